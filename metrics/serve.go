package metrics

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"time"
)

// Path is where the servers of this package answer.
const Path = "/metrics"

// Handler answers GET /metrics with the families collect adds to a fresh
// Set, built on each scrape.
func Handler(collect func(*Set)) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET "+Path, func(w http.ResponseWriter, r *http.Request) {
		var s Set
		collect(&s)
		var buf bytes.Buffer
		if _, err := s.WriteTo(&buf); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", ContentType)
		w.Write(buf.Bytes())
	})
	return mux
}

// Server is an HTTP server on a listener of its own.
type Server struct {
	srv  *http.Server
	ln   net.Listener
	done chan error
	path string // the unix socket, removed by Close
}

// ServeUnix serves h on a unix socket at path (mode 0600; a stale socket
// left by a dead process is replaced).
func ServeUnix(path string, h http.Handler) (*Server, error) {
	if fi, err := os.Lstat(path); err == nil {
		if fi.Mode()&os.ModeSocket == 0 {
			return nil, fmt.Errorf("metrics: %s exists and is no socket", path)
		}
		if err := os.Remove(path); err != nil {
			return nil, fmt.Errorf("metrics: remove stale socket: %w", err)
		}
	}
	ln, err := net.Listen("unix", path)
	if err != nil {
		return nil, fmt.Errorf("metrics: listen on %s: %w", path, err)
	}
	if err := os.Chmod(path, 0o600); err != nil {
		ln.Close()
		return nil, fmt.Errorf("metrics: %w", err)
	}
	return serve(ln, h, path), nil
}

// ServeTCP serves h on a TCP address (host:port; port 0 picks one).
func ServeTCP(addr string, h http.Handler) (*Server, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("metrics: listen on %s: %w", addr, err)
	}
	return serve(ln, h, ""), nil
}

func serve(ln net.Listener, h http.Handler, path string) *Server {
	s := &Server{srv: &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}, ln: ln, done: make(chan error, 1), path: path}
	go func() { s.done <- s.srv.Serve(ln) }()
	return s
}

// Addr is the address the server listens on.
func (s *Server) Addr() net.Addr { return s.ln.Addr() }

// Close stops the server, ending scrapes in flight, and removes its socket.
func (s *Server) Close() error {
	err := s.srv.Close()
	if serr := <-s.done; serr != nil && !errors.Is(serr, http.ErrServerClosed) {
		err = errors.Join(err, serr)
	}
	if s.path != "" {
		if rerr := os.Remove(s.path); rerr != nil && !os.IsNotExist(rerr) {
			err = errors.Join(err, rerr)
		}
	}
	return err
}

// Shutdown stops the server after the scrapes in flight, or when ctx ends.
func (s *Server) Shutdown(ctx context.Context) error {
	err := s.srv.Shutdown(ctx)
	if err != nil {
		s.srv.Close()
	}
	<-s.done
	if s.path != "" {
		os.Remove(s.path)
	}
	return err
}

// ScrapeUnix fetches GET /metrics from the unix socket at path and parses
// it, reading at most limit bytes.
func ScrapeUnix(ctx context.Context, path string, limit int64) ([]Family, error) {
	tr := &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", path)
	}, DisableKeepAlives: true}
	defer tr.CloseIdleConnections()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://localhost"+Path, nil)
	if err != nil {
		return nil, err
	}
	resp, err := (&http.Client{Transport: tr}).Do(req)
	if err != nil {
		return nil, fmt.Errorf("metrics: scrape %s: %w", path, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("metrics: scrape %s: %s", path, resp.Status)
	}
	fams, err := Parse(&limitedReader{r: resp.Body, n: limit})
	if err != nil {
		return nil, fmt.Errorf("metrics: scrape %s: %w", path, err)
	}
	return fams, nil
}

// limitedReader is io.LimitReader that fails, rather than ends quietly,
// past its limit, so a truncated exposition is not taken for a whole one.
type limitedReader struct {
	r io.Reader
	n int64
}

func (l *limitedReader) Read(p []byte) (int, error) {
	// One byte past the limit tells an over-long body from one that ends there.
	if int64(len(p)) > l.n+1 {
		p = p[:l.n+1]
	}
	n, err := l.r.Read(p)
	if int64(n) > l.n {
		return 0, errors.New("exposition over its size limit")
	}
	l.n -= int64(n)
	return n, err
}
