/* Token slots of page numbers, shared by kvtier.pools._indices (the expansions) and
 * kvtier.cache._tokens (a full hit's slots, taken at the end of its walk), and the
 * DLPack capsule new slots leave in. */
#ifndef KVTIER_SLOTS_H
#define KVTIER_SLOTS_H

#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_lines.h"

/* ``obj``'s buffer, C-contiguous native int64 (writable where asked), into ``view``: 0,
 * or -1 with an error set (a TypeError naming ``what`` where it is not int64). */
static inline int get_int64s(PyObject *obj, Py_buffer *view, int writable, const char *what) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0)
        return -1;
    const char *f = view->format;
    if (view->itemsize != 8 || f == NULL || (strcmp(f, "q") && strcmp(f, "<q") && strcmp(f, "=q") &&
                                              strcmp(f, "l") && strcmp(f, "<l") && strcmp(f, "=l"))) {
        PyErr_Format(PyExc_TypeError, "%s must be a buffer of native int64, got format %s itemsize %zd", what,
                     f ? f : "B", view->itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* The token slots of ``n`` page numbers to ``dst``: page p becomes p * ps .. p * ps + ps - 1.
 * With ``holes``, a negative number (no page) leaves its ps slots as they are. The one
 * loop, which each build below inlines. */
#if defined(__GNUC__) || defined(__clang__)
#define SLOTS_INLINE __attribute__((always_inline)) static inline
#else
#define SLOTS_INLINE static inline
#endif

SLOTS_INLINE void expand_loop(int64_t *dst, const int64_t *pages, Py_ssize_t n, int64_t ps, int holes) {
    for (Py_ssize_t p = 0; p < n; p++, dst += ps) {
        if (holes && pages[p] < 0)
            continue;
        /* NOTE: unsigned, so no page number overflows into undefined behaviour */
        uint64_t first = (uint64_t)pages[p] * (uint64_t)ps;
        for (int64_t j = 0; j < ps; j++)
            dst[j] = (int64_t)(first + (uint64_t)j);
    }
}

/* NOTE: the loop built for AVX2 (32-byte stores), where the CPU has it (lines_width()
 * says so): a full hit's 8K slots (page 64) took 2.6 us with SSE2's 16-byte stores and
 * 1.1 with these (Zen 2) */
#ifdef LINES_WIDE
LINES_HALF_TARGET static void expand_avx2(int64_t *dst, const int64_t *pages, Py_ssize_t n, int64_t ps, int holes) {
    if (ps % 4) {
        expand_loop(dst, pages, n, ps, holes);
        return;
    }
    /* NOTE: four slots a store, written out: the compiler's loop for a page size known
     * only at run time set itself up for every page. A call expanding 8K slots took 2.1
     * us at page 16 and 1.9 at page 64 so, 1.6-1.8 and 1.3-1.8 this way (Zen 2, three
     * alternated pairs) */
    const __m256i iota = _mm256_set_epi64x(3, 2, 1, 0), four = _mm256_set1_epi64x(4);
    for (Py_ssize_t p = 0; p < n; p++, dst += ps) {
        if (holes && pages[p] < 0)
            continue;
        __m256i v = _mm256_add_epi64(_mm256_set1_epi64x((int64_t)((uint64_t)pages[p] * (uint64_t)ps)), iota);
        for (int64_t j = 0; j < ps; j += 4) {
            _mm256_storeu_si256((__m256i *)(dst + j), v);
            v = _mm256_add_epi64(v, four);
        }
    }
}
#endif

static inline void expand_into(int64_t *dst, const int64_t *pages, Py_ssize_t n, int64_t ps, int holes) {
#ifdef LINES_WIDE
    if (lines_width() >= 32) {
        expand_avx2(dst, pages, n, ps, holes);
        return;
    }
#endif
    expand_loop(dst, pages, n, ps, holes);
}

/* New slots leave the compiled parts as a DLPack capsule, which torch makes a tensor of
 * without a copy: DLPack's legacy (unversioned) structs, the ABI every torch since 1.x
 * reads. NOTE: through a bytearray and torch.frombuffer, making and freeing a full hit's
 * tensor took 0.7 us more (its buffer exported, then released through Python when freed);
 * through numpy.empty and torch.from_numpy, 1.0 us more (8K slots, Zen 2). */
typedef struct { int32_t device_type, device_id; } DLDevice;
typedef struct { uint8_t code, bits; uint16_t lanes; } DLDataType;
typedef struct {
    void *data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape, *strides;
    uint64_t byte_offset;
} DLTensor;
typedef struct DLManagedTensor {
    DLTensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensor *);
} DLManagedTensor;

/* One block: the managed tensor, its shape and stride, then the slots. */
typedef struct {
    DLManagedTensor managed;
    int64_t shape, stride;
    int64_t data[];
} SlotsBlock;

/* NOTE: the raw allocator: no GIL needed (torch may free a tensor on any thread), and
 * tracemalloc sees it (the tests count what a hit leaves behind) */
static inline void slots_deleter(DLManagedTensor *managed) { PyMem_RawFree(managed); }

static inline void slots_capsule_gone(PyObject *capsule) {
    /* NOTE: a consumer that took the tensor renamed the capsule and frees it through the deleter */
    if (PyCapsule_IsValid(capsule, "dltensor")) {
        DLManagedTensor *managed = (DLManagedTensor *)PyCapsule_GetPointer(capsule, "dltensor");
        managed->deleter(managed);
    }
}

/* A DLPack capsule of ``count`` int64 on the CPU, its slots to ``*data``; NULL with an error set. */
static inline PyObject *slots_capsule(Py_ssize_t count, int64_t **data) {
    SlotsBlock *block = (SlotsBlock *)PyMem_RawMalloc(sizeof(SlotsBlock) + (size_t)count * sizeof(int64_t));
    if (block == NULL)
        return PyErr_NoMemory();
    memset(&block->managed, 0, sizeof(block->managed));
    block->shape = count;
    block->stride = 1;
    DLTensor *t = &block->managed.dl_tensor;
    t->data = block->data;
    t->device.device_type = 1; /* kDLCPU */
    t->ndim = 1;
    t->dtype.code = 0; /* kDLInt */
    t->dtype.bits = 64;
    t->dtype.lanes = 1;
    t->shape = &block->shape;
    t->strides = &block->stride;
    block->managed.deleter = slots_deleter;
    PyObject *capsule = PyCapsule_New(&block->managed, "dltensor", slots_capsule_gone);
    if (capsule == NULL) {
        PyMem_RawFree(block);
        return NULL;
    }
    *data = block->data;
    return capsule;
}

#endif
