package registry

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// tlsRegistry writes hosts.toml for an https server at srvURL with tlsKeys
// (ca, skip_verify, client), the server's certificate as ca.pem and a
// client certificate as cert.pem and key.pem beside it.
func tlsRegistry(t *testing.T, srv *httptest.Server, tlsKeys string) (host, configPath string) {
	t.Helper()
	host = strings.TrimPrefix(srv.URL, "https://")
	configPath = writeHosts(t, host, fmt.Sprintf("server = %q\n%s\n", srv.URL, tlsKeys))
	dir := filepath.Join(configPath, host)
	if err := os.WriteFile(filepath.Join(dir, "ca.pem"), pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw}), 0o644); err != nil {
		t.Fatal(err)
	}
	selfSigned(t, dir)
	return host, configPath
}

// tokenServer hands out token to every request, counting them.
func tokenServer(calls *atomic.Int32, token string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		json.NewEncoder(w).Encode(map[string]any{"token": token})
	}
}

// TestPlainHTTPRealmRefused: an https registry whose bearer challenge
// names an http:// realm is refused before the realm is asked anything,
// so credentials and the token never cross the network in the clear.
func TestPlainHTTPRealmRefused(t *testing.T) {
	var realmCalls atomic.Int32
	realm := httptest.NewServer(tokenServer(&realmCalls, "tok"))
	defer realm.Close()
	realmURL := realm.URL + "/token"
	reg := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") == "Bearer tok" {
			json.NewEncoder(w).Encode(ocispec.Manifest{MediaType: ocispec.MediaTypeImageManifest})
			return
		}
		w.Header().Set("WWW-Authenticate", fmt.Sprintf(`Bearer realm=%q,service="s"`, realmURL))
		http.Error(w, "unauthorized", http.StatusUnauthorized)
	}))
	defer reg.Close()
	host, cfg := tlsRegistry(t, reg, `ca = "ca.pem"`)
	c := New(Options{ConfigPath: cfg, Attempts: 1,
		Credentials: func(string) (Credentials, error) { return Credentials{Username: "node", Secret: "pw"}, nil }})
	ref, _ := ParseReference(host + "/a/b:c")
	_, err := c.Resolve(context.Background(), ref)
	t.Logf("refused: %v", err)
	if err == nil || !strings.Contains(err.Error(), realmURL) || !strings.Contains(err.Error(), "https://"+host) {
		t.Fatalf("resolve with an http realm: %v, want a refusal naming the realm %s and the registry https://%s", err, realmURL, host)
	}
	if n := realmCalls.Load(); n != 0 {
		t.Fatalf("the http realm was asked %d times, want never", n)
	}
}

// TestRealmTLS: a token realm on another host is reached with default TLS
// (system roots), never the registry's ca, skip_verify or client
// certificate, so a realm only the registry's settings would trust is
// refused; a realm on the registry itself keeps them.
func TestRealmTLS(t *testing.T) {
	for _, keys := range []string{`ca = "ca.pem"`, "skip_verify = true"} {
		for _, elsewhere := range []bool{true, false} {
			t.Run(fmt.Sprintf("%s/elsewhere=%v", strings.Fields(keys)[0], elsewhere), func(t *testing.T) {
				const token = "tok"
				// Every httptest TLS server has the same certificate, so
				// the registry's ca.pem would trust this one too.
				var realmCalls, ownTokenCalls atomic.Int32
				var ownTokenClientCert atomic.Bool
				realm := httptest.NewTLSServer(tokenServer(&realmCalls, token))
				defer realm.Close()
				issue := tokenServer(&ownTokenCalls, token)
				reg := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					switch {
					case r.URL.Path == "/token":
						ownTokenClientCert.Store(len(r.TLS.PeerCertificates) > 0)
						issue(w, r)
					case r.Header.Get("Authorization") == "Bearer "+token:
						json.NewEncoder(w).Encode(ocispec.Manifest{MediaType: ocispec.MediaTypeImageManifest})
					default:
						realmURL := "https://" + r.Host + "/token"
						if elsewhere {
							realmURL = realm.URL + "/token"
						}
						w.Header().Set("WWW-Authenticate", fmt.Sprintf(`Bearer realm=%q,service="s"`, realmURL))
						http.Error(w, "unauthorized", http.StatusUnauthorized)
					}
				}))
				reg.TLS = &tls.Config{ClientAuth: tls.RequestClientCert}
				reg.StartTLS()
				defer reg.Close()
				host, cfg := tlsRegistry(t, reg, keys+"\nclient = [[\"cert.pem\", \"key.pem\"]]")
				c := New(Options{ConfigPath: cfg, Attempts: 1,
					Credentials: func(string) (Credentials, error) { return Credentials{Username: "node", Secret: "pw"}, nil }})
				ref, _ := ParseReference(host + "/a/b:c")
				_, err := c.Resolve(context.Background(), ref)
				if elsewhere {
					t.Logf("refused: %v", err)
					if err == nil || !strings.Contains(err.Error(), "certificate") || !strings.Contains(err.Error(), strings.TrimPrefix(realm.URL, "https://")) {
						t.Fatalf("resolve with a realm on another host trusted only by the registry's settings: %v, want a certificate error naming the realm", err)
					}
					if n := realmCalls.Load(); n != 0 {
						t.Fatalf("the realm on another host answered %d token requests, want none (its certificate must not verify)", n)
					}
					return
				}
				if err != nil {
					t.Fatalf("resolve with the realm on the registry: %v", err)
				}
				if ownTokenCalls.Load() != 1 || !ownTokenClientCert.Load() {
					t.Fatalf("the registry's own realm got %d token requests (client certificate: %v), want 1 with the hosts.toml client certificate",
						ownTokenCalls.Load(), ownTokenClientCert.Load())
				}
			})
		}
	}
}
