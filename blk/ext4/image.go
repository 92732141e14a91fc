package ext4

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"

	"github.com/kata-fsx/kata-fsx/atomicfile"
	"github.com/kata-fsx/kata-fsx/blk/blockmap"
	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/blk/rawimage"
)

// Files of a persisted image directory.
const (
	MetaFile     = "meta.bin"
	MapFile      = "blockmap.bin"
	ManifestFile = "manifest.json"
	formatV1     = 1
)

// Manifest describes a built image; it is written beside the metadata.
type Manifest struct {
	Format     int            `json:"format"`
	BlockSize  uint32         `json:"block_size"`
	Blocks     uint64         `json:"blocks"`
	SizeBytes  uint64         `json:"size_bytes"`
	Inodes     uint64         `json:"inodes"`
	UsedInodes uint64         `json:"used_inodes"`
	Groups     uint64         `json:"groups"`
	UUID       string         `json:"uuid"`
	Features   []string       `json:"features"`
	BuildTime  int64          `json:"build_time"` // filesystem timestamp (Options.Time), Unix seconds
	MetaBytes  uint64         `json:"meta_bytes"` // stored metadata
	DataBytes  uint64         `json:"data_bytes"` // bytes mapped to content sources
	Journal    uint64         `json:"journal_bytes"`
	Extents    int            `json:"map_extents"`
	Counts     map[string]int `json:"counts"` // index entries by type
	// Sources is the index's source table: Data extents' Source ids point
	// into it.
	Sources []index.Source `json:"sources"`
}

// Image is a synthesized filesystem: stored metadata blocks plus the block
// map that says where every block's bytes come from.
type Image struct {
	Manifest Manifest
	Map      *blockmap.Map
	meta     io.ReaderAt
	metaSize int64
	closer   io.Closer
	// built is the unlinked metadata file Build made, until WriteTo
	// persists it and the image reads its copy instead.
	built *os.File
}

// The run-time reader serves an Image without knowing its format.
var _ rawimage.Image = (*Image)(nil)

// Meta gives access to the metadata file; Meta extents' offsets point into it.
func (img *Image) Meta() io.ReaderAt { return img.meta }

// BlockMap is img.Map, for readers that take any synthesized image.
func (img *Image) BlockMap() *blockmap.Map { return img.Map }

// Sources is the index's source table, which Data extents' Source ids index.
func (img *Image) Sources() []index.Source { return img.Manifest.Sources }

// MetaSize is the size of the metadata file in bytes.
func (img *Image) MetaSize() int64 { return img.metaSize }

// Close releases the metadata file of an image built by Build or loaded by
// Open, and the block map of one loaded by Open: neither the image's Map
// nor a Location it returned may be used after.
func (img *Image) Close() error {
	if img.closer != nil {
		return img.closer.Close()
	}
	return nil
}

// newImage is the image a plan and its emitted metadata make: the block
// map and the manifest.
func newImage(p *plan, md *metadata) (*Image, error) {
	l := p.layout
	m, err := blockMap(p, md)
	if err != nil {
		return nil, err
	}
	var dataBytes uint64
	for _, e := range l.dataExts {
		dataBytes += e.Bytes
	}
	used := uint64(len(p.tree.nodes)) + 9 // nodes plus reserved inodes 1..10 but root
	if p.tree.journal >= 0 {
		used--
	}
	u := p.uuid
	now, _ := p.opts.now()
	mf := Manifest{
		Format: formatV1, BlockSize: uint32(l.bs), Blocks: l.blocks, SizeBytes: l.blocks * l.bs,
		Inodes: l.ipg * l.ngroups, UsedInodes: used, Groups: l.ngroups,
		UUID:      fmt.Sprintf("%x-%x-%x-%x-%x", u[0:4], u[4:6], u[6:8], u[8:10], u[10:16]),
		Features:  []string{"ext_attr", "dir_index", "filetype", "extent", "64bit", "flex_bg", "sparse_super", "large_file", "huge_file", "dir_nlink", "extra_isize", "metadata_csum"},
		BuildTime: now, MetaBytes: md.size, DataBytes: dataBytes,
		Extents: m.Len(), Counts: p.tree.counts, Sources: p.idx.Sources,
	}
	if p.tree.journal >= 0 {
		mf.Features = append([]string{"has_journal"}, mf.Features...)
		mf.Journal = l.nodes[p.tree.journal].dataBlks * l.bs
	}
	return &Image{Manifest: mf, Map: m, meta: md.f, metaSize: int64(md.size), closer: md.f, built: md.f}, nil
}

// blockMap combines stored, shared, zero and data ranges into the block map.
func blockMap(p *plan, md *metadata) (*blockmap.Map, error) {
	l := p.layout
	all := make([]blockmap.Extent, 0, len(p.stored)+len(md.shared)+len(p.zero)+len(l.dataExts))
	for i, r := range p.stored {
		all = append(all, blockmap.Extent{First: r.start, Count: r.n, Kind: blockmap.Meta,
			Loc: blockmap.Location{Offset: int64(md.storedOff[i])}, Bytes: r.n * l.bs})
	}
	for _, r := range md.shared {
		all = append(all, blockmap.Extent{First: r.r.start, Count: r.r.n, Kind: blockmap.Meta,
			Loc: blockmap.Location{Offset: int64(md.sharedOff[r.id])}, Bytes: r.r.n * l.bs})
	}
	for _, r := range p.zero {
		all = append(all, blockmap.Extent{First: r.start, Count: r.n, Kind: blockmap.Zero})
	}
	all = append(all, l.dataExts...)
	sort.Slice(all, func(i, j int) bool { return all[i].First < all[j].First })
	mb := blockmap.NewBuilder(uint32(l.bs), l.blocks)
	for _, e := range all {
		mb.Add(e)
	}
	m, err := mb.Map()
	if err != nil {
		return nil, fmt.Errorf("ext4: block map: %w", err)
	}
	return m, nil
}

// WriteTo persists the image into dir (created if missing): the metadata
// file, the encoded block map and the manifest. Each file is replaced
// whole and durably (atomicfile), so rewriting the directory an image was
// opened from is safe.
// An image from Build then reads dir's metadata file and releases the
// temporary one, so the metadata is not kept twice; WriteTo must not run
// while the image is being read.
func (img *Image) WriteTo(dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("ext4: image dir: %w", err)
	}
	err := atomicfile.Write(filepath.Join(dir, MetaFile), 0o644, func(w io.Writer) error {
		_, err := io.Copy(w, io.NewSectionReader(img.meta, 0, img.metaSize))
		return err
	})
	if err != nil {
		return fmt.Errorf("ext4: write metadata: %w", err)
	}
	enc, err := img.Map.MarshalBinary()
	if err != nil {
		return fmt.Errorf("ext4: encode block map: %w", err)
	}
	if err := atomicfile.WriteFile(filepath.Join(dir, MapFile), enc, 0o644); err != nil {
		return fmt.Errorf("ext4: write block map: %w", err)
	}
	js, err := json.MarshalIndent(img.Manifest, "", "  ")
	if err != nil {
		return fmt.Errorf("ext4: encode manifest: %w", err)
	}
	js = append(js, '\n')
	if err := atomicfile.WriteFile(filepath.Join(dir, ManifestFile), js, 0o644); err != nil {
		return fmt.Errorf("ext4: write manifest: %w", err)
	}
	if img.built != nil {
		f, err := os.Open(filepath.Join(dir, MetaFile))
		if err != nil {
			return fmt.Errorf("ext4: reopen metadata: %w", err)
		}
		img.built.Close()
		img.meta, img.closer, img.built = f, f, nil
	}
	return nil
}

// Open loads an image persisted by WriteTo; the metadata stays on disk and
// is read on demand. Close releases it.
func Open(dir string) (*Image, error) {
	js, err := readRegular(filepath.Join(dir, ManifestFile), maxManifestBytes)
	if err != nil {
		return nil, fmt.Errorf("ext4: open image: %w", err)
	}
	var mf Manifest
	if err := json.Unmarshal(js, &mf); err != nil {
		return nil, fmt.Errorf("ext4: manifest: %w", err)
	}
	if mf.Format != formatV1 {
		return nil, fmt.Errorf("ext4: manifest format %d not supported", mf.Format)
	}
	// The block map is read in place from a shared read-only mapping: a
	// process serving the image holds none of it on its heap, and every
	// process serving it shares the pages.
	enc, unmap, err := mapRegular(filepath.Join(dir, MapFile), maxMapBytes)
	if err != nil {
		return nil, fmt.Errorf("ext4: open image: %w", err)
	}
	img, err := openWithMap(dir, mf, enc)
	if err != nil {
		unmap()
		return nil, err
	}
	img.closer = multiCloser{img.closer, closerFunc(unmap)}
	return img, nil
}

func openWithMap(dir string, mf Manifest, enc []byte) (*Image, error) {
	m, err := blockmap.View(enc)
	if err != nil {
		return nil, fmt.Errorf("ext4: block map: %w", err)
	}
	if m.BlockSize() != mf.BlockSize || m.Blocks() != mf.Blocks {
		return nil, fmt.Errorf("ext4: block map geometry %d x %d disagrees with manifest %d x %d",
			m.Blocks(), m.BlockSize(), mf.Blocks, mf.BlockSize)
	}
	f, err := openRegular(filepath.Join(dir, MetaFile))
	if err != nil {
		return nil, fmt.Errorf("ext4: open image: %w", err)
	}
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("ext4: open image: %w", err)
	}
	for i := 0; i < m.Len(); i++ {
		e := m.At(i)
		if e.Kind == blockmap.Meta && uint64(e.Loc.Offset)+e.Bytes > uint64(st.Size()) {
			f.Close()
			return nil, fmt.Errorf("ext4: block map points past the %d-byte metadata file", st.Size())
		}
		if e.Kind == blockmap.Data && int(e.Loc.Source) >= len(mf.Sources) {
			f.Close()
			return nil, fmt.Errorf("ext4: block map names source %d of %d", e.Loc.Source, len(mf.Sources))
		}
	}
	return &Image{Manifest: mf, Map: m, meta: f, metaSize: st.Size(), closer: f}, nil
}

type closerFunc func() error

func (f closerFunc) Close() error { return f() }

// multiCloser closes each in order and returns every error.
type multiCloser []io.Closer

func (m multiCloser) Close() error {
	var errs []error
	for _, c := range m {
		errs = append(errs, c.Close())
	}
	return errors.Join(errs...)
}

// Export writes the whole raw filesystem to out: metadata, file data read
// through opener, free and zero blocks left as holes.
func Export(ctx context.Context, img *Image, opener index.Opener, out *os.File) error {
	m := img.Map
	bs := uint64(m.BlockSize())
	if err := out.Truncate(int64(m.Blocks() * bs)); err != nil {
		return fmt.Errorf("ext4: export: %w", err)
	}
	d := rawimage.New(img, opener)
	defer d.Close()
	buf := make([]byte, 1<<20)
	for i := 0; i < m.Len(); i++ {
		if i%1024 == 0 {
			if err := ctx.Err(); err != nil {
				return fmt.Errorf("ext4: export: %w", err)
			}
		}
		e := m.At(i)
		if e.Kind != blockmap.Meta && e.Kind != blockmap.Data {
			continue
		}
		// Only the bytes that hold something; the zero tail of a last
		// block stays a hole like the free space.
		start := e.First * bs
		for done := uint64(0); done < e.Bytes; {
			n := min(uint64(len(buf)), e.Bytes-done)
			if _, err := d.ReadAt(buf[:n], int64(start+done)); err != nil {
				return fmt.Errorf("ext4: export: %w", err)
			}
			if _, err := out.WriteAt(buf[:n], int64(start+done)); err != nil {
				return fmt.Errorf("ext4: export: %w", err)
			}
			done += n
		}
	}
	return nil
}
