/*
 * fake_libcuda.c - a test double of the NVIDIA driver library (libcuda.so.1).
 *
 * Lets the real cuda-python package (cuda.bindings.driver, and Cython code that cimports
 * cuda.bindings.cydriver) run end to end on a machine without a GPU. Built by
 * tests/fake_cuda/__init__.py:build():
 *
 *   gcc -std=gnu11 -O2 -Wall -Wextra -Werror -fPIC -shared -pthread -I$CUDA_HOME/include \
 *       -Wl,-soname,libcuda.so.1 -Wl,-z,defs -o libcuda.so.1 fake_libcuda.c
 *
 * The real cuda.h is included so types and CUresult codes are exact. Its macros rename the
 * versioned entry points (cuMemAlloc -> cuMemAlloc_v2, cuCtxPushCurrent ->
 * cuCtxPushCurrent_v2, ...), so each function below is defined under the header's name and
 * exported under the symbol cuda-python looks for. Every signature is also checked at compile
 * time against the PFN_<name>_v<version> typedefs of cudaTypedefs.h (see FAKE_PROCS).
 *
 * How cuda-python finds the functions:
 *   - cuda-bindings 13.0.x dlopen()s "libcuda.so.1", then uses cuGetProcAddress_v2 when it is
 *     exported and falls back to dlsym() of each versioned name when it is not.
 *   - cuda-bindings 13.5.x loads "libcuda.so.1" through cuda.pathfinder (already-loaded
 *     library, else plain dlopen, so LD_LIBRARY_PATH works) and REQUIRES cuGetProcAddress_v2.
 *   So cuGetProcAddress_v2 is implemented properly: the newest ABI introduced at or before the
 *   requested version, from a table holding every version cudaTypedefs.h lists for the
 *   implemented names (older ABIs it does not implement give NULL, never the wrong ABI); a
 *   version above the reported driver version gives CUDA_ERROR_INVALID_VALUE, as documented;
 *   the per-thread-default-stream twins are the same functions (work is synchronous).
 *   Building with -DFAKE_CUDA_NO_GET_PROC_ADDRESS leaves it out, to exercise the dlsym path
 *   of 13.0.x.
 *
 * Model:
 *   - N identical devices (compute capability 9.0, 132 SMs), each with a primary context
 *     (retain/release reference count) and a memory capacity.
 *   - Device memory is host memory (256-byte aligned; blocks of 1 MiB and more come from
 *     mmap(MAP_NORESERVE), so a test can "allocate" gigabytes), so device pointers can be read
 *     and written with memcpy; a table of live allocations validates every device range.
 *     Capacity accounting counts the requested sizes exactly: free = total - sum(live sizes).
 *   - All work runs synchronously when it is submitted. Streams and events are heap objects
 *     validated on every use. To exercise code that polls, a stream can be made "busy":
 *     fake_cuda_set_stream_busy(stream, n), or FAKE_CUDA_STREAM_BUSY_QUERIES=n (every async
 *     copy/memset leaves its stream busy for n queries). A busy stream answers the next n
 *     cuStreamQuery calls with CUDA_ERROR_NOT_READY; an event recorded on it copies the count
 *     and answers its own next queries the same way. cuStreamSynchronize, cuEventSynchronize
 *     and cuCtxSynchronize clear the counts.
 *   - One context stack per thread (cuCtxPushCurrent/PopCurrent/SetCurrent/GetCurrent).
 *   - Resources are NOT reclaimed when a primary context's reference count drops to zero, so
 *     fake_cuda_live_*() still show what a program forgot to free; calls that need a current
 *     context fail with CUDA_ERROR_CONTEXT_IS_DESTROYED while the current context is
 *     released.
 *   - Calls that the real driver ties to the current context (allocation, copies, memset,
 *     stream/event creation, the default stream, cuCtxSynchronize, cuMemGetInfo) return
 *     CUDA_ERROR_INVALID_CONTEXT without one; calls naming a handle (cuMemFree, cuMemFreeHost,
 *     cuStreamQuery(s), cuEventQuery, ...) do not need one.
 *
 * Environment, read by the first successful cuInit:
 *   FAKE_CUDA_DEVICE_COUNT          devices (default 1; 0 behaves like FAKE_CUDA_NO_DEVICE)
 *   FAKE_CUDA_TOTAL_MEM             bytes per device, suffix K/M/G/T allowed (default 8G)
 *   FAKE_CUDA_NO_DEVICE=1           cuInit returns CUDA_ERROR_NO_DEVICE
 *   FAKE_CUDA_STREAM_BUSY_QUERIES   see above (default 0)
 *   FAKE_CUDA_CONTEXT_BYTES         device memory a primary context takes while retained, as a
 *                                   real one does (default 0; suffixes as TOTAL_MEM)
 *   (an unparsable value makes cuInit print why and return CUDA_ERROR_INVALID_VALUE)
 * Read when used:
 *   FAKE_CUDA_DRIVER_VERSION        what cuDriverGetVersion reports (default 13000)
 *   FAKE_CUDA_TRACE=1               log every cuGetProcAddress lookup to stderr
 *
 * cuGetErrorName/String know the codes the fake returns and a few more; others give
 * CUDA_ERROR_INVALID_VALUE. Functions not listed here are not exported (cuda-python then
 * raises "function not found" when one is called).
 *
 * Test helpers (plain C, for ctypes): fake_cuda_live_allocations, fake_cuda_live_host_allocations,
 * fake_cuda_live_streams, fake_cuda_live_events, fake_cuda_primary_ctx_refcount,
 * fake_cuda_set_stream_busy; for virtual memory (see the VMM block) fake_cuda_live_vmm_handles,
 * fake_cuda_live_vmm_mappings, fake_cuda_live_vmm_reservations.
 */
#define _GNU_SOURCE
#include <cuda.h>
#include <cudaTypedefs.h>

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define FAKE_MAX_DEVICES 64
#define FAKE_ALIGNMENT 256                     /* cuMemAlloc guarantees at least this */
#define FAKE_MMAP_THRESHOLD (1u << 20)         /* larger blocks come from mmap (lazy pages) */
#define FAKE_DEFAULT_DRIVER_VERSION 13000
#define FAKE_CTX_STACK_MAX 256
#define FAKE_PCI_BUS_BASE 0x18

/* ------------------------------------------------------------------------------------------
 * State. Everything shared is guarded by g_lock; the context stack is per thread.
 * ------------------------------------------------------------------------------------------ */
struct CUctx_st {            /* CUcontext is struct CUctx_st *: one primary context per device */
    int device;
    int refcount;            /* cuDevicePrimaryCtxRetain - cuDevicePrimaryCtxRelease */
};

struct CUstream_st {
    int device;
    unsigned flags;
    int busy;                /* cuStreamQuery answers NOT_READY while > 0 (and decrements) */
    struct CUstream_st *next;
};

struct CUevent_st {
    int device;
    unsigned flags;
    int pending;             /* cuEventQuery answers NOT_READY while > 0 (and decrements) */
    struct CUstream_st *stream;   /* stream of the last record, NULL once that stream is gone */
    struct CUevent_st *next;
};

struct fake_device {
    size_t total;
    size_t used;             /* live cuMemAlloc sizes (and VMM handles), plus a live context's bytes */
    struct CUctx_st ctx;
    struct CUstream_st null_stream;   /* the default stream: 0, CU_STREAM_LEGACY, _PER_THREAD */
};

struct fake_block {          /* a live allocation */
    uintptr_t base;
    size_t size;             /* requested size */
    size_t mapped;           /* bytes obtained from mmap, 0 when from aligned_alloc */
    int device;
};

struct fake_table {          /* blocks sorted by base (device) or unsorted (host) */
    struct fake_block *v;
    size_t n, cap;
};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_init;
static int g_ndev;
static int g_busy_after_work;
static size_t g_context_bytes;   /* FAKE_CUDA_CONTEXT_BYTES */
static struct fake_device g_dev[FAKE_MAX_DEVICES];
static struct fake_table g_dev_blocks;
static struct fake_table g_host_blocks;
static struct CUstream_st *g_streams;
static struct CUevent_st *g_events;
static int g_nstreams, g_nevents;

static __thread struct CUctx_st *t_ctx_stack[FAKE_CTX_STACK_MAX];
static __thread int t_ctx_depth;

/* Run an implementation under the global lock and return its result. */
#define LOCKED(expr)                                   \
    do {                                               \
        CUresult r_;                                   \
        pthread_mutex_lock(&g_lock);                   \
        r_ = (expr);                                   \
        pthread_mutex_unlock(&g_lock);                 \
        return r_;                                     \
    } while (0)

#define TRY(expr)                                      \
    do {                                               \
        CUresult t_ = (expr);                          \
        if (t_ != CUDA_SUCCESS)                        \
            return t_;                                 \
    } while (0)

/* ------------------------------------------------------------------------------------------
 * Helpers (all called with g_lock held)
 * ------------------------------------------------------------------------------------------ */
static CUresult need_init(void) { return g_init ? CUDA_SUCCESS : CUDA_ERROR_NOT_INITIALIZED; }

static CUresult need_device(CUdevice dev)
{
    TRY(need_init());
    return (dev >= 0 && dev < g_ndev) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
}

static struct CUctx_st *lookup_ctx(CUcontext c)
{
    for (int i = 0; i < g_ndev; i++)
        if (c == &g_dev[i].ctx)
            return c;
    return NULL;
}

/* The current context of this thread, which must be alive. */
static CUresult current_ctx(struct CUctx_st **out)
{
    TRY(need_init());
    if (t_ctx_depth == 0)
        return CUDA_ERROR_INVALID_CONTEXT;
    struct CUctx_st *c = t_ctx_stack[t_ctx_depth - 1];
    if (c->refcount <= 0)
        return CUDA_ERROR_CONTEXT_IS_DESTROYED;
    *out = c;
    return CUDA_SUCCESS;
}

static int is_default_stream(CUstream h)
{
    return h == NULL || h == CU_STREAM_LEGACY || h == CU_STREAM_PER_THREAD;
}

/* A live stream, or the current context's default stream for 0 / LEGACY / PER_THREAD. */
static CUresult resolve_stream(CUstream h, struct CUstream_st **out)
{
    TRY(need_init());
    if (is_default_stream(h)) {
        struct CUctx_st *c;
        TRY(current_ctx(&c));
        *out = &g_dev[c->device].null_stream;
        return CUDA_SUCCESS;
    }
    for (struct CUstream_st *s = g_streams; s; s = s->next)
        if (s == h) {
            *out = s;
            return CUDA_SUCCESS;
        }
    return CUDA_ERROR_INVALID_HANDLE;
}

static CUresult resolve_event(CUevent h, struct CUevent_st **out)
{
    TRY(need_init());
    for (struct CUevent_st *e = g_events; e; e = e->next)
        if (e == h) {
            *out = e;
            return CUDA_SUCCESS;
        }
    return CUDA_ERROR_INVALID_HANDLE;
}

/* All work on s is done: the stream and the events recorded on it become idle. */
static void complete_stream(struct CUstream_st *s)
{
    s->busy = 0;
    for (struct CUevent_st *e = g_events; e; e = e->next)
        if (e->stream == s)
            e->pending = 0;
}

/* Work was just submitted to s (it already ran): optionally report the stream busy. */
static void submitted(struct CUstream_st *s)
{
    if (g_busy_after_work > s->busy)
        s->busy = g_busy_after_work;
}

static int table_reserve(struct fake_table *t)
{
    if (t->n < t->cap)
        return 0;
    size_t cap = t->cap ? 2 * t->cap : 64;
    struct fake_block *v = realloc(t->v, cap * sizeof *v);
    if (!v)
        return -1;
    t->v = v;
    t->cap = cap;
    return 0;
}

/* Index of the first block with base >= p (device table, sorted by base). */
static size_t lower_bound(uintptr_t p)
{
    size_t lo = 0, hi = g_dev_blocks.n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (g_dev_blocks.v[mid].base < p)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

static CUresult vmm_check_range(uintptr_t p, size_t n);   /* in the VMM block below */

/* [p, p + n) must lie inside one live device allocation or in mapped, accessible VMM memory. */
static CUresult check_range(CUdeviceptr dptr, size_t n)
{
    uintptr_t p = (uintptr_t)dptr;
    size_t i = lower_bound(p + 1);   /* first block starting after p */
    if (i == 0)
        return vmm_check_range(p, n);
    const struct fake_block *b = &g_dev_blocks.v[i - 1];   /* the last one starting at or before p */
    size_t off = p - b->base;
    if (off >= b->size || n > b->size - off)
        return vmm_check_range(p, n);
    return CUDA_SUCCESS;
}

/* Host-side storage for a block: mmap(MAP_NORESERVE) for big blocks so that a test can
 * "allocate" gigabytes without committing them, aligned_alloc for small ones. */
static void *raw_alloc(size_t n, size_t align, size_t *mapped)
{
    size_t rounded = (n + align - 1) & ~(align - 1);
    if (rounded < n)
        return NULL;
    if (rounded >= FAKE_MMAP_THRESHOLD) {
        void *p = mmap(NULL, rounded, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED)
            return NULL;
        *mapped = rounded;
        return p;
    }
    *mapped = 0;
    return aligned_alloc(align, rounded);
}

static void raw_free(void *p, size_t mapped)
{
    if (mapped)
        munmap(p, mapped);
    else
        free(p);
}

static long long parse_size(const char *s, int *ok)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    unsigned shift = 0;
    switch (*end) {
    case 'k': case 'K': shift = 10; end++; break;
    case 'm': case 'M': shift = 20; end++; break;
    case 'g': case 'G': shift = 30; end++; break;
    case 't': case 'T': shift = 40; end++; break;
    default: break;
    }
    if (*end == 'i' && shift) end++;             /* accept "8Gi" */
    if ((*end == 'b' || *end == 'B') && shift) end++;   /* and "8GB" / "8GiB" */
    *ok = errno == 0 && end != s && *end == '\0' && *s != '-' &&
          (shift == 0 || v <= (ULLONG_MAX >> shift)) && (v << shift) <= (unsigned long long)SIZE_MAX;
    return (long long)(v << shift);
}

static int env_int(const char *name, long long def, long long lo, long long hi, long long *out)
{
    const char *s = getenv(name);
    if (!s || !*s) {
        *out = def;
        return 0;
    }
    int ok;
    long long v = parse_size(s, &ok);
    if (!ok || v < lo || v > hi) {
        fprintf(stderr, "fake_libcuda: invalid %s=%s (expected %lld..%lld)\n", name, s, lo, hi);
        return -1;
    }
    *out = v;
    return 0;
}

static int driver_version(void)
{
    const char *s = getenv("FAKE_CUDA_DRIVER_VERSION");
    int v = s ? atoi(s) : 0;
    return v > 0 ? v : FAKE_DEFAULT_DRIVER_VERSION;
}

/* ------------------------------------------------------------------------------------------
 * Error names and strings (texts as the real driver words them)
 * ------------------------------------------------------------------------------------------ */
struct err_text { CUresult code; const char *name; const char *text; };
#define E(code, text) { code, #code, text }
static const struct err_text g_errors[] = {
    E(CUDA_SUCCESS, "no error"),
    E(CUDA_ERROR_INVALID_VALUE, "invalid argument"),
    E(CUDA_ERROR_OUT_OF_MEMORY, "out of memory"),
    E(CUDA_ERROR_NOT_INITIALIZED, "initialization error"),
    E(CUDA_ERROR_DEINITIALIZED, "driver shutting down"),
    E(CUDA_ERROR_STUB_LIBRARY, "CUDA driver is a stub library"),
    E(CUDA_ERROR_NO_DEVICE, "no CUDA-capable device is detected"),
    E(CUDA_ERROR_INVALID_DEVICE, "invalid device ordinal"),
    E(CUDA_ERROR_INVALID_CONTEXT, "invalid device context"),
    E(CUDA_ERROR_CONTEXT_ALREADY_CURRENT, "context already current"),
    E(CUDA_ERROR_INVALID_HANDLE, "invalid resource handle"),
    E(CUDA_ERROR_NOT_FOUND, "named symbol not found"),
    E(CUDA_ERROR_NOT_READY, "device not ready"),
    E(CUDA_ERROR_ILLEGAL_ADDRESS, "an illegal memory access was encountered"),
    E(CUDA_ERROR_CONTEXT_IS_DESTROYED, "context is destroyed"),
    E(CUDA_ERROR_NOT_PERMITTED, "operation not permitted"),
    E(CUDA_ERROR_NOT_SUPPORTED, "operation not supported"),
    E(CUDA_ERROR_UNKNOWN, "unknown error"),
};
#undef E

static const struct err_text *find_error(CUresult code)
{
    for (size_t i = 0; i < sizeof g_errors / sizeof g_errors[0]; i++)
        if (g_errors[i].code == code)
            return &g_errors[i];
    return NULL;
}

CUresult CUDAAPI cuGetErrorName(CUresult error, const char **pStr)
{
    if (!pStr)
        return CUDA_ERROR_INVALID_VALUE;
    const struct err_text *e = find_error(error);
    *pStr = e ? e->name : NULL;
    return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult CUDAAPI cuGetErrorString(CUresult error, const char **pStr)
{
    if (!pStr)
        return CUDA_ERROR_INVALID_VALUE;
    const struct err_text *e = find_error(error);
    *pStr = e ? e->text : NULL;
    return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* ------------------------------------------------------------------------------------------
 * Initialization, version, devices
 * ------------------------------------------------------------------------------------------ */
static CUresult init_impl(unsigned int flags)
{
    if (flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (g_init)
        return CUDA_SUCCESS;
    const char *nodev = getenv("FAKE_CUDA_NO_DEVICE");
    if (nodev && *nodev && strcmp(nodev, "0") != 0)
        return CUDA_ERROR_NO_DEVICE;
    long long count, total, busy, ctx_bytes;
    if (env_int("FAKE_CUDA_DEVICE_COUNT", 1, 0, FAKE_MAX_DEVICES, &count) ||
        env_int("FAKE_CUDA_TOTAL_MEM", 8LL << 30, 1, (long long)(SIZE_MAX >> 1), &total) ||
        env_int("FAKE_CUDA_STREAM_BUSY_QUERIES", 0, 0, 1 << 30, &busy) ||
        env_int("FAKE_CUDA_CONTEXT_BYTES", 0, 0, (long long)(SIZE_MAX >> 1), &ctx_bytes))
        return CUDA_ERROR_INVALID_VALUE;
    if ((size_t)ctx_bytes > (size_t)total) {
        fprintf(stderr, "fake libcuda: FAKE_CUDA_CONTEXT_BYTES exceeds FAKE_CUDA_TOTAL_MEM\n");
        return CUDA_ERROR_INVALID_VALUE;
    }
    g_context_bytes = (size_t)ctx_bytes;
    if (count == 0)
        return CUDA_ERROR_NO_DEVICE;
    g_ndev = (int)count;
    g_busy_after_work = (int)busy;
    for (int i = 0; i < g_ndev; i++) {
        g_dev[i].total = (size_t)total;
        g_dev[i].used = 0;
        g_dev[i].ctx.device = i;
        g_dev[i].ctx.refcount = 0;
        g_dev[i].null_stream.device = i;
    }
    g_init = 1;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuInit(unsigned int Flags) { LOCKED(init_impl(Flags)); }

CUresult CUDAAPI cuDriverGetVersion(int *driverVersion)
{
    /* Like the real driver, usable before cuInit. */
    if (!driverVersion)
        return CUDA_ERROR_INVALID_VALUE;
    *driverVersion = driver_version();
    return CUDA_SUCCESS;
}

static CUresult device_get_count(int *count)
{
    TRY(need_init());
    if (!count)
        return CUDA_ERROR_INVALID_VALUE;
    *count = g_ndev;
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuDeviceGetCount(int *count) { LOCKED(device_get_count(count)); }

static CUresult device_get(CUdevice *device, int ordinal)
{
    TRY(need_init());
    if (!device)
        return CUDA_ERROR_INVALID_VALUE;
    TRY(need_device(ordinal));
    *device = ordinal;
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuDeviceGet(CUdevice *device, int ordinal) { LOCKED(device_get(device, ordinal)); }

static CUresult device_get_name(char *name, int len, CUdevice dev)
{
    TRY(need_device(dev));
    if (!name || len <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    snprintf(name, (size_t)len, "NVIDIA H100 (fake libcuda)");
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuDeviceGetName(char *name, int len, CUdevice dev)
{
    LOCKED(device_get_name(name, len, dev));
}

static CUresult device_total_mem(size_t *bytes, CUdevice dev)
{
    TRY(need_device(dev));
    if (!bytes)
        return CUDA_ERROR_INVALID_VALUE;
    *bytes = g_dev[dev].total;
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuDeviceTotalMem(size_t *bytes, CUdevice dev) { LOCKED(device_total_mem(bytes, dev)); }

static CUresult device_get_attribute(int *pi, CUdevice_attribute attrib, CUdevice dev)
{
    TRY(need_device(dev));
    if (!pi)
        return CUDA_ERROR_INVALID_VALUE;
    int v;
    switch (attrib) {   /* an H100 SXM5 */
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: v = 9; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: v = 132; break;
    case CU_DEVICE_ATTRIBUTE_CLOCK_RATE: v = 1980000; break;            /* kHz */
    case CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE: v = 2619000; break;     /* kHz */
    case CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH: v = 5120; break;  /* bits */
    case CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE: v = 50 << 20; break;        /* bytes */
    case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: v = 1024; break;
    case CU_DEVICE_ATTRIBUTE_WARP_SIZE: v = 32; break;
    case CU_DEVICE_ATTRIBUTE_INTEGRATED: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_ECC_ENABLED: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_TCC_DRIVER: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY: v = 0; break;  /* cuMemAllocManaged is absent */
    case CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_PCI_BUS_ID: v = FAKE_PCI_BUS_BASE + dev; break;
    case CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: v = 1; break;   /* VMM block */
    default: return CUDA_ERROR_INVALID_VALUE;
    }
    *pi = v;
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev)
{
    LOCKED(device_get_attribute(pi, attrib, dev));
}

static CUresult device_get_pci_bus_id(char *pciBusId, int len, CUdevice dev)
{
    TRY(need_device(dev));
    if (!pciBusId || len <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    snprintf(pciBusId, (size_t)len, "0000:%02x:00.0", FAKE_PCI_BUS_BASE + dev);
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuDeviceGetPCIBusId(char *pciBusId, int len, CUdevice dev)
{
    LOCKED(device_get_pci_bus_id(pciBusId, len, dev));
}

/* ------------------------------------------------------------------------------------------
 * Contexts
 * ------------------------------------------------------------------------------------------ */
static CUresult primary_retain(CUcontext *pctx, CUdevice dev)
{
    TRY(need_device(dev));
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    if (g_dev[dev].ctx.refcount++ == 0)
        g_dev[dev].used += g_context_bytes;     /* a context holds device memory while it lives */
    *pctx = &g_dev[dev].ctx;
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    LOCKED(primary_retain(pctx, dev));
}

static CUresult primary_release(CUdevice dev)
{
    TRY(need_device(dev));
    if (g_dev[dev].ctx.refcount <= 0)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (--g_dev[dev].ctx.refcount == 0)
        g_dev[dev].used -= g_context_bytes;
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuDevicePrimaryCtxRelease(CUdevice dev) { LOCKED(primary_release(dev)); }

static CUresult primary_get_state(CUdevice dev, unsigned int *flags, int *active)
{
    TRY(need_device(dev));
    if (!flags || !active)
        return CUDA_ERROR_INVALID_VALUE;
    *flags = 0;
    *active = g_dev[dev].ctx.refcount > 0;
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active)
{
    LOCKED(primary_get_state(dev, flags, active));
}

static CUresult ctx_push(CUcontext ctx)
{
    TRY(need_init());
    struct CUctx_st *c = lookup_ctx(ctx);
    if (!c)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (t_ctx_depth >= FAKE_CTX_STACK_MAX)
        return CUDA_ERROR_INVALID_VALUE;
    t_ctx_stack[t_ctx_depth++] = c;
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuCtxPushCurrent(CUcontext ctx) { LOCKED(ctx_push(ctx)); }

static CUresult ctx_pop(CUcontext *pctx)
{
    TRY(need_init());
    if (t_ctx_depth == 0)
        return CUDA_ERROR_INVALID_CONTEXT;
    struct CUctx_st *c = t_ctx_stack[--t_ctx_depth];
    if (pctx)
        *pctx = c;
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuCtxPopCurrent(CUcontext *pctx) { LOCKED(ctx_pop(pctx)); }

static CUresult ctx_set(CUcontext ctx)
{
    TRY(need_init());
    if (!ctx) {                      /* NULL pops the top, or does nothing on an empty stack */
        if (t_ctx_depth > 0)
            t_ctx_depth--;
        return CUDA_SUCCESS;
    }
    struct CUctx_st *c = lookup_ctx(ctx);
    if (!c)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (t_ctx_depth == 0)
        t_ctx_depth = 1;             /* an empty stack gets ctx pushed */
    t_ctx_stack[t_ctx_depth - 1] = c; /* otherwise the top is replaced */
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuCtxSetCurrent(CUcontext ctx) { LOCKED(ctx_set(ctx)); }

static CUresult ctx_get(CUcontext *pctx)
{
    TRY(need_init());
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    *pctx = t_ctx_depth ? t_ctx_stack[t_ctx_depth - 1] : NULL;
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuCtxGetCurrent(CUcontext *pctx) { LOCKED(ctx_get(pctx)); }

/* ctx NULL means the current context; a named one must be alive. */
static CUresult ctx_or_current(CUcontext ctx, struct CUctx_st **out)
{
    TRY(need_init());
    if (!ctx)
        return current_ctx(out);
    struct CUctx_st *c = lookup_ctx(ctx);
    if (!c)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (c->refcount <= 0)
        return CUDA_ERROR_CONTEXT_IS_DESTROYED;
    *out = c;
    return CUDA_SUCCESS;
}

static CUresult ctx_get_device(CUdevice *device, CUcontext ctx)
{
    struct CUctx_st *c;
    TRY(ctx_or_current(ctx, &c));
    if (!device)
        return CUDA_ERROR_INVALID_VALUE;
    *device = c->device;
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuCtxGetDevice(CUdevice *device) { LOCKED(ctx_get_device(device, NULL)); }
CUresult CUDAAPI cuCtxGetDevice_v2(CUdevice *device, CUcontext ctx)
{
    LOCKED(ctx_get_device(device, ctx));
}

static CUresult ctx_synchronize(CUcontext ctx)
{
    struct CUctx_st *c;
    TRY(ctx_or_current(ctx, &c));
    complete_stream(&g_dev[c->device].null_stream);
    for (struct CUstream_st *s = g_streams; s; s = s->next)
        if (s->device == c->device)
            complete_stream(s);
    for (struct CUevent_st *e = g_events; e; e = e->next)
        if (e->device == c->device)
            e->pending = 0;
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuCtxSynchronize(void) { LOCKED(ctx_synchronize(NULL)); }
CUresult CUDAAPI cuCtxSynchronize_v2(CUcontext ctx) { LOCKED(ctx_synchronize(ctx)); }

/* ------------------------------------------------------------------------------------------
 * Memory
 * ------------------------------------------------------------------------------------------ */
static CUresult mem_get_info(size_t *free_bytes, size_t *total)
{
    struct CUctx_st *c;
    TRY(current_ctx(&c));
    if (!free_bytes || !total)
        return CUDA_ERROR_INVALID_VALUE;
    *total = g_dev[c->device].total;
    *free_bytes = g_dev[c->device].total - g_dev[c->device].used;
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemGetInfo(size_t *free, size_t *total) { LOCKED(mem_get_info(free, total)); }

static CUresult mem_alloc(CUdeviceptr *dptr, size_t bytesize)
{
    struct CUctx_st *c;
    TRY(current_ctx(&c));
    if (!dptr || bytesize == 0)
        return CUDA_ERROR_INVALID_VALUE;
    struct fake_device *d = &g_dev[c->device];
    if (bytesize > d->total - d->used)
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (table_reserve(&g_dev_blocks))
        return CUDA_ERROR_OUT_OF_MEMORY;
    size_t mapped;
    void *p = raw_alloc(bytesize, FAKE_ALIGNMENT, &mapped);
    if (!p)
        return CUDA_ERROR_OUT_OF_MEMORY;
    uintptr_t base = (uintptr_t)p;
    size_t i = lower_bound(base);
    memmove(&g_dev_blocks.v[i + 1], &g_dev_blocks.v[i], (g_dev_blocks.n - i) * sizeof(struct fake_block));
    g_dev_blocks.v[i] = (struct fake_block){base, bytesize, mapped, c->device};
    g_dev_blocks.n++;
    d->used += bytesize;
    *dptr = (CUdeviceptr)base;
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemAlloc(CUdeviceptr *dptr, size_t bytesize) { LOCKED(mem_alloc(dptr, bytesize)); }

static CUresult mem_free(CUdeviceptr dptr)
{
    TRY(need_init());
    if (dptr == 0)
        return CUDA_SUCCESS;   /* freeing NULL is a no-op */
    uintptr_t p = (uintptr_t)dptr;
    size_t i = lower_bound(p);
    if (i >= g_dev_blocks.n || g_dev_blocks.v[i].base != p)
        return CUDA_ERROR_INVALID_VALUE;   /* not the start of a live allocation */
    struct fake_block b = g_dev_blocks.v[i];
    memmove(&g_dev_blocks.v[i], &g_dev_blocks.v[i + 1], (g_dev_blocks.n - i - 1) * sizeof b);
    g_dev_blocks.n--;
    g_dev[b.device].used -= b.size;
    raw_free((void *)b.base, b.mapped);
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemFree(CUdeviceptr dptr) { LOCKED(mem_free(dptr)); }

static CUresult host_alloc(void **pp, size_t bytesize, unsigned int flags)
{
    struct CUctx_st *c;
    TRY(current_ctx(&c));
    if (!pp || bytesize == 0 ||
        (flags & ~(unsigned)(CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP |
                             CU_MEMHOSTALLOC_WRITECOMBINED)))
        return CUDA_ERROR_INVALID_VALUE;
    if (table_reserve(&g_host_blocks))
        return CUDA_ERROR_OUT_OF_MEMORY;
    size_t mapped;
    void *p = raw_alloc(bytesize, 4096, &mapped);   /* page-locked memory is page aligned */
    if (!p)
        return CUDA_ERROR_OUT_OF_MEMORY;
    g_host_blocks.v[g_host_blocks.n++] = (struct fake_block){(uintptr_t)p, bytesize, mapped, c->device};
    *pp = p;
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemAllocHost(void **pp, size_t bytesize) { LOCKED(host_alloc(pp, bytesize, 0)); }
CUresult CUDAAPI cuMemHostAlloc(void **pp, size_t bytesize, unsigned int Flags)
{
    LOCKED(host_alloc(pp, bytesize, Flags));
}

static CUresult host_free(void *p)
{
    TRY(need_init());
    for (size_t i = 0; i < g_host_blocks.n; i++)
        if (g_host_blocks.v[i].base == (uintptr_t)p) {
            struct fake_block b = g_host_blocks.v[i];
            g_host_blocks.v[i] = g_host_blocks.v[--g_host_blocks.n];
            raw_free(p, b.mapped);
            return CUDA_SUCCESS;
        }
    return CUDA_ERROR_INVALID_VALUE;
}
CUresult CUDAAPI cuMemFreeHost(void *p) { LOCKED(host_free(p)); }

/* Copies and memsets run at once, synchronous or not; both need a current context, the
 * async forms also a valid stream (which may then report itself busy, see submitted()). */
enum { TO_DEVICE = 1, FROM_DEVICE = 2 };

static CUresult copy_impl(void *dst, const void *src, size_t n, int dir, int async, CUstream hs)
{
    struct CUstream_st *s = NULL;
    struct CUctx_st *c;
    if (async)
        TRY(resolve_stream(hs, &s));
    TRY(current_ctx(&c));
    if (n == 0)
        return CUDA_SUCCESS;
    if (!dst || !src)
        return CUDA_ERROR_INVALID_VALUE;
    if (dir & TO_DEVICE)
        TRY(check_range((CUdeviceptr)(uintptr_t)dst, n));
    if (dir & FROM_DEVICE)
        TRY(check_range((CUdeviceptr)(uintptr_t)src, n));
    memmove(dst, src, n);
    if (s)
        submitted(s);
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemcpyHtoD(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount)
{
    LOCKED(copy_impl((void *)(uintptr_t)dstDevice, srcHost, ByteCount, TO_DEVICE, 0, NULL));
}
CUresult CUDAAPI cuMemcpyDtoH(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount)
{
    LOCKED(copy_impl(dstHost, (const void *)(uintptr_t)srcDevice, ByteCount, FROM_DEVICE, 0, NULL));
}
CUresult CUDAAPI cuMemcpyDtoD(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount)
{
    LOCKED(copy_impl((void *)(uintptr_t)dstDevice, (const void *)(uintptr_t)srcDevice, ByteCount,
                     TO_DEVICE | FROM_DEVICE, 0, NULL));
}
CUresult CUDAAPI cuMemcpyHtoDAsync(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount,
                                   CUstream hStream)
{
    LOCKED(copy_impl((void *)(uintptr_t)dstDevice, srcHost, ByteCount, TO_DEVICE, 1, hStream));
}
CUresult CUDAAPI cuMemcpyDtoHAsync(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount,
                                   CUstream hStream)
{
    LOCKED(copy_impl(dstHost, (const void *)(uintptr_t)srcDevice, ByteCount, FROM_DEVICE, 1,
                     hStream));
}
CUresult CUDAAPI cuMemcpyDtoDAsync(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount,
                                   CUstream hStream)
{
    LOCKED(copy_impl((void *)(uintptr_t)dstDevice, (const void *)(uintptr_t)srcDevice, ByteCount,
                     TO_DEVICE | FROM_DEVICE, 1, hStream));
}

static CUresult memset_impl(CUdeviceptr dst, unsigned char uc, size_t n, int async, CUstream hs)
{
    struct CUstream_st *s = NULL;
    struct CUctx_st *c;
    if (async)
        TRY(resolve_stream(hs, &s));
    TRY(current_ctx(&c));
    if (n == 0)
        return CUDA_SUCCESS;
    TRY(check_range(dst, n));
    memset((void *)(uintptr_t)dst, uc, n);
    if (s)
        submitted(s);
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemsetD8(CUdeviceptr dstDevice, unsigned char uc, size_t N)
{
    LOCKED(memset_impl(dstDevice, uc, N, 0, NULL));
}
CUresult CUDAAPI cuMemsetD8Async(CUdeviceptr dstDevice, unsigned char uc, size_t N, CUstream hStream)
{
    LOCKED(memset_impl(dstDevice, uc, N, 1, hStream));
}

/* ------------------------------------------------------------------------------------------
 * Streams
 * ------------------------------------------------------------------------------------------ */
static CUresult stream_create(CUstream *phStream, unsigned int flags)
{
    struct CUctx_st *c;
    TRY(current_ctx(&c));
    if (!phStream || (flags & ~(unsigned)CU_STREAM_NON_BLOCKING))
        return CUDA_ERROR_INVALID_VALUE;
    struct CUstream_st *s = calloc(1, sizeof *s);
    if (!s)
        return CUDA_ERROR_OUT_OF_MEMORY;
    s->device = c->device;
    s->flags = flags;
    s->next = g_streams;
    g_streams = s;
    g_nstreams++;
    *phStream = s;
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuStreamCreate(CUstream *phStream, unsigned int Flags)
{
    LOCKED(stream_create(phStream, Flags));
}

static CUresult stream_destroy(CUstream h)
{
    TRY(need_init());
    for (struct CUstream_st **pp = &g_streams; *pp; pp = &(*pp)->next)
        if (*pp == h) {
            struct CUstream_st *s = *pp;
            *pp = s->next;
            g_nstreams--;
            /* Events recorded on it keep their own count; they just lose the link. */
            for (struct CUevent_st *e = g_events; e; e = e->next)
                if (e->stream == s)
                    e->stream = NULL;
            free(s);
            return CUDA_SUCCESS;
        }
    return CUDA_ERROR_INVALID_HANDLE;   /* includes the default stream handles */
}
CUresult CUDAAPI cuStreamDestroy(CUstream hStream) { LOCKED(stream_destroy(hStream)); }

static CUresult stream_query(CUstream h)
{
    struct CUstream_st *s;
    TRY(resolve_stream(h, &s));
    if (s->busy > 0) {
        s->busy--;
        return CUDA_ERROR_NOT_READY;
    }
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuStreamQuery(CUstream hStream) { LOCKED(stream_query(hStream)); }

static CUresult stream_synchronize(CUstream h)
{
    struct CUstream_st *s;
    TRY(resolve_stream(h, &s));
    complete_stream(s);
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuStreamSynchronize(CUstream hStream) { LOCKED(stream_synchronize(hStream)); }

static CUresult stream_wait_event(CUstream hs, CUevent he, unsigned int flags)
{
    struct CUstream_st *s;
    struct CUevent_st *e;
    TRY(resolve_stream(hs, &s));
    TRY(resolve_event(he, &e));
    if (flags & ~(unsigned)CU_EVENT_WAIT_EXTERNAL)
        return CUDA_ERROR_INVALID_VALUE;
    if (e->pending > s->busy)    /* the stream cannot be idle before the event completes */
        s->busy = e->pending;
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuStreamWaitEvent(CUstream hStream, CUevent hEvent, unsigned int Flags)
{
    LOCKED(stream_wait_event(hStream, hEvent, Flags));
}

/* ------------------------------------------------------------------------------------------
 * Events
 * ------------------------------------------------------------------------------------------ */
static CUresult event_create(CUevent *phEvent, unsigned int flags)
{
    struct CUctx_st *c;
    TRY(current_ctx(&c));
    const unsigned known = CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS;
    if (!phEvent || (flags & ~known) ||
        ((flags & CU_EVENT_INTERPROCESS) && !(flags & CU_EVENT_DISABLE_TIMING)))
        return CUDA_ERROR_INVALID_VALUE;
    struct CUevent_st *e = calloc(1, sizeof *e);
    if (!e)
        return CUDA_ERROR_OUT_OF_MEMORY;
    e->device = c->device;
    e->flags = flags;
    e->next = g_events;
    g_events = e;
    g_nevents++;
    *phEvent = e;
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuEventCreate(CUevent *phEvent, unsigned int Flags)
{
    LOCKED(event_create(phEvent, Flags));
}

static CUresult event_record(CUevent he, CUstream hs)
{
    struct CUevent_st *e;
    struct CUstream_st *s;
    TRY(resolve_event(he, &e));
    TRY(resolve_stream(hs, &s));
    if (s->device != e->device)
        return CUDA_ERROR_INVALID_HANDLE;   /* event and stream of different contexts */
    e->pending = s->busy;
    e->stream = s;
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuEventRecord(CUevent hEvent, CUstream hStream) { LOCKED(event_record(hEvent, hStream)); }

static CUresult event_query(CUevent he)
{
    struct CUevent_st *e;
    TRY(resolve_event(he, &e));
    if (e->pending > 0) {
        e->pending--;
        return CUDA_ERROR_NOT_READY;
    }
    return CUDA_SUCCESS;   /* also for an event never recorded, as in the real driver */
}
CUresult CUDAAPI cuEventQuery(CUevent hEvent) { LOCKED(event_query(hEvent)); }

static CUresult event_synchronize(CUevent he)
{
    struct CUevent_st *e;
    TRY(resolve_event(he, &e));
    e->pending = 0;
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuEventSynchronize(CUevent hEvent) { LOCKED(event_synchronize(hEvent)); }

static CUresult event_destroy(CUevent he)
{
    TRY(need_init());
    for (struct CUevent_st **pp = &g_events; *pp; pp = &(*pp)->next)
        if (*pp == he) {
            struct CUevent_st *e = *pp;
            *pp = e->next;
            g_nevents--;
            free(e);
            return CUDA_SUCCESS;
        }
    return CUDA_ERROR_INVALID_HANDLE;
}
CUresult CUDAAPI cuEventDestroy(CUevent hEvent) { LOCKED(event_destroy(hEvent)); }

/* ==========================================================================================
 * Virtual memory management (cuMem* VMM calls) - a separate block, kept apart from the rest.
 *
 * Model (the rules of the CUDA driver API documentation, "Virtual Memory Management"):
 *   - granularity: FAKE_VMM_GRANULARITY (2 MiB, minimum and recommended alike); every size,
 *     address and offset must be a multiple of it;
 *   - cuMemAddressReserve takes host address space only (mmap PROT_NONE, MAP_NORESERVE): it does
 *     not count against cuMemGetInfo; cuMemCreate counts its size as used device memory, backed
 *     by a memfd so that the same bytes show through every mapping of the handle;
 *   - cuMemMap maps a whole handle (offset 0) inside one reservation over unmapped bytes only;
 *     the range is inaccessible (copies and memsets fail) until cuMemSetAccess grants access
 *     on a fully mapped range;
 *   - cuMemUnmap takes exactly whole mappings; cuMemAddressFree needs the reservation whole
 *     and unmapped; cuMemRelease of a still-mapped handle is allowed and frees the memory at
 *     its last unmap (as the real driver does).
 * Helpers: fake_cuda_live_vmm_handles (created, not released), fake_cuda_live_vmm_mappings,
 * fake_cuda_live_vmm_reservations.
 * ========================================================================================== */
#define FAKE_VMM_GRANULARITY ((size_t)2 << 20)

struct fake_vmm_mem {          /* a physical allocation (CUmemGenericAllocationHandle) */
    int fd;
    size_t size;
    int device;
    int nmaps;
    int released;
    struct fake_vmm_mem *next;
};

struct fake_vmm_range {        /* a reservation or a mapping */
    uintptr_t base;
    size_t size;
    void *raw;                 /* reservation: what mmap returned (before alignment) */
    size_t raw_size;
    struct fake_vmm_mem *mem;  /* mapping: its handle */
    int access;                /* mapping: cuMemSetAccess granted read/write */
};

static struct fake_vmm_mem *g_vmm_mems;
static struct fake_vmm_range *g_vmm_res, *g_vmm_maps;
static size_t g_vmm_nres, g_vmm_capres, g_vmm_nmaps, g_vmm_capmaps;
static int g_vmm_live_handles;

static int vmm_push(struct fake_vmm_range **v, size_t *n, size_t *cap, struct fake_vmm_range r)
{
    if (*n == *cap) {
        size_t c = *cap ? 2 * *cap : 32;
        struct fake_vmm_range *g = realloc(*v, c * sizeof *g);
        if (!g)
            return -1;
        *v = g;
        *cap = c;
    }
    (*v)[(*n)++] = r;
    return 0;
}

static int vmm_aligned(size_t x) { return x % FAKE_VMM_GRANULARITY == 0; }

static struct fake_vmm_mem *vmm_lookup_mem(CUmemGenericAllocationHandle h)
{
    for (struct fake_vmm_mem *m = g_vmm_mems; m; m = m->next)
        if ((CUmemGenericAllocationHandle)(uintptr_t)m == h && !m->released)
            return m;
    return NULL;
}

/* The reservation holding [p, p + n), or NULL. */
static struct fake_vmm_range *vmm_reservation_of(uintptr_t p, size_t n)
{
    for (size_t i = 0; i < g_vmm_nres; i++) {
        struct fake_vmm_range *r = &g_vmm_res[i];
        if (p >= r->base && n <= r->size && p - r->base <= r->size - n)
            return r;
    }
    return NULL;
}

/* Index of the mapping containing p, or -1. */
static long vmm_mapping_at(uintptr_t p)
{
    for (size_t i = 0; i < g_vmm_nmaps; i++)
        if (p >= g_vmm_maps[i].base && p - g_vmm_maps[i].base < g_vmm_maps[i].size)
            return (long)i;
    return -1;
}

/* Collect the whole mappings that tile [p, p + n) exactly into idx (at most max); the count,
 * or -1 when the range is not exactly a run of whole mappings. */
static long vmm_tiling(uintptr_t p, size_t n, long *idx, long max)
{
    long k = 0;
    uintptr_t at = p;
    while (at < p + n) {
        long i = vmm_mapping_at(at);
        if (i < 0 || g_vmm_maps[i].base != at || k == max)
            return -1;
        idx[k++] = i;
        at += g_vmm_maps[i].size;
    }
    return at == p + n ? k : -1;
}

/* Copies and memsets into VMM memory: every byte mapped, with access granted. */
static CUresult vmm_check_range(uintptr_t p, size_t n)
{
    uintptr_t at = p;
    while (at < p + n) {
        long i = vmm_mapping_at(at);
        if (i < 0 || !g_vmm_maps[i].access)
            return CUDA_ERROR_INVALID_VALUE;
        at = g_vmm_maps[i].base + g_vmm_maps[i].size;
    }
    return CUDA_SUCCESS;
}

static void vmm_drop_mem_if_unused(struct fake_vmm_mem *m)
{
    if (!m->released || m->nmaps)
        return;
    struct fake_vmm_mem **pp = &g_vmm_mems;
    while (*pp != m)
        pp = &(*pp)->next;
    *pp = m->next;
    g_dev[m->device].used -= m->size;
    close(m->fd);
    free(m);
}

static CUresult vmm_check_prop(const CUmemAllocationProp *prop)
{
    if (!prop || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED ||
        prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return CUDA_ERROR_INVALID_VALUE;
    if (prop->location.id < 0 || prop->location.id >= g_ndev)
        return CUDA_ERROR_INVALID_DEVICE;
    return CUDA_SUCCESS;
}

static CUresult mem_get_allocation_granularity(size_t *granularity, const CUmemAllocationProp *prop,
                                               CUmemAllocationGranularity_flags option)
{
    TRY(need_init());
    if (!granularity || (option != CU_MEM_ALLOC_GRANULARITY_MINIMUM &&
                         option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED))
        return CUDA_ERROR_INVALID_VALUE;
    TRY(vmm_check_prop(prop));
    *granularity = FAKE_VMM_GRANULARITY;
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
                                               CUmemAllocationGranularity_flags option)
{
    LOCKED(mem_get_allocation_granularity(granularity, prop, option));
}

static CUresult mem_address_reserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                    unsigned long long flags)
{
    TRY(need_init());
    (void)addr;                 /* a hint only */
    if (!ptr || size == 0 || flags || !vmm_aligned(size) || (alignment & (alignment - 1)))
        return CUDA_ERROR_INVALID_VALUE;
    size_t align = alignment > FAKE_VMM_GRANULARITY ? alignment : FAKE_VMM_GRANULARITY;
    size_t raw_size = size + align;
    void *raw = mmap(NULL, raw_size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (raw == MAP_FAILED)
        return CUDA_ERROR_OUT_OF_MEMORY;
    uintptr_t base = ((uintptr_t)raw + align - 1) & ~(uintptr_t)(align - 1);
    struct fake_vmm_range r = {base, size, raw, raw_size, NULL, 0};
    if (vmm_push(&g_vmm_res, &g_vmm_nres, &g_vmm_capres, r)) {
        munmap(raw, raw_size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *ptr = (CUdeviceptr)base;
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                     unsigned long long flags)
{
    LOCKED(mem_address_reserve(ptr, size, alignment, addr, flags));
}

static CUresult mem_address_free(CUdeviceptr ptr, size_t size)
{
    TRY(need_init());
    for (size_t i = 0; i < g_vmm_nres; i++) {
        struct fake_vmm_range *r = &g_vmm_res[i];
        if (r->base != (uintptr_t)ptr)
            continue;
        if (r->size != size)
            return CUDA_ERROR_INVALID_VALUE;
        for (size_t j = 0; j < g_vmm_nmaps; j++)     /* unmap before free */
            if (g_vmm_maps[j].base >= r->base && g_vmm_maps[j].base - r->base < r->size)
                return CUDA_ERROR_INVALID_VALUE;
        munmap(r->raw, r->raw_size);
        g_vmm_res[i] = g_vmm_res[--g_vmm_nres];
        return CUDA_SUCCESS;
    }
    return CUDA_ERROR_INVALID_VALUE;
}
CUresult CUDAAPI cuMemAddressFree(CUdeviceptr ptr, size_t size) { LOCKED(mem_address_free(ptr, size)); }

static CUresult mem_create(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                           unsigned long long flags)
{
    TRY(need_init());
    if (!handle || size == 0 || flags || !vmm_aligned(size))
        return CUDA_ERROR_INVALID_VALUE;
    TRY(vmm_check_prop(prop));
    struct fake_device *d = &g_dev[prop->location.id];
    if (size > d->total - d->used)
        return CUDA_ERROR_OUT_OF_MEMORY;
    struct fake_vmm_mem *m = calloc(1, sizeof *m);
    if (!m)
        return CUDA_ERROR_OUT_OF_MEMORY;
    m->fd = memfd_create("fake_cuda_vmm", MFD_CLOEXEC);
    if (m->fd < 0 || ftruncate(m->fd, (off_t)size) != 0) {
        if (m->fd >= 0)
            close(m->fd);
        free(m);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    m->size = size;
    m->device = prop->location.id;
    m->next = g_vmm_mems;
    g_vmm_mems = m;
    d->used += size;
    g_vmm_live_handles++;
    *handle = (CUmemGenericAllocationHandle)(uintptr_t)m;
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                             unsigned long long flags)
{
    LOCKED(mem_create(handle, size, prop, flags));
}

static CUresult mem_release(CUmemGenericAllocationHandle handle)
{
    TRY(need_init());
    struct fake_vmm_mem *m = vmm_lookup_mem(handle);
    if (!m)
        return CUDA_ERROR_INVALID_VALUE;
    m->released = 1;
    g_vmm_live_handles--;
    vmm_drop_mem_if_unused(m);
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemRelease(CUmemGenericAllocationHandle handle) { LOCKED(mem_release(handle)); }

static CUresult mem_map(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                        unsigned long long flags)
{
    TRY(need_init());
    uintptr_t p = (uintptr_t)ptr;
    struct fake_vmm_mem *m = vmm_lookup_mem(handle);
    if (!m || flags || offset || size == 0 || !vmm_aligned(p) || !vmm_aligned(size) || size > m->size)
        return CUDA_ERROR_INVALID_VALUE;
    if (!vmm_reservation_of(p, size))
        return CUDA_ERROR_INVALID_VALUE;             /* map only inside a reservation */
    for (size_t i = 0; i < g_vmm_nmaps; i++) {       /* over unmapped bytes only */
        const struct fake_vmm_range *q = &g_vmm_maps[i];
        if (p < q->base + q->size && q->base < p + size)
            return CUDA_ERROR_INVALID_VALUE;
    }
    struct fake_vmm_range r = {p, size, NULL, 0, m, 0};
    if (vmm_push(&g_vmm_maps, &g_vmm_nmaps, &g_vmm_capmaps, r))
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (mmap((void *)p, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, m->fd, 0) == MAP_FAILED) {
        g_vmm_nmaps--;
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    m->nmaps++;
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                          unsigned long long flags)
{
    LOCKED(mem_map(ptr, size, offset, handle, flags));
}

#define FAKE_VMM_MAX_RUN 4096

static CUresult mem_set_access(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count)
{
    TRY(need_init());
    static long idx[FAKE_VMM_MAX_RUN];
    if (!desc || count == 0 || size == 0)
        return CUDA_ERROR_INVALID_VALUE;
    int grant = 0;
    for (size_t i = 0; i < count; i++) {
        if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE)
            return CUDA_ERROR_INVALID_VALUE;
        if (desc[i].location.id < 0 || desc[i].location.id >= g_ndev)
            return CUDA_ERROR_INVALID_DEVICE;
        if (desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_NONE && desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READ &&
            desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
            return CUDA_ERROR_INVALID_VALUE;
        grant = desc[i].flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    }
    long k = vmm_tiling((uintptr_t)ptr, size, idx, FAKE_VMM_MAX_RUN);
    if (k < 0)
        return CUDA_ERROR_INVALID_VALUE;             /* the range must be fully mapped */
    for (long j = 0; j < k; j++)
        g_vmm_maps[idx[j]].access = grant;
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count)
{
    LOCKED(mem_set_access(ptr, size, desc, count));
}

static CUresult mem_unmap(CUdeviceptr ptr, size_t size)
{
    TRY(need_init());
    static long idx[FAKE_VMM_MAX_RUN];
    uintptr_t p = (uintptr_t)ptr;
    long k = vmm_tiling(p, size, idx, FAKE_VMM_MAX_RUN);
    if (k <= 0)
        return CUDA_ERROR_INVALID_VALUE;             /* whole mappings only */
    /* back to a bare reservation */
    if (mmap((void *)p, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0)
        == MAP_FAILED)
        return CUDA_ERROR_UNKNOWN;
    struct fake_vmm_mem *dropped[FAKE_VMM_MAX_RUN];
    for (long j = 0; j < k; j++) {
        dropped[j] = g_vmm_maps[idx[j]].mem;
        dropped[j]->nmaps--;
        g_vmm_maps[idx[j]].size = 0;                 /* mark, then compact */
    }
    size_t w = 0;
    for (size_t i = 0; i < g_vmm_nmaps; i++)
        if (g_vmm_maps[i].size)
            g_vmm_maps[w++] = g_vmm_maps[i];
    g_vmm_nmaps = w;
    for (long j = 0; j < k; j++)
        vmm_drop_mem_if_unused(dropped[j]);
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemUnmap(CUdeviceptr ptr, size_t size) { LOCKED(mem_unmap(ptr, size)); }

int fake_cuda_live_vmm_handles(void)
{
    pthread_mutex_lock(&g_lock);
    int n = g_vmm_live_handles;
    pthread_mutex_unlock(&g_lock);
    return n;
}

int fake_cuda_live_vmm_mappings(void)
{
    pthread_mutex_lock(&g_lock);
    int n = (int)g_vmm_nmaps;
    pthread_mutex_unlock(&g_lock);
    return n;
}

int fake_cuda_live_vmm_reservations(void)
{
    pthread_mutex_lock(&g_lock);
    int n = (int)g_vmm_nres;
    pthread_mutex_unlock(&g_lock);
    return n;
}

#define FAKE_VMM_PROCS(X)                                                   \
    X(cuMemGetAllocationGranularity, 10020, cuMemGetAllocationGranularity)  \
    X(cuMemAddressReserve, 10020, cuMemAddressReserve)                      \
    X(cuMemAddressFree, 10020, cuMemAddressFree)                            \
    X(cuMemCreate, 10020, cuMemCreate)                                      \
    X(cuMemRelease, 10020, cuMemRelease)                                    \
    X(cuMemMap, 10020, cuMemMap)                                            \
    X(cuMemUnmap, 10020, cuMemUnmap)                                        \
    X(cuMemSetAccess, 10020, cuMemSetAccess)
/* ================================ end of the VMM block ================================== */

/* ------------------------------------------------------------------------------------------
 * Numba (numba-cuda through cuda.core and cuda.bindings): what its device, context and memory
 * layer calls besides the above, for cuda.device_array / to_device / copy_to_host with an EMM
 * plugin (tests/test_numba_plugin.py). Kernels (cuModuleLoadData, cuLaunchKernel) are not
 * modelled: there is no code to run them.
 * ------------------------------------------------------------------------------------------ */
static CUresult device_get_uuid(CUuuid *uuid, CUdevice dev)
{
    CUresult rc = need_device(dev);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!uuid)
        return CUDA_ERROR_INVALID_VALUE;
    memset(uuid->bytes, 0, sizeof uuid->bytes);
    memcpy(uuid->bytes, "fake-cuda-dev", 13);
    uuid->bytes[15] = (char)dev;             /* distinct per device, stable across runs */
    return CUDA_SUCCESS;
}
CUresult CUDAAPI cuDeviceGetUuid(CUuuid *uuid, CUdevice dev) { LOCKED(device_get_uuid(uuid, dev)); }

#define FAKE_NUMBA_PROCS(X, OLD)                                            \
    OLD(cuDeviceGetUuid, 9020)                                              \
    X(cuDeviceGetUuid, 11040, cuDeviceGetUuid)

/* ------------------------------------------------------------------------------------------
 * cuGetProcAddress
 *
 * X(name, version, function): every ABI version of the implemented entry points that
 * cudaTypedefs.h (CUDA 13.0) knows. A row whose function is NULL is an older
 * ABI the fake does not implement: it must be listed so that a request for that old version
 * is refused instead of being answered with the newer, incompatible ABI. The signature of
 * every implemented row is checked against PFN_<name>_v<version> at compile time.
 * ------------------------------------------------------------------------------------------ */
#define FAKE_PROCS(X, OLD)                                                  \
    X(cuGetErrorString, 6000, cuGetErrorString)                             \
    X(cuGetErrorName, 6000, cuGetErrorName)                                 \
    X(cuInit, 2000, cuInit)                                                 \
    X(cuDriverGetVersion, 2020, cuDriverGetVersion)                         \
    X(cuDeviceGet, 2000, cuDeviceGet)                                       \
    X(cuDeviceGetCount, 2000, cuDeviceGetCount)                             \
    X(cuDeviceGetName, 2000, cuDeviceGetName)                               \
    OLD(cuDeviceTotalMem, 2000)                                             \
    X(cuDeviceTotalMem, 3020, cuDeviceTotalMem)                             \
    X(cuDeviceGetAttribute, 2000, cuDeviceGetAttribute)                     \
    X(cuDeviceGetPCIBusId, 4010, cuDeviceGetPCIBusId)                       \
    X(cuDevicePrimaryCtxRetain, 7000, cuDevicePrimaryCtxRetain)             \
    OLD(cuDevicePrimaryCtxRelease, 7000)                                    \
    X(cuDevicePrimaryCtxRelease, 11000, cuDevicePrimaryCtxRelease)          \
    X(cuDevicePrimaryCtxGetState, 7000, cuDevicePrimaryCtxGetState)         \
    OLD(cuCtxPushCurrent, 2000)                                             \
    X(cuCtxPushCurrent, 4000, cuCtxPushCurrent)                             \
    OLD(cuCtxPopCurrent, 2000)                                              \
    X(cuCtxPopCurrent, 4000, cuCtxPopCurrent)                               \
    X(cuCtxSetCurrent, 4000, cuCtxSetCurrent)                               \
    X(cuCtxGetCurrent, 4000, cuCtxGetCurrent)                               \
    X(cuCtxGetDevice, 2000, cuCtxGetDevice)                                 \
    X(cuCtxGetDevice, 13000, cuCtxGetDevice_v2)                             \
    X(cuCtxSynchronize, 2000, cuCtxSynchronize)                             \
    X(cuCtxSynchronize, 13000, cuCtxSynchronize_v2)                         \
    OLD(cuMemGetInfo, 2000)                                                 \
    X(cuMemGetInfo, 3020, cuMemGetInfo)                                     \
    OLD(cuMemAlloc, 2000)                                                   \
    X(cuMemAlloc, 3020, cuMemAlloc)                                         \
    OLD(cuMemFree, 2000)                                                    \
    X(cuMemFree, 3020, cuMemFree)                                           \
    OLD(cuMemAllocHost, 2000)                                               \
    X(cuMemAllocHost, 3020, cuMemAllocHost)                                 \
    X(cuMemHostAlloc, 2020, cuMemHostAlloc)                                 \
    X(cuMemFreeHost, 2000, cuMemFreeHost)                                   \
    OLD(cuMemcpyHtoD, 2000)                                                 \
    X(cuMemcpyHtoD, 3020, cuMemcpyHtoD)                                     \
    OLD(cuMemcpyDtoH, 2000)                                                 \
    X(cuMemcpyDtoH, 3020, cuMemcpyDtoH)                                     \
    OLD(cuMemcpyDtoD, 2000)                                                 \
    X(cuMemcpyDtoD, 3020, cuMemcpyDtoD)                                     \
    OLD(cuMemcpyHtoDAsync, 2000)                                            \
    X(cuMemcpyHtoDAsync, 3020, cuMemcpyHtoDAsync)                           \
    OLD(cuMemcpyDtoHAsync, 2000)                                            \
    X(cuMemcpyDtoHAsync, 3020, cuMemcpyDtoHAsync)                           \
    OLD(cuMemcpyDtoDAsync, 3000)                                            \
    X(cuMemcpyDtoDAsync, 3020, cuMemcpyDtoDAsync)                           \
    OLD(cuMemsetD8, 2000)                                                   \
    X(cuMemsetD8, 3020, cuMemsetD8)                                         \
    X(cuMemsetD8Async, 3020, cuMemsetD8Async)                               \
    X(cuStreamCreate, 2000, cuStreamCreate)                                 \
    OLD(cuStreamDestroy, 2000)                                              \
    X(cuStreamDestroy, 4000, cuStreamDestroy)                               \
    X(cuStreamQuery, 2000, cuStreamQuery)                                   \
    X(cuStreamSynchronize, 2000, cuStreamSynchronize)                       \
    X(cuStreamWaitEvent, 3020, cuStreamWaitEvent)                           \
    X(cuEventCreate, 2000, cuEventCreate)                                   \
    X(cuEventRecord, 2000, cuEventRecord)                                   \
    X(cuEventQuery, 2000, cuEventQuery)                                     \
    X(cuEventSynchronize, 2000, cuEventSynchronize)                         \
    OLD(cuEventDestroy, 2000)                                               \
    X(cuEventDestroy, 4000, cuEventDestroy)                                 \
    OLD(cuGetProcAddress, 11030)                                            \
    FAKE_NUMBA_PROCS(X, OLD)                                                \
    FAKE_VMM_PROCS(X)                                                       \
    GET_PROC_ADDRESS_ROW(X, OLD)

struct proc_entry {
    const char *name;
    int version;            /* CUDA version that introduced this ABI */
    void *fn;               /* NULL: an older ABI the fake does not implement */
};

#ifndef FAKE_CUDA_NO_GET_PROC_ADDRESS
/* cuda.h maps cuGetProcAddress to cuGetProcAddress_v2, the 12000 ABI defined below. */
#define GET_PROC_ADDRESS_ROW(X, OLD) X(cuGetProcAddress, 12000, cuGetProcAddress)
#else
#define GET_PROC_ADDRESS_ROW(X, OLD) OLD(cuGetProcAddress, 12000)
#endif

#define CHECK_SIG(name, ver, fn)                                                         \
    _Static_assert(__builtin_types_compatible_p(__typeof__(&fn), PFN_##name##_v##ver),   \
                   #fn " does not match PFN_" #name "_v" #ver);
#define NO_CHECK(name, ver)
FAKE_PROCS(CHECK_SIG, NO_CHECK)

#ifndef FAKE_CUDA_NO_GET_PROC_ADDRESS
#define ROW(name, ver, fn) {#name, ver, (void *)(fn)},
#define OLD_ROW(name, ver) {#name, ver, NULL},
static const struct proc_entry g_procs[] = {FAKE_PROCS(ROW, OLD_ROW)};

static CUresult get_proc_address(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                 CUdriverProcAddressQueryResult *symbolStatus)
{
    const uint64_t known = CU_GET_PROC_ADDRESS_LEGACY_STREAM |
                           CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;
    if (!symbol || !pfn || (flags & ~known))
        return CUDA_ERROR_INVALID_VALUE;
    *pfn = NULL;
    CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    CUresult rc = CUDA_SUCCESS;
    if (cudaVersion > driver_version()) {
        rc = CUDA_ERROR_INVALID_VALUE;     /* newer than this driver, as documented */
    } else {
        /* The newest ABI introduced at or before cudaVersion. */
        const struct proc_entry *best = NULL;
        int named = 0;
        for (size_t i = 0; i < sizeof g_procs / sizeof g_procs[0]; i++) {
            const struct proc_entry *e = &g_procs[i];
            if (strcmp(e->name, symbol) != 0)
                continue;
            named = 1;
            if (e->version <= cudaVersion && (!best || e->version > best->version))
                best = e;
        }
        if (named && !best) {
            status = CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
        } else if (best && best->fn) {
            /* Work runs synchronously, so the per-thread default stream twin (returned for
             * CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) is the same function. */
            *pfn = best->fn;
            status = CU_GET_PROC_ADDRESS_SUCCESS;
        }
    }
    if (symbolStatus)
        *symbolStatus = status;
    const char *trace = getenv("FAKE_CUDA_TRACE");
    if (trace && *trace && strcmp(trace, "0") != 0)
        fprintf(stderr, "fake_libcuda: cuGetProcAddress(%s, %d, %llu) -> %d, %s\n", symbol,
                cudaVersion, (unsigned long long)flags, (int)rc, *pfn ? "found" : "NULL");
    return rc;
}

CUresult CUDAAPI cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                  CUdriverProcAddressQueryResult *symbolStatus)
{
    /* Like the real driver, usable before cuInit (cuda-python resolves everything first). */
    return get_proc_address(symbol, pfn, cudaVersion, flags, symbolStatus);
}
#endif

/* ------------------------------------------------------------------------------------------
 * Test helpers (exported, plain C types, for ctypes)
 * ------------------------------------------------------------------------------------------ */
int fake_cuda_live_allocations(void)
{
    pthread_mutex_lock(&g_lock);
    int n = (int)g_dev_blocks.n;
    pthread_mutex_unlock(&g_lock);
    return n;
}

int fake_cuda_live_host_allocations(void)
{
    pthread_mutex_lock(&g_lock);
    int n = (int)g_host_blocks.n;
    pthread_mutex_unlock(&g_lock);
    return n;
}

int fake_cuda_live_streams(void)
{
    pthread_mutex_lock(&g_lock);
    int n = g_nstreams;
    pthread_mutex_unlock(&g_lock);
    return n;
}

int fake_cuda_live_events(void)
{
    pthread_mutex_lock(&g_lock);
    int n = g_nevents;
    pthread_mutex_unlock(&g_lock);
    return n;
}

/* Reference count of device dev's primary context, or -1 for no such device. */
int fake_cuda_primary_ctx_refcount(int dev)
{
    pthread_mutex_lock(&g_lock);
    int n = (g_init && dev >= 0 && dev < g_ndev) ? g_dev[dev].ctx.refcount : -1;
    pthread_mutex_unlock(&g_lock);
    return n;
}

/* Make the next n_queries cuStreamQuery calls on s (and cuEventQuery calls on events recorded
 * on s from now on) return CUDA_ERROR_NOT_READY. A default stream handle (0, 1, 2) names the
 * default stream of the calling thread's current context. Returns a CUresult. */
static CUresult set_stream_busy(CUstream h, int n_queries)
{
    struct CUstream_st *s;
    if (n_queries < 0)
        return CUDA_ERROR_INVALID_VALUE;
    TRY(resolve_stream(h, &s));
    s->busy = n_queries;
    return CUDA_SUCCESS;
}
int fake_cuda_set_stream_busy(CUstream s, int n_queries)
{
    CUresult r;
    pthread_mutex_lock(&g_lock);
    r = set_stream_busy(s, n_queries);
    pthread_mutex_unlock(&g_lock);
    return (int)r;
}
