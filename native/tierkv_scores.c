/* Sparse attention's page scores, read straight from the key summaries table (tierkv.attention.score_kernel).
 *
 * Each decode step sparse attention ranks every candidate page of a layer by its key summaries
 * (tierkv/store/summaries.py): Quest's bound and a logit estimate per query head,
 *
 *     bound[g, e] = q⁻_g · min_e + q⁺_g · max_e          (q⁺ = max(q, 0), q⁻ = min(q, 0))
 *     logit[g, e] = 0.5 · (bound[g, e] + q_g · mean_e)
 *
 * In torch that gathers the candidates' summaries into a new tensor, widens it to fp32 and concatenates it (three
 * copies of the bytes a step scores, then two matmuls); this kernel reads each page's min, max and mean once where
 * the table holds them (fp32, fp16 or bf16, widened exactly in registers) and writes only the results. Every query
 * head of a KV head's group is scored from the same read. The (row, KV head) pairs, each cut into pieces of
 * entries where there are fewer of them than threads, run across OpenMP threads; the results of a piece are its
 * own, so nothing is merged.
 *
 * Layouts (all contiguous):
 *   query   [B, H_kv, G, D]        fp32, already multiplied by the softmax scaling
 *   table   [H_kv, rows, fields, D] the layer's summary table (fields 0, 1, 2: the page's key min, max, mean)
 *   pages   [B, n]                 int64 table row of each entry (a block's row · pages + page)
 *   bound, logits [B, H_kv, G, n]  fp32
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "tierkv_kernel.h"

enum { TKV_OK = 0, TKV_ENOMEM = -1, TKV_EARGS = -2, TKV_EROW = -3 };

/* Sums may be reassociated (a dot product's lanes added as a tree, not one by one): torch's matmul, the reference,
 * adds in its own blocked order, which no fixed order matches bit for bit. Infinities and NaN keep their meaning. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("associative-math", "no-signed-zeros", "no-trapping-math")
#endif

typedef struct {
    int64_t batch, kv_heads, groups, head_dim, entries, rows, fields, dtype, threads; /* dtype: TKV_F32/F16/BF16 */
    uint64_t query, table, pages, bound, logits;
} tkv_scores_args;

const char *tkv_scores_source_sha(void) { return TKV_SOURCE_SHA; }
int64_t tkv_scores_args_size(void) { return (int64_t)sizeof(tkv_scores_args); }

/* One (row, KV head), entries [e0, e1) of the row, all G query heads of the head. ``D`` is a constant where the
 * caller passes one (always inlined into each specialisation). */
static inline __attribute__((always_inline)) int score_body(const tkv_scores_args *a, int64_t b, int64_t h,
                                                            int64_t e0, int64_t e1, const int64_t D) {
    const int64_t G = a->groups, n = a->entries, rows = a->rows, task = b * a->kv_heads + h;
    const int64_t size = a->dtype == TKV_F32 ? 4 : 2;
    const float *q = (const float *)a->query + task * G * D;
    const char *table = (const char *)a->table + h * rows * a->fields * D * size;
    const int64_t *pages = (const int64_t *)a->pages + b * n;
    float *bound = (float *)a->bound + task * G * n, *logits = (float *)a->logits + task * G * n;
    /* one allocation: q⁻ and q⁺ [G, D] each, then the page's min, max and mean [3, D] in fp32 */
    float *neg = malloc((size_t)((2 * G + 3) * D) * sizeof(float));
    if (!neg) return TKV_ENOMEM;
    float *pos = neg + G * D, *lo = pos + G * D, *hi = lo + D, *mean = hi + D;
    for (int64_t k = 0; k < G * D; k++) {
        neg[k] = q[k] < 0.0f ? q[k] : 0.0f;
        pos[k] = q[k] > 0.0f ? q[k] : 0.0f;
    }
    for (int64_t e = e0; e < e1; e++) {
        const int64_t row = pages[e];
        if (row < 0 || row >= rows) {
            free(neg);
            return TKV_EROW;
        }
        widen(table + row * a->fields * D * size, a->dtype, 3 * D, lo); /* fields 0, 1, 2: adjacent */
        for (int64_t g = 0; g < G; g++) {
            const float *qn = neg + g * D, *qp = pos + g * D, *qg = q + g * D;
            float x = 0.0f, y = 0.0f;
#pragma omp simd reduction(+ : x, y)
            for (int64_t d = 0; d < D; d++) {
                x += qn[d] * lo[d] + qp[d] * hi[d];
                y += qg[d] * mean[d];
            }
            bound[g * n + e] = x;
            logits[g * n + e] = (y + x) * 0.5f;
        }
    }
    free(neg);
    return TKV_OK;
}

/* The specialisations: head dimensions 32, 64, 128 and 256 as constants, any other as a variable. */
#define TKV_PIECE(name, dim)                                                                                       \
    TKV_CLONES static int name(const tkv_scores_args *a, int64_t b, int64_t h, int64_t e0, int64_t e1) {           \
        return score_body(a, b, h, e0, e1, dim);                                                                   \
    }
TKV_PIECE(piece_32, 32)
TKV_PIECE(piece_64, 64)
TKV_PIECE(piece_128, 128)
TKV_PIECE(piece_256, 256)
TKV_PIECE(piece_any, a->head_dim)

typedef int (*tkv_piece)(const tkv_scores_args *, int64_t, int64_t, int64_t, int64_t);

/* Entries per piece at least: a (row, KV head) is cut into pieces only where there are fewer of them than
 * threads, and a piece is worth a thread's start. */
#define MIN_PIECE 64

/* Score every (row, KV head) of ``packed`` (a tkv_scores_args), in pieces of entries across the threads; 0, or a
 * negative TKV_E* code. */
int tkv_scores(const char *packed) {
    tkv_scores_args a;
    memcpy(&a, packed, sizeof a);
    if (a.batch < 1 || a.kv_heads < 1 || a.groups < 1 || a.head_dim < 1 || a.entries < 0 || a.rows < 0 ||
        a.fields < 3 || a.dtype < TKV_F32 || a.dtype > TKV_BF16 || a.threads < 0 || !a.query || !a.table ||
        (a.entries > 0 && (!a.pages || !a.bound || !a.logits)))
        return TKV_EARGS;
    const int64_t tasks = a.batch * a.kv_heads;
    const int threads = a.threads > 0 ? (int)a.threads : 1;
    const tkv_piece score_piece = a.head_dim == 32    ? piece_32
                                  : a.head_dim == 64  ? piece_64
                                  : a.head_dim == 128 ? piece_128
                                  : a.head_dim == 256 ? piece_256
                                                      : piece_any;
    int64_t split = (threads + tasks - 1) / tasks; /* pieces per (row, KV head) */
    if (split > a.entries / MIN_PIECE) split = a.entries / MIN_PIECE;
    if (split < 1) split = 1;
    const int64_t items = tasks * split;
    int status = TKV_OK;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && items > 1)
#endif
    for (int64_t item = 0; item < items; item++) {
        const int64_t task = item / split, piece = item % split, b = task / a.kv_heads, h = task % a.kv_heads;
        const int rc = score_piece(&a, b, h, a.entries * piece / split, a.entries * (piece + 1) / split);
        if (rc != TKV_OK) {
#ifdef _OPENMP
#pragma omp atomic write
#endif
            status = rc;
        }
    }
    return status;
}
