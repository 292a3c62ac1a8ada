/* kvtier.pools._indices: the two loops over token slots that every cache call runs.
 *
 * check_pages validates a slot array the way kvtier.pools.indices does in numpy (each
 * page's slots consecutive from an aligned start inside the pool) and writes the page
 * numbers, in one pass instead of about ten numpy calls; expand_pages writes the token
 * slots of page numbers (the inverse), expand_runs those of several runs of page numbers
 * into one output (a matched path's), window_slots a sliding group's window among -1s.
 * All are optional: kvtier.pools.indices falls
 * back to numpy where this module is missing or KVTIER_NATIVE=0, and words every error
 * itself (check_pages only reports where the first bad page is). Nothing is trusted:
 * every buffer must be C-contiguous and exactly the size its counts imply.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "../_sequences.h"
#include "../_slots.h"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Calls longer than this many slots release the GIL while they loop. */
#define RELEASE_GIL_SLOTS 65536

/* Whether ``pages`` (each in [0, 2^62)) names a page twice: an open-addressing set of
 * 2^k >= 2n slots holding page + 1 (0 is empty). -1 on no memory. */
static int has_duplicate(const int64_t *pages, Py_ssize_t n) {
    int bits = 1;
    while (((Py_ssize_t)1 << bits) < 2 * n)
        bits++;
    size_t mask = ((size_t)1 << bits) - 1;
    uint64_t *table = calloc(mask + 1, sizeof(uint64_t));
    if (table == NULL)
        return -1;
    int found = 0;
    for (Py_ssize_t i = 0; i < n && !found; i++) {
        uint64_t v = (uint64_t)pages[i] + 1;
        size_t at = (size_t)((v * 0x9E3779B97F4A7C15ull) >> (64 - bits));
        while (table[at] && table[at] != v)
            at = (at + 1) & mask;
        found = table[at] == v;
        table[at] = v;
    }
    free(table);
    return found;
}

/* Whether a page's ``ps`` slots are consecutive from its first: the whole page, its
 * first slot too, in a loop the compiler keeps in vectors (unsigned: it runs before the
 * range check, and a start near 2^63 must wrap, not overflow). */
static inline int consecutive(const int64_t *page, int64_t ps) {
    uint64_t mismatch = 0;
    for (int64_t j = 0; j < ps; j++)
        mismatch |= (uint64_t)page[j] ^ ((uint64_t)page[0] + (uint64_t)j);
    return mismatch == 0;
}

/* A page's start, checked (in [0, end), a multiple of ``ps``): its number, or -1. A
 * power of two takes ``shift`` (a mask and a shift, not two 64-bit divisions a page:
 * about 1 us of an 8K-token insert at page 16); any other page size has shift -1. */
SLOTS_INLINE int64_t page_of(int64_t start, int64_t ps, int64_t end, int shift) {
    /* start >= 0 first, so % sees no negative number */
    if (start < 0 || start >= end || (shift >= 0 ? start & (ps - 1) : start % ps))
        return -1;
    return shift >= 0 ? start >> shift : start / ps;
}

/* check_pages' loop over ``pages`` pages of ``s``: each page's number to ``o``; the
 * index of the first page that is not whole and in range, or -1. */
static Py_ssize_t check_loop(const int64_t *s, int64_t *o, Py_ssize_t pages, int64_t ps, int64_t end, int shift) {
    for (Py_ssize_t p = 0; p < pages; p++) {
        const int64_t *page = s + p * ps;
        int64_t number = page_of(page[0], ps, end, shift);
        if (number < 0 || !consecutive(page, ps))
            return p;
        o[p] = number;
    }
    return -1;
}

/* NOTE: the loop built for AVX2 where the CPU has it and the page size is a multiple of
 * four: four slots a compare against the page's first slot stepped, and the slots 2 KiB
 * ahead prefetched (an insert's slots were written long before, out of the caches). An
 * 8K-slot check with the repeat check took 4.5-6.1 us warm with the compiler's loop for
 * a page size known only at run time (SSE2, set up for every page), 2.2-3.5 this way;
 * out of the caches 7.9 at page 64 and 10.1-10.5 at page 16, 6.3-6.7 and 8.9-10.1 this
 * way, the prefetch taking about 1 us of that (1 KiB or 4 KiB ahead did no better; Zen 2,
 * alternated runs) */
#define CHECK_AHEAD_BYTES 2048
#ifdef LINES_WIDE
LINES_HALF_TARGET static Py_ssize_t check_avx2(const int64_t *s, int64_t *o, Py_ssize_t pages, int64_t ps,
                                               int64_t end, int shift) {
    const __m256i iota = _mm256_set_epi64x(3, 2, 1, 0), four = _mm256_set1_epi64x(4);
    const Py_ssize_t ahead = (CHECK_AHEAD_BYTES + ps * 8 - 1) / (ps * 8); /* pages, at least one */
    for (Py_ssize_t p = 0; p < pages; p++) {
        const int64_t *page = s + p * ps;
        if (p + ahead < pages)
            for (int64_t j = 0; j < ps; j += 8)
                _mm_prefetch((const char *)(page + ahead * ps + j), _MM_HINT_T0);
        int64_t number = page_of(page[0], ps, end, shift);
        if (number < 0)
            return p;
        __m256i want = _mm256_add_epi64(_mm256_set1_epi64x(page[0]), iota), off = _mm256_setzero_si256();
        for (int64_t j = 0; j < ps; j += 4) {
            off = _mm256_or_si256(off, _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(page + j)), want));
            want = _mm256_add_epi64(want, four);
        }
        if (!_mm256_testz_si256(off, off))
            return p;
        o[p] = number;
    }
    return -1;
}
#endif

/* check_pages' work, past its arguments: ``n`` slots at ``s``, ``pages`` page numbers
 * to ``o``; a ValueError (NULL) where the counts do not fit. */
static PyObject *check_span(const int64_t *s, Py_ssize_t n, Py_ssize_t page_size, Py_ssize_t size, int64_t *o,
                            Py_ssize_t pages, int unique) {
    if (page_size <= 0 || size < 0) {
        PyErr_Format(PyExc_ValueError, "check_pages: page_size %zd and size %zd must be positive", page_size, size);
        return NULL;
    }
    if (n <= 0 || n % page_size || pages != n / page_size) {
        PyErr_Format(PyExc_ValueError, "check_pages: %zd slots with page_size %zd need an output of %zd pages, "
                     "got %zd", n, page_size, n > 0 ? n / page_size : 0, pages);
        return NULL;
    }
    const int64_t ps = (int64_t)page_size;
    /* a page starts below ``end``: the last whole page of the pool starts before it */
    const int64_t end = (int64_t)(size / page_size) * ps;
    Py_ssize_t bad = -1;
    PyThreadState *save = n >= RELEASE_GIL_SLOTS ? PyEval_SaveThread() : NULL;
    int shift = -1;
    if ((ps & (ps - 1)) == 0)
        for (shift = 0; ((int64_t)1 << shift) < ps; shift++)
            ;
#ifdef LINES_WIDE
    if (ps % 4 == 0 && lines_width() >= 32)
        bad = check_avx2(s, o, pages, ps, end, shift);
    else
#endif
        bad = check_loop(s, o, pages, ps, end, shift);
    int repeated = 0;
    if (bad < 0 && unique && pages > 1) /* every page number is now in [0, size / page_size) */
        repeated = has_duplicate(o, pages);
    if (save)
        PyEval_RestoreThread(save);
    if (repeated < 0)
        return PyErr_NoMemory();
    return PyLong_FromSsize_t(repeated ? -2 : bad);
}

PyDoc_STRVAR(check_pages_doc,
"check_pages(slots, page_size, size, out, unique=False) -> int\n\n"
"``slots``: int64 token slots, a positive multiple of ``page_size`` long; ``out``: a\n"
"writable int64 buffer of len(slots) // page_size. Writes each page's number to ``out``\n"
"and returns -1 when every page's slots are consecutive from a multiple of\n"
"``page_size`` and lie in [0, size) (and, with ``unique``, no page comes twice);\n"
"otherwise the index of the first page that is not (``out`` partly written), or -2\n"
"when only a repeated page is wrong.");

static PyObject *check_pages(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *src_obj, *out_obj;
    Py_ssize_t page_size, size;
    int unique = 0;
    if (!PyArg_ParseTuple(args, "OnnO|p:check_pages", &src_obj, &page_size, &size, &out_obj, &unique))
        return NULL;
    Py_buffer src, out;
    if (get_int64s(src_obj, &src, 0, "slots") < 0)
        return NULL;
    if (get_int64s(out_obj, &out, 1, "out") < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    PyObject *result = check_span((const int64_t *)src.buf, src.len / 8, page_size, size, (int64_t *)out.buf,
                                  out.len / 8, unique);
    PyBuffer_Release(&src);
    PyBuffer_Release(&out);
    return result;
}

PyDoc_STRVAR(check_pages_at_doc,
"check_pages_at(address, count, page_size, size, out, unique=False) -> int\n\n"
"check_pages of the ``count`` int64 slots at ``address``: the memory of a tensor the\n"
"caller holds and has checked (CPU, int64, 1-D, contiguous, ``count`` elements, as\n"
"kvtier.pools.indices does), which this trusts. A tensor's numpy view, the one\n"
"buffer torch gives, cost half as much as the check of 8K slots itself.");

static PyObject *check_pages_at(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long address;
    Py_ssize_t count, page_size, size;
    PyObject *out_obj;
    int unique = 0;
    if (!PyArg_ParseTuple(args, "KnnnO|p:check_pages_at", &address, &count, &page_size, &size, &out_obj, &unique))
        return NULL;
    if (address == 0 || address % sizeof(int64_t)) {
        PyErr_Format(PyExc_ValueError, "check_pages_at: address %llu is not that of int64s", address);
        return NULL;
    }
    Py_buffer out;
    if (get_int64s(out_obj, &out, 1, "out") < 0)
        return NULL;
    PyObject *result = check_span((const int64_t *)(uintptr_t)address, count, page_size, size, (int64_t *)out.buf,
                                  out.len / 8, unique);
    PyBuffer_Release(&out);
    return result;
}

PyDoc_STRVAR(first_flag_doc,
"first_flag(flags, pages, start, value) -> int\n\n"
"The index i >= ``start`` of the first page p = pages[i] whose ``flags[p]`` (a\n"
"buffer of a byte a page, as a numpy bool array is) is ``value`` (true: nonzero),\n"
"or -1. ``pages``: int64; each page read must lie in ``flags``, else a ValueError\n"
"naming it. One pass in place of a gather, a count and a call or two of numpy each.");

static PyObject *first_flag(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *flags_obj, *pages_obj;
    Py_ssize_t start;
    int value;
    if (!PyArg_ParseTuple(args, "OOnp:first_flag", &flags_obj, &pages_obj, &start, &value))
        return NULL;
    Py_buffer flags, pages;
    if (PyObject_GetBuffer(flags_obj, &flags, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (flags.itemsize != 1) {
        PyErr_Format(PyExc_TypeError, "first_flag: flags must hold a byte a page, got items of %zd bytes",
                     flags.itemsize);
        PyBuffer_Release(&flags);
        return NULL;
    }
    if (get_int64s(pages_obj, &pages, 0, "pages") < 0) {
        PyBuffer_Release(&flags);
        return NULL;
    }
    const Py_ssize_t n = pages.len / 8;
    const uint8_t *f = (const uint8_t *)flags.buf;
    const int64_t *p = (const int64_t *)pages.buf;
    Py_ssize_t found = -1, outside = -1;
    int failed = start < 0 || start > n;
    if (failed) {
        PyErr_Format(PyExc_ValueError, "first_flag: start %zd outside the %zd pages", start, n);
    } else {
        for (Py_ssize_t i = start; i < n; i++) {
            if ((uint64_t)p[i] >= (uint64_t)flags.len) {
                outside = i;
                break;
            }
            if ((f[p[i]] != 0) == value) {
                found = i;
                break;
            }
        }
        if (outside >= 0) {
            failed = 1;
            PyErr_Format(PyExc_ValueError, "first_flag: page %lld (item %zd) outside the %zd flags",
                         (long long)p[outside], outside, flags.len);
        }
    }
    PyBuffer_Release(&flags);
    PyBuffer_Release(&pages);
    return failed ? NULL : PyLong_FromSsize_t(found);
}

/* What the expansions take: ``(pages, page_size, out)``, ``pages`` one buffer or (with
 * ``many``) a tuple or list of items, each a buffer or (with ``placed``) a tuple
 * ``(first page, buffer)``. Every item's buffer is taken before any slot is written. */
typedef struct {
    PyObject *seq;      /* many: the items as a fast sequence */
    Py_ssize_t count;   /* buffers taken */
    Py_buffer *views;   /* count of them */
    Py_ssize_t *firsts; /* placed: each item's first page */
    Py_buffer out;      /* the caller's buffer, or (made) the capsule's slots */
    int has_out;        /* 0 once parsed: ``out`` was a count, and expansion_made makes its slots */
    PyObject *capsule;  /* ... in this capsule, until returned */
    int64_t page_size;
} expansion_t;

static void expansion_release(expansion_t *e) {
    for (Py_ssize_t i = 0; i < e->count; i++)
        PyBuffer_Release(&e->views[i]);
    if (e->has_out)
        PyBuffer_Release(&e->out);
    Py_XDECREF(e->capsule);
    PyMem_Free(e->views);
    PyMem_Free(e->firsts);
    Py_XDECREF(e->seq);
}

/* 0 with every buffer taken (expansion_release gives them back), or -1 with an exception
 * set and nothing held. */
static int expansion_parse(PyObject *args, const char *name, int many, int placed, expansion_t *e) {
    PyObject *pages_obj, *out_obj;
    Py_ssize_t page_size;
    memset(e, 0, sizeof *e);
    if (!PyArg_ParseTuple(args, "OnO", &pages_obj, &page_size, &out_obj))
        return -1;
    if (page_size <= 0) {
        PyErr_Format(PyExc_ValueError, "%s: page_size %zd must be positive", name, page_size);
        return -1;
    }
    e->page_size = (int64_t)page_size;
    Py_ssize_t n = 1;
    if (many) {
        if (!(e->seq = held_items(pages_obj, "the pages must be a tuple or list")))
            return -1;
        n = PySequence_Fast_GET_SIZE(e->seq);
    }
    e->views = PyMem_Calloc(n ? (size_t)n : 1, sizeof(Py_buffer));
    e->firsts = PyMem_Calloc(n ? (size_t)n : 1, sizeof(Py_ssize_t));
    if (e->views == NULL || e->firsts == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    for (; e->count < n; e->count++) {
        PyObject *item = many ? PySequence_Fast_GET_ITEM(e->seq, e->count) : pages_obj;
        if (placed) {
            if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2) {
                PyErr_Format(PyExc_TypeError, "%s: each piece must be a tuple (first, pages)", name);
                goto fail;
            }
            e->firsts[e->count] = PyLong_AsSsize_t(PyTuple_GET_ITEM(item, 0));
            if (e->firsts[e->count] == -1 && PyErr_Occurred())
                goto fail;
            item = PyTuple_GET_ITEM(item, 1);
        }
        if (get_int64s(item, &e->views[e->count], 0, "pages") < 0)
            goto fail;
    }
    if (PyLong_Check(out_obj)) { /* a count: new slots, in a capsule (slots_capsule) */
        Py_ssize_t slots = PyLong_AsSsize_t(out_obj);
        if (slots == -1 && PyErr_Occurred())
            goto fail;
        if (slots < 0 || slots > PY_SSIZE_T_MAX / 8) {
            PyErr_Format(PyExc_ValueError, "%s: %zd slots cannot be made", name, slots);
            goto fail;
        }
        e->out.len = slots * 8;
        return 0;
    }
    if (get_int64s(out_obj, &e->out, 1, "out") < 0)
        goto fail;
    e->has_out = 1;
    return 0;
fail:
    expansion_release(e);
    return -1;
}

/* Where ``out`` was a count, its new slots (the call's checks passed): 0, or -1 with an
 * error set. */
static int expansion_made(expansion_t *e) {
    int64_t *data = NULL;
    if (e->has_out || e->capsule != NULL)
        return 0;
    if (!(e->capsule = slots_capsule(e->out.len / 8, &data)))
        return -1;
    e->out.buf = data;
    return 0;
}

/* What a call that wrote ``e`` returns: ``done`` (a new reference, or NULL), or where
 * ``out`` was a count, the new slots' capsule (with ``done`` beside it, when not None). */
static PyObject *expansion_result(expansion_t *e, PyObject *done) {
    PyObject *capsule = e->capsule;
    e->capsule = NULL;
    expansion_release(e);
    if (capsule == NULL || done == NULL) {
        Py_XDECREF(capsule);
        return done;
    }
    if (done == Py_None) {
        Py_DECREF(done);
        return capsule;
    }
    return Py_BuildValue("(NN)", capsule, done);
}

/* Pages of every buffer taken, in all. */
static Py_ssize_t expansion_pages(const expansion_t *e) {
    Py_ssize_t pages = 0;
    for (Py_ssize_t i = 0; i < e->count; i++)
        pages += e->views[i].len / 8;
    return pages;
}

/* expand_pages and expand_runs: every page's slots, one buffer after another, filling
 * ``out`` exactly. */
static PyObject *expand_all(PyObject *args, const char *name, int many) {
    expansion_t e;
    if (expansion_parse(args, name, many, 0, &e) < 0)
        return NULL;
    Py_ssize_t pages = expansion_pages(&e), slots = e.out.len / 8;
    /* NOTE: as a quotient, not pages * page_size, which wraps for a huge page size */
    if (slots % e.page_size || slots / e.page_size != pages) {
        if (pages > PY_SSIZE_T_MAX / e.page_size)
            PyErr_Format(PyExc_ValueError, "%s: %zd pages of %lld slots need more than 2^63, the output holds %zd",
                         name, pages, (long long)e.page_size, slots);
        else
            PyErr_Format(PyExc_ValueError, "%s: %zd pages of %lld slots need %zd, the output holds %zd", name, pages,
                         (long long)e.page_size, pages * (Py_ssize_t)e.page_size, slots);
        expansion_release(&e);
        return NULL;
    }
    if (expansion_made(&e) < 0) {
        expansion_release(&e);
        return NULL;
    }
    int64_t *o = (int64_t *)e.out.buf;
    PyThreadState *save = slots >= RELEASE_GIL_SLOTS ? PyEval_SaveThread() : NULL;
    for (Py_ssize_t i = 0; i < e.count; i++) {
        expand_into(o, (const int64_t *)e.views[i].buf, e.views[i].len / 8, e.page_size, 0);
        o += (e.views[i].len / 8) * e.page_size;
    }
    if (save)
        PyEval_RestoreThread(save);
    return expansion_result(&e, Py_NewRef(Py_None));
}

PyDoc_STRVAR(expand_pages_doc,
"expand_pages(pages, page_size, out) -> None\n\n"
"Write the token slots of ``pages`` (int64 page numbers) to ``out`` (a writable int64\n"
"buffer of len(pages) * page_size): page p becomes p * page_size .. p * page_size +\n"
"page_size - 1. Where ``out`` is a count of slots, they are written to new memory and\n"
"returned as a DLPack capsule (torch.utils.dlpack.from_dlpack takes it, without a\n"
"copy); so for every expansion here.");

static PyObject *expand_pages(PyObject *self, PyObject *args) {
    (void)self;
    return expand_all(args, "expand_pages", 0);
}

PyDoc_STRVAR(expand_runs_doc,
"expand_runs(runs, page_size, out) -> None\n\n"
"Write the token slots of the pages of each run in ``runs`` (a tuple or list of int64\n"
"page number buffers), one run after another, to ``out`` (a writable int64 buffer of\n"
"page_size slots per page of all the runs): what expand_pages does with the runs\n"
"concatenated, without the concatenation.");

static PyObject *expand_runs(PyObject *self, PyObject *args) {
    (void)self;
    return expand_all(args, "expand_runs", 1);
}

PyDoc_STRVAR(window_slots_doc,
"window_slots(pieces, page_size, out) -> int\n\n"
"Fill ``out`` (a writable int64 buffer of token slots) with -1, then write the token\n"
"slots of each piece ``(first, pages)`` from page ``first`` of ``out`` on: ``pages``\n"
"holds int64 page numbers, a negative one (a hole) leaving its page's slots at -1.\n"
"Every piece is checked to lie inside ``out`` before anything is written. Returns how\n"
"many pages were written (the pieces' pages that are not holes); with a count for\n"
"``out``, ``(capsule, written)``.");

static PyObject *window_slots(PyObject *self, PyObject *args) {
    (void)self;
    expansion_t e;
    if (expansion_parse(args, "window_slots", 1, 1, &e) < 0)
        return NULL;
    Py_ssize_t room = e.out.len / 8 / (Py_ssize_t)e.page_size; /* whole pages of out */
    for (Py_ssize_t i = 0; i < e.count; i++) {
        Py_ssize_t first = e.firsts[i], count = e.views[i].len / 8;
        if (first < 0 || first > room || count > room - first) {
            PyErr_Format(PyExc_ValueError, "window_slots: pages %zd..%zd of %lld slots each lie outside the %zd "
                         "slots given", first, first + count, (long long)e.page_size, e.out.len / 8);
            expansion_release(&e);
            return NULL;
        }
    }
    if (expansion_made(&e) < 0) {
        expansion_release(&e);
        return NULL;
    }
    memset(e.out.buf, 0xff, (size_t)e.out.len); /* -1 in every slot: all bits set */
    Py_ssize_t written = 0;
    for (Py_ssize_t i = 0; i < e.count; i++) {
        const int64_t *pages = (const int64_t *)e.views[i].buf;
        Py_ssize_t count = e.views[i].len / 8;
        expand_into((int64_t *)e.out.buf + e.firsts[i] * e.page_size, pages, count, e.page_size, 1);
        for (Py_ssize_t p = 0; p < count; p++)
            written += pages[p] >= 0;
    }
    return expansion_result(&e, PyLong_FromSsize_t(written));
}

static PyMethodDef methods[] = {
    {"check_pages", check_pages, METH_VARARGS, check_pages_doc},
    {"check_pages_at", check_pages_at, METH_VARARGS, check_pages_at_doc},
    {"first_flag", first_flag, METH_VARARGS, first_flag_doc},
    {"expand_pages", expand_pages, METH_VARARGS, expand_pages_doc},
    {"expand_runs", expand_runs, METH_VARARGS, expand_runs_doc},
    {"window_slots", window_slots, METH_VARARGS, window_slots_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvtier.pools._indices",
    "Token-slot checks and page expansion (optional; kvtier.pools.indices falls back to numpy).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__indices(void) { return PyModule_Create(&module); }
