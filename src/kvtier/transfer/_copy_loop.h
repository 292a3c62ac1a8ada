/* The compiled copy's loops (kvtier.transfer._native), included there once per kind of
 * streaming store. The includer defines LOOP(name), this inclusion's name for each
 * function; LOOP_ATTR, what marks them (a target the CPU must then have); and
 * LOOP_LINES, the copy of whole lines with streaming stores (_lines.h). Plan, Cursor,
 * the cursor functions, the prefetch macros and ALWAYS_INLINE come from the includer.
 */

LOOP_ATTR static ALWAYS_INLINE void LOOP(copy_block)(char *dst, const char *src, size_t block, int stream) {
    if (stream)
        LOOP_LINES(dst, src, block);
    else
        memcpy(dst, src, block);
}

/* A block longer than the lines prefetched ahead of it (PREFETCH_LINES): each line's
 * copy prefetches the line that far past it, so its reads stay ahead to the block's
 * end. The hardware's streamer alone fell behind: 128 KiB blocks at random places,
 * copied by two threads, went from 18.5 to 21.3 GB/s in a C harness (a burst of
 * prefetches per 4 KiB piece instead gained nothing). */
LOOP_ATTR static ALWAYS_INLINE void LOOP(copy_long_block)(char *dst, const char *src, size_t block, int stream) {
    const size_t ahead = PREFETCH_LINES * 64;
    size_t k = 0;
    for (; k + ahead < block; k += 64) {
        PREFETCH_READ(src + k + ahead);
        LOOP(copy_block)(dst + k, src + k, 64, stream);
    }
    LOOP(copy_block)(dst + k, src + k, block - k, stream);
}

LOOP_ATTR static ALWAYS_INLINE void LOOP(copy_all_sized)(const Plan *p, char *dst, const char *src, size_t block,
                                                       int stream) {
    Cursor cur, ahead;
    cursor_at_page(p, &cur, 0);
    cursor_at_page(p, &ahead, 0);
    size_t lines = (block + 63) / 64;
    if (lines > PREFETCH_LINES)
        lines = PREFETCH_LINES;
    size_t blocks_ahead = (block <= SHORT_BLOCK ? AHEAD_SHORT_BYTES : AHEAD_BYTES) / (lines * 64);
    if (blocks_ahead < 1)
        blocks_ahead = 1;
    for (size_t k = 0; k < blocks_ahead && ahead.page < p->pages; k++) {
        for (size_t l = 0; l < lines; l++)
            PREFETCH_READ(src + ahead.src + 64 * l);
        cursor_next(p, &ahead);
    }
    while (cur.page < p->pages) {
        if (ahead.page < p->pages) {
            for (size_t l = 0; l < lines; l++)
                PREFETCH_READ(src + ahead.src + 64 * l);
            if (!stream)
                PREFETCH_WRITE(dst + ahead.dst);
            cursor_next(p, &ahead);
        }
        if (block > PREFETCH_LINES * 64)
            LOOP(copy_long_block)(dst + cur.dst, src + cur.src, block, stream);
        else
            LOOP(copy_block)(dst + cur.dst, src + cur.src, block, stream);
        cursor_next(p, &cur);
    }
    if (stream)
        lines_fence(); /* make the streaming stores visible before returning */
}

/* NOTE: copy_all_sized compiled once per common block size (a head's dims at 2 bytes:
 * 64 to 512 dims), with the size and the store kind as constants: the copy and
 * prefetch loops unrolled, a page_head per-layer load ran much faster than through the
 * one loop for any size (256-byte blocks 8 KiB apart, the same code compiled both
 * ways). Other sizes take that generic loop. */
#define LOOP_SIZED(n)                                     \
    case n:                                               \
        if (stream)                                       \
            LOOP(copy_all_sized)(p, dst, src, n, 1);      \
        else                                              \
            LOOP(copy_all_sized)(p, dst, src, n, 0);      \
        return;

LOOP_ATTR static void LOOP(copy_all)(const Plan *p, char *dst, const char *src, size_t block, int stream) {
    switch (block) {
        LOOP_SIZED(128)
        LOOP_SIZED(256)
        LOOP_SIZED(384)
        LOOP_SIZED(512)
        LOOP_SIZED(768)
        LOOP_SIZED(1024)
    default:
        LOOP(copy_all_sized)(p, dst, src, block, stream);
    }
}

#undef LOOP_SIZED
