package main

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
)

// The layout of Kata's guest image (tools/osbuilder/image-builder/image_builder.sh):
//
//	0         MBR #1: one partition at 3 MiB, read by virtio-blk and by kernels without DAX
//	4 KiB     nd_pfn info block: the nvdimm namespace's data starts at 2 MiB
//	2 MiB     MBR #2: one partition at 1 MiB of the pfn device, i.e. 3 MiB of the file
//	3 MiB     the ext4 filesystem, to the end of the file
//
// With the info block the guest's nvdimm driver puts a pfn device over the
// namespace (pmem0 then starts at 2 MiB and supports DAX); both tables name
// the same filesystem, so root=/dev/pmem0p1 and root=/dev/vda1 both find it.
const (
	mib = 1 << 20
	// daxHeaderSize is the room before MBR #2: MBR #1 and the info block.
	daxHeaderSize = 2 * mib
	// daxAlignment is the pfn mapping's alignment (2 MiB huge pages).
	daxAlignment = 2 * mib
	// FSOffset is where the filesystem starts in the file.
	FSOffset = 3 * mib
	// partOffset is where the partition starts in the device MBR #2 describes.
	partOffset = FSOffset - daxHeaderSize
	sectorSize = 512
	// pfnInfoOffset is where the nvdimm driver reads the info block.
	pfnInfoOffset = 4096
	pfnInfoSize   = 4096
	// pfnModeRAM keeps the struct pages in guest RAM (PFN_MODE_RAM), as Kata's nsdax does.
	pfnModeRAM = 1
	// ext4 superblock magic, at byte 1024+56 of the filesystem.
	ext4Magic       = 0xEF53
	ext4MagicOffset = 1024 + 56
	partTypeLinux   = 0x83
)

// mbr returns a DOS partition table with one Linux partition from start to
// the end of a device of size bytes.
func mbr(start, size int64) ([sectorSize]byte, error) {
	var b [sectorSize]byte
	if start%sectorSize != 0 || size%sectorSize != 0 || start >= size {
		return b, fmt.Errorf("partition at %d of a %d-byte device: want sector-aligned, start below size", start, size)
	}
	first, count := start/sectorSize, (size-start)/sectorSize
	if size/sectorSize > 1<<32-1 {
		return b, fmt.Errorf("device of %d bytes is too big for an MBR", size)
	}
	e := b[446:462]
	e[0] = 0x00 // not bootable: the kernel is booted directly
	// CHS fields say "use LBA" (the maximum), as partitioners do past 8 GiB;
	// Linux reads only the LBA fields.
	copy(e[1:4], []byte{0xfe, 0xff, 0xff})
	e[4] = partTypeLinux
	copy(e[5:8], []byte{0xfe, 0xff, 0xff})
	binary.LittleEndian.PutUint32(e[8:12], uint32(first))
	binary.LittleEndian.PutUint32(e[12:16], uint32(count))
	b[510], b[511] = 0x55, 0xaa
	return b, nil
}

// pfnInfo returns the nvdimm pfn info block (struct nd_pfn_sb, version 0.2)
// saying the namespace's data starts at dataOff, mapped with align.
func pfnInfo(dataOff, align uint64) [pfnInfoSize]byte {
	var b [pfnInfoSize]byte
	copy(b[0:16], "NVDIMM_PFN_INFO\x00")
	// uuid (16..32) and parent_uuid (32..48) stay zero: a label-less
	// namespace's uuid is null, which the driver accepts as the parent.
	binary.LittleEndian.PutUint16(b[54:56], 2) // version_minor: has start_pad, end_trunc, align
	binary.LittleEndian.PutUint64(b[56:64], dataOff)
	binary.LittleEndian.PutUint32(b[72:76], pfnModeRAM)
	binary.LittleEndian.PutUint32(b[84:88], uint32(align))
	binary.LittleEndian.PutUint64(b[pfnInfoSize-8:], fletcher64(b[:]))
	return b
}

// fletcher64 is the nvdimm driver's nd_fletcher64 over little-endian
// 32-bit words, with the checksum field (the last 8 bytes) taken as zero.
func fletcher64(b []byte) uint64 {
	var lo uint32
	var hi uint64
	for i := 0; i+4 <= len(b); i += 4 {
		if i < len(b)-8 {
			lo += binary.LittleEndian.Uint32(b[i:])
		}
		hi += uint64(lo)
	}
	return hi<<32 | uint64(lo)
}

// writeLayout writes both partition tables and the info block into img,
// which already holds an ext4 filesystem at FSOffset running to its end.
func writeLayout(img *os.File) error {
	st, err := img.Stat()
	if err != nil {
		return err
	}
	size := st.Size()
	if size%daxAlignment != 0 || size <= FSOffset {
		return fmt.Errorf("%s: %d bytes: want a multiple of %d beyond %d", img.Name(), size, daxAlignment, FSOffset)
	}
	var magic [2]byte
	if _, err := img.ReadAt(magic[:], FSOffset+ext4MagicOffset); err != nil {
		return fmt.Errorf("%s: read the superblock: %w", img.Name(), err)
	}
	if binary.LittleEndian.Uint16(magic[:]) != ext4Magic {
		return fmt.Errorf("%s: no ext4 filesystem at %d", img.Name(), FSOffset)
	}
	// The first 3 MiB must be free for the tables: an earlier run's are overwritten.
	if err := zeroRange(img, 0, FSOffset); err != nil {
		return err
	}
	outer, err := mbr(FSOffset, size)
	if err != nil {
		return err
	}
	inner, err := mbr(partOffset, size-daxHeaderSize)
	if err != nil {
		return err
	}
	info := pfnInfo(daxHeaderSize, daxAlignment)
	for _, w := range []struct {
		off  int64
		data []byte
	}{{0, outer[:]}, {pfnInfoOffset, info[:]}, {daxHeaderSize, inner[:]}} {
		if _, err := img.WriteAt(w.data, w.off); err != nil {
			return fmt.Errorf("%s: write at %d: %w", img.Name(), w.off, err)
		}
	}
	return img.Sync()
}

func zeroRange(f *os.File, off, n int64) error {
	_, err := f.WriteAt(make([]byte, n), off)
	return err
}

// errShort is returned by checkLayout for an image too small to hold the layout.
var errShort = errors.New("image shorter than its header")

// checkLayout reads back what writeLayout wrote: both tables point at the
// ext4 filesystem and the info block is intact.
func checkLayout(r io.ReaderAt, size int64) error {
	head := make([]byte, FSOffset+ext4MagicOffset+2)
	if _, err := r.ReadAt(head, 0); err != nil {
		return fmt.Errorf("%w: %v", errShort, err)
	}
	for _, t := range []struct {
		name     string
		at, base int64
	}{{"MBR #1", 0, 0}, {"MBR #2", daxHeaderSize, daxHeaderSize}} {
		b := head[t.at : t.at+sectorSize]
		if b[510] != 0x55 || b[511] != 0xaa || b[446+4] != partTypeLinux {
			return fmt.Errorf("%s: no DOS table with a Linux partition", t.name)
		}
		start := t.base + int64(binary.LittleEndian.Uint32(b[446+8:]))*sectorSize
		end := start + int64(binary.LittleEndian.Uint32(b[446+12:]))*sectorSize
		if start != FSOffset || end != size {
			return fmt.Errorf("%s: partition spans [%d, %d) of the file, want [%d, %d)", t.name, start, end, FSOffset, size)
		}
	}
	info := head[pfnInfoOffset : pfnInfoOffset+pfnInfoSize]
	if string(info[:15]) != "NVDIMM_PFN_INFO" || binary.LittleEndian.Uint64(info[pfnInfoSize-8:]) != fletcher64(info) {
		return errors.New("nd_pfn info block: bad signature or checksum")
	}
	if binary.LittleEndian.Uint16(head[FSOffset+ext4MagicOffset:]) != ext4Magic {
		return errors.New("no ext4 superblock at the partition")
	}
	return nil
}
