// Package tarlayer reads one uncompressed image layer tar into a per-layer
// index (see package index), the form overlayfs.Merge folds into an image.
// It is a package of its own because every source of layer tars (OCI
// layouts and archives, a registry) must read them alike and reject the
// same hostile archives; those sources differ only in how they find and
// verify the blobs. It is not called tar so that it does not shadow
// archive/tar, which it and its callers import.
package tarlayer
