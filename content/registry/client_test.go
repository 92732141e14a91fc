package registry

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// hostsFor writes a certs.d directory with hosts.toml body for name.
func writeHosts(t *testing.T, name, body string) string {
	t.Helper()
	dir := t.TempDir()
	os.MkdirAll(filepath.Join(dir, name), 0o755)
	if err := os.WriteFile(filepath.Join(dir, name, "hosts.toml"), []byte(body), 0o644); err != nil {
		t.Fatal(err)
	}
	return dir
}

// TestRangeNotHonoured: a registry answering a range request with the
// whole blob (200) or with another range is an error, never read as data.
func TestRangeNotHonoured(t *testing.T) {
	blob := []byte(strings.Repeat("0123456789", 100))
	var mode atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch mode.Load() {
		case 0:
			w.Write(blob) // Range ignored
		case 1:
			w.Header().Set("Content-Range", fmt.Sprintf("bytes 0-9/%d", len(blob)))
			w.WriteHeader(http.StatusPartialContent)
			w.Write(blob[:10])
		case 2:
			w.Header().Set("Content-Range", "bytes 10-19/1000")
			w.WriteHeader(http.StatusPartialContent)
			w.Write(blob[10:15]) // short body
		}
	}))
	defer srv.Close()
	host := strings.TrimPrefix(srv.URL, "http://")
	c := New(Options{ConfigPath: writeHosts(t, host, fmt.Sprintf("server = %q\n", srv.URL))})
	ref, _ := ParseReference(host + "/a/b:c")
	br := c.Blob(context.Background(), ref, ocispec.Descriptor{Digest: digest.FromBytes(blob), Size: int64(len(blob))}, 5*time.Second)
	for m, want := range []string{"HTTP 200", "asked bytes 10-19", "read range body"} {
		mode.Store(int32(m))
		p := make([]byte, 10)
		_, err := br.ReadAt(p, 10)
		if err == nil || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), host) || !strings.Contains(err.Error(), "a/b") {
			t.Errorf("mode %d: %v, want an error with %q naming host and repository", m, err, want)
		}
		if m < 2 && !errors.Is(err, ErrRangeIgnored) {
			t.Errorf("mode %d: %v is not ErrRangeIgnored", m, err)
		}
	}
}

// TestRetriesBounded: 5xx answers are retried Attempts times, then fail.
func TestRetriesBounded(t *testing.T) {
	var calls atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		http.Error(w, "overloaded", http.StatusServiceUnavailable)
	}))
	defer srv.Close()
	host := strings.TrimPrefix(srv.URL, "http://")
	c := New(Options{ConfigPath: writeHosts(t, host, fmt.Sprintf("server = %q\n", srv.URL)), Attempts: 4, Backoff: time.Millisecond})
	ref, _ := ParseReference(host + "/a/b:c")
	_, err := c.Resolve(context.Background(), ref)
	if err == nil || calls.Load() != 4 || !strings.Contains(err.Error(), "503") || !strings.Contains(err.Error(), "resolve c") {
		t.Fatalf("%d calls, %v; want 4 calls and a 503 error naming the operation", calls.Load(), err)
	}
}

// TestMirrorsInOrder: mirrors are tried in file order (with containerd's
// ns parameter), capabilities decide which hosts an operation may use,
// and the server comes last.
func TestMirrorsInOrder(t *testing.T) {
	var mu sync.Mutex
	var seen []string
	record := func(name string, status int) *httptest.Server {
		return httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			mu.Lock()
			seen = append(seen, name+" "+r.Method+" "+r.URL.Path+"?"+r.URL.RawQuery)
			mu.Unlock()
			if status == http.StatusOK {
				w.Header().Set("Content-Type", ocispec.MediaTypeImageManifest)
				json.NewEncoder(w).Encode(ocispec.Manifest{MediaType: ocispec.MediaTypeImageManifest})
				return
			}
			w.WriteHeader(status)
		}))
	}
	m1, m2, pullOnly, server := record("m1", 404), record("m2", 200), record("pullonly", 200), record("server", 500)
	for _, s := range []*httptest.Server{m1, m2, pullOnly, server} {
		defer s.Close()
	}
	body := fmt.Sprintf("server = %q\ncapabilities = [\"push\"]\n[host.%q]\ncapabilities = [\"pull\"]\n[host.%q]\n[host.%q]\ncapabilities = [\"pull\", \"resolve\"]\n",
		server.URL, pullOnly.URL, m1.URL, m2.URL)
	c := New(Options{ConfigPath: writeHosts(t, "reg.test", body), Attempts: 1})
	ref, _ := ParseReference("reg.test/x/y:t")
	if _, err := c.Resolve(context.Background(), ref); err != nil {
		t.Fatal(err)
	}
	want := []string{"m1 GET /v2/x/y/manifests/t?ns=reg.test", "m2 GET /v2/x/y/manifests/t?ns=reg.test"}
	if strings.Join(seen, "|") != strings.Join(want, "|") {
		t.Fatalf("resolve asked %q, want %q (pull-only mirror skipped, m1 before m2)", seen, want)
	}
	seen = nil
	_, err := c.PushBlob(context.Background(), ref, "x", []byte("x"))
	// m1 has every capability by default; m2 and pullonly may not push.
	if err == nil || len(seen) != 3 || !strings.HasPrefix(seen[0], "m1 HEAD") || !strings.HasPrefix(seen[1], "m1 POST") || !strings.HasPrefix(seen[2], "server HEAD") ||
		!strings.Contains(err.Error(), strings.TrimPrefix(server.URL, "http://")) || !strings.Contains(err.Error(), strings.TrimPrefix(m1.URL, "http://")) {
		t.Fatalf("push asked %q (%v), want m1 then the server, both named", seen, err)
	}
}

// TestDockerConfigCredentials reads docker login's two spellings.
func TestDockerConfigCredentials(t *testing.T) {
	f := filepath.Join(t.TempDir(), "config.json")
	os.WriteFile(f, []byte(`{"auths":{"https://index.docker.io/v1/":{"auth":"dTpw"},"r.example:5000":{"username":"a","password":"b"}}}`), 0o600)
	cf := DockerConfigCredentials(f)
	for host, want := range map[string]Credentials{"docker.io": {"u", "p"}, "r.example:5000": {"a", "b"}, "other": {}} {
		got, err := cf(host)
		if err != nil || got != want {
			t.Errorf("%s: %+v %v, want %+v", host, got, err, want)
		}
	}
	os.WriteFile(f, []byte(`{"auths":{"x":{"auth":"!!"}}}`), 0o600)
	if _, err := cf("x"); err == nil || !strings.Contains(err.Error(), f) {
		t.Errorf("bad auth: %v, want an error naming the file", err)
	}
}

// TestRangeBodyCutRetried: a range body cut short (the connection broke
// mid-transfer) is fetched again, and the bytes come from the full answer.
func TestRangeBodyCutRetried(t *testing.T) {
	blob := []byte(strings.Repeat("abcdefghij", 100))
	var calls atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Range", fmt.Sprintf("bytes 100-199/%d", len(blob)))
		w.Header().Set("Content-Length", "100")
		w.WriteHeader(http.StatusPartialContent)
		if calls.Add(1) == 1 {
			w.Write(blob[100:150])
			panic(http.ErrAbortHandler) // drop the connection mid-body
		}
		w.Write(blob[100:200])
	}))
	defer srv.Close()
	host := strings.TrimPrefix(srv.URL, "http://")
	c := New(Options{ConfigPath: writeHosts(t, host, fmt.Sprintf("server = %q\n", srv.URL)), Backoff: time.Millisecond})
	ref, _ := ParseReference(host + "/a/b:c")
	p := make([]byte, 100)
	if err := c.FetchRange(context.Background(), ref, digest.FromBytes(blob), p, 100); err != nil || string(p) != string(blob[100:200]) || calls.Load() != 2 {
		t.Fatalf("%v after %d calls, want the range on the second call", err, calls.Load())
	}
}

// TestReferrersAPI: a registry with the OCI 1.1 referrers API is asked
// through it (artifactType filter passed on), and a push it answers with
// OCI-Subject leaves the referrers tag alone.
func TestReferrersAPI(t *testing.T) {
	subject := digest.FromString("subject")
	ref1 := ocispec.Descriptor{MediaType: ocispec.MediaTypeImageManifest, Digest: digest.FromString("a"), Size: 1, ArtifactType: "t/x+json"}
	var mu sync.Mutex
	var seen []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		seen = append(seen, r.Method+" "+r.URL.Path+"?"+r.URL.RawQuery)
		mu.Unlock()
		switch {
		case r.Method == http.MethodGet && r.URL.Path == "/v2/a/b/referrers/"+subject.String():
			w.Header().Set("Content-Type", ocispec.MediaTypeImageIndex)
			json.NewEncoder(w).Encode(ocispec.Index{Manifests: []ocispec.Descriptor{ref1}})
		case r.Method == http.MethodPut:
			w.Header().Set("OCI-Subject", subject.String())
			w.WriteHeader(http.StatusCreated)
		default:
			http.NotFound(w, r)
		}
	}))
	defer srv.Close()
	host := strings.TrimPrefix(srv.URL, "http://")
	c := New(Options{ConfigPath: writeHosts(t, host, fmt.Sprintf("server = %q\n", srv.URL))})
	ref, _ := ParseReference(host + "/a/b:c")
	got, err := c.Referrers(context.Background(), ref, subject, "t/x+json")
	if err != nil || len(got) != 1 || got[0].Digest != ref1.Digest {
		t.Fatalf("referrers %+v %v", got, err)
	}
	if seen[0] != "GET /v2/a/b/referrers/"+subject.String()+"?artifactType=t%2Fx%2Bjson" {
		t.Fatalf("asked %q", seen)
	}
	seen = nil
	m := ocispec.Manifest{MediaType: ocispec.MediaTypeImageManifest, Subject: &ocispec.Descriptor{MediaType: ocispec.MediaTypeImageManifest, Digest: subject, Size: 7}}
	data, _ := json.Marshal(m)
	if _, err := c.PushManifest(context.Background(), ref, ocispec.MediaTypeImageManifest, data, ""); err != nil {
		t.Fatal(err)
	}
	if len(seen) != 1 {
		t.Fatalf("push with OCI-Subject asked %q, want the manifest PUT only", seen)
	}
}
