package boot

import "testing"

func TestRootMount(t *testing.T) {
	mi := `22 1 259:1 / / ro,relatime shared:1 - ext4 /dev/pmem0p1 ro,dax=always,errors=remount-ro,data=ordered
23 22 0:5 / /dev rw,nosuid shared:2 - devtmpfs devtmpfs rw,size=10k
`
	src, typ, opts, ok := rootMount(mi)
	if !ok || src != "/dev/pmem0p1" || typ != "ext4" || opts != "ro,relatime ro,dax=always,errors=remount-ro,data=ordered" {
		t.Fatalf("got %q %q %q %v", src, typ, opts, ok)
	}
	if _, _, _, ok := rootMount("23 22 0:5 / /dev rw - devtmpfs devtmpfs rw\n"); ok {
		t.Fatal("found a root in a table without one")
	}
}
