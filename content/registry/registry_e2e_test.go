package registry

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"math/big"
	mrand "math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kata-fsx/kata-fsx/test/registrytest"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// testImage is an OCI layout with one gzip layer of random file data.
type testImage struct {
	dir       string
	layer     []byte
	layerDesc ocispec.Descriptor
	config    []byte
	manifest  []byte
}

func buildImage(t *testing.T) *testImage {
	t.Helper()
	rng := mrand.New(mrand.NewPCG(1, 2))
	var tb bytes.Buffer
	tw := tar.NewWriter(&tb)
	for i := 0; i < 4; i++ {
		data := make([]byte, 200<<10+i*777)
		for j := range data {
			data[j] = byte(rng.IntN(256))
		}
		if err := tw.WriteHeader(&tar.Header{Name: fmt.Sprintf("f%d", i), Mode: 0o644, Size: int64(len(data)), Typeflag: tar.TypeReg}); err != nil {
			t.Fatal(err)
		}
		tw.Write(data)
	}
	tw.Close()
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	zw.Write(tb.Bytes())
	zw.Close()
	img := &testImage{dir: t.TempDir(), layer: gz.Bytes()}
	img.layerDesc = ocispec.Descriptor{MediaType: ocispec.MediaTypeImageLayerGzip, Digest: registrytest.WriteBlob(t, img.dir, img.layer), Size: int64(len(img.layer))}
	cfg := ocispec.Image{Platform: ocispec.Platform{OS: "linux", Architecture: "amd64"},
		RootFS: ocispec.RootFS{Type: "layers", DiffIDs: []digest.Digest{digest.FromBytes(tb.Bytes())}}}
	img.config, _ = json.Marshal(cfg)
	m := ocispec.Manifest{MediaType: ocispec.MediaTypeImageManifest,
		Config: ocispec.Descriptor{MediaType: ocispec.MediaTypeImageConfig, Digest: registrytest.WriteBlob(t, img.dir, img.config), Size: int64(len(img.config))},
		Layers: []ocispec.Descriptor{img.layerDesc}}
	m.SchemaVersion = 2
	img.manifest, _ = json.Marshal(m)
	md := registrytest.WriteBlob(t, img.dir, img.manifest)
	idx := ocispec.Index{MediaType: ocispec.MediaTypeImageIndex, Manifests: []ocispec.Descriptor{{MediaType: ocispec.MediaTypeImageManifest, Digest: md, Size: int64(len(img.manifest)),
		Annotations: map[string]string{ocispec.AnnotationRefName: "v1"}}}}
	idx.SchemaVersion = 2
	ib, _ := json.Marshal(idx)
	os.WriteFile(filepath.Join(img.dir, "index.json"), ib, 0o644)
	os.WriteFile(filepath.Join(img.dir, "oci-layout"), []byte(`{"imageLayoutVersion":"1.0.0"}`), 0o644)
	return img
}

func skopeoPush(t *testing.T, img *testImage, dest string) {
	t.Helper()
	registrytest.PushOCI(t, img.dir, "v1", dest)
}

func TestRegistryPlainHTTP(t *testing.T) {
	reg := registrytest.Start(t, registrytest.Options{})
	img := buildImage(t)
	skopeoPush(t, img, reg.Addr+"/kata/img:v1")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	ref, err := ParseReference(reg.Addr + "/kata/img:v1")
	if err != nil {
		t.Fatal(err)
	}

	t.Run("https is the default", func(t *testing.T) {
		// No hosts.toml: containerd talks https, so a plain HTTP registry fails.
		c := New(Options{ConfigPath: t.TempDir(), Attempts: 1})
		if _, err := c.Resolve(ctx, ref); err == nil || !strings.Contains(err.Error(), reg.Addr) {
			t.Fatalf("resolve over https of a plain registry: %v, want an error naming %s", err, reg.Addr)
		}
	})

	c := New(Options{ConfigPath: reg.HostsDir(t, "")})
	m, desc, err := c.ImageManifest(ctx, ref)
	if err != nil {
		t.Fatal(err)
	}
	if len(m.Layers) != 1 || m.Layers[0].Digest != img.layerDesc.Digest || m.Layers[0].Size != img.layerDesc.Size {
		t.Fatalf("manifest layers %+v, want %v", m.Layers, img.layerDesc)
	}
	t.Logf("resolved %s to %s %s", ref, desc.MediaType, desc.Digest)

	t.Run("range reads", func(t *testing.T) {
		br := c.Blob(ctx, ref, m.Layers[0], 10*time.Second)
		rng := mrand.New(mrand.NewPCG(3, 4))
		for i := 0; i < 50; i++ {
			off := rng.Int64N(br.Size())
			p := make([]byte, 1+rng.IntN(64<<10))
			n, err := br.ReadAt(p, off)
			want := img.layer[off:min(off+int64(len(p)), int64(len(img.layer)))]
			if n != len(want) || !bytes.Equal(p[:n], want) {
				t.Fatalf("ReadAt(%d, %d) = %d bytes (%v), differs from the blob", len(p), off, n, err)
			}
			if off+int64(len(p)) > br.Size() && err != io.EOF || off+int64(len(p)) <= br.Size() && err != nil {
				t.Fatalf("ReadAt(%d, %d) error %v", len(p), off, err)
			}
		}
		// A range the registry cannot serve is an error, not short data.
		p := make([]byte, 10)
		if err := c.FetchRange(ctx, ref, m.Layers[0].Digest, p, img.layerDesc.Size+100); err == nil {
			t.Fatal("range past the end of the blob read without error")
		} else if !strings.Contains(err.Error(), "kata/img") || !strings.Contains(err.Error(), reg.Addr) {
			t.Fatalf("error %v does not name the host and repository", err)
		}
	})

	t.Run("referrers tag schema", func(t *testing.T) {
		empty, err := c.PushBlob(ctx, ref, ocispec.MediaTypeEmptyJSON, []byte("{}"))
		if err != nil {
			t.Fatal(err)
		}
		payload, err := c.PushBlob(ctx, ref, "application/vnd.kata-fsx.test", []byte("index bytes"))
		if err != nil {
			t.Fatal(err)
		}
		subject := desc
		art := ocispec.Manifest{MediaType: ocispec.MediaTypeImageManifest, ArtifactType: "application/vnd.kata-fsx.test.index",
			Config: empty, Layers: []ocispec.Descriptor{payload}, Subject: &subject}
		art.SchemaVersion = 2
		data, _ := json.Marshal(art)
		ad, err := c.PushManifest(ctx, ref, ocispec.MediaTypeImageManifest, data, "")
		if err != nil {
			t.Fatal(err)
		}
		got, err := c.Referrers(ctx, ref, subject.Digest, "application/vnd.kata-fsx.test.index")
		if err != nil {
			t.Fatal(err)
		}
		if len(got) != 1 || got[0].Digest != ad.Digest {
			t.Fatalf("referrers %+v, want %s", got, ad.Digest)
		}
		if other, err := c.Referrers(ctx, ref, subject.Digest, "application/other"); err != nil || len(other) != 0 {
			t.Fatalf("referrers of another type: %v %v", other, err)
		}
		// Found through the tag a registry without the API keeps.
		if _, err := c.Resolve(ctx, Reference{Host: ref.Host, Repository: ref.Repository, Tag: ReferrersTag(subject.Digest)}); err != nil {
			t.Fatalf("referrers tag: %v", err)
		}
		back, _, err := c.FetchManifest(ctx, ref, ad.Digest)
		if err != nil || !bytes.Equal(back, data) {
			t.Fatalf("artifact manifest back: %v", err)
		}
	})

	t.Run("index platform pick", func(t *testing.T) {
		var other ocispec.Manifest
		json.Unmarshal(img.manifest, &other)
		other.Annotations = map[string]string{"arch": "arm64"}
		ob, _ := json.Marshal(other)
		od, err := c.PushManifest(ctx, ref, ocispec.MediaTypeImageManifest, ob, "")
		if err != nil {
			t.Fatal(err)
		}
		idx := ocispec.Index{MediaType: ocispec.MediaTypeImageIndex, Manifests: []ocispec.Descriptor{
			{MediaType: od.MediaType, Digest: od.Digest, Size: od.Size, Platform: &ocispec.Platform{OS: "linux", Architecture: "arm64"}},
			{MediaType: desc.MediaType, Digest: desc.Digest, Size: desc.Size, Platform: &ocispec.Platform{OS: "linux", Architecture: "amd64"}},
		}}
		idx.SchemaVersion = 2
		ib, _ := json.Marshal(idx)
		iref := ref
		iref.Tag = "multi"
		if _, err := c.PushManifest(ctx, iref, ocispec.MediaTypeImageIndex, ib, "multi"); err != nil {
			t.Fatal(err)
		}
		top, err := c.Resolve(ctx, iref)
		if err != nil || top.MediaType != ocispec.MediaTypeImageIndex || top.Digest != digest.FromBytes(ib) {
			t.Fatalf("resolve index: %+v %v", top, err)
		}
		_, got, err := c.ImageManifest(ctx, iref)
		if err != nil || got.Digest != desc.Digest {
			t.Fatalf("picked %s (%v), want the linux/amd64 manifest %s", got.Digest, err, desc.Digest)
		}
	})

	t.Run("registry killed mid-read", func(t *testing.T) {
		const timeout = 2 * time.Second
		c := New(Options{ConfigPath: reg.HostsDir(t, ""), Backoff: 100 * time.Millisecond, Attempts: 100})
		br := c.Blob(ctx, ref, m.Layers[0], timeout)
		done := make(chan struct{})
		go func() {
			time.Sleep(300 * time.Millisecond)
			reg.Stop()
			close(done)
		}()
		failed := false
		for i := 0; i < 1000 && !failed; i++ {
			p := make([]byte, 64<<10)
			off := int64(i*4096) % (br.Size() - int64(len(p)))
			start := time.Now()
			_, err := br.ReadAt(p, off)
			if el := time.Since(start); el > timeout+time.Second {
				t.Fatalf("ReadAt took %v, over its %v deadline", el, timeout)
			}
			if err != nil {
				failed = true
				if !errors.Is(err, context.DeadlineExceeded) && !strings.Contains(err.Error(), reg.Addr) {
					t.Fatalf("error %v names neither the deadline nor the host", err)
				}
			} else if !bytes.Equal(p, img.layer[off:off+int64(len(p))]) {
				t.Fatal("wrong bytes")
			}
		}
		<-done
		if !failed {
			t.Fatal("reads kept succeeding with the registry killed")
		}
		reg.Start()
		p := make([]byte, 1000)
		if _, err := br.ReadAt(p, 1234); err != nil || !bytes.Equal(p, img.layer[1234:2234]) {
			t.Fatalf("read after restart: %v", err)
		}
	})
}

// TestRegistryDeadHost: a host that accepts connections and never answers
// gives an error within the read's deadline.
func TestRegistryDeadHost(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	conns := make(chan net.Conn, 64)
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				close(conns)
				return
			}
			conns <- c
		}
	}()
	defer func() {
		l.Close()
		for c := range conns {
			c.Close()
		}
	}()
	dir := t.TempDir()
	os.MkdirAll(filepath.Join(dir, l.Addr().String()), 0o755)
	os.WriteFile(filepath.Join(dir, l.Addr().String(), "hosts.toml"), []byte(fmt.Sprintf("server = \"http://%s\"\n", l.Addr())), 0o644)
	ref, _ := ParseReference(l.Addr().String() + "/a/b:c")
	c := New(Options{ConfigPath: dir})
	br := c.Blob(context.Background(), ref, ocispec.Descriptor{Digest: digest.FromString("x"), Size: 100}, 500*time.Millisecond)
	start := time.Now()
	_, err = br.ReadAt(make([]byte, 10), 0)
	if el := time.Since(start); err == nil || el > 1500*time.Millisecond {
		t.Fatalf("ReadAt on a silent host: %v after %v, want an error within 500ms", err, el)
	}
	if !strings.Contains(err.Error(), l.Addr().String()) || !strings.Contains(err.Error(), "a/b") {
		t.Fatalf("error %v does not name host and repository", err)
	}
}

// selfSigned makes a CA-less self-signed server certificate for 127.0.0.1.
func selfSigned(t *testing.T, dir string) (certFile, keyFile string) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "kata-fsx test registry"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}, KeyUsage: x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}, BasicConstraintsValid: true, IsCA: true}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	kb, _ := x509.MarshalECPrivateKey(key)
	certFile, keyFile = filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem")
	os.WriteFile(certFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644)
	os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kb}), 0o600)
	return certFile, keyFile
}

// pushImage pushes img with the client itself (blobs, then the manifest).
func pushImage(ctx context.Context, t *testing.T, c *Client, ref Reference, img *testImage) {
	t.Helper()
	if _, err := c.PushBlob(ctx, ref, ocispec.MediaTypeImageLayerGzip, img.layer); err != nil {
		t.Fatal(err)
	}
	if _, err := c.PushBlob(ctx, ref, ocispec.MediaTypeImageConfig, img.config); err != nil {
		t.Fatal(err)
	}
	if _, err := c.PushManifest(ctx, ref, ocispec.MediaTypeImageManifest, img.manifest, ref.Tag); err != nil {
		t.Fatal(err)
	}
}

func checkPulls(ctx context.Context, t *testing.T, c *Client, ref Reference, img *testImage) {
	t.Helper()
	m, _, err := c.ImageManifest(ctx, ref)
	if err != nil {
		t.Fatal(err)
	}
	p := make([]byte, 5000)
	if _, err := c.Blob(ctx, ref, m.Layers[0], 5*time.Second).ReadAt(p, 777); err != nil || !bytes.Equal(p, img.layer[777:5777]) {
		t.Fatalf("range read: %v", err)
	}
}

func TestRegistryTLSBasicAuth(t *testing.T) {
	dir := t.TempDir()
	cert, key := selfSigned(t, dir)
	htpasswd := filepath.Join(dir, "htpasswd")
	if err := os.WriteFile(htpasswd, []byte(testHtpasswd(t, "kata", "s3cret")), 0o600); err != nil {
		t.Fatal(err)
	}
	reg := registrytest.Start(t, registrytest.Options{TLSCert: cert, TLSKey: key, Extra: fmt.Sprintf("auth:\n  htpasswd:\n    realm: kata-fsx-test\n    path: %s\n", htpasswd)})
	ref, _ := ParseReference(reg.Addr + "/kata/tls:v1")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	img := buildImage(t)

	// ca relative to the host's directory, as containerd resolves it.
	hosts := reg.HostsDir(t, "")
	data, _ := os.ReadFile(cert)
	os.WriteFile(filepath.Join(hosts, reg.Addr, "ca.pem"), data, 0o644)
	os.WriteFile(filepath.Join(hosts, reg.Addr, "hosts.toml"), []byte(fmt.Sprintf("server = \"https://%s\"\nca = \"ca.pem\"\n", reg.Addr)), 0o644)
	dockerCfg := filepath.Join(dir, "config.json")
	os.WriteFile(dockerCfg, []byte(fmt.Sprintf(`{"auths":{"%s":{"auth":"a2F0YTpzM2NyZXQ="}}}`, reg.Addr)), 0o600)

	t.Run("untrusted certificate refused", func(t *testing.T) {
		c := New(Options{ConfigPath: reg.HostsDir(t, ""), Credentials: DockerConfigCredentials(dockerCfg), Attempts: 1})
		if _, err := c.Resolve(ctx, ref); err == nil || !strings.Contains(err.Error(), "certificate") {
			t.Fatalf("resolve without the ca: %v, want a certificate error", err)
		}
	})
	t.Run("no credentials refused", func(t *testing.T) {
		c := New(Options{ConfigPath: hosts, Attempts: 1})
		if _, err := c.Resolve(ctx, ref); !errors.Is(err, ErrUnauthorized) {
			t.Fatalf("resolve without credentials: %v, want unauthorized", err)
		}
	})
	c := New(Options{ConfigPath: hosts, Credentials: DockerConfigCredentials(dockerCfg)})
	pushImage(ctx, t, c, ref, img)
	checkPulls(ctx, t, c, ref, img)
}
