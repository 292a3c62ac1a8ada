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
#include "_pageio.h"
#include "../_sequences.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdint.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/syscall.h>
#ifndef __NR_cachestat
#define __NR_cachestat 451 /* Linux 6.5: the same number on every architecture */
#endif
#endif

create_fn xxh_create;
free_fn xxh_free;
reset_fn xxh_reset;
update_fn xxh_update;
digest_fn xxh_digest;

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

/* Every byte of buf at offset, read (write == 0) or written; 0, or -1 with errno set
 * (EIO: a read met the end of the file). */
int move_all(int fd, char *buf, size_t len, long long offset, int write) {
    struct iovec one = {buf, len};
    return len ? iov_all(fd, &one, 1, offset, write) : 0;
}

#ifndef IOV_MAX
#define IOV_MAX 1024 /* Linux's */
#endif

int iov_all(int fd, struct iovec *iov, int n, long long offset, int write) {
    while (n > 0) {
        int count = n < IOV_MAX ? n : IOV_MAX;
        ssize_t done = write ? pwritev(fd, iov, count, (off_t)offset) : preadv(fd, iov, count, (off_t)offset);
        if (done < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        if (done == 0) {
            errno = EIO;
            return -1;
        }
        offset += done;
        while (n > 0 && (size_t)done >= iov->iov_len) {
            done -= (ssize_t)iov->iov_len;
            iov++, n--;
        }
        if (n > 0) {
            iov->iov_base = (char *)iov->iov_base + done;
            iov->iov_len -= (size_t)done;
        }
    }
    return 0;
}

void hash_parts(const shape_t *sh, const span_t *spans, void *state, unsigned long long *sums) {
    for (Py_ssize_t p = 0; p < sh->nparts; p++) {
        xxh_reset(state);
        for (Py_ssize_t k = sh->parts[p].first; k < sh->parts[p].first + sh->parts[p].count; k++)
            xxh_update(state, spans[k].at, spans[k].len);
        sums[p] = xxh_digest(state);
    }
}

/* The parts moved and hashed; 0, or -1 with errno set. */
int move_parts(int fd, const part_t *parts, Py_ssize_t nparts, const span_t *spans, size_t chunk, int write,
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
    PyObject *seq = held_items(parts_obj, "move: parts must be a sequence");
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
        if (!(lists[p] = held_items(list, "move: a part's buffers must be a sequence")))
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

int reserve(int fd, long long length) {
#ifdef __linux__
    if (fallocate(fd, 0, 0, (off_t)length) == 0)
        return 1;
    if (errno != EOPNOTSUPP && errno != ENOSYS && errno != EINVAL)
        return -1;
#else
    (void)fd, (void)length;
#endif
    return 0;
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
    int rc, err = 0;
    Py_BEGIN_ALLOW_THREADS
    rc = reserve(fd, length);
    if (rc < 0)
        err = errno;
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyBool_FromLong(rc);
}

static PyMethodDef methods[] = {
    {"cached_pages", cached_pages, METH_VARARGS, cached_pages_doc},
    {"preallocate", preallocate, METH_VARARGS, preallocate_doc},
    {"bind", bind, METH_VARARGS, bind_doc},
    {"move", move, METH_VARARGS, move_doc},
    {"read_pages", read_pages, METH_VARARGS, read_pages_doc},
    {"write_pages", write_pages, METH_VARARGS, write_pages_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pageio", NULL, -1, methods};

PyMODINIT_FUNC PyInit__pageio(void) { return PyModule_Create(&module); }
