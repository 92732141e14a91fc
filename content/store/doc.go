// Package store is the node's lazy content store: it serves the file data
// of lazily pulled image layers to the block device (through
// blk/index.Opener) without the layers on disk, fetching only the pieces
// that reads need from the layer's registry.
//
// # Tiers
//
// A layer is known by its lazy-read index (content/lazyindex), which cuts
// the stored blob (gzip-compressed or a plain tar) into chunks (1 MiB by
// default) and records each chunk's SHA-256. A read of the uncompressed
// tar asks, in order:
//
//   - the memory tier: a least-recently-used cache bounded by
//     Options.MemoryBytes, holding verified chunks and, for gzip layers,
//     whole inflated spans (the bytes between two checkpoints), so that
//     the guest's many small reads of one span inflate it once;
//   - the node disk tier (Options.Dir): the chunks already fetched, on
//     disk across restarts and shared by every Store (every shim process)
//     using the same directory;
//   - the registry: one Range request for the missing chunk and the
//     missing chunks after it that the same read needs (up to
//     Options.MaxFetch in all), retried with backoff. Reads of a chunk already being fetched wait for that
//     fetch (in this process, and through file locks in others).
//
// Every chunk is verified against the index before any byte of it is
// used or stored; a chunk that does not verify is a read error and a log
// line, never data. A read waits and inflates at most
// Options.ReadTimeout; the fetch it started goes on for the reads after
// it. No mutex is held across
// network I/O: readers wait on the fetch's completion, each with its own
// deadline. The one lock a fetch holds is its chunks' byte-range lock in
// the data file, which other processes poll rather than block on, so it
// cannot stretch their reads either.
//
// # On-disk format
//
// Per layer, in <Dir>/layers/, named by the blob digest's hex:
//
//	<hex>.data    sparse, the size of the blob: every fetched chunk at its
//	              offset in the blob, holes elsewhere
//	<hex>.chunks  the chunk map: a 32-byte header (magic "KFSXCHM\n",
//	              version u32, zero u32, chunk size u64, blob size u64,
//	              little-endian), then one byte per chunk: 1 when the
//	              chunk's bytes in the data file are durable, else 0
//
// A byte per chunk rather than a bit lets processes set their own chunks'
// entries with one write each, never rewriting a byte another process
// may be setting. A chunk map whose header does not match the index (an
// index of the same blob with another chunk size, a damaged header) starts
// over; the data file stays, as its bytes are at blob offsets whatever the
// chunking and are verified before use.
//
// # Crash safety and sharing
//
// A process fetching chunks first takes an OFD write lock
// (F_OFD_SETLK, polled: a blocking wait could outlast a read's deadline)
// on their byte range in the data file, then rereads their map entries:
// another process may have fetched them meanwhile, and they are read from
// disk instead. Fetched chunks are verified, written to the data file,
// made durable (fdatasync), and only then marked in the map. So a marked
// chunk's bytes were durable before the mark; a crash before the mark
// leaves the chunk unmarked and it is fetched again. Bytes the map claims
// but that are wrong anyway (a torn write the disk did not report, a
// damaged file) are caught because every chunk read from disk is verified
// the first time a Store reads it; it is then fetched again, never served.
// A write that fails (ENOSPC, EDQUOT, EIO) leaves the chunks unmarked,
// punches their blocks out of the data file, logs one line, and the layer
// is served from memory; writing is tried again a minute later, as space
// may have been freed. The node cache does not evict: a layer's files grow
// to the blob's size at most, and are removed with the node's cache
// directory.
//
// # Fill and prefetch
//
// Fill fetches the rest of every layer onto the node disk at a bounded
// rate (a token bucket). StartTrace and StopTrace record the chunks a pod
// reads in its first seconds, in order; the Trace's binary form is meant
// to be stored as an artifact referring to the image, and Prefetch
// replays it at the next start of the image on any node. A replayed trace
// is whatever its pusher wrote, so Prefetch fetches each chunk once and
// stops at a byte budget the caller sets.
package store
