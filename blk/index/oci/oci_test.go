package oci

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"reflect"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/blk/index"
	"github.com/kata-fsx/kata-fsx/blk/index/hostfs"
	"github.com/kata-fsx/kata-fsx/blk/index/indextest"
	"github.com/kata-fsx/kata-fsx/blk/index/overlayfs"
	"github.com/klauspost/compress/zstd"
	"golang.org/x/sys/unix"
)

// dirToTar writes a layer directory as an OCI layer tar, independently of
// the package's reader: whiteout devices become .wh.NAME, opaque
// directories get .wh..wh..opq, hard links become TypeLink, xattrs and
// nanosecond times go into PAX records. Sockets are skipped (tar has none).
func dirToTar(t testing.TB, dir string) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	seen := map[[2]uint64]string{}
	indextest.Must(t, filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		name := rel
		if rel == "." {
			name = "./"
		}
		var st unix.Stat_t
		indextest.Must(t, unix.Lstat(p, &st))
		hdr := &tar.Header{
			Name: name, Mode: int64(st.Mode & 07777), Uid: int(st.Uid), Gid: int(st.Gid),
			ModTime:    time.Unix(st.Mtim.Sec, st.Mtim.Nsec),
			AccessTime: time.Unix(st.Atim.Sec, st.Atim.Nsec),
			ChangeTime: time.Unix(st.Ctim.Sec, st.Ctim.Nsec),
			Format:     tar.FormatPAX,
		}
		for _, x := range indextest.Lxattrs(t, p) {
			if strings.HasPrefix(x.Name, "trusted.overlay.") {
				continue
			}
			if hdr.PAXRecords == nil {
				hdr.PAXRecords = map[string]string{}
			}
			hdr.PAXRecords["SCHILY.xattr."+x.Name] = string(x.Value)
		}
		var body []byte
		switch st.Mode & unix.S_IFMT {
		case unix.S_IFSOCK:
			return nil
		case unix.S_IFCHR, unix.S_IFBLK:
			if st.Mode&unix.S_IFMT == unix.S_IFCHR && st.Rdev == 0 {
				indextest.Must(t, tw.WriteHeader(&tar.Header{Name: filepath.Join(filepath.Dir(rel), ".wh."+filepath.Base(rel)), Typeflag: tar.TypeReg, ModTime: hdr.ModTime}))
				return nil
			}
			hdr.Typeflag = tar.TypeChar
			if st.Mode&unix.S_IFMT == unix.S_IFBLK {
				hdr.Typeflag = tar.TypeBlock
			}
			hdr.Devmajor, hdr.Devminor = int64(unix.Major(st.Rdev)), int64(unix.Minor(st.Rdev))
		case unix.S_IFIFO:
			hdr.Typeflag = tar.TypeFifo
		case unix.S_IFLNK:
			hdr.Typeflag = tar.TypeSymlink
			hdr.Linkname, err = os.Readlink(p)
			indextest.Must(t, err)
		case unix.S_IFDIR:
			hdr.Typeflag = tar.TypeDir
			if rel != "." {
				hdr.Name = rel + "/"
			}
		case unix.S_IFREG:
			k := [2]uint64{st.Dev, st.Ino}
			if first, ok := seen[k]; ok && st.Nlink > 1 {
				hdr.Typeflag, hdr.Linkname = tar.TypeLink, first
				break
			}
			seen[k] = rel
			hdr.Typeflag = tar.TypeReg
			body, err = os.ReadFile(p)
			indextest.Must(t, err)
			hdr.Size = int64(len(body))
		}
		indextest.Must(t, tw.WriteHeader(hdr))
		_, err = tw.Write(body)
		indextest.Must(t, err)
		if v, err := unix.Lgetxattr(p, "trusted.overlay.opaque", make([]byte, 8)); err == nil && v == 1 {
			indextest.Must(t, tw.WriteHeader(&tar.Header{Name: rel + "/.wh..wh..opq", Typeflag: tar.TypeReg, ModTime: hdr.ModTime}))
		}
		return nil
	}))
	indextest.Must(t, tw.Close())
	return buf.Bytes()
}

func gzipBytes(t testing.TB, b []byte) []byte {
	var buf bytes.Buffer
	zw := gzip.NewWriter(&buf)
	_, err := zw.Write(b)
	indextest.Must(t, err)
	indextest.Must(t, zw.Close())
	return buf.Bytes()
}

func zstdBytes(t testing.TB, b []byte) []byte {
	enc, err := zstd.NewWriter(nil)
	indextest.Must(t, err)
	return enc.EncodeAll(b, nil)
}

type testLayer struct {
	tar       []byte // uncompressed
	blob      []byte // as stored
	mediaType string
}

func compressLayers(t testing.TB, tars [][]byte) []testLayer {
	var out []testLayer
	for i, tb := range tars {
		l := testLayer{tar: tb}
		switch i % 3 {
		case 0:
			l.blob, l.mediaType = gzipBytes(t, tb), "application/vnd.oci.image.layer.v1.tar+gzip"
		case 1:
			l.blob, l.mediaType = zstdBytes(t, tb), "application/vnd.oci.image.layer.v1.tar+zstd"
		default:
			l.blob, l.mediaType = tb, "application/vnd.oci.image.layer.v1.tar"
		}
		out = append(out, l)
	}
	return out
}

func configJSON(t testing.TB, layers []testLayer) []byte {
	var diffs []string
	for _, l := range layers {
		diffs = append(diffs, indextest.DigestOf(l.tar))
	}
	b, err := json.Marshal(map[string]any{
		"architecture": "amd64", "os": "linux",
		"rootfs": map[string]any{"type": "layers", "diff_ids": diffs},
	})
	indextest.Must(t, err)
	return b
}

// writeOCILayout writes an OCI image layout with one image per tag, each
// using the first n layers.
func writeOCILayout(t testing.TB, dir string, layers []testLayer, tags map[string]int) {
	t.Helper()
	put := func(b []byte) string {
		d := indextest.DigestOf(b)
		p := filepath.Join(dir, "blobs", "sha256", strings.TrimPrefix(d, "sha256:"))
		indextest.Must(t, os.MkdirAll(filepath.Dir(p), 0o755))
		indextest.Must(t, os.WriteFile(p, b, 0o644))
		return d
	}
	var manifests []map[string]any
	for tag, n := range tags {
		cfg := configJSON(t, layers[:n])
		var ls []map[string]any
		for _, l := range layers[:n] {
			ls = append(ls, map[string]any{"mediaType": l.mediaType, "digest": put(l.blob), "size": len(l.blob)})
		}
		man, err := json.Marshal(map[string]any{
			"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
			"config": map[string]any{"mediaType": "application/vnd.oci.image.config.v1+json", "digest": put(cfg), "size": len(cfg)},
			"layers": ls,
		})
		indextest.Must(t, err)
		manifests = append(manifests, map[string]any{
			"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": put(man), "size": len(man),
			"annotations": map[string]string{"org.opencontainers.image.ref.name": tag},
		})
	}
	idx, err := json.Marshal(map[string]any{"schemaVersion": 2, "manifests": manifests})
	indextest.Must(t, err)
	indextest.Must(t, os.WriteFile(filepath.Join(dir, "index.json"), idx, 0o644))
	indextest.Must(t, os.WriteFile(filepath.Join(dir, "oci-layout"), []byte(`{"imageLayoutVersion":"1.0.0"}`), 0o644))
}

// tarDir archives a directory's regular files (an OCI archive).
func tarDir(t testing.TB, dir, out string) {
	t.Helper()
	f, err := os.Create(out)
	indextest.Must(t, err)
	tw := tar.NewWriter(f)
	indextest.Must(t, filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		b, err := os.ReadFile(p)
		indextest.Must(t, err)
		indextest.Must(t, tw.WriteHeader(&tar.Header{Name: rel, Mode: 0o644, Size: int64(len(b)), Typeflag: tar.TypeReg}))
		_, err = tw.Write(b)
		return err
	}))
	indextest.Must(t, tw.Close())
	indextest.Must(t, f.Close())
}

// writeDockerArchive writes a `docker save` style archive; the last layer
// is stored twice through a symlink, as docker does for repeated layers.
func writeDockerArchive(t testing.TB, out string, layers []testLayer, tag string) {
	t.Helper()
	f, err := os.Create(out)
	indextest.Must(t, err)
	tw := tar.NewWriter(f)
	add := func(name string, b []byte) {
		indextest.Must(t, tw.WriteHeader(&tar.Header{Name: name, Mode: 0o644, Size: int64(len(b)), Typeflag: tar.TypeReg}))
		_, err := tw.Write(b)
		indextest.Must(t, err)
	}
	cfg := configJSON(t, layers)
	cfgName := strings.TrimPrefix(indextest.DigestOf(cfg), "sha256:") + ".json"
	add(cfgName, cfg)
	var names []string
	for i, l := range layers {
		name := "layer" + string(rune('a'+i)) + "/layer.tar"
		if i == len(layers)-1 {
			indextest.Must(t, tw.WriteHeader(&tar.Header{Name: "dup/layer.tar", Typeflag: tar.TypeSymlink, Linkname: "../" + name}))
			names = append(names, "dup/layer.tar")
		} else {
			names = append(names, name)
		}
		b := l.tar
		if i == 0 {
			b = l.blob // docker 25+ may store compressed OCI blobs as well
		}
		add(name, b)
	}
	man, err := json.Marshal([]map[string]any{{"Config": cfgName, "RepoTags": []string{tag}, "Layers": names}})
	indextest.Must(t, err)
	add("manifest.json", man)
	indextest.Must(t, tw.Close())
	indextest.Must(t, f.Close())
}

// ociLayerSpecs are indextest.OverlayLayers without sockets, which tar cannot carry.
func ociLayerSpecs() []indextest.LayerSpec {
	var out []indextest.LayerSpec
	for _, s := range indextest.OverlayLayers {
		var lines []string
		for _, l := range strings.Split(string(s), "\n") {
			if !strings.HasPrefix(l, "s ") {
				lines = append(lines, l)
			}
		}
		out = append(out, indextest.LayerSpec(strings.Join(lines, "\n")))
	}
	return out
}

func TestFromOCIMatchesLayers(t *testing.T) {
	dirs := indextest.BuildLayers(t, ociLayerSpecs())
	want, err := overlayfs.FromLayers(context.Background(), dirs, index.Options{})
	indextest.Must(t, err)
	var tars [][]byte
	for _, d := range dirs {
		tars = append(tars, dirToTar(t, d))
	}
	layers := compressLayers(t, tars)
	work := t.TempDir()
	layout := filepath.Join(work, "layout")
	writeOCILayout(t, layout, layers, map[string]int{"v1": 3, "v0": 2})
	ociArchive := filepath.Join(work, "oci.tar")
	tarDir(t, layout, ociArchive)
	dockerArchive := filepath.Join(work, "docker.tar")
	writeDockerArchive(t, dockerArchive, layers, "example.com/img:v1")

	for _, c := range []struct{ name, path, tag string }{
		{"layout", layout, "v1"},
		{"oci-archive", ociArchive, "v1"},
		{"docker-archive", dockerArchive, "example.com/img:v1"},
	} {
		t.Run(c.name, func(t *testing.T) {
			cache := t.TempDir()
			var st index.Stats
			ix, err := FromOCI(context.Background(), c.path, c.tag, index.Options{CacheDir: cache, Stats: &st})
			indextest.Must(t, err)
			indextest.Must(t, ix.Validate())
			if st.BlobsWritten != 3 || st.LayersIndexed != 3 {
				t.Errorf("stats %+v", st)
			}
			for i, s := range ix.Sources {
				if s.Kind != index.SourceBlob || s.ID != indextest.DigestOf(tars[i]) {
					t.Errorf("source %d = %+v", i, s)
				}
			}
			entriesEqualIgnoringSource(t, ix, want, false)
			wantData := map[string][]byte{}
			for i := range want.Entries {
				if e := &want.Entries[i]; e.Type == index.TypeRegular {
					wantData[e.Path] = indextest.ReadEntry(t, want, hostfs.Opener{}, e)
				}
			}
			indextest.CheckContents(t, ix, hostfs.Opener{CacheDir: cache}, func(p string) ([]byte, error) {
				b, ok := wantData[p]
				if !ok {
					return nil, errors.New("no such file in FromLayers")
				}
				return b, nil
			})
			// The second pod on the same image costs a merge, not a read.
			var st2 index.Stats
			ix2, err := FromOCI(context.Background(), c.path, c.tag, index.Options{CacheDir: cache, Stats: &st2})
			indextest.Must(t, err)
			if st2.BlobsWritten != 0 || st2.LayersIndexed != 0 || st2.LayersCached != 3 {
				t.Errorf("second call stats %+v", st2)
			}
			if !reflect.DeepEqual(indextest.Normalize(ix), indextest.Normalize(ix2)) {
				t.Error("cached result differs")
			}
		})
	}
	// Tag selection.
	cache := t.TempDir()
	ix0, err := FromOCI(context.Background(), layout, "v0", index.Options{CacheDir: cache})
	indextest.Must(t, err)
	if len(ix0.Sources) != 2 {
		t.Errorf("v0 has %d layers", len(ix0.Sources))
	}
	if _, err := FromOCI(context.Background(), layout, "", index.Options{CacheDir: cache}); err == nil || !strings.Contains(err.Error(), "matches 2") {
		t.Errorf("ambiguous tag: %v", err)
	}
	if _, err := FromOCI(context.Background(), layout, "nope", index.Options{CacheDir: cache}); err == nil {
		t.Error("unknown tag accepted")
	}
	if _, err := FromOCI(context.Background(), layout, "v1", index.Options{}); err == nil {
		t.Error("no cache dir accepted")
	}
}

func TestFromOCIRejectsTamperedLayer(t *testing.T) {
	tar1 := indextest.BuildTar(t, []indextest.TarEnt{{Name: "f", Body: "hello"}})
	layers := compressLayers(t, [][]byte{tar1})
	dir := t.TempDir()
	writeOCILayout(t, dir, layers, map[string]int{"x": 1})
	// Swap the blob's content for another valid gzip stream.
	p := filepath.Join(dir, "blobs", "sha256", strings.TrimPrefix(indextest.DigestOf(layers[0].blob), "sha256:"))
	indextest.Must(t, os.WriteFile(p, gzipBytes(t, indextest.BuildTar(t, []indextest.TarEnt{{Name: "f", Body: "evil!"}})), 0o644))
	cache := t.TempDir()
	_, err := FromOCI(context.Background(), dir, "x", index.Options{CacheDir: cache})
	if err == nil || !strings.Contains(err.Error(), "digest") {
		t.Fatalf("tampered layer: %v", err)
	}
	if m, _ := filepath.Glob(filepath.Join(cache, "blobs", "sha256", "*")); len(m) != 0 {
		t.Fatalf("unverified blob left in the cache: %v", m)
	}
	// A decompression bomb stops at MaxBlobSize.
	big := indextest.BuildTar(t, []indextest.TarEnt{{Name: "zeros", Body: strings.Repeat("\x00", 1<<20)}})
	dir2 := t.TempDir()
	writeOCILayout(t, dir2, compressLayers(t, [][]byte{big}), map[string]int{"x": 1})
	_, err = FromOCI(context.Background(), dir2, "x", index.Options{CacheDir: t.TempDir(), MaxBlobSize: 64 << 10})
	if err == nil || !strings.Contains(err.Error(), "inflated-bytes budget") {
		t.Fatalf("bomb: %v", err)
	}
}

// TestFromOCIMultiPlatform selects this host's platform from a nested image
// index, and accepts a docker-style tag for a layout that also carries a
// docker manifest.json (docker save >= 25 writes both).
func TestFromOCIMultiPlatform(t *testing.T) {
	dir := t.TempDir()
	put := func(b []byte) string {
		d := indextest.DigestOf(b)
		p := filepath.Join(dir, "blobs", "sha256", strings.TrimPrefix(d, "sha256:"))
		indextest.Must(t, os.MkdirAll(filepath.Dir(p), 0o755))
		indextest.Must(t, os.WriteFile(p, b, 0o644))
		return d
	}
	manifestFor := func(content string) (string, int, string) {
		tb := indextest.BuildTar(t, []indextest.TarEnt{{Name: "arch", Body: content}})
		l := compressLayers(t, [][]byte{tb})[0]
		cfg := configJSON(t, []testLayer{l})
		man, err := json.Marshal(map[string]any{
			"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
			"config": map[string]any{"mediaType": "application/vnd.oci.image.config.v1+json", "digest": put(cfg), "size": len(cfg)},
			"layers": []map[string]any{{"mediaType": l.mediaType, "digest": put(l.blob), "size": len(l.blob)}},
		})
		indextest.Must(t, err)
		return put(man), len(man), strings.TrimPrefix(indextest.DigestOf(cfg), "sha256:")
	}
	other := "arm64"
	if runtime.GOARCH == "arm64" {
		other = "amd64"
	}
	dOther, nOther, _ := manifestFor("other")
	dHost, nHost, cfgHex := manifestFor("host")
	sub, err := json.Marshal(map[string]any{
		"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
		"manifests": []map[string]any{
			{"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": dOther, "size": nOther, "platform": map[string]string{"os": "linux", "architecture": other}},
			{"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": dHost, "size": nHost, "platform": map[string]string{"os": "linux", "architecture": runtime.GOARCH}},
		},
	})
	indextest.Must(t, err)
	idx, err := json.Marshal(map[string]any{"schemaVersion": 2, "manifests": []map[string]any{{
		"mediaType": "application/vnd.oci.image.index.v1+json", "digest": put(sub), "size": len(sub),
		"annotations": map[string]string{"org.opencontainers.image.ref.name": "latest", "io.containerd.image.name": "docker.io/library/multi:latest"},
	}}})
	indextest.Must(t, err)
	indextest.Must(t, os.WriteFile(filepath.Join(dir, "index.json"), idx, 0o644))
	indextest.Must(t, os.WriteFile(filepath.Join(dir, "oci-layout"), []byte(`{"imageLayoutVersion":"1.0.0"}`), 0o644))
	cache := t.TempDir()
	for _, tag := range []string{"latest", "docker.io/library/multi:latest"} {
		ix, err := FromOCI(context.Background(), dir, tag, index.Options{CacheDir: cache})
		indextest.Must(t, err)
		if got := string(indextest.ReadEntry(t, ix, hostfs.Opener{CacheDir: cache}, indextest.Lookup(t, ix, "arch"))); got != "host" {
			t.Fatalf("tag %q picked the %q image", tag, got)
		}
	}
	// Add a docker manifest.json naming the host image by a RepoTag.
	var diff string
	{
		var cfg imageConfig
		b, err := os.ReadFile(filepath.Join(dir, "blobs", "sha256", cfgHex))
		indextest.Must(t, err)
		indextest.Must(t, json.Unmarshal(b, &cfg))
		diff = cfg.RootFS.DiffIDs[0]
	}
	// Docker's manifest.json points at the (here gzip) layer blob by path.
	var man ociManifest
	b, err := os.ReadFile(filepath.Join(dir, "blobs", "sha256", strings.TrimPrefix(dHost, "sha256:")))
	indextest.Must(t, err)
	indextest.Must(t, json.Unmarshal(b, &man))
	dm, err := json.Marshal([]map[string]any{{"Config": "blobs/sha256/" + cfgHex, "RepoTags": []string{"multi:v9"}, "Layers": []string{"blobs/sha256/" + strings.TrimPrefix(man.Layers[0].Digest, "sha256:")}}})
	indextest.Must(t, err)
	indextest.Must(t, os.WriteFile(filepath.Join(dir, "manifest.json"), dm, 0o644))
	ix, err := FromOCI(context.Background(), dir, "multi:v9", index.Options{CacheDir: cache})
	indextest.Must(t, err)
	if ix.Sources[0].ID != diff {
		t.Fatalf("source %v, want %s", ix.Sources[0], diff)
	}
}

// TestFromOCIHostileNamesEntryAndLayer checks the error at the API surface.
func TestFromOCIHostileNamesEntryAndLayer(t *testing.T) {
	good := indextest.BuildTar(t, []indextest.TarEnt{{Name: "ok", Body: "fine"}})
	bad := indextest.BuildTar(t, []indextest.TarEnt{{Name: "x/../../../etc/shadow", Body: "x"}})
	dir := t.TempDir()
	writeOCILayout(t, dir, compressLayers(t, [][]byte{good, bad}), map[string]int{"t": 2})
	_, err := FromOCI(context.Background(), dir, "t", index.Options{CacheDir: t.TempDir()})
	if err == nil {
		t.Fatal("accepted")
	}
	for _, s := range []string{"layer 1 (" + indextest.DigestOf(bad) + ")", `"x/../../../etc/shadow"`, `".." component`} {
		if !strings.Contains(err.Error(), s) {
			t.Errorf("error %q lacks %q", err, s)
		}
	}
}

// entriesEqualIgnoringSource compares two indexes entry by entry, ignoring
// where data lives and atimes.
func entriesEqualIgnoringSource(t *testing.T, a, b *index.Index, ignoreCtime bool) {
	t.Helper()
	if len(a.Entries) != len(b.Entries) {
		var pa, pb []string
		for _, e := range a.Entries {
			pa = append(pa, e.Path)
		}
		for _, e := range b.Entries {
			pb = append(pb, e.Path)
		}
		t.Fatalf("%d vs %d entries:\n%q\n%q", len(a.Entries), len(b.Entries), pa, pb)
	}
	for i := range a.Entries {
		x, y := indextest.Comparable(a.Entries[i]), indextest.Comparable(b.Entries[i])
		if ignoreCtime {
			x.Ctime, y.Ctime = index.Timespec{}, index.Timespec{}
		}
		if !reflect.DeepEqual(x, y) {
			t.Errorf("entry %d:\n%+v\n%+v", i, x, y)
		}
	}
}
