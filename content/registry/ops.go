package registry

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// Docker's manifest media types, accepted alongside OCI's.
const (
	MediaTypeDockerManifest     = "application/vnd.docker.distribution.manifest.v2+json"
	MediaTypeDockerManifestList = "application/vnd.docker.distribution.manifest.list.v2+json"
)

// manifestAccept is every manifest type Resolve understands.
var manifestAccept = strings.Join([]string{
	ocispec.MediaTypeImageManifest, ocispec.MediaTypeImageIndex,
	MediaTypeDockerManifest, MediaTypeDockerManifestList,
}, ", ")

// maxManifest bounds a manifest or index read into memory (distribution's
// own limit is 4 MiB).
const maxManifest = 4 << 20

// IsIndex reports whether mediaType is an OCI index or a Docker manifest list.
func IsIndex(mediaType string) bool {
	return mediaType == ocispec.MediaTypeImageIndex || mediaType == MediaTypeDockerManifestList
}

// Resolve gives the descriptor ref names (a manifest or an index) from
// the first host with the resolve capability that has it.
func (c *Client) Resolve(ctx context.Context, ref Reference) (ocispec.Descriptor, error) {
	var desc ocispec.Descriptor
	err := c.onHosts(ctx, ref, CapResolve, "resolve "+ref.Object(), func(h Host) error {
		// GET rather than HEAD: some registries omit Docker-Content-Digest
		// on HEAD, and the body lets the digest be checked.
		data, mt, err := c.getManifest(ctx, h, ref, ref.Object())
		if err != nil {
			return err
		}
		desc = ocispec.Descriptor{MediaType: mt, Digest: digest.FromBytes(data), Size: int64(len(data))}
		return nil
	})
	return desc, err
}

func (c *Client) getManifest(ctx context.Context, h Host, ref Reference, object string) ([]byte, string, error) {
	resp, err := c.do(ctx, h, ref, request{
		method: http.MethodGet,
		path:   "/" + ref.Repository + "/manifests/" + object,
		header: http.Header{"Accept": {manifestAccept}},
		scope:  pullScope(ref),
		ok:     []int{http.StatusOK},
	})
	if err != nil {
		return nil, "", err
	}
	defer resp.Body.Close()
	data, err := readSmall(resp, maxManifest)
	if err != nil {
		return nil, "", fmt.Errorf("read manifest: %w", err)
	}
	if d, err := digest.Parse(object); err == nil {
		if err := d.Validate(); err == nil && d.Algorithm().Available() && d.Algorithm().FromBytes(data) != d {
			return nil, "", fmt.Errorf("manifest content does not match its digest %s", d)
		}
	}
	mt := resp.Header.Get("Content-Type")
	if i := strings.IndexByte(mt, ';'); i >= 0 {
		mt = strings.TrimSpace(mt[:i])
	}
	var probe struct {
		MediaType string `json:"mediaType"`
	}
	if json.Unmarshal(data, &probe) == nil && probe.MediaType != "" {
		mt = probe.MediaType
	}
	return data, mt, nil
}

// readSmall reads a JSON answer (a manifest, a referrers list) of at most
// limit bytes: a Content-Length over it is refused before the body is
// read, and the buffer grows only as bytes arrive.
func readSmall(resp *http.Response, limit int64) ([]byte, error) {
	if resp.ContentLength > limit {
		return nil, fmt.Errorf("%w: Content-Length %d, the limit is %d", ErrTooLarge, resp.ContentLength, limit)
	}
	data, err := io.ReadAll(io.LimitReader(resp.Body, limit+1))
	if err != nil {
		return nil, err
	}
	if int64(len(data)) > limit {
		return nil, fmt.Errorf("%w: more than %d bytes", ErrTooLarge, limit)
	}
	return data, nil
}

// FetchManifest fetches the manifest or index with digest d from ref's
// repository, checked against d.
func (c *Client) FetchManifest(ctx context.Context, ref Reference, d digest.Digest) ([]byte, ocispec.Descriptor, error) {
	var data []byte
	var mt string
	err := c.onHosts(ctx, ref, CapPull, "fetch manifest "+d.String(), func(h Host) error {
		var err error
		data, mt, err = c.getManifest(ctx, h, ref, d.String())
		return err
	})
	if err != nil {
		return nil, ocispec.Descriptor{}, err
	}
	return data, ocispec.Descriptor{MediaType: mt, Digest: d, Size: int64(len(data))}, nil
}

// Platform is the platform ImageManifest picks from an index.
var Platform = ocispec.Platform{OS: "linux", Architecture: "amd64"}

// ImageManifest resolves ref to an image manifest, picking the linux/amd64
// entry when ref names an index.
func (c *Client) ImageManifest(ctx context.Context, ref Reference) (ocispec.Manifest, ocispec.Descriptor, error) {
	desc, err := c.Resolve(ctx, ref)
	if err != nil {
		return ocispec.Manifest{}, desc, err
	}
	data, desc, err := c.FetchManifest(ctx, ref, desc.Digest)
	if err != nil {
		return ocispec.Manifest{}, desc, err
	}
	if IsIndex(desc.MediaType) {
		var idx ocispec.Index
		if err := json.Unmarshal(data, &idx); err != nil {
			return ocispec.Manifest{}, desc, &Error{Host: ref.Host, Repository: ref.Repository, Op: "parse index " + desc.Digest.String(), Err: err}
		}
		var have []string
		found := false
		for _, m := range idx.Manifests {
			if m.Platform != nil && m.Platform.OS == Platform.OS && m.Platform.Architecture == Platform.Architecture {
				desc, found = m, true
				break
			}
			if m.Platform != nil {
				have = append(have, m.Platform.OS+"/"+m.Platform.Architecture)
			}
		}
		if !found {
			return ocispec.Manifest{}, desc, &Error{Host: ref.Host, Repository: ref.Repository, Op: "pick platform",
				Err: fmt.Errorf("%w: no %s/%s manifest in index %s (it has %v)", ErrNotFound, Platform.OS, Platform.Architecture, desc.Digest, have)}
		}
		if data, desc, err = c.FetchManifest(ctx, ref, desc.Digest); err != nil {
			return ocispec.Manifest{}, desc, err
		}
	}
	var m ocispec.Manifest
	if err := json.Unmarshal(data, &m); err != nil {
		return m, desc, &Error{Host: ref.Host, Repository: ref.Repository, Op: "parse manifest " + desc.Digest.String(), Err: err}
	}
	return m, desc, nil
}

// BlobReader reads one blob by HTTP Range requests: each ReadAt is one
// Range GET (retried on the same host, then tried on the next), bounded
// by Timeout.
type BlobReader struct {
	c    *Client
	ctx  context.Context
	ref  Reference
	desc ocispec.Descriptor
	// Timeout bounds each ReadAt, retries included.
	Timeout time.Duration
}

// Blob gives a reader of desc's blob in ref's repository. ctx bounds all
// its reads; timeout bounds each (zero means one minute).
func (c *Client) Blob(ctx context.Context, ref Reference, desc ocispec.Descriptor, timeout time.Duration) *BlobReader {
	if timeout <= 0 {
		timeout = time.Minute
	}
	return &BlobReader{c: c, ctx: ctx, ref: ref, desc: desc, Timeout: timeout}
}

// Size is the blob's size from its descriptor.
func (b *BlobReader) Size() int64 { return b.desc.Size }

// ReadAt reads len(p) bytes at off; a read reaching past the blob's size
// gives the bytes up to it and io.EOF.
func (b *BlobReader) ReadAt(p []byte, off int64) (int, error) {
	ctx, cancel := context.WithTimeout(b.ctx, b.Timeout)
	defer cancel()
	return b.ReadAtContext(ctx, p, off)
}

// ReadAtContext is ReadAt bounded by ctx instead of Timeout.
func (b *BlobReader) ReadAtContext(ctx context.Context, p []byte, off int64) (int, error) {
	if off < 0 {
		return 0, fmt.Errorf("blob %s: negative offset %d", b.desc.Digest, off)
	}
	want := int64(len(p))
	var eof error
	if b.desc.Size > 0 {
		if off >= b.desc.Size {
			return 0, io.EOF
		}
		if off+want > b.desc.Size {
			want, eof = b.desc.Size-off, io.EOF
		}
	}
	if want == 0 {
		return 0, nil
	}
	n, err := b.c.readRange(ctx, b.ref, b.desc.Digest, p[:want], off)
	if err != nil {
		return n, err
	}
	return n, eof
}

// FetchRange reads exactly len(p) bytes of blob d at off with one Range
// GET; a registry that answers anything but that range is an error.
func (c *Client) FetchRange(ctx context.Context, ref Reference, d digest.Digest, p []byte, off int64) error {
	_, err := c.readRange(ctx, ref, d, p, off)
	return err
}

func (c *Client) readRange(ctx context.Context, ref Reference, d digest.Digest, p []byte, off int64) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	end := off + int64(len(p)) - 1
	n := 0
	once := func(h Host) error {
		resp, err := c.do(ctx, h, ref, request{
			method: http.MethodGet,
			path:   "/" + ref.Repository + "/blobs/" + d.String(),
			header: http.Header{"Range": {fmt.Sprintf("bytes=%d-%d", off, end)}},
			scope:  pullScope(ref),
			ok:     []int{http.StatusPartialContent, http.StatusOK},
		})
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusPartialContent {
			return fmt.Errorf("%w: HTTP %d for a range request", ErrRangeIgnored, resp.StatusCode)
		}
		s, e, err := parseContentRange(resp.Header.Get("Content-Range"))
		if err != nil {
			return fmt.Errorf("%w: %v", ErrRangeIgnored, err)
		}
		if s != off || e != end {
			return fmt.Errorf("%w: asked bytes %d-%d, got Content-Range %d-%d", ErrRangeIgnored, off, end, s, e)
		}
		n, err = io.ReadFull(resp.Body, p)
		if err != nil {
			return fmt.Errorf("read range body: %w (%v)", errBodyCut, err)
		}
		return nil
	}
	err := c.onHosts(ctx, ref, CapPull, fmt.Sprintf("read blob %s bytes %d-%d", d, off, end), func(h Host) error {
		return c.retryCut(ctx, func() error { return once(h) })
	})
	return n, err
}

// errBodyCut is a body that ended early: do retried the request, and
// retryCut retries the transfer.
var errBodyCut = errors.New("body cut short")

// retryCut runs once again, up to Attempts times with backoff, while it
// fails with errBodyCut: a body cut short (the registry died or the
// connection broke mid-transfer) is a connection error, retried like one.
func (c *Client) retryCut(ctx context.Context, once func() error) error {
	wait := c.opts.Backoff
	for attempt := 1; ; attempt++ {
		err := once()
		if !errors.Is(err, errBodyCut) || attempt >= c.opts.Attempts || ctx.Err() != nil {
			return err
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("%w (after %v)", ctx.Err(), err)
		case <-t.C:
		}
		wait *= 2
	}
}

// parseContentRange parses "bytes START-END/TOTAL" (TOTAL may be *).
func parseContentRange(v string) (int64, int64, error) {
	rest, ok := strings.CutPrefix(v, "bytes ")
	if !ok {
		return 0, 0, fmt.Errorf("Content-Range %q is not bytes START-END/TOTAL", truncate(v))
	}
	rng, _, ok := strings.Cut(rest, "/")
	if !ok {
		return 0, 0, fmt.Errorf("Content-Range %q has no total", truncate(v))
	}
	a, b, ok := strings.Cut(rng, "-")
	s, err1 := strconv.ParseInt(a, 10, 64)
	e, err2 := strconv.ParseInt(b, 10, 64)
	if !ok || err1 != nil || err2 != nil || s < 0 || e < s {
		return 0, 0, fmt.Errorf("Content-Range %q is not bytes START-END/TOTAL", truncate(v))
	}
	return s, e, nil
}

// PushBlob uploads data as one blob (a monolithic upload) to the first
// host with the push capability, unless the registry has it already.
func (c *Client) PushBlob(ctx context.Context, ref Reference, mediaType string, data []byte) (ocispec.Descriptor, error) {
	desc := ocispec.Descriptor{MediaType: mediaType, Digest: digest.FromBytes(data), Size: int64(len(data))}
	err := c.onHosts(ctx, ref, CapPush, "push blob "+desc.Digest.String(), func(h Host) error {
		if resp, err := c.do(ctx, h, ref, request{method: http.MethodHead, path: "/" + ref.Repository + "/blobs/" + desc.Digest.String(),
			scope: pushScope(ref), ok: []int{http.StatusOK}}); err == nil {
			resp.Body.Close()
			return nil
		} else if !errors.Is(err, ErrNotFound) {
			return err
		}
		resp, err := c.do(ctx, h, ref, request{method: http.MethodPost, path: "/" + ref.Repository + "/blobs/uploads/",
			scope: pushScope(ref), ok: []int{http.StatusAccepted}})
		if err != nil {
			return fmt.Errorf("start upload: %w", err)
		}
		loc := resp.Header.Get("Location")
		drain(resp)
		if loc == "" {
			return errors.New("start upload: no Location in the answer")
		}
		u, err := resp.Request.URL.Parse(loc)
		if err != nil {
			return fmt.Errorf("start upload: bad Location %q: %w", truncate(loc), err)
		}
		q := u.Query()
		q.Set("digest", desc.Digest.String())
		u.RawQuery = q.Encode()
		resp, err = c.do(ctx, h, ref, request{method: http.MethodPut, path: u.String(),
			header: http.Header{"Content-Type": {"application/octet-stream"}},
			body:   data, scope: pushScope(ref), ok: []int{http.StatusCreated}})
		if err != nil {
			return fmt.Errorf("finish upload: %w", err)
		}
		drain(resp)
		return nil
	})
	return desc, err
}

// PushManifest stores data (of mediaType) under tag, or under its digest
// when tag is empty. A manifest with a subject is also listed in the
// subject's referrers tag when the registry does not say (OCI-Subject)
// that it keeps the referrers itself.
func (c *Client) PushManifest(ctx context.Context, ref Reference, mediaType string, data []byte, tag string) (ocispec.Descriptor, error) {
	var m struct {
		ArtifactType string              `json:"artifactType"`
		Config       *ocispec.Descriptor `json:"config"`
		Subject      *ocispec.Descriptor `json:"subject"`
		Annotations  map[string]string   `json:"annotations"`
	}
	if err := json.Unmarshal(data, &m); err != nil {
		return ocispec.Descriptor{}, &Error{Host: ref.Host, Repository: ref.Repository, Op: "push manifest", Err: fmt.Errorf("not JSON: %w", err)}
	}
	desc := ocispec.Descriptor{MediaType: mediaType, Digest: digest.FromBytes(data), Size: int64(len(data)),
		ArtifactType: m.ArtifactType, Annotations: m.Annotations}
	if desc.ArtifactType == "" && m.Config != nil && m.Config.MediaType != ocispec.MediaTypeEmptyJSON {
		desc.ArtifactType = m.Config.MediaType
	}
	object := tag
	if object == "" {
		object = desc.Digest.String()
	}
	subjectKept := false
	err := c.onHosts(ctx, ref, CapPush, "push manifest "+object, func(h Host) error {
		resp, err := c.do(ctx, h, ref, request{method: http.MethodPut, path: "/" + ref.Repository + "/manifests/" + object,
			header: http.Header{"Content-Type": {mediaType}}, body: data, scope: pushScope(ref), ok: []int{http.StatusCreated}})
		if err != nil {
			return err
		}
		subjectKept = resp.Header.Get("OCI-Subject") != ""
		drain(resp)
		return nil
	})
	if err != nil || m.Subject == nil || subjectKept {
		return desc, err
	}
	return desc, c.addToReferrersTag(ctx, ref, m.Subject.Digest, desc)
}

// ReferrersTag is the tag the OCI 1.1 referrers tag schema keeps the
// referrers of subject under: ALG-HEX, cut to a tag's 128 characters.
func ReferrersTag(subject digest.Digest) string {
	t := subject.Algorithm().String() + "-" + subject.Encoded()
	if len(t) > 128 {
		t = t[:128]
	}
	return t
}

func (c *Client) addToReferrersTag(ctx context.Context, ref Reference, subject digest.Digest, desc ocispec.Descriptor) error {
	idx, err := c.referrersFromTag(ctx, ref, subject)
	if err != nil && !errors.Is(err, ErrNotFound) {
		return err
	}
	for _, d := range idx.Manifests {
		if d.Digest == desc.Digest {
			return nil
		}
	}
	idx.Manifests = append(idx.Manifests, desc)
	idx.SchemaVersion = 2
	idx.MediaType = ocispec.MediaTypeImageIndex
	data, err := json.Marshal(idx)
	if err != nil {
		return err
	}
	_, err = c.PushManifest(ctx, ref, ocispec.MediaTypeImageIndex, data, ReferrersTag(subject))
	return err
}

func (c *Client) referrersFromTag(ctx context.Context, ref Reference, subject digest.Digest) (ocispec.Index, error) {
	var idx ocispec.Index
	tref := ref
	tref.Tag, tref.Digest = ReferrersTag(subject), ""
	err := c.onHosts(ctx, ref, CapPull, "read referrers tag "+tref.Tag, func(h Host) error {
		data, _, err := c.getManifest(ctx, h, tref, tref.Tag)
		if err != nil {
			return err
		}
		return json.Unmarshal(data, &idx)
	})
	return idx, err
}

// Referrers lists the manifests whose subject is subject, of artifactType
// when it is not empty: the OCI 1.1 referrers API where the registry has
// it, else the referrers tag schema.
func (c *Client) Referrers(ctx context.Context, ref Reference, subject digest.Digest, artifactType string) ([]ocispec.Descriptor, error) {
	var idx ocispec.Index
	apiMissing := false
	err := c.onHosts(ctx, ref, CapPull, "list referrers of "+subject.String(), func(h Host) error {
		path := "/" + ref.Repository + "/referrers/" + subject.String()
		if artifactType != "" {
			path += "?artifactType=" + url.QueryEscape(artifactType)
		}
		resp, err := c.do(ctx, h, ref, request{method: http.MethodGet, path: path,
			header: http.Header{"Accept": {ocispec.MediaTypeImageIndex}}, scope: pullScope(ref), ok: []int{http.StatusOK}})
		if errors.Is(err, ErrNotFound) {
			// A registry with the API answers 200 even for an unknown
			// subject; a 404 means it has no API.
			apiMissing = true
			return nil
		}
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		data, err := readSmall(resp, maxManifest)
		if err != nil {
			return fmt.Errorf("read referrers list: %w", err)
		}
		if err := json.Unmarshal(data, &idx); err != nil {
			return fmt.Errorf("parse referrers list: %w", err)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	if apiMissing {
		idx, err = c.referrersFromTag(ctx, ref, subject)
		if errors.Is(err, ErrNotFound) {
			return nil, nil
		}
		if err != nil {
			return nil, err
		}
	}
	var out []ocispec.Descriptor
	for _, d := range idx.Manifests {
		if artifactType == "" || d.ArtifactType == artifactType {
			out = append(out, d)
		}
	}
	return out, nil
}
