/* kvtier.storage._pageio's read_pages: a batch of page files read straight into one
 * pool and checked, in one call with the GIL released.
 *
 * Per file: open (no symlink, no blocking), the regular-file and size checks, the cold
 * check (the page cache's count of three stretches, as FileStorage._is_cold), then
 *   - cached: the header, then each part read and hashed a chunk at a time while in
 *     the CPU's cache (move_parts);
 *   - cold: one O_DIRECT request per run of aligned parts that follow each other in
 *     the file (the disk wants large requests; O_DIRECT set on the same descriptor),
 *     then each part hashed, by a hasher thread beside the reader where the call has
 *     more files and staging for two: it judges one file while the next is read, so
 *     the disk is not left idle during the hash.
 * A file counts only if its header is the expected one and every part matches its
 * checksum; anything else gets a status for the caller's own path to judge.
 *
 * NOTE: keeping the next cold file's request in flight (Linux AIO, two files a thread)
 * while one is hashed read 3.5x slower than these synchronous reads on this VM's disk
 * (throwaway A/B), so each thread has one request at a time, as the peers do, and the
 * hash moved to a thread of its own instead: one I/O thread's cold gets of 1.4 MiB
 * pages went from 1.39-1.42 to 1.67-1.85 GB/s (alternated A/B, kvtier bench storage).
 * NOTE: O_DIRECT reads into the same staging file after file took about twice as long
 * as reads into the pool on this VM (1.36 against 0.86 ms a 1.4 MiB file), which neither
 * huge pages nor flushing the staging from the CPU's cache changed; so where the caller's
 * staging holds three files or more, warm files use its first stretch and cold ones the
 * others in turn: in one process alternating cold reads of the same files into
 * page_first and page_head pools, page_first went from about 0.55x of page_head to 0.85x.
 * NOTE: where the caller's staging holds two cold files whole, a cold file's pieces that
 * a warm read moves in place go through staging too (cold_stage), copied out by the
 * hasher once the file checks out: on this VM an O_DIRECT read into a few stretches of
 * staging that are used over and over ran faster than into the pool's pages, and the
 * copy runs beside the next file's read. Alternated in one run (kvtier bench storage,
 * the reader before slot order, whose page_first files were all staged, against the
 * reader that put them in place): 8 MiB page_first cold gets 3.20-3.21 GB/s staged
 * against 2.37-2.43 in place, 1.4 MiB 2.78-2.95 against 2.31-2.33.
 * NOTE: the copy out of staging writes whole lines with streaming stores (the pool's page
 * is not read back soon), since a plain store first reads the line of the pool it writes:
 * 1.4 MiB page_first pages read from the page cache at 0.68-0.73x of raw files' reads
 * with plain stores, 0.97-1.04x with streaming ones (alternated A/B, kvtier bench storage).
 */
#include "_pageio.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/syscall.h>
#ifndef __NR_cachestat
#define __NR_cachestat 451
#endif
#endif

/* READ_ELSEWHERE: a file another call sharing the claim took (see read_files) */
enum { READ_OK = 0, READ_MISSING = 1, READ_COLD = 2, READ_OTHER = 3, READ_DIRECT = 4, READ_PENDING = 5, READ_ELSEWHERE = 6 };
#define PROBE_PAGES 16 /* pages counted at each of a large file's three stretches */


/* The file being read, and the buffers of the call. */
typedef struct {
    const shape_t *sh;
    const unsigned char *zeros;
    unsigned char *sink; /* the zeros between unaligned parts */
    void *state;
    int fd, direct; /* direct: O_DIRECT is set on fd */
    const char *prefix;
    Py_ssize_t prefix_len;
    long long page;
    unsigned char *head;
    char *staging;     /* its staged pieces (sh->staged bytes): warm_staging or cold_staging */
    char *warm_staging, *cold_staging;
    span_t *spans;     /* its pieces in the pool */
    struct iovec *iov; /* its runs' buffers, one run after another */
    unsigned long long *sums;
    unsigned char *status; /* where its file's status goes */
} reader_t;


/* 1: most of the file (size bytes) is out of the page cache, 0: not, -1: cachestat
 * cannot be asked here, -2: it failed. The same three stretches as FileStorage._is_cold. */
static int is_cold(int fd, long long size, long long page) {
#ifdef __linux__
    long long probe = PROBE_PAGES * page, offs[3], lens[3];
    int n = 3;
    if (size <= 3 * probe) {
        offs[0] = 0, lens[0] = size, n = 1;
    } else {
        offs[0] = 0, offs[1] = size / 2 - size / 2 % page, offs[2] = size - probe;
        lens[0] = lens[1] = lens[2] = probe;
    }
    unsigned long long cached = 0, pages = 0;
    for (int i = 0; i < n; i++) {
        struct { uint64_t off, len; } range = {(uint64_t)offs[i], (uint64_t)lens[i]};
        struct { uint64_t nr_cache, nr_dirty, nr_writeback, nr_evicted, nr_recently_evicted; } st = {0};
        if (syscall(__NR_cachestat, fd, &range, &st, 0) != 0)
            return errno == ENOSYS || errno == EPERM ? -1 : -2;
        cached += st.nr_cache;
        pages += (unsigned long long)((offs[i] + lens[i] - 1) / page - offs[i] / page + 1);
    }
    return 2 * cached < pages;
#else
    (void)fd, (void)size, (void)page;
    return -1;
#endif
}

static uint64_t le64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}

static int aligned(const void *at, size_t len) {
    return (uintptr_t)at % ALIGN == 0 && len % ALIGN == 0;
}

/* Whether every piece of part p is aligned for O_DIRECT. */
static int part_aligned(const reader_t *r, Py_ssize_t p) {
    const part_t *part = &r->sh->parts[p];
    for (Py_ssize_t k = part->first; k < part->first + part->count; k++)
        if (!aligned(r->spans[k].at, r->spans[k].len))
            return 0;
    return 1;
}

/* The header's bytes and every wanted part's digest (in r->sums) are this file's. */
static int checks_out(const reader_t *r) {
    const shape_t *sh = r->sh;
    size_t header_len = (size_t)sh->header_len, sums_end = (size_t)r->prefix_len + 8 * (size_t)sh->nsums;
    if (memcmp(r->head, r->prefix, (size_t)r->prefix_len) != 0 ||
        memcmp(r->head + sums_end, r->zeros, header_len - sums_end) != 0)
        return 0;
    for (Py_ssize_t p = 0; p < sh->nparts; p++)
        if (le64(r->head + r->prefix_len + 8 * sh->sum_index[p]) != r->sums[p])
            return 0;
    return 1;
}

/* O_DIRECT set on r->fd (on), or cleared; 0, or -1 with errno set. */
static int set_direct(reader_t *r, int on) {
#ifdef O_DIRECT
    if (r->direct == on)
        return 0;
    int flags = fcntl(r->fd, F_GETFL);
    if (flags < 0 || fcntl(r->fd, F_SETFL, on ? flags | O_DIRECT : flags & ~O_DIRECT) < 0)
        return -1;
    r->direct = on;
    return 0;
#else
    if (!on)
        return 0;
    errno = EINVAL;
    return -1;
#endif
}

/* A cold file's header and parts: one request per run, with O_DIRECT where its
 * buffers are aligned for it, else buffered (the zeros between unaligned parts into
 * sink). A run ends at a gap in the file or where alignment changes; the header
 * comes with a run that starts at the first part, else alone. The parts are hashed
 * afterwards (hash_cold). 0, or -1 with errno set. */
static int read_cold(reader_t *r) {
    const shape_t *sh = r->sh;
    struct iovec *iov = r->iov;
    int have_head = 0;
    for (Py_ssize_t p = 0; p <= sh->nparts;) {
        int n = 0, direct;
        long long offset;
        Py_ssize_t q = p;
        if (p == sh->nparts) { /* the header, when no run brought it */
            if (have_head)
                break;
            iov[n++] = (struct iovec){r->head, (size_t)sh->header_len};
            offset = 0, q = p + 1, direct = aligned(r->head, (size_t)sh->header_len);
        } else {
            offset = sh->parts[p].offset, direct = part_aligned(r, p);
            if (sh->sum_index[p] == 0) {
                iov[n++] = (struct iovec){r->head, (size_t)sh->header_len};
                offset = 0, have_head = 1;
                direct = direct && aligned(r->head, (size_t)sh->header_len);
            }
            for (; q < sh->nparts; q++) {
                const part_t *part = &sh->parts[q];
                if (q > p) {
                    const part_t *prev = &sh->parts[q - 1];
                    long long end = prev->offset;
                    for (Py_ssize_t k = prev->first; k < prev->first + prev->count; k++)
                        end += (long long)sh->len[k];
                    if (sh->sum_index[q] != sh->sum_index[q - 1] + 1 || part_aligned(r, q) != direct ||
                        part->offset - end > ALIGN)
                        break;
                    if (part->offset > end)
                        iov[n++] = (struct iovec){r->sink, (size_t)(part->offset - end)};
                }
                for (Py_ssize_t k = part->first; k < part->first + part->count; k++)
                    iov[n++] = (struct iovec){r->spans[k].at, r->spans[k].len};
            }
        }
        if (set_direct(r, direct) < 0 || iov_all(r->fd, iov, n, offset, 0) < 0)
            return -1;
        p = q;
    }
    return 0;
}

/* A cold file read by read_cold judged: its parts hashed, checked, staged pieces
 * copied out; its status. */
static int hash_cold(reader_t *r) {
    const shape_t *sh = r->sh;
    hash_parts(sh, r->spans, r->state, r->sums);
    if (!checks_out(r))
        return READ_OTHER;
    if (sh->cold_stage)
        unstage_all(sh, r->staging, r->page);
    else
        unstage(sh, r->staging, r->page);
    return READ_DIRECT;
}

/* One file read into its page of the pool: its status, or READ_PENDING where a cold
 * file was read and is left open for hash_cold (then close(r->fd)). */
static int read_file(reader_t *r, const char *path, const char *prefix, Py_ssize_t prefix_len, long long page) {
    const shape_t *sh = r->sh;
    size_t header_len = (size_t)sh->header_len;
    r->prefix = prefix, r->prefix_len = prefix_len, r->page = page, r->direct = 0;
    r->fd = open(path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (r->fd < 0)
        return errno == ENOENT ? READ_MISSING : READ_OTHER; /* the caller judges the rest (ENOTDIR: a fault) */
    int status = READ_OTHER, have_head = 0, cold = 0;
    struct stat st;
    if (fstat(r->fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size != sh->total)
        goto out;
    if (sh->cold_check) {
        cold = is_cold(r->fd, sh->total, sh->page_bytes);
        if (cold == -1) { /* ask for the header without waiting: read when cached */
#if defined(__linux__) && defined(RWF_NOWAIT)
            struct iovec iov = {r->head, header_len};
            ssize_t n = preadv2(r->fd, &iov, 1, 0, RWF_NOWAIT);
            if (n < 0 && (errno == EOPNOTSUPP || errno == EINVAL || errno == ENOSYS)) {
                cold = 0; /* a file system that cannot be asked without waiting (tmpfs): read as cached */
            } else {
                if (n < 0 && errno != EAGAIN)
                    goto out;
                cold = n != (ssize_t)header_len;
                have_head = !cold;
            }
#else
            cold = 0;
#endif
        } else if (cold < 0) {
            goto out;
        }
    }
    r->staging = cold ? r->cold_staging : r->warm_staging;
    page_spans(sh, r->staging, page, r->spans, cold && sh->cold_stage);
    if (cold) {
        /* read with O_DIRECT: about twice a buffered read's speed from disk here, and it
         * leaves the page cache to the host tier's own copy */
        if (set_direct(r, 1) < 0) {
            status = READ_COLD; /* no O_DIRECT here: the caller's path decides */
            goto out;
        }
        if (read_cold(r) == 0)
            return READ_PENDING;
        goto out;
    }
    /* cached: the header first (a file of another object moves no byte into the pool) */
    if (!have_head && move_all(r->fd, (char *)r->head, header_len, 0, 0) < 0)
        goto out;
    if (memcmp(r->head, prefix, (size_t)prefix_len) != 0)
        goto out;
    if (move_parts(r->fd, sh->parts, sh->nparts, r->spans, sh->chunk, 0, r->state, r->sums) < 0)
        goto out;
    if (checks_out(r)) {
        unstage(sh, r->staging, page);
        status = READ_OK;
    }
out:
    close(r->fd);
    return status;
}

/* A thread beside the reader that judges each cold file (hash_cold) while the reader
 * reads the next one into its other slot. */
typedef struct {
    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    reader_t *slot;     /* the reader's two slots */
    int queue[2], queued, busy[2], stop;
} hasher_t;

static void *hasher_main(void *arg) {
    hasher_t *h = arg;
    pthread_mutex_lock(&h->lock);
    for (;;) {
        while (!h->queued && !h->stop)
            pthread_cond_wait(&h->cond, &h->lock);
        if (!h->queued)
            break;
        int s = h->queue[0];
        h->queue[0] = h->queue[1], h->queued--;
        pthread_mutex_unlock(&h->lock);
        reader_t *r = &h->slot[s];
        *r->status = (unsigned char)hash_cold(r);
        close(r->fd);
        pthread_mutex_lock(&h->lock);
        h->busy[s] = 0;
        pthread_cond_broadcast(&h->cond);
    }
    pthread_mutex_unlock(&h->lock);
    return NULL;
}

/* Waits until the hasher is done with slot s. */
static void hasher_wait(hasher_t *h, int s) {
    pthread_mutex_lock(&h->lock);
    while (h->busy[s])
        pthread_cond_wait(&h->cond, &h->lock);
    pthread_mutex_unlock(&h->lock);
}

/* The hasher's lock, condition and thread; 1, or 0 with nothing left to undo. */
static int hasher_start(hasher_t *h) {
    if (pthread_mutex_init(&h->lock, NULL) != 0)
        return 0;
    if (pthread_cond_init(&h->cond, NULL) == 0) {
        if (pthread_create(&h->thread, NULL, hasher_main, h) == 0)
            return 1;
        pthread_cond_destroy(&h->cond);
    }
    pthread_mutex_destroy(&h->lock);
    return 0;
}

/* The hasher ended once every file posted is judged, and its lock and condition gone. */
static void hasher_stop(hasher_t *h) {
    pthread_mutex_lock(&h->lock);
    h->stop = 1;
    pthread_cond_broadcast(&h->cond);
    pthread_mutex_unlock(&h->lock);
    pthread_join(h->thread, NULL);
    pthread_cond_destroy(&h->cond);
    pthread_mutex_destroy(&h->lock);
}

static void hasher_post(hasher_t *h, int s) {
    pthread_mutex_lock(&h->lock);
    h->busy[s] = 1, h->queue[h->queued++] = s;
    pthread_cond_broadcast(&h->cond);
    pthread_mutex_unlock(&h->lock);
}

/* The staging one file takes: its staged parts, or with cold_stage all of its parts. */
static long long file_staging(const shape_t *sh) {
    return sh->cold_stage ? sh->cold_staged : sh->staged;
}

/* The next file this call reads: the next in order, or with a shared ``claim`` the
 * next that no call sharing it took yet. */
static Py_ssize_t next_file(long long *claim, Py_ssize_t f) {
    return claim ? (Py_ssize_t)__atomic_fetch_add(claim, 1, __ATOMIC_RELAXED) : f + 1;
}

/* Every file of the call read (with ``claim``, the files it takes): the cold ones judged
 * by a hasher beside this thread where there are two slots and it starts, else here.
 * A shared claim lets each I/O thread read a whole batch in one call, none of them with
 * a fixed share (why, as traced: the NOTE at FileStorage._read_compiled). */
static void read_files(reader_t *slot, int nslots, const files_t *fs, unsigned char *status, long long *claim) {
    hasher_t h = {.slot = slot};
    int started = 0, tried = nslots < 2;
    /* stretches of one file's staging in the caller's; with two, each slot keeps its own */
    long long per = file_staging(slot->sh);
    long long stretches = nslots == 2 && per ? slot->sh->staging_len / per : 0, pending = 0;
    Py_ssize_t s = 0;
    for (Py_ssize_t f = next_file(claim, -1); f < fs->n; f = next_file(claim, f)) {
        reader_t *r = &slot[s];
        if (started)
            hasher_wait(&h, (int)s);
        r->status = &status[f];
        if (stretches >= 3) { /* warm files in the first stretch, cold ones in turn through the others (NOTE above) */
            r->warm_staging = r->sh->staging;
            r->cold_staging = r->sh->staging + (1 + pending % (stretches - 1)) * per;
        }
        int got = read_file(r, PyBytes_AS_STRING(fs->paths[f]), fs->prefixes[f], fs->prefix_lens[f], fs->pages[f]);
        int more = claim ? __atomic_load_n(claim, __ATOMIC_RELAXED) < fs->n : f + 1 < fs->n;
        if (got == READ_PENDING && !tried && more) { /* the first cold file, more to come */
            tried = 1;
            started = hasher_start(&h);
        }
        if (got != READ_PENDING) {
            status[f] = (unsigned char)got;
            continue;
        }
        pending++; /* its stretch stays the hasher's until the file is judged */
        if (started) {
            hasher_post(&h, (int)s);
            s = (s + 1) % nslots;
        } else {
            status[f] = (unsigned char)hash_cold(r);
            close(r->fd);
        }
    }
    if (started)
        hasher_stop(&h);
}


const char read_pages_doc[] =
    "read_pages(pool, header_len, total, nsums, parts, files, chunk, direct[, staging[, claim]]) -> bytes\n\n"
    "Page files of one layout read straight into ``pool`` (a writable contiguous buffer),\n"
    "with the GIL released. ``parts``: the parts to read, in file order, each\n"
    "``(checksum index, file offset, pieces)``, a piece ``(start, step, bytes)`` going to\n"
    "``pool[start + page * step:][:bytes]``, or staged: ``(start, step, bytes, dims,\n"
    "strides)``, read into ``staging`` (each staged part at a multiple of 4096 bytes)\n"
    "and copied to the pool as an array of those dims and byte strides once the file\n"
    "checks out. ``files``: ``(path, header prefix, page)``\n"
    "each. A file counts only if it is a regular file of ``total`` bytes whose first\n"
    "``header_len`` bytes are the prefix, ``nsums`` checksums and zeros, and whose parts\n"
    "match their checksums. Cached files are read ``chunk`` bytes at a time; with\n"
    "``direct``, a file mostly out of the page cache is read with O_DIRECT (and hashed\n"
    "by a thread beside this one while the next file is read, where ``staging`` holds\n"
    "two files' staged parts). One status\n"
    "byte per file: 0 read, 4 read with O_DIRECT, 1 missing, 2 cold where O_DIRECT\n"
    "cannot be used, 3 anything else (for the caller's own path to judge). ``staging``\n"
    "may be None. ``claim``: None, or a writable, 8-byte aligned int64 counter that\n"
    "calls over the same ``files`` share (from 0): each call then reads the files it\n"
    "takes in turn from it, and answers 6 for the files another call took.";

PyObject *read_pages(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer pool;
    shape_t sh = {.what = "read_pages"};
    reader_t slot[2] = {{0}};
    int nslots = 1;
    Py_ssize_t chunk;
    int direct;
    PyObject *parts_obj, *files_obj, *out = NULL;
    files_t fs = {0};
    unsigned char *zeros = NULL, *sink = NULL;
    Py_buffer staging = {0}, claim = {0};
    PyObject *staging_obj = Py_None, *claim_obj = Py_None;
    if (!PyArg_ParseTuple(args, "w*LLnOOnp|OO:read_pages", &pool, &sh.header_len, &sh.total, &sh.nsums, &parts_obj,
                          &files_obj, &chunk, &direct, &staging_obj, &claim_obj))
        return NULL;
    if (staging_obj != Py_None && PyObject_GetBuffer(staging_obj, &staging, PyBUF_WRITABLE) < 0)
        goto done;
    if (claim_obj != Py_None) {
        if (PyObject_GetBuffer(claim_obj, &claim, PyBUF_WRITABLE) < 0)
            goto done;
        if (claim.len < (Py_ssize_t)sizeof(long long) || (uintptr_t)claim.buf % sizeof(long long)) {
            PyErr_Format(PyExc_ValueError, "read_pages: claim must be an 8-byte aligned int64 counter, got %zd bytes",
                         claim.len);
            goto done;
        }
    }
    sh.flat = pool.buf, sh.flat_len = pool.len, sh.chunk = (size_t)chunk, sh.cold_check = direct;
    sh.staging = staging.buf, sh.staging_len = staging.buf ? staging.len : 0;
    sh.page_bytes = sysconf(_SC_PAGESIZE);
    if (!xxh_create) {
        PyErr_SetString(PyExc_RuntimeError, "read_pages: bind() the xxh3 calls first");
        goto done;
    }
    if (chunk < 0 || sh.nsums < 0 || sh.header_len <= 0 || sh.header_len > MAX_HEADER || sh.total < sh.header_len) {
        PyErr_Format(PyExc_ValueError, "read_pages: chunk %zd, %zd checksums, header %lld of at most %d bytes, file "
                     "%lld bytes", chunk, sh.nsums, sh.header_len, MAX_HEADER, sh.total);
        goto done;
    }
    if (parse_parts(parts_obj, &sh) < 0)
        goto done;
    if (parse_files(&sh, files_obj, 0, &fs) < 0)
        goto done;
    zeros = PyMem_Calloc((size_t)sh.header_len, 1);
    if (posix_memalign((void **)&sink, ALIGN, ALIGN))
        sink = NULL;
    if (!zeros || !sink) {
        PyErr_NoMemory();
        goto done;
    }
    /* cold files through staging, every piece, where it holds two such files (NOTE above) */
    sh.cold_stage = direct && sh.cold_staged > sh.staged && 2 * sh.cold_staged <= sh.staging_len;
    long long per = file_staging(&sh);
    /* two slots where a hasher can judge one cold file while the next is read: staging
     * for two files */
    if (direct && fs.n > 1 && 2 * per <= sh.staging_len)
        nslots = 2;
    for (int s = 0; s < nslots; s++) { /* a run's buffers: the header, its pieces, the zeros between its parts */
        reader_t *r = &slot[s];
        r->spans = PyMem_Calloc((size_t)sh.npieces + 1, sizeof(span_t));
        r->iov = PyMem_Calloc((size_t)(sh.npieces + 2 * sh.nparts + 2), sizeof(struct iovec));
        r->sums = PyMem_Calloc((size_t)sh.nparts + 1, sizeof(unsigned long long));
        if (posix_memalign((void **)&r->head, ALIGN, (size_t)sh.header_len))
            r->head = NULL;
        if (!r->spans || !r->iov || !r->sums || !r->head) {
            PyErr_NoMemory();
            goto done;
        }
        r->sh = &sh, r->zeros = zeros, r->sink = sink;
        r->staging = r->warm_staging = r->cold_staging = sh.staging ? sh.staging + s * per : NULL;
    }
    if (!(out = PyBytes_FromStringAndSize(NULL, fs.n)))
        goto done;
    memset(PyBytes_AS_STRING(out), READ_ELSEWHERE, (size_t)fs.n); /* each file read answers its own */
    for (int s = 0; s < nslots; s++)
        if (!(slot[s].state = xxh_create())) {
            Py_CLEAR(out);
            PyErr_NoMemory();
            goto done;
        }
    Py_BEGIN_ALLOW_THREADS
    read_files(slot, nslots, &fs, (unsigned char *)PyBytes_AS_STRING(out), claim.buf);
    Py_END_ALLOW_THREADS
done:
    for (int s = 0; s < 2; s++) {
        if (slot[s].state)
            xxh_free(slot[s].state);
        PyMem_Free(slot[s].spans);
        PyMem_Free(slot[s].iov);
        PyMem_Free(slot[s].sums);
        free(slot[s].head);
    }
    free_files(&fs);
    PyMem_Free(zeros);
    free(sink);
    free_shape(&sh);
    PyBuffer_Release(&pool);
    if (staging.obj)
        PyBuffer_Release(&staging);
    if (claim.obj)
        PyBuffer_Release(&claim);
    return out;
}
