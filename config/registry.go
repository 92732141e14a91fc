package config

import (
	"fmt"
	"path/filepath"
	"time"
)

// DefaultRegistryConfigPath is containerd's own hosts.toml directory, so
// kata-fsx reaches registries exactly as the node's containerd does.
const DefaultRegistryConfigPath = "/etc/containerd/certs.d"

// Registry is the [kata_fsx.registry] table: how lazy image content
// reaches OCI registries.
type Registry struct {
	// ConfigPath is a directory in containerd's certs.d layout: one
	// subdirectory per registry host holding a hosts.toml (mirrors, CAs,
	// client certificates, plain HTTP). Empty means none: https to every
	// registry itself.
	ConfigPath string `toml:"config_path"`
	// AuthFile is a docker-style config.json with registry credentials
	// ("auths"); empty means docker login's file, if any.
	AuthFile string `toml:"auth_file"`
	// CacheMemoryMB bounds the lazy store's memory tier per process.
	CacheMemoryMB int `toml:"cache_memory_mb"`
	// ReadTimeout is the deadline, in seconds, of one guest read that
	// needs the registry; after it the guest gets an I/O error.
	ReadTimeout int `toml:"read_timeout"`
	// MaxFetchMB caps one Range request of merged adjacent chunks.
	MaxFetchMB int `toml:"max_fetch_mb"`
	// MaxIndexMB caps an index artifact's blob, read whole into memory,
	// whatever the size of the layer it indexes.
	MaxIndexMB int `toml:"max_index_mb"`
	// BackgroundFillMbps fetches the rest of a lazy image after the pod
	// starts, at most this many megabits per second; 0 turns it off.
	BackgroundFillMbps int `toml:"background_fill_mbps"`
	// Prefetch replays the image's newest prefetch trace artifact, if it
	// has one, at pod start.
	Prefetch bool `toml:"prefetch"`
	// PushTrace records the chunks a pod reads in its first TraceSeconds
	// and pushes them as the image's prefetch trace when it has none. Off
	// by default: the trace tells everyone who can pull the image what
	// the pod read, it is pushed with the node's credentials, and a
	// hostile guest's reads would become every later node's prefetch.
	PushTrace bool `toml:"push_trace"`
	// TraceSeconds is how long after the container starts its reads are
	// recorded into a prefetch trace.
	TraceSeconds int `toml:"trace_seconds"`
	// MaxTraceMB bounds the bytes one replayed trace may make the node
	// fetch (never more than the image's layers hold); a longer trace is
	// trimmed.
	MaxTraceMB int `toml:"max_trace_mb"`
	// LazyImageAnnotation lets a pod's AnnotationLazyImage name a registry
	// image for its first container's rootfs (off: a pod author must not
	// make the node reach any registry unless the operator agrees).
	LazyImageAnnotation bool `toml:"lazy_image_annotation"`
}

// AnnotationLazyImage names a registry image (registry:HOST/REPO[:TAG|
// @DIGEST]) that the shim serves lazily, on imagefs-blk, as the pod's
// first container's rootfs in place of the rootfs containerd mounted,
// until the kata-fsx snapshotter passes lazy layers itself.
const AnnotationLazyImage = "io.kata-fsx.image.lazy"

// Defaults of the [kata_fsx.registry] lazy store keys.
const (
	DefaultCacheMemoryMB = 64
	DefaultReadTimeout   = 30
	DefaultMaxFetchMB    = 8
	DefaultTraceSeconds  = 10
	DefaultMaxTraceMB    = 512
	// DefaultMaxIndexMB holds the index of a layer of about 8 GiB of tar
	// (its 32 KiB windows every 4 MiB take most of an index).
	DefaultMaxIndexMB = 64
	// maxIndexMBLimit is the lazy-read index encoding's own bound.
	maxIndexMBLimit = 4096
)

// DefaultRegistry is the [kata_fsx.registry] table when the file has none.
func DefaultRegistry() Registry {
	return Registry{ConfigPath: DefaultRegistryConfigPath, CacheMemoryMB: DefaultCacheMemoryMB, ReadTimeout: DefaultReadTimeout,
		MaxFetchMB: DefaultMaxFetchMB, MaxIndexMB: DefaultMaxIndexMB, Prefetch: true, TraceSeconds: DefaultTraceSeconds, MaxTraceMB: DefaultMaxTraceMB}
}

// ReadDeadline is ReadTimeout as a duration.
func (r *Registry) ReadDeadline() time.Duration { return time.Duration(r.ReadTimeout) * time.Second }

func validateRegistry(r *Registry, add func(*Error)) {
	if r.ConfigPath != "" && !filepath.IsAbs(r.ConfigPath) {
		add(&Error{Key: "kata_fsx.registry.config_path", Value: r.ConfigPath, Problem: "must be an absolute path",
			Fix: "use " + DefaultRegistryConfigPath + " (containerd's), or \"\" for none"})
	}
	if r.AuthFile != "" && !filepath.IsAbs(r.AuthFile) {
		add(&Error{Key: "kata_fsx.registry.auth_file", Value: r.AuthFile, Problem: "must be an absolute path",
			Fix: "name a docker-style config.json by its absolute path, or \"\" for docker login's"})
	}
	for _, k := range []struct {
		key       string
		v, lo, hi int
		fix       string
	}{
		{"cache_memory_mb", r.CacheMemoryMB, 1, 1 << 20, fmt.Sprintf("use %d (the default) or more for large images", DefaultCacheMemoryMB)},
		{"read_timeout", r.ReadTimeout, 1, 3600, fmt.Sprintf("use %d seconds (the default)", DefaultReadTimeout)},
		{"max_fetch_mb", r.MaxFetchMB, 1, 1024, fmt.Sprintf("use %d (the default)", DefaultMaxFetchMB)},
		{"max_index_mb", r.MaxIndexMB, 1, maxIndexMBLimit, fmt.Sprintf("use %d (the default); raise it only for images with layers of more than 8 GiB of tar, whose indexes are refused and streamed instead", DefaultMaxIndexMB)},
		{"background_fill_mbps", r.BackgroundFillMbps, 0, 1 << 20, "use 0 to turn the background fill off"},
		{"trace_seconds", r.TraceSeconds, 1, 3600, fmt.Sprintf("use %d (the default)", DefaultTraceSeconds)},
		{"max_trace_mb", r.MaxTraceMB, 1, 1 << 20, fmt.Sprintf("use %d (the default), or prefetch = false to replay no trace", DefaultMaxTraceMB)},
	} {
		if k.v < k.lo || k.v > k.hi {
			add(&Error{Key: "kata_fsx.registry." + k.key, Value: fmt.Sprint(k.v), Problem: fmt.Sprintf("outside [%d, %d]", k.lo, k.hi), Fix: k.fix})
		}
	}
}
