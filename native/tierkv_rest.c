/* Decode attention over sparse attention's low-bit rest copy, decoded on the fly (tierkv.attention.rest_kernel).
 *
 * The rest copy (tierkv/store/summaries.py) holds every summarised page of a layer at `bits` (2, 4 or 8) bits per
 * element: keys coded per page and channel on the page's key min and max, values per token and channel group on
 * their own min and step. Attending it in torch decodes every page into fp32 temporaries first (8x the codes'
 * bytes, written and read again); this kernel reads each code byte once and never materialises a decoded page:
 *
 *     logit[g, t] = q_g · (lo + c_t · step)  =  q_g · lo  +  (q_g ⊙ step) · c_t        (one FMA per code)
 *     out[g]     += w[g, t] · (v_lo + c'_t · v_step)   per value group                 (one FMA per code)
 *
 * with an online softmax over the pages of each (row, KV head), all query heads of the head's group in the same
 * pass over the codes. Where there are fewer rows x KV heads than threads, each one's entries are cut into pieces
 * attended on different threads and merged by log-sum-exp. Output: the softmax-normalised output and the log-sum-exp per (row, KV head, group), fp32,
 * in tierkv.attention.lse's convention (no entries: output 0, log-sum-exp -inf).
 *
 * Layouts (all contiguous; one call per chunk of pages):
 *   query   [B, H_kv, G, D]            fp32, already multiplied by the softmax scaling
 *   codes   [H_kv, rows, 2, pt, D·bits/8]   the layer's packed table (K then V per page); code j·(8/bits) + i at bit
 *                                      i·bits of byte j
 *   pages   [B, n]   int64 table row of each entry; entries [counts[b], n) of row b are padding, never read
 *   bounds  [H_kv, B·n, 2, D]          fp32 the entries' key min and max
 *   scales  [H_kv, B·n, pt, groups, 2] fp32 the entries' value (min, step) per token and channel group
 *   bias    [B, n·pt] fp32 additive (masked keys: a large negative value) or NULL
 *   out     [B, H_kv, G, D], lse [B, H_kv, G]
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#ifndef TKV_SOURCE_SHA
#define TKV_SOURCE_SHA ""
#endif

enum { TKV_OK = 0, TKV_ENOMEM = -1, TKV_EARGS = -2, TKV_EROW = -3 };

/* The largest query group, head and page a call takes (a piece's scratch lives on its thread's stack, ~320 KiB at
 * most); tierkv.attention.rest_kernel leaves larger shapes to torch. */
#define TKV_MAX_GROUP 64
#define TKV_MAX_DIM 1024
#define TKV_MAX_PAGE 256

/* The x86 builds carry an AVX-512 and an AVX2 version of the hot function, picked at load time (GCC's function
 * multi-versioning); elsewhere, the portable build. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define TKV_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define TKV_CLONES
#endif

typedef struct {
    int64_t batch, kv_heads, groups, head_dim, page_tokens, entries, bits, value_groups, rows, threads;
    double softcap; /* 0: none */
    uint64_t query, codes, pages, counts, bounds, scales, bias, out, lse;
} tkv_rest_args;

const char *tkv_rest_source_sha(void) { return TKV_SOURCE_SHA; }
int64_t tkv_rest_args_size(void) { return (int64_t)sizeof(tkv_rest_args); }

/* Codes of one token's D channels as floats. */
static inline void unpack(const uint8_t *restrict bytes, int64_t dim, int64_t bits, float *restrict out) {
    if (bits == 8) {
        for (int64_t d = 0; d < dim; d++) out[d] = (float)bytes[d];
    } else if (bits == 4) {
        for (int64_t j = 0; j < dim / 2; j++) {
            out[2 * j] = (float)(bytes[j] & 15);
            out[2 * j + 1] = (float)(bytes[j] >> 4);
        }
    } else {
        for (int64_t j = 0; j < dim / 4; j++) {
            uint8_t b = bytes[j];
            out[4 * j] = (float)(b & 3);
            out[4 * j + 1] = (float)((b >> 2) & 3);
            out[4 * j + 2] = (float)((b >> 4) & 3);
            out[4 * j + 3] = (float)(b >> 6);
        }
    }
}

static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* One (row, KV head), entries [e0, e1) of the row, all G query heads of the head: the unnormalised partial state
 * (running max ``m`` [G], sum ``s`` [G], weighted values ``out`` [G, D]) that tkv_rest merges across pieces. */
TKV_CLONES static int attend_piece(const tkv_rest_args *a, int64_t b, int64_t h, int64_t e0, int64_t e1,
                                   float *state_m, float *state_s, float *out) {
    const int64_t G = a->groups, D = a->head_dim, pt = a->page_tokens, n = a->entries;
    const int64_t tok_bytes = D * a->bits / 8, groups = a->value_groups, width = D / groups;
    const float inv_levels = 1.0f / (float)((1 << a->bits) - 1);
    const float *q = (const float *)a->query + (b * a->kv_heads + h) * G * D;
    const uint8_t *codes = (const uint8_t *)a->codes;
    const int64_t *pages = (const int64_t *)a->pages + b * n;
    const float *bias = a->bias ? (const float *)a->bias + b * n * pt : NULL;
    /* per piece, on the stack (fixed sizes, which tkv_rest checks: arrays of known extent vectorise best):
     * q ⊙ step [G, D], the page's logits [G, pt], one token's codes [D], per head base and page max */
    float qs[TKV_MAX_GROUP * TKV_MAX_DIM], logit[TKV_MAX_GROUP * TKV_MAX_PAGE], c[TKV_MAX_DIM];
    float base[TKV_MAX_GROUP], peak[TKV_MAX_GROUP], m[TKV_MAX_GROUP], s[TKV_MAX_GROUP];
    for (int64_t g = 0; g < G; g++) {
        m[g] = -INFINITY;
        s[g] = 0.0f;
        memset(out + g * D, 0, (size_t)D * sizeof(float));
    }
    for (int64_t e = e0; e < e1; e++) {
        const int64_t row = pages[e];
        if (row < 0 || row >= a->rows) return TKV_EROW;
        const uint8_t *key = codes + ((h * a->rows + row) * 2) * pt * tok_bytes;
        const uint8_t *value = key + pt * tok_bytes;
        const float *lo = (const float *)a->bounds + ((h * a->batch + b) * n + e) * 2 * D, *hi = lo + D;
        const float *scale = (const float *)a->scales + ((h * a->batch + b) * n + e) * pt * groups * 2;
        for (int64_t g = 0; g < G; g++) {
            float acc = 0.0f;
            for (int64_t d = 0; d < D; d++) {
                qs[g * D + d] = q[g * D + d] * (hi[d] - lo[d]) * inv_levels;
                acc += q[g * D + d] * lo[d];
            }
            base[g] = acc;
        }
        for (int64_t g = 0; g < G; g++) peak[g] = -INFINITY;
        for (int64_t t = 0; t < pt; t++) {
            unpack(key + t * tok_bytes, D, a->bits, c);
            const float extra = bias ? bias[e * pt + t] : 0.0f;
            for (int64_t g = 0; g < G; g++) {
                float x = base[g] + dot(qs + g * D, c, D);
                if (a->softcap > 0) x = (float)(tanh(x / a->softcap) * a->softcap);
                x += extra;
                if (x < -FLT_MAX) x = -FLT_MAX; /* masked keys stay finite, as in tierkv.attention.lse */
                logit[g * pt + t] = x;
                if (x > peak[g]) peak[g] = x;
            }
        }
        for (int64_t g = 0; g < G; g++) {
            if (peak[g] > m[g]) {
                const float shrink = expf(m[g] - peak[g]);  /* 0 when m was -inf */
                s[g] *= shrink;
                for (int64_t d = 0; d < D; d++) out[g * D + d] *= shrink;
                m[g] = peak[g];
            }
        }
        for (int64_t t = 0; t < pt; t++) {
            unpack(value + t * tok_bytes, D, a->bits, c);
            const float *vs = scale + t * groups * 2;
            for (int64_t g = 0; g < G; g++) {
                const float w = expf(logit[g * pt + t] - m[g]);
                if (w == 0.0f) continue;
                s[g] += w;
                float *o = out + g * D;
                for (int64_t k = 0; k < groups; k++) {
                    const float off = w * vs[2 * k], step = w * vs[2 * k + 1];
                    const float *ck = c + k * width;
                    float *ok = o + k * width;
#pragma omp simd
                    for (int64_t d = 0; d < width; d++) ok[d] += off + step * ck[d];
                }
            }
        }
    }
    memcpy(state_m, m, (size_t)G * sizeof(float));
    memcpy(state_s, s, (size_t)G * sizeof(float));
    return TKV_OK;
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
        a.head_dim % a.value_groups || a.head_dim / a.value_groups % (8 / a.bits) || a.rows < 0 || !a.query ||
        !a.codes || !a.pages || !a.counts || !a.bounds || !a.scales || !a.out || !a.lse ||
        a.groups > TKV_MAX_GROUP || a.head_dim > TKV_MAX_DIM || a.page_tokens > TKV_MAX_PAGE)
        return TKV_EARGS;
    const int64_t *counts = (const int64_t *)a.counts;
    for (int64_t b = 0; b < a.batch; b++)
        if (counts[b] < 0 || counts[b] > a.entries) return TKV_EARGS;
    const int64_t G = a.groups, D = a.head_dim, tasks = a.batch * a.kv_heads;
    const int threads = a.threads > 0 ? (int)a.threads : 1;
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
