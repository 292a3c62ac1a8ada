/* kvtier.storage._pageio's write_pages: a batch of page files written from one pool,
 * in one call with the GIL released.
 *
 * Per file, as FileStorage._write does it: a new temporary file (O_EXCL, no symlink;
 * its directory made where it is missing), the store's mode set exactly, the file
 * reserved whole (fallocate: one extent, so a cold read is one disk request), the
 * staged pieces gathered from the pool into staging, the file's bytes written in as
 * few calls as its chunks allow (write_body), fsync where asked, and the rename to the
 * object's name. A file that fails anywhere is removed and gets its errno as its
 * status: the caller's own path writes it again and judges the fault.
 *
 * NOTE: the Python loop spent about as long on a page_first page's gather (numpy's
 * copyto of its strided pieces, 0.23 ms a 1.4 MiB page) and its file calls as the
 * kernel did writing it, holding the GIL for all of it between two I/O threads.
 *
 * NOTE: one pwritev per chunk of the file, not one pwrite per piece of a part: each
 * write call is a round of the file system's own (the inode's lock and times, page
 * cache folios sized by that call's offset and length), and a page's 8 parts, a header
 * and its zeros made 9 or more calls. Alternated in one process (512
 * new 1.4 MiB files a round, two I/O threads, ext4, medians of 9 rounds): 5.8 -> 7.2
 * GB/s for page_first pages, 5.8 -> 7.7 for page_head; 8 MiB pages 7.0 -> 8.0 and
 * 9.3 -> 12.4. One call for a whole 8 MiB file was as fast at best but fell to about
 * 1 GB/s in some rounds, as one write of a whole file does for the peers (vLLM's fs
 * tier, raw files); calls that end at multiples of the chunk did not. */
#include "_pageio.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

/* What every file of the call uses. */
typedef struct {
    const shape_t *sh;
    void *state;
    span_t *spans;
    unsigned long long *sums;
    unsigned char *head;
    struct iovec *iov; /* room for niov stretches: one write call's */
    /* the call's part bytes in file order, hashed once it is written (hash_written), and
     * per entry the part it ends (an empty entry at each part's end), else -1: room for
     * niov stretches and every part's end */
    span_t *done;
    Py_ssize_t *ends;
    int niov;
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

static char zeros[ALIGN];

/* The part bytes of the call just written hashed in file order (the kernel's copy left
 * them in the CPU's cache), each part's digest taken at its end marker. */
static void hash_written(writer_t *w, int nd) {
    for (int i = 0; i < nd; i++) {
        if (w->done[i].len)
            xxh_update(w->state, w->done[i].at, w->done[i].len);
        if (w->ends[i] >= 0) {
            w->sums[w->ends[i]] = xxh_digest(w->state);
            xxh_reset(w->state);
        }
    }
}

/* The file's header, parts and the zeros between them written in pwritev calls that
 * end at multiples of the chunk in the file (the page cache then holds it in large
 * folios, which read back far faster), each call's bytes hashed just after it, while
 * the kernel's copy has left them in the CPU's cache; the header last, once every
 * checksum is known. A file no longer than a chunk is one call from offset 0, header
 * first, its parts hashed before. 0, or -1 with errno set.
 *
 * NOTE: hashed after the call, not before: the hash then reads each call's bytes from
 * the core's L2 instead of from memory, and the kernel's copy reads memory, as the
 * peers' writes do (before, the hash was the first to read them, at about 20 GB/s a
 * thread against 50-60 from L2). With calls of half the L2 (now a quarter: pageio.write_chunk), on a
 * Xeon with 2 MiB of L2 a core, the build before and this one alternated, `kvtier bench
 * storage --backends file --repeat 5` (32 pages of 8 MiB), two pairs per layout: puts
 * 0.80-0.89x of vLLM's buffered fs tier -> 0.98-1.10x (page_first), 0.72-0.90x ->
 * 0.96-1.01x (page_head); gets level. */
static int write_body(writer_t *w, int fd, const char *prefix, Py_ssize_t prefix_len) {
    const shape_t *sh = w->sh;
    struct iovec *iov = w->iov;
    size_t chunk = sh->chunk;
    int whole = !chunk || (unsigned long long)sh->total <= chunk;
    int n = 0, nd = 0; /* stretches of the call; of them, part bytes and part ends to hash after it */
    long long at = sh->header_len, call = sh->header_len; /* the next byte; the current call's first */
    if (whole) {
        hash_parts(sh, w->spans, w->state, w->sums);
        build_header(w, prefix, prefix_len);
        iov[n++] = (struct iovec){w->head, (size_t)sh->header_len};
        call = 0;
    } else {
        xxh_reset(w->state);
    }
    for (Py_ssize_t p = 0; p < sh->nparts; p++) {
        /* b == first - 1: the zeros before the part (parse_parts: no part starts before the last ends) */
        for (Py_ssize_t b = sh->parts[p].first - 1; b < sh->parts[p].first + sh->parts[p].count; b++) {
            int gap = b < sh->parts[p].first;
            char *from = gap ? zeros : w->spans[b].at;
            size_t left = gap ? (size_t)(sh->parts[p].offset - at) : w->spans[b].len;
            while (left) {
                size_t take = left;
                if (gap && take > sizeof zeros)
                    take = sizeof zeros;
                if (!whole) {
                    size_t room = chunk - (size_t)((unsigned long long)at % chunk);
                    if (room < take)
                        take = room;
                    if (!gap) {
                        w->done[nd] = (span_t){from, take};
                        w->ends[nd++] = -1;
                    }
                }
                iov[n++] = (struct iovec){from, take};
                at += (long long)take;
                left -= take;
                if (!gap)
                    from += take;
                if (n == w->niov || (!whole && (unsigned long long)at % chunk == 0)) {
                    if (iov_all(fd, iov, n, call, 1) < 0)
                        return -1;
                    hash_written(w, nd);
                    n = 0, nd = 0, call = at;
                }
            }
        }
        if (!whole) { /* the part ends here: its digest once its last bytes are hashed */
            w->done[nd] = (span_t){NULL, 0};
            w->ends[nd++] = p;
        }
    }
    if (n && iov_all(fd, iov, n, call, 1) < 0)
        return -1;
    if (whole)
        return 0;
    hash_written(w, nd);
    build_header(w, prefix, prefix_len);
    return move_all(fd, (char *)w->head, (size_t)sh->header_len, 0, 1);
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
    page_spans(sh, sh->staging, page, w->spans, 0);
    if (write_body(w, fd, prefix, prefix_len) < 0)
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
    "missing), reserved whole, its parts and the zeros between them written in one call\n"
    "per ``chunk`` of the file (each call's bytes hashed with xxh3-64 just after it, then\n"
    "the header: the prefix, the checksums, zeros up to ``header_len``), or, for a file\n"
    "no longer than ``chunk`` (or ``chunk`` 0), in one call from offset 0 with its header\n"
    "first, fsync'd with ``fsync``, and renamed to its path. One status byte per\n"
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
    /* a call's stretches (more make more calls): the header, each part's zeros and pieces */
    w.niov = 1 + sh.nparts + sh.npieces > 64 ? 64 : (int)(1 + sh.nparts + sh.npieces);
    w.iov = PyMem_Calloc((size_t)w.niov, sizeof(struct iovec));
    w.done = PyMem_Calloc((size_t)w.niov + (size_t)sh.nparts, sizeof(span_t));
    w.ends = PyMem_Calloc((size_t)w.niov + (size_t)sh.nparts, sizeof(Py_ssize_t));
    if (!w.spans || !w.sums || !w.head || !w.iov || !w.done || !w.ends) {
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
    PyMem_Free(w.iov);
    PyMem_Free(w.done);
    PyMem_Free(w.ends);
    free_shape(&sh);
    PyBuffer_Release(&pool);
    if (staging.buf)
        PyBuffer_Release(&staging);
    return out;
}
