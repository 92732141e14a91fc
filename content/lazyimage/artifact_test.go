package lazyimage

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

var (
	testSubject = digest.FromString("image manifest")
	testLayer   = digest.FromString("layer blob")
)

// artifactJSON is a valid index artifact manifest, changed by edit.
func artifactJSON(t testing.TB, edit func(m *ocispec.Manifest)) []byte {
	m := ocispec.Manifest{MediaType: ocispec.MediaTypeImageManifest, ArtifactType: ArtifactType, Config: ocispec.DescriptorEmptyJSON,
		Layers: []ocispec.Descriptor{{MediaType: IndexMediaType, Digest: digest.FromString("index"), Size: 1234,
			Annotations: map[string]string{AnnotationLayerDigest: testLayer.String()}}},
		Subject: &ocispec.Descriptor{MediaType: ocispec.MediaTypeImageManifest, Digest: testSubject, Size: 99}}
	m.SchemaVersion = 2
	if edit != nil {
		edit(&m)
	}
	b, err := json.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestParseArtifact(t *testing.T) {
	m, err := parseArtifact(artifactJSON(t, nil), ArtifactType, IndexMediaType, testSubject, maxArtifactLayers)
	if err != nil {
		t.Fatal(err)
	}
	by, err := indexLayers(m)
	if err != nil || by[testLayer].Digest != digest.FromString("index") {
		t.Fatalf("indexLayers: %v, %v", by, err)
	}
	for _, c := range []struct {
		name string
		edit func(m *ocispec.Manifest)
		want string
	}{
		{"schema version", func(m *ocispec.Manifest) { m.SchemaVersion = 1 }, "schemaVersion 1"},
		{"media type", func(m *ocispec.Manifest) { m.MediaType = ocispec.MediaTypeImageIndex }, "media type"},
		{"artifact type", func(m *ocispec.Manifest) { m.ArtifactType = PrefetchArtifactType }, "artifactType"},
		{"no subject", func(m *ocispec.Manifest) { m.Subject = nil }, "no subject"},
		{"other subject", func(m *ocispec.Manifest) { m.Subject.Digest = testLayer }, "not the image manifest"},
		{"no layers", func(m *ocispec.Manifest) { m.Layers = nil }, "0 layers"},
		{"too many layers", func(m *ocispec.Manifest) {
			for len(m.Layers) <= maxArtifactLayers {
				m.Layers = append(m.Layers, m.Layers[0])
			}
		}, "1025 layers"},
		{"layer media type", func(m *ocispec.Manifest) { m.Layers[0].MediaType = ocispec.MediaTypeImageLayerGzip }, "layer 1: media type"},
		{"layer digest", func(m *ocispec.Manifest) { m.Layers[0].Digest = "sha256:xyz" }, "layer 1: digest"},
		{"layer digest algorithm", func(m *ocispec.Manifest) {
			m.Layers[0].Digest = digest.SHA512.FromString("x")
		}, "only sha256"},
		{"layer size", func(m *ocispec.Manifest) { m.Layers[0].Size = 0 }, "layer 1: size 0"},
	} {
		_, err := parseArtifact(artifactJSON(t, c.edit), ArtifactType, IndexMediaType, testSubject, maxArtifactLayers)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want an error with %q", c.name, err, c.want)
		}
	}
	if _, err := parseArtifact([]byte("{"), ArtifactType, IndexMediaType, testSubject, 1); err == nil {
		t.Error("truncated JSON accepted")
	}
	for _, c := range []struct {
		name string
		ann  map[string]string
		want string
	}{
		{"no annotation", nil, "annotation " + AnnotationLayerDigest},
		{"bad annotation", map[string]string{AnnotationLayerDigest: "sha256:0"}, "annotation " + AnnotationLayerDigest},
	} {
		m, err := parseArtifact(artifactJSON(t, func(m *ocispec.Manifest) { m.Layers[0].Annotations = c.ann }), ArtifactType, IndexMediaType, testSubject, maxArtifactLayers)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := indexLayers(m); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want an error with %q", c.name, err, c.want)
		}
	}
}

func TestNewestFirst(t *testing.T) {
	at := func(name string, ts time.Time) ocispec.Descriptor {
		d := ocispec.Descriptor{Digest: digest.FromString(name), Annotations: map[string]string{}}
		if !ts.IsZero() {
			d.Annotations[ocispec.AnnotationCreated] = ts.Format(time.RFC3339Nano)
		}
		return d
	}
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	in := []ocispec.Descriptor{at("old", t0), at("new", t0.Add(time.Nanosecond)), at("undated1", time.Time{}), at("undated2", time.Time{})}
	got := newestFirst(in)
	var names []digest.Digest
	for _, d := range got {
		names = append(names, d.Digest)
	}
	want := []digest.Digest{digest.FromString("new"), digest.FromString("old"), digest.FromString("undated2"), digest.FromString("undated1")}
	for i := range want {
		if names[i] != want[i] {
			t.Fatalf("order %v, want new, old, then the undated last-listed first", names)
		}
	}
}

// FuzzParseArtifact: no manifest makes the parser panic, and whatever it
// accepts keeps the invariants the fetching code relies on.
func FuzzParseArtifact(f *testing.F) {
	f.Add(artifactJSON(f, nil))
	f.Add(artifactJSON(f, func(m *ocispec.Manifest) { m.Layers = append(m.Layers, m.Layers[0]) }))
	f.Add(artifactJSON(f, func(m *ocispec.Manifest) {
		l := m.Layers[0]
		l.Digest = digest.FromString("other index")
		m.Layers = append(m.Layers, l)
	}))
	f.Add(artifactJSON(f, func(m *ocispec.Manifest) { m.Subject = nil }))
	f.Add([]byte(`{"schemaVersion":2,"layers":[{"size":-1}]}`))
	f.Add([]byte(`null`))
	f.Fuzz(func(t *testing.T, data []byte) {
		m, err := parseArtifact(data, ArtifactType, IndexMediaType, testSubject, 8)
		if err != nil {
			return
		}
		if m.ArtifactType != ArtifactType || m.Subject == nil || m.Subject.Digest != testSubject || len(m.Layers) == 0 || len(m.Layers) > 8 {
			t.Fatalf("accepted %+v", m)
		}
		for _, l := range m.Layers {
			if l.Size <= 0 || checkSHA256(l.Digest) != nil || l.MediaType != IndexMediaType {
				t.Fatalf("accepted layer %+v", l)
			}
		}
		by, err := indexLayers(m)
		if err != nil {
			return
		}
		for ld, bd := range by {
			if checkSHA256(ld) != nil || checkSHA256(bd.Digest) != nil {
				t.Fatalf("indexLayers gave %s -> %s", ld, bd.Digest)
			}
		}
	})
}
