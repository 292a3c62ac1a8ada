/* kvtier.storage._pageio: a page file's parts read or written, each checksummed with
 * xxh3-64 while its bytes are in the CPU's cache, in one call with the GIL released.
 *
 * Python's loop over a part's pieces costs two calls per chunk; hashing a part after it
 * was read whole costs a second pass from memory. Here each chunk is read and then
 * hashed (written: hashed and then written) while it sits in the core's cache.
 *
 * The hash is the xxHash that the ``xxhash`` package compiled: its extension exports
 * the streaming XXH3 calls, which ``kvtier.storage.pageio`` finds with ctypes and hands
 * to ``bind`` (its self-check compares a digest with ``xxhash.xxh3_64_intdigest`` before
 * the module is used). Nothing here parses file contents: the caller checks digests
 * against the header it read and built.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>
#include <fcntl.h>
#ifdef __linux__
#include <sys/syscall.h>
#ifndef __NR_cachestat
#define __NR_cachestat 451 /* Linux 6.5: the same number on every architecture */
#endif
#endif

typedef void *(*create_fn)(void);
typedef int (*free_fn)(void *);
typedef int (*reset_fn)(void *);
typedef int (*update_fn)(void *, const void *, size_t);
typedef unsigned long long (*digest_fn)(const void *);

static create_fn xxh_create;
static free_fn xxh_free;
static reset_fn xxh_reset;
static update_fn xxh_update;
static digest_fn xxh_digest;

PyDoc_STRVAR(bind_doc,
"bind(create, free, reset, update, digest)\n\n"
"The addresses of XXH3_createState, XXH3_freeState, XXH3_64bits_reset,\n"
"XXH3_64bits_update and XXH3_64bits_digest.");

static PyObject *bind(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long a[5];
    if (!PyArg_ParseTuple(args, "KKKKK:bind", &a[0], &a[1], &a[2], &a[3], &a[4]))
        return NULL;
    for (int i = 0; i < 5; i++)
        if (!a[i]) {
            PyErr_SetString(PyExc_ValueError, "bind: a null function address");
            return NULL;
        }
    xxh_create = (create_fn)(uintptr_t)a[0];
    xxh_free = (free_fn)(uintptr_t)a[1];
    xxh_reset = (reset_fn)(uintptr_t)a[2];
    xxh_update = (update_fn)(uintptr_t)a[3];
    xxh_digest = (digest_fn)(uintptr_t)a[4];
    Py_RETURN_NONE;
}

/* A contiguous stretch of memory. */
typedef struct {
    char *at;
    size_t len;
} span_t;

/* One part: its file offset and the stretches [first, first + count) of a span array. */
typedef struct {
    long long offset;
    Py_ssize_t first, count;
} part_t;

/* Every byte of buf at offset, read (write == 0) or written; 0, or -1 with errno set
 * (EIO: a read met the end of the file). */
static int move_all(int fd, char *buf, size_t len, long long offset, int write) {
    while (len) {
        ssize_t n = write ? pwrite(fd, buf, len, (off_t)offset) : pread(fd, buf, len, (off_t)offset);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        if (n == 0) {
            errno = EIO;
            return -1;
        }
        buf += n;
        len -= (size_t)n;
        offset += n;
    }
    return 0;
}

/* The parts moved and hashed; 0, or -1 with errno set. */
static int move_parts(int fd, const part_t *parts, Py_ssize_t nparts, const span_t *spans, size_t chunk, int write,
                      void *state, unsigned long long *sums) {
    for (Py_ssize_t p = 0; p < nparts; p++) {
        long long offset = parts[p].offset;
        xxh_reset(state);
        for (Py_ssize_t b = parts[p].first; b < parts[p].first + parts[p].count; b++) {
            char *at = spans[b].at;
            size_t left = spans[b].len;
            while (left) {
                /* each piece ends at a multiple of chunk in the file: the page cache then
                 * holds a written file in large folios, which read back far faster */
                size_t n = left;
                if (chunk) {
                    size_t room = chunk - (size_t)((unsigned long long)offset % chunk);
                    if (room < n)
                        n = room;
                }
                if (write)
                    xxh_update(state, at, n);  /* first: the write's copy then reads from cache */
                if (move_all(fd, at, n, offset, write) < 0)
                    return -1;
                if (!write)
                    xxh_update(state, at, n);
                at += n;
                left -= n;
                offset += (long long)n;
            }
        }
        sums[p] = xxh_digest(state);
    }
    return 0;
}

static void release(Py_buffer *bufs, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++)
        PyBuffer_Release(&bufs[i]);
    PyMem_Free(bufs);
}

PyDoc_STRVAR(move_doc,
"move(fd, parts, chunk, write) -> tuple of int\n\n"
"Each part of ``parts`` (``(offset, buffers)``, buffers contiguous, writable to\n"
"read into) read from ``fd`` at its offset (``write``: written there), in pieces that\n"
"end at multiples of ``chunk`` in the file (0: each buffer in one call), and its\n"
"xxh3-64 digest. Raises OSError (EIO when a read meets the end of the file); the\n"
"GIL is released meanwhile.");

static PyObject *move(PyObject *self, PyObject *args) {
    (void)self;
    int fd, write;
    Py_ssize_t chunk;
    PyObject *parts_obj;
    if (!PyArg_ParseTuple(args, "iOnp:move", &fd, &parts_obj, &chunk, &write))
        return NULL;
    if (chunk < 0) {
        PyErr_Format(PyExc_ValueError, "move: chunk must be at least 0, got %zd", chunk);
        return NULL;
    }
    if (!xxh_create) {
        PyErr_SetString(PyExc_RuntimeError, "move: bind() the xxh3 calls first");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(parts_obj, "move: parts must be a sequence");
    if (!seq)
        return NULL;
    Py_ssize_t nparts = PySequence_Fast_GET_SIZE(seq), nbufs = 0, total = 0, p;
    part_t *parts = PyMem_Calloc(nparts ? nparts : 1, sizeof(part_t));
    unsigned long long *sums = PyMem_Calloc(nparts ? nparts : 1, sizeof(unsigned long long));
    PyObject **lists = PyMem_Calloc(nparts ? nparts : 1, sizeof(PyObject *));
    Py_buffer *bufs = NULL;
    span_t *spans = NULL;
    PyObject *out = NULL;
    if (!parts || !sums || !lists) {
        PyErr_NoMemory();
        goto done;
    }
    for (p = 0; p < nparts; p++) {  /* each part's offset and buffer list; their count */
        PyObject *pair = PySequence_Fast_GET_ITEM(seq, p), *list;
        if (!PyTuple_Check(pair)) {
            PyErr_SetString(PyExc_TypeError, "move: each part must be a tuple (offset, buffers)");
            goto done;
        }
        if (!PyArg_ParseTuple(pair, "LO:move part", &parts[p].offset, &list))
            goto done;
        if (!(lists[p] = PySequence_Fast(list, "move: a part's buffers must be a sequence")))
            goto done;
        parts[p].first = total;
        parts[p].count = PySequence_Fast_GET_SIZE(lists[p]);
        total += parts[p].count;
    }
    if (!(bufs = PyMem_Calloc(total ? total : 1, sizeof(Py_buffer)))) {
        PyErr_NoMemory();
        goto done;
    }
    int flags = write ? PyBUF_C_CONTIGUOUS : PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE;
    for (p = 0; p < nparts; p++)
        for (Py_ssize_t b = 0; b < parts[p].count; b++, nbufs++)
            if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(lists[p], b), &bufs[nbufs], flags) < 0)
                goto done;
    if (!(spans = PyMem_Calloc(total ? total : 1, sizeof(span_t)))) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t b = 0; b < total; b++)
        spans[b] = (span_t){(char *)bufs[b].buf, (size_t)bufs[b].len};
    void *state = xxh_create();
    if (!state) {
        PyErr_NoMemory();
        goto done;
    }
    int rc, err = 0;
    Py_BEGIN_ALLOW_THREADS
    rc = move_parts(fd, parts, nparts, spans, (size_t)chunk, write, state, sums);
    if (rc < 0)
        err = errno;
    xxh_free(state);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    out = PyTuple_New(nparts);
    for (Py_ssize_t p = 0; out && p < nparts; p++) {
        PyObject *v = PyLong_FromUnsignedLongLong(sums[p]);
        if (!v) {
            Py_CLEAR(out);
            break;
        }
        PyTuple_SET_ITEM(out, p, v);
    }
done:
    if (bufs)
        release(bufs, nbufs);
    for (p = 0; lists && p < nparts; p++)
        Py_XDECREF(lists[p]);
    PyMem_Free(lists);
    PyMem_Free(spans);
    PyMem_Free(parts);
    PyMem_Free(sums);
    Py_DECREF(seq);
    return out;
}

PyDoc_STRVAR(cached_pages_doc,
"cached_pages(fd, offset, length) -> int or None\n\n"
"How many pages of ``fd``'s bytes [offset, offset + length) are in the page cache\n"
"(Linux's cachestat, which starts no I/O); None where the kernel lacks it.");

static PyObject *cached_pages(PyObject *self, PyObject *args) {
    (void)self;
    int fd;
    unsigned long long offset, length;
    if (!PyArg_ParseTuple(args, "iKK:cached_pages", &fd, &offset, &length))
        return NULL;
#ifdef __linux__
    struct { uint64_t off, len; } range = {offset, length};
    struct { uint64_t nr_cache, nr_dirty, nr_writeback, nr_evicted, nr_recently_evicted; } stat = {0};
    long rc;
    Py_BEGIN_ALLOW_THREADS
    rc = syscall(__NR_cachestat, fd, &range, &stat, 0);
    Py_END_ALLOW_THREADS
    if (rc == 0)
        return PyLong_FromUnsignedLongLong(stat.nr_cache);
    if (errno != ENOSYS && errno != EPERM)  /* EPERM: a seccomp filter that does not know it */
        return PyErr_SetFromErrno(PyExc_OSError);
#endif
    Py_RETURN_NONE;
}

PyDoc_STRVAR(preallocate_doc,
"preallocate(fd, length) -> bool\n\n"
"Reserve ``fd``'s first ``length`` bytes on disk in one request (Linux's fallocate,\n"
"which the file system answers with as few extents as it can); False where the\n"
"file system or the platform cannot (nothing is written then, unlike\n"
"posix_fallocate's emulation).");

static PyObject *preallocate(PyObject *self, PyObject *args) {
    (void)self;
    int fd;
    long long length;
    if (!PyArg_ParseTuple(args, "iL:preallocate", &fd, &length))
        return NULL;
    if (length <= 0) {
        PyErr_Format(PyExc_ValueError, "preallocate: length must be positive, got %lld", length);
        return NULL;
    }
#ifdef __linux__
    int rc, err = 0;
    Py_BEGIN_ALLOW_THREADS
    rc = fallocate(fd, 0, 0, (off_t)length);
    if (rc < 0)
        err = errno;
    Py_END_ALLOW_THREADS
    if (rc == 0)
        Py_RETURN_TRUE;
    if (err != EOPNOTSUPP && err != ENOSYS && err != EINVAL) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
#endif
    Py_RETURN_FALSE;
}

/* -- read_pages: a batch of page files read straight into one pool ------------------- */

enum { READ_OK = 0, READ_MISSING = 1, READ_COLD = 2, READ_OTHER = 3, READ_DIRECT = 4 };
#define ALIGN 4096
#define MAX_IOV 1024 /* IOV_MAX on Linux */
#define PROBE_PAGES 16 /* pages counted at each of a large file's three stretches */
#define MAX_HEADER (1 << 20)

/* What every file of one read_pages call shares: its layout, and where its parts go. */
typedef struct {
    char *flat;
    long long flat_len, header_len, total, page_bytes;
    Py_ssize_t nsums, nparts, npieces;
    Py_ssize_t *sum_index; /* per wanted part: its checksum's index in the header */
    part_t *parts;         /* per wanted part: its file offset, its pieces */
    long long *start, *step; /* per piece: its bytes in the pool are flat[start + page * step], span.len of them */
    span_t *spans;         /* the pieces of the file being read */
    size_t chunk;
    int cold_check;
} shape_t;

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

/* Every byte of iov[0..n) read from fd at offset (O_DIRECT or not); 0, or -1 with errno
 * set (EIO: the file ended early). Consumes iov. */
static int readv_all(int fd, struct iovec *iov, int n, long long offset) {
    while (n > 0) {
        ssize_t got = preadv(fd, iov, n < MAX_IOV ? n : MAX_IOV, (off_t)offset);
        if (got < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        if (got == 0) {
            errno = EIO;
            return -1;
        }
        offset += got;
        while (n > 0 && (size_t)got >= iov->iov_len) {
            got -= (ssize_t)iov->iov_len;
            iov++, n--;
        }
        if (n > 0) {
            iov->iov_base = (char *)iov->iov_base + got;
            iov->iov_len -= (size_t)got;
        }
    }
    return 0;
}

static int aligned(const void *at, size_t len) {
    return (uintptr_t)at % ALIGN == 0 && len % ALIGN == 0;
}

/* Whether every piece of part p (at its page) is aligned for O_DIRECT. */
static int part_aligned(const shape_t *sh, Py_ssize_t p) {
    for (Py_ssize_t k = sh->parts[p].first; k < sh->parts[p].first + sh->parts[p].count; k++)
        if (!aligned(sh->spans[k].at, sh->spans[k].len))
            return 0;
    return 1;
}

/* A cold file's header and parts read with O_DIRECT (dfd) in one request per run of
 * parts that follow each other in the file (the disk wants large requests); parts
 * whose buffers are not aligned for it make runs of their own, read through fd (the
 * zeros between them into sink). Then each part is hashed. 0, or -1 with errno set. */
static int read_cold(const shape_t *sh, int fd, int dfd, unsigned char *head, char *sink, struct iovec *iov,
                     void *state, unsigned long long *sums) {
    int have_head = 0;
    for (Py_ssize_t p = 0; p < sh->nparts;) {
        int n = 0, ok = 1;
        long long offset = sh->parts[p].offset;
        if (sh->sum_index[p] == 0) { /* the header comes with the first part */
            iov[n++] = (struct iovec){head, (size_t)sh->header_len};
            offset = 0, have_head = 1;
        }
        Py_ssize_t q = p;
        for (; q < sh->nparts; q++) {
            if (q > p) { /* a run ends at a gap in the file, or where alignment changes */
                if (sh->sum_index[q] != sh->sum_index[q - 1] + 1 || part_aligned(sh, q) != part_aligned(sh, p))
                    break;
                long long end = sh->parts[q - 1].offset;
                for (Py_ssize_t k = sh->parts[q - 1].first; k < sh->parts[q - 1].first + sh->parts[q - 1].count; k++)
                    end += (long long)sh->spans[k].len;
                if (sh->parts[q].offset - end > ALIGN || sh->parts[q].offset < end)
                    break;
                if (sh->parts[q].offset > end)
                    iov[n++] = (struct iovec){sink, (size_t)(sh->parts[q].offset - end)};
            }
            for (Py_ssize_t k = sh->parts[q].first; k < sh->parts[q].first + sh->parts[q].count; k++)
                iov[n++] = (struct iovec){sh->spans[k].at, sh->spans[k].len};
        }
        for (int i = 0; i < n; i++)
            ok = ok && aligned(iov[i].iov_base, iov[i].iov_len);
        if (readv_all(ok && offset % ALIGN == 0 ? dfd : fd, iov, n, offset) < 0)
            return -1;
        p = q;
    }
    if (!have_head) {
        iov[0] = (struct iovec){head, (size_t)sh->header_len};
        if (readv_all(dfd, iov, 1, 0) < 0)
            return -1;
    }
    for (Py_ssize_t p = 0; p < sh->nparts; p++) {
        xxh_reset(state);
        for (Py_ssize_t k = sh->parts[p].first; k < sh->parts[p].first + sh->parts[p].count; k++)
            xxh_update(state, sh->spans[k].at, sh->spans[k].len);
        sums[p] = xxh_digest(state);
    }
    return 0;
}

/* One file read into the pool: READ_OK only when it is a regular file of the layout's
 * size whose header is the expected one (prefix, then zeros after the checksums) and
 * every wanted part matches its checksum. Anything else is left to the caller's own
 * path, which reads it again and judges it (the pool's bytes of that page may hold
 * what was read meanwhile: the page is not loaded). */
static int read_one(const shape_t *sh, const char *path, const char *prefix, Py_ssize_t prefix_len,
                    long long page, unsigned char *head, const unsigned char *zeros, unsigned char *sink,
                    struct iovec *iov, void *state, unsigned long long *sums) {
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0)
        return errno == ENOENT || errno == ENOTDIR ? READ_MISSING : READ_OTHER;
    int status = READ_OTHER, have_head = 0, dfd = -1;
    size_t header_len = (size_t)sh->header_len;
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size != sh->total)
        goto out;
    if (sh->cold_check) {
        int cold = is_cold(fd, sh->total, sh->page_bytes);
        if (cold == -1) { /* ask for the header without waiting: read when cached */
#if defined(__linux__) && defined(RWF_NOWAIT)
            struct iovec iov = {head, header_len};
            ssize_t n = preadv2(fd, &iov, 1, 0, RWF_NOWAIT);
            if (n < 0 && errno != EAGAIN)
                goto out;
            if (n != (ssize_t)header_len) {
                status = READ_COLD;
                goto out;
            }
            have_head = 1;
#endif
        } else if (cold < 0) {
            goto out;
        } else if (cold) {
            /* read with O_DIRECT: about twice a buffered read's speed from disk here, and
             * it leaves the page cache to the host tier's own copy */
#ifdef O_DIRECT
            dfd = open(path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC | O_DIRECT);
#endif
            struct stat same;
            if (dfd < 0 || fstat(dfd, &same) != 0 || same.st_dev != st.st_dev || same.st_ino != st.st_ino) {
                status = READ_COLD; /* no O_DIRECT here, or replaced meanwhile: the caller's path decides */
                goto out;
            }
        }
    }
    for (Py_ssize_t k = 0; k < sh->npieces; k++)
        sh->spans[k].at = sh->flat + sh->start[k] + page * sh->step[k];
    size_t sums_end = (size_t)prefix_len + 8 * (size_t)sh->nsums;
    if (dfd >= 0) {
        if (read_cold(sh, fd, dfd, head, (char *)sink, iov, state, sums) < 0)
            goto out;
    } else {
        /* the header first: a file of another object moves no byte into the pool */
        if (!have_head && move_all(fd, (char *)head, header_len, 0, 0) < 0)
            goto out;
        if (memcmp(head, prefix, (size_t)prefix_len) != 0)
            goto out;
        if (move_parts(fd, sh->parts, sh->nparts, sh->spans, sh->chunk, 0, state, sums) < 0)
            goto out;
    }
    if (memcmp(head, prefix, (size_t)prefix_len) != 0 || memcmp(head + sums_end, zeros, header_len - sums_end) != 0)
        goto out;
    for (Py_ssize_t p = 0; p < sh->nparts; p++)
        if (le64(head + prefix_len + 8 * sh->sum_index[p]) != sums[p])
            goto out;
    status = dfd >= 0 ? READ_DIRECT : READ_OK;
out:
    if (dfd >= 0)
        close(dfd);
    close(fd);
    return status;
}

/* The shape's parts from a sequence of (checksum index, file offset, ((start, step,
 * bytes), ...)); 0, or -1 with an exception set. */
static int parse_parts(PyObject *parts_obj, shape_t *sh) {
    PyObject *seq = PySequence_Fast(parts_obj, "read_pages: parts must be a sequence");
    if (!seq)
        return -1;
    int rc = -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), total = 0;
    PyObject **pieces = PyMem_Calloc(n ? n : 1, sizeof(PyObject *));
    sh->nparts = n;
    sh->sum_index = PyMem_Calloc(n ? n : 1, sizeof(Py_ssize_t));
    sh->parts = PyMem_Calloc(n ? n : 1, sizeof(part_t));
    if (!pieces || !sh->sum_index || !sh->parts) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t p = 0; p < n; p++) {
        PyObject *list;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, p), "nLO:read_pages part", &sh->sum_index[p],
                              &sh->parts[p].offset, &list))
            goto done;
        if (sh->sum_index[p] < 0 || sh->sum_index[p] >= sh->nsums || sh->parts[p].offset < sh->header_len) {
            PyErr_Format(PyExc_ValueError, "read_pages: part %zd: checksum %zd of %zd, offset %lld under the "
                         "header's %lld bytes", p, sh->sum_index[p], sh->nsums, sh->parts[p].offset,
                         sh->header_len);
            goto done;
        }
        if (!(pieces[p] = PySequence_Fast(list, "read_pages: a part's pieces must be a sequence")))
            goto done;
        sh->parts[p].first = total;
        sh->parts[p].count = PySequence_Fast_GET_SIZE(pieces[p]);
        total += sh->parts[p].count;
    }
    sh->npieces = total;
    sh->start = PyMem_Calloc(total ? total : 1, sizeof(long long));
    sh->step = PyMem_Calloc(total ? total : 1, sizeof(long long));
    sh->spans = PyMem_Calloc(total ? total : 1, sizeof(span_t));
    if (!sh->start || !sh->step || !sh->spans) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t p = 0, k = 0; p < n; p++) {
        long long end = sh->parts[p].offset;
        for (Py_ssize_t j = 0; j < sh->parts[p].count; j++, k++) {
            long long nbytes;
            if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(pieces[p], j), "LLL:read_pages piece", &sh->start[k],
                                  &sh->step[k], &nbytes))
                goto done;
            if (sh->start[k] < 0 || sh->step[k] < 0 || nbytes < 0 || sh->start[k] + nbytes > sh->flat_len) {
                PyErr_Format(PyExc_ValueError, "read_pages: piece (%lld, %lld, %lld) outside the pool's %lld bytes",
                             sh->start[k], sh->step[k], nbytes, sh->flat_len);
                goto done;
            }
            sh->spans[k].len = (size_t)nbytes;
            end += nbytes;
        }
        if (end > sh->total) {
            PyErr_Format(PyExc_ValueError, "read_pages: part %zd ends at %lld, past the file's %lld bytes", p, end,
                         sh->total);
            goto done;
        }
    }
    rc = 0;
done:
    for (Py_ssize_t p = 0; pieces && p < n; p++)
        Py_XDECREF(pieces[p]);
    PyMem_Free(pieces);
    Py_DECREF(seq);
    return rc;
}

PyDoc_STRVAR(read_pages_doc,
"read_pages(pool, header_len, total, nsums, parts, files, chunk, cold_check) -> bytes\n\n"
"Page files of one layout read straight into ``pool`` (a writable contiguous buffer),\n"
"with the GIL released. ``parts``: the parts to read, in file order, each\n"
"``(checksum index, file offset, pieces)``, a piece ``(start, step, bytes)`` going to\n"
"``pool[start + page * step:][:bytes]``. ``files``: ``(path, header prefix, page)``\n"
"each. A file counts only if it is a regular file of ``total`` bytes whose first\n"
"``header_len`` bytes are the prefix, ``nsums`` checksums and zeros, and whose parts\n"
"match their checksums. With ``cold_check``, a file mostly out of the page cache is\n"
"not read. One status byte per file: 0 read and checked, 1 missing, 2 cold, 3 anything\n"
"else (for the caller's own path to judge).");

static PyObject *read_pages(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer pool;
    shape_t sh = {0};
    Py_ssize_t chunk;
    int cold_check;
    PyObject *parts_obj, *files_obj, *out = NULL, *files = NULL, **paths = NULL;
    const char **prefixes = NULL;
    Py_ssize_t *prefix_lens = NULL, nfiles = 0, f;
    long long *pages = NULL;
    unsigned char *head = NULL, *zeros = NULL, *sink = NULL;
    struct iovec *iov = NULL;
    unsigned long long *sums = NULL;
    if (!PyArg_ParseTuple(args, "w*LLnOOnp:read_pages", &pool, &sh.header_len, &sh.total, &sh.nsums, &parts_obj,
                          &files_obj, &chunk, &cold_check))
        return NULL;
    sh.flat = pool.buf, sh.flat_len = pool.len, sh.chunk = (size_t)chunk, sh.cold_check = cold_check;
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
    if (!(files = PySequence_Fast(files_obj, "read_pages: files must be a sequence")))
        goto done;
    nfiles = PySequence_Fast_GET_SIZE(files);
    paths = PyMem_Calloc(nfiles ? nfiles : 1, sizeof(PyObject *));
    prefixes = PyMem_Calloc(nfiles ? nfiles : 1, sizeof(char *));
    prefix_lens = PyMem_Calloc(nfiles ? nfiles : 1, sizeof(Py_ssize_t));
    pages = PyMem_Calloc(nfiles ? nfiles : 1, sizeof(long long));
    sums = PyMem_Calloc(sh.nparts ? sh.nparts : 1, sizeof(unsigned long long));
    zeros = PyMem_Calloc((size_t)sh.header_len, 1);
    iov = PyMem_Calloc((size_t)(sh.npieces + sh.nparts + 1), sizeof(struct iovec));
    if (posix_memalign((void **)&head, ALIGN, (size_t)sh.header_len))
        head = NULL;
    if (posix_memalign((void **)&sink, ALIGN, ALIGN))
        sink = NULL;
    if (!paths || !prefixes || !prefix_lens || !pages || !sums || !zeros || !iov || !head || !sink) {
        PyErr_NoMemory();
        goto done;
    }
    for (f = 0; f < nfiles; f++) { /* every file checked before any byte moves */
        PyObject *path, *prefix;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(files, f), "OSL:read_pages file", &path, &prefix, &pages[f]))
            goto done;
        if (!PyUnicode_FSConverter(path, &paths[f]))
            goto done;
        prefixes[f] = PyBytes_AS_STRING(prefix);
        prefix_lens[f] = PyBytes_GET_SIZE(prefix);
        if (prefix_lens[f] + 8 * sh.nsums > sh.header_len) {
            PyErr_Format(PyExc_ValueError, "read_pages: file %zd: a prefix of %zd bytes and %zd checksums exceed the "
                         "header's %lld bytes", f, prefix_lens[f], sh.nsums, sh.header_len);
            goto done;
        }
        for (Py_ssize_t k = 0; k < sh.npieces; k++)
            if (pages[f] < 0 || (sh.step[k] && pages[f] > (sh.flat_len - sh.start[k]) / sh.step[k]) ||
                sh.start[k] + pages[f] * sh.step[k] + (long long)sh.spans[k].len > sh.flat_len) {
                PyErr_Format(PyExc_ValueError, "read_pages: page %lld puts piece %zd outside the pool's %lld bytes",
                             pages[f], k, sh.flat_len);
                goto done;
            }
    }
    if (!(out = PyBytes_FromStringAndSize(NULL, nfiles)))
        goto done;
    unsigned char *status = (unsigned char *)PyBytes_AS_STRING(out);
    void *state = xxh_create();
    if (!state) {
        Py_CLEAR(out);
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    for (f = 0; f < nfiles; f++)
        status[f] = (unsigned char)read_one(&sh, PyBytes_AS_STRING(paths[f]), prefixes[f], prefix_lens[f], pages[f],
                                            head, zeros, sink, iov, state, sums);
    xxh_free(state);
    Py_END_ALLOW_THREADS
done:
    for (f = 0; paths && f < nfiles; f++)
        Py_XDECREF(paths[f]);
    PyMem_Free(paths);
    PyMem_Free(prefixes);
    PyMem_Free(prefix_lens);
    PyMem_Free(pages);
    PyMem_Free(sums);
    PyMem_Free(zeros);
    PyMem_Free(iov);
    free(head);
    free(sink);
    PyMem_Free(sh.sum_index);
    PyMem_Free(sh.parts);
    PyMem_Free(sh.start);
    PyMem_Free(sh.step);
    PyMem_Free(sh.spans);
    Py_XDECREF(files);
    PyBuffer_Release(&pool);
    return out;
}

static PyMethodDef methods[] = {
    {"cached_pages", cached_pages, METH_VARARGS, cached_pages_doc},
    {"preallocate", preallocate, METH_VARARGS, preallocate_doc},
    {"bind", bind, METH_VARARGS, bind_doc},
    {"move", move, METH_VARARGS, move_doc},
    {"read_pages", read_pages, METH_VARARGS, read_pages_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pageio", NULL, -1, methods};

PyMODINIT_FUNC PyInit__pageio(void) { return PyModule_Create(&module); }
