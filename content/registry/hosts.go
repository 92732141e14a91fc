package registry

import (
	"errors"
	"fmt"
	"io/fs"
	"net/url"
	"os"
	"path"
	"path/filepath"
	"strings"
	"time"

	"github.com/BurntSushi/toml"
)

// Capability is what a host may be used for, as in containerd's hosts.toml.
type Capability uint8

// The capabilities of containerd's hosts.toml.
const (
	CapPull Capability = 1 << iota
	CapResolve
	CapPush
	capAll = CapPull | CapResolve | CapPush
)

// Host is one endpoint a registry name is served from: a mirror or the
// registry's own server.
type Host struct {
	// Scheme is https, or http only where a hosts.toml said so.
	Scheme string
	// Host is the endpoint's host[:port].
	Host string
	// Path is the API root, /v2 unless override_path kept another.
	Path string
	// Capabilities say which operations may use this host.
	Capabilities Capability
	// CAs are PEM files trusted in addition to the system pool.
	CAs []string
	// Clients are certificate and key file pairs presented to the host;
	// Key is empty when the certificate file holds the key too.
	Clients []ClientCert
	// SkipVerify turns off TLS verification for this host.
	SkipVerify bool
	// Header is sent with every request to this host.
	Header map[string][]string
	// DialTimeout bounds connecting to the host (containerd 2's
	// dial_timeout, so a dead mirror falls through quickly); zero is 30s.
	DialTimeout time.Duration
	// Mirror is true for [host] entries, false for the server.
	Mirror bool
}

// ClientCert is one client certificate for TLS client authentication.
type ClientCert struct {
	Cert, Key string
}

// URL gives the host's API root as a URL.
func (h Host) URL() string { return h.Scheme + "://" + h.Host + h.Path }

// HostsFileError is a hosts.toml that cannot be used, with the key or line
// at fault.
type HostsFileError struct {
	File string
	// Where is a key path (host."https://m".ca) or "line N".
	Where   string
	Problem string
}

func (e *HostsFileError) Error() string {
	if e.Where == "" {
		return fmt.Sprintf("hosts file %s: %s", e.File, e.Problem)
	}
	return fmt.Sprintf("hosts file %s: %s: %s", e.File, e.Where, e.Problem)
}

// maxHostsFile bounds a hosts.toml read into memory.
const maxHostsFile = 1 << 20

// LookupHosts gives the hosts to try for registry name host (as in a
// Reference), mirrors in file order then the server, following
// containerd's certs.d convention: configPath/<host>/hosts.toml, else
// configPath/_default/hosts.toml, else https on the registry itself. An
// empty configPath means no configuration.
func LookupHosts(configPath, host string) ([]Host, error) {
	def := defaultServer(host)
	if configPath == "" {
		return []Host{def}, nil
	}
	if strings.ContainsAny(host, `/\`) || host == "." || host == ".." {
		return nil, fmt.Errorf("registry host %q is not a directory name", host)
	}
	for _, dir := range []string{filepath.Join(configPath, host), filepath.Join(configPath, "_default")} {
		file := filepath.Join(dir, "hosts.toml")
		data, err := readBounded(file)
		if errors.Is(err, fs.ErrNotExist) {
			if h, ok, err := legacyCerts(dir, def); err != nil || ok {
				return []Host{h}, err
			}
			continue
		}
		if err != nil {
			return nil, err
		}
		return ParseHostsFile(file, data, host)
	}
	return []Host{def}, nil
}

func readBounded(file string) ([]byte, error) {
	f, err := os.Open(file)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if st.Size() > maxHostsFile {
		return nil, &HostsFileError{File: file, Problem: fmt.Sprintf("larger than %d bytes", maxHostsFile)}
	}
	data := make([]byte, st.Size())
	if _, err := f.ReadAt(data, 0); err != nil && st.Size() > 0 {
		return nil, fmt.Errorf("read hosts file %s: %w", file, err)
	}
	return data, nil
}

func defaultServer(host string) Host {
	h := host
	if host == DockerHub {
		h = dockerHubHost
	}
	return Host{Scheme: "https", Host: h, Path: "/v2", Capabilities: capAll}
}

// hostBody holds the keys a [host."URL"] table shares with the top level.
type hostBody struct {
	Capabilities []string       `toml:"capabilities"`
	CA           any            `toml:"ca"`
	Client       any            `toml:"client"`
	SkipVerify   *bool          `toml:"skip_verify"`
	Header       map[string]any `toml:"header"`
	OverridePath bool           `toml:"override_path"`
	DialTimeout  string         `toml:"dial_timeout"`
}

// hostFields are the keys of the top level: a host's keys, the server and
// the [host."URL"] tables.
type hostFields struct {
	hostBody
	Server string              `toml:"server"`
	Host   map[string]hostBody `toml:"host"`
}

// ParseHostsFile parses a hosts.toml (file names it in errors and anchors
// relative ca and client paths) for registry name host. Unknown keys,
// unknown capabilities, URLs that are not http or https, and values of the
// wrong type are refused with the key at fault.
func ParseHostsFile(file string, data []byte, host string) ([]Host, error) {
	var f hostFields
	md, err := toml.Decode(string(data), &f)
	if err != nil {
		var pe toml.ParseError
		if errors.As(err, &pe) {
			return nil, &HostsFileError{File: file, Where: fmt.Sprintf("line %d", pe.Position.Line), Problem: pe.Message}
		}
		return nil, &HostsFileError{File: file, Problem: err.Error()}
	}
	for _, k := range md.Undecoded() {
		// Header values are free-form tables of strings, checked below.
		if len(k) >= 1 && k[0] == "header" || len(k) >= 3 && k[0] == "host" && k[2] == "header" {
			continue
		}
		return nil, &HostsFileError{File: file, Where: k.String(), Problem: "unknown key (known: server, capabilities, ca, client, skip_verify, header, override_path, dial_timeout, host)"}
	}
	base := filepath.Dir(file)
	var hosts []Host
	// md.Keys is in file order: mirrors are tried in the order written.
	for _, k := range md.Keys() {
		if len(k) != 2 || k[0] != "host" {
			continue
		}
		b := f.Host[k[1]]
		where := fmt.Sprintf("host.%q", k[1])
		h, err := makeHost(file, where, base, k[1], b)
		if err != nil {
			return nil, err
		}
		h.Mirror = true
		hosts = append(hosts, h)
	}
	server := defaultServer(host)
	if f.Server != "" {
		s, err := makeHost(file, "server", base, f.Server, f.hostBody)
		if err != nil {
			return nil, err
		}
		server = s
	} else if f.DialTimeout != "" || f.Capabilities != nil || f.CA != nil || f.Client != nil || f.SkipVerify != nil || f.Header != nil {
		// containerd applies top-level settings to the default server.
		s, err := makeHost(file, "server", base, server.URL(), f.hostBody)
		if err != nil {
			return nil, err
		}
		server = s
	}
	return append(hosts, server), nil
}

func makeHost(file, where, base, rawURL string, b hostBody) (Host, error) {
	caps, ca, client, skip, header, overridePath, dialTimeout := b.Capabilities, b.CA, b.Client, b.SkipVerify, b.Header, b.OverridePath, b.DialTimeout
	bad := func(key, problem string) (Host, error) {
		w := where
		if key != "" {
			w += "." + key
		}
		return Host{}, &HostsFileError{File: file, Where: w, Problem: problem}
	}
	u, err := url.Parse(rawURL)
	if err != nil {
		return bad("", fmt.Sprintf("bad URL %q: %v", rawURL, err))
	}
	if u.Scheme != "https" && u.Scheme != "http" {
		return bad("", fmt.Sprintf("URL %q must start with https:// (or http:// for plain HTTP)", rawURL))
	}
	if u.Host == "" || u.User != nil || u.RawQuery != "" || u.Fragment != "" {
		return bad("", fmt.Sprintf("URL %q must be scheme://host[:port][/path] without user, query or fragment", rawURL))
	}
	h := Host{Scheme: u.Scheme, Host: u.Host, Capabilities: capAll}
	p := path.Clean("/" + u.Path)
	switch {
	case p == "/":
		h.Path = "/v2"
	case overridePath:
		h.Path = p
	case strings.HasSuffix(p, "/v2"):
		h.Path = p
	default:
		h.Path = p + "/v2"
	}
	if caps != nil {
		h.Capabilities = 0
		for _, c := range caps {
			switch c {
			case "pull":
				h.Capabilities |= CapPull
			case "resolve":
				h.Capabilities |= CapResolve
			case "push":
				h.Capabilities |= CapPush
			default:
				return bad("capabilities", fmt.Sprintf("unknown capability %q (use pull, resolve, push)", c))
			}
		}
	}
	abs := func(p string) string {
		if filepath.IsAbs(p) {
			return p
		}
		return filepath.Join(base, p)
	}
	switch v := ca.(type) {
	case nil:
	case string:
		h.CAs = []string{abs(v)}
	case []any:
		for _, e := range v {
			s, ok := e.(string)
			if !ok {
				return bad("ca", "must be a path or a list of paths")
			}
			h.CAs = append(h.CAs, abs(s))
		}
	default:
		return bad("ca", "must be a path or a list of paths")
	}
	switch v := client.(type) {
	case nil:
	case string:
		h.Clients = []ClientCert{{Cert: abs(v)}}
	case []any:
		for _, e := range v {
			switch p := e.(type) {
			case string:
				h.Clients = append(h.Clients, ClientCert{Cert: abs(p)})
			case []any:
				if len(p) != 2 {
					return bad("client", "a pair must be [certificate, key]")
				}
				c, ok1 := p[0].(string)
				k, ok2 := p[1].(string)
				if !ok1 || !ok2 {
					return bad("client", "a pair must be two paths")
				}
				h.Clients = append(h.Clients, ClientCert{Cert: abs(c), Key: abs(k)})
			default:
				return bad("client", "must be a path, a list of paths or of [certificate, key] pairs")
			}
		}
	default:
		return bad("client", "must be a path, a list of paths or of [certificate, key] pairs")
	}
	if skip != nil {
		h.SkipVerify = *skip
	}
	if dialTimeout != "" {
		d, err := time.ParseDuration(dialTimeout)
		if err != nil || d <= 0 {
			return bad("dial_timeout", fmt.Sprintf("%q is not a positive duration (e.g. \"3s\")", dialTimeout))
		}
		h.DialTimeout = d
	}
	if len(header) > 0 {
		h.Header = map[string][]string{}
		for k, v := range header {
			switch x := v.(type) {
			case string:
				h.Header[k] = []string{x}
			case []any:
				for _, e := range x {
					s, ok := e.(string)
					if !ok {
						return bad("header."+k, "must be a string or a list of strings")
					}
					h.Header[k] = append(h.Header[k], s)
				}
			default:
				return bad("header."+k, "must be a string or a list of strings")
			}
		}
	}
	return h, nil
}

// legacyCerts reads a host directory without hosts.toml as containerd does
// (Docker's certs.d): *.crt are CAs, *.cert with the *.key of the same
// name are client pairs, all for the registry itself over https. ok is
// false when the directory does not exist.
func legacyCerts(dir string, h Host) (Host, bool, error) {
	ents, err := os.ReadDir(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return h, false, nil
	}
	if err != nil {
		return h, false, fmt.Errorf("registry hosts directory: %w", err)
	}
	for _, e := range ents {
		name := e.Name()
		switch {
		case strings.HasSuffix(name, ".crt"):
			h.CAs = append(h.CAs, filepath.Join(dir, name))
		case strings.HasSuffix(name, ".cert"):
			key := strings.TrimSuffix(name, ".cert") + ".key"
			if _, err := os.Stat(filepath.Join(dir, key)); err != nil {
				return h, false, fmt.Errorf("client certificate %s has no key %s beside it", filepath.Join(dir, name), key)
			}
			h.Clients = append(h.Clients, ClientCert{Cert: filepath.Join(dir, name), Key: filepath.Join(dir, key)})
		}
	}
	return h, true, nil
}
