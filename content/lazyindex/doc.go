// Package lazyindex builds and reads the lazy-read index of one image
// layer: the layer's tree as kata-fsx synthesizes ext4 from it (a
// blk/index per-layer index whose regular files point at their data's
// offset in the uncompressed tar), plus, for gzip layers, decompressor
// checkpoints at regular spans of the uncompressed stream (the zran /
// SOCI zTOC technique) from which any range of the layer can be inflated
// without decoding what precedes it. One pass over the layer builds it; a
// node holding it needs no other part of the layer to start a pod, and
// reads file data later by fetching only the compressed bytes from the
// nearest checkpoint on.
package lazyindex
