package index

// Internals the external tests need: the header layout, to wrap raw
// payloads past the checksum, and the sources' unexported entry points.
const (
	EncHeaderSize = encHeaderSize
	EncMagic      = encMagic
	EncVersion    = encVersion
	FlagLayer     = flagLayer
)

var (
	Castagnoli   = castagnoli
	ReadTarLayer = readTarLayer
	Merge        = merge
	OpenWalk     = openWalk
)

type (
	ImageConfig = imageConfig
	OCIManifest = ociManifest
)
