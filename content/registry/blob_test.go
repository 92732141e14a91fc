package registry

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"testing/iotest"
	"time"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// fakeBlobRegistry is a fake registry on loopback serving blobs by
// digest, each as its serve function writes it, and counting the
// requests for each path.
type fakeBlobRegistry struct {
	srv    *httptest.Server
	client *Client
	ref    Reference

	mu    sync.Mutex
	serve map[digest.Digest]func(w http.ResponseWriter, r *http.Request, attempt int)
	gets  map[string]int
	seen  []string // method, path and Range header of every request
}

func newFakeBlobRegistry(t *testing.T) *fakeBlobRegistry {
	t.Helper()
	f := &fakeBlobRegistry{serve: map[digest.Digest]func(http.ResponseWriter, *http.Request, int){}, gets: map[string]int{}}
	f.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		f.mu.Lock()
		f.gets[r.URL.Path]++
		n := f.gets[r.URL.Path]
		f.seen = append(f.seen, r.Method+" "+r.URL.Path+" "+r.Header.Get("Range"))
		serve := f.serve[digest.Digest(strings.TrimPrefix(r.URL.Path, "/v2/a/b/blobs/"))]
		f.mu.Unlock()
		if serve == nil {
			http.NotFound(w, r)
			return
		}
		serve(w, r, n)
	}))
	t.Cleanup(f.srv.Close)
	host := strings.TrimPrefix(f.srv.URL, "http://")
	f.client = New(Options{ConfigPath: writeHosts(t, host, fmt.Sprintf("server = %q\n", f.srv.URL)), Backoff: time.Millisecond})
	f.ref, _ = ParseReference(host + "/a/b:c")
	return f
}

// blob adds a blob of data and returns its descriptor.
func (f *fakeBlobRegistry) blob(data []byte, serve func(w http.ResponseWriter, r *http.Request, attempt int)) ocispec.Descriptor {
	d := ocispec.Descriptor{Digest: digest.FromBytes(data), Size: int64(len(data))}
	f.mu.Lock()
	f.serve[d.Digest] = serve
	f.mu.Unlock()
	return d
}

func (f *fakeBlobRegistry) requests(d ocispec.Descriptor) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.gets["/v2/a/b/blobs/"+d.Digest.String()]
}

// garbage writes n bytes that are not the blob, made as they are sent.
func garbage(w io.Writer, n int64) {
	chunk := bytes.Repeat([]byte("garbage!"), 4096)
	for n > 0 {
		k := min(n, int64(len(chunk)))
		if _, err := w.Write(chunk[:k]); err != nil {
			return
		}
		n -= k
	}
}

// TestFetchBlob: a blob is read whole with one plain GET and checked; a
// descriptor over the limit is refused without a request; a Content-Length
// other than the descriptor's size is refused before the body is read
// (here the body is the right blob, so only the header can refuse it);
// a body longer than the descriptor, or not matching its digest, is
// refused and not fetched again; a body cut short is fetched again.
func TestFetchBlob(t *testing.T) {
	f := newFakeBlobRegistry(t)
	ctx := context.Background()
	data := bytes.Repeat([]byte("blob"), 100<<10)
	const limit = 1 << 20
	plain := func(b []byte) func(http.ResponseWriter, *http.Request, int) {
		return func(w http.ResponseWriter, _ *http.Request, _ int) { w.Write(b) }
	}

	good := f.blob(data, plain(data))
	got, err := f.client.FetchBlob(ctx, f.ref, good, limit)
	if err != nil || !bytes.Equal(got, data) || f.requests(good) != 1 {
		t.Fatalf("good blob: %d bytes, %v after %d requests", len(got), err, f.requests(good))
	}
	if f.seen[0] != "GET /v2/a/b/blobs/"+good.Digest.String()+" " {
		t.Fatalf("asked %q, want a GET without Range", f.seen[0])
	}

	big := f.blob(append(bytes.Clone(data), 'x'), plain(data))
	big.Size = limit + 1
	if _, err := f.client.FetchBlob(ctx, f.ref, big, limit); !errors.Is(err, ErrTooLarge) || f.requests(big) != 0 {
		t.Fatalf("descriptor over the limit: %v after %d requests, want ErrTooLarge and none", err, f.requests(big))
	}

	for _, c := range []struct {
		name   string
		data   []byte
		serve  func(w http.ResponseWriter, r *http.Request, attempt int)
		tooBig bool
		want   string
		gets   int
	}{
		{"Content-Length over the limit", []byte("lying length"), func(w http.ResponseWriter, _ *http.Request, _ int) {
			w.Header().Set("Content-Length", strconv.Itoa(1<<30))
			w.Write([]byte("lying length"))
		}, true, "Content-Length 1073741824", 1},
		{"Content-Length short", []byte("short length"), func(w http.ResponseWriter, _ *http.Request, _ int) {
			w.Header().Set("Content-Length", "5")
			w.Write([]byte("short"))
		}, false, "Content-Length 5", 1},
		{"longer body", []byte("longer body"), func(w http.ResponseWriter, _ *http.Request, _ int) {
			// Without a Content-Length: a chunked body of 1 GiB.
			w.(http.Flusher).Flush()
			garbage(w, 1<<30)
		}, true, "more than the descriptor's 11 bytes", 1},
		{"wrong content", []byte("right content"), plain([]byte("wrong content")), false, "blob content has digest", 1},
		{"cut once", []byte("cut once, then whole"), func(w http.ResponseWriter, _ *http.Request, attempt int) {
			w.Header().Set("Content-Length", "20")
			if attempt == 1 {
				w.Write([]byte("cut once"))
				panic(http.ErrAbortHandler)
			}
			w.Write([]byte("cut once, then whole"))
		}, false, "", 2},
	} {
		d := f.blob(c.data, c.serve)
		got, err := f.client.FetchBlob(ctx, f.ref, d, limit)
		if c.want == "" {
			if err != nil || !bytes.Equal(got, c.data) {
				t.Errorf("%s: %q, %v", c.name, got, err)
			}
		} else if err == nil || !strings.Contains(err.Error(), c.want) || errors.Is(err, ErrTooLarge) != c.tooBig || got != nil {
			t.Errorf("%s: %q, %v; want an error with %q (ErrTooLarge: %v)", c.name, got, err, c.want, c.tooBig)
		}
		if n := f.requests(d); n != c.gets {
			t.Errorf("%s: %d requests, want %d", c.name, n, c.gets)
		}
	}
}

// endless is a body that never ends.
type endless struct{}

func (endless) Read(p []byte) (int, error) {
	for i := range p {
		p[i] = 'g'
	}
	return len(p), nil
}

// TestReadBlobMemory: reading a blob allocates its size plus the small
// buffers it started in, not the doubling of an io.ReadAll, and a body
// that never ends costs no more.
func TestReadBlobMemory(t *testing.T) {
	const size = 24 << 20
	data := bytes.Repeat([]byte{'g'}, size)
	d := digest.FromBytes(data)
	// The buffers below blobDoubleUntil sum to under twice it; the rest
	// is the hash and the test's own bookkeeping.
	const bound = size + 2*blobDoubleUntil + 256<<10
	for _, c := range []struct {
		name string
		body io.Reader
		want error
	}{
		{"exact", bytes.NewReader(data), nil},
		{"endless", endless{}, ErrTooLarge},
	} {
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		b, err := readBlob(c.body, size, d, nil)
		runtime.ReadMemStats(&after)
		if !errors.Is(err, c.want) || (err == nil) != (c.want == nil) {
			t.Fatalf("%s: %v, want %v", c.name, err, c.want)
		}
		if alloc := after.TotalAlloc - before.TotalAlloc; alloc > bound {
			t.Errorf("%s: reading a %d-byte blob allocated %d bytes, want at most %d", c.name, size, alloc, bound)
		}
		if cap(b) != size {
			t.Errorf("%s: buffer of %d bytes for a %d-byte blob", c.name, cap(b), size)
		}
	}
}

// FuzzReadBlob: whatever the body, readBlob never holds a buffer larger
// than the declared size, and accepts exactly the
// bodies that are the declared blob.
func FuzzReadBlob(f *testing.F) {
	f.Add([]byte("blob"), uint32(4), uint32(4), uint8(0))
	f.Add([]byte("blob and more"), uint32(4), uint32(4), uint8(0))
	f.Add([]byte("bl"), uint32(4), uint32(4), uint8(0))
	f.Add([]byte("blob"), uint32(4), uint32(3), uint8(0))
	f.Add([]byte("blob"), uint32(4), uint32(4), uint8(1))
	f.Add([]byte("blob"), uint32(4), uint32(4), uint8(2))
	f.Add([]byte("blob!"), uint32(4), uint32(4), uint8(1))
	f.Add(make([]byte, blobFirstBuf+1), uint32(blobFirstBuf+1), uint32(blobFirstBuf+1), uint8(2))
	f.Fuzz(func(t *testing.T, body []byte, size, digestOf uint32, mode uint8) {
		// Sizes past what a body can bring cost allocation, not coverage.
		size, digestOf = size%(4*blobFirstBuf), digestOf%(4*blobFirstBuf)
		// The declared blob is the body's first digestOf bytes (padded
		// with zeros past its end), declared to be size bytes long.
		blob := make([]byte, digestOf)
		copy(blob, body)
		d := digest.FromBytes(blob)
		n := int64(size)
		if n == 0 {
			n = 1
		}
		// Bodies come in pieces of every size, the last with io.EOF or
		// before it, as HTTP bodies do.
		var r io.Reader = bytes.NewReader(body)
		switch mode % 3 {
		case 1:
			r = iotest.DataErrReader(r)
		case 2:
			r = iotest.DataErrReader(iotest.OneByteReader(r))
		}
		b, err := readBlob(r, n, d, nil)
		if int64(cap(b)) > n {
			t.Fatalf("buffer of %d bytes for a blob of %d", cap(b), n)
		}
		want := int64(len(body)) == n && int64(digestOf) == n && bytes.Equal(body, blob)
		if (err == nil) != want {
			t.Fatalf("body %d bytes, declared %d, digest of %d bytes: %v", len(body), n, digestOf, err)
		}
		if err == nil && !bytes.Equal(b, body) {
			t.Fatal("accepted bytes differ from the body")
		}
	})
}

// TestJSONAnswersBounded: a manifest or referrers list whose
// Content-Length is over the 4 MiB limit is refused as ErrTooLarge, and
// so is one that brings more without saying so.
func TestJSONAnswersBounded(t *testing.T) {
	big := append([]byte(`{"schemaVersion":2,"manifests":[]}`), bytes.Repeat([]byte(" "), maxManifest)...)
	subject := digest.FromString("subject")
	for _, declare := range []bool{true, false} {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", ocispec.MediaTypeImageIndex)
			if declare {
				w.Header().Set("Content-Length", strconv.Itoa(len(big)))
			} else {
				w.(http.Flusher).Flush()
			}
			w.Write(big)
		}))
		host := strings.TrimPrefix(srv.URL, "http://")
		c := New(Options{ConfigPath: writeHosts(t, host, fmt.Sprintf("server = %q\n", srv.URL))})
		ref, _ := ParseReference(host + "/a/b:c")
		if _, err := c.Referrers(context.Background(), ref, subject, ""); !errors.Is(err, ErrTooLarge) {
			t.Errorf("referrers list of %d bytes (Content-Length sent: %v): %v, want ErrTooLarge", len(big), declare, err)
		}
		if _, err := c.Resolve(context.Background(), ref); !errors.Is(err, ErrTooLarge) {
			t.Errorf("manifest of %d bytes (Content-Length sent: %v): %v, want ErrTooLarge", len(big), declare, err)
		}
		srv.Close()
	}
}
