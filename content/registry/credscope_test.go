package registry

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/opencontainers/go-digest"
)

// seenRequest is what a server outside the registry was sent.
type seenRequest struct {
	method, path, query string
	header              http.Header
	body                []byte
}

// recorder is a server that keeps every request it is sent.
type recorder struct {
	mu   sync.Mutex
	reqs []seenRequest
}

func (rec *recorder) record(r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	rec.mu.Lock()
	defer rec.mu.Unlock()
	rec.reqs = append(rec.reqs, seenRequest{r.Method, r.URL.Path, r.URL.RawQuery, r.Header.Clone(), body})
}

func (rec *recorder) seen() []seenRequest {
	rec.mu.Lock()
	defer rec.mu.Unlock()
	return append([]seenRequest(nil), rec.reqs...)
}

// credentialed is a registry front that answers 401 with a Basic
// challenge unless the request carries user:pass and the hosts.toml
// header, counting the requests it let through.
func credentialed(user, pass string, passed *atomic.Int32, next http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		u, p, ok := r.BasicAuth()
		if !ok || u != user || p != pass || r.Header.Get("X-Registry-Key") != "k1" {
			w.Header().Set("WWW-Authenticate", `Basic realm="test"`)
			http.Error(w, "unauthorized", http.StatusUnauthorized)
			return
		}
		passed.Add(1)
		next(w, r)
	}
}

// credentialedClient is a client with user:pass for host and a hosts.toml
// entry (with a header) naming srvURL as host's server.
func credentialedClient(t *testing.T, host, srvURL string) *Client {
	t.Helper()
	return New(Options{
		ConfigPath: writeHosts(t, host, fmt.Sprintf("server = %q\n[header]\nx-registry-key = \"k1\"\n", srvURL)),
		Credentials: func(h string) (Credentials, error) {
			if h != host {
				return Credentials{}, fmt.Errorf("credentials asked for %s, not the registry %s", h, host)
			}
			return Credentials{Username: "node", Secret: "pw"}, nil
		},
		Attempts: 1,
	})
}

// leaked names the credentials a request outside the registry carried.
func leaked(r seenRequest) string {
	var out []string
	for _, k := range []string{"Authorization", "X-Registry-Key"} {
		if v := r.header.Values(k); len(v) > 0 {
			out = append(out, fmt.Sprintf("%s: %q", k, v))
		}
	}
	return strings.Join(out, ", ")
}

// TestUploadLocationElsewhereGetsNoCredentials: an upload the registry
// sends to another host (a storage backend) is finished there without
// the registry's credentials or hosts.toml headers, and one it keeps on
// itself (an absolute Location naming the registry) still carries them.
func TestUploadLocationElsewhereGetsNoCredentials(t *testing.T) {
	data := []byte("layer bytes")
	d := digest.FromBytes(data)
	var storage recorder
	store := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		storage.record(r)
		w.WriteHeader(http.StatusCreated)
	}))
	defer store.Close()

	for _, elsewhere := range []bool{true, false} {
		t.Run(fmt.Sprintf("elsewhere=%v", elsewhere), func(t *testing.T) {
			var passed, puts atomic.Int32
			var own recorder
			reg := httptest.NewServer(credentialed("node", "pw", &passed, func(w http.ResponseWriter, r *http.Request) {
				switch {
				case r.Method == http.MethodHead:
					http.NotFound(w, r)
				case r.Method == http.MethodPost && r.URL.Path == "/v2/a/b/blobs/uploads/":
					loc := store.URL + "/upload/1?state=s"
					if !elsewhere {
						loc = "http://" + r.Host + "/v2/a/b/blobs/uploads/1?state=s"
					}
					w.Header().Set("Location", loc)
					w.WriteHeader(http.StatusAccepted)
				case r.Method == http.MethodPut:
					puts.Add(1)
					own.record(r)
					w.WriteHeader(http.StatusCreated)
				default:
					http.Error(w, "unexpected "+r.Method+" "+r.URL.Path, http.StatusBadRequest)
				}
			}))
			defer reg.Close()
			host := strings.TrimPrefix(reg.URL, "http://")
			ref, _ := ParseReference(host + "/a/b:c")
			before := len(storage.seen())
			if _, err := credentialedClient(t, host, reg.URL).PushBlob(context.Background(), ref, "x", data); err != nil {
				t.Fatal(err)
			}
			got := storage.seen()[before:]
			if !elsewhere {
				if len(got) != 0 || puts.Load() != 1 || passed.Load() != 3 {
					t.Fatalf("upload on the registry: storage got %d requests, registry %d PUTs and %d credentialed requests; want 0, 1 and 3 (HEAD, POST, PUT)",
						len(got), puts.Load(), passed.Load())
				}
				return
			}
			if len(got) != 1 || got[0].method != http.MethodPut || got[0].path != "/upload/1" || string(got[0].body) != string(data) {
				t.Fatalf("storage got %+v, want one PUT of the blob to /upload/1", got)
			}
			if q, _ := url.ParseQuery(got[0].query); q.Get("digest") != d.String() || q.Get("state") != "s" {
				t.Fatalf("storage PUT query %q, want the Location's state and the digest", got[0].query)
			}
			if l := leaked(got[0]); l != "" {
				t.Fatalf("the upload host %s was sent the registry's %s", store.URL, l)
			}
			if passed.Load() != 2 || puts.Load() != 0 {
				t.Fatalf("registry let %d credentialed requests through and got %d PUTs, want 2 (HEAD, POST) and 0", passed.Load(), puts.Load())
			}
		})
	}
}

// TestBlobRedirectElsewhereGetsNoCredentials: a blob GET the registry
// redirects to a storage backend on another host reaches it without the
// registry's credentials or hosts.toml headers, and reads the range.
func TestBlobRedirectElsewhereGetsNoCredentials(t *testing.T) {
	blob := []byte(strings.Repeat("0123456789", 50))
	d := digest.FromBytes(blob)
	var storage recorder
	store := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		storage.record(r)
		if r.Header.Get("Range") != "bytes=100-149" {
			http.Error(w, "range "+r.Header.Get("Range"), http.StatusBadRequest)
			return
		}
		w.Header().Set("Content-Range", fmt.Sprintf("bytes 100-149/%d", len(blob)))
		w.WriteHeader(http.StatusPartialContent)
		w.Write(blob[100:150])
	}))
	defer store.Close()
	var passed atomic.Int32
	reg := httptest.NewServer(credentialed("node", "pw", &passed, func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodGet || r.URL.Path != "/v2/a/b/blobs/"+d.String() {
			http.NotFound(w, r)
			return
		}
		http.Redirect(w, r, store.URL+"/blobs/1?sig=x", http.StatusTemporaryRedirect)
	}))
	defer reg.Close()
	host := strings.TrimPrefix(reg.URL, "http://")
	ref, _ := ParseReference(host + "/a/b:c")
	p := make([]byte, 50)
	if err := credentialedClient(t, host, reg.URL).FetchRange(context.Background(), ref, d, p, 100); err != nil {
		t.Fatal(err)
	}
	if string(p) != string(blob[100:150]) {
		t.Fatalf("read %q, want the blob's bytes 100-149", p)
	}
	got := storage.seen()
	if len(got) != 1 || got[0].path != "/blobs/1" || got[0].query != "sig=x" {
		t.Fatalf("storage got %+v, want the one redirected GET", got)
	}
	if l := leaked(got[0]); l != "" {
		t.Fatalf("the redirect target %s was sent the registry's %s", store.URL, l)
	}
	if passed.Load() != 1 {
		t.Fatalf("registry let %d credentialed requests through, want 1", passed.Load())
	}
}

// TestChallengeElsewhereNotAnswered: a 401 from the host an upload was
// sent to is an error, not a challenge to answer: its realm would be
// sent the registry's credentials.
func TestChallengeElsewhereNotAnswered(t *testing.T) {
	var realm recorder
	evil := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/token" {
			realm.record(r)
			json.NewEncoder(w).Encode(map[string]any{"token": "tok"})
			return
		}
		w.Header().Set("WWW-Authenticate", fmt.Sprintf(`Bearer realm="http://%s/token"`, r.Host))
		http.Error(w, "unauthorized", http.StatusUnauthorized)
	}))
	defer evil.Close()
	var passed atomic.Int32
	reg := httptest.NewServer(credentialed("node", "pw", &passed, func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodPost {
			w.Header().Set("Location", evil.URL+"/upload/1")
			w.WriteHeader(http.StatusAccepted)
			return
		}
		http.NotFound(w, r)
	}))
	defer reg.Close()
	host := strings.TrimPrefix(reg.URL, "http://")
	ref, _ := ParseReference(host + "/a/b:c")
	_, err := credentialedClient(t, host, reg.URL).PushBlob(context.Background(), ref, "x", []byte("x"))
	if err == nil || !strings.Contains(err.Error(), "401") {
		t.Fatalf("upload to a host that challenges: %v, want its 401", err)
	}
	if got := realm.seen(); len(got) != 0 {
		t.Fatalf("the upload host's realm was asked for a token %d times (%s), want never", len(got), leaked(got[0]))
	}
}
