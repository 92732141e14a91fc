package disklayout

import (
	"encoding/binary"
	"testing"
)

func TestRecordSizes(t *testing.T) {
	for _, c := range []struct {
		name string
		v    any
		want int
	}{
		{"SuperBlock", SuperBlock{}, SuperBlockSize},
		{"GroupDesc", GroupDesc{}, GroupDescSize64},
		{"Inode", Inode{}, InodeCoreSize + InodeExtraSize},
		{"ExtentHeader", ExtentHeader{}, ExtentSize},
		{"Extent", Extent{}, ExtentSize},
		{"ExtentIdx", ExtentIdx{}, ExtentSize},
		{"ExtentTail", ExtentTail{}, 4},
		{"Dirent", Dirent{}, DirentHeaderSize},
		{"DirentTail", DirentTail{}, DirentTailSize},
		{"DxRootInfo", DxRootInfo{}, DxRootInfoSize},
		{"DxCountLimit", DxCountLimit{}, 4},
		{"DxEntry", DxEntry{}, DxEntrySize},
		{"DxTail", DxTail{}, DxTailSize},
		{"XattrHeader", XattrHeader{}, XattrHeaderSize},
		{"XattrEntry", XattrEntry{}, XattrEntrySize},
		{"XattrIbodyHeader", XattrIbodyHeader{}, XattrIbodySize},
		{"JournalSuperBlock", JournalSuperBlock{}, JournalSuperBlockSize},
	} {
		if got := binary.Size(c.v); got != c.want {
			t.Errorf("%s: size %d, want %d", c.name, got, c.want)
		}
	}
}
