package overlay

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"math/bits"
)

// The dirty bitmap lives in its own file beside the overlay (overlay path +
// ".dirty"): a fixed header in the first headerRegion bytes, then the
// bitmap, one bit per block in little-endian 64-bit words, bit i of word w
// standing for block 64*w+i. Bits only ever go from 0 to 1.
//
// Version 2 stores the words in pages of bitmapPageSize bytes, pageWords
// words each, every page closed by a trailer that carries its index and a
// CRC-32C, so a flipped bit (which would read a written block as base
// data) or a page written to the wrong place is caught on open. A page is
// written in one aligned write; a kill -9 cannot tear it (a page of the
// page cache is copied whole), a power cut on a disk without atomic 4 KiB
// writes can, and is then reported as corruption, never repaired by
// guessing. Version 1 (one contiguous run of words, no checksums) is read
// and converted to version 2 on the first read-write open.
//
// Header layout (all little-endian):
//
//	0   magic        [8]byte "KFSXCOW1"
//	8   version      uint32  (2; 1 is converted)
//	12  block size   uint32  (power of two, minBlockSize..maxBlockSize)
//	16  disk size    uint64  (bytes, multiple of 512)
//	24  bitmap off   uint64  (headerRegion)
//	32  bitmap len   uint64  (bytes of bits: 8 * ceil(blocks/64))
//	40  flags        uint32  (0; unknown flags are refused)
//	44  crc32c       uint32  (Castagnoli, of bytes 0..44)
//
// Page layout (version 2), page i at bitmap off + i*bitmapPageSize:
//
//	0     words       [pageWords]uint64 (the last page is zero-padded)
//	4080  reserved    uint64  (0)
//	4088  page index  uint32  (i)
//	4092  crc32c      uint32  (Castagnoli, of bytes 0..4092)
const (
	headerLen     = 48
	headerRegion  = 4096
	headerVersion = 2
	minBlockSize  = 512
	maxBlockSize  = 1 << 20
	// maxDiskSize bounds the disk so the bitmap (size/blockSize/8 bytes)
	// stays reasonable to hold in memory: 1 PiB at 512-byte blocks is 256 GiB
	// of bitmap, so the limit is applied together with maxBitmapLen.
	maxDiskSize  = 1 << 50
	maxBitmapLen = 1 << 30

	// bitmapPageSize is the unit a version-2 bitmap is checked and
	// rewritten in: one page of the page cache, written in one piece.
	bitmapPageSize = 4096
	pageTrailer    = 16
	// pageWords is how many bitmap words one page holds.
	pageWords = (bitmapPageSize - pageTrailer) / 8
)

var headerMagic = [8]byte{'K', 'F', 'S', 'X', 'C', 'O', 'W', '1'}

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// ErrCorrupt reports a bitmap file whose header or contents cannot be trusted.
var ErrCorrupt = errors.New("overlay: corrupt dirty bitmap")

// ErrMismatch reports an existing overlay made for a different disk size or block size.
var ErrMismatch = errors.New("overlay: existing overlay does not match this disk")

// header is the decoded bitmap-file header.
type header struct {
	version   uint32
	blockSize uint32
	diskSize  uint64
	bitmapOff uint64
	bitmapLen uint64
}

// bitmapBytes returns the bitmap length for a disk, or false if it overflows the limits.
func bitmapBytes(diskSize uint64, blockSize uint32) (uint64, bool) {
	if blockSize == 0 {
		return 0, false
	}
	blocks := diskSize / uint64(blockSize)
	if diskSize%uint64(blockSize) != 0 {
		blocks++
	}
	words := blocks / 64
	if blocks%64 != 0 {
		words++
	}
	hi, n := bits.Mul64(words, 8)
	if hi != 0 || n > maxBitmapLen {
		return 0, false
	}
	return n, true
}

func validGeometry(diskSize uint64, blockSize uint32) error {
	if blockSize < minBlockSize || blockSize > maxBlockSize || blockSize&(blockSize-1) != 0 {
		return fmt.Errorf("block size %d is not a power of two in [%d, %d]", blockSize, minBlockSize, maxBlockSize)
	}
	if diskSize == 0 || diskSize > maxDiskSize || diskSize%512 != 0 {
		return fmt.Errorf("disk size %d is not a nonzero multiple of 512 up to %d", diskSize, uint64(maxDiskSize))
	}
	if _, ok := bitmapBytes(diskSize, blockSize); !ok {
		return fmt.Errorf("disk size %d with block size %d needs a bitmap larger than %d bytes", diskSize, blockSize, maxBitmapLen)
	}
	return nil
}

func newHeader(diskSize uint64, blockSize uint32) (header, error) {
	if err := validGeometry(diskSize, blockSize); err != nil {
		return header{}, err
	}
	n, _ := bitmapBytes(diskSize, blockSize)
	return header{version: headerVersion, blockSize: blockSize, diskSize: diskSize, bitmapOff: headerRegion, bitmapLen: n}, nil
}

// encode writes the header into b, which must hold headerLen bytes.
func (h header) encode(b []byte) {
	b = b[:headerLen]
	clear(b)
	copy(b[0:8], headerMagic[:])
	binary.LittleEndian.PutUint32(b[8:12], h.version)
	binary.LittleEndian.PutUint32(b[12:16], h.blockSize)
	binary.LittleEndian.PutUint64(b[16:24], h.diskSize)
	binary.LittleEndian.PutUint64(b[24:32], h.bitmapOff)
	binary.LittleEndian.PutUint64(b[32:40], h.bitmapLen)
	binary.LittleEndian.PutUint32(b[40:44], 0)
	binary.LittleEndian.PutUint32(b[44:48], crc32.Checksum(b[:44], castagnoli))
}

// decodeHeader parses and validates a bitmap-file header; every field read
// from disk is checked before use.
func decodeHeader(b []byte) (header, error) {
	if len(b) < headerLen {
		return header{}, fmt.Errorf("%w: header is %d bytes, want %d", ErrCorrupt, len(b), headerLen)
	}
	if [8]byte(b[0:8]) != headerMagic {
		return header{}, fmt.Errorf("%w: bad magic %q", ErrCorrupt, b[0:8])
	}
	if sum, want := crc32.Checksum(b[:44], castagnoli), binary.LittleEndian.Uint32(b[44:48]); sum != want {
		return header{}, fmt.Errorf("%w: header checksum %#x, stored %#x", ErrCorrupt, sum, want)
	}
	v := binary.LittleEndian.Uint32(b[8:12])
	if v != 1 && v != headerVersion {
		return header{}, fmt.Errorf("%w: format version %d, this build reads versions 1 and %d (was it written by a newer kata-fsx?)", ErrCorrupt, v, headerVersion)
	}
	if f := binary.LittleEndian.Uint32(b[40:44]); f != 0 {
		return header{}, fmt.Errorf("%w: unknown flags %#x", ErrCorrupt, f)
	}
	h := header{
		version:   v,
		blockSize: binary.LittleEndian.Uint32(b[12:16]),
		diskSize:  binary.LittleEndian.Uint64(b[16:24]),
		bitmapOff: binary.LittleEndian.Uint64(b[24:32]),
		bitmapLen: binary.LittleEndian.Uint64(b[32:40]),
	}
	if err := validGeometry(h.diskSize, h.blockSize); err != nil {
		return header{}, fmt.Errorf("%w: %w", ErrCorrupt, err)
	}
	if h.bitmapOff != headerRegion {
		return header{}, fmt.Errorf("%w: bitmap offset %d, want %d", ErrCorrupt, h.bitmapOff, headerRegion)
	}
	if want, _ := bitmapBytes(h.diskSize, h.blockSize); h.bitmapLen != want {
		return header{}, fmt.Errorf("%w: bitmap length %d, want %d", ErrCorrupt, h.bitmapLen, want)
	}
	return h, nil
}

// bitmapPages returns how many version-2 pages hold nwords bitmap words.
func bitmapPages(nwords uint64) uint64 { return (nwords + pageWords - 1) / pageWords }

// encodePage fills b (bitmapPageSize bytes) with page idx: words (at most
// pageWords, zero-padded) and the trailer.
func encodePage(b []byte, idx uint32, words []uint64) {
	b = b[:bitmapPageSize]
	clear(b)
	for i, w := range words {
		binary.LittleEndian.PutUint64(b[8*i:], w)
	}
	binary.LittleEndian.PutUint32(b[bitmapPageSize-8:], idx)
	binary.LittleEndian.PutUint32(b[bitmapPageSize-4:], crc32.Checksum(b[:bitmapPageSize-4], castagnoli))
}

// checkPage verifies the trailer of page idx held in b.
func checkPage(b []byte, idx uint32) error {
	b = b[:bitmapPageSize]
	if sum, want := crc32.Checksum(b[:bitmapPageSize-4], castagnoli), binary.LittleEndian.Uint32(b[bitmapPageSize-4:]); sum != want {
		return fmt.Errorf("checksum %#x, stored %#x", sum, want)
	}
	if got := binary.LittleEndian.Uint32(b[bitmapPageSize-8:]); got != idx {
		return fmt.Errorf("holds page %d", got)
	}
	if r := binary.LittleEndian.Uint64(b[pageWords*8:]); r != 0 {
		return fmt.Errorf("reserved trailer field %#x", r)
	}
	return nil
}
