package registry

import (
	"context"
	"encoding/json"
	"fmt"
	"github.com/kata-fsx/kata-fsx/test/registrytest"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/crypto/bcrypt"
)

func testHtpasswd(t *testing.T, user, pass string) string {
	t.Helper()
	h, err := bcrypt.GenerateFromPassword([]byte(pass), bcrypt.MinCost)
	if err != nil {
		t.Fatal(err)
	}
	return user + ":" + string(h) + "\n"
}

func TestParseChallenges(t *testing.T) {
	got, err := ParseChallenges([]string{`Bearer realm="https://auth.example/token",service="registry.example",scope="repository:a/b:pull"`, `Basic realm="x, y"`})
	if err != nil {
		t.Fatal(err)
	}
	want := []Challenge{
		{Scheme: "bearer", Params: map[string]string{"realm": "https://auth.example/token", "service": "registry.example", "scope": "repository:a/b:pull"}},
		{Scheme: "basic", Params: map[string]string{"realm": "x, y"}},
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("got %+v, want %+v", got, want)
	}
	if _, err := ParseChallenges([]string{`Bearer realm="unterminated`}); err == nil {
		t.Fatal("unterminated quote accepted")
	}
}

// TestRegistryBearer puts a token server and a reverse proxy demanding
// its tokens in front of a real registry, as Docker Hub and Harbor do.
func TestRegistryBearer(t *testing.T) {
	reg := registrytest.Start(t, registrytest.Options{})
	img := buildImage(t)
	skopeoPush(t, img, reg.Addr+"/kata/bearer:v1")

	const token = "tok-for-kata"
	var tokenCalls, challenged atomic.Int32
	tokens := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tokenCalls.Add(1)
		u, p, ok := r.BasicAuth()
		if !ok || u != "kata" || p != "pw" || r.URL.Query().Get("service") != "test-registry" ||
			r.URL.Query().Get("scope") != "repository:kata/bearer:pull" {
			http.Error(w, "bad token request "+r.URL.RawQuery, http.StatusUnauthorized)
			return
		}
		json.NewEncoder(w).Encode(map[string]any{"token": token, "expires_in": 300})
	}))
	defer tokens.Close()
	backend, _ := url.Parse("http://" + reg.Addr)
	proxy := httputil.NewSingleHostReverseProxy(backend)
	front := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") != "Bearer "+token {
			challenged.Add(1)
			w.Header().Set("WWW-Authenticate", fmt.Sprintf(`Bearer realm=%q,service="test-registry",scope="repository:kata/bearer:pull"`, tokens.URL+"/token"))
			http.Error(w, "unauthorized", http.StatusUnauthorized)
			return
		}
		proxy.ServeHTTP(w, r)
	}))
	defer front.Close()
	host := strings.TrimPrefix(front.URL, "http://")
	dir := t.TempDir()
	os.MkdirAll(filepath.Join(dir, host), 0o755)
	os.WriteFile(filepath.Join(dir, host, "hosts.toml"), []byte(fmt.Sprintf("server = %q\n", front.URL)), 0o644)
	cfg := filepath.Join(dir, "config.json")
	os.WriteFile(cfg, []byte(fmt.Sprintf(`{"auths":{"http://%s":{"username":"kata","password":"pw"}}}`, host)), 0o600)

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	ref, _ := ParseReference(host + "/kata/bearer:v1")
	c := New(Options{ConfigPath: dir, Credentials: DockerConfigCredentials(cfg)})
	checkPulls(ctx, t, c, ref, img)
	if tokenCalls.Load() != 1 || challenged.Load() != 1 {
		t.Fatalf("%d token fetches and %d challenges, want 1 and 1 (the token is reused)", tokenCalls.Load(), challenged.Load())
	}

	bad := New(Options{ConfigPath: dir, Credentials: func(string) (Credentials, error) { return Credentials{Username: "kata", Secret: "wrong"}, nil }})
	if _, err := bad.Resolve(ctx, ref); err == nil || !strings.Contains(err.Error(), "token") {
		t.Fatalf("wrong password: %v, want a token error", err)
	}
}
