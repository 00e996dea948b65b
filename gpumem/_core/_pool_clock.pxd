# cython: language_level=3
# Internal to gpumem: the clock of the history rings and the ring write, as `cdef inline`
# functions compiled into pool.pyx, the only module that cimports this file (it defines the
# clock's process-wide state, so there is one per process).
#
# Why a ticker: an event used to call clock_gettime(CLOCK_MONOTONIC_COARSE) itself, about 5 ns,
# two per alloc/free pair: history made the C hit pair 1.7x slower. The CPU's time-stamp counter
# is no cheaper here (rdtsc: about 10 ns on this AMD EPYC VM). Reading the clock only every N
# events would date sparse events wrongly. So a ticker thread stores CLOCK_MONOTONIC into
# gm_clock_now about every millisecond, and an event reads that (one load of a line that
# changes once per ms). Timestamps are correct to the tick plus the ticker's scheduling delay,
# whatever the event rate; finer than the coarse clock's 4 ms jiffy.
#
# The ticker is plain C (it never touches Python): it is started by the first event that finds
# no ticker (gm_clock_now == 0: that event reads the clock itself) and it stops after
# GM_CLOCK_IDLE_TICKS ticks without an event, setting gm_clock_now back to 0. Around fork()
# (pthread_atfork) it is stopped and reaped, so neither the parent nor the child has one until
# its next event. If no thread can be made, every event reads the clock itself.
from libc.stdint cimport uint64_t

from gpumem._core.pool_layout cimport gm_event, gm_ring

cdef extern from *:
    """
    #include <pthread.h>
    #include <sched.h>
    #include <signal.h>
    #include <time.h>
    #include <atomic>
    #define GM_CLOCK_TICK_NS 1000000       /* 1 ms */
    #define GM_CLOCK_IDLE_TICKS 2000       /* the ticker stops after ~2 s without an event */
    static std::atomic<unsigned long long> gm_clock_now{0};  /* 0: no ticker: read the clock */
    static std::atomic<int> gm_clock_used{0};     /* set by events, cleared by the ticker */
    static std::atomic<int> gm_clock_running{0};  /* 1 while a ticker runs */
    static std::atomic<int> gm_clock_stop{0};     /* set before a fork: the ticker exits */
    static std::atomic<int> gm_clock_no_thread{0};/* pthread_create failed: never try again */
    /* starting, reaping and (around fork) stopping the ticker; never taken by an event that
       could wait (trylock) */
    static pthread_mutex_t gm_clock_mu = PTHREAD_MUTEX_INITIALIZER;
    static pthread_t gm_clock_thread;             /* under gm_clock_mu */
    static int gm_clock_joinable = 0;             /* under gm_clock_mu: a thread to reap */
    static int gm_clock_atfork = 0;               /* under gm_clock_mu */

    static inline unsigned long long gm_mono_ns(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (unsigned long long)ts.tv_sec * 1000000000ULL + (unsigned long long)ts.tv_nsec;
    }

    static void* gm_clock_tick(void*) {
        int idle = 0;
        struct timespec tick = {0, GM_CLOCK_TICK_NS};
        /* a name that top, gdb and /proc/<pid>/task/<tid>/comm show (and the tests count) */
        pthread_setname_np(pthread_self(), "gpumem-clock");
        for (;;) {
            gm_clock_now.store(gm_mono_ns(), std::memory_order_relaxed);
            nanosleep(&tick, NULL);
            if (gm_clock_stop.load(std::memory_order_relaxed))
                break;
            if (gm_clock_used.load(std::memory_order_relaxed)) {
                gm_clock_used.store(0, std::memory_order_relaxed);
                idle = 0;
            } else if (++idle >= GM_CLOCK_IDLE_TICKS) {
                break;
            }
        }
        gm_clock_now.store(0, std::memory_order_relaxed);  /* events read the clock again */
        /* Stopping when idle, the ticker detaches itself: otherwise a process that stops
           allocating keeps a finished thread nobody joins (ThreadSanitizer's "thread leak").
           Never wait for the mutex: fork's hook holds it while it joins this thread (it set
           gm_clock_stop first); a starting event holds it only while gm_clock_running is 1,
           so it never joins this thread either, and lets go soon. */
        for (;;) {
            if (pthread_mutex_trylock(&gm_clock_mu) == 0) {
                if (gm_clock_joinable) {
                    gm_clock_joinable = 0;
                    pthread_detach(pthread_self());
                }
                gm_clock_running.store(0, std::memory_order_release);
                pthread_mutex_unlock(&gm_clock_mu);
                return NULL;
            }
            if (gm_clock_stop.load(std::memory_order_relaxed))
                break;                          /* fork's hook joins this thread */
            sched_yield();
        }
        gm_clock_running.store(0, std::memory_order_release);
        return NULL;
    }

    static void gm_clock_reap_locked(void) {    /* gm_clock_mu held */
        if (gm_clock_joinable) {
            pthread_join(gm_clock_thread, NULL);
            gm_clock_joinable = 0;
        }
    }

    /* fork: the ticker is stopped and reaped first (at most one tick), so the fork sees one
       thread fewer (Python 3.12+ warns when forking a multi-threaded process) and the child
       inherits no ticker state; the next event restarts it, in the parent and in the child */
    static void gm_clock_before_fork(void) {
        pthread_mutex_lock(&gm_clock_mu);
        if (gm_clock_joinable) {
            gm_clock_stop.store(1, std::memory_order_relaxed);
            gm_clock_reap_locked();
            gm_clock_stop.store(0, std::memory_order_relaxed);
        }
    }
    static void gm_clock_after_fork_parent(void) {
        pthread_mutex_unlock(&gm_clock_mu);
    }
    static void gm_clock_after_fork_child(void) {
        gm_clock_now.store(0, std::memory_order_relaxed);
        gm_clock_used.store(0, std::memory_order_relaxed);
        gm_clock_running.store(0, std::memory_order_relaxed);
        gm_clock_joinable = 0;
        pthread_mutex_unlock(&gm_clock_mu);     /* locked by this (the forking) thread */
    }

    /* The rare path: no ticker. Starts one (unless another thread is at it) and reads the
       clock itself. Creates no Python object: callable under the pool's locks. */
    __attribute__((noinline, cold)) static unsigned long long gm_clock_slow(void) {
        if (!gm_clock_no_thread.load(std::memory_order_relaxed)
                && !gm_clock_running.load(std::memory_order_acquire)
                && pthread_mutex_trylock(&gm_clock_mu) == 0) {
            if (!gm_clock_running.load(std::memory_order_acquire)) {
                pthread_attr_t attr;
                sigset_t all, old;
                int rc;
                gm_clock_reap_locked();     /* a ticker that stopped when idle */
                if (!gm_clock_atfork) {
                    gm_clock_atfork = 1;
                    pthread_atfork(gm_clock_before_fork, gm_clock_after_fork_parent,
                                   gm_clock_after_fork_child);
                }
                /* publish a reading before the ticker exists: its samples are all later, so
                   a ring's events never go back in time across the start */
                gm_clock_now.store(gm_mono_ns(), std::memory_order_relaxed);
                gm_clock_running.store(1, std::memory_order_relaxed);
                sigfillset(&all);           /* signals go to the application's threads */
                pthread_sigmask(SIG_SETMASK, &all, &old);
                pthread_attr_init(&attr);
                pthread_attr_setstacksize(&attr, 64 * 1024);
                rc = pthread_create(&gm_clock_thread, &attr, gm_clock_tick, NULL);
                pthread_attr_destroy(&attr);
                pthread_sigmask(SIG_SETMASK, &old, NULL);
                if (rc == 0) {
                    gm_clock_joinable = 1;
                } else {                    /* no thread: every event reads the clock */
                    gm_clock_now.store(0, std::memory_order_relaxed);
                    gm_clock_no_thread.store(1, std::memory_order_relaxed);
                    gm_clock_running.store(0, std::memory_order_relaxed);
                }
            }
            pthread_mutex_unlock(&gm_clock_mu);
        }
        unsigned long long t = gm_clock_now.load(std::memory_order_relaxed);
        return t ? t : gm_mono_ns();
    }

    /* The ticker's last CLOCK_MONOTONIC reading; 0 while no ticker runs. */
    static inline unsigned long long gm_clock_value(void) {
        return gm_clock_now.load(std::memory_order_relaxed);
    }

    /* A ring's first event at a new clock value t (once per tick per active ring), or an event
       while no ticker runs (t == 0): tell the ticker the clock is in use (it stops after
       GM_CLOCK_IDLE_TICKS ticks without), or start one and read the clock. The time to record. */
    __attribute__((noinline)) static unsigned long long gm_clock_new_tick(unsigned long long t) {
        if (t == 0)
            return gm_clock_slow();
        if (!gm_clock_used.load(std::memory_order_relaxed))
            gm_clock_used.store(1, std::memory_order_relaxed);
        return t;
    }

    /* Bytes ahead of the write position that an event prefetches for writing: the ring (3-4 MiB
       by default) streams through the cache, and a store that misses holds up the next lock's
       xchg until its line arrives; this brings the line in while the pair runs (a hint: never
       faults, so it may point past the ring's end). */
    #define GM_RING_PREFETCH_BYTES 512
    static inline void gm_ring_prefetch(const void* e) {
        __builtin_prefetch((const char*)e + GM_RING_PREFETCH_BYTES, 1, 3);
    }

    static inline int gm_clock_ticking(void) {   /* a ticker runs */
        return gm_clock_running.load(std::memory_order_acquire);
    }
    """
    unsigned long long gm_clock_value() nogil
    unsigned long long gm_clock_new_tick(unsigned long long t) nogil
    void gm_ring_prefetch(const void* e) nogil
    int gm_clock_ticking() nogil


cdef inline void _record(gm_ring* r, uint64_t op, uint64_t id, size_t size,
                         uint64_t stream) noexcept nogil:
    """Append an event to r (nothing when r is off). The caller holds the lock that guards r:
    the pool's for the pool's ring, a front cache's for its own.

    The common case is one load of the clock and a compare with the ring's last value; the
    ticker's "in use" flag is set once per tick per ring (gm_clock_new_tick), not checked per
    event."""
    cdef gm_event* e
    cdef uint64_t t
    if r.events == NULL:
        return
    t = gm_clock_value()
    if t != r.last_t:
        t = gm_clock_new_tick(t)
        r.last_t = t
    e = &r.events[r.count & r.mask]
    gm_ring_prefetch(e)
    e.t_ns = t
    e.id = id
    e.size_op = size | (op << 63)
    e.stream = stream
    r.count += 1
