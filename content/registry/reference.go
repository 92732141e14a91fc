// Package registry reads and writes OCI registries the way containerd does:
// references normalised as containerd normalises them, hosts chosen from a
// hosts.toml directory (containerd's certs.d convention, mirrors first),
// bearer and basic auth, TLS with custom CAs, and blobs read by HTTP Range
// with every range checked.
package registry

import (
	"fmt"
	"regexp"
	"strings"

	"github.com/opencontainers/go-digest"
)

// DockerHub is the name containerd gives Docker Hub in references.
const DockerHub = "docker.io"

// dockerHubHost is the host Docker Hub's API is served from.
const dockerHubHost = "registry-1.docker.io"

// Reference is a parsed image reference: HOST[:PORT]/REPO[:TAG][@DIGEST].
type Reference struct {
	// Host is the registry name with its port, as used for the hosts.toml
	// directory (docker.io for Docker Hub).
	Host string
	// Repository is the path within the registry (library/alpine).
	Repository string
	// Tag is empty when only a digest was given.
	Tag string
	// Digest is empty when only a tag was given.
	Digest digest.Digest
}

var (
	componentRe = regexp.MustCompile(`^[a-z0-9]+(?:(?:[._]|__|[-]+)[a-z0-9]+)*$`)
	tagRe       = regexp.MustCompile(`^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$`)
	hostRe      = regexp.MustCompile(`^(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?$`)
)

// maxReferenceLen bounds what ParseReference reads, as distribution does
// for repository names (255) plus room for a host, tag and digest.
const maxReferenceLen = 1024

// ParseReference parses ref and normalises it as containerd does: a
// reference without a registry is on docker.io, a one-component Docker Hub
// repository is under library/, index.docker.io is docker.io, and a
// reference with neither tag nor digest gets the tag latest.
func ParseReference(ref string) (Reference, error) {
	bad := func(problem string) (Reference, error) {
		return Reference{}, fmt.Errorf("image reference %q: %s (use HOST[:PORT]/REPO[:TAG][@sha256:HEX])", truncate(ref), problem)
	}
	if ref == "" {
		return bad("empty")
	}
	if len(ref) > maxReferenceLen {
		return bad(fmt.Sprintf("longer than %d bytes", maxReferenceLen))
	}
	var r Reference
	name := ref
	if i := strings.IndexByte(name, '@'); i >= 0 {
		d, err := digest.Parse(name[i+1:])
		if err != nil {
			return bad(fmt.Sprintf("bad digest: %v", err))
		}
		r.Digest = d
		name = name[:i]
	}
	// A tag follows the last colon after the last slash; a colon before
	// the first slash is a port.
	if i := strings.LastIndexByte(name, ':'); i >= 0 && i > strings.LastIndexByte(name, '/') {
		r.Tag = name[i+1:]
		name = name[:i]
		if !tagRe.MatchString(r.Tag) {
			return bad(fmt.Sprintf("bad tag %q", r.Tag))
		}
	}
	host, repo := DockerHub, name
	if i := strings.IndexByte(name, '/'); i >= 0 {
		first := name[:i]
		if strings.ContainsAny(first, ".:") || first == "localhost" || strings.ToLower(first) != first {
			host, repo = first, name[i+1:]
		}
	}
	if !hostRe.MatchString(host) {
		return bad(fmt.Sprintf("bad registry host %q", host))
	}
	if host == "index.docker.io" {
		host = DockerHub
	}
	if host == DockerHub && !strings.Contains(repo, "/") {
		repo = "library/" + repo
	}
	if repo == "" {
		return bad("no repository")
	}
	if len(repo) > 255 {
		return bad("repository longer than 255 bytes")
	}
	for _, c := range strings.Split(repo, "/") {
		if !componentRe.MatchString(c) {
			return bad(fmt.Sprintf("bad repository component %q (lower-case letters, digits and . _ - separators)", c))
		}
	}
	r.Host, r.Repository = host, repo
	if r.Tag == "" && r.Digest == "" {
		r.Tag = "latest"
	}
	return r, nil
}

// String gives the reference in its normalised form.
func (r Reference) String() string {
	s := r.Host + "/" + r.Repository
	if r.Tag != "" {
		s += ":" + r.Tag
	}
	if r.Digest != "" {
		s += "@" + r.Digest.String()
	}
	return s
}

// Object is what a manifest request names: the digest when given, else the tag.
func (r Reference) Object() string {
	if r.Digest != "" {
		return r.Digest.String()
	}
	return r.Tag
}

func truncate(s string) string {
	if len(s) > 80 {
		return s[:80] + "..."
	}
	return s
}
