package index

// The header layout, so that the external tests can wrap raw payloads in a
// valid header and reach the payload decoder past the checksum.
const (
	EncHeaderSize = encHeaderSize
	EncMagic      = encMagic
	EncVersion    = encVersion
	FlagLayer     = flagLayer
)

// Castagnoli is the CRC-32C table of the header checksum.
var Castagnoli = castagnoli
