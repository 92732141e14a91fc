// Package lazyimage finds the lazy-read indexes (content/lazyindex) of an
// image in an OCI registry: from the node's cache, else from an index
// artifact that refers to the image manifest (OCI 1.1 referrers, or the
// referrers tag schema where the registry has no API), else by streaming
// each layer once. It pushes such artifacts (kata-fsx image index) and the
// prefetch traces a pod's first reads leave, and reads layer byte ranges
// for the content store.
//
// An artifact is hostile input: every blob is bounded before it is read,
// checked against its digest, decoded by lazyindex.Decode (which validates
// it), and must index exactly the manifest's layer (blob digest and size)
// and the config's diff_id. Anything else is refused with a log line and
// that layer is streamed instead. See docs/lazy-images.md for the format
// and for what an index artifact is trusted with.
package lazyimage
