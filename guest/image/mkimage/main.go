// Command mkimage turns a file holding an ext4 filesystem at 3 MiB into a
// guest rootfs image in Kata's layout: two DOS partition tables and the
// nvdimm pfn info block that lets the guest map the image with DAX, as
// Kata's image_builder.sh and its nsdax tool write them. It writes only the
// first 3 MiB, so build-image.sh can make the filesystem in place
// (mkfs.ext4 -d -E offset=3145728) with no loop device.
//
//	mkimage IMAGE
package main

import (
	"fmt"
	"os"
)

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: mkimage IMAGE (an ext4 filesystem at 3 MiB to the end of the file)")
		os.Exit(2)
	}
	if err := run(os.Args[1]); err != nil {
		fmt.Fprintf(os.Stderr, "mkimage: %v\n", err)
		os.Exit(1)
	}
}

func run(path string) error {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := writeLayout(f); err != nil {
		return err
	}
	st, err := f.Stat()
	if err != nil {
		return err
	}
	if err := checkLayout(f, st.Size()); err != nil {
		return fmt.Errorf("%s: written layout does not read back: %w", path, err)
	}
	return f.Close()
}
