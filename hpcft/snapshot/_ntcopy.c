/* hpcft's streaming-store copy kernel, built by `pip install` (setup.py) next to this file and loaded with
 * ctypes by hpcft/snapshot/ntcopy.py; not a Python module. Without it copies are libc's memcpy. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
__attribute__((target("avx2"))) static size_t stream_avx2(char *d, const char *s, size_t n) {
    size_t i = 0;
    for (; i + 128 <= n; i += 128) {
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
#endif

/* dst[0:n] = src[0:n]; streaming stores for all but the unaligned head and the tail (AVX2 CPUs, n >= 4 KiB). */
void hpcft_stream_copy(void *dst, const void *src, size_t n) {
    char *d = (char *)dst;
    const char *s = (const char *)src;
#if defined(__x86_64__)
    static int avx2 = -1;
    if (avx2 < 0) {
        __builtin_cpu_init();
        avx2 = __builtin_cpu_supports("avx2") ? 1 : 0;
    }
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
