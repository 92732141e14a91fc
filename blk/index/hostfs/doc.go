// Package hostfs reads image trees on this host's file systems: FromDir
// indexes a directory and Opener serves the bytes of the indexes every
// source builds (directory files and cached blobs). Both sides refuse to
// follow symlinks out of a source root, so they live together; OpenBeneath
// is shared with sources that read image files from a directory. It is not
// called dir so that it does not collide with the variables of that name
// its callers have.
package hostfs
