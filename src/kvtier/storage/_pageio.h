/* What the two halves of kvtier.storage._pageio share: the xxh3 calls bound at import
 * (see bind in _pageio.c), and the loop that moves and hashes a file's parts. */
#ifndef KVTIER_PAGEIO_H
#define KVTIER_PAGEIO_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>

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

/* Every byte of buf at offset, read (write == 0) or written; 0, or -1 with errno set
 * (EIO: a read met the end of the file). */
int move_all(int fd, char *buf, size_t len, long long offset, int write);

/* The parts moved in pieces that end at multiples of chunk in the file (0: a stretch
 * at once), each piece hashed while in the CPU's cache, each part's digest into sums;
 * 0, or -1 with errno set. */
int move_parts(int fd, const part_t *parts, Py_ssize_t nparts, const span_t *spans, size_t chunk, int write,
               void *state, unsigned long long *sums);

/* read_pages (in _pageio_read.c) */
extern const char read_pages_doc[];
PyObject *read_pages(PyObject *self, PyObject *args);

#endif
