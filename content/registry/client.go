package registry

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"strings"
	"sync"
	"time"
)

// Options configure a Client.
type Options struct {
	// ConfigPath is containerd's hosts.toml directory
	// ([kata_fsx.registry] config_path); empty means none.
	ConfigPath string
	// Credentials gives basic credentials per host; nil means anonymous.
	Credentials CredentialFunc
	// Attempts bounds tries of one request on one host when the
	// connection fails or the registry answers 5xx (default 3).
	Attempts int
	// Backoff is the first wait between attempts, doubled each time
	// (default 200ms).
	Backoff time.Duration
	// UserAgent is sent with every request.
	UserAgent string
}

// Client talks to OCI registries. It is safe for concurrent use.
type Client struct {
	opts Options

	// elsewhere carries requests to hosts other than a registry's own
	// (upload Locations, redirect targets, token realms): default TLS,
	// so hosts.toml trust and client certificates stay with their host.
	elsewhere *http.Transport

	// mu guards the two caches. It is never held across a request or a
	// token fetch (authorize stores the token after the fetch); only the
	// first use of a host reads its CA files under it, a local read that
	// waits for no one.
	mu         sync.Mutex
	transports map[string]*http.Client // by host URL
	tokens     map[string]string       // by host URL + " " + scope
}

// New makes a Client.
func New(opts Options) *Client {
	if opts.Attempts <= 0 {
		opts.Attempts = 3
	}
	if opts.Backoff <= 0 {
		opts.Backoff = 200 * time.Millisecond
	}
	if opts.UserAgent == "" {
		opts.UserAgent = "kata-fsx"
	}
	tr := newTransport(0)
	tr.TLSClientConfig = &tls.Config{MinVersion: tls.VersionTLS12}
	return &Client{opts: opts, elsewhere: tr, transports: map[string]*http.Client{}, tokens: map[string]string{}}
}

// Error is a failed registry operation, naming where and what.
type Error struct {
	Host, Repository, Op string
	Err                  error
}

func (e *Error) Error() string {
	return fmt.Sprintf("registry %s, repository %s: %s: %v", e.Host, e.Repository, e.Op, e.Err)
}

func (e *Error) Unwrap() error { return e.Err }

// Sentinel causes, for errors.Is.
var (
	// ErrNotFound is a 404 from every host tried.
	ErrNotFound = errors.New("not found")
	// ErrRangeIgnored is a range request answered with something other
	// than exactly the range asked for.
	ErrRangeIgnored = errors.New("registry did not honour the range request")
	// ErrNoHost is an operation no configured host is capable of.
	ErrNoHost = errors.New("no host has the capability")
	// ErrUnauthorized is a 401 or 403 that credentials did not cure.
	ErrUnauthorized = errors.New("unauthorized")
	// ErrTooLarge is a blob or an answer over the size its descriptor
	// states or the caller allows.
	ErrTooLarge = errors.New("over the size limit")
)

// StatusError is an HTTP answer the operation did not expect.
type StatusError struct {
	Status int
	Body   string
}

func (e *StatusError) Error() string {
	if e.Body == "" {
		return fmt.Sprintf("HTTP %d %s", e.Status, http.StatusText(e.Status))
	}
	return fmt.Sprintf("HTTP %d %s: %s", e.Status, http.StatusText(e.Status), e.Body)
}

func (e *StatusError) Is(target error) bool {
	switch target {
	case ErrNotFound:
		return e.Status == http.StatusNotFound
	case ErrUnauthorized:
		return e.Status == http.StatusUnauthorized || e.Status == http.StatusForbidden
	}
	return false
}

// request is one registry API call, remade for every attempt.
type request struct {
	method string
	// path is after the API root, e.g. /library/alpine/manifests/latest,
	// or an absolute URL (an upload Location).
	path   string
	header http.Header
	body   []byte
	// scope is the token scope a bearer challenge is answered with.
	scope string
	// ok lists the statuses that end the call successfully.
	ok []int
}

// hostsFor gives the hosts for ref capable of cap, in order.
func (c *Client) hostsFor(ref Reference, cap Capability) ([]Host, error) {
	all, err := LookupHosts(c.opts.ConfigPath, ref.Host)
	if err != nil {
		return nil, err
	}
	var hs []Host
	for _, h := range all {
		if h.Capabilities&cap != 0 {
			hs = append(hs, h)
		}
	}
	if len(hs) == 0 {
		return nil, ErrNoHost
	}
	return hs, nil
}

// onHosts runs fn on each host capable of cap in order until one
// succeeds; the errors of all hosts tried are returned together.
func (c *Client) onHosts(ctx context.Context, ref Reference, cap Capability, op string, fn func(Host) error) error {
	hs, err := c.hostsFor(ref, cap)
	if err != nil {
		return &Error{Host: ref.Host, Repository: ref.Repository, Op: op, Err: err}
	}
	var errs []error
	for _, h := range hs {
		err := fn(h)
		if err == nil {
			return nil
		}
		errs = append(errs, &Error{Host: h.Host, Repository: ref.Repository, Op: op, Err: err})
		if ctx.Err() != nil {
			break
		}
	}
	return errors.Join(errs...)
}

// newTransport gives a transport without TLS settings; dial zero is 30s.
func newTransport(dial time.Duration) *http.Transport {
	if dial <= 0 {
		dial = 30 * time.Second
	}
	return &http.Transport{
		Proxy:                 http.ProxyFromEnvironment,
		DialContext:           (&net.Dialer{Timeout: dial, KeepAlive: 30 * time.Second}).DialContext,
		TLSHandshakeTimeout:   10 * time.Second,
		ResponseHeaderTimeout: 60 * time.Second,
		MaxIdleConnsPerHost:   16,
		IdleConnTimeout:       90 * time.Second,
	}
}

// origin is scheme://host:port in lower case with the scheme's default
// port spelled out, so two spellings of one endpoint compare equal.
func origin(scheme, hostport string) string {
	u := url.URL{Host: hostport}
	scheme = strings.ToLower(scheme)
	port := u.Port()
	switch {
	case port != "":
	case scheme == "https":
		port = "443"
	case scheme == "http":
		port = "80"
	}
	return scheme + "://" + net.JoinHostPort(strings.ToLower(u.Hostname()), port)
}

// sameOrigin reports whether u is on h itself: same scheme, host and port.
// Only such requests may carry h's credentials, headers and client
// certificate; another port or a downgrade to http is another server.
func sameOrigin(u *url.URL, h Host) bool {
	return origin(u.Scheme, u.Host) == origin(h.Scheme, h.Host)
}

// confined sends requests for origin through own and every other
// request (a redirect elsewhere) through elsewhere, stripped of
// Authorization and the hosts.toml headers: net/http keeps Authorization
// on a redirect to another port or scheme of the same host name, and
// other headers on any redirect.
type confined struct {
	origin    string
	own       http.RoundTripper
	elsewhere http.RoundTripper
	// strip holds canonical header names; hosts.toml keys reach the
	// request spelled as written, so matching is on canonical forms.
	strip map[string]bool
}

func (t *confined) RoundTrip(req *http.Request) (*http.Response, error) {
	if origin(req.URL.Scheme, req.URL.Host) == t.origin {
		return t.own.RoundTrip(req)
	}
	// A RoundTripper must not change its caller's request.
	req = req.Clone(req.Context())
	for k := range req.Header {
		if ck := http.CanonicalHeaderKey(k); ck == "Authorization" || t.strip[ck] {
			delete(req.Header, k)
		}
	}
	return t.elsewhere.RoundTrip(req)
}

// httpClient gives the (cached) client with h's TLS settings for h and
// default ones for any other host a request is sent or redirected to.
func (c *Client) httpClient(h Host) (*http.Client, error) {
	key := h.Scheme + "://" + h.Host
	c.mu.Lock()
	defer c.mu.Unlock()
	if hc, ok := c.transports[key]; ok {
		return hc, nil
	}
	tr := newTransport(h.DialTimeout)
	if h.Scheme == "https" {
		tc := &tls.Config{MinVersion: tls.VersionTLS12, InsecureSkipVerify: h.SkipVerify} //nolint:gosec // only where hosts.toml says skip_verify
		if len(h.CAs) > 0 {
			pool, err := x509.SystemCertPool()
			if err != nil {
				pool = x509.NewCertPool()
			}
			for _, f := range h.CAs {
				pem, err := os.ReadFile(f)
				if err != nil {
					return nil, fmt.Errorf("ca for %s: %w", h.Host, err)
				}
				if !pool.AppendCertsFromPEM(pem) {
					return nil, fmt.Errorf("ca for %s: %s holds no PEM certificate", h.Host, f)
				}
			}
			tc.RootCAs = pool
		}
		for _, cc := range h.Clients {
			key := cc.Key
			if key == "" {
				key = cc.Cert
			}
			cert, err := tls.LoadX509KeyPair(cc.Cert, key)
			if err != nil {
				return nil, fmt.Errorf("client certificate for %s: %w", h.Host, err)
			}
			tc.Certificates = append(tc.Certificates, cert)
		}
		tr.TLSClientConfig = tc
	}
	strip := map[string]bool{}
	for k := range h.Header {
		strip[http.CanonicalHeaderKey(k)] = true
	}
	hc := &http.Client{Transport: &confined{origin: origin(h.Scheme, h.Host), own: tr, elsewhere: c.elsewhere, strip: strip}}
	c.transports[key] = hc
	return hc, nil
}

// maxErrorBody bounds how much of an error answer is kept for messages.
const maxErrorBody = 512

// do runs r on h: retries on connection errors and 5xx with backoff
// (bounded by Attempts and ctx), answers one auth challenge, and returns
// the response when its status is in r.ok. The caller closes the body.
func (c *Client) do(ctx context.Context, h Host, ref Reference, r request) (*http.Response, error) {
	hc, err := c.httpClient(h)
	if err != nil {
		return nil, err
	}
	target := r.path
	own := true
	if strings.HasPrefix(target, "http://") || strings.HasPrefix(target, "https://") {
		u, err := url.Parse(target)
		if err != nil {
			return nil, fmt.Errorf("bad URL %q: %w", truncate(target), err)
		}
		own = sameOrigin(u, h)
	} else {
		target = h.URL() + r.path
		if h.Mirror && ref.Host != h.Host {
			// containerd tells mirrors which registry is meant.
			sep := "?"
			if strings.Contains(target, "?") {
				sep = "&"
			}
			target += sep + "ns=" + url.QueryEscape(ref.Host)
		}
	}
	authTried := false
	wait := c.opts.Backoff
	var lastErr error
	for attempt := 0; attempt < c.opts.Attempts; {
		req, err := http.NewRequestWithContext(ctx, r.method, target, bytes.NewReader(r.body))
		if err != nil {
			return nil, err
		}
		req.ContentLength = int64(len(r.body))
		if own {
			for k, v := range h.Header {
				req.Header[k] = v
			}
		}
		for k, v := range r.header {
			req.Header[k] = v
		}
		req.Header.Set("User-Agent", c.opts.UserAgent)
		if auth := c.authHeader(h, r.scope); auth != "" && own {
			req.Header.Set("Authorization", auth)
		}
		resp, err := hc.Do(req)
		if err != nil {
			lastErr = err
			if ctx.Err() != nil {
				return nil, err
			}
		} else {
			switch {
			case contains(r.ok, resp.StatusCode):
				return resp, nil
			// A challenge from another host (a Location or redirect
			// target) is not answered: its realm would get h's
			// credentials.
			case resp.StatusCode == http.StatusUnauthorized && !authTried && sameOrigin(resp.Request.URL, h):
				authTried = true
				chs, perr := ParseChallenges(resp.Header.Values("WWW-Authenticate"))
				drain(resp)
				if perr != nil {
					return nil, perr
				}
				if err := c.authorize(ctx, hc, h, r.scope, chs); err != nil {
					return nil, err
				}
				continue // the retry with credentials is not an attempt
			case resp.StatusCode >= 500:
				lastErr = statusErr(resp)
			default:
				return nil, statusErr(resp)
			}
		}
		attempt++
		if attempt >= c.opts.Attempts {
			break
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, fmt.Errorf("%w (after %v)", ctx.Err(), lastErr)
		case <-t.C:
		}
		wait *= 2
	}
	return nil, fmt.Errorf("%d attempts: %w", c.opts.Attempts, lastErr)
}

func statusErr(resp *http.Response) error {
	b, _ := io.ReadAll(io.LimitReader(resp.Body, maxErrorBody))
	drain(resp)
	return &StatusError{Status: resp.StatusCode, Body: strings.TrimSpace(string(b))}
}

// drain reads a little of a body so the connection can be reused, then
// closes it.
func drain(resp *http.Response) {
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 4096))
	resp.Body.Close()
}

func contains(s []int, v int) bool {
	for _, x := range s {
		if x == v {
			return true
		}
	}
	return false
}

func (c *Client) authHeader(h Host, scope string) string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.tokens[h.Scheme+"://"+h.Host+" "+scope]
}

// authorize answers a 401's challenges: a bearer token fetched from the
// realm, or basic credentials; it stores the Authorization value for
// the host and scope.
func (c *Client) authorize(ctx context.Context, hc *http.Client, h Host, scope string, chs []Challenge) error {
	var cred Credentials
	if c.opts.Credentials != nil {
		var err error
		if cred, err = c.opts.Credentials(h.Host); err != nil {
			return err
		}
	}
	var value string
	for _, ch := range chs {
		switch ch.Scheme {
		case "bearer":
			realm, err := realmURL(ch)
			if err != nil {
				return fmt.Errorf("%w: %w", ErrUnauthorized, err)
			}
			// The realm gets the registry's credentials and answers with
			// a token that is as good as them: never over plain http
			// when the registry itself is https.
			if h.Scheme == "https" && realm.Scheme != "https" {
				return fmt.Errorf("%w: bearer realm %s of registry %s is plain http; refusing to send credentials to it",
					ErrUnauthorized, realm, h.Scheme+"://"+h.Host)
			}
			// hosts.toml's ca, skip_verify and client certificate vouch
			// for the registry, not for a realm it names elsewhere (and
			// the registry's client would strip the credentials the
			// token protocol sends the realm).
			thc := hc
			if !sameOrigin(realm, h) {
				thc = &http.Client{Transport: &confined{origin: origin(realm.Scheme, realm.Host), own: c.elsewhere, elsewhere: c.elsewhere}}
			}
			tok, err := fetchToken(ctx, thc, realm, ch, scope, cred)
			if err != nil {
				return fmt.Errorf("%w: %w", ErrUnauthorized, err)
			}
			value = "Bearer " + tok
		case "basic":
			if cred.Username == "" && cred.Secret == "" {
				return fmt.Errorf("%w: basic auth needed and no credentials for %s (add them to the docker config)", ErrUnauthorized, h.Host)
			}
			req, _ := http.NewRequest(http.MethodGet, "http://x", nil)
			req.SetBasicAuth(cred.Username, cred.Secret)
			value = req.Header.Get("Authorization")
		default:
			continue
		}
		break
	}
	if value == "" {
		return fmt.Errorf("%w: no supported WWW-Authenticate challenge (want Bearer or Basic)", ErrUnauthorized)
	}
	c.mu.Lock()
	c.tokens[h.Scheme+"://"+h.Host+" "+scope] = value
	c.mu.Unlock()
	return nil
}

func pullScope(ref Reference) string { return "repository:" + ref.Repository + ":pull" }
func pushScope(ref Reference) string { return "repository:" + ref.Repository + ":pull,push" }
