# cython: language_level=3
# The C layout of the caching pool: enums and structures only, no class and no function, so
# that the pool's own modules (pool_segments, pool_inspect, pool_history and the internal .pxd
# helpers) can cimport it without importing gpumem._core.pool at run time (no import cycle).
# pool.pxd re-exports all of it: downstream Cython keeps `from gpumem._core.pool cimport ...`.
from libc.stdint cimport uint64_t, int64_t
from libcpp.atomic cimport atomic

cdef enum:
    GM_SLI = 5                       # log2 of the second-level subdivisions (32 per octave)
    GM_NCLASSES = 1920               # (64 - GM_SLI) * 32 + 32, rounded up to whole 64-bit words
    GM_NWORDS = 30                   # GM_NCLASSES / 64

# Return codes of gm_alloc / gm_free.
cdef enum:
    GM_OK = 0
    GM_MISS = 1                      # no cached block fits: the caller must add a segment
    GM_UNKNOWN_STREAM = 2            # the stream was never registered with this pool
    GM_BAD_BLOCK = 3                 # gm_free of a block that is not live (double free)

# gm_block.heap_index of a block whose pages are unmapped (expandable segments, pool_pages.pyx):
# in no heap, not live, not reserved; it merges only with unmapped neighbours.
cdef enum:
    GM_UNMAPPED = -3

ctypedef struct gm_segment

ctypedef struct gm_block:
    gm_segment* segment
    size_t offset                    # from the segment base
    size_t size                      # bytes this block spans (rounded)
    size_t requested                 # bytes the user asked for (live blocks)
    uint64_t stream                  # allocating stream; when free, the stream whose heap holds it
    uint64_t serial                  # nonzero while live; identifies the allocation
    gm_block* prev                   # address-order neighbours inside the segment
    gm_block* next
    gm_block* free_prev              # links in a size-class list (free blocks only)
    gm_block* free_next
    int heap_index                   # index into gm_pool.heaps while free, -1 while live or in a
                                     # front cache (then serial is 0)
    int size_class
    char _pad[40]                    # 128 bytes, 64-aligned: two threads' blocks never share a
                                     # cache line (the front caches write serial and requested)

ctypedef struct gm_segment:
    uint64_t handle                  # backend's name for the raw allocation
    size_t base                      # address of byte 0 (synthetic for OpenCL)
    size_t size                      # address span of its blocks (mapped and unmapped)
    size_t unmapped                  # bytes of its unmapped blocks: reserved = size - unmapped
    int is_small                     # 1: the small pool (<= small_size requests)
    size_t live_blocks
    uint64_t stream                  # stream that caused its creation (informational)
    gm_block* first
    gm_segment* prev                 # all segments of the pool, newest first
    gm_segment* next

ctypedef struct gm_heap:             # free blocks of one (stream, small|large) pair
    uint64_t stream
    uint64_t top                     # bit w set when words[w] != 0
    uint64_t words[GM_NWORDS]
    gm_block* heads[GM_NCLASSES]
    size_t free_bytes
    size_t free_blocks

ctypedef struct gm_config:
    size_t granularity               # every block size is a multiple of this (power of two)
    size_t small_size                # requests up to this go to the small pool
    size_t small_segment             # segment size of the small pool
    size_t large_segment             # segment size for large requests below large_threshold
    size_t large_threshold
    size_t large_round               # bigger requests get their own segment, rounded to this
    size_t max_split_size            # cached blocks at least this big are not split for smaller requests
    size_t large_split_min           # a large block is split only if the remainder is at least this
    size_t oversize_slack            # an unsplittable block may exceed the request by this much

ctypedef struct gm_stats:
    atomic[size_t] reserved_bytes    # held from the device, in segments
    atomic[size_t] in_use_bytes      # in live blocks (rounded sizes)
    atomic[size_t] requested_bytes   # what users asked for, live blocks
    atomic[size_t] peak_in_use_bytes
    atomic[size_t] peak_reserved_bytes
    atomic[size_t] active_blocks
    atomic[size_t] num_segments
    atomic[size_t] num_allocs
    atomic[size_t] num_frees
    atomic[size_t] hits
    atomic[size_t] misses
    atomic[size_t] segments_created
    atomic[size_t] segments_released
    atomic[size_t] whole_free_bytes  # in segments that are one free block (releasable at once)
    atomic[uint64_t] next_serial

# History: alloc/free events in C rings (one per pool, written under the pool lock, and one per
# front cache, written under its lock); the newest `capacity` events of each are kept.
ctypedef struct gm_event:            # 32 bytes: two per cache line
    uint64_t t_ns                    # CLOCK_MONOTONIC read by a ticker every ~1 ms (_pool_clock.pxd)
    uint64_t id                      # the block's serial (the buffer id)
    uint64_t size_op                 # bytes requested, | 1 << 63 for a free
    uint64_t stream

ctypedef struct gm_ring:
    gm_event* events                 # NULL: not recording
    size_t capacity                  # a power of two
    size_t mask                      # capacity - 1 (the hot path's index: one load, no subtract)
    size_t count                     # events written (those before count - capacity are gone)
    uint64_t last_t                  # the clock value of this ring's last event (~0: none yet)

# Front caches: blocks freed through gm_free by nogil callers are kept, still carved, in a small
# cache of the freeing thread and handed back by its next gm_alloc of the same (stream, size)
# without the pool lock. Threads are spread round-robin over GM_NSHARDS caches; each has its own
# lock and counters (one cache line apart), so threads on different caches share no writes.
cdef enum:
    GM_NSHARDS = 8                   # front caches per pool
    GM_FRONT_BINS = 8                # (stream, rounded request) bins per front cache
    GM_FRONT_DEPTH = 4               # blocks per bin
    GM_FRONT_BYTES = 4 << 20         # at most this many bytes cached per front cache

ctypedef struct gm_front_bin:
    uint64_t stream
    size_t size                      # rounded request size the blocks serve; 0: bin unused
    int count
    gm_block* blocks[GM_FRONT_DEPTH]

ctypedef struct gm_shard:
    atomic[int] lock                 # order: a shard's lock before the pool's
    gm_front_bin bins[GM_FRONT_BINS]
    uint64_t serial_next             # serials handed out by front hits: [next, end) reserved
    uint64_t serial_end
    # written under this shard's lock only; read lock-free by counters()
    atomic[size_t] cached_bytes      # bytes of the blocks in the bins (the pool counts them as in use)
    atomic[size_t] cached_blocks
    atomic[size_t] requested_delta   # add to the pool's requested_bytes (mod 2**64)
    atomic[size_t] allocs            # front hits (also counted as hits)
    atomic[size_t] frees             # frees into the bins
    gm_ring history
    char _pad[64]

ctypedef struct gm_pool:
    atomic[int] lock
    gm_config cfg
    gm_stats stats
    gm_heap** heaps                  # heaps[2*k] small, heaps[2*k+1] large, for stream slot k
    int nheaps
    int last_slot                    # slot of the last stream looked up (most calls use one stream)
    gm_segment* segments
    gm_block* spare_blocks           # recycled block structs
    void** chunks                    # malloc'd arrays of block structs, freed with the pool
    int nchunks
    int chunks_cap
    gm_shard* shards                 # GM_NSHARDS front caches, 64-aligned
    gm_ring history                  # events of the pool path (under the pool lock)
    atomic[size_t] history_capacity  # events kept per ring; 0: history off
