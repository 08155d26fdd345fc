/* What the attention kernels (tierkv_attn.c, tierkv_rest.c, tierkv_scores.c) share: the dtype codes of
 * tierkv.attention.host_kernel, their exact widening to fp32, the source-hash default and GCC's x86 function
 * multi-versioning. The loaders' source digest covers this header (tierkv.cbuild.source_bytes, setup.py), so a
 * change here rebuilds every kernel that includes it. */
#ifndef TIERKV_KERNEL_H
#define TIERKV_KERNEL_H

#include <stdint.h>
#include <string.h>

#ifndef TKV_SOURCE_SHA
#define TKV_SOURCE_SHA ""
#endif

enum { TKV_F32 = 0, TKV_F16 = 1, TKV_BF16 = 2 };

/* The x86 builds carry an AVX-512 and an AVX2 version of a hot function, picked at load time (GCC's function
 * multi-versioning); elsewhere, the portable build. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define TKV_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define TKV_CLONES
#endif

/* The helpers below are always inlined: a plain `static inline` called from a multi-versioned function was compiled
 * once, out of line, for the baseline target (GCC does not inline it across the clones' targets), so each widened
 * element or softmax weight cost a call and the loops around them stayed scalar. */
#if defined(__GNUC__)
#define TKV_INLINE static inline __attribute__((always_inline))
#else
#define TKV_INLINE static inline
#endif

TKV_INLINE float bits_to_float(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

TKV_INLINE uint32_t float_to_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* IEEE half -> float, exact, without branches the compiler cannot turn into selects (vectorises). */
TKV_INLINE float half_to_float(uint16_t h) {
    uint32_t em = h & 0x7fffu;
    uint32_t bits = (em << 13) + (112u << 23);         /* rebias the exponent 15 -> 127 */
    bits = em >= 0x7c00u ? bits + (112u << 23) : bits; /* inf / nan keep an all-ones exponent */
    float f = bits_to_float(bits);
    f = em < 0x0400u ? (float)em * 5.9604644775390625e-8f : f; /* zero and subnormals: em * 2^-24 */
    return bits_to_float(float_to_bits(f) | ((uint32_t)(h & 0x8000u) << 16));
}

/* `n` elements of `dtype` at `src` as fp32 into `dst` (exact: every format here widens to fp32). */
TKV_INLINE void widen(const void *src, int64_t dtype, int64_t n, float *restrict dst) {
    if (dtype == TKV_F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
    } else if (dtype == TKV_BF16) {
        const uint16_t *h = (const uint16_t *)src;
        for (int64_t i = 0; i < n; i++) dst[i] = bits_to_float((uint32_t)h[i] << 16);
    } else {
        const uint16_t *h = (const uint16_t *)src;
        for (int64_t i = 0; i < n; i++) dst[i] = half_to_float(h[i]);
    }
}

#endif
