/* kvtier.transfer._native: the CPU engine's optional compiled block copy.
 *
 * One function, copy_jobs(): for each job, for each page pair i, copy every block of a page,
 * i.e. for every index (i0, ..., ik) of ``shape`` (at most MAX_DIMS axes, the
 * first varying slowest)
 *
 *     dst[dst_page[i] + sum(ij * dst_strides[j])]  <-  src[src_page[i] + sum(ij * src_strides[j])]
 *
 * ``block_bytes`` bytes at a time, in page order, then in ``shape``'s order (the
 * caller orders the axes by the source's memory: sequential reads where it has them).
 * Offsets and strides are in bytes from the start of each buffer.
 *
 * Why C: a page_head per-layer load reads 256-byte blocks 8 KiB apart, which is
 * bound by memory latency; prefetching the source a few blocks ahead hides it
 * (numpy, which cannot prefetch, reaches about half of memcpy). Destination blocks of
 * whole cache lines are written with streaming stores, a line per store where the CPU
 * has AVX-512 (half a line with AVX2): a plain store first reads the line it writes, a
 * third of a copy's memory traffic. One call takes every component's job and splits
 * each job's pages over threads kept between calls (_copy_pool.h), GIL released: a
 * per-layer load then costs one Python call instead of one per component and thread,
 * handed to Python threads (about 400 us of a 4.4 ms load of 64 MiB before).
 *
 * Nothing read from the caller is trusted: every block of every page of every job is
 * checked to lie inside both buffers before the first byte moves (ValueError otherwise).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../_lines.h"
#include "../_sequences.h"

#define MAX_DIMS 6
/* Threads copy_jobs may split one call over. */
#define MAX_THREADS 64
/* Bytes of source prefetched ahead of the block being copied: four of page_first's 2 KiB
 * rows. Measured on the reference spec with L2 prefetches (below): 8 KiB ahead of 2 and
 * 4 KiB, level with 16 and 32 KiB. */
#ifndef AHEAD_BYTES
#define AHEAD_BYTES 8192
#endif
/* Short blocks (at most SHORT_BLOCK bytes: a page_head row of one head) are prefetched
 * further ahead: 80 blocks of 256 bytes. Per-layer loads from page_head, the copy split
 * over two threads started in C, alternated on the 2-core VM (one build per distance):
 * 10.5-11.1 GB/s at 8 KiB, 11.8-13.5 at 12-16, 13.7-14.8 at 20, 12.2-14.8 at 24-64;
 * K/V dims 128/128 and 192/128 alike. page_first's rows stay best at 8 KiB. */
#ifndef AHEAD_SHORT_BYTES
#define AHEAD_SHORT_BYTES 20480
#endif
#define SHORT_BLOCK 1024
/* Cache lines prefetched per block at most (a longer block prefetches its own rest as it
 * is copied: copy_long_block), 8 KiB. Once a store wrote a whole line (_lines.h), 4 KiB
 * fell behind: per-layer loads of 128 KiB blocks (layer_first, page_first_direct)
 * 20.5-21.0 -> 21.6-21.8 GB/s in alternated bench runs, limits level at 24.6-25.0 (2 KiB
 * ahead level with 4, 16 KiB between 4 and 8); the other layouts level. */
#ifndef PREFETCH_LINES
#define PREFETCH_LINES 128
#endif

/* NOTE: prefetches into L2, not L1 (prefetcht1; prefetchnta and prefetcht0 fill L1 on
 * AMD Zen): a core keeps few L1 misses in flight and many more L2 ones, and a scattered
 * gather is bound by how many are in flight. Alternated on the 2-core EPYC VM, reference
 * spec, per-layer loads from page_first went from 12-13 to 16-18 GB/s and from page_head
 * from 14 to 20-22 (nta, 2 KiB ahead -> t1, 8 KiB ahead); contiguous copies level. */
#ifndef PF_LOCALITY
#define PF_LOCALITY 2
#endif
#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH_READ(p) __builtin_prefetch((p), 0, PF_LOCALITY)
#define PREFETCH_WRITE(p) __builtin_prefetch((p), 1, 0)
#else
#define PREFETCH_READ(p) ((void)(p))
#define PREFETCH_WRITE(p) ((void)(p))
#endif

#if defined(__GNUC__) || defined(__clang__)
#define ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define ALWAYS_INLINE inline
#endif

/* The position of one block: page i, index idx[] within the page. */
typedef struct {
    Py_ssize_t page;
    Py_ssize_t idx[MAX_DIMS];
    int64_t dst, src; /* byte offsets of the block */
} Cursor;

typedef struct {
    Py_ssize_t pages, ndim;
    const int64_t *dst_page, *src_page;
    Py_ssize_t shape[MAX_DIMS];
    int64_t dst_stride[MAX_DIMS], src_stride[MAX_DIMS];
} Plan;

static ALWAYS_INLINE void cursor_at_page(const Plan *p, Cursor *c, Py_ssize_t page) {
    c->page = page;
    memset(c->idx, 0, sizeof c->idx);
    if (page < p->pages) {
        c->dst = p->dst_page[page];
        c->src = p->src_page[page];
    }
}

/* Step to the next block (odometer over shape, then the next page). */
static ALWAYS_INLINE void cursor_next(const Plan *p, Cursor *c) {
    for (Py_ssize_t j = p->ndim - 1; j >= 0; j--) {
        if (++c->idx[j] < p->shape[j]) {
            c->dst += p->dst_stride[j];
            c->src += p->src_stride[j];
            return;
        }
        c->dst -= p->dst_stride[j] * (int64_t)(p->shape[j] - 1);
        c->src -= p->src_stride[j] * (int64_t)(p->shape[j] - 1);
        c->idx[j] = 0;
    }
    cursor_at_page(p, c, c->page + 1);
}

/* A buffer argument as a contiguous 1-d int64 array of exactly ``n`` items (n < 0: any). */
static int get_offsets(PyObject *obj, Py_buffer *view, Py_ssize_t n, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    const char *f = view->format ? view->format : "B";
    if (f[0] == '<' || f[0] == '=' || f[0] == '@')
        f++;
    if (view->itemsize != 8 || (strcmp(f, "q") != 0 && strcmp(f, "l") != 0) || view->ndim > 1) {
        PyErr_Format(PyExc_ValueError, "%s: expected a 1-d int64 buffer, got format %s itemsize %zd",
                     name, view->format ? view->format : "B", view->itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    if (n >= 0 && view->len / 8 != n) {
        PyErr_Format(PyExc_ValueError, "%s: expected %zd items, got %zd", name, n, view->len / 8);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* Bytes spanned below and above a page's first block by the strides (the extreme blocks). */
static int page_extent(const Plan *p, const int64_t *stride, int64_t block, int64_t *lo, int64_t *hi) {
    int64_t l = 0, h = block;
    for (Py_ssize_t j = 0; j < p->ndim; j++) {
        int64_t s = stride[j], n = (int64_t)p->shape[j] - 1;
        if ((s > 0 && n > INT64_MAX / 4 / s) || (s < 0 && n > INT64_MAX / 4 / -s))
            return -1;
        if (s > 0)
            h += s * n;
        else
            l += s * n;
        if (h > INT64_MAX / 4 || l < INT64_MIN / 4)
            return -1;
    }
    *lo = l;
    *hi = h;
    return 0;
}

static int check_side(const Plan *p, const int64_t *page, const int64_t *stride, int64_t block,
                      int64_t len, const char *side) {
    int64_t lo, hi;
    if (page_extent(p, stride, block, &lo, &hi) < 0) {
        PyErr_Format(PyExc_ValueError, "%s strides overflow", side);
        return -1;
    }
    for (Py_ssize_t i = 0; i < p->pages; i++) {
        int64_t off = page[i];
        if (off < INT64_MIN / 4 || off > INT64_MAX / 4 || off + lo < 0 || off + hi > len) {
            PyErr_Format(PyExc_ValueError,
                         "%s page %zd at byte offset %lld spans [%lld, %lld), outside the %lld-byte buffer",
                         side, i, (long long)off, (long long)(off + lo), (long long)(off + hi), (long long)len);
            return -1;
        }
    }
    return 0;
}

/* Whether every destination block starts on a 64-byte line and covers whole lines:
 * then it can be written with streaming stores, which skip reading the destination's
 * lines into cache first (a plain store reads each line before writing it: a third
 * of the memory traffic of a copy). */
static int whole_lines(const Plan *p, const char *dst, size_t block) {
    if (!lines_ok(dst, block))
        return 0;
    for (Py_ssize_t j = 0; j < p->ndim; j++)
        if (p->dst_stride[j] % LINE != 0)
            return 0;
    for (Py_ssize_t i = 0; i < p->pages; i++)
        if (p->dst_page[i] % LINE != 0)
            return 0;
    return 1;
}

/* The loops, with 16-byte streaming stores (SSE2) and, where the compiler can build
 * them, a line per store (copy_all_wide, run where the CPU has AVX-512) and half a line
 * (copy_all_half, AVX2). */
#define LOOP(name) name##_narrow
#define LOOP_ATTR
#define LOOP_LINES copy_lines
#include "_copy_loop.h"
#undef LOOP
#undef LOOP_ATTR
#undef LOOP_LINES

/* NOTE: streaming stores a line at a time where the CPU has them (_lines.h). Per-layer
 * loads on the 2-core EPYC VM, a C harness of the same gathers (two threads, the same
 * prefetches, medians of 15 rounds alternating the store widths in one process):
 * page_first's 2 KiB rows 64 KiB apart 17.8 -> 19.0 GB/s, page_head's 256-byte rows
 * 8 KiB apart 9.5 -> 11.0; 32-byte stores between the two; contiguous copies level. In
 * kvtier bench transfer (five pairs of runs alternating KVTIER_WIDE_STORES): per-layer
 * loads from page_first 0.58-0.60x -> 0.61-0.65x of the limit, from page_head
 * 0.52-0.57x -> 0.56-0.64x; backups level. */
#ifdef LINES_WIDE
#define LOOP(name) name##_wide
#define LOOP_ATTR LINES_WIDE_TARGET
#define LOOP_LINES copy_lines_wide
#include "_copy_loop.h"
#undef LOOP
#undef LOOP_ATTR
#undef LOOP_LINES
#endif

/* NOTE: half a line per store where the CPU has AVX2 but not AVX-512 (an AMD Zen 2
 * VM, 2 cores): a C harness of the per-layer loads' gathers (two threads, best of 21
 * rounds) copied page_first's 2 KiB rows 64 KiB apart at 15.3-15.6 GB/s with 16-byte
 * stores and 17.0-18.3 with 32-byte ones, page_head's 256-byte rows 8 KiB apart at
 * 10.1-10.6 against 10.9-11.5. */
#ifdef LINES_WIDE
#define LOOP(name) name##_half
#define LOOP_ATTR LINES_HALF_TARGET
#define LOOP_LINES copy_lines_half
#include "_copy_loop.h"
#undef LOOP
#undef LOOP_ATTR
#undef LOOP_LINES
#endif

/* store: bytes per streaming store, the call's choice (store_width), the CPU's support
 * included. */
static void copy_all(const Plan *p, char *dst, const char *src, size_t block, int stream, int store) {
#ifdef LINES_WIDE
    if (stream && store == 64) {
        copy_all_wide(p, dst, src, block, stream);
        return;
    }
    if (stream && store == 32) {
        copy_all_half(p, dst, src, block, stream);
        return;
    }
#endif
    (void)store;
    copy_all_narrow(p, dst, src, block, stream);
}

/* Bytes per streaming store this call may use: the widest the CPU runs (64 with
 * AVX-512, 32 with AVX2, else 16), capped by KVTIER_WIDE_STORES ("0": 16, "32": 32;
 * read per call, with the GIL held, as Python sets the environment). */
static int store_width(void) {
#ifdef LINES_WIDE
    int width = lines_width();
#else
    int width = 16;
#endif
    const char *flag = getenv("KVTIER_WIDE_STORES");
    if (flag != NULL && strcmp(flag, "0") == 0)
        return 16;
    if (flag != NULL && strcmp(flag, "32") == 0 && width > 32)
        return 32;
    return width;
}

static int get_int64_tuple(PyObject *seq, int64_t *out, Py_ssize_t n, const char *name) {
    PyObject *fast = held_items(seq, name);
    if (fast == NULL)
        return -1;
    if (PySequence_Fast_GET_SIZE(fast) != n) {
        PyErr_Format(PyExc_ValueError, "%s: expected %zd items", name, n);
        Py_DECREF(fast);
        return -1;
    }
    for (Py_ssize_t j = 0; j < n; j++) {
        long long v = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, j));
        if (v == -1 && PyErr_Occurred()) {
            Py_DECREF(fast);
            return -1;
        }
        out[j] = (int64_t)v;
    }
    Py_DECREF(fast);
    return 0;
}

/* One copy job's arguments (see copy_jobs), checked, with the buffers it holds. */
typedef struct {
    Plan plan;
    Py_buffer dst, src, dpage, spage;
    int64_t *offsets; /* page numbers given: both sides' byte offsets, worked out here */
    size_t block;
    int stream;
} Job;

static void job_release(Job *job) {
    PyBuffer_Release(&job->dst);
    PyBuffer_Release(&job->src);
    PyBuffer_Release(&job->dpage);
    PyBuffer_Release(&job->spage);
    PyMem_Free(job->offsets);
    job->offsets = NULL;
}

/* Page numbers ``page[0..n)`` as byte offsets ``first + page * step`` into ``out``; -1
 * (ValueError set) where a number is negative or an offset would leave the range that
 * check_side accepts (a view's page stride may be 0 or negative: a one-page or a
 * reversed view). */
static int page_offsets(const int64_t *page, Py_ssize_t n, int64_t first, int64_t step, int64_t *out,
                        const char *side) {
    const int64_t limit = INT64_MAX / 4;
    if (first < -limit || first > limit || step < -limit || step > limit) {
        PyErr_Format(PyExc_ValueError, "%s: page 0 at byte %lld with a page stride of %lld bytes is out of range",
                     side, (long long)first, (long long)step);
        return -1;
    }
    int64_t most = step ? limit / (step < 0 ? -step : step) : INT64_MAX;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (page[i] < 0 || page[i] > most) {
            PyErr_Format(PyExc_ValueError, "%s page number %lld at %zd is out of range", side, (long long)page[i],
                         i);
            return -1;
        }
        out[i] = first + page[i] * step; /* |first| and |page * step| at most INT64_MAX / 4 */
    }
    return 0;
}

/* Parse and check one job; on success it holds its four buffers and, given page
 * numbers, their byte offsets (job_release), on failure none and an exception is set. */
static int job_parse(PyObject *args, Job *job) {
    PyObject *dst_obj, *src_obj, *dpage_obj, *spage_obj, *shape_obj, *dstr_obj, *sstr_obj, *at_obj = NULL;
    Py_ssize_t block;
    int allow_stream = 1;
    memset(job, 0, sizeof *job);
    if (!PyTuple_Check(args)) {
        PyErr_Format(PyExc_TypeError, "a copy job must be a tuple, got %s", Py_TYPE(args)->tp_name);
        return -1;
    }
    if (!PyArg_ParseTuple(args, "OOOOOOOn|pO:copy_jobs", &dst_obj, &src_obj, &dpage_obj, &spage_obj, &shape_obj,
                          &dstr_obj, &sstr_obj, &block, &allow_stream, &at_obj))
        return -1;
    int64_t at[4] = {0, 0, 0, 0}; /* page numbers given: dst_first, dst_step, src_first, src_step */
    if (at_obj != NULL && at_obj != Py_None && get_int64_tuple(at_obj, at, 4, "pages_at") < 0)
        return -1;
    int numbers = at_obj != NULL && at_obj != Py_None;
    Plan *plan = &job->plan;
    Py_ssize_t ndim = PySequence_Size(shape_obj);
    if (ndim < 0)
        return -1;
    if (ndim > MAX_DIMS) {
        PyErr_Format(PyExc_ValueError, "shape: at most %d axes, got %zd", MAX_DIMS, ndim);
        return -1;
    }
    if (block <= 0 || block > INT64_MAX / 4) { /* (page_extent's sums then stay in range) */
        PyErr_SetString(PyExc_ValueError, "block_bytes must be positive and below 2^61");
        return -1;
    }
    plan->ndim = ndim;
    int64_t shape64[MAX_DIMS];
    if (get_int64_tuple(shape_obj, shape64, ndim, "shape") < 0 ||
        get_int64_tuple(dstr_obj, plan->dst_stride, ndim, "dst_strides") < 0 ||
        get_int64_tuple(sstr_obj, plan->src_stride, ndim, "src_strides") < 0)
        return -1;
    int empty = 0;
    for (Py_ssize_t j = 0; j < ndim; j++) {
        if (shape64[j] < 0) {
            PyErr_SetString(PyExc_ValueError, "shape: negative size");
            return -1;
        }
        if (shape64[j] == 0)
            empty = 1;
        plan->shape[j] = (Py_ssize_t)shape64[j];
    }
    /* NOTE: job_release releases only what was taken: the job starts zeroed */
    if (PyObject_GetBuffer(dst_obj, &job->dst, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0 ||
        PyObject_GetBuffer(src_obj, &job->src, PyBUF_C_CONTIGUOUS) < 0 ||
        get_offsets(dpage_obj, &job->dpage, -1, "dst_pages") < 0 ||
        get_offsets(spage_obj, &job->spage, job->dpage.len / 8, "src_pages") < 0) {
        job_release(job);
        return -1;
    }
    plan->pages = empty ? 0 : job->dpage.len / 8; /* an empty page shape: nothing to copy */
    plan->dst_page = (const int64_t *)job->dpage.buf;
    plan->src_page = (const int64_t *)job->spage.buf;
    if (numbers) {
        Py_ssize_t n = job->dpage.len / 8;
        job->offsets = PyMem_Malloc(2 * (size_t)(n ? n : 1) * sizeof(int64_t));
        if (job->offsets == NULL) {
            job_release(job);
            PyErr_NoMemory();
            return -1;
        }
        if (page_offsets(plan->dst_page, n, at[0], at[1], job->offsets, "dst") < 0 ||
            page_offsets(plan->src_page, n, at[2], at[3], job->offsets + n, "src") < 0) {
            job_release(job);
            return -1;
        }
        plan->dst_page = job->offsets;
        plan->src_page = job->offsets + n;
    }
    job->block = (size_t)block;
    if (plan->pages > 0) {
        if (check_side(plan, plan->dst_page, plan->dst_stride, block, (int64_t)job->dst.len, "dst") < 0 ||
            check_side(plan, plan->src_page, plan->src_stride, block, (int64_t)job->src.len, "src") < 0) {
            job_release(job);
            return -1;
        }
        job->stream = whole_lines(plan, (const char *)job->dst.buf, (size_t)block) && allow_stream;
    }
    return 0;
}

/* Part ``part`` of ``parts`` of every job: a contiguous share of each job's pages. */
typedef struct {
    const Job *jobs;
    Py_ssize_t count;
    Py_ssize_t part, parts;
    int store;
} Share;

static void copy_share(const Share *sh) {
    for (Py_ssize_t k = 0; k < sh->count; k++) {
        const Job *job = &sh->jobs[k];
        Py_ssize_t from = job->plan.pages * sh->part / sh->parts, to = job->plan.pages * (sh->part + 1) / sh->parts;
        if (to <= from)
            continue;
        Plan plan = job->plan;
        plan.pages = to - from;
        plan.dst_page += from;
        plan.src_page += from;
        copy_all(&plan, (char *)job->dst.buf, (const char *)job->src.buf, job->block, job->stream, sh->store);
    }
}

#ifndef _WIN32
#include "_copy_pool.h"

static void *share_thread(void *arg) {
    copy_share((const Share *)arg);
    return NULL;
}

static void share_part(const void *shares, int part) {
    copy_share(&((const Share *)shares)[part]);
}
#endif

/* The bytes every job moves. */
static long long jobs_bytes(const Job *jobs, Py_ssize_t count) {
    long long total = 0;
    for (Py_ssize_t k = 0; k < count; k++) {
        long long n = (long long)jobs[k].plan.pages * (long long)jobs[k].block;
        for (Py_ssize_t j = 0; j < jobs[k].plan.ndim; j++)
            n *= jobs[k].plan.shape[j];
        total += n;
    }
    return total;
}

/* Every job's pages split over ``parts`` threads: this one and parts - 1 kept ones
 * (_copy_pool.h), or where another call holds those, started for the call (a thread
 * that cannot start has its share copied here). */
static void copy_jobs_split(const Job *jobs, Py_ssize_t count, Py_ssize_t parts, int store) {
    Share shares[MAX_THREADS];
    for (Py_ssize_t t = 0; t < parts; t++)
        shares[t] = (Share){jobs, count, t, parts, store};
#ifndef _WIN32
    if (parts > 1 && pool_run((int)parts, share_part, shares, jobs_bytes(jobs, count)) == 0)
        return;
    pthread_t threads[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (Py_ssize_t t = 1; t < parts; t++)
        started[t] = pthread_create(&threads[t], NULL, share_thread, &shares[t]) == 0;
    copy_share(&shares[0]);
    for (Py_ssize_t t = 1; t < parts; t++) {
        if (started[t])
            pthread_join(threads[t], NULL);
        else
            copy_share(&shares[t]);
    }
#else
    for (Py_ssize_t t = 0; t < parts; t++)
        copy_share(&shares[t]);
#endif
}

PyDoc_STRVAR(copy_jobs_doc,
"copy_jobs(jobs, threads=1)\n\n"
"Run copy jobs, each a tuple ``(dst, src, dst_pages, src_pages, shape, dst_strides,\n"
"src_strides, block_bytes[, stream[, pages_at]])``:\n"
"copy ``block_bytes`` at every index of ``shape`` of every page pair: page i's block\n"
"``idx`` goes from ``src`` byte ``src_pages[i] + sum(idx * src_strides)`` to ``dst`` byte\n"
"``dst_pages[i] + sum(idx * dst_strides)``. ``dst`` is a writable buffer, ``src`` a\n"
"buffer (both C-contiguous bytes), ``dst_pages``/``src_pages`` 1-d int64 buffers of\n"
"equal length. Every block of every job is checked to lie inside both of its buffers\n"
"before any byte is copied (ValueError otherwise). Then each job's pages are split into\n"
"``threads`` contiguous shares, one copied on this thread and the others on threads\n"
"kept between calls (at most " Py_STRINGIFY(MAX_THREADS) "; after a call that came within 1 ms\n"
"of the last they spin KVTIER_COPY_SPIN_US, 100 by default, for the next, then sleep;\n"
"with them asleep a call under 4 MiB runs on this thread alone), with the GIL\n"
"released. With ``stream`` (default; and SSE2, and every destination block made of\n"
"whole 64-byte lines) the destination is written with streaming stores, a line per\n"
"store where the CPU has AVX-512, half a line with AVX2 (KVTIER_WIDE_STORES, read per\n"
"call: 0 keeps 16 bytes per store, 32 at most 32). Jobs must not write memory that\n"
"another job, or their own source, holds.\n"
"With ``pages_at``, ``(dst_first, dst_step, src_first, src_step)``, the pages are page\n"
"numbers instead: page p of a side starts at byte ``first + p * step`` (a negative\n"
"number, or one whose offset overflows, is refused).");

static PyObject *copy_jobs(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *jobs_obj;
    Py_ssize_t threads = 1;
    if (!PyArg_ParseTuple(args, "O|n:copy_jobs", &jobs_obj, &threads))
        return NULL;
    if (threads < 1 || threads > MAX_THREADS) {
        PyErr_Format(PyExc_ValueError, "threads must be in [1, %d], got %zd", MAX_THREADS, threads);
        return NULL;
    }
    PyObject *fast = held_items(jobs_obj, "jobs must be a sequence of tuples");
    if (fast == NULL)
        return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(fast);
    Job *jobs = PyMem_Calloc(count > 0 ? (size_t)count : 1, sizeof(Job));
    if (jobs == NULL) {
        Py_DECREF(fast);
        return PyErr_NoMemory();
    }
    Py_ssize_t parsed = 0;
    for (; parsed < count; parsed++)
        if (job_parse(PySequence_Fast_GET_ITEM(fast, parsed), &jobs[parsed]) < 0)
            break;
    if (parsed == count) {
        int store = store_width();
#ifndef _WIN32
        pool_settings();
#endif
        Py_BEGIN_ALLOW_THREADS
        copy_jobs_split(jobs, count, threads, store);
        Py_END_ALLOW_THREADS
    }
    for (Py_ssize_t k = 0; k < parsed; k++)
        job_release(&jobs[k]);
    PyMem_Free(jobs);
    Py_DECREF(fast);
    if (parsed < count)
        return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(store_bytes_doc,
"store_bytes() -> int\n\n"
"Bytes per streaming store that copy_jobs would use now: 64 where the CPU has AVX-512,\n"
"32 where it has AVX2, else 16 (SSE2), capped by KVTIER_WIDE_STORES (0: 16, 32: 32);\n"
"0 where it has no streaming stores.");

static PyObject *store_bytes(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
#if defined(__SSE2__)
    return PyLong_FromLong(store_width());
#else
    return PyLong_FromLong(0);
#endif
}

PyDoc_STRVAR(copy_threads_doc,
"copy_threads() -> (kept, asleep, spin_us)\n\n"
"The threads copy_jobs keeps between calls: how many were started, how many of them\n"
"sleep now, and how long each spins for the next call once a call of a burst ends\n"
"(microseconds, KVTIER_COPY_SPIN_US; -1 until the first copy reads it). (0, 0, -1)\n"
"where none are kept (Windows: threads started per call).");

static PyObject *copy_threads(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
#ifndef _WIN32
    pthread_mutex_lock(&pool.lock);
    int kept = pool.threads, asleep = pool.sleeping;
    pthread_mutex_unlock(&pool.lock);
    return Py_BuildValue("iiL", kept, asleep, pool.spin_ns < 0 ? -1LL : pool.spin_ns / 1000);
#else
    return Py_BuildValue("iiL", 0, 0, -1LL);
#endif
}

static PyMethodDef methods[] = {
    {"copy_jobs", copy_jobs, METH_VARARGS, copy_jobs_doc},
    {"store_bytes", store_bytes, METH_NOARGS, store_bytes_doc},
    {"copy_threads", copy_threads, METH_NOARGS, copy_threads_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvtier.transfer._native",
    "Optional compiled block copy for kvtier's CPU transfers (see copy_jobs).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void) {
#ifndef _WIN32
    pthread_atfork(NULL, NULL, pool_reset_child);
#endif
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "MAX_THREADS", MAX_THREADS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
