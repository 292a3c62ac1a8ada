/* kvtier.storage._pageio: the shape of a batch of page files, parsed from Python and
 * checked against the pool, for read_pages and write_pages. */
#include "_pageio.h"
#include "../_lines.h"
#include "../_sequences.h"

#include <limits.h>
#include <string.h>

/* a * b of non-negative a and b into *out: 0, or -1 where it would pass LLONG_MAX. */
static int mul_nn(long long a, long long b, long long *out) {
    if (a && b > LLONG_MAX / a)
        return -1;
    *out = a * b;
    return 0;
}

/* a + b of non-negative a and b into *out: 0, or -1 where it would pass LLONG_MAX. */
static int add_nn(long long a, long long b, long long *out) {
    if (b > LLONG_MAX - a)
        return -1;
    *out = a + b;
    return 0;
}

/* Piece k's dims and byte strides (None, None: in place) and its extent in the pool;
 * 0, or -1 with an exception set. */
static int parse_dims(shape_t *sh, Py_ssize_t k, long long nbytes, PyObject *dims, PyObject *strides) {
    sh->ndim[k] = 0, sh->extent[k] = nbytes;
    if (!dims || dims == Py_None)
        return 0;
    PyObject *d = held_items(dims, "a piece's dims must be a sequence"), *s = NULL;
    int rc = -1;
    if (!d || !(s = held_items(strides, "a piece's strides must be a sequence")))
        goto done;
    Py_ssize_t nd = PySequence_Fast_GET_SIZE(d);
    if (nd < 1 || nd > MAX_DIMS || PySequence_Fast_GET_SIZE(s) != nd) {
        PyErr_Format(PyExc_ValueError, "%s: piece %zd: 1 to %d dims, as many strides", sh->what, k, MAX_DIMS);
        goto done;
    }
    long long count = 1, extent = 0;
    for (Py_ssize_t i = 0; i < nd; i++) {
        sh->dims[k][i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(d, i));
        sh->strides[k][i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(s, i));
        if (PyErr_Occurred())
            goto done;
        if (sh->dims[k][i] < 1 || sh->strides[k][i] < 0) {
            PyErr_Format(PyExc_ValueError, "%s: piece %zd: dims must be positive, strides not negative", sh->what, k);
            goto done;
        }
        long long reach = 0; /* NOTE: checked, as every sum here: a wrapped extent would pass the pool's bound */
        if (mul_nn(count, sh->dims[k][i], &count) < 0 ||
            (i < nd - 1 && (mul_nn(sh->dims[k][i] - 1, sh->strides[k][i], &reach) < 0 ||
                            add_nn(extent, reach, &extent) < 0)))
            goto too_far;
    }
    long long item = count ? nbytes / count : 0, row = sh->dims[k][nd - 1] * item; /* (row <= nbytes) */
    if (!item || item * count != nbytes || sh->strides[k][nd - 1] != item) {
        PyErr_Format(PyExc_ValueError, "%s: piece %zd: %lld bytes in dims of %lld items, the last dim "
                     "contiguous", sh->what, k, nbytes, count);
        goto done;
    }
    if (add_nn(extent, row, &extent) < 0)
        goto too_far;
    sh->ndim[k] = (int)nd, sh->extent[k] = extent;
    rc = 0;
    goto done;
too_far:
    PyErr_Format(PyExc_ValueError, "%s: piece %zd: dims and strides reach past 2^63 bytes", sh->what, k);
done:
    Py_XDECREF(d);
    Py_XDECREF(s);
    return rc;
}

/* Whether staged pieces a and b are arrays of the same dims, strides and bytes. */
static int alike(const shape_t *sh, Py_ssize_t a, Py_ssize_t b) {
    if (sh->ndim[a] != sh->ndim[b] || sh->len[a] != sh->len[b])
        return 0;
    for (int d = 0; d < sh->ndim[a]; d++)
        if (sh->dims[a][d] != sh->dims[b][d] || sh->strides[a][d] != sh->strides[b][d])
            return 0;
    return 1;
}

/* The staged pieces in groups of alike ones (lead: the first of its group; next_alike:
 * the next of it, -1 after the last). */
static void group_alike(shape_t *sh) {
    for (Py_ssize_t k = 0; k < sh->npieces; k++)
        sh->lead[k] = sh->ndim[k] > 0, sh->next_alike[k] = -1;
    for (Py_ssize_t k = 0; k < sh->npieces; k++) {
        if (!sh->lead[k])
            continue;
        for (Py_ssize_t j = k + 1, last = k; j < sh->npieces; j++)
            if (sh->lead[j] && alike(sh, k, j))
                sh->lead[j] = 0, sh->next_alike[last] = j, last = j;
    }
}

/* The shape's parts from a sequence of (checksum index, file offset, ((start, step,
 * bytes), ...)); 0, or -1 with an exception set. */
int parse_parts(PyObject *parts_obj, shape_t *sh) {
    PyObject *seq = held_items(parts_obj, "parts must be a sequence");
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
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, p), "nLO:part", &sh->sum_index[p],
                              &sh->parts[p].offset, &list))
            goto done;
        if (sh->sum_index[p] < 0 || sh->sum_index[p] >= sh->nsums || sh->parts[p].offset < sh->header_len ||
            (p && sh->parts[p].offset <= sh->parts[p - 1].offset)) {
            PyErr_Format(PyExc_ValueError, "%s: part %zd: checksum %zd of %zd, offset %lld (parts in file "
                         "order, after the header's %lld bytes)", sh->what, p, sh->sum_index[p], sh->nsums,
                         sh->parts[p].offset, sh->header_len);
            goto done;
        }
        if (!(pieces[p] = held_items(list, "a part's pieces must be a sequence")))
            goto done;
        sh->parts[p].first = total;
        sh->parts[p].count = PySequence_Fast_GET_SIZE(pieces[p]);
        total += sh->parts[p].count;
    }
    sh->npieces = total;
    sh->start = PyMem_Calloc(total ? total : 1, sizeof(long long));
    sh->step = PyMem_Calloc(total ? total : 1, sizeof(long long));
    sh->len = PyMem_Calloc(total ? total : 1, sizeof(size_t));
    sh->ndim = PyMem_Calloc(total ? total : 1, sizeof(int));
    sh->dims = PyMem_Calloc(total ? total : 1, sizeof *sh->dims);
    sh->strides = PyMem_Calloc(total ? total : 1, sizeof *sh->strides);
    sh->extent = PyMem_Calloc(total ? total : 1, sizeof(long long));
    sh->stage_at = PyMem_Calloc(total ? total : 1, sizeof(long long));
    sh->cold_at = PyMem_Calloc(total ? total : 1, sizeof(long long));
    sh->next_alike = PyMem_Calloc(total ? total : 1, sizeof(Py_ssize_t));
    sh->lead = PyMem_Calloc(total ? total : 1, 1);
    if (!sh->start || !sh->step || !sh->len || !sh->ndim || !sh->dims || !sh->strides || !sh->extent ||
        !sh->stage_at || !sh->cold_at || !sh->next_alike || !sh->lead) {
        PyErr_NoMemory();
        goto done;
    }
    long long staged = 0; /* staging bytes: each staged part at a multiple of ALIGN */
    for (Py_ssize_t p = 0, k = 0; p < n; p++) {
        long long end = sh->parts[p].offset, part_bytes = 0;
        int part_staged = -1;
        for (Py_ssize_t j = 0; j < sh->parts[p].count; j++, k++) {
            long long nbytes;
            PyObject *dims = NULL, *strides = NULL;
            if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(pieces[p], j), "LLL|OO:piece", &sh->start[k],
                                  &sh->step[k], &nbytes, &dims, &strides))
                goto done;
            if (parse_dims(sh, k, nbytes, dims, strides) < 0)
                goto done;
            if (part_staged >= 0 && part_staged != (sh->ndim[k] > 0)) {
                PyErr_Format(PyExc_ValueError, "%s: part %zd has staged and in-place pieces", sh->what, p);
                goto done;
            }
            part_staged = sh->ndim[k] > 0;
            if (sh->start[k] < 0 || sh->step[k] < 0 || nbytes < 0 || sh->extent[k] > sh->flat_len ||
                sh->start[k] > sh->flat_len - sh->extent[k]) {
                PyErr_Format(PyExc_ValueError, "%s: piece (%lld, %lld, %lld) outside the pool's %lld bytes", sh->what,
                             sh->start[k], sh->step[k], nbytes, sh->flat_len);
                goto done;
            }
            sh->len[k] = (size_t)nbytes;
            sh->stage_at[k] = staged + part_bytes;
            part_bytes += nbytes;
            if (add_nn(end, nbytes, &end) < 0)
                end = LLONG_MAX; /* past any file: refused below */
        }
        if (part_staged == 1)
            staged += (part_bytes + ALIGN - 1) / ALIGN * ALIGN;
        if (end > sh->total || (p + 1 < n && end > sh->parts[p + 1].offset)) {
            PyErr_Format(PyExc_ValueError, "%s: part %zd ends at %lld, past the next part or the file's "
                         "%lld bytes", sh->what, p, end, sh->total);
            goto done;
        }
    }
    sh->staged = staged;
    /* a cold file's staging: the staged parts as above, then each in-place part at a
     * multiple of ALIGN */
    long long cold = staged;
    for (Py_ssize_t p = 0; p < n; p++) {
        const part_t *part = &sh->parts[p];
        long long part_bytes = 0;
        for (Py_ssize_t k = part->first; k < part->first + part->count; k++) {
            sh->cold_at[k] = sh->ndim[k] ? sh->stage_at[k] : cold + part_bytes;
            part_bytes += (long long)sh->len[k];
        }
        if (part->count && !sh->ndim[part->first])
            cold += (part_bytes + ALIGN - 1) / ALIGN * ALIGN;
    }
    sh->cold_staged = cold;
    group_alike(sh);
    if (staged > sh->staging_len) {
        PyErr_Format(PyExc_ValueError, "%s: staged parts need %lld bytes of staging, got %lld", sh->what, staged,
                     sh->staging_len);
        goto done;
    }
    rc = 0;
done:
    for (Py_ssize_t p = 0; pieces && p < n; p++)
        Py_XDECREF(pieces[p]);
    PyMem_Free(pieces);
    Py_DECREF(seq);
    return rc;
}

int parse_files(const shape_t *sh, PyObject *files_obj, int with_tmp, files_t *fs) {
    /* NOTE: held here also because the prefixes are read with the GIL released: a
     * list another thread empties meanwhile would free them */
    PyObject *seq = held_items(files_obj, "files must be a sequence");
    if (!seq)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), m = n ? n : 1;
    int rc = -1;
    fs->n = n;
    fs->tmps = with_tmp ? PyMem_Calloc(m, sizeof(PyObject *)) : NULL;
    fs->paths = PyMem_Calloc(m, sizeof(PyObject *));
    fs->prefixes = PyMem_Calloc(m, sizeof(char *));
    fs->prefix_lens = PyMem_Calloc(m, sizeof(Py_ssize_t));
    fs->pages = PyMem_Calloc(m, sizeof(long long));
    if ((with_tmp && !fs->tmps) || !fs->paths || !fs->prefixes || !fs->prefix_lens || !fs->pages) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t f = 0; f < n; f++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, f), *tmp = NULL, *path, *prefix;
        long long page;
        if (!(with_tmp ? PyArg_ParseTuple(item, "OOSL:file", &tmp, &path, &prefix, &page)
                       : PyArg_ParseTuple(item, "OSL:file", &path, &prefix, &page)))
            goto done;
        if ((tmp && !PyUnicode_FSConverter(tmp, &fs->tmps[f])) || !PyUnicode_FSConverter(path, &fs->paths[f]))
            goto done;
        fs->prefixes[f] = PyBytes_AS_STRING(prefix), fs->prefix_lens[f] = PyBytes_GET_SIZE(prefix);
        fs->pages[f] = page;
        if (sh->nsums < 0 || fs->prefix_lens[f] > sh->header_len ||
            sh->nsums > (sh->header_len - fs->prefix_lens[f]) / 8) {
            PyErr_Format(PyExc_ValueError, "%s: file %zd: a prefix of %zd bytes and %zd checksums exceed the "
                         "header's %lld bytes", sh->what, f, fs->prefix_lens[f], sh->nsums, sh->header_len);
            goto done;
        }
        for (Py_ssize_t k = 0; k < sh->npieces; k++)
            if (page < 0 || (sh->step[k] && page > (sh->flat_len - sh->start[k] - sh->extent[k]) / sh->step[k]) ||
                sh->start[k] + page * sh->step[k] + sh->extent[k] > sh->flat_len) {
                PyErr_Format(PyExc_ValueError, "%s: page %lld puts piece %zd outside the pool's %lld bytes",
                             sh->what, page, k, sh->flat_len);
                goto done;
            }
    }
    rc = 0;
done:
    fs->seq = seq; /* holds the prefixes */
    return rc;
}

void free_files(files_t *fs) {
    for (Py_ssize_t f = 0; f < fs->n; f++) {
        if (fs->tmps)
            Py_XDECREF(fs->tmps[f]);
        if (fs->paths)
            Py_XDECREF(fs->paths[f]);
    }
    PyMem_Free(fs->tmps);
    PyMem_Free(fs->paths);
    PyMem_Free(fs->prefixes);
    PyMem_Free(fs->prefix_lens);
    PyMem_Free(fs->pages);
    Py_XDECREF(fs->seq);
}

void free_shape(shape_t *sh) {
    PyMem_Free(sh->sum_index);
    PyMem_Free(sh->parts);
    PyMem_Free(sh->start);
    PyMem_Free(sh->step);
    PyMem_Free(sh->len);
    PyMem_Free(sh->ndim);
    PyMem_Free(sh->dims);
    PyMem_Free(sh->strides);
    PyMem_Free(sh->extent);
    PyMem_Free(sh->stage_at);
    PyMem_Free(sh->cold_at);
    PyMem_Free(sh->next_alike);
    PyMem_Free(sh->lead);
}

/* Every staged piece of page `page` moved between staging and its place in the pool, a
 * row (its last, contiguous dim) at a time: out of staging (unstage) as whole lines with
 * streaming stores where the row allows, or into it (stage). The pieces of a group of
 * alike ones (each head group's K of a page_first page, say) move row by row together,
 * so that the pool is walked in its own order: its heads' rows sit side by side there.
 * NOTE: piece by piece, a 1.4 MiB page_first page's gather took as long as the kernel's
 * copy of the whole file (perf, tmpfs): each piece read a quarter of every stretch of the
 * pool and the prefetcher fetched the rest, gone from the caches by the next piece. */
static void each_row(const shape_t *sh, char *staging, long long page, int out) {
    for (Py_ssize_t k = 0; k < sh->npieces; k++) {
        if (!sh->lead[k])
            continue;
        int nd = sh->ndim[k];
        size_t row = sh->len[k];
        long long rows = 1, index[MAX_DIMS] = {0};
        for (int d = 0; d < nd - 1; d++)
            rows *= sh->dims[k][d];
        row /= (size_t)rows;
        for (long long i = 0; i < rows; i++) {
            long long offset = 0;
            for (int d = 0; d < nd - 1; d++)
                offset += index[d] * sh->strides[k][d];
            for (Py_ssize_t j = k; j >= 0; j = sh->next_alike[j]) {
                char *in_pool = sh->flat + sh->start[j] + page * sh->step[j] + offset;
                char *at = staging + sh->stage_at[j] + (size_t)i * row;
                if (!out)
                    memcpy(at, in_pool, row);
                else if (lines_ok(in_pool, row))
                    copy_lines(in_pool, at, row);
                else
                    memcpy(in_pool, at, row);
            }
            for (int d = nd - 2; d >= 0 && ++index[d] == sh->dims[k][d]; d--) /* the next row's index */
                index[d] = 0;
        }
    }
    if (out)
        lines_fence();
}

void page_spans(const shape_t *sh, char *staging, long long page, span_t *spans, int all) {
    for (Py_ssize_t k = 0; k < sh->npieces; k++)
        spans[k] = (span_t){all            ? staging + sh->cold_at[k]
                            : sh->ndim[k] ? staging + sh->stage_at[k]
                                          : sh->flat + sh->start[k] + page * sh->step[k],
                            sh->len[k]};
}

void unstage(const shape_t *sh, const char *staging, long long page) {
    each_row(sh, (char *)staging, page, 1);
}

void unstage_all(const shape_t *sh, const char *staging, long long page) {
    unstage(sh, staging, page);
    int streamed = 0;
    for (Py_ssize_t k = 0; k < sh->npieces; k++) {
        if (sh->ndim[k])
            continue;
        char *in_pool = sh->flat + sh->start[k] + page * sh->step[k];
        if (lines_ok(in_pool, sh->len[k])) {
            copy_lines(in_pool, staging + sh->cold_at[k], sh->len[k]);
            streamed = 1;
        } else {
            memcpy(in_pool, staging + sh->cold_at[k], sh->len[k]);
        }
    }
    if (streamed)
        lines_fence();
}

void stage(const shape_t *sh, char *staging, long long page) {
    each_row(sh, staging, page, 0);
}
