// Package overlayfs builds image trees from stacks of layers with the
// kernel overlayfs's semantics: Merge folds per-layer indexes (see package
// index) into one, Cache keeps per-layer indexes across builds, and
// FromLayers is the source for containerd's overlayfs snapshot directories.
// Merge and Cache live here rather than in one source's package because
// every layered source needs both: the per-layer indexes oci and any
// registry source read from tars merge and cache like host layer
// directories. It is not called layers so that it does not collide with
// the variables of that name its callers have.
package overlayfs
