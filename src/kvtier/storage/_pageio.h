/* What the parts of kvtier.storage._pageio share: the xxh3 calls bound at import (see
 * bind in _pageio.c), the loop that moves and hashes a file's parts, and the shape of a
 * batch of page files (_pageio_shape.c) that read_pages and write_pages move. */
#ifndef KVTIER_PAGEIO_H
#define KVTIER_PAGEIO_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <sys/uio.h>

typedef void *(*create_fn)(void);
typedef int (*free_fn)(void *);
typedef int (*reset_fn)(void *);
typedef int (*update_fn)(void *, const void *, size_t);
typedef unsigned long long (*digest_fn)(const void *);

extern create_fn xxh_create;
extern free_fn xxh_free;
extern reset_fn xxh_reset;
extern update_fn xxh_update;
extern digest_fn xxh_digest;

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

#define ALIGN 4096 /* of each staged part in staging, and of direct I/O */
#define MAX_HEADER (1 << 20)
#define MAX_DIMS 8 /* of a staged piece */

/* What every file of one read_pages or write_pages call shares: its layout, and where
 * its parts are in the pool. */
typedef struct {
    const char *what; /* the call, for its errors */
    char *flat;
    long long flat_len, header_len, total, page_bytes;
    Py_ssize_t nsums, nparts, npieces;
    Py_ssize_t *sum_index;   /* per wanted part: its checksum's index in the header */
    part_t *parts;           /* per wanted part: its file offset, its pieces */
    long long *start, *step; /* per piece: its bytes in the pool are flat[start + page * step], len of them */
    size_t *len;
    /* per piece: 0 (in place: moved straight between the file and the pool), or the
     * dims of a staged piece, which moves through staging (read: copied out to the pool
     * once the file checks out; written: gathered into it first) as an array of these
     * dims and byte strides in the pool (the last dim contiguous) */
    int *ndim;
    long long (*dims)[MAX_DIMS], (*strides)[MAX_DIMS];
    long long *extent; /* per piece: bytes from its first to past its last in the pool */
    long long *stage_at; /* per staged piece: its offset in staging */
    long long *cold_at;  /* per piece: its offset in a cold file's staging (cold_stage) */
    /* per piece: whether it is the first staged piece of its group of alike ones (the same
     * dims, strides and bytes: moved row by row together), and the next of its group (-1:
     * none) */
    unsigned char *lead;
    Py_ssize_t *next_alike;
    char *staging;
    long long staging_len, staged; /* staged: the staging one file needs */
    /* cold_staged: the staging one cold file needs when every piece goes through it
     * (cold_stage: read_pages does so; see the NOTE in _pageio_read.c) */
    long long cold_staged;
    int cold_stage;
    size_t chunk;
    int cold_check;
} shape_t;

/* (in _pageio_shape.c) The shape's parts from a sequence of (checksum index, file
 * offset, pieces), each piece (start, step, bytes) or staged (start, step, bytes, dims,
 * strides), checked against the pool (sh->flat_len), the header and the file
 * (sh->header_len, sh->total) and the staging (sh->staging_len); 0, or -1 with an
 * exception set. */
int parse_parts(PyObject *parts_obj, shape_t *sh);

/* The files of one call: per file its path (and, for write_pages, its temporary path),
 * its header prefix (bytes of the sequence held) and its page. */
typedef struct {
    Py_ssize_t n;
    PyObject *seq;
    PyObject **tmps, **paths; /* bytes (file system encoding); tmps NULL without */
    const char **prefixes;
    Py_ssize_t *prefix_lens;
    long long *pages;
} files_t;

/* The files from a sequence of (path, prefix, page), or with with_tmp of (temporary
 * path, path, prefix, page), each checked: the prefix and the checksums inside the
 * header, every piece of the page inside the pool; 0, or -1 with an exception set
 * (free_files either way). */
int parse_files(const shape_t *sh, PyObject *files_obj, int with_tmp, files_t *fs);

/* What parse_files took. */
void free_files(files_t *fs);

/* Where each piece of page `page` moves from or to: its place in the pool, or (staged)
 * its place in `staging`; with `all`, every piece's place in a cold file's staging
 * (cold_at). */
void page_spans(const shape_t *sh, char *staging, long long page, span_t *spans, int all);

/* Every staged piece of page `page` copied out of staging to its place in the pool, whole
 * lines with streaming stores where it can (the pool's page is not read back soon: a
 * plain store first reads each line it writes). */
void unstage(const shape_t *sh, const char *staging, long long page);

/* unstage, then every in-place piece of page `page` copied from its place in a cold
 * file's staging (cold_at) to the pool, whole lines with streaming stores where it can. */
void unstage_all(const shape_t *sh, const char *staging, long long page);

/* Every staged piece of page `page` gathered from the pool into staging (plain stores:
 * the staging is read back at once). */
void stage(const shape_t *sh, char *staging, long long page);

/* What parse_parts allocated. */
void free_shape(shape_t *sh);

/* The first length bytes of the new file fd reserved on disk in one request (Linux's
 * fallocate); 1 reserved, 0 where the file system or platform cannot (nothing done), or
 * -1 with errno set. */
int reserve(int fd, long long length);

/* Every byte of buf at offset, read (write == 0) or written; 0, or -1 with errno set
 * (EIO: a read met the end of the file). */
int move_all(int fd, char *buf, size_t len, long long offset, int write);

/* Every byte of iov[0..n) read (write == 0) or written at offset, IOV_MAX stretches a
 * call at most; 0, or -1 with errno set (EIO: a read met the end of the file). Consumes
 * iov. */
int iov_all(int fd, struct iovec *iov, int n, long long offset, int write);

/* Each part's xxh3-64 digest over its stretches of spans, into sums (in part order). */
void hash_parts(const shape_t *sh, const span_t *spans, void *state, unsigned long long *sums);

/* The parts moved in pieces that end at multiples of chunk in the file (0: a stretch
 * at once), each piece hashed while in the CPU's cache, each part's digest into sums;
 * 0, or -1 with errno set. */
int move_parts(int fd, const part_t *parts, Py_ssize_t nparts, const span_t *spans, size_t chunk, int write,
               void *state, unsigned long long *sums);

/* read_pages (in _pageio_read.c), write_pages (in _pageio_write.c) */
extern const char read_pages_doc[], write_pages_doc[];
PyObject *read_pages(PyObject *self, PyObject *args);
PyObject *write_pages(PyObject *self, PyObject *args);

#endif
