// Package oci indexes images read directly from disk: OCI image layouts and
// OCI or docker-save archives. It finds, decompresses and verifies the
// layers into the blob cache and leaves reading the layer tars to tarlayer
// and merging and caching their indexes to overlayfs, which other layered
// sources share.
package oci
