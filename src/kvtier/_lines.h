/* Whole cache lines written with streaming stores, for kvtier's compiled copies.
 *
 * A plain store first reads the line it writes into the cache (read for ownership), a
 * third of a copy's memory traffic when the destination is not cached; a streaming
 * store writes the line without reading it. Used where a copy's destination is memory
 * the copy will not read back soon: a host pool's pages (kvtier.transfer._native, the
 * copy out of kvtier.storage._pageio's read staging).
 */
#ifndef KVTIER_LINES_H
#define KVTIER_LINES_H

#include <stddef.h>
#include <stdint.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define LINE 64

/* Whether n bytes at dst can be written as whole lines with streaming stores. */
static inline int lines_ok(const void *dst, size_t n) {
#if defined(__SSE2__)
    return ((uintptr_t)dst | n) % LINE == 0;
#else
    (void)dst, (void)n;
    return 0;
#endif
}

/* n bytes (whole lines at dst, as lines_ok) copied from src with streaming stores;
 * visible to other threads after lines_fence. */
static inline void copy_lines(char *dst, const char *src, size_t n) {
#if defined(__SSE2__)
    for (size_t k = 0; k < n; k += LINE) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + k));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + k + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + k + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + k + 48));
        _mm_stream_si128((__m128i *)(dst + k), a);
        _mm_stream_si128((__m128i *)(dst + k + 16), b);
        _mm_stream_si128((__m128i *)(dst + k + 32), c);
        _mm_stream_si128((__m128i *)(dst + k + 48), d);
    }
#else
    (void)dst, (void)src, (void)n;
#endif
}

/* The same copy a whole line per instruction (AVX-512) and half a line (AVX2), where the
 * compiler can build them for x86-64: LINES_WIDE is then defined, LINES_WIDE_TARGET and
 * LINES_HALF_TARGET mark a function that may use copy_lines_wide or copy_lines_half, and
 * lines_width() says which this CPU (and its OS) runs. Call each only from such a
 * function, and only where lines_width() is at least its width. A line written by one
 * streaming store leaves the write-combining buffer at once, where four 16-byte stores
 * hold it until the last: gathers that write short blocks far apart went faster with
 * each wider store (see _native.c). */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define LINES_WIDE 1
#define LINES_WIDE_TARGET __attribute__((target("avx512f")))
#define LINES_HALF_TARGET __attribute__((target("avx2")))

LINES_WIDE_TARGET __attribute__((always_inline)) static inline void copy_lines_wide(char *dst, const char *src,
                                                                                  size_t n) {
    for (size_t k = 0; k < n; k += LINE)
        _mm512_stream_si512((void *)(dst + k), _mm512_loadu_si512((const void *)(src + k)));
}

LINES_HALF_TARGET __attribute__((always_inline)) static inline void copy_lines_half(char *dst, const char *src,
                                                                                  size_t n) {
    for (size_t k = 0; k < n; k += LINE) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(src + k));
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + k + 32));
        _mm256_stream_si256((__m256i *)(dst + k), a);
        _mm256_stream_si256((__m256i *)(dst + k + 32), b);
    }
}

/* Bytes of the widest streaming store this CPU runs: 64 (AVX-512), 32 (AVX2) or 16. */
static inline int lines_width(void) {
    static int known; /* NOTE: a race here only repeats the same answer */
    if (!known) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx512f") ? 64 : __builtin_cpu_supports("avx2") ? 32 : 16;
    }
    return known;
}
#endif

/* Streaming stores are weakly ordered: this makes the ones before it visible first. */
static inline void lines_fence(void) {
#if defined(__SSE2__)
    _mm_sfence();
#endif
}

#endif
