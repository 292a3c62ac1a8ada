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

/* Streaming stores are weakly ordered: this makes the ones before it visible first. */
static inline void lines_fence(void) {
#if defined(__SSE2__)
    _mm_sfence();
#endif
}

#endif
