/* Kept copy threads for kvtier.transfer._native: a call's parts run on threads that
 * stay after it, spinning a short while for the next call before they sleep.
 *
 * Why: a per-layer load is one call per layer, back to back. A thread started per call
 * (pthread_create) finds the other core asleep, and waking a halted vCPU of this VM
 * costs tens of microseconds: a MiMo sliding layer's 640 KB load took longer on two
 * threads started for it than on one (131 against 86 us), so such calls stayed on one.
 * A thread already running copies its half at once: in a C harness, 640 KB of cold
 * memory took 91 us on one thread, 121 split with a thread started per copy, and 49
 * split with a running one.
 *
 * So each kept thread, once its part is done, spins while the call runs and, where the
 * call came in a burst (within POOL_BURST_NS of the previous call's end), for
 * POOL_SPIN_NS after it ends (KVTIER_COPY_SPIN_US, read at the first call; 0: never),
 * then sleeps on a condition variable until the next call. A call that finds them
 * asleep and moves under POOL_WAKE_MIN_BYTES copies alone, and wakes them for the calls
 * that follow if it came in a burst; a larger one wakes them and splits. An isolated
 * call (a backup now and then) thus costs what it did with threads started per call,
 * and leaves no thread spinning.
 *
 * One caller at a time holds the pool; a copy from another Python thread meanwhile
 * (the GIL is released) starts threads of its own, as before. A forked child starts
 * its own (the parent's do not exist there). The threads never end: they sleep until
 * the process does.
 */
#ifndef KVTIER_COPY_POOL_H
#define KVTIER_COPY_POOL_H

#ifndef _WIN32
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif

#ifndef POOL_SPIN_NS
#define POOL_SPIN_NS 100000 /* 100 us: a few per-layer calls' Python between two copies */
#endif
#ifndef POOL_BURST_NS
#define POOL_BURST_NS 1000000 /* 1 ms: the calls of a per-layer load come tens of us apart */
#endif
#ifndef POOL_WAKE_MIN_BYTES
#define POOL_WAKE_MIN_BYTES (4 << 20)
#endif
#define POOL_MAX 63 /* kept threads, besides the caller's */

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() __asm__ __volatile__("yield")
#else
#define CPU_RELAX() ((void)0)
#endif

typedef void (*pool_fn)(const void *ctx, int part);

/* NOTE: ``ticket`` is the call's number << 8 | its parts, in one word: a thread reads
 * both at once, so it never takes a later call's parts for an earlier call's number. */
static struct {
    pthread_mutex_t lock;
    pthread_cond_t wake;
    int threads;      /* kept threads started (lock) */
    int sleeping;     /* of them, asleep on ``wake`` (lock; read without it as a hint) */
    uint64_t ticket;  /* atomic */
    pool_fn fn;       /* the call's, written before its ticket */
    const void *ctx;
    int remaining;    /* atomic: the call's parts not done by the kept threads */
    int busy;         /* atomic: a caller holds the pool */
    long long spin_ns;  /* KVTIER_COPY_SPIN_US's */
    long long spin_now; /* atomic: the spin after the call running or last ended (0 or spin_ns) */
    long long ended;    /* when the last call ended (pool_now_ns; the holder's) */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0, NULL, NULL, 0, 0, -1, 0, 0};

static long long pool_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* The first ticket after ``seen``: spun for while a call runs and spin_now after it
 * (a thread done with its part waits for the caller's own part first), then slept for. */
static uint64_t pool_next(uint64_t seen) {
    long long until = 0;
    for (unsigned spins = 1;; spins++) {
        uint64_t t = __atomic_load_n(&pool.ticket, __ATOMIC_ACQUIRE);
        if (t != seen)
            return t;
        if (spins % 256 == 0) {
            if (__atomic_load_n(&pool.busy, __ATOMIC_RELAXED)) {
                until = 0;
            } else {
                long long now = pool_now_ns();
                if (until == 0)
                    until = now + __atomic_load_n(&pool.spin_now, __ATOMIC_RELAXED);
                if (now >= until)
                    break;
            }
        }
        CPU_RELAX();
    }
    pthread_mutex_lock(&pool.lock);
    __atomic_store_n(&pool.sleeping, pool.sleeping + 1, __ATOMIC_RELAXED);
    uint64_t t;
    while ((t = __atomic_load_n(&pool.ticket, __ATOMIC_ACQUIRE)) == seen)
        pthread_cond_wait(&pool.wake, &pool.lock);
    __atomic_store_n(&pool.sleeping, pool.sleeping - 1, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&pool.lock);
    return t;
}

typedef struct {
    int part;
    uint64_t seen; /* the ticket before the call that started it */
} pool_start_t;

static void *pool_main(void *arg) {
    pool_start_t start = *(pool_start_t *)arg;
    free(arg);
#ifdef __linux__
    prctl(PR_SET_NAME, "kvtier-copy", 0, 0, 0); /* as top -H and /proc name it */
#endif
    for (uint64_t seen = start.seen;;) {
        seen = pool_next(seen);
        if (start.part < (int)(seen & 0xff)) {
            /* NOTE: the caller waits for this part, so fn and ctx are still this call's */
            pool.fn(pool.ctx, start.part);
            __atomic_fetch_sub(&pool.remaining, 1, __ATOMIC_RELEASE);
        }
    }
    return NULL;
}

/* KVTIER_COPY_SPIN_US, read once, at the first call: with the GIL held (Python sets
 * the environment), before any kept thread starts. Not a number >= 0: POOL_SPIN_NS. */
static void pool_settings(void) {
    if (pool.spin_ns >= 0)
        return;
    const char *us = getenv("KVTIER_COPY_SPIN_US");
    char *end = NULL;
    long long v = us ? strtoll(us, &end, 10) : -1;
    pool.spin_ns = us && end != us && *end == '\0' && v >= 0 && v <= 1000000000LL ? v * 1000 : POOL_SPIN_NS;
}

/* Kept threads up to ``want`` (the caller holds the pool); how many there are. */
static int pool_grow(int want) {
    if (want > POOL_MAX)
        want = POOL_MAX;
    while (pool.threads < want) {
        pool_start_t *start = malloc(sizeof *start);
        if (start == NULL)
            break;
        *start = (pool_start_t){pool.threads + 1, __atomic_load_n(&pool.ticket, __ATOMIC_ACQUIRE)};
        pthread_attr_t attr;
        pthread_t thread;
        int ok = pthread_attr_init(&attr) == 0;
        if (ok) {
            /* NOTE: every signal blocked in the thread (it inherits the mask): signals go to
             * the process's own threads, as if the kept ones did not exist */
            sigset_t all, old;
            sigfillset(&all);
            int masked = pthread_sigmask(SIG_BLOCK, &all, &old) == 0;
            pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
            ok = pthread_create(&thread, &attr, pool_main, start) == 0;
            if (masked)
                pthread_sigmask(SIG_SETMASK, &old, NULL);
            pthread_attr_destroy(&attr);
        }
        if (!ok) {
            free(start);
            break;
        }
        pthread_mutex_lock(&pool.lock);
        pool.threads++;
        pthread_mutex_unlock(&pool.lock);
    }
    return pool.threads;
}

/* Posts a call of ``parts`` parts (1: none for the kept threads, which only wakes them). */
static void pool_post(int parts, pool_fn fn, const void *ctx) {
    pool.fn = fn, pool.ctx = ctx;
    __atomic_store_n(&pool.remaining, parts - 1, __ATOMIC_RELAXED);
    uint64_t next = ((pool.ticket >> 8) + 1) << 8 | (uint64_t)parts;
    __atomic_store_n(&pool.ticket, next, __ATOMIC_RELEASE);
    pthread_mutex_lock(&pool.lock);
    if (pool.sleeping)
        pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
}

static void pool_reset_child(void) {
    pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
    pool.lock = lock, pool.wake = wake;
    pool.threads = pool.sleeping = pool.remaining = pool.busy = 0;
    pool.ended = 0;
}

/* fn(ctx, part) for part 0 .. parts - 1: part 0 here, the others on kept threads (here
 * too, those no thread could be started for), returning once every part is done.
 * ``bytes``: what the call moves (with the kept threads asleep, a small call runs here
 * alone, and wakes them if it came in a burst). 0, or -1 where another call holds the
 * pool and nothing ran. */
static int pool_run(int parts, pool_fn fn, const void *ctx, long long bytes) {
    int expected = 0;
    if (!__atomic_compare_exchange_n(&pool.busy, &expected, 1, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED))
        return -1;
    int kept = pool_grow(parts - 1);
    int asleep = __atomic_load_n(&pool.sleeping, __ATOMIC_RELAXED) > 0;
    int split = kept + 1 < parts ? kept + 1 : parts;
    int burst = pool.ended > 0 && pool_now_ns() - pool.ended < POOL_BURST_NS;
    __atomic_store_n(&pool.spin_now, burst ? pool.spin_ns : 0, __ATOMIC_RELAXED);
    if (asleep && bytes < POOL_WAKE_MIN_BYTES)
        split = 1; /* runs here; in a burst the threads are woken for the next call */
    if (split > 1 || burst)
        pool_post(split, fn, ctx);
    fn(ctx, 0);
    for (int part = split; part < parts; part++) /* parts no kept thread took */
        fn(ctx, part);
    long long until = 0;
    for (unsigned spins = 1; __atomic_load_n(&pool.remaining, __ATOMIC_ACQUIRE) > 0; spins++) {
        if (spins % 256 == 0) { /* a kept thread still waking, or its core taken: let it run */
            long long now = pool_now_ns();
            if (until == 0)
                until = now + pool.spin_ns;
            else if (now >= until)
                sched_yield();
        }
        CPU_RELAX();
    }
    pool.ended = pool_now_ns();
    __atomic_store_n(&pool.busy, 0, __ATOMIC_RELEASE);
    return 0;
}

#endif /* _WIN32 */
#endif /* KVTIER_COPY_POOL_H */
