/* hpcft's copy kernels, built by `pip install` (setup.py) next to this file and loaded with ctypes by
 * hpcft/store/ntcopy.py; not a Python module. Without them copies are libc's memcpy and checksums the crc32c
 * package's, in a second pass.
 *
 * hpcft_stream_copy: a copy with streaming stores (AVX2).
 * hpcft_stream_copy_crc32c: that copy, then the crc32c of the source from cache (the `stream` kernel).
 * hpcft_copy_crc32c: the same copy with the crc32c of the source taken in the same pass (SSE4.2 crc32 + AVX2): the
 * checksum of a copied chunk costs no second read. Four crc streams run side by side over four equal lanes of a
 * block (the crc32 instruction's latency is three times its throughput, and a fourth stream of reads keeps more
 * of them in flight: 4 lanes copied 22.7 GB/s with 2 threads where 3 lanes did 20.7, on a 2-core Xeon VM whose
 * glibc memcpy did 23.4); each 64-byte line is checksummed from its load and stored from L1 right after, so the
 * reads from memory and the streaming writes overlap. The lanes' crcs are joined by multiplying by
 * x^(8 * lane bytes) mod P, a table lookup per byte of the crc. Lanes of 32 KiB keep each lane inside long runs of
 * pages for the prefetchers (4 KiB lanes ran at 0.6x the 32 KiB lanes' speed here), 4 KiB and 256 bytes take what
 * is left of a chunk. Both copies ask for the source PREFETCH bytes ahead of the line they copy (+8 % fused, +20 %
 * for the plain streaming copy, same VM): the hardware prefetchers stop at page boundaries, the loop does not.
 *
 * hpcft_copy_chunks: a whole snapshot's or restore's chunks, one call a worker; hpcft_populate: a fresh mapping's
 * pages mapped in bulk by several threads together (each at its definition). */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>

#define PREFETCH 256 /* bytes ahead of the line being copied (256-1024 were alike; 128 slower) */

__attribute__((target("avx2"))) static size_t stream_avx2(char *d, const char *s, size_t n) {
    size_t i = 0;
    for (; i + 128 <= n; i += 128) {
        _mm_prefetch(s + i + PREFETCH, _MM_HINT_T0);
        _mm_prefetch(s + i + PREFETCH + 64, _MM_HINT_T0);
        __m256i a = _mm256_loadu_si256((const __m256i *)(s + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(s + i + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(s + i + 64));
        __m256i e = _mm256_loadu_si256((const __m256i *)(s + i + 96));
        _mm256_stream_si256((__m256i *)(d + i), a);
        _mm256_stream_si256((__m256i *)(d + i + 32), b);
        _mm256_stream_si256((__m256i *)(d + i + 64), c);
        _mm256_stream_si256((__m256i *)(d + i + 96), e);
    }
    return i;
}

static int avx2 = -1, sse42 = -1;
static void detect(void) {
    if (avx2 < 0) {
        __builtin_cpu_init();
        sse42 = __builtin_cpu_supports("sse4.2") ? 1 : 0;
        avx2 = __builtin_cpu_supports("avx2") ? 1 : 0;
    }
}
#endif

/* dst[0:n] = src[0:n]; streaming stores for all but the unaligned head and the tail (AVX2 CPUs, n >= 4 KiB). */
void hpcft_stream_copy(void *dst, const void *src, size_t n) {
    char *d = (char *)dst;
    const char *s = (const char *)src;
#if defined(__x86_64__)
    detect();
    if (avx2 && n >= 4096) {
        size_t head = (32 - ((uintptr_t)d & 31)) & 31;
        memcpy(d, s, head);
        d += head; s += head; n -= head;
        size_t done = stream_avx2(d, s, n);
        _mm_sfence();
        d += done; s += done; n -= done;
    }
#endif
    memcpy(d, s, n);
}

/* 1 where hpcft_copy_crc32c runs on this CPU (x86-64 with SSE4.2 and AVX2), else 0: then it must not be called. */
int hpcft_copy_crc32c_supported(void) {
#if defined(__x86_64__)
    detect();
    return sse42 && avx2;
#else
    return 0;
#endif
}

#if defined(__x86_64__)
#define POLY 0x82f63b78u /* crc32c (Castagnoli), bit-reflected */

/* a * b mod P in the reflected representation (x^0 is the top bit). */
static uint32_t multmodp(uint32_t a, uint32_t b) {
    uint32_t m = 1u << 31, p = 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0) break;
        }
        m >>= 1;
        b = b & 1 ? (b >> 1) ^ POLY : b >> 1;
    }
    return p;
}

typedef struct { uint32_t t[4][256]; } shift_table;
static const size_t LANES[3] = {32768, 4096, 256};
static shift_table SHIFTS[3];
static volatile int tables_ready;

/* SHIFTS[i] multiplies a crc by x^(8 * LANES[i]) mod P, i.e. moves it past LANES[i] zero bytes. */
static void make_tables(void) {
    shift_table *t = SHIFTS;
    for (int l = 0; l < 3; l++, t++) {
        uint32_t k = 1u << 31;
        for (size_t i = 0; i < LANES[l]; i++) k = multmodp(1u << 23, k); /* times x^8 */
        for (int i = 0; i < 4; i++)
            for (uint32_t b = 0; b < 256; b++) t->t[i][b] = multmodp(k, b << (8 * i));
    }
    __atomic_store_n(&tables_ready, 1, __ATOMIC_RELEASE); /* racing first callers compute the same tables */
}

static inline uint32_t shifted(const shift_table *t, uint32_t c) {
    return t->t[0][c & 0xff] ^ t->t[1][(c >> 8) & 0xff] ^ t->t[2][(c >> 16) & 0xff] ^ t->t[3][c >> 24];
}

/* The running raw crc over n bytes, one lane (heads and tails). */
__attribute__((target("sse4.2"))) static uint32_t crc_small(const char *s, size_t n, uint32_t c) {
    uint64_t c64 = c;
    for (; n >= 8; n -= 8, s += 8) {
        uint64_t v;
        memcpy(&v, s, 8);
        c64 = _mm_crc32_u64(c64, v);
    }
    c = (uint32_t)c64;
    for (; n; n--, s++) c = _mm_crc32_u8(c, (uint8_t)*s);
    return c;
}

/* Plain copy of n bytes and the running raw crc over them. */
static uint32_t copy_crc_small(char *d, const char *s, size_t n, uint32_t c) {
    memcpy(d, s, n);
    return crc_small(s, n, c);
}

#define LINE(p, q, k) _mm256_stream_si256((__m256i *)(q + k), _mm256_loadu_si256((const __m256i *)(p + k)))
#define NLANES 4

/* Whole blocks of NLANES lanes of `lane` bytes; advances *d, *s, *n past them; the raw crc continued. With `store`
 * 0 only the checksum (d is not touched): inlined twice, once per value. */
__attribute__((target("sse4.2,avx2"), always_inline))
static inline uint32_t lanes(char **dp, const char **sp, size_t *np, uint32_t c, size_t lane, const shift_table *t,
                             const int store) {
    char *d = *dp;
    const char *s = *sp;
    size_t n = *np;
    for (; n >= NLANES * lane; s += NLANES * lane, d += NLANES * lane, n -= NLANES * lane) {
        uint64_t crc[NLANES] = {c};
        for (size_t i = 0; i < lane; i += 64) {
            for (int l = 0; l < NLANES; l++) {
                const char *p = s + l * lane + i;
                _mm_prefetch(p + PREFETCH, _MM_HINT_T0);
                for (int k = 0; k < 64; k += 8) {
                    uint64_t x;
                    memcpy(&x, p + k, 8);
                    crc[l] = _mm_crc32_u64(crc[l], x);
                }
            }
            if (store)
                for (int l = 0; l < NLANES; l++) {
                    const char *p = s + l * lane + i;
                    char *q = d + l * lane + i;
                    LINE(p, q, 0); LINE(p, q, 32);
                }
        }
        uint32_t joined = (uint32_t)crc[0];
        for (int l = 1; l < NLANES; l++) joined = shifted(t, joined) ^ (uint32_t)crc[l];
        c = joined;
    }
    *dp = d; *sp = s; *np = n;
    return c;
}

__attribute__((target("sse4.2,avx2")))
static uint32_t copy_crc_blocks(char **dp, const char **sp, size_t *np, uint32_t c, size_t lane, const shift_table *t) {
    return lanes(dp, sp, np, c, lane, t, 1);
}

__attribute__((target("sse4.2,avx2")))
static uint32_t crc_blocks(const char **sp, size_t *np, uint32_t c, size_t lane, const shift_table *t) {
    char *none = NULL;
    return lanes(&none, sp, np, c, lane, t, 0);
}
#endif

/* crc32c(src[0:n]) continuing `crc`: the checksum half of hpcft_copy_crc32c. Only where
 * hpcft_copy_crc32c_supported(). */
static uint32_t hpcft_crc32c(const void *src, size_t n, uint32_t crc) {
#if defined(__x86_64__)
    const char *s = (const char *)src;
    uint32_t c = ~crc;
    if (!__atomic_load_n(&tables_ready, __ATOMIC_ACQUIRE)) make_tables();
    for (int l = 0; l < 3; l++) c = crc_blocks(&s, &n, c, LANES[l], &SHIFTS[l]);
    return ~crc_small(s, n, c);
#else
    (void)src; (void)n;
    return crc;
#endif
}

/* The `stream` kernel: the streaming copy, then the crc32c of the source while it is still in cache, in one call.
 * Composed in Python (two ctypes calls and a closure per segment) it cost a 240 MB restore of ~1600 segments 5 ms
 * more than the fused kernel, which calibration (1 MiB chunks, a call each) never saw. Only where
 * hpcft_copy_crc32c_supported(). */
uint32_t hpcft_stream_copy_crc32c(void *dst, const void *src, size_t n, uint32_t crc) {
    hpcft_stream_copy(dst, src, n);
    return hpcft_crc32c(src, n, crc);
}

/* dst[0:n] = src[0:n] (streaming stores) and return crc32c(src[0:n]) continuing `crc` (the crc32c package's and
 * iSCSI's convention: crc32c(b, crc32c(a)) == crc32c(a + b)). Only where hpcft_copy_crc32c_supported(). */
uint32_t hpcft_copy_crc32c(void *dst, const void *src, size_t n, uint32_t crc) {
#if defined(__x86_64__)
    char *d = (char *)dst;
    const char *s = (const char *)src;
    uint32_t c = ~crc;
    if (!__atomic_load_n(&tables_ready, __ATOMIC_ACQUIRE)) make_tables();
    if (((uintptr_t)d - (uintptr_t)s) & 31) {
        /* source and destination lines do not line up: lines split between two source lines run at a third of
         * the speed here, so the streaming copy first and the checksum after, from cache */
        hpcft_stream_copy(d, s, n);
        return hpcft_crc32c(s, n, crc);
    }
    size_t head = (64 - ((uintptr_t)d & 63)) & 63; /* whole destination lines for the streaming stores */
    if (head > n) head = n;
    c = copy_crc_small(d, s, head, c);
    d += head; s += head; n -= head;
    for (int l = 0; l < 3; l++) c = copy_crc_blocks(&d, &s, &n, c, LANES[l], &SHIFTS[l]);
    _mm_sfence();
    return ~copy_crc_small(d, s, n, c);
#else
    (void)dst; (void)src; (void)n;
    return crc;
#endif
}

/* A worker's whole share of a snapshot's or a restore's chunks in one call, so that no Python runs (and no GIL is
 * taken) between chunks: each worker takes the next chunk from `*next` (shared by every worker; atomic), copies its
 * segments with the kernel `kind` (its index in ntcopy.KERNELS: 0 fused, 1 stream, 2 memcpy), checksums the
 * padding between and after them in the slot, and stores the chunk's crc32c in crcs[i], sealed with `key` where
 * `sealed` (hpcft.store.checksum.seal: the crc continued over key's 4 bytes, little-endian). Chunk i is the slot's
 * bytes [bounds[i], bounds[i + 1]) and its segments are first[i] .. first[i + 1] - 1: segment j is n[j] bytes at
 * slot + off[j] and at the address addr[j], copied into the slot (`to_slot`, a snapshot) or out of it (a restore).
 * Only where hpcft_copy_crc32c_supported(). */
void hpcft_copy_chunks(char *slot, const uint64_t *addr, const uint64_t *off, const uint64_t *n, const uint64_t *first,
                       const uint64_t *bounds, uint64_t count, uint64_t *next, uint32_t key, int sealed, uint32_t *crcs,
                       int kind, int to_slot) {
#if defined(__x86_64__)
    uint8_t k[4] = {key & 0xff, (key >> 8) & 0xff, (key >> 16) & 0xff, key >> 24};
    for (;;) {
        uint64_t i = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED);
        if (i >= count) return;
        uint64_t pos = bounds[i];
        uint32_t crc = 0;
        for (uint64_t j = first[i]; j < first[i + 1]; j++) {
            if (off[j] > pos) crc = hpcft_crc32c(slot + pos, off[j] - pos, crc);
            char *there = (char *)(uintptr_t)addr[j];
            char *d = to_slot ? slot + off[j] : there;
            const char *s = to_slot ? there : slot + off[j];
            if (kind == 0) {
                crc = hpcft_copy_crc32c(d, s, n[j], crc);
            } else if (kind == 1) {
                crc = hpcft_stream_copy_crc32c(d, s, n[j], crc);
            } else {
                memcpy(d, s, n[j]);
                crc = hpcft_crc32c(s, n[j], crc);
            }
            pos = off[j] + n[j];
        }
        if (bounds[i + 1] > pos) crc = hpcft_crc32c(slot + pos, bounds[i + 1] - pos, crc);
        crcs[i] = sealed ? hpcft_crc32c(k, 4, crc) : crc;
    }
#else
    (void)slot; (void)addr; (void)off; (void)n; (void)first; (void)bounds; (void)count; (void)next; (void)key;
    (void)sealed; (void)crcs; (void)kind; (void)to_slot;
#endif
}

/* hpcft_populate: map the pages of the `n` bytes at `base` (a shared file mapping) into the page table, `piece` bytes
 * per madvise(MADV_POPULATE_READ), for every thread that calls it on the same range: each takes the next piece from
 * `*next` (atomic) until none is left, counts each piece it finished in `*done` and each refused one in `*failed`.
 * The loop is here, not in Python, so a thread populating ahead of a restore needs no GIL between pieces (the
 * restore's Python set-up holds it for milliseconds at a time) and the thread that adopts the mapping can take
 * pieces beside it (hpcft.store.prefetch.Pieces). */
#if defined(__linux__)
#include <sys/mman.h>
#endif
#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif
void hpcft_populate(char *base, uint64_t n, uint64_t piece, uint64_t *next, uint64_t *done, uint64_t *failed) {
    for (;;) {
        uint64_t off = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED) * piece;
        if (off >= n) return;
        uint64_t len = n - off < piece ? n - off : piece;
#if defined(__linux__)
        if (madvise(base + off, len, MADV_POPULATE_READ) != 0) __atomic_fetch_add(failed, 1, __ATOMIC_RELAXED);
#else
        (void)len;
        __atomic_fetch_add(failed, 1, __ATOMIC_RELAXED);
#endif
        __atomic_fetch_add(done, 1, __ATOMIC_RELEASE);
    }
}
