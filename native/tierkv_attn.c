/* tierkv_attn.c: paged decode attention over a memory tier's slab, on the host's CPUs.
 *
 * The query attends the K/V blocks a block table names where they lie (no gather into a staging buffer),
 * and the result is a partial attention — the softmax-normalised output and the log-sum-exp of the scores per
 * (row, query head, query) — that merges exactly with the other tiers' parts (tierkv/attention/lse.py).
 * Driven through ctypes by tierkv/attention/host_kernel.py, which checks every argument; this file trusts them.
 *
 * Layout. A block is [2, kv_heads, block_tokens, head_dim] (K then V) of fp32, fp16 or bf16, in a slot of the
 * tier's slab, which may come in chunks (a growing pool): table[b * n_blocks + j] is a slot id counted on across
 * the chunks, each given as (address, slots, bytes from one slot to the next); a negative id means "no block" (a
 * row with fewer blocks than the widest). Addresses are resolved here, once per call.
 *
 * Entries. A table entry names entry_tokens tokens of its slot: all of them (entry_tokens == block_tokens, no
 * starts array), or, with starts, tokens starts[b][j] .. + entry_tokens - 1 of the slot (a page of a block that
 * sparse attention selected; starts[b][j] a multiple of entry_tokens below block_tokens). The slot keeps the
 * whole block's geometry: an entry's K of head h is entry_tokens rows inside that head's block_tokens rows.
 * Entry j of row b holds the keys at positions positions[b][j] .. + entry_tokens - 1 (j * entry_tokens without
 * a positions array: the entries concatenated in table order); keys at positions >= lengths[b] are not attended
 * (a partly filled last block or page), nor keys at negative positions (a span that starts inside its first
 * block).
 *
 * Which keys query i of row b attends (q = query_start[b] + i, the query's position):
 *   causal (query_start given): positions <= q, and > q - window when window > 0;
 *   mask (optional): an additive fp32 bias [mask batch, q_len, mask_len], column = position - mask_start;
 *     keys before mask_start are not attended. Scores are soft-capped (tanh(s / cap) * cap) before the bias,
 *     then clamped to -FLT_MAX, as the eager attention does, so a fully masked query stays finite.
 * A query that attends no key gets output 0 and log-sum-exp -inf (it merges as an empty part).
 *
 * Work. Memory-bound by design: every K/V byte is read once. A task owns one row, a range of kv heads and a
 * range of the row's blocks; each K (then V) row it reads serves all the queries of that head's GQA group
 * (g * q_len of them) while it is in registers or L1. Tasks walk their blocks in table order, the K of every
 * head of a block and then its V, so a run of consecutive slots is read as one sequential stream. Rows and key
 * ranges are split across OpenMP threads (split-K: a key range keeps a running max, sum and output per query;
 * the ranges of one row merge by log-sum-exp at the end), so two threads help even at batch 1 with one kv head;
 * small calls stay on one thread (THREAD_BYTES). Without OpenMP the same code runs on one thread.
 *
 * Code paths, the widest the CPU has chosen at run time (tkv_attn_isa(); a call may ask for a narrower one):
 * - AVX-512F (head_dim a multiple of 16): at a GQA group of 4 the kernel does 2 * 4 * head_dim fp32
 *   multiply-adds per key and head against 4 * head_dim bytes of fp16 K/V, about what one core's FMA units do
 *   in the time its memory delivers those bytes, so this path keeps the multiply-adds the only real work: each
 *   K/V vector is loaded and converted in registers once for all the queries it serves (tiles of 4 queries x 4
 *   keys, 2 x 8, 1 x 16 for the scores; 4 queries x half a row of V), 16 independent accumulators hide the FMA
 *   latency, the 16 dot products of a score tile are reduced together (15 adds, no horizontal sums), and the
 *   softmax runs once per block (the block's scores, one max and exp pass, then its V).
 * - AVX2+FMA+F16C (head_dim a multiple of 8): the same structure on 8 lanes and 16 registers: tiles of 4 queries
 *   x 3 keys for the scores, 4 queries x 24 columns of V, twelve independent accumulators (eight, one FMA each
 *   per step, ran the FMA units at ~60% on Zen 5, waiting on their latency).
 * - portable C: a block's rows are first converted into a small fp32 buffer (fp16 by bit operations).
 * fp16 converts with F16C's vcvtph2ps, bf16 with a shift. Software prefetch runs ahead in each K and V stream
 * (STREAM_AHEAD_512, STREAM_AHEAD_256), never past the bytes the call reads (a block's slot, a page's rows).
 */

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define TKV_X86 1
#else
#define TKV_X86 0
#endif

#include "tierkv_kernel.h"

enum { TKV_OK = 0, TKV_ENOMEM = -1, TKV_EINVAL = -2, TKV_ESLOT = -3 /* a slot id past the slab */,
       TKV_ESTART = -4 /* a start that is not a multiple of entry_tokens inside the block */ };
enum { TKV_PORTABLE = 0, TKV_AVX2 = 1, TKV_AVX512 = 2 }; /* the code paths, each needing the one before */

#define SPLIT_TOKENS 256 /* the fewest keys a split-K range covers: its merge must stay cheap beside its reads */
#define TASKS_PER_THREAD 4 /* dynamic scheduling evens out rows of unequal length */
#define TILE_TOKENS 32 /* V rows whose columns are swept together: 8 KiB of fp16 at head_dim 128, in L1 */
#define TILE_TOKENS_512 8 /* the same for the AVX-512 path, whose accumulators cover half a row: 8 ran ~15% faster
                           * than 32 on Zen 4 (16: ~8%) at 4 queries per kv head */
#define STREAM_AHEAD_256 4096 /* software prefetch distance in a K or V stream of the AVX2 path: the next 4 KiB
                              * page, which the hardware prefetchers do not cross into (without it 1 MiB blocks ran
                              * ~35% slower). Prefetches hold lines a stream has yet to use, so the distance is what
                              * the memory latency times the path's rate needs: longer ran 5-20% slower on Zen 5 */
#define STREAM_AHEAD_512 16384 /* the same for the AVX-512 path, about twice as fast per byte: 4 KiB ran 15-25%
                               * slower at 2-4 query heads per kv head over 8K-token layers on Zen 5 (one, over 64K
                               * tokens and DRAM-bound, ran ~5% faster) */
#define NEXT_BLOCK_BYTES (256 << 10) /* entries up to this size also fetch the next entry (table order) ahead */
#define THREAD_BYTES (1 << 20) /* K/V bytes that pay for one more thread (its wake-up and the merge) */

/* Mirrored by _ARGS in tierkv/attention/host_kernel.py (tkv_attn_args_size() guards the two), which packs the
 * struct and its chunks into one buffer. */
typedef struct {
    int64_t batch, q_heads, kv_heads, q_len, head_dim, block_tokens;
    int64_t entry_tokens;      /* tokens per table entry: block_tokens, or a divisor of it with starts */
    int64_t n_blocks;          /* table entries per row */
    int64_t dtype;
    int64_t window;
    int64_t mask_len, mask_start, mask_batch_stride;
    int64_t threads;
    int64_t isa;               /* the widest code path to use (TKV_PORTABLE..TKV_AVX512), -1: the best the CPU has */
    int64_t n_chunks;
    double scaling, softcap;
    const float *query;        /* [batch, q_heads, q_len, head_dim], contiguous */
    const int64_t *table;      /* [batch, n_blocks] slot ids, < 0: none */
    const int64_t *starts;     /* [batch, n_blocks] first token of each entry in its slot, or NULL (0) */
    const int64_t *positions;  /* [batch, n_blocks] or NULL */
    const int64_t *lengths;    /* [batch] */
    const int64_t *query_start;/* [batch] or NULL (not causal) */
    const float *mask;         /* [mask batch, q_len, mask_len] or NULL */
    float *out;                /* [batch, q_heads, q_len, head_dim] */
    float *lse;                /* [batch, q_heads, q_len] */
    float *entry_lse;          /* [batch, q_heads, q_len, n_blocks] or NULL: each entry's own log-sum-exp (its share
                                * of the softmax is exp(entry_lse - lse)); entries attending no key keep theirs */
    int64_t chunks[];          /* [n_chunks, 3] after the struct: address, slots, slot stride in bytes */
} tkv_attn_args;

const char *tkv_attn_source_sha(void) { return TKV_SOURCE_SHA; }

int64_t tkv_attn_args_size(void) { return (int64_t)sizeof(tkv_attn_args); }

static int best_isa(void);

/* The widest code path this CPU runs (TKV_PORTABLE, TKV_AVX2 or TKV_AVX512). */
int64_t tkv_attn_isa(void) { return best_isa(); }

/* Threads a call may use: OpenMP's default team size, 1 when built without OpenMP. */
int64_t tkv_attn_max_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

/* `n` elements at `src` as fp32: `src` itself for fp32, else widened into `buf`. */
TKV_INLINE const float *as_f32(const char *src, int64_t n, int dtype, float *buf) {
    if (dtype == TKV_F32) return (const float *)src;
    widen(src, dtype, n, buf);
    return buf;
}

/* Prefetch the `bytes` that lie `ahead` past `p` in a stream, those of them below `stop` (where the bytes the call
 * is known to read end): a stream never fetches past what it reads, e.g. into a block's unselected tokens after a
 * sparse page. */
static inline __attribute__((always_inline)) void prefetch_ahead(const char *p, int64_t bytes, int64_t ahead,
                                                                 const char *stop) {
    uintptr_t from = (uintptr_t)p + (uintptr_t)ahead, to = from + (uintptr_t)bytes;
    if (to > (uintptr_t)stop) to = (uintptr_t)stop;
    for (; from < to; from += 64) __builtin_prefetch((const char *)from, 0, 3);
}

/* ---- the two small matrix products of a block, tiled so that compilers vectorise them ---- */

#define LANES 16

/* sc[rr * n + t] = q[rr] . k[t] for `nr` (4 or 1) query rows: one K row load serves every query row. */
static inline __attribute__((always_inline)) void scores_tile(const float *q, const float *k, int64_t n, int64_t D,
                                                              float *sc, int nr) {
    for (int64_t t = 0; t < n; t++) {
        const float *kt = k + t * D;
        float acc[4][LANES] = {{0}};
        int64_t d = 0;
        for (; d + LANES <= D; d += LANES)
            for (int rr = 0; rr < nr; rr++)
                for (int l = 0; l < LANES; l++) acc[rr][l] += q[rr * D + d + l] * kt[d + l];
        for (int rr = 0; rr < nr; rr++) {
            float s = 0.0f;
            for (int64_t e = d; e < D; e++) s += q[rr * D + e] * kt[e];
            for (int l = 0; l < LANES; l++) s += acc[rr][l];
            sc[rr * n + t] = s;
        }
    }
}

/* out[rr] += sum_t w[rr * n + t] * v[t] for `nr` (4 or 1) query rows whose states (stride D + 2, output at +2)
 * start at `st`: the outputs of a slice of D stay in registers while the block's V rows stream past. */
static inline __attribute__((always_inline)) void accumulate_tile(float *st, const float *w, const float *v,
                                                                  int64_t n, int64_t D, int nr) {
    int64_t d = 0;
    for (; d + LANES <= D; d += LANES) {
        float acc[4][LANES];
        for (int rr = 0; rr < nr; rr++)
            for (int l = 0; l < LANES; l++) acc[rr][l] = st[rr * (D + 2) + 2 + d + l];
        for (int64_t t = 0; t < n; t++)
            for (int rr = 0; rr < nr; rr++) {
                const float wt = w[rr * n + t];
                for (int l = 0; l < LANES; l++) acc[rr][l] += wt * v[t * D + d + l];
            }
        for (int rr = 0; rr < nr; rr++)
            for (int l = 0; l < LANES; l++) st[rr * (D + 2) + 2 + d + l] = acc[rr][l];
    }
    for (int rr = 0; rr < nr; rr++)
        for (int64_t t = 0; t < n; t++)
            for (int64_t e = d; e < D; e++) st[rr * (D + 2) + 2 + e] += w[rr * n + t] * v[t * D + e];
}

/* ---- the same two products with AVX2+FMA+F16C intrinsics (x86-64; head_dim a multiple of 8), reading K and V
 * straight from the slab: each 8 elements are converted in registers as they are used ---- */

#if TKV_X86
#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define AVX2_INLINE __attribute__((target("avx2,fma,f16c"), always_inline)) static inline

AVX2_INLINE __m256 load8(const char *p, int dtype) {
    if (dtype == TKV_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    if (dtype == TKV_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
    return _mm256_loadu_ps((const float *)p);
}

AVX2_INLINE float hsum(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}

/* the four sums of a0..a3 */
AVX2_INLINE __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

AVX2_INLINE void scores_avx2_of(const float *q, const char *k, int64_t n, int64_t D, float *sc, int64_t rows,
                                int dtype, const char *stop) {
    const int64_t elt = dtype == TKV_F32 ? 4 : 2;
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) { /* four query rows x three keys: twelve independent FMA chains (eight kept the
                                     * FMA units ~60% busy, waiting on their latency) */
        const float *q0 = q + r * D, *q1 = q0 + D, *q2 = q1 + D, *q3 = q2 + D;
        int64_t t = 0;
        for (; t + 3 <= n; t += 3) {
            const char *ka = k + t * D * elt, *kb = ka + D * elt, *kc = kb + D * elt;
            prefetch_ahead(ka, 3 * D * elt, STREAM_AHEAD_256, stop);
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0, c0 = a0,
                   c1 = a0, c2 = a0, c3 = a0;
            for (int64_t d = 0; d < D; d += 8) {
                const __m256 x = load8(ka + d * elt, dtype), y = load8(kb + d * elt, dtype),
                             z = load8(kc + d * elt, dtype);
                __m256 p = _mm256_loadu_ps(q0 + d);
                a0 = _mm256_fmadd_ps(p, x, a0);
                b0 = _mm256_fmadd_ps(p, y, b0);
                c0 = _mm256_fmadd_ps(p, z, c0);
                p = _mm256_loadu_ps(q1 + d);
                a1 = _mm256_fmadd_ps(p, x, a1);
                b1 = _mm256_fmadd_ps(p, y, b1);
                c1 = _mm256_fmadd_ps(p, z, c1);
                p = _mm256_loadu_ps(q2 + d);
                a2 = _mm256_fmadd_ps(p, x, a2);
                b2 = _mm256_fmadd_ps(p, y, b2);
                c2 = _mm256_fmadd_ps(p, z, c2);
                p = _mm256_loadu_ps(q3 + d);
                a3 = _mm256_fmadd_ps(p, x, a3);
                b3 = _mm256_fmadd_ps(p, y, b3);
                c3 = _mm256_fmadd_ps(p, z, c3);
            }
            float sa[4], sb[4], sz[4];
            _mm_storeu_ps(sa, hsum4(a0, a1, a2, a3));
            _mm_storeu_ps(sb, hsum4(b0, b1, b2, b3));
            _mm_storeu_ps(sz, hsum4(c0, c1, c2, c3));
            for (int rr = 0; rr < 4; rr++) {
                sc[(r + rr) * n + t] = sa[rr];
                sc[(r + rr) * n + t + 1] = sb[rr];
                sc[(r + rr) * n + t + 2] = sz[rr];
            }
        }
        for (; t < n; t++) {
            const char *kt = k + t * D * elt;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t d = 0; d < D; d += 8) {
                const __m256 kv = load8(kt + d * elt, dtype);
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + d), kv, a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q1 + d), kv, a1);
                a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q2 + d), kv, a2);
                a3 = _mm256_fmadd_ps(_mm256_loadu_ps(q3 + d), kv, a3);
            }
            float s4[4];
            _mm_storeu_ps(s4, hsum4(a0, a1, a2, a3));
            for (int rr = 0; rr < 4; rr++) sc[(r + rr) * n + t] = s4[rr];
        }
    }
    for (; r < rows; r++) { /* one query row: four keys at a time */
        const float *qr = q + r * D;
        int64_t t = 0;
        for (; t + 4 <= n; t += 4) {
            const char *k0 = k + t * D * elt, *k1 = k0 + D * elt, *k2 = k1 + D * elt, *k3 = k2 + D * elt;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t d = 0; d < D; d += 8) {
                const __m256 p = _mm256_loadu_ps(qr + d);
                a0 = _mm256_fmadd_ps(p, load8(k0 + d * elt, dtype), a0);
                a1 = _mm256_fmadd_ps(p, load8(k1 + d * elt, dtype), a1);
                a2 = _mm256_fmadd_ps(p, load8(k2 + d * elt, dtype), a2);
                a3 = _mm256_fmadd_ps(p, load8(k3 + d * elt, dtype), a3);
            }
            _mm_storeu_ps(sc + r * n + t, hsum4(a0, a1, a2, a3));
        }
        for (; t < n; t++) {
            const char *kt = k + t * D * elt;
            __m256 a = _mm256_setzero_ps();
            for (int64_t d = 0; d < D; d += 8)
                a = _mm256_fmadd_ps(_mm256_loadu_ps(qr + d), load8(kt + d * elt, dtype), a);
            sc[r * n + t] = hsum(a);
        }
    }
}

/* `n` V rows; the weights of query row r are w[r * w_stride + t] */
AVX2_INLINE void accumulate_avx2_of(float *st, const float *w, const char *v, int64_t n, int64_t D, int64_t rows,
                                    int64_t w_stride, int dtype) {
    const int64_t elt = dtype == TKV_F32 ? 4 : 2, stride = D + 2;
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) { /* four query rows x 24 columns: twelve independent FMA chains, as for scores */
        float *o0 = st + r * stride + 2, *o1 = o0 + stride, *o2 = o1 + stride, *o3 = o2 + stride;
        const float *w0 = w + r * w_stride, *w1 = w0 + w_stride, *w2 = w1 + w_stride, *w3 = w2 + w_stride;
        int64_t d = 0;
        for (; d + 24 <= D; d += 24) {
            __m256 a0 = _mm256_loadu_ps(o0 + d), a1 = _mm256_loadu_ps(o1 + d), a2 = _mm256_loadu_ps(o2 + d),
                   a3 = _mm256_loadu_ps(o3 + d), b0 = _mm256_loadu_ps(o0 + d + 8), b1 = _mm256_loadu_ps(o1 + d + 8),
                   b2 = _mm256_loadu_ps(o2 + d + 8), b3 = _mm256_loadu_ps(o3 + d + 8),
                   c0 = _mm256_loadu_ps(o0 + d + 16), c1 = _mm256_loadu_ps(o1 + d + 16),
                   c2 = _mm256_loadu_ps(o2 + d + 16), c3 = _mm256_loadu_ps(o3 + d + 16);
            for (int64_t t = 0; t < n; t++) {
                const char *vt = v + (t * D + d) * elt;
                const __m256 x = load8(vt, dtype), y = load8(vt + 8 * elt, dtype), z = load8(vt + 16 * elt, dtype);
                __m256 c = _mm256_set1_ps(w0[t]);
                a0 = _mm256_fmadd_ps(c, x, a0);
                b0 = _mm256_fmadd_ps(c, y, b0);
                c0 = _mm256_fmadd_ps(c, z, c0);
                c = _mm256_set1_ps(w1[t]);
                a1 = _mm256_fmadd_ps(c, x, a1);
                b1 = _mm256_fmadd_ps(c, y, b1);
                c1 = _mm256_fmadd_ps(c, z, c1);
                c = _mm256_set1_ps(w2[t]);
                a2 = _mm256_fmadd_ps(c, x, a2);
                b2 = _mm256_fmadd_ps(c, y, b2);
                c2 = _mm256_fmadd_ps(c, z, c2);
                c = _mm256_set1_ps(w3[t]);
                a3 = _mm256_fmadd_ps(c, x, a3);
                b3 = _mm256_fmadd_ps(c, y, b3);
                c3 = _mm256_fmadd_ps(c, z, c3);
            }
            _mm256_storeu_ps(o0 + d, a0);
            _mm256_storeu_ps(o1 + d, a1);
            _mm256_storeu_ps(o2 + d, a2);
            _mm256_storeu_ps(o3 + d, a3);
            _mm256_storeu_ps(o0 + d + 8, b0);
            _mm256_storeu_ps(o1 + d + 8, b1);
            _mm256_storeu_ps(o2 + d + 8, b2);
            _mm256_storeu_ps(o3 + d + 8, b3);
            _mm256_storeu_ps(o0 + d + 16, c0);
            _mm256_storeu_ps(o1 + d + 16, c1);
            _mm256_storeu_ps(o2 + d + 16, c2);
            _mm256_storeu_ps(o3 + d + 16, c3);
        }
        for (; d + 16 <= D; d += 16) {
            __m256 a0 = _mm256_loadu_ps(o0 + d), a1 = _mm256_loadu_ps(o1 + d), a2 = _mm256_loadu_ps(o2 + d),
                   a3 = _mm256_loadu_ps(o3 + d), b0 = _mm256_loadu_ps(o0 + d + 8), b1 = _mm256_loadu_ps(o1 + d + 8),
                   b2 = _mm256_loadu_ps(o2 + d + 8), b3 = _mm256_loadu_ps(o3 + d + 8);
            for (int64_t t = 0; t < n; t++) {
                const char *vt = v + (t * D + d) * elt;
                const __m256 x = load8(vt, dtype), y = load8(vt + 8 * elt, dtype);
                __m256 c = _mm256_set1_ps(w0[t]);
                a0 = _mm256_fmadd_ps(c, x, a0);
                b0 = _mm256_fmadd_ps(c, y, b0);
                c = _mm256_set1_ps(w1[t]);
                a1 = _mm256_fmadd_ps(c, x, a1);
                b1 = _mm256_fmadd_ps(c, y, b1);
                c = _mm256_set1_ps(w2[t]);
                a2 = _mm256_fmadd_ps(c, x, a2);
                b2 = _mm256_fmadd_ps(c, y, b2);
                c = _mm256_set1_ps(w3[t]);
                a3 = _mm256_fmadd_ps(c, x, a3);
                b3 = _mm256_fmadd_ps(c, y, b3);
            }
            _mm256_storeu_ps(o0 + d, a0);
            _mm256_storeu_ps(o1 + d, a1);
            _mm256_storeu_ps(o2 + d, a2);
            _mm256_storeu_ps(o3 + d, a3);
            _mm256_storeu_ps(o0 + d + 8, b0);
            _mm256_storeu_ps(o1 + d + 8, b1);
            _mm256_storeu_ps(o2 + d + 8, b2);
            _mm256_storeu_ps(o3 + d + 8, b3);
        }
        for (; d < D; d += 8) {
            __m256 a0 = _mm256_loadu_ps(o0 + d), a1 = _mm256_loadu_ps(o1 + d), a2 = _mm256_loadu_ps(o2 + d),
                   a3 = _mm256_loadu_ps(o3 + d);
            for (int64_t t = 0; t < n; t++) {
                const __m256 x = load8(v + (t * D + d) * elt, dtype);
                a0 = _mm256_fmadd_ps(_mm256_set1_ps(w0[t]), x, a0);
                a1 = _mm256_fmadd_ps(_mm256_set1_ps(w1[t]), x, a1);
                a2 = _mm256_fmadd_ps(_mm256_set1_ps(w2[t]), x, a2);
                a3 = _mm256_fmadd_ps(_mm256_set1_ps(w3[t]), x, a3);
            }
            _mm256_storeu_ps(o0 + d, a0);
            _mm256_storeu_ps(o1 + d, a1);
            _mm256_storeu_ps(o2 + d, a2);
            _mm256_storeu_ps(o3 + d, a3);
        }
    }
    for (; r < rows; r++) { /* one query row: four keys in flight */
        float *o = st + r * stride + 2;
        const float *wr = w + r * w_stride;
        for (int64_t d = 0; d < D; d += 8) {
            __m256 a0 = _mm256_loadu_ps(o + d), a1 = _mm256_setzero_ps(), a2 = a1, a3 = a1;
            int64_t t = 0;
            for (; t + 4 <= n; t += 4) {
                const char *vt = v + (t * D + d) * elt;
                a0 = _mm256_fmadd_ps(_mm256_set1_ps(wr[t]), load8(vt, dtype), a0);
                a1 = _mm256_fmadd_ps(_mm256_set1_ps(wr[t + 1]), load8(vt + D * elt, dtype), a1);
                a2 = _mm256_fmadd_ps(_mm256_set1_ps(wr[t + 2]), load8(vt + 2 * D * elt, dtype), a2);
                a3 = _mm256_fmadd_ps(_mm256_set1_ps(wr[t + 3]), load8(vt + 3 * D * elt, dtype), a3);
            }
            for (; t < n; t++) a0 = _mm256_fmadd_ps(_mm256_set1_ps(wr[t]), load8(v + (t * D + d) * elt, dtype), a0);
            _mm256_storeu_ps(o + d, _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
        }
    }
}

/* exp of 8 floats (Cephes' expf: range reduction by ln 2, degree-5 polynomial; about 1 ulp), 0 below -87.3
 * (so excluded keys, at -inf, weigh exactly 0) */
AVX2_INLINE __m256 exp8(__m256 x) {
    const __m256 zero = _mm256_cmp_ps(x, _mm256_set1_ps(-87.33654f), _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.33654f)), _mm256_set1_ps(88.3762626647949f));
    const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(zero, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

/* the largest of `init` and w[0..n) */
AVX2 static float max_avx2(const float *w, int64_t n, float init) {
    __m256 m = _mm256_set1_ps(init);
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(w + t));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    float peak = _mm_cvtss_f32(h);
    for (; t < n; t++) peak = w[t] > peak ? w[t] : peak;
    return peak;
}

/* w <- exp(w - peak) for n scores; returns their sum */
AVX2 static float exp_sum_avx2(float *w, int64_t n, float peak) {
    const __m256 p = _mm256_set1_ps(peak);
    __m256 acc = _mm256_setzero_ps();
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(w + t), p));
        _mm256_storeu_ps(w + t, e);
        acc = _mm256_add_ps(acc, e);
    }
    float sum = hsum(acc);
    for (; t < n; t++) {
        w[t] = expf(w[t] - peak);
        sum += w[t];
    }
    return sum;
}

/* V rows in tiles of TILE_TOKENS, so that the passes over a tile's columns hit L1 */
AVX2_INLINE void accumulate_tiled_avx2_of(float *st, const float *w, const char *v, int64_t n, int64_t D,
                                          int64_t rows, int dtype, const char *stop) {
    const int64_t elt = dtype == TKV_F32 ? 4 : 2;
    for (int64_t t = 0; t < n; t += TILE_TOKENS) {
        const int64_t m = n - t < TILE_TOKENS ? n - t : TILE_TOKENS;
        prefetch_ahead(v + t * D * elt, m * D * elt, STREAM_AHEAD_256, stop);
        accumulate_avx2_of(st, w + t, v + t * D * elt, m, D, rows, n, dtype);
    }
}

/* one copy per dtype, the conversion chosen at compile time */
AVX2 static void scores_avx2(const float *q, const char *k, int64_t n, int64_t D, float *sc, int64_t rows, int dtype,
                             const char *stop) {
    if (dtype == TKV_F16) scores_avx2_of(q, k, n, D, sc, rows, TKV_F16, stop);
    else if (dtype == TKV_BF16) scores_avx2_of(q, k, n, D, sc, rows, TKV_BF16, stop);
    else scores_avx2_of(q, k, n, D, sc, rows, TKV_F32, stop);
}

AVX2 static void accumulate_avx2(float *st, const float *w, const char *v, int64_t n, int64_t D, int64_t rows,
                                 int dtype, const char *stop) {
    if (dtype == TKV_F16) accumulate_tiled_avx2_of(st, w, v, n, D, rows, TKV_F16, stop);
    else if (dtype == TKV_BF16) accumulate_tiled_avx2_of(st, w, v, n, D, rows, TKV_BF16, stop);
    else accumulate_tiled_avx2_of(st, w, v, n, D, rows, TKV_F32, stop);
}

/* ---- the same two products with AVX-512F (x86-64; head_dim a multiple of 16): see the top of the file ---- */

#define AVX512 __attribute__((target("avx512f")))
#define AVX512_INLINE __attribute__((target("avx512f"), always_inline)) static inline

AVX512_INLINE __m512 load16(const char *p, int dtype) {
    if (dtype == TKV_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    if (dtype == TKV_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)),
                                                     16));
    return _mm512_loadu_ps((const float *)p);
}

/* lane i of the result = the sum of the lanes of v[i] */
AVX512_INLINE __m512 reduce16(__m512 v[16]) {
    __m512 s1[8], s2[4], s3[2];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: partials of v[2i], v[2i+1], v[2i], v[2i+1] */
        s1[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) /* per 128-bit lane: partials of v[4i .. 4i+3] */
        s2[i] = _mm512_add_ps(_mm512_shuffle_ps(s1[2 * i], s1[2 * i + 1], 0x44),
                              _mm512_shuffle_ps(s1[2 * i], s1[2 * i + 1], 0xEE));
    for (int i = 0; i < 2; i++) /* two 128-bit lanes per group of four */
        s3[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s2[2 * i], s2[2 * i + 1], 0x44),
                              _mm512_shuffle_f32x4(s2[2 * i], s2[2 * i + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(s3[0], s3[1], 0x88), _mm512_shuffle_f32x4(s3[0], s3[1], 0xDD));
}

/* sc[r * n + t] for QB query rows x KB keys at a time (QB * KB == 16), then the keys left one at a time */
AVX512_INLINE void scores_qk_512(const float *q, const char *k, int64_t n, int64_t D, float *sc, int dtype, int QB,
                                 int KB, const char *stop) {
    const int64_t elt = dtype == TKV_F32 ? 4 : 2, row = D * elt;
    int64_t t = 0;
    for (; t + KB <= n; t += KB) {
        const char *kt = k + t * row;
        prefetch_ahead(kt, KB * row, STREAM_AHEAD_512, stop);
        __m512 acc[16];
        for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d += 16) {
            if (QB == 1) { /* each key vector serves one product: no need to hold 16 of them */
                const __m512 qv = _mm512_loadu_ps(q + d);
                for (int j = 0; j < KB; j++) acc[j] = _mm512_fmadd_ps(qv, load16(kt + j * row + d * elt, dtype), acc[j]);
                continue;
            }
            __m512 kv[16];
            for (int j = 0; j < KB; j++) kv[j] = load16(kt + j * row + d * elt, dtype);
            for (int r = 0; r < QB; r++) {
                const __m512 qv = _mm512_loadu_ps(q + r * D + d);
                for (int j = 0; j < KB; j++) acc[r * KB + j] = _mm512_fmadd_ps(qv, kv[j], acc[r * KB + j]);
            }
        }
        float s[16];
        _mm512_storeu_ps(s, reduce16(acc));
        for (int r = 0; r < QB; r++)
            for (int j = 0; j < KB; j++) sc[r * n + t + j] = s[r * KB + j];
    }
    for (; t < n; t++) {
        __m512 acc[4];
        for (int r = 0; r < QB; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d += 16) {
            const __m512 kv = load16(k + t * row + d * elt, dtype);
            for (int r = 0; r < QB; r++) acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(q + r * D + d), kv, acc[r]);
        }
        for (int r = 0; r < QB; r++) sc[r * n + t] = _mm512_reduce_add_ps(acc[r]);
    }
}

AVX512_INLINE void scores_avx512_of(const float *q, const char *k, int64_t n, int64_t D, float *sc, int64_t rows,
                                    int dtype, const char *stop) {
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) scores_qk_512(q + r * D, k, n, D, sc + r * n, dtype, 4, 4, stop);
    for (; r + 2 <= rows; r += 2) scores_qk_512(q + r * D, k, n, D, sc + r * n, dtype, 2, 8, stop);
    for (; r < rows; r++) scores_qk_512(q + r * D, k, n, D, sc + r * n, dtype, 1, 16, stop);
}

/* out[r] += sum_t w[r * w_stride + t] * v[t] for QB query rows over CH 16-column slices of D starting at d0:
 * QB * CH accumulators; one query row keeps two keys in flight instead */
AVX512_INLINE void accumulate_qv_512(float *st, const float *w, const char *v, int64_t n, int64_t D, int64_t d0,
                                     int64_t w_stride, int dtype, int QB, int CH) {
    const int64_t elt = dtype == TKV_F32 ? 4 : 2, stride = D + 2;
    __m512 acc[16], alt[8];
    for (int r = 0; r < QB; r++)
        for (int c = 0; c < CH; c++) acc[r * CH + c] = _mm512_loadu_ps(st + r * stride + 2 + d0 + 16 * c);
    int64_t t = 0;
    if (QB == 1) {
        for (int c = 0; c < CH; c++) alt[c] = _mm512_setzero_ps();
        for (; t + 2 <= n; t += 2) {
            const __m512 w0 = _mm512_set1_ps(w[t]), w1 = _mm512_set1_ps(w[t + 1]);
            for (int c = 0; c < CH; c++) {
                acc[c] = _mm512_fmadd_ps(w0, load16(v + (t * D + d0 + 16 * c) * elt, dtype), acc[c]);
                alt[c] = _mm512_fmadd_ps(w1, load16(v + ((t + 1) * D + d0 + 16 * c) * elt, dtype), alt[c]);
            }
        }
        for (int c = 0; c < CH; c++) acc[c] = _mm512_add_ps(acc[c], alt[c]);
    }
    for (; t < n; t++) {
        __m512 x[8];
        for (int c = 0; c < CH; c++) x[c] = load16(v + (t * D + d0 + 16 * c) * elt, dtype);
        for (int r = 0; r < QB; r++) {
            const __m512 wr = _mm512_set1_ps(w[r * w_stride + t]);
            for (int c = 0; c < CH; c++) acc[r * CH + c] = _mm512_fmadd_ps(wr, x[c], acc[r * CH + c]);
        }
    }
    for (int r = 0; r < QB; r++)
        for (int c = 0; c < CH; c++) _mm512_storeu_ps(st + r * stride + 2 + d0 + 16 * c, acc[r * CH + c]);
}

/* QB query rows over all of D: slices of CH columns while they last, then single slices */
AVX512_INLINE void accumulate_rows_512(float *st, const float *w, const char *v, int64_t n, int64_t D,
                                       int64_t w_stride, int dtype, int QB, int CH) {
    int64_t d = 0;
    for (; d + 16 * CH <= D; d += 16 * CH) accumulate_qv_512(st, w, v, n, D, d, w_stride, dtype, QB, CH);
    for (; d < D; d += 16) accumulate_qv_512(st, w, v, n, D, d, w_stride, dtype, QB, 1);
}

/* V rows in tiles of TILE_TOKENS_512 (in L1 while every slice of D and every query row passes over them) */
AVX512_INLINE void accumulate_avx512_of(float *st, const float *w, const char *v, int64_t n, int64_t D, int64_t rows,
                                        int dtype, const char *stop) {
    const int64_t elt = dtype == TKV_F32 ? 4 : 2, stride = D + 2;
    for (int64_t t = 0; t < n; t += TILE_TOKENS_512) {
        const int64_t m = n - t < TILE_TOKENS_512 ? n - t : TILE_TOKENS_512;
        const char *vt = v + t * D * elt;
        prefetch_ahead(vt, m * D * elt, STREAM_AHEAD_512, stop);
        int64_t r = 0;
        for (; r + 4 <= rows; r += 4) accumulate_rows_512(st + r * stride, w + r * n + t, vt, m, D, n, dtype, 4, 4);
        for (; r + 2 <= rows; r += 2) accumulate_rows_512(st + r * stride, w + r * n + t, vt, m, D, n, dtype, 2, 8);
        for (; r < rows; r++) accumulate_rows_512(st + r * stride, w + r * n + t, vt, m, D, n, dtype, 1, 8);
    }
}

/* exp8's polynomial on 16 lanes */
AVX512_INLINE __m512 exp16(__m512 x) {
    const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.33654f), _CMP_GE_OQ);
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.33654f)), _mm512_set1_ps(88.3762626647949f));
    const __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps(keep, y, _mm512_castsi512_ps(e));
}

AVX512 static float max_avx512(const float *w, int64_t n, float init) {
    __m512 m = _mm512_set1_ps(init);
    int64_t t = 0;
    for (; t + 16 <= n; t += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(w + t));
    if (t < n) m = _mm512_mask_max_ps(m, (__mmask16)((1u << (n - t)) - 1), m, _mm512_maskz_loadu_ps((__mmask16)((1u << (n - t)) - 1), w + t));
    return _mm512_reduce_max_ps(m);
}

AVX512 static float exp_sum_avx512(float *w, int64_t n, float peak) {
    const __m512 p = _mm512_set1_ps(peak);
    __m512 acc = _mm512_setzero_ps();
    int64_t t = 0;
    for (; t + 16 <= n; t += 16) {
        const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(w + t), p));
        _mm512_storeu_ps(w + t, e);
        acc = _mm512_add_ps(acc, e);
    }
    if (t < n) {
        const __mmask16 tail = (__mmask16)((1u << (n - t)) - 1);
        const __m512 e = _mm512_maskz_mov_ps(tail, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, w + t), p)));
        _mm512_mask_storeu_ps(w + t, tail, e);
        acc = _mm512_add_ps(acc, e);
    }
    return _mm512_reduce_add_ps(acc);
}

AVX512 static void scores_avx512(const float *q, const char *k, int64_t n, int64_t D, float *sc, int64_t rows,
                                 int dtype, const char *stop) {
    if (dtype == TKV_F16) scores_avx512_of(q, k, n, D, sc, rows, TKV_F16, stop);
    else if (dtype == TKV_BF16) scores_avx512_of(q, k, n, D, sc, rows, TKV_BF16, stop);
    else scores_avx512_of(q, k, n, D, sc, rows, TKV_F32, stop);
}

AVX512 static void accumulate_avx512(float *st, const float *w, const char *v, int64_t n, int64_t D, int64_t rows,
                                     int dtype, const char *stop) {
    if (dtype == TKV_F16) accumulate_avx512_of(st, w, v, n, D, rows, TKV_F16, stop);
    else if (dtype == TKV_BF16) accumulate_avx512_of(st, w, v, n, D, rows, TKV_BF16, stop);
    else accumulate_avx512_of(st, w, v, n, D, rows, TKV_F32, stop);
}

static float max_of(const float *w, int64_t n, float init, int simd) {
    if (simd == TKV_AVX512) return max_avx512(w, n, init);
    if (simd) return max_avx2(w, n, init);
    for (int64_t t = 0; t < n; t++) init = w[t] > init ? w[t] : init;
    return init;
}

static float exp_sum(float *w, int64_t n, float peak, int simd) {
    if (simd == TKV_AVX512) return exp_sum_avx512(w, n, peak);
    if (simd) return exp_sum_avx2(w, n, peak);
    float sum = 0.0f;
    for (int64_t t = 0; t < n; t++) {
        w[t] = expf(w[t] - peak);
        sum += w[t];
    }
    return sum;
}

static int best_isa(void) {
    __builtin_cpu_init();
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")))
        return TKV_PORTABLE;
    return __builtin_cpu_supports("avx512f") ? TKV_AVX512 : TKV_AVX2;
}
#else
static float max_of(const float *w, int64_t n, float init, int simd) {
    (void)simd;
    for (int64_t t = 0; t < n; t++) init = w[t] > init ? w[t] : init;
    return init;
}

static float exp_sum(float *w, int64_t n, float peak, int simd) {
    (void)simd;
    float sum = 0.0f;
    for (int64_t t = 0; t < n; t++) {
        w[t] = expf(w[t] - peak);
        sum += w[t];
    }
    return sum;
}

static int best_isa(void) { return TKV_PORTABLE; }
#endif

/* ---- one task: row b, kv heads [h0, h1), table entries [j0, j1) ---- */

/* State of one (kv head, query of its group): running max, sum of exp(score - max), output * sum. */
#define STATE(state, hh, r, D) ((state) + ((hh) * rows + (r)) * ((D) + 2))

/* whether any of n scores is NaN or +inf (a NaN or infinite key makes one), where softmax gives NaN: one compare a
 * score, beside the D FMAs that made it; max_ps and the exp's clamp would drop it */
static int any_nan(const float *w, int64_t n) {
    int nan = 0;
    for (int64_t t = 0; t < n; t++) nan |= isnan(w[t]) | (w[t] == INFINITY);
    return nan;
}

static void run_task(const tkv_attn_args *a, const uint64_t *blocks, int64_t b, int64_t h0, int64_t h1, int64_t j0, int64_t j1,
                     float *state, float *qbuf, float *kbuf, float *vbuf, float *sc, int simd) {
    const int64_t D = a->head_dim, bt = a->block_tokens, et = a->entry_tokens, q_len = a->q_len;
    const int64_t group = a->q_heads / a->kv_heads, rows = group * q_len;
    const int64_t elt = a->dtype == TKV_F32 ? 4 : 2;
    const int64_t value_offset = a->kv_heads * bt * D * elt; /* bytes from a block's K to its V */
    const int64_t length = a->lengths[b];
    const int causal = a->query_start != NULL;
    const int64_t qstart = causal ? a->query_start[b] : 0;
    const float softcap = (float)a->softcap;
    const float *mask = a->mask ? a->mask + b * a->mask_batch_stride : NULL;

    for (int64_t hh = 0; hh < h1 - h0; hh++) {
        const float *q = a->query + ((b * a->q_heads + (h0 + hh) * group) * q_len) * D;
        for (int64_t r = 0; r < rows; r++) {
            float *st = STATE(state, hh, r, D);
            st[0] = -INFINITY;
            st[1] = 0.0f;
            memset(st + 2, 0, (size_t)D * sizeof(float));
            for (int64_t d = 0; d < D; d++) qbuf[(hh * rows + r) * D + d] = q[r * D + d] * (float)a->scaling;
        }
    }
    /* the keys any query of this row may attend: [lo, hi) */
    int64_t lo = 0, hi = length;
    if (causal) {
        if (qstart + q_len < hi) hi = qstart + q_len;
        if (a->window > 0 && qstart - a->window + 1 > lo) lo = qstart - a->window + 1;
    }
    if (mask && a->mask_start > lo) lo = a->mask_start;

    for (int64_t j = j0; j < j1; j++) {
        const uint64_t addr = blocks[b * a->n_blocks + j];
        if (!addr) continue;
        const int64_t pos = a->positions ? a->positions[b * a->n_blocks + j] : j * et;
        const int64_t t_lo = lo > pos ? lo - pos : 0;
        const int64_t t_hi = hi - pos < et ? hi - pos : et;
        if (t_lo >= t_hi) continue;
        const int64_t n = t_hi - t_lo;
        /* K of every head of the block (one contiguous run), then V of every head (the next run): a run of
         * consecutive slots is one sequential stream. The next entry's bytes are fetched while this one is computed.
         * `block` is the entry's first attended K row of head 0; a head's rows lie block_tokens rows apart. */
        const char *next = j + 1 < j1 && 2 * a->kv_heads * et * D * elt <= NEXT_BLOCK_BYTES
                               ? (const char *)(uintptr_t)blocks[b * a->n_blocks + j + 1] : NULL;
        const int64_t head_bytes = bt * D * elt, entry_bytes = et * D * elt;
        const char *block = (const char *)(uintptr_t)addr + t_lo * D * elt;
        const int64_t p0 = pos + t_lo, p1 = pos + t_hi - 1; /* first and last key position */
        /* Where the K and V streams stop prefetching: a whole block's streams run on through its slot (the K of
         * every head, then the V) and, for a large entry whose successor is the next slot (past the slot's padding
         * to the 4 KiB I/O alignment), into the start of that one; a page's streams stop at its own rows. */
#if TKV_X86
        const char *slot_end = NULL;
        if (et == bt) {
            slot_end = (const char *)(uintptr_t)addr + 2 * a->kv_heads * head_bytes;
            const uint64_t following = j + 1 < j1 ? blocks[b * a->n_blocks + j + 1] : 0;
            if (!next && following >= (uintptr_t)slot_end && following - (uintptr_t)slot_end < 4096)
                slot_end = (const char *)(uintptr_t)following + STREAM_AHEAD_512;
        }
#endif
        const int plain = !mask && softcap <= 0.0f &&
                          (!causal || (p1 <= qstart && (a->window <= 0 || p0 > qstart + q_len - 1 - a->window)));
        for (int64_t hh = 0; hh < h1 - h0; hh++) {
            const char *kp = block + (h0 + hh) * head_bytes;
            if (next)
                for (int64_t off = (h0 + hh) * head_bytes; off < (h0 + hh) * head_bytes + entry_bytes; off += 64)
                    __builtin_prefetch(next + off, 0, 2);
            const float *qh = qbuf + hh * rows * D;
            float *sh = sc + hh * rows * n;
            int64_t r = 0;
#if TKV_X86
            const char *k_stop = slot_end ? slot_end : kp + n * D * elt;
            if (simd == TKV_AVX512) scores_avx512(qh, kp, n, D, sh, rows, (int)a->dtype, k_stop);
            else if (simd) scores_avx2(qh, kp, n, D, sh, rows, (int)a->dtype, k_stop);
#endif
            if (!simd) {
                const float *k = as_f32(kp, n * D, (int)a->dtype, kbuf);
                for (; r + 4 <= rows; r += 4) scores_tile(qh + r * D, k, n, D, sh + r * n, 4);
                for (; r < rows; r++) scores_tile(qh + r * D, k, n, D, sh + r * n, 1);
            }
            for (r = 0; r < rows && !plain; r++) { /* soft-cap, then the causal window or the mask */
                const int64_t i = r % q_len;
                for (int64_t t = 0; t < n; t++) {
                    float s = sh[r * n + t];
                    if (softcap > 0.0f) s = tanhf(s / softcap) * softcap;
                    const int64_t p = p0 + t;
                    if (causal && (p > qstart + i || (a->window > 0 && p <= qstart + i - a->window))) {
                        s = -INFINITY;
                    } else if (mask) {
                        s += mask[i * a->mask_len + (p - a->mask_start)];
                        if (s < -FLT_MAX) s = -FLT_MAX;
                    }
                    sh[r * n + t] = s;
                }
            }
            /* online softmax: rescale each query's state to the new running max, turn scores into weights */
            for (r = 0; r < rows; r++) {
                float *st = STATE(state, hh, r, D), *w = sh + r * n;
                if (isnan(st[0]) || any_nan(w, n)) { /* a NaN score (a NaN or infinite key): NaN, as softmax gives */
                    for (int64_t d = 0; d < D + 2; d++) st[d] = NAN;
                    for (int64_t t = 0; t < n; t++) w[t] = 0.0f;
                    if (a->entry_lse)
                        a->entry_lse[(((b * a->q_heads + (h0 + hh) * group + r / q_len) * q_len + r % q_len) *
                                      a->n_blocks) + j] = NAN;
                    continue;
                }
                const float peak = max_of(w, n, st[0], simd);
                if (peak == -INFINITY) { /* nothing attended yet */
                    for (int64_t t = 0; t < n; t++) w[t] = 0.0f;
                    continue;
                }
                if (peak > st[0]) {
                    const float scale = expf(st[0] - peak);
                    st[1] *= scale;
                    for (int64_t d = 0; d < D; d++) st[2 + d] *= scale;
                    st[0] = peak;
                }
                const float part = exp_sum(w, n, peak, simd);
                st[1] += part;
                if (a->entry_lse) /* query head (h0 + hh) * group + r / q_len, query r % q_len */
                    a->entry_lse[(((b * a->q_heads + (h0 + hh) * group + r / q_len) * q_len + r % q_len) *
                                  a->n_blocks) + j] = peak + logf(part);
            }
        }
        for (int64_t hh = 0; hh < h1 - h0; hh++) {
            const char *vp = block + value_offset + (h0 + hh) * head_bytes;
            if (next)
                for (int64_t off = (h0 + hh) * head_bytes; off < (h0 + hh) * head_bytes + entry_bytes; off += 64)
                    __builtin_prefetch(next + value_offset + off, 0, 2);
            const float *sh = sc + hh * rows * n;
#if TKV_X86
            const char *v_stop = slot_end ? slot_end : vp + n * D * elt;
            if (simd == TKV_AVX512)
                accumulate_avx512(STATE(state, hh, 0, D), sh, vp, n, D, rows, (int)a->dtype, v_stop);
            else if (simd) accumulate_avx2(STATE(state, hh, 0, D), sh, vp, n, D, rows, (int)a->dtype, v_stop);
#endif
            if (!simd) {
                const float *v = as_f32(vp, n * D, (int)a->dtype, vbuf);
                int64_t r = 0;
                for (; r + 4 <= rows; r += 4) accumulate_tile(STATE(state, hh, r, D), sh + r * n, v, n, D, 4);
                for (; r < rows; r++) accumulate_tile(STATE(state, hh, r, D), sh + r * n, v, n, D, 1);
            }
        }
    }
}

static int64_t ceil_div(int64_t x, int64_t y) { return (x + y - 1) / y; }

/* Each table entry's address: its slot's, plus its start's rows (0: no entry); TKV_ESLOT if one names a slot
 * past the slab, TKV_ESTART if a start is not a multiple of entry_tokens inside the block. */
static int resolve(const tkv_attn_args *a, uint64_t *blocks) {
    const int64_t row_bytes = a->head_dim * (a->dtype == TKV_F32 ? 4 : 2);
    for (int64_t i = 0; i < a->batch * a->n_blocks; i++) {
        int64_t slot = a->table[i], c = 0;
        blocks[i] = 0;
        if (slot < 0) continue;
        while (c < a->n_chunks && slot >= a->chunks[3 * c + 1]) slot -= a->chunks[3 * c + 1], c++;
        if (c == a->n_chunks) return TKV_ESLOT;
        const int64_t start = a->starts ? a->starts[i] : 0;
        if (start < 0 || start >= a->block_tokens || start % a->entry_tokens) return TKV_ESTART;
        blocks[i] = (uint64_t)a->chunks[3 * c] + (uint64_t)slot * (uint64_t)a->chunks[3 * c + 2] +
                    (uint64_t)(start * row_bytes);
    }
    return TKV_OK;
}

/* Attend; 0, or TKV_ENOMEM / TKV_EINVAL / TKV_ESLOT / TKV_ESTART. */
int tkv_attn(const tkv_attn_args *a) {
    if (a->batch <= 0 || a->kv_heads <= 0 || a->q_heads % a->kv_heads || a->q_len <= 0 || a->head_dim <= 0 ||
        a->block_tokens <= 0 || a->entry_tokens <= 0 || a->block_tokens % a->entry_tokens || a->n_blocks < 0 ||
        a->dtype < TKV_F32 || a->dtype > TKV_BF16)
        return TKV_EINVAL;
    const int64_t D = a->head_dim, B = a->batch, H = a->kv_heads, rows = a->q_heads / H * a->q_len;
    /* a thread per THREAD_BYTES of K/V at most: waking a team costs more than a small layer's attention */
    const int64_t elt = a->dtype == TKV_F32 ? 4 : 2;
    const int64_t kv_bytes = B * a->n_blocks * 2 * H * a->entry_tokens * D * elt;
    int64_t threads = a->threads > 0 ? a->threads : 1;
    if (threads > kv_bytes / THREAD_BYTES) threads = kv_bytes / THREAD_BYTES > 1 ? kv_bytes / THREAD_BYTES : 1;
    /* work units: key ranges first (they keep each slot's bytes one stream), then kv head groups */
    const int64_t want = threads * TASKS_PER_THREAD;
    int64_t splits = ceil_div(want, B);
    const int64_t by_size = ceil_div(a->n_blocks * a->entry_tokens, SPLIT_TOKENS);
    if (splits > by_size) splits = by_size;
    if (splits > a->n_blocks) splits = a->n_blocks;
    if (splits < 1) splits = 1;
    int64_t head_groups = ceil_div(want, B * splits);
    if (head_groups > H) head_groups = H;
    if (threads == 1) head_groups = 1; /* one thread: fewest, longest streams */
    const int64_t tasks = B * head_groups * splits;
    const int64_t state_per_head = rows * (D + 2);
    /* states: [B, H, splits, rows, D + 2] */
    float *states = malloc((size_t)(B * H * splits * state_per_head) * sizeof(float));
    uint64_t *blocks = malloc((size_t)(B * a->n_blocks + 1) * sizeof(uint64_t));
    if (!states || !blocks) {
        free(states);
        free(blocks);
        return TKV_ENOMEM;
    }
    const int resolved = resolve(a, blocks);
    if (resolved != TKV_OK) {
        free(states);
        free(blocks);
        return resolved;
    }
    int simd = best_isa();
    if (a->isa >= 0 && a->isa < simd) simd = (int)a->isa;
    if (simd == TKV_AVX512 && D % 16) simd = TKV_AVX2;
    if (simd == TKV_AVX2 && D % 8) simd = TKV_PORTABLE;
    const int64_t heads_per_group = ceil_div(H, head_groups);
    int failed = 0;

#ifdef _OPENMP
#pragma omp parallel num_threads((int)threads) if (threads > 1 && tasks > 1)
#endif
    {
        float *qbuf = malloc((size_t)(heads_per_group * rows * D) * sizeof(float));
        /* the portable path's fp32 copies of an entry's K and V rows (the SIMD paths convert in registers) */
        const size_t row_buf = simd ? 0 : (size_t)(a->entry_tokens * D) * sizeof(float);
        float *kbuf = row_buf ? malloc(row_buf) : NULL, *vbuf = row_buf ? malloc(row_buf) : NULL;
        float *sc = malloc((size_t)(heads_per_group * rows * a->entry_tokens) * sizeof(float));
        /* one task's state, contiguous per head; copied to `states` in [B, H, splits] order at the end */
        float *local = malloc((size_t)(heads_per_group * state_per_head) * sizeof(float));
        const int ok = qbuf && (!row_buf || (kbuf && vbuf)) && sc && local;
        if (!ok) {
#ifdef _OPENMP
#pragma omp atomic write
#endif
            failed = 1;
        }
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
        for (int64_t id = 0; id < tasks; id++) {
            if (!ok) continue;
            const int64_t s = id % splits, hg = (id / splits) % head_groups, b = id / (splits * head_groups);
            const int64_t h0 = hg * heads_per_group, h1 = h0 + heads_per_group < H ? h0 + heads_per_group : H;
            if (h0 >= h1) continue;
            const int64_t j0 = a->n_blocks * s / splits, j1 = a->n_blocks * (s + 1) / splits;
            run_task(a, blocks, b, h0, h1, j0, j1, local, qbuf, kbuf, vbuf, sc, simd);
            for (int64_t h = h0; h < h1; h++)
                memcpy(states + ((b * H + h) * splits + s) * state_per_head, local + (h - h0) * state_per_head,
                       (size_t)state_per_head * sizeof(float));
        }
        free(qbuf);
        free(kbuf);
        free(vbuf);
        free(sc);
        free(local);
    }
    free(blocks);
    if (failed) {
        free(states);
        return TKV_ENOMEM;
    }
    /* merge the key ranges of each (row, kv head, query) by log-sum-exp; normalise */
#ifdef _OPENMP
#pragma omp parallel for num_threads((int)threads) if (threads > 1 && B * H * rows * splits * D > 65536)
#endif
    for (int64_t bh = 0; bh < B * H; bh++) {
        const int64_t b = bh / H, h = bh % H;
        for (int64_t r = 0; r < rows; r++) {
            const float *first = states + (bh * splits * rows + r) * (D + 2);
            float peak = -INFINITY;
            for (int64_t s = 0; s < splits; s++) {
                const float m = first[s * state_per_head];
                peak = m > peak || isnan(m) ? m : peak; /* a NaN piece makes the query's output NaN */
                if (isnan(peak)) break;
            }
            /* query head h * group + r / q_len, query r % q_len: rows of a kv head are contiguous in out */
            const int64_t at = (b * a->q_heads + h * (a->q_heads / H)) * a->q_len + r;
            float *out = a->out + at * D;
            if (peak == -INFINITY) {
                memset(out, 0, (size_t)D * sizeof(float));
                a->lse[at] = -INFINITY;
                continue;
            }
            float total = 0.0f;
            for (int64_t d = 0; d < D; d++) out[d] = 0.0f;
            for (int64_t s = 0; s < splits; s++) {
                const float *st = first + s * state_per_head;
                if (st[0] == -INFINITY) continue;
                const float scale = expf(st[0] - peak);
                total += st[1] * scale;
                for (int64_t d = 0; d < D; d++) out[d] += st[2 + d] * scale;
            }
            const float inv = 1.0f / total;
            for (int64_t d = 0; d < D; d++) out[d] *= inv;
            a->lse[at] = peak + logf(total);
        }
    }
    free(states);
    return TKV_OK;
}
