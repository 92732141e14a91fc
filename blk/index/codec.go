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
	// An entry with every field zero and atime = ctime = mtime takes
	// prefix length, name length, one name byte, type, flags, mode, uid,
	// gid, mtime seconds and nanoseconds, size: one byte each.
	minEncodedEntry = 11
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
		return nil, Invalidf("decode index: a per-layer cache index, not a merged index")
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
		return nil, 0, Invalidf("decode index: bad magic")
	}
	if v := binary.LittleEndian.Uint32(hdr[8:]); v != encVersion {
		return nil, 0, Invalidf("decode index: unsupported version %d", v)
	}
	flags := binary.LittleEndian.Uint32(hdr[12:])
	if flags&^flagLayer != 0 || binary.LittleEndian.Uint32(hdr[28:]) != 0 {
		return nil, 0, Invalidf("decode index: unknown flags %#x", flags)
	}
	n := binary.LittleEndian.Uint64(hdr[16:])
	if n > MaxEncodedSize {
		return nil, 0, Invalidf("decode index: payload of %d bytes exceeds %d", n, uint64(MaxEncodedSize))
	}
	// Grow with the data actually read rather than trusting n up front.
	var buf bytes.Buffer
	if _, err := buf.ReadFrom(io.LimitReader(r, int64(n))); err != nil {
		return nil, 0, fmt.Errorf("decode index: %w", err)
	}
	b := buf.Bytes()
	if uint64(len(b)) != n {
		return nil, 0, Invalidf("decode index: truncated payload (%d of %d bytes)", len(b), n)
	}
	if crc32.Checksum(b, castagnoli) != binary.LittleEndian.Uint32(hdr[24:]) {
		return nil, 0, Invalidf("decode index: checksum mismatch")
	}
	d := decoder{b: b}
	ix := d.index()
	if d.err != nil {
		return nil, 0, fmt.Errorf("decode index at byte %d: %w", d.off, d.err)
	}
	return ix, flags, nil
}

// decoder reads a payload with a sticky error, like archive/tar's reader:
// the first failure is kept in err and every later read returns a zero
// value without moving off. A record is therefore read straight through and
// checked once, off still points at the failure, and the zero values read
// after it only ever size empty allocations.
type decoder struct {
	b   []byte
	off int
	err error
}

// fail records err unless an earlier failure is already recorded.
func (d *decoder) fail(err error) {
	if d.err == nil {
		d.err = err
	}
}

func (d *decoder) uvarint() uint64 {
	if d.err != nil {
		return 0
	}
	v, n := binary.Uvarint(d.b[d.off:])
	if n <= 0 {
		d.fail(Invalidf("bad varint"))
		return 0
	}
	d.off += n
	return v
}

func (d *decoder) varint() int64 {
	if d.err != nil {
		return 0
	}
	v, n := binary.Varint(d.b[d.off:])
	if n <= 0 {
		d.fail(Invalidf("bad varint"))
		return 0
	}
	d.off += n
	return v
}

// u32 reads a uvarint that must fit 32 bits; what names the field in the
// error.
func (d *decoder) u32(what string) uint32 {
	v := d.uvarint()
	if v > math.MaxUint32 {
		d.fail(Invalidf("%s %d out of range", what, v))
		return 0
	}
	return uint32(v)
}

// i64 reads a uvarint that must fit a non-negative int64.
func (d *decoder) i64(what string) int64 {
	v := d.uvarint()
	if v > maxInt64 {
		d.fail(Invalidf("%s %d out of range", what, v))
		return 0
	}
	return int64(v)
}

// count reads a count whose items take at least min bytes each, so that it
// can never exceed what the remaining data could hold.
func (d *decoder) count(what string, min int) int {
	v := d.uvarint()
	if v > uint64(len(d.b)-d.off)/uint64(min) {
		d.fail(Invalidf("%s count %d exceeds the remaining data", what, v))
		return 0
	}
	return int(v)
}

// bytes reads a length-prefixed byte string of at most max bytes; the
// result aliases the payload.
func (d *decoder) bytes(max int) []byte {
	v := d.uvarint()
	if d.err != nil {
		return nil
	}
	if v > uint64(max) || v > uint64(len(d.b)-d.off) {
		d.fail(Invalidf("string of %d bytes too long or truncated", v))
		return nil
	}
	s := d.b[d.off : d.off+int(v)]
	d.off += int(v)
	return s
}

func (d *decoder) string(max int) string {
	return string(d.bytes(max))
}

func (d *decoder) byte() byte {
	if d.err != nil {
		return 0
	}
	if d.off >= len(d.b) {
		d.fail(Invalidf("truncated"))
		return 0
	}
	c := d.b[d.off]
	d.off++
	return c
}

func (d *decoder) time() Timespec {
	s := d.varint()
	ns := d.u32("nanoseconds")
	return Timespec{Sec: s, Nsec: ns}
}

// index reads the payload; failures are left in d.err.
func (d *decoder) index() *Index {
	ix := &Index{}
	ns := d.count("source", 2)
	ix.Sources = make([]Source, 0, ns)
	for range ns {
		k := d.byte()
		id := d.string(MaxPathLen + 64)
		ix.Sources = append(ix.Sources, Source{Kind: SourceKind(k), ID: id})
	}
	ne := d.count("entry", minEncodedEntry)
	if d.err != nil {
		return nil
	}
	// count bounded ne by the bytes actually read, so this allocation is
	// proportional to the input, not to a claimed length.
	ix.Entries = make([]Entry, 0, min(ne, 1<<22))
	prev := ""
	for range ne {
		var e Entry
		d.entry(&e, prev)
		if d.err != nil {
			d.err = fmt.Errorf("entry %d after %q: %w", len(ix.Entries), Trunc(prev), d.err)
			return nil
		}
		ix.Entries = append(ix.Entries, e)
		prev = e.Path
	}
	if d.off != len(d.b) {
		d.fail(Invalidf("%d trailing bytes", len(d.b)-d.off))
		return nil
	}
	return ix
}

// entry reads one entry whose path shares a prefix with prev.
func (d *decoder) entry(e *Entry, prev string) {
	shared := d.uvarint()
	if shared > uint64(len(prev)) {
		d.fail(Invalidf("shared prefix %d longer than previous path", shared))
		return
	}
	suffix := d.bytes(MaxPathLen)
	if int(shared)+len(suffix) > MaxPathLen {
		d.fail(Invalidf("path too long"))
		return
	}
	e.Path = prev[:shared] + string(suffix)
	e.Type = Type(d.byte())
	f := d.uvarint()
	if f&^efAll != 0 {
		d.fail(Invalidf("unknown entry flags %#x", f))
		return
	}
	e.Mode = d.u32("mode")
	e.UID = d.u32("uid")
	e.GID = d.u32("gid")
	e.Mtime = d.time()
	e.Atime, e.Ctime = e.Mtime, e.Mtime
	if f&efAtimeIsMtime == 0 {
		e.Atime = d.time()
	}
	if f&efCtimeIsMtime == 0 {
		e.Ctime = d.time()
	}
	e.Size = d.i64("size")
	if f&efLinkname != 0 {
		e.Linkname = d.string(MaxPathLen)
	}
	if f&efDev != 0 {
		e.Devmajor = d.u32("major")
		e.Devminor = d.u32("minor")
	}
	if f&efXattrs != 0 {
		e.Xattrs = make([]Xattr, d.count("xattr", 2))
		for i := range e.Xattrs {
			e.Xattrs[i].Name = d.string(MaxXattrNameLen)
			// Cloned so the index does not pin the whole payload.
			e.Xattrs[i].Value = bytes.Clone(d.bytes(MaxXattrSize))
			if e.Xattrs[i].Value == nil {
				e.Xattrs[i].Value = []byte{}
			}
		}
	}
	if f&efData != 0 {
		e.Data.Source = d.u32("source")
		if f&efDataPathIsPath != 0 {
			e.Data.Path = e.Path
		} else {
			e.Data.Path = d.string(MaxPathLen)
		}
		e.Data.Offset = d.i64("offset")
		if f&efSegments != 0 {
			e.Data.Segments = make([]Range, d.count("segment", 2))
			for i := range e.Data.Segments {
				e.Data.Segments[i].Off = d.i64("segment offset")
				e.Data.Segments[i].Len = d.i64("segment length")
			}
		}
	} else if f&(efDataPathIsPath|efSegments) != 0 {
		d.fail(Invalidf("data flags without data"))
	}
	if f&efIno != 0 {
		e.Ino = d.u32("inode")
		if e.Ino == 0 {
			d.fail(Invalidf("zero inode flagged"))
		}
	}
}
