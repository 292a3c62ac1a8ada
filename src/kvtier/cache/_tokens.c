/* kvtier.cache._tokens: token ids from a Python list or tuple into an int64 buffer, and
 * the radix walk's common steps (int-keyed children, whole keys compared in place).
 *
 * The pure-Python conversion (one struct.pack over the list) costs ~27 us for 8K ids;
 * this loop reads each exact int's value directly. It handles only the common case
 * (every element an exact int that fits int64) and answers False otherwise, without
 * calling any Python code, so the caller falls back to the pure path, which words
 * every error and handles other integer types (__index__). Nothing else is trusted:
 * the destination must be a writable, contiguous buffer of exactly 8 bytes per id.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "../_slots.h"
#include <stdint.h>
#include <stddef.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* Bytes past an id's int object that are prefetched, every other id. A list's int
 * objects (32 bytes each, 256 KiB for 8K ids) are found through pointers, which the
 * hardware's prefetchers do not follow; but a list made in one go (a tokenizer's, a
 * decoded request's) has them side by side in memory, in its order, so the memory a
 * little past the one being read is the objects a few dozen ids on. Prefetching there
 * costs no load of a later item, where prefetching ``items[i + 64]`` cost one per id.
 * Reading 8K random 30-bit ids on the Zen 2 VM (a throwaway loop, best of 5, the builds
 * alternated): in the CPU's caches 9.3-9.5 us with items[i + 64] prefetched, 7.8-7.9 with
 * nothing prefetched, 7.7-8.1 with this; out of the L2 10.1-10.7 / 8.4-9.4 / 8.4-9.6; 300
 * lists in turn, none in the caches, 20.5-24.2 / 24.7-26.9 / 18.3-21.2 (512 bytes or 4
 * KiB ahead no better). Where the objects lie in another order (a list shuffled in
 * memory) this prefetches nothing useful: 53.7-54.2 us there against 49.5-51.6. */
#define PREFETCH_AHEAD_BYTES 1024
#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH(p) __builtin_prefetch((p), 0, 3)
#else
#define PREFETCH(p) ((void)(p))
#endif

/* The common id's test in one 16-byte load: an exact int of one positive 30-bit digit
 * (every token id but 0 and negative ones) has, past its refcount, the two words
 * [&PyLong_Type, ONE_DIGIT] (3.11's ob_size 1; 3.12's lv_tag: one digit, sign +), and its
 * value is that digit. The general test reads the type, then the size word, then the
 * digit: four loads an id with its item, which the Zen 2's two loads a cycle took at
 * 2.0-2.1 cycles an id; this makes it three. Reading 8K random 30-bit ids (a throwaway
 * loop, best of 5, Zen 2 VM, the builds side by side): in the CPU's caches 7.9-8.2 us ->
 * 6.5, out of the L2 8.8-9.3 -> 7.6, out of the caches the same (20-21, memory-bound).
 * The layout is private: the import checks it on ints it makes (one_digit_setup) and,
 * where it differs, every id is read the general way. */
#if defined(__SSE2__) && PY_VERSION_HEX >= 0x030B0000 && PYLONG_BITS_IN_DIGIT == 30
#define ONE_DIGIT_TEST 1
#if PY_VERSION_HEX >= 0x030C0000
#define ONE_DIGIT ((int64_t)1 << _PyLong_NON_SIZE_BITS)
#define SIZE_AT offsetof(PyLongObject, long_value.lv_tag)
#define DIGIT_AT offsetof(PyLongObject, long_value.ob_digit)
#else
#define ONE_DIGIT ((int64_t)1)
#define SIZE_AT offsetof(PyVarObject, ob_size)
#define DIGIT_AT offsetof(PyLongObject, ob_digit)
#endif
#define TYPE_AT offsetof(PyObject, ob_type)
static __m128i one_digit;    /* [&PyLong_Type, ONE_DIGIT], as the two words lie */
static int one_digit_on = 0; /* set at import where the layout checks out */

/* Whether the two words at ``item``'s type are ``want`` (one_digit's): all ones where so. */
static inline __m128i one_digit_eq(PyObject *item, __m128i want) {
    return _mm_cmpeq_epi32(_mm_loadu_si128((const __m128i *)((const char *)item + TYPE_AT)), want);
}

static inline int64_t one_digit_value(PyObject *item) {
    uint32_t d;
    memcpy(&d, (const char *)item + DIGIT_AT, sizeof(d));
    return (int64_t)d;
}

/* The test made on ints of known value: ``v`` must pass it (with its value read) exactly
 * where ``fast``. 1 when it does. */
static int one_digit_checked(long long v, int fast) {
    PyObject *item = PyLong_FromLongLong(v);
    if (item == NULL) {
        PyErr_Clear();
        return 0;
    }
    int pass = _mm_movemask_epi8(one_digit_eq(item, one_digit)) == 0xFFFF;
    int ok = pass == fast && (!pass || one_digit_value(item) == v);
    Py_DECREF(item);
    return ok;
}

/* Turns the one-load test on where the layout is the one above: the type and the size
 * word adjacent, and ints of one positive digit (only they) passing with their value. */
static void one_digit_setup(void) {
    one_digit = _mm_set_epi64x(ONE_DIGIT, (int64_t)(uintptr_t)&PyLong_Type);
    int on = TYPE_AT + sizeof(PyObject *) == SIZE_AT;
    on = on && one_digit_checked(1000, 1) && one_digit_checked((1LL << 30) - 1, 1) && one_digit_checked(123457, 1);
    on = on && one_digit_checked(-1000, 0) && one_digit_checked(1LL << 30, 0) && one_digit_checked(-(1LL << 30), 0);
    on = on && one_digit_checked(1LL << 40, 0) && one_digit_checked(0, 0);
    one_digit_on = on;
}
#endif

/* The value of an exact int of at most one digit (|v| < 2**30, every token id), read
 * straight from the object: 1 when read, 0 to take the general call instead. */
static inline int compact_value(PyObject *item, int64_t *v) {
#if PY_VERSION_HEX >= 0x030C0000
    if (!PyUnstable_Long_IsCompact((PyLongObject *)item))
        return 0;
    *v = (int64_t)PyUnstable_Long_CompactValue((PyLongObject *)item);
    return 1;
#elif PY_VERSION_HEX >= 0x030B0000
    /* NOTE: 3.11's layout: the sign and digit count in ob_size, 30-bit digits */
    Py_ssize_t size = Py_SIZE(item);
    if (size < -1 || size > 1)
        return 0;
    *v = (int64_t)size * (int64_t)((PyLongObject *)item)->ob_digit[0];
    return 1;
#else
    (void)item;
    (void)v;
    return 0;
#endif
}

/* ``item``'s value when it is an exact int in the int64 range: 1 when read, 0 when not
 * (no exception set; no Python code runs). */
static inline int int64_of(PyObject *item, int64_t *v) {
    if (!PyLong_CheckExact(item))
        return 0;
    if (compact_value(item, v))
        return 1;
    int overflow = 0;
    long long value = PyLong_AsLongLongAndOverflow(item, &overflow);
    if (overflow)
        return 0;
    *v = (int64_t)value;
    return 1;
}

PyDoc_STRVAR(fill_int64_doc,
"fill_int64(dst, ids) -> bool\n\n"
"Write ``ids`` (a list or tuple) into ``dst`` (a writable buffer of len(ids) * 8\n"
"bytes) as native int64. True when every id was an exact int in the int64 range;\n"
"False (``dst`` partly written, no exception) as soon as one is not.");

static PyObject *fill_int64(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *dst_obj, *ids;
    if (!PyArg_ParseTuple(args, "OO:fill_int64", &dst_obj, &ids))
        return NULL;
    if (!PyList_Check(ids) && !PyTuple_Check(ids)) {
        PyErr_SetString(PyExc_TypeError, "fill_int64: ids must be a list or a tuple");
        return NULL;
    }
    Py_buffer dst;
    if (PyObject_GetBuffer(dst_obj, &dst, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(ids);
    if (dst.len != n * (Py_ssize_t)sizeof(int64_t)) {
        PyBuffer_Release(&dst);
        PyErr_Format(PyExc_ValueError, "fill_int64: %zd ids need %zd bytes, the buffer holds %zd", n,
                     n * (Py_ssize_t)sizeof(int64_t), dst.len);
        return NULL;
    }
    /* NOTE: no Python code runs in this loop (only exact ints are read), so the list
     * cannot change under it and its item array stays valid. */
    PyObject **items = PySequence_Fast_ITEMS(ids);
    unsigned char *out = (unsigned char *)dst.buf;
    int ok = 1;
    Py_ssize_t i = 0;
    int64_t a, b;
#ifdef ONE_DIGIT_TEST
    /* four ids a step, one test for the four (the general one for each where it fails);
     * NOTE: the globals in locals: the stores through bytes would reload them every step */
    const __m128i want = one_digit;
    for (Py_ssize_t end = one_digit_on ? n - n % 4 : 0; i < end; i += 4) {
        PyObject *p0 = items[i], *p1 = items[i + 1], *p2 = items[i + 2], *p3 = items[i + 3];
        PREFETCH((const void *)((uintptr_t)p0 + PREFETCH_AHEAD_BYTES));
        PREFETCH((const void *)((uintptr_t)p2 + PREFETCH_AHEAD_BYTES));
        __m128i eq = _mm_and_si128(_mm_and_si128(one_digit_eq(p0, want), one_digit_eq(p1, want)),
                                   _mm_and_si128(one_digit_eq(p2, want), one_digit_eq(p3, want)));
        int64_t v[4];
        if (_mm_movemask_epi8(eq) == 0xFFFF) {
            v[0] = one_digit_value(p0), v[1] = one_digit_value(p1);
            v[2] = one_digit_value(p2), v[3] = one_digit_value(p3);
        } else if (!int64_of(p0, &v[0]) || !int64_of(p1, &v[1]) || !int64_of(p2, &v[2]) || !int64_of(p3, &v[3])) {
            ok = 0;
            break;
        }
        /* NOTE: every value read before the first store: a store through bytes may alias
         * the item array, and the compiler read the items again after each one */
        for (int j = 0; j < 4; j++)
            memcpy(out + (i + j) * (Py_ssize_t)sizeof(int64_t), &v[j], sizeof(v[j]));
    }
#endif
    /* two ids a step, one prefetch for both: the objects are 32 bytes */
    for (; ok && i + 2 <= n; i += 2) {
        PREFETCH((const void *)((uintptr_t)items[i] + PREFETCH_AHEAD_BYTES)); /* never faults */
        if (!int64_of(items[i], &a) || !int64_of(items[i + 1], &b)) {
            ok = 0;
            break;
        }
        memcpy(out + i * (Py_ssize_t)sizeof(int64_t), &a, sizeof(a));
        memcpy(out + (i + 1) * (Py_ssize_t)sizeof(int64_t), &b, sizeof(b));
    }
    if (ok && i < n) {
        ok = int64_of(items[i], &a);
        if (ok)
            memcpy(out + i * (Py_ssize_t)sizeof(int64_t), &a, sizeof(a));
    }
    PyBuffer_Release(&dst);
    if (ok)
        Py_RETURN_TRUE;
    Py_RETURN_FALSE;
}

/* The attribute names walk_run reads and writes, interned once at import. */
static PyObject *s_children, *s_key, *s_last_access, *s_collisions, *s_device, *s_pages, *s_base, *s_at;

/* ``node``'s child keyed by the int ``id`` (a new reference), or NULL: with an error set
 * where the lookup failed, without one where there is no such child. */
static PyObject *child_of(PyObject *node, int64_t id) {
    PyObject *children = PyObject_GetAttr(node, s_children);
    if (children == NULL)
        return NULL;
    if (!PyDict_CheckExact(children)) {
        Py_DECREF(children);
        PyErr_SetString(PyExc_TypeError, "walk_run: a node's children must be a dict");
        return NULL;
    }
    PyObject *key = PyLong_FromLongLong((long long)id);
    if (key == NULL) {
        Py_DECREF(children);
        return NULL;
    }
    PyObject *child = PyDict_GetItemWithError(children, key);
    Py_XINCREF(child);
    Py_DECREF(key);
    Py_DECREF(children);
    return child;
}

/* Whether ``child``'s key is ``tok[pos:pos + len(key)]`` with that run ending by
 * ``usable``; its length to ``*len``. -1 with an error set where the key is not an
 * int64 buffer. */
static int key_matches(PyObject *child, const int64_t *tok, Py_ssize_t pos, Py_ssize_t usable, Py_ssize_t *len) {
    PyObject *key = PyObject_GetAttr(child, s_key);
    if (key == NULL)
        return -1;
    Py_buffer kb;
    if (PyObject_GetBuffer(key, &kb, PyBUF_C_CONTIGUOUS) < 0) {
        Py_DECREF(key);
        return -1;
    }
    int same = -1;
    if (kb.itemsize != 8) {
        PyErr_SetString(PyExc_TypeError, "walk_run: a node's key must be an int64 buffer");
    } else {
        *len = kb.len / 8;
        same = *len <= usable - pos && memcmp(tok + pos, kb.buf, (size_t)kb.len) == 0;
    }
    PyBuffer_Release(&kb);
    Py_DECREF(key);
    return same;
}

/* walk_run's loop from ``*node`` (a reference the caller owns, replaced as the walk
 * goes) at ``tok[*pos]``: 1 where it stopped at a child keyed by ``tok[*pos]`` whose key
 * did not match, else 0 (at ``usable``, or no such child), with an error set where one
 * stopped it.
 *
 * NOTE: the caller holds the tokens' buffer (an array cannot resize meanwhile), and
 * nothing here runs Python code: slot attributes, int keys and dict lookups are all C. */
static int run(PyObject **node, const int64_t *tok, Py_ssize_t *pos, Py_ssize_t *inner, Py_ssize_t usable,
               PyObject *path, PyObject *stamp) {
    while (*pos < usable) {
        PyObject *child = child_of(*node, tok[*pos]);
        if (child == NULL)
            return 0;
        Py_ssize_t len = 0;
        int same = key_matches(child, tok, *pos, usable, &len);
        if (same == 1 && PyList_Append(path, child) < 0)
            same = -1;
        if (same == 1 && stamp != Py_None && PyObject_SetAttr(child, s_last_access, stamp) < 0)
            same = -1;
        if (same != 1) {
            Py_DECREF(child);
            return 1;
        }
        *pos += len;
        *inner = len;
        Py_SETREF(*node, child);
    }
    return 0;
}

PyDoc_STRVAR(walk_run_doc,
"walk_run(node, tokens, pos, inner, usable, path, stamp) -> (pos, inner, node)\n\n"
"The radix walk's common steps, from ``node`` at ``tokens[pos]``: while ``pos <\n"
"usable``, take the child keyed by the int ``tokens[pos]`` and, where its whole key is\n"
"``tokens[pos:pos + len(key)]`` within ``usable``, append it to ``path`` (a list), set\n"
"its ``last_access`` to ``stamp`` unless that is None, and go on from it. Returns\n"
"where it stopped: the position, the length of the last key matched (``inner`` when\n"
"none was) and that node. ``tokens`` and every key are int64 buffers (``array('q')``),\n"
"compared in place.");

static PyObject *walk_run(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "walk_run(node, tokens, pos, inner, usable, path, stamp) takes 7 arguments");
        return NULL;
    }
    PyObject *node = args[0], *path = args[5], *stamp = args[6];
    Py_ssize_t pos = PyLong_AsSsize_t(args[2]);
    Py_ssize_t inner = pos == -1 && PyErr_Occurred() ? -1 : PyLong_AsSsize_t(args[3]);
    Py_ssize_t usable = inner == -1 && PyErr_Occurred() ? -1 : PyLong_AsSsize_t(args[4]);
    if (usable == -1 && PyErr_Occurred())
        return NULL;
    if (!PyList_Check(path)) {
        PyErr_SetString(PyExc_TypeError, "walk_run: path must be a list");
        return NULL;
    }
    Py_buffer tb;
    if (PyObject_GetBuffer(args[1], &tb, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (tb.itemsize != 8 || pos < 0 || usable < pos || usable > tb.len / 8) {
        PyBuffer_Release(&tb);
        PyErr_Format(PyExc_ValueError, "walk_run: tokens must be an int64 buffer with 0 <= pos <= usable <= its "
                     "%zd ids, got pos %zd and usable %zd", tb.len / (tb.itemsize ? tb.itemsize : 1), pos, usable);
        return NULL;
    }
    Py_INCREF(node);
    (void)run(&node, (const int64_t *)tb.buf, &pos, &inner, usable, path, stamp);
    PyBuffer_Release(&tb);
    if (PyErr_Occurred()) {
        Py_DECREF(node);
        return NULL;
    }
    return Py_BuildValue("(nnN)", pos, inner, node);
}

/* Whether the walk that stopped at ``node`` at ``pos`` with no child keyed by the
 * next id left to look at (run's 0) is over: at ``usable``, or with no collisions at
 * ``node`` (a child keyed by its first page, which the Python walk goes on with). -1
 * with an error set. */
static int walk_over(PyObject *node, Py_ssize_t pos, Py_ssize_t usable) {
    if (pos >= usable)
        return 1;
    PyObject *collisions = PyObject_GetAttr(node, s_collisions);
    if (collisions == NULL)
        return -1;
    int some = PyObject_IsTrue(collisions);
    Py_DECREF(collisions);
    return some < 0 ? -1 : !some;
}

/* An error set by reading what the path's nodes hold, as the callers below answer it:
 * 0 (cleared) where it was the wrong kind of thing (TypeError, BufferError: the Python
 * path is left to judge it), else -1 (kept). */
static int judged(void) {
    if (!PyErr_ExceptionMatches(PyExc_TypeError) && !PyErr_ExceptionMatches(PyExc_BufferError))
        return -1;
    PyErr_Clear();
    return 0;
}

/* The slots of pages ``obj[start:start + n]`` (``n < 0``: all of ``obj``) to ``o``,
 * which has room for ``room``: the slots written; 0 where ``obj`` is not a contiguous
 * int64 buffer or the range is not in it or not within ``room``; -1 with an error set. */
static Py_ssize_t expand_range(PyObject *obj, Py_ssize_t start, Py_ssize_t n, Py_ssize_t room, int64_t page_size,
                               int64_t *o) {
    Py_buffer view;
    if (get_int64s(obj, &view, 0, "a node's device pages") < 0)
        return judged();
    Py_ssize_t have = view.len / 8, written = 0;
    if (n < 0)
        n = have - start;
    if (start >= 0 && n > 0 && start <= have - n && n <= room / page_size) {
        expand_into(o, (const int64_t *)view.buf + start, n, page_size, 0);
        written = n * (Py_ssize_t)page_size;
    }
    PyBuffer_Release(&view);
    return written;
}

/* An int attribute of ``obj``: its value, or -1 (with an error set where it failed). */
static Py_ssize_t int_attr(PyObject *obj, PyObject *name) {
    PyObject *value = PyObject_GetAttr(obj, name);
    if (value == NULL)
        return -1;
    Py_ssize_t v = PyLong_AsSsize_t(value);
    Py_DECREF(value);
    return v;
}

/* Where the device copies ``first`` and ``last`` are views of one array (``base``), the
 * pages of the path from one to the other are that array's run between them (only a
 * split shares a base, and its pieces stay parent and child: CacheState._run_slots):
 * their slots to ``o`` as expand_range writes them. 0 where they are not one run. */
static Py_ssize_t run_slots(PyObject *first, PyObject *last, Py_ssize_t count, int64_t page_size, int64_t *o) {
    PyObject *base = PyObject_GetAttr(first, s_base), *other = base ? PyObject_GetAttr(last, s_base) : NULL;
    Py_ssize_t written = other == NULL ? -1 : 0;
    if (other != NULL && base == other) {
        PyObject *pages = PyObject_GetAttr(last, s_pages);
        Py_ssize_t from = int_attr(first, s_at), to = from < 0 ? -1 : int_attr(last, s_at);
        Py_ssize_t tail = to < 0 || pages == NULL ? -1 : PyObject_Size(pages);
        written = tail < 0 ? -1 : expand_range(base, from, to + tail - from, count, page_size, o);
        Py_XDECREF(pages);
    }
    Py_XDECREF(other);
    Py_XDECREF(base);
    return written < 0 && PyErr_Occurred() ? judged() : written < 0 ? 0 : written;
}

/* The device slots of every node of ``path`` (a non-empty list), ``count`` of them, in a
 * new slots_capsule: one run of one array where the first and last node's pages are
 * (run_slots), else node by node; None (no error) where a node is not on the device,
 * its pages are not a contiguous int64 buffer, or their slots are not its share of
 * ``count``: the caller's Python path then takes them its own way. NULL with an error
 * set. */
static PyObject *path_slots(PyObject *path, Py_ssize_t count, int64_t page_size) {
    Py_ssize_t nodes = PyList_GET_SIZE(path), filled = 0, got = 1;
    int64_t *o = NULL;
    PyObject *out = slots_capsule(count, &o);
    if (out == NULL)
        return NULL;
    PyObject *first = PyObject_GetAttr(PyList_GET_ITEM(path, 0), s_device);
    PyObject *last = first == NULL ? NULL : PyObject_GetAttr(PyList_GET_ITEM(path, nodes - 1), s_device);
    if (last == NULL)
        got = -1;
    else if (first == Py_None || last == Py_None)
        got = 0;
    else
        filled = got = run_slots(first, last, count, page_size, o);
    Py_XDECREF(first);
    Py_XDECREF(last);
    if (got == 0) { /* not one run: node by node (each held: reading an attribute may run Python) */
        got = 1;
        for (Py_ssize_t i = 0; got > 0 && i < nodes; i++) {
            PyObject *node = PyList_GET_ITEM(path, i);
            Py_INCREF(node);
            PyObject *device = PyObject_GetAttr(node, s_device);
            PyObject *pages = device == NULL || device == Py_None ? NULL : PyObject_GetAttr(device, s_pages);
            got = pages == NULL ? (PyErr_Occurred() ? -1 : 0)
                                : expand_range(pages, 0, -1, count - filled, page_size, o + filled);
            filled += got > 0 ? got : 0;
            Py_XDECREF(pages);
            Py_XDECREF(device);
            Py_DECREF(node);
        }
    }
    if (got > 0 && filled == count)
        return out;
    Py_DECREF(out);
    if (got < 0)
        return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(walk_slots_doc,
"walk_slots(node, tokens, usable, path, stamp, page_size) -> (pos, inner, node, slots)\n\n"
"walk_run from ``node`` at position 0 and, where the walk is over (at ``usable``, or\n"
"where no child is keyed by the next id and the node has no collisions) and every node\n"
"appended to ``path`` is on the device, their device slots, one node after another,\n"
"in a new DLPack capsule of int64 on the CPU (``page_size`` slots a page: ``pos`` of\n"
"them), which torch.utils.dlpack.from_dlpack makes a tensor of without a copy.\n"
"``slots`` is None otherwise: the caller's own walk goes on from ``(pos, inner,\n"
"node)``, or takes the slots its own way.");

static PyObject *walk_slots(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "walk_slots(node, tokens, usable, path, stamp, page_size) takes 6 arguments");
        return NULL;
    }
    PyObject *node = args[0], *path = args[3], *stamp = args[4];
    Py_ssize_t usable = PyLong_AsSsize_t(args[2]);
    long long page_size = usable == -1 && PyErr_Occurred() ? -1 : PyLong_AsLongLong(args[5]);
    if (page_size == -1 && PyErr_Occurred())
        return NULL;
    if (!PyList_Check(path) || PyList_GET_SIZE(path)) {
        PyErr_SetString(PyExc_TypeError, "walk_slots: path must be an empty list");
        return NULL;
    }
    Py_buffer tb;
    if (PyObject_GetBuffer(args[1], &tb, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (tb.itemsize != 8 || page_size < 1 || usable < 0 || usable > tb.len / 8) {
        PyBuffer_Release(&tb);
        PyErr_Format(PyExc_ValueError, "walk_slots: tokens must be an int64 buffer with 0 <= usable <= its %zd "
                     "ids and page_size at least 1, got usable %zd and page_size %lld",
                     tb.len / (tb.itemsize ? tb.itemsize : 1), usable, page_size);
        return NULL;
    }
    const int64_t *tok = (const int64_t *)tb.buf;
    Py_ssize_t pos = 0, inner = 0;
    PyObject *slots = NULL;
    Py_INCREF(node);
    /* a child the run could not take: the Python walk looks at it (a match in part) */
    int unmatched = run(&node, tok, &pos, &inner, usable, path, stamp);
    int over = PyErr_Occurred() ? -1 : PyList_GET_SIZE(path) && !unmatched ? walk_over(node, pos, usable) : 0;
    if (over == 1)
        slots = path_slots(path, pos, (int64_t)page_size);
    else if (over == 0)
        slots = Py_NewRef(Py_None);
    PyBuffer_Release(&tb);
    if (slots == NULL) {
        Py_DECREF(node);
        return NULL;
    }
    return Py_BuildValue("(nnNN)", pos, inner, node, slots);
}

static PyMethodDef methods[] = {
    {"fill_int64", fill_int64, METH_VARARGS, fill_int64_doc},
    {"walk_run", (PyCFunction)(void (*)(void))walk_run, METH_FASTCALL, walk_run_doc},
    {"walk_slots", (PyCFunction)(void (*)(void))walk_slots, METH_FASTCALL, walk_slots_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvtier.cache._tokens",
    "Token ids into int64 buffers, and the radix walk's common steps (optional; pure paths fall back).", -1,
    methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__tokens(void) {
    s_children = PyUnicode_InternFromString("children");
    s_key = PyUnicode_InternFromString("key");
    s_last_access = PyUnicode_InternFromString("last_access");
    s_collisions = PyUnicode_InternFromString("collisions");
    s_device = PyUnicode_InternFromString("device");
    s_pages = PyUnicode_InternFromString("pages");
    s_base = PyUnicode_InternFromString("base");
    s_at = PyUnicode_InternFromString("at");
    if (s_children == NULL || s_key == NULL || s_last_access == NULL || s_collisions == NULL || s_device == NULL ||
        s_pages == NULL || s_base == NULL || s_at == NULL)
        return NULL;
    int on = 0;
#ifdef ONE_DIGIT_TEST
    one_digit_setup();
    on = one_digit_on;
#endif
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "one_digit_test", on) < 0)
        Py_CLEAR(m);
    return m;
}
