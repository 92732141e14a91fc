package index

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"io"
	"math"
)

// Encoded index layout (all integers little-endian or unsigned varints):
//
//	header (32 bytes): magic "KFSXIDX\n", version u32, flags u32,
//	                   payload length u64, CRC-32C of payload u32, zero u32
//	payload:           sources, entries (see encodeEntry)
//
// Paths are stored as the length of the prefix shared with the previous
// path plus the remaining bytes, which keeps sorted trees compact.
const (
	encMagic      = "KFSXIDX\n"
	encVersion    = 1
	encHeaderSize = 32

	// flagLayer marks a per-layer index (whiteouts and overlay markers kept).
	flagLayer = 1

	// MaxEncodedSize bounds the payload Decode accepts.
	MaxEncodedSize = 1 << 32

	// minEncodedEntry is the fewest bytes one encoded entry takes; it bounds
	// counts read from the payload before anything is allocated for them.
	minEncodedEntry = 14
)

// Per-entry presence flags.
const (
	efLinkname = 1 << iota
	efDev
	efXattrs
	efData
	efDataPathIsPath
	efSegments
	efAtimeIsMtime
	efCtimeIsMtime
	efIno = 1 << 8
	efAll = efIno<<1 - 1
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// Encode writes ix in the versioned binary index format.
func Encode(w io.Writer, ix *Index) error {
	return encode(w, ix, 0)
}

func encode(w io.Writer, ix *Index, flags uint32) error {
	var b []byte
	b = binary.AppendUvarint(b, uint64(len(ix.Sources)))
	for _, s := range ix.Sources {
		b = append(b, byte(s.Kind))
		b = appendString(b, s.ID)
	}
	b = binary.AppendUvarint(b, uint64(len(ix.Entries)))
	prev := ""
	for i := range ix.Entries {
		b = encodeEntry(b, &ix.Entries[i], prev)
		prev = ix.Entries[i].Path
	}
	hdr := make([]byte, encHeaderSize)
	copy(hdr, encMagic)
	binary.LittleEndian.PutUint32(hdr[8:], encVersion)
	binary.LittleEndian.PutUint32(hdr[12:], flags)
	binary.LittleEndian.PutUint64(hdr[16:], uint64(len(b)))
	binary.LittleEndian.PutUint32(hdr[24:], crc32.Checksum(b, castagnoli))
	if _, err := w.Write(hdr); err != nil {
		return fmt.Errorf("write index header: %w", err)
	}
	if _, err := w.Write(b); err != nil {
		return fmt.Errorf("write index: %w", err)
	}
	return nil
}

func appendString(b []byte, s string) []byte {
	b = binary.AppendUvarint(b, uint64(len(s)))
	return append(b, s...)
}

func appendTime(b []byte, t Timespec) []byte {
	b = binary.AppendVarint(b, t.Sec)
	return binary.AppendUvarint(b, uint64(t.Nsec))
}

func encodeEntry(b []byte, e *Entry, prev string) []byte {
	var f uint64
	if e.Linkname != "" {
		f |= efLinkname
	}
	if e.Devmajor != 0 || e.Devminor != 0 {
		f |= efDev
	}
	if len(e.Xattrs) > 0 {
		f |= efXattrs
	}
	if !e.Data.isZero() {
		f |= efData
		if e.Data.Path == e.Path {
			f |= efDataPathIsPath
		}
		if e.Data.Segments != nil {
			f |= efSegments
		}
	}
	if e.Atime == e.Mtime {
		f |= efAtimeIsMtime
	}
	if e.Ctime == e.Mtime {
		f |= efCtimeIsMtime
	}
	if e.Ino != 0 {
		f |= efIno
	}
	n := 0
	for n < len(prev) && n < len(e.Path) && prev[n] == e.Path[n] {
		n++
	}
	b = binary.AppendUvarint(b, uint64(n))
	b = appendString(b, e.Path[n:])
	b = append(b, byte(e.Type))
	b = binary.AppendUvarint(b, f)
	b = binary.AppendUvarint(b, uint64(e.Mode))
	b = binary.AppendUvarint(b, uint64(e.UID))
	b = binary.AppendUvarint(b, uint64(e.GID))
	b = appendTime(b, e.Mtime)
	if f&efAtimeIsMtime == 0 {
		b = appendTime(b, e.Atime)
	}
	if f&efCtimeIsMtime == 0 {
		b = appendTime(b, e.Ctime)
	}
	b = binary.AppendUvarint(b, uint64(e.Size))
	if f&efLinkname != 0 {
		b = appendString(b, e.Linkname)
	}
	if f&efDev != 0 {
		b = binary.AppendUvarint(b, uint64(e.Devmajor))
		b = binary.AppendUvarint(b, uint64(e.Devminor))
	}
	if f&efXattrs != 0 {
		b = binary.AppendUvarint(b, uint64(len(e.Xattrs)))
		for _, x := range e.Xattrs {
			b = appendString(b, x.Name)
			b = binary.AppendUvarint(b, uint64(len(x.Value)))
			b = append(b, x.Value...)
		}
	}
	if f&efData != 0 {
		b = binary.AppendUvarint(b, uint64(e.Data.Source))
		if f&efDataPathIsPath == 0 {
			b = appendString(b, e.Data.Path)
		}
		b = binary.AppendUvarint(b, uint64(e.Data.Offset))
		if f&efSegments != 0 {
			b = binary.AppendUvarint(b, uint64(len(e.Data.Segments)))
			for _, r := range e.Data.Segments {
				b = binary.AppendUvarint(b, uint64(r.Off))
				b = binary.AppendUvarint(b, uint64(r.Len))
			}
		}
	}
	if f&efIno != 0 {
		b = binary.AppendUvarint(b, uint64(e.Ino))
	}
	return b
}

// Decode reads an index written by Encode. The input is treated as hostile:
// sizes and counts are checked against the bytes actually present before
// anything is allocated for them, and the result passes Validate.
func Decode(r io.Reader) (*Index, error) {
	ix, flags, err := decode(r)
	if err != nil {
		return nil, err
	}
	if flags&flagLayer != 0 {
		// Per-layer indexes live only in the layer cache.
		return nil, invalidf("decode index: a per-layer cache index, not a merged index")
	}
	if err := ix.validate(false); err != nil {
		return nil, fmt.Errorf("decode index: %w", err)
	}
	return ix, nil
}

func decode(r io.Reader) (*Index, uint32, error) {
	var hdr [encHeaderSize]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return nil, 0, fmt.Errorf("decode index header: %w", err)
	}
	if string(hdr[:8]) != encMagic {
		return nil, 0, invalidf("decode index: bad magic")
	}
	if v := binary.LittleEndian.Uint32(hdr[8:]); v != encVersion {
		return nil, 0, invalidf("decode index: unsupported version %d", v)
	}
	flags := binary.LittleEndian.Uint32(hdr[12:])
	if flags&^flagLayer != 0 || binary.LittleEndian.Uint32(hdr[28:]) != 0 {
		return nil, 0, invalidf("decode index: unknown flags %#x", flags)
	}
	n := binary.LittleEndian.Uint64(hdr[16:])
	if n > MaxEncodedSize {
		return nil, 0, invalidf("decode index: payload of %d bytes exceeds %d", n, uint64(MaxEncodedSize))
	}
	// Grow with the data actually read rather than trusting n up front.
	var buf bytes.Buffer
	if _, err := buf.ReadFrom(io.LimitReader(r, int64(n))); err != nil {
		return nil, 0, fmt.Errorf("decode index: %w", err)
	}
	b := buf.Bytes()
	if uint64(len(b)) != n {
		return nil, 0, invalidf("decode index: truncated payload (%d of %d bytes)", len(b), n)
	}
	if crc32.Checksum(b, castagnoli) != binary.LittleEndian.Uint32(hdr[24:]) {
		return nil, 0, invalidf("decode index: checksum mismatch")
	}
	d := decoder{b: b}
	ix, err := d.index()
	if err != nil {
		return nil, 0, fmt.Errorf("decode index at byte %d: %w", d.off, err)
	}
	return ix, flags, nil
}

type decoder struct {
	b   []byte
	off int
}

func (d *decoder) uvarint() (uint64, error) {
	v, n := binary.Uvarint(d.b[d.off:])
	if n <= 0 {
		return 0, invalidf("bad varint")
	}
	d.off += n
	return v, nil
}

func (d *decoder) varint() (int64, error) {
	v, n := binary.Varint(d.b[d.off:])
	if n <= 0 {
		return 0, invalidf("bad varint")
	}
	d.off += n
	return v, nil
}

// u32 reads a uvarint that must fit 32 bits.
func (d *decoder) u32(what string) (uint32, error) {
	v, err := d.uvarint()
	if err != nil {
		return 0, err
	}
	if v > math.MaxUint32 {
		return 0, invalidf("%s %d out of range", what, v)
	}
	return uint32(v), nil
}

func (d *decoder) i64(what string) (int64, error) {
	v, err := d.uvarint()
	if err != nil {
		return 0, err
	}
	if v > maxInt64 {
		return 0, invalidf("%s %d out of range", what, v)
	}
	return int64(v), nil
}

// count reads a count whose items take at least min bytes each.
func (d *decoder) count(what string, min int) (int, error) {
	v, err := d.uvarint()
	if err != nil {
		return 0, err
	}
	if v > uint64(len(d.b)-d.off)/uint64(min) {
		return 0, invalidf("%s count %d exceeds the remaining data", what, v)
	}
	return int(v), nil
}

func (d *decoder) bytes(max int) ([]byte, error) {
	v, err := d.uvarint()
	if err != nil {
		return nil, err
	}
	if v > uint64(max) || v > uint64(len(d.b)-d.off) {
		return nil, invalidf("string of %d bytes too long or truncated", v)
	}
	s := d.b[d.off : d.off+int(v)]
	d.off += int(v)
	return s, nil
}

func (d *decoder) string(max int) (string, error) {
	b, err := d.bytes(max)
	return string(b), err
}

func (d *decoder) byte() (byte, error) {
	if d.off >= len(d.b) {
		return 0, invalidf("truncated")
	}
	c := d.b[d.off]
	d.off++
	return c, nil
}

func (d *decoder) time() (Timespec, error) {
	s, err := d.varint()
	if err != nil {
		return Timespec{}, err
	}
	ns, err := d.u32("nanoseconds")
	if err != nil {
		return Timespec{}, err
	}
	return Timespec{Sec: s, Nsec: ns}, nil
}

func (d *decoder) index() (*Index, error) {
	ix := &Index{}
	ns, err := d.count("source", 2)
	if err != nil {
		return nil, err
	}
	ix.Sources = make([]Source, 0, ns)
	for range ns {
		k, err := d.byte()
		if err != nil {
			return nil, err
		}
		id, err := d.string(MaxPathLen + 64)
		if err != nil {
			return nil, err
		}
		ix.Sources = append(ix.Sources, Source{Kind: SourceKind(k), ID: id})
	}
	ne, err := d.count("entry", minEncodedEntry)
	if err != nil {
		return nil, err
	}
	// count bounded ne by the bytes actually read, so this allocation is
	// proportional to the input, not to a claimed length.
	ix.Entries = make([]Entry, 0, min(ne, 1<<22))
	prev := ""
	for range ne {
		var e Entry
		if err := d.entry(&e, prev); err != nil {
			return nil, fmt.Errorf("entry %d after %q: %w", len(ix.Entries), trunc(prev), err)
		}
		ix.Entries = append(ix.Entries, e)
		prev = e.Path
	}
	if d.off != len(d.b) {
		return nil, invalidf("%d trailing bytes", len(d.b)-d.off)
	}
	return ix, nil
}

func (d *decoder) entry(e *Entry, prev string) error {
	shared, err := d.uvarint()
	if err != nil {
		return err
	}
	if shared > uint64(len(prev)) {
		return invalidf("shared prefix %d longer than previous path", shared)
	}
	suffix, err := d.bytes(MaxPathLen)
	if err != nil {
		return err
	}
	if int(shared)+len(suffix) > MaxPathLen {
		return invalidf("path too long")
	}
	e.Path = prev[:shared] + string(suffix)
	t, err := d.byte()
	if err != nil {
		return err
	}
	e.Type = Type(t)
	f, err := d.uvarint()
	if err != nil {
		return err
	}
	if f&^efAll != 0 {
		return invalidf("unknown entry flags %#x", f)
	}
	if e.Mode, err = d.u32("mode"); err != nil {
		return err
	}
	if e.UID, err = d.u32("uid"); err != nil {
		return err
	}
	if e.GID, err = d.u32("gid"); err != nil {
		return err
	}
	if e.Mtime, err = d.time(); err != nil {
		return err
	}
	e.Atime, e.Ctime = e.Mtime, e.Mtime
	if f&efAtimeIsMtime == 0 {
		if e.Atime, err = d.time(); err != nil {
			return err
		}
	}
	if f&efCtimeIsMtime == 0 {
		if e.Ctime, err = d.time(); err != nil {
			return err
		}
	}
	if e.Size, err = d.i64("size"); err != nil {
		return err
	}
	if f&efLinkname != 0 {
		if e.Linkname, err = d.string(MaxPathLen); err != nil {
			return err
		}
	}
	if f&efDev != 0 {
		if e.Devmajor, err = d.u32("major"); err != nil {
			return err
		}
		if e.Devminor, err = d.u32("minor"); err != nil {
			return err
		}
	}
	if f&efXattrs != 0 {
		n, err := d.count("xattr", 2)
		if err != nil {
			return err
		}
		e.Xattrs = make([]Xattr, n)
		for i := range e.Xattrs {
			if e.Xattrs[i].Name, err = d.string(MaxXattrNameLen); err != nil {
				return err
			}
			v, err := d.bytes(MaxXattrSize)
			if err != nil {
				return err
			}
			e.Xattrs[i].Value = bytes.Clone(v)
			if e.Xattrs[i].Value == nil {
				e.Xattrs[i].Value = []byte{}
			}
		}
	}
	if f&efData != 0 {
		if e.Data.Source, err = d.u32("source"); err != nil {
			return err
		}
		if f&efDataPathIsPath != 0 {
			e.Data.Path = e.Path
		} else if e.Data.Path, err = d.string(MaxPathLen); err != nil {
			return err
		}
		if e.Data.Offset, err = d.i64("offset"); err != nil {
			return err
		}
		if f&efSegments != 0 {
			n, err := d.count("segment", 2)
			if err != nil {
				return err
			}
			e.Data.Segments = make([]Range, n)
			for i := range e.Data.Segments {
				if e.Data.Segments[i].Off, err = d.i64("segment offset"); err != nil {
					return err
				}
				if e.Data.Segments[i].Len, err = d.i64("segment length"); err != nil {
					return err
				}
			}
		}
	} else if f&(efDataPathIsPath|efSegments) != 0 {
		return invalidf("data flags without data")
	}
	if f&efIno != 0 {
		if e.Ino, err = d.u32("inode"); err != nil {
			return err
		}
		if e.Ino == 0 {
			return invalidf("zero inode flagged")
		}
	}
	return nil
}
