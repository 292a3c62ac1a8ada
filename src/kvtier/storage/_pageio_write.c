/* kvtier.storage._pageio's write_pages: a batch of page files written from one pool,
 * in one call with the GIL released.
 *
 * Per file, as FileStorage._write does it: a new temporary file (O_EXCL, no symlink;
 * its directory made where it is missing), the store's mode set exactly, the file
 * reserved whole (fallocate: one extent, so a cold read is one disk request), the
 * staged pieces gathered from the pool into staging, each part written a chunk at a
 * time and hashed just before (the write's copy then reads the chunk from the CPU's
 * cache), then the header with the checksums, fsync where asked, and the rename to the
 * object's name. A file that fails anywhere is removed and gets its errno as its
 * status: the caller's own path writes it again and judges the fault.
 *
 * NOTE: the Python loop spent about as long on a page_first page's gather (numpy's
 * copyto of its strided pieces, 0.23 ms a 1.4 MiB page) and its file calls as the
 * kernel did writing it, holding the GIL for all of it between two I/O threads.
 */
#include "_pageio.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* What every file of the call uses. */
typedef struct {
    const shape_t *sh;
    void *state;
    span_t *spans;
    unsigned long long *sums;
    unsigned char *head;
    mode_t mode, dir_mode;
    int fsync;
} writer_t;

/* The directory of path (up to its last '/') there as a directory: made with dir_mode
 * where missing (exactly that mode, whatever the umask), else one that is not a
 * symlink; 0, or an errno. */
static int make_dir(const char *path, mode_t dir_mode) {
    const char *slash = strrchr(path, '/');
    char dir[PATH_MAX];
    size_t n = slash ? (size_t)(slash - path) : 0;
    struct stat st;
    if (!n)
        return ENOENT;
    if (n >= sizeof dir)
        return ENAMETOOLONG;
    memcpy(dir, path, n);
    dir[n] = 0;
    if (mkdir(dir, dir_mode) == 0) {
        if (lstat(dir, &st) != 0 || ((st.st_mode & 07777) != dir_mode && chmod(dir, dir_mode) != 0))
            return errno;
        return 0;
    }
    if (errno != EEXIST)
        return errno;
    if (lstat(dir, &st) != 0)
        return errno;
    return S_ISDIR(st.st_mode) ? 0 : EEXIST;
}

/* The header of the file: the prefix, each part's checksum (little-endian, in part
 * order) and zeros. */
static void build_header(const writer_t *w, const char *prefix, Py_ssize_t prefix_len) {
    const shape_t *sh = w->sh;
    unsigned char *at = w->head + prefix_len;
    memcpy(w->head, prefix, (size_t)prefix_len);
    for (Py_ssize_t p = 0; p < sh->nparts; p++)
        for (int b = 0; b < 8; b++)
            *at++ = (unsigned char)(w->sums[p] >> (8 * b));
    memset(at, 0, (size_t)sh->header_len - (size_t)(at - w->head));
}

/* One page's file written to tmp and renamed to path; 0, or the errno of what failed
 * (nothing left behind). */
static int write_file(writer_t *w, const char *tmp, const char *path, const char *prefix, Py_ssize_t prefix_len,
                      long long page) {
    const shape_t *sh = w->sh;
    const int flags = O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC;
    int fd = open(tmp, flags, w->mode);
    if (fd < 0 && errno == ENOENT) { /* the directory's first object */
        int err = make_dir(tmp, w->dir_mode);
        if (err)
            return err;
        fd = open(tmp, flags, w->mode);
    }
    if (fd < 0)
        return errno;
    struct stat st;
    if (fstat(fd, &st) != 0 || ((st.st_mode & 07777) != w->mode && fchmod(fd, w->mode) != 0))
        goto fail;
    if (reserve(fd, sh->total) < 0)
        goto fail;
    stage(sh, sh->staging, page);
    page_spans(sh, sh->staging, page, w->spans);
    if (move_parts(fd, sh->parts, sh->nparts, w->spans, sh->chunk, 1, w->state, w->sums) < 0)
        goto fail;
    build_header(w, prefix, prefix_len);
    if (move_all(fd, (char *)w->head, (size_t)sh->header_len, 0, 1) < 0)
        goto fail;
    if (w->fsync && fsync(fd) != 0)
        goto fail;
    int closed = close(fd);
    fd = -1;
    if (closed != 0 || rename(tmp, path) != 0)
        goto fail;
    return 0;
fail:;
    int err = errno ? errno : EIO;
    if (fd >= 0)
        close(fd);
    unlink(tmp);
    return err;
}

const char write_pages_doc[] =
    "write_pages(pool, header_len, total, parts, files, chunk, fsync, mode, dir_mode[, staging]) -> bytes\n\n"
    "Page files of one layout written from ``pool`` (a contiguous buffer), with the GIL\n"
    "released. ``parts``: every part of the file, in file order, each ``(index, file\n"
    "offset, pieces)`` with its index its checksum's place in the header (0, 1, ...), a\n"
    "piece ``(start, step, bytes)`` taken from ``pool[start + page * step:][:bytes]``, or\n"
    "staged: ``(start, step, bytes, dims, strides)``, gathered from the array of those\n"
    "dims and byte strides there into ``staging`` (each staged part at a multiple of\n"
    "4096 bytes) and written from it; the last part ends the file at ``total`` bytes.\n"
    "``files``: ``(temporary path, path, header prefix, page)`` each. Each file is made\n"
    "new at its temporary path with ``mode`` (its directory with ``dir_mode`` where\n"
    "missing), reserved whole, its parts written ``chunk`` bytes at a time, each hashed\n"
    "with xxh3-64 just before, then its header (the prefix, the checksums, zeros up to\n"
    "``header_len``), fsync'd with ``fsync``, and renamed to its path. One status byte per\n"
    "file: 0 written, else the errno of what failed (255 for one above 254); a file that\n"
    "fails leaves nothing behind.";

PyObject *write_pages(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer pool, staging = {0};
    shape_t sh = {.what = "write_pages"};
    writer_t w = {.sh = &sh};
    Py_ssize_t chunk;
    int fsync_each, mode, dir_mode;
    PyObject *parts_obj, *files_obj, *out = NULL;
    files_t fs = {0};
    if (!PyArg_ParseTuple(args, "y*LLOOnpii|w*:write_pages", &pool, &sh.header_len, &sh.total, &parts_obj, &files_obj,
                          &chunk, &fsync_each, &mode, &dir_mode, &staging))
        return NULL;
    sh.flat = pool.buf, sh.flat_len = pool.len, sh.chunk = (size_t)chunk;
    sh.staging = staging.buf, sh.staging_len = staging.buf ? staging.len : 0;
    w.mode = (mode_t)mode, w.dir_mode = (mode_t)dir_mode, w.fsync = fsync_each;
    if (!xxh_create) {
        PyErr_SetString(PyExc_RuntimeError, "write_pages: bind() the xxh3 calls first");
        goto done;
    }
    if (chunk < 0 || sh.header_len <= 0 || sh.header_len > MAX_HEADER || sh.total < sh.header_len ||
        (mode & ~07777) || (dir_mode & ~07777)) {
        PyErr_Format(PyExc_ValueError, "write_pages: chunk %zd, header %lld of at most %d bytes, file %lld bytes, "
                     "modes %o and %o", chunk, sh.header_len, MAX_HEADER, sh.total, mode, dir_mode);
        goto done;
    }
    Py_ssize_t nparts = PySequence_Size(parts_obj);
    if (nparts < 0)
        goto done;
    sh.nsums = nparts; /* every part written: as many checksums */
    if (parse_parts(parts_obj, &sh) < 0)
        goto done;
    long long end = sh.header_len;
    for (Py_ssize_t p = 0; p < sh.nparts; p++) {
        if (sh.sum_index[p] != p) {
            PyErr_Format(PyExc_ValueError, "write_pages: part %zd has checksum index %zd: every part, in order",
                         p, sh.sum_index[p]);
            goto done;
        }
        end = sh.parts[p].offset;
        for (Py_ssize_t k = sh.parts[p].first; k < sh.parts[p].first + sh.parts[p].count; k++)
            end += (long long)sh.len[k];
    }
    if (end != sh.total) {
        PyErr_Format(PyExc_ValueError, "write_pages: the parts end at %lld, not at the file's %lld bytes", end,
                     sh.total);
        goto done;
    }
    if (parse_files(&sh, files_obj, 1, &fs) < 0)
        goto done;
    w.spans = PyMem_Calloc((size_t)sh.npieces + 1, sizeof(span_t));
    w.sums = PyMem_Calloc((size_t)sh.nparts + 1, sizeof(unsigned long long));
    w.head = PyMem_Calloc((size_t)sh.header_len, 1);
    if (!w.spans || !w.sums || !w.head) {
        PyErr_NoMemory();
        goto done;
    }
    if (!(out = PyBytes_FromStringAndSize(NULL, fs.n)))
        goto done;
    if (!(w.state = xxh_create())) {
        Py_CLEAR(out);
        PyErr_NoMemory();
        goto done;
    }
    unsigned char *status = (unsigned char *)PyBytes_AS_STRING(out);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t f = 0; f < fs.n; f++) {
        int err = write_file(&w, PyBytes_AS_STRING(fs.tmps[f]), PyBytes_AS_STRING(fs.paths[f]), fs.prefixes[f],
                             fs.prefix_lens[f], fs.pages[f]);
        status[f] = (unsigned char)(err > 254 ? 255 : err);
    }
    Py_END_ALLOW_THREADS
done:
    if (w.state)
        xxh_free(w.state);
    free_files(&fs);
    PyMem_Free(w.spans);
    PyMem_Free(w.sums);
    PyMem_Free(w.head);
    free_shape(&sh);
    PyBuffer_Release(&pool);
    if (staging.buf)
        PyBuffer_Release(&staging);
    return out;
}
