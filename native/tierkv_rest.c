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
 * pass over the codes. Output: the softmax-normalised output and the log-sum-exp per (row, KV head, group), fp32,
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

/* One (row, KV head): every entry of the row, all G query heads of the head. */
TKV_CLONES static int attend_head(const tkv_rest_args *a, int64_t b, int64_t h) {
    const int64_t G = a->groups, D = a->head_dim, pt = a->page_tokens, n = a->entries;
    const int64_t tok_bytes = D * a->bits / 8, groups = a->value_groups, width = D / groups;
    const float inv_levels = 1.0f / (float)((1 << a->bits) - 1);
    const float *q = (const float *)a->query + (b * a->kv_heads + h) * G * D;
    const uint8_t *codes = (const uint8_t *)a->codes;
    const int64_t *pages = (const int64_t *)a->pages + b * n;
    const int64_t count = ((const int64_t *)a->counts)[b];
    const float *bias = a->bias ? (const float *)a->bias + b * n * pt : NULL;
    float *out = (float *)a->out + (b * a->kv_heads + h) * G * D;
    float *lse = (float *)a->lse + (b * a->kv_heads + h) * G;
    if (count < 0 || count > n) return TKV_EARGS;
    /* per task: q ⊙ step [G, D], the page's logits [G, pt], one token's codes [D], and per head base, max, sum */
    float *scratch = malloc((size_t)(G * D + G * pt + D + 4 * G) * sizeof(float));
    if (!scratch) return TKV_ENOMEM;
    float *qs = scratch, *logit = qs + G * D, *c = logit + G * pt, *base = c + D, *m = base + G, *s = m + G;
    float *peak = s + G;
    for (int64_t g = 0; g < G; g++) {
        m[g] = -INFINITY;
        s[g] = 0.0f;
        memset(out + g * D, 0, (size_t)D * sizeof(float));
    }
    for (int64_t e = 0; e < count; e++) {
        const int64_t row = pages[e];
        if (row < 0 || row >= a->rows) {
            free(scratch);
            return TKV_EROW;
        }
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
    for (int64_t g = 0; g < G; g++) {
        if (s[g] > 0.0f) {
            const float inv = 1.0f / s[g];
            for (int64_t d = 0; d < D; d++) out[g * D + d] *= inv;
            lse[g] = m[g] + logf(s[g]);
        } else {
            lse[g] = -INFINITY;
        }
    }
    free(scratch);
    return TKV_OK;
}

/* Attend every (row, KV head) of ``packed`` (a tkv_rest_args); 0, or a negative TKV_E* code. */
int tkv_rest(const char *packed) {
    tkv_rest_args a;
    memcpy(&a, packed, sizeof a);
    if (a.batch < 1 || a.kv_heads < 1 || a.groups < 1 || a.head_dim < 1 || a.page_tokens < 1 || a.entries < 0 ||
        (a.bits != 2 && a.bits != 4 && a.bits != 8) || a.head_dim * a.bits % 8 || a.value_groups < 1 ||
        a.head_dim % a.value_groups || a.rows < 0 || !a.query || !a.codes || !a.pages || !a.counts || !a.bounds ||
        !a.scales || !a.out || !a.lse)
        return TKV_EARGS;
    const int64_t tasks = a.batch * a.kv_heads;
    int status = TKV_OK;
#ifdef _OPENMP
    const int threads = a.threads > 0 ? (int)a.threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && tasks > 1)
#endif
    for (int64_t task = 0; task < tasks; task++) {
        const int rc = attend_head(&a, task / a.kv_heads, task % a.kv_heads);
        if (rc != TKV_OK) {
#ifdef _OPENMP
#pragma omp atomic write
#endif
            status = rc;
        }
    }
    return status;
}
