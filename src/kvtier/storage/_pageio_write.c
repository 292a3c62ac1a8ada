/* kvtier.storage._pageio's write_pages: a batch of page files written from one pool,
 * in one call with the GIL released.
 *
 * Per file, as FileStorage._write does it: a new temporary file (O_EXCL, no symlink;
 * its directory made where it is missing), the store's mode set exactly, the file
 * reserved whole (fallocate: one extent, so a cold read is one disk request), the
 * staged pieces gathered from the pool into staging, the file's bytes written in as
 * few calls as its chunks allow (write_body), fsync where asked, and the rename to the
 * object's name. A file that fails anywhere is removed and gets its errno as its
 * status: the caller's own path writes it again and judges the fault. With direct,
 * an aligned file is written with O_DIRECT in one request left in flight while the
 * next file is made (write_direct).
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
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>
#ifdef __linux__
#include <linux/aio_abi.h>
#include <sys/syscall.h>
#endif

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
    int direct; /* write with O_DIRECT where a file's stretches are aligned for it */
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

/* Whether a file whose parts are in spans can be written with O_DIRECT as one request
 * of its header and stretches back to back: the header and every stretch (address and
 * length) multiples of ALIGN, each part starting where the one before ends (the first
 * where the header ends), the last ending the file. A layout with zeros between parts
 * (write_body writes them) is not. */
static int direct_ok(const writer_t *w) {
    const shape_t *sh = w->sh;
    if (sh->header_len % ALIGN)
        return 0;
    long long at = sh->header_len;
    for (Py_ssize_t p = 0; p < sh->nparts; p++) {
        if (sh->parts[p].offset != at)
            return 0;
        for (Py_ssize_t b = sh->parts[p].first; b < sh->parts[p].first + sh->parts[p].count; b++) {
            if ((uintptr_t)w->spans[b].at % ALIGN || w->spans[b].len % ALIGN)
                return 0;
            at += (long long)w->spans[b].len;
        }
    }
    return at == sh->total;
}

/* O_DIRECT set on fd: 1, or 0 where the file system refuses it (the file is then
 * written buffered). */
static int set_direct(int fd) {
#ifdef O_DIRECT
    int flags = fcntl(fd, F_GETFL);
    return flags >= 0 && fcntl(fd, F_SETFL, flags | O_DIRECT) == 0;
#else
    (void)fd;
    return 0;
#endif
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

/* tmp made new (its directory where missing) at the writer's mode and reserved whole:
 * its descriptor, or -1 with errno set (nothing left behind). */
static int create_file(const writer_t *w, const char *tmp) {
    const int flags = O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC;
    int fd = open(tmp, flags, w->mode);
    if (fd < 0 && errno == ENOENT) { /* the directory's first object */
        int err = make_dir(tmp, w->dir_mode);
        if (err) {
            errno = err;
            return -1;
        }
        fd = open(tmp, flags, w->mode);
    }
    if (fd < 0)
        return -1;
    struct stat st;
    if (fstat(fd, &st) != 0 || ((st.st_mode & 07777) != w->mode && fchmod(fd, w->mode) != 0) ||
        reserve(fd, w->sh->total) < 0) {
        int err = errno;
        close(fd);
        unlink(tmp);
        errno = err;
        return -1;
    }
    return fd;
}

/* The written file fd (fsync'd where asked) closed and tmp renamed to path, or with
 * err (a failure so far) removed: 0, or the errno of what failed. */
static int finish_file(const writer_t *w, int fd, const char *tmp, const char *path, int err) {
    if (!err && w->fsync && fsync(fd) != 0)
        err = errno ? errno : EIO;
    if (close(fd) != 0 && !err)
        err = errno ? errno : EIO;
    if (!err && rename(tmp, path) != 0)
        err = errno ? errno : EIO;
    if (err)
        unlink(tmp);
    return err;
}

/* A file's status byte for errno err (0: written; 255 for one above 254). */
static unsigned char status_of(int err) {
    return (unsigned char)(err > 254 ? 255 : err);
}

/* The staged file fd written (write_body) and finished (finish_file): 0, or the errno
 * of what failed (nothing left behind). */
static int write_rest(writer_t *w, int fd, const char *tmp, const char *path, const char *prefix,
                      Py_ssize_t prefix_len) {
    int err = write_body(w, fd, prefix, prefix_len) < 0 ? (errno ? errno : EIO) : 0;
    return finish_file(w, fd, tmp, path, err);
}

#ifdef __linux__
/* Each thread's Linux AIO context, kept for the thread's life and ended with it: an
 * io_destroy waits for an RCU grace period (about 30 ms on this VM, as long as a whole
 * call of 8 MiMo-like pages). Kept with the process it was made in: a forked child's
 * thread keeps the key's value, but the context is its parent's, which the child's
 * kernel refuses (io_submit: EINVAL), so the child makes its own. */
typedef struct {
    aio_context_t ctx;
    pid_t pid;
} aio_kept_t;

static pthread_key_t aio_key;
static pthread_once_t aio_once = PTHREAD_ONCE_INIT;
static int aio_key_made;

static void aio_end(void *kept) {
    aio_kept_t *k = kept;
    if (k->pid == getpid())
        syscall(__NR_io_destroy, k->ctx);
    free(k);
}

static void aio_make_key(void) {
    aio_key_made = pthread_key_create(&aio_key, aio_end) == 0;
}

/* This thread's context, or 0 where none can be had. */
static aio_context_t thread_aio(void) {
    pthread_once(&aio_once, aio_make_key);
    if (!aio_key_made)
        return 0;
    pid_t pid = getpid();
    aio_kept_t *kept = pthread_getspecific(aio_key);
    if (kept && kept->pid == pid)
        return kept->ctx;
    if (kept) { /* the parent's, from before a fork: not this process's to end */
        pthread_setspecific(aio_key, NULL);
        free(kept);
    }
    aio_context_t ctx = 0;
    if (syscall(__NR_io_setup, 1, &ctx) != 0)
        return 0;
    if (!(kept = malloc(sizeof *kept))) {
        syscall(__NR_io_destroy, ctx);
        return 0;
    }
    kept->ctx = ctx, kept->pid = pid;
    if (pthread_setspecific(aio_key, kept) != 0) {
        free(kept);
        syscall(__NR_io_destroy, ctx);
        return 0;
    }
    return ctx;
}

/* This thread's context ended (every request of it done first) after a fault; the
 * next call makes another. */
static void thread_aio_end(aio_context_t ctx) {
    free(pthread_getspecific(aio_key));
    pthread_setspecific(aio_key, NULL);
    syscall(__NR_io_destroy, ctx);
}
#endif

/* Direct writes, each file's whole write (header and parts, one O_DIRECT request) in
 * flight while the next file is made, staged, hashed and its header built: a Linux AIO
 * context, and per slot the file, its stretches and its header.
 * NOTE: hashed before its write (a direct write's bytes never pass through the CPU's
 * cache), each file held the disk idle while its parts were hashed and its file made:
 * 1.4 MiB MiMo-like page_head pages, two I/O threads, alternated in one process with
 * vLLM's O_DIRECT fs tier, 1.74 against 2.11 GB/s (8 MiB pages 2.26 against 2.44; with
 * no hash at all 2.55 against 2.56). A thread beside each writer for the parts' call,
 * the header written after the hash, did no better for small pages: on two cores it
 * waited for one to start the call. */
typedef struct {
#ifdef __linux__
    aio_context_t ctx;
    struct iocb cb;
#endif
    int aio;                 /* the context is set up */
    int busy, fd, slot;      /* a write in flight: its descriptor and slot */
    Py_ssize_t file;         /* its file */
    size_t bytes;            /* its length */
    unsigned char *head[2];  /* per slot, aligned */
    struct iovec *iov[2];    /* per slot: the header, then every piece */
    char *staging[2];        /* per slot: where its staged parts go */
    int one_stage;           /* both slots stage in one place (room for one file's staged parts) */
} pipe_t;

/* The write in flight done: its file finished (status set). */
static void pipe_drain(const writer_t *w, pipe_t *q, const files_t *fs, unsigned char *status) {
    if (!q->busy)
        return;
    q->busy = 0;
    int err = 0;
#ifdef __linux__
    struct io_event ev;
    long got;
    do /* NOTE: only this call's one request is ever in flight in the thread's context */
        got = syscall(__NR_io_getevents, q->ctx, 1, 1, &ev, NULL);
    while (got < 0 && errno == EINTR);
    if (got != 1) { /* the context is of no more use: ended once its request is done */
        err = got < 0 ? errno : EIO;
        thread_aio_end(q->ctx);
        q->aio = 0;
    } else if (ev.res < 0)
        err = (int)-ev.res;
    else if ((size_t)ev.res != q->bytes)
        err = EIO; /* short: the caller's own path writes it again */
#endif
    Py_ssize_t f = q->file;
    int done = finish_file(w, q->fd, PyBytes_AS_STRING(fs->tmps[f]), PyBytes_AS_STRING(fs->paths[f]), err);
    status[f] = status_of(done);
}

/* The write of file f (fd, its n stretches in slot s) started, or where AIO cannot be
 * had, made: 0, or -1 with errno set (nothing in flight). */
static int pipe_start(pipe_t *q, int fd, int s, int n, size_t bytes, Py_ssize_t f) {
#ifdef __linux__
    if (q->aio) {
        memset(&q->cb, 0, sizeof q->cb);
        q->cb.aio_fildes = (unsigned)fd;
        q->cb.aio_lio_opcode = IOCB_CMD_PWRITEV;
        q->cb.aio_buf = (unsigned long long)(uintptr_t)q->iov[s];
        q->cb.aio_nbytes = (unsigned long long)n;
        q->cb.aio_offset = 0;
        struct iocb *cbs[1] = {&q->cb};
        long sent;
        do
            sent = syscall(__NR_io_submit, q->ctx, 1, cbs);
        while (sent < 0 && errno == EINTR);
        if (sent == 1) {
            q->busy = 1, q->fd = fd, q->slot = s, q->file = f, q->bytes = bytes;
            return 0;
        }
    }
#else
    (void)f;
#endif
    (void)bytes;
    return iov_all(fd, q->iov[s], n, 0, 1);
}

/* File f written with O_DIRECT where its stretches allow it (the last one's write in
 * flight meanwhile), else as write_file does; its status set now or once its write is
 * done (pipe_drain). */
static void write_direct(writer_t *w, pipe_t *q, const files_t *fs, Py_ssize_t f, unsigned char *status) {
    const shape_t *sh = w->sh;
    const char *tmp = PyBytes_AS_STRING(fs->tmps[f]), *path = PyBytes_AS_STRING(fs->paths[f]);
    int s = q->busy ? 1 - q->slot : 0;
    if (q->one_stage)
        pipe_drain(w, q, fs, status); /* room for one file's staged parts: the last one's go first */
    int fd = create_file(w, tmp);
    if (fd < 0) {
        status[f] = status_of(errno);
        return;
    }
    stage(sh, q->staging[s], fs->pages[f]);
    page_spans(sh, q->staging[s], fs->pages[f], w->spans, 0);
    w->head = q->head[s];
    if (!direct_ok(w) || !set_direct(fd)) {
        status[f] = status_of(write_rest(w, fd, tmp, path, fs->prefixes[f], fs->prefix_lens[f]));
        return;
    }
    hash_parts(sh, w->spans, w->state, w->sums);
    build_header(w, fs->prefixes[f], fs->prefix_lens[f]);
    struct iovec *iov = q->iov[s];
    int n = 0;
    iov[n++] = (struct iovec){w->head, (size_t)sh->header_len};
    for (Py_ssize_t p = 0; p < sh->nparts; p++)
        for (Py_ssize_t b = sh->parts[p].first; b < sh->parts[p].first + sh->parts[p].count; b++)
            iov[n++] = (struct iovec){w->spans[b].at, w->spans[b].len};
    pipe_drain(w, q, fs, status);
    int rc = pipe_start(q, fd, s, n, (size_t)sh->total, f);
    if (q->busy)
        return; /* in flight: pipe_drain finishes it */
    status[f] = status_of(finish_file(w, fd, tmp, path, rc < 0 ? (errno ? errno : EIO) : 0));
}

/* One page's file written to tmp and renamed to path; 0, or the errno of what failed
 * (nothing left behind). */
static int write_file(writer_t *w, const char *tmp, const char *path, const char *prefix, Py_ssize_t prefix_len,
                      long long page) {
    const shape_t *sh = w->sh;
    int fd = create_file(w, tmp);
    if (fd < 0)
        return errno ? errno : EIO;
    stage(sh, sh->staging, page);
    page_spans(sh, sh->staging, page, w->spans, 0);
    return write_rest(w, fd, tmp, path, prefix, prefix_len);
}

const char write_pages_doc[] =
    "write_pages(pool, header_len, total, parts, files, chunk, fsync, mode, dir_mode[, staging[, direct]])\n"
    "-> bytes\n\n"
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
    "first, fsync'd with ``fsync``, and renamed to its path. With ``direct``, a file whose\n"
    "header and parts (addresses, lengths and offsets) are multiples of 4096 bytes is\n"
    "written with O_DIRECT in one request from offset 0, header first, left in flight\n"
    "while the next file is made (staged parts in a second stretch of ``staging`` where\n"
    "it holds two files' worth); others, or all where the file system refuses O_DIRECT,\n"
    "as without it. One status byte per\n"
    "file: 0 written, else the errno of what failed (255 for one above 254); a file that\n"
    "fails leaves nothing behind.";

PyObject *write_pages(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer pool, staging = {0};
    shape_t sh = {.what = "write_pages"};
    writer_t w = {.sh = &sh};
    pipe_t q = {0};
    unsigned char *head2 = NULL;
    Py_ssize_t chunk;
    int fsync_each, mode, dir_mode, direct = 0;
    PyObject *parts_obj, *files_obj, *staging_obj = Py_None, *out = NULL;
    files_t fs = {0};
    if (!PyArg_ParseTuple(args, "y*LLOOnpii|Op:write_pages", &pool, &sh.header_len, &sh.total, &parts_obj,
                          &files_obj, &chunk, &fsync_each, &mode, &dir_mode, &staging_obj, &direct))
        return NULL;
    if (staging_obj != Py_None && PyObject_GetBuffer(staging_obj, &staging, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&pool);
        return NULL;
    }
    sh.flat = pool.buf, sh.flat_len = pool.len, sh.chunk = (size_t)chunk;
    sh.staging = staging.buf, sh.staging_len = staging.buf ? staging.len : 0;
    w.mode = (mode_t)mode, w.dir_mode = (mode_t)dir_mode, w.fsync = fsync_each, w.direct = direct;
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
    /* aligned, and written from: a direct write's first stretch */
    if (posix_memalign((void **)&w.head, ALIGN, (size_t)sh.header_len))
        w.head = NULL;
    else
        memset(w.head, 0, (size_t)sh.header_len);
    /* a call's stretches (more make more calls): the header, each part's zeros and pieces */
    w.niov = 1 + sh.nparts + sh.npieces > 64 ? 64 : (int)(1 + sh.nparts + sh.npieces);
    w.iov = PyMem_Calloc((size_t)w.niov, sizeof(struct iovec));
    w.done = PyMem_Calloc((size_t)w.niov + (size_t)sh.nparts, sizeof(span_t));
    w.ends = PyMem_Calloc((size_t)w.niov + (size_t)sh.nparts, sizeof(Py_ssize_t));
    if (direct) { /* a second slot's header, and each slot's stretches */
        if (posix_memalign((void **)&head2, ALIGN, (size_t)sh.header_len))
            head2 = NULL;
        q.iov[0] = PyMem_Calloc((size_t)sh.npieces + 1, sizeof(struct iovec));
        q.iov[1] = PyMem_Calloc((size_t)sh.npieces + 1, sizeof(struct iovec));
    }
    if (!w.spans || !w.sums || !w.head || !w.iov || !w.done || !w.ends ||
        (direct && (!head2 || !q.iov[0] || !q.iov[1]))) {
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
    if (direct) {
        memset(head2, 0, (size_t)sh.header_len);
        q.head[0] = w.head, q.head[1] = head2;
        /* each slot its own staging where there is room for two files' staged parts */
        long long second = (sh.staged + ALIGN - 1) / ALIGN * ALIGN;
        q.one_stage = sh.staged && sh.staging_len < second + sh.staged;
        q.staging[0] = sh.staging, q.staging[1] = q.one_stage ? sh.staging : sh.staging + second;
#ifdef __linux__
        q.ctx = thread_aio();
        q.aio = q.ctx != 0;
#endif
        for (Py_ssize_t f = 0; f < fs.n; f++)
            write_direct(&w, &q, &fs, f, status);
        pipe_drain(&w, &q, &fs, status);
        w.head = q.head[0];
    } else {
        for (Py_ssize_t f = 0; f < fs.n; f++) {
            status[f] = status_of(write_file(&w, PyBytes_AS_STRING(fs.tmps[f]), PyBytes_AS_STRING(fs.paths[f]),
                                             fs.prefixes[f], fs.prefix_lens[f], fs.pages[f]));
        }
    }
    Py_END_ALLOW_THREADS
done:
    if (w.state)
        xxh_free(w.state);
    free_files(&fs);
    PyMem_Free(w.spans);
    PyMem_Free(w.sums);
    free(w.head);
    PyMem_Free(w.iov);
    PyMem_Free(w.done);
    PyMem_Free(w.ends);
    free(head2);
    PyMem_Free(q.iov[0]);
    PyMem_Free(q.iov[1]);
    free_shape(&sh);
    PyBuffer_Release(&pool);
    if (staging.buf)
        PyBuffer_Release(&staging);
    return out;
}
