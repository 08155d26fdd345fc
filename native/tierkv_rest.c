/* Decode attention over sparse attention's low-bit rest copy, decoded on the fly (tierkv.attention.rest_kernel).
 *
 * The rest copy (tierkv/store/summaries.py) holds every summarised page of a layer at `bits` (2, 4 or 8) bits per
 * element: keys coded per page and channel on the page's key min and max, values per token and channel group on
 * their own min and step. Attending it in torch decodes every page into fp32 temporaries first (8x the codes'
 * bytes, written and read again); this kernel reads each code byte once and never materialises a decoded page:
 *
 *     logit[g, t] = q_g · (lo + c_t · step)  =  q_g · lo  +  (q_g ⊙ step) · c_t        (one FMA per code)
 *     out[g]     += w[g, t] · (v_lo + c'_t · v_step)  =  Σ_t (w · v_step) c'_t  +  Σ_t w · v_lo   (one FMA per
 *                                                   code; the offsets summed once per value group, not per code)
 *
 * with an online softmax over the pages of each (row, KV head), all query heads of the head's group in the same
 * pass over the codes. Where there are fewer rows x KV heads than threads, each one's entries are cut into pieces
 * attended on different threads and merged by log-sum-exp. Output: the softmax-normalised output and the
 * log-sum-exp per (row, KV head, group), fp32, in tierkv.attention.lse's convention (no entries: output 0,
 * log-sum-exp -inf).
 *
 * Speed (it is compute-bound, not memory-bound, unless every code is one FMA): the codes of a byte are never
 * interleaved into channel order. Channel d = j · (8 / bits) + i is code i of byte j, so the query (scaled by the
 * page's step) and the output accumulators are kept split by i ("lanes"): every inner loop runs over bytes j with
 * one shift and mask per code, which the compiler vectorises; the output goes back to channel order once per piece.
 * The head dimension and the bit width are compile-time constants in the common shapes (32, 64, 128, 256 channels);
 * the softmax weights of a page are one vectorised loop with a polynomial exp, not one libm call per weight.
 *
 * Layouts (all contiguous; one call per chunk of pages; `rows` = table rows of the layer, a page each):
 *   query     [B, H_kv, G, D]              fp32, already multiplied by the softmax scaling
 *   codes     [H_kv, rows, 2, pt, D·bits/8] the layer's packed table (K then V per page); code i of byte j is at
 *                                          bit i·bits of byte j
 *   summaries [H_kv, rows, fields, D]      the layer's summary table (fp32, fp16 or bf16): field 0 the page's key
 *                                          min, field 1 its max
 *   scales    [H_kv, rows, pt, groups, 2]  the value (min, step) per token and channel group (fp32, fp16 or bf16)
 *   pages     [B, n]   int64 table row of each entry; entries [counts[b], n) of row b are padding, never read
 *   bias      [B, n·pt] fp32 additive (masked keys: a large negative value) or NULL
 *   out       [B, H_kv, G, D], lse [B, H_kv, G]
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "tierkv_kernel.h"

enum { TKV_OK = 0, TKV_ENOMEM = -1, TKV_EARGS = -2, TKV_EROW = -3 };

/* The largest query group, head and page a call takes; tierkv.attention.rest_kernel leaves larger shapes to torch. */
#define TKV_MAX_GROUP 64
#define TKV_MAX_DIM 1024
#define TKV_MAX_PAGE 256

/* Sums may be reassociated (a dot product's lanes added as a tree, not one by one): the reference is a float64
 * softmax, which no order of fp32 additions matches bit for bit. Infinities and NaN keep their meaning. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("associative-math", "no-signed-zeros", "no-trapping-math")
#endif

typedef struct {
    int64_t batch, kv_heads, groups, head_dim, page_tokens, entries, bits, value_groups, rows, threads;
    int64_t fields, summary_dtype, scale_dtype; /* summary fields per row; TKV_F32 / TKV_F16 / TKV_BF16 */
    double softcap;                             /* 0: none */
    uint64_t query, codes, pages, counts, summaries, scales, bias, out, lse;
} tkv_rest_args;

const char *tkv_rest_source_sha(void) { return TKV_SOURCE_SHA; }
int64_t tkv_rest_args_size(void) { return (int64_t)sizeof(tkv_rest_args); }

/* e^x for x <= 0 (a softmax weight), vectorisable: 2^n · p(r), r = x - n·ln 2 in [-ln2/2, ln2/2], p of degree 6
 * (relative error ~2e-7, as libm's expf within a few ulp); 0 below e^-87 (libm: a subnormal or 0). */
TKV_INLINE float weight_exp(float x) {
    const float clamped = x < -87.0f ? -87.0f : x;
    const float n = __builtin_rintf(clamped * 1.44269504088896341f); /* to nearest (vroundps; no libm call) */
    const float r = (clamped - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const float scale = bits_to_float((uint32_t)((int32_t)n + 127) << 23);
    return x < -87.0f ? 0.0f : p * scale;
}

/* a · b over n floats as 32 running sums (four AVX2 registers), added up at the end: one running sum is bound by
 * the latency of its chain of FMAs, not by their throughput (at a head of 256 it was a quarter of the kernel). */
TKV_INLINE float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float part[32] = {0.0f};
    int64_t k = 0;
    for (; k + 32 <= n; k += 32)
#pragma omp simd
        for (int64_t l = 0; l < 32; l++) part[l] += a[k + l] * b[k + l];
    float x = 0.0f;
    for (; k < n; k++) x += a[k] * b[k];
#pragma omp simd reduction(+ : x)
    for (int64_t l = 0; l < 32; l++) x += part[l];
    return x;
}

/* One (row, KV head), entries [e0, e1) of the row, all G query heads of the head: the unnormalised partial state
 * (running max ``m`` [G], sum ``s`` [G], weighted values ``out`` [G, D]) that tkv_rest merges across pieces.
 * ``D`` and ``BITS`` are constants where the caller passes constants (always inlined into each specialisation). */
static inline __attribute__((always_inline)) int attend_body(const tkv_rest_args *a, int64_t b, int64_t h, int64_t e0,
                                                             int64_t e1, float *state_m, float *state_s,
                                                             float *restrict out, const int64_t D,
                                                             const int64_t BITS, const int64_t VG) {
    const int64_t G = a->groups, pt = a->page_tokens, n = a->entries, rows = a->rows;
    const int64_t LANES = 8 / BITS, J = D / LANES, tok_bytes = D * BITS / 8; /* codes per byte; bytes per token */
    const int64_t width = D / VG / LANES; /* bytes per value group */
    /* channels accumulated at a time: 64 (eight AVX2 registers) where whole value groups of one lane make it */
    const int64_t CHUNK = D > 64 && J % 64 == 0 && 64 % width == 0 ? 64 : D;
    const unsigned MASK = (1u << BITS) - 1u;
    const float inv_levels = 1.0f / (float)MASK;
    const float *q = (const float *)a->query + (b * a->kv_heads + h) * G * D;
    const uint8_t *codes = (const uint8_t *)a->codes;
    const char *summaries = (const char *)a->summaries;
    const char *scales = (const char *)a->scales;
    const int64_t summary_size = a->summary_dtype == TKV_F32 ? 4 : 2, scale_size = a->scale_dtype == TKV_F32 ? 4 : 2;
    const int64_t *pages = (const int64_t *)a->pages + b * n;
    const float *bias = a->bias ? (const float *)a->bias + b * n * pt : NULL;
    /* per piece, one allocation: q ⊙ step by lane [G, LANES, J], the page's logits then weights [G, pt], its codes
     * by lane [pt, LANES, J] (keys, then values), its key bounds [2, D] and value scales [pt, VG, 2], the query by
     * lane [G, LANES, J] and the page's step by lane [D]; on the stack per head the base logit q · lo, the page's
     * and the running max, the running sum. */
    float *qs = malloc((size_t)(2 * G * D + G * pt + pt * D + 3 * D + pt * VG * 2) * sizeof(float));
    if (!qs) return TKV_ENOMEM;
    float *w = qs + G * D, *c = w + G * pt, *lohi = c + pt * D, *vs = lohi + 2 * D;
    float *ql = vs + pt * VG * 2, *span = ql + G * D; /* the query by lane [G, LANES, J]; a page's step by lane */
    for (int64_t g = 0; g < G; g++)
        for (int64_t i = 0; i < LANES; i++)
            for (int64_t j = 0; j < J; j++) ql[(g * LANES + i) * J + j] = q[g * D + j * LANES + i];
    float base[TKV_MAX_GROUP], peak[TKV_MAX_GROUP], m[TKV_MAX_GROUP], s[TKV_MAX_GROUP];
    for (int64_t g = 0; g < G; g++) {
        m[g] = -INFINITY;
        s[g] = 0.0f;
    }
    memset(out, 0, (size_t)(G * D) * sizeof(float)); /* by lane: [G, LANES, J] until the end of the piece */
    for (int64_t e = e0; e < e1; e++) {
        const int64_t row = pages[e];
        if (row < 0 || row >= rows) {
            free(qs);
            return TKV_EROW;
        }
        const int64_t at = h * rows + row;
        const uint8_t *key = codes + at * 2 * pt * tok_bytes;
        const uint8_t *value = key + pt * tok_bytes;
        widen(summaries + at * a->fields * D * summary_size, a->summary_dtype, 2 * D, lohi);
        widen(scales + at * pt * VG * 2 * scale_size, a->scale_dtype, pt * VG * 2, vs);
        const float *lo = lohi, *hi = lohi + D;
        for (int64_t i = 0; i < LANES; i++) /* the page's step by lane, once for all heads of the group */
            for (int64_t j = 0; j < J; j++) span[i * J + j] = (hi[j * LANES + i] - lo[j * LANES + i]) * inv_levels;
        for (int64_t g = 0; g < G; g++) {
#pragma omp simd
            for (int64_t k = 0; k < D; k++) qs[g * D + k] = ql[g * D + k] * span[k];
            base[g] = dot(q + g * D, lo, D);
        }
        for (int64_t t = 0; t < pt; t++) { /* the page's key codes by lane, [pt, LANES, J] */
            const uint8_t *bytes = key + t * tok_bytes;
            for (int64_t i = 0; i < LANES; i++)
#pragma omp simd
                for (int64_t j = 0; j < J; j++) c[(t * LANES + i) * J + j] = (float)((bytes[j] >> (i * BITS)) & MASK);
        }
        for (int64_t g = 0; g < G; g++) {
            const float *qg = qs + g * D;
            for (int64_t t = 0; t < pt; t++) w[g * pt + t] = base[g] + dot(qg, c + t * D, D);
        }
        if (a->softcap > 0)
            for (int64_t k = 0; k < G * pt; k++) w[k] = (float)(tanh(w[k] / a->softcap) * a->softcap);
        if (bias)
            for (int64_t g = 0; g < G; g++)
#pragma omp simd
                for (int64_t t = 0; t < pt; t++) {
                    const float x = w[g * pt + t] + bias[e * pt + t];
                    w[g * pt + t] = x < -FLT_MAX ? -FLT_MAX : x; /* masked keys stay finite, as in tierkv.attention.lse */
                }
        for (int64_t g = 0; g < G; g++) {
            float top = -INFINITY;
#pragma omp simd reduction(max : top)
            for (int64_t t = 0; t < pt; t++) top = w[g * pt + t] > top ? w[g * pt + t] : top;
            peak[g] = top;
        }
        for (int64_t g = 0; g < G; g++) {
            if (peak[g] > m[g]) {
                const float shrink = expf(m[g] - peak[g]); /* 0 when m was -inf */
                s[g] *= shrink;
                for (int64_t k = 0; k < D; k++) out[g * D + k] *= shrink;
                m[g] = peak[g];
            }
            float total = 0.0f;
#pragma omp simd reduction(+ : total)
            for (int64_t t = 0; t < pt; t++) {
                const float x = weight_exp(w[g * pt + t] - m[g]);
                w[g * pt + t] = x;
                total += x;
            }
            s[g] += total;
        }
        for (int64_t t = 0; t < pt; t++) { /* the page's value codes by lane, [pt, LANES, J] */
            const uint8_t *bytes = value + t * tok_bytes;
            for (int64_t i = 0; i < LANES; i++)
#pragma omp simd
                for (int64_t j = 0; j < J; j++) c[(t * LANES + i) * J + j] = (float)((bytes[j] >> (i * BITS)) & MASK);
        }
        for (int64_t g = 0; g < G; g++) {
            float offsets[TKV_MAX_DIM]; /* a value group's offsets: one sum per group, not per code */
            memset(offsets, 0, (size_t)VG * sizeof(float));
            for (int64_t t = 0; t < pt; t++)
                for (int64_t k = 0; k < VG; k++) offsets[k] += w[g * pt + t] * vs[(t * VG + k) * 2];
            /* the head's accumulators a chunk of lane-ordered channels at a time, held in registers over the page's
             * tokens (a head of 256 does not fit them whole); a chunk is whole value groups of one lane */
            for (int64_t p0 = 0; p0 < D; p0 += CHUNK) {
                float acc[TKV_MAX_DIM];
                memcpy(acc, out + g * D + p0, (size_t)CHUNK * sizeof(float));
                for (int64_t t = 0; t < pt; t++) {
                    const float wt = w[g * pt + t], *scale = vs + t * VG * 2, *ct = c + t * D + p0;
                    for (int64_t at = 0; at < CHUNK; at += width) {
                        const float step = wt * scale[2 * ((p0 + at) % J / width) + 1];
#pragma omp simd
                        for (int64_t j = 0; j < width; j++) acc[at + j] += step * ct[at + j];
                    }
                }
                for (int64_t at = 0; at < CHUNK; at += width) {
                    const float offset = offsets[(p0 + at) % J / width];
#pragma omp simd
                    for (int64_t j = 0; j < width; j++) acc[at + j] += offset;
                }
                memcpy(out + g * D + p0, acc, (size_t)CHUNK * sizeof(float));
            }
        }
    }
    for (int64_t g = 0; g < G; g++) { /* back to channel order */
        float *o = out + g * D;
        memcpy(qs, o, (size_t)D * sizeof(float));
        for (int64_t i = 0; i < LANES; i++)
            for (int64_t j = 0; j < J; j++) o[j * LANES + i] = qs[i * J + j];
    }
    free(qs);
    memcpy(state_m, m, (size_t)G * sizeof(float));
    memcpy(state_s, s, (size_t)G * sizeof(float));
    return TKV_OK;
}

/* The specialisations: each (head dimension, bits) in the common shapes with both constant, any other head
 * dimension with only the bits constant (as fast as a plain loop, ~2x slower than the constant shapes). */
#define TKV_PIECE(name, dim, bits, value_groups)                                                                   \
    TKV_CLONES static int name(const tkv_rest_args *a, int64_t b, int64_t h, int64_t e0, int64_t e1, float *m,     \
                               float *s, float *out) {                                                             \
        return attend_body(a, b, h, e0, e1, m, s, out, dim, bits, value_groups);                                   \
    }
/* One head dimension's three widths: piece_<dim>_2, _4 and _8 (a value group per 32 channels). */
#define TKV_PIECES(dim)                                                                                            \
    TKV_PIECE(piece_##dim##_2, dim, 2, dim / 32)                                                                   \
    TKV_PIECE(piece_##dim##_4, dim, 4, dim / 32)                                                                   \
    TKV_PIECE(piece_##dim##_8, dim, 8, dim / 32)
TKV_PIECES(32)
TKV_PIECES(64)
TKV_PIECES(128)
TKV_PIECES(256)
TKV_PIECE(piece_any_2, a->head_dim, 2, a->value_groups)
TKV_PIECE(piece_any_4, a->head_dim, 4, a->value_groups)
TKV_PIECE(piece_any_8, a->head_dim, 8, a->value_groups)

typedef int (*tkv_piece)(const tkv_rest_args *, int64_t, int64_t, int64_t, int64_t, float *, float *, float *);

static tkv_piece piece_for(int64_t dim, int64_t bits, int64_t value_groups) {
    static const tkv_piece fixed[4][3] = {{piece_32_2, piece_32_4, piece_32_8},
                                          {piece_64_2, piece_64_4, piece_64_8},
                                          {piece_128_2, piece_128_4, piece_128_8},
                                          {piece_256_2, piece_256_4, piece_256_8}};
    static const tkv_piece any[3] = {piece_any_2, piece_any_4, piece_any_8};
    const int width = bits == 2 ? 0 : bits == 4 ? 1 : 2;
    if (value_groups * 32 != dim) return any[width]; /* the fixed shapes have a value group per 32 channels */
    if (dim == 32) return fixed[0][width];
    if (dim == 64) return fixed[1][width];
    if (dim == 128) return fixed[2][width];
    if (dim == 256) return fixed[3][width];
    return any[width];
}


/* Entries per piece: a (row, KV head) is cut into pieces of at least MIN_PIECE entries so that every thread has
 * work when there are fewer rows x KV heads than threads (Gemma 3: one KV head); each piece reads its own pages. */
#define MIN_PIECE 16

/* Attend every (row, KV head) of ``packed`` (a tkv_rest_args), in pieces of entries across the threads, merged
 * by log-sum-exp per (row, KV head); 0, or a negative TKV_E* code. */
int tkv_rest(const char *packed) {
    tkv_rest_args a;
    memcpy(&a, packed, sizeof a);
    if (a.batch < 1 || a.kv_heads < 1 || a.groups < 1 || a.head_dim < 1 || a.page_tokens < 1 || a.entries < 0 ||
        (a.bits != 2 && a.bits != 4 && a.bits != 8) || a.head_dim * a.bits % 8 || a.value_groups < 1 ||
        a.head_dim % a.value_groups || a.head_dim / a.value_groups % (8 / a.bits) || a.rows < 0 || a.fields < 2 ||
        a.summary_dtype < TKV_F32 || a.summary_dtype > TKV_BF16 || a.scale_dtype < TKV_F32 || a.scale_dtype > TKV_BF16 ||
        !a.query || !a.codes || !a.pages || !a.counts || !a.summaries || !a.scales || !a.out || !a.lse ||
        a.groups > TKV_MAX_GROUP || a.head_dim > TKV_MAX_DIM || a.page_tokens > TKV_MAX_PAGE)
        return TKV_EARGS;
    const int64_t *counts = (const int64_t *)a.counts;
    for (int64_t b = 0; b < a.batch; b++)
        if (counts[b] < 0 || counts[b] > a.entries) return TKV_EARGS;
    const int64_t G = a.groups, D = a.head_dim, tasks = a.batch * a.kv_heads;
    const int threads = a.threads > 0 ? (int)a.threads : 1;
    const tkv_piece attend_piece = piece_for(D, a.bits, a.value_groups);
    int64_t split = (threads + tasks - 1) / tasks;  /* pieces per (row, KV head) */
    if (split > a.entries / MIN_PIECE) split = a.entries / MIN_PIECE;
    if (split < 1) split = 1;
    const int64_t items = tasks * split;
    float *state = malloc((size_t)(items * G * (D + 2)) * sizeof(float));  /* per piece: m [G], s [G], out [G, D] */
    if (!state) return TKV_ENOMEM;
    int status = TKV_OK;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && items > 1)
#endif
    for (int64_t item = 0; item < items; item++) {
        const int64_t task = item / split, piece = item % split, b = task / a.kv_heads, h = task % a.kv_heads;
        const int64_t count = counts[b], e0 = count * piece / split, e1 = count * (piece + 1) / split;
        float *m = state + item * G * (D + 2), *s = m + G;
        const int rc = attend_piece(&a, b, h, e0, e1, m, s, s + G);
        if (rc != TKV_OK) {
#ifdef _OPENMP
#pragma omp atomic write
#endif
            status = rc;
        }
    }
    if (status == TKV_OK) {
        for (int64_t task = 0; task < tasks; task++) {
            float *out = (float *)a.out + task * G * D, *lse = (float *)a.lse + task * G;
            for (int64_t g = 0; g < G; g++) {
                float top = -INFINITY, total = 0.0f;
                for (int64_t piece = 0; piece < split; piece++) {
                    const float *m = state + (task * split + piece) * G * (D + 2);
                    if (m[G + g] > 0.0f && m[g] > top) top = m[g];
                }
                float *o = out + g * D;
                memset(o, 0, (size_t)D * sizeof(float));
                for (int64_t piece = 0; piece < split; piece++) {
                    const float *m = state + (task * split + piece) * G * (D + 2), *acc = m + 2 * G + g * D;
                    if (!(m[G + g] > 0.0f)) continue;  /* a piece with no entries (or all weights 0) adds nothing */
                    const float w = expf(m[g] - top);
                    total += m[G + g] * w;
                    for (int64_t d = 0; d < D; d++) o[d] += acc[d] * w;
                }
                if (total > 0.0f) {
                    const float inv = 1.0f / total;
                    for (int64_t d = 0; d < D; d++) o[d] *= inv;
                    lse[g] = top + logf(total);
                } else {
                    lse[g] = -INFINITY;
                }
            }
        }
    }
    free(state);
    return status;
}
