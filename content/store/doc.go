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
// # Lock order
//
// In one process the mutexes are taken in the order layer.mu, Store.mu,
// memTier.mu (a read that starts a fetch holds its layer's mutex while it
// counts the fetch in the Store and looks in the memory tier); Store.tmu,
// the trace's, is taken alone. None is held across I/O, a file lock, a
// fetch or a wait for another goroutine, so no holder can wait, however
// indirectly, on another holder: opening a layer's files, which may wait
// for another process, runs outside Store.mu (AddLayer), and reads wait
// for a fetch, or for a span another read is inflating, on its channel,
// each within its own deadline; Fill and Prefetch wait the same way
// within their context.
//
// Across processes (and between Stores of one process: OFD locks conflict
// between open file descriptions, and go with the description when it is
// closed or its process dies) a layer's files carry three kinds of lock:
//
//   - the header lock, bytes [0, 32) of the chunk map: held by a Store
//     while it opens and checks the layer's files, waiting for nothing
//     but their I/O, and by RemoveLayer around its unlinks;
//   - the in-use mark, a read lock on one byte far beyond the map's end,
//     held by every Store with the layer open; a prune tries the write
//     lock under the header lock, without waiting;
//   - chunk locks, write locks on byte ranges of the data file: held by
//     a fetch from before it rereads the map until its chunks are written,
//     and by RemoveLayer (the whole file) around its unlinks.
//
// The order is header lock, then chunk lock. A fetch holding a chunk lock
// takes no other lock and waits only for the registry (each attempt
// bounded) and the disk; each chunk lock is one F_OFD_SETLK of the whole
// range, all or nothing, so no holder of a range waits for another range.
// The one holder that waits while it holds is RemoveLayer, header lock
// held, for the fetches' chunk locks: fetches never wait for the header
// lock, so that cannot cycle. Every wait polls with a bound, so a stopped
// holder cannot hold anyone for ever: a Store opening a layer waits
// initLockWait for the header lock (then serves the layer from memory),
// a fetch waits attemptTimeout for its range (then fetches without the
// disk tier), RemoveLayer waits initLockWait in all for its locks (a
// prune's removal also no longer than the prune's context).
//
// Within a Store, a layer's chunk locks are all on its one data file
// description, where they never conflict with each other; fetches of one
// process are kept apart by the layer's inflight map instead. A fetch that
// fails for one chunk drops it from inflight at once, so that the next
// read retries, and a retry may then lock the same range on the same
// description and lose that lock when the failed fetch unlocks its whole
// range. Another process may then fetch the chunk at the same time: a
// duplicate request, not wrong data, as both write bytes verified against
// the index, and bytes read back from disk are verified again.
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
