package store

import (
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/crc32"
)

// TraceEntry is one chunk of one layer blob a pod read.
type TraceEntry struct {
	Layer string // the layer blob's digest
	Chunk int64
}

// Trace is the chunks a pod touched, in the order it first touched them.
type Trace struct{ Entries []TraceEntry }

// Limits of the encoded trace DecodeTrace accepts.
const (
	MaxTraceSize    = 64 << 20
	MaxTraceLayers  = 1024
	MaxTraceEntries = 1 << 24
	maxTraceChunk   = 1 << 40
)

// Encoded trace (integers little-endian or unsigned varints):
//
//	magic "KFSXTRC\n", version u32,
//	layer count, each layer's SHA-256 (32 bytes; digests "sha256:<hex>"),
//	entry count, each entry: layer number, chunk,
//	CRC-32C of all that u32.
const (
	traceMagic   = "KFSXTRC\n"
	traceVersion = 1
)

// ErrBadTrace is wrapped by every error DecodeTrace returns for bad input.
var ErrBadTrace = errors.New("invalid prefetch trace")

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// MarshalBinary encodes the trace; it fails for a trace DecodeTrace would
// refuse (too many entries or layers, a layer that is no sha256 digest).
func (t Trace) MarshalBinary() ([]byte, error) {
	if len(t.Entries) > MaxTraceEntries {
		return nil, fmt.Errorf("prefetch trace of %d entries: at most %d", len(t.Entries), MaxTraceEntries)
	}
	num := map[string]uint64{}
	var layers [][]byte
	for _, e := range t.Entries {
		if _, ok := num[e.Layer]; ok {
			continue
		}
		h, err := blobHex(e.Layer)
		if err != nil {
			return nil, fmt.Errorf("prefetch trace layer %q: %w", e.Layer, err)
		}
		raw, _ := hex.DecodeString(h)
		num[e.Layer] = uint64(len(layers))
		layers = append(layers, raw)
		if len(layers) > MaxTraceLayers {
			return nil, fmt.Errorf("prefetch trace of more than %d layers", MaxTraceLayers)
		}
	}
	b := append([]byte(traceMagic), 0, 0, 0, 0)
	binary.LittleEndian.PutUint32(b[len(traceMagic):], traceVersion)
	b = binary.AppendUvarint(b, uint64(len(layers)))
	for _, l := range layers {
		b = append(b, l...)
	}
	b = binary.AppendUvarint(b, uint64(len(t.Entries)))
	for _, e := range t.Entries {
		if e.Chunk < 0 || e.Chunk > maxTraceChunk {
			return nil, fmt.Errorf("prefetch trace: chunk %d of layer %s out of range", e.Chunk, e.Layer)
		}
		b = binary.AppendUvarint(b, num[e.Layer])
		b = binary.AppendUvarint(b, uint64(e.Chunk))
	}
	b = binary.LittleEndian.AppendUint32(b, crc32.Checksum(b, castagnoli))
	if len(b) > MaxTraceSize {
		return nil, fmt.Errorf("prefetch trace encodes to %d bytes: at most %d", len(b), MaxTraceSize)
	}
	return b, nil
}

// DecodeTrace reads an encoded trace, distrusting it: sizes and counts are
// bounded before anything is allocated, and the checksum must match.
func DecodeTrace(b []byte) (Trace, error) {
	bad := func(format string, args ...any) (Trace, error) {
		return Trace{}, fmt.Errorf("%w: %s", ErrBadTrace, fmt.Sprintf(format, args...))
	}
	if len(b) > MaxTraceSize {
		return bad("%d bytes, at most %d", len(b), MaxTraceSize)
	}
	if len(b) < len(traceMagic)+4+4 || string(b[:len(traceMagic)]) != traceMagic {
		return bad("no trace header (not a kata-fsx prefetch trace)")
	}
	if v := binary.LittleEndian.Uint32(b[len(traceMagic):]); v != traceVersion {
		return bad("version %d, this kata-fsx reads version %d", v, traceVersion)
	}
	body, sum := b[:len(b)-4], binary.LittleEndian.Uint32(b[len(b)-4:])
	if crc32.Checksum(body, castagnoli) != sum {
		return bad("checksum mismatch (truncated or damaged)")
	}
	p := body[len(traceMagic)+4:]
	uvarint := func(what string) (uint64, error) {
		v, n := binary.Uvarint(p)
		if n <= 0 {
			return 0, fmt.Errorf("%w: %s: bad or missing varint", ErrBadTrace, what)
		}
		p = p[n:]
		return v, nil
	}
	nl, err := uvarint("layer count")
	if err != nil {
		return Trace{}, err
	}
	if nl > MaxTraceLayers || nl*32 > uint64(len(p)) {
		return bad("%d layers in %d bytes (at most %d layers)", nl, len(p), MaxTraceLayers)
	}
	layers := make([]string, nl)
	for i := range layers {
		layers[i] = "sha256:" + hex.EncodeToString(p[:32])
		p = p[32:]
	}
	ne, err := uvarint("entry count")
	if err != nil {
		return Trace{}, err
	}
	if ne > MaxTraceEntries || ne*2 > uint64(len(p)) {
		return bad("%d entries in %d bytes (at most %d entries)", ne, len(p), MaxTraceEntries)
	}
	t := Trace{Entries: make([]TraceEntry, ne)}
	for i := range t.Entries {
		li, err := uvarint(fmt.Sprintf("entry %d layer", i))
		if err != nil {
			return Trace{}, err
		}
		c, err := uvarint(fmt.Sprintf("entry %d chunk", i))
		if err != nil {
			return Trace{}, err
		}
		if li >= nl {
			return bad("entry %d names layer %d of %d", i, li, nl)
		}
		if c > maxTraceChunk {
			return bad("entry %d: chunk %d out of range", i, c)
		}
		t.Entries[i] = TraceEntry{Layer: layers[li], Chunk: int64(c)}
	}
	if len(p) != 0 {
		return bad("%d bytes after the last entry", len(p))
	}
	return t, nil
}

// StartTrace starts recording, in order and once each, the chunks reads
// need (from any tier); a trace in progress starts over.
func (s *Store) StartTrace() {
	s.tmu.Lock()
	s.tseen = make(map[TraceEntry]bool)
	s.tlog = nil
	s.tracing.Store(true)
	s.tmu.Unlock()
}

// StopTrace ends recording and returns the trace.
func (s *Store) StopTrace() Trace {
	s.tmu.Lock()
	defer s.tmu.Unlock()
	s.tracing.Store(false)
	t := Trace{Entries: s.tlog}
	s.tseen, s.tlog = nil, nil
	return t
}

// record adds chunks [lo, hi) of l to the trace in progress, if any.
func (s *Store) record(l *layer, lo, hi int64) {
	if !s.tracing.Load() {
		return
	}
	s.tmu.Lock()
	defer s.tmu.Unlock()
	if s.tseen == nil || len(s.tlog) >= MaxTraceEntries {
		return
	}
	for i := lo; i < hi && len(s.tlog) < MaxTraceEntries; i++ {
		e := TraceEntry{Layer: l.name, Chunk: i}
		if !s.tseen[e] {
			s.tseen[e] = true
			s.tlog = append(s.tlog, e)
		}
	}
}
