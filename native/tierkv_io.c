/*
 * tierkv native disk engine: batched pread/pwrite on a pthread pool.
 *
 * Why it exists beside the posix engine: the Python engine pays the interpreter (and the GIL handoff)
 * for every piece it issues; here a batch crosses into C once, the workers cut it into pieces and keep
 * `nthreads` system calls in flight with no Python in the loop. No io_uring on purpose: it is not
 * everywhere (containers often block it by seccomp) and a thread pool already saturates NVMe at
 * queue depth 16-32 with MiB-sized requests, which is what the disk tier issues.
 *
 * Model: one pool per open file. A batch is a list of (offset, length, address) requests; workers take
 * pieces of at most `chunk` bytes from the batch at the head of a FIFO, so batches finish in order and a
 * large request is read by many workers at once. One mutex guards the queue and every counter: pieces
 * are MiB-sized, so it is taken a few thousand times per second at most.
 *
 * Errors are per request: 0, a positive errno, or TKV_EOF for a read that hit end of file. Pieces of a
 * request that already failed are skipped. tkv_wait reports the first failed request in submission order.
 *
 * Checksums: a read batch may ask for the XXH3-64 (seed 0) of every `unit` bytes (the disk tier's slots) as
 * they land. Pieces are then cut at unit boundaries and the worker that read a piece hashes its units right
 * after its pread returns, so verification runs on the I/O threads, in parallel, with no Python loop over
 * blocks. The digests equal the Python `xxhash.xxh3_64_intdigest` of the same bytes (the same algorithm:
 * xxHash's single header, vendored as native/xxhash.h, BSD-2-Clause). tkv_xxh3_rows hashes rows already in
 * memory (blocks being written, reads through other engines).
 *
 * Built with the package as the optional extension tierkv.io._native (setup.py), or, where the install
 * could not build it, on first use by tierkv/io/native.py (cc -O2 -shared -fPIC -pthread). Either way it
 * is a plain C library loaded with ctypes (not a Python module), which releases the GIL during every call,
 * so tkv_wait blocks without stalling Python threads.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define XXH_INLINE_ALL /* header-only: xxHash's functions compile into this library */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__AVX2__)
/* xxHash's own dispatch recipe (xxh_x86dispatch.c): its AVX2 loop compiled beside the baseline one, chosen at run
 * time; the same algorithm, so the same digests. */
#define XXH_DISPATCH_AVX2 1
#define XXH_TARGET_AVX2 __attribute__((__target__("avx2")))
#define TKV_HASH_DISPATCH 1
#include <immintrin.h>
#endif
#include "xxhash.h"

#define TKV_EOF (-1)

/* sha256 of this file (16 hex digits), defined by setup.py: the loader rebuilds a library that an editable
 * install built from an older version of the source. */
#ifndef TKV_SOURCE_SHA
#define TKV_SOURCE_SHA ""
#endif

const char *tkv_source_sha(void) { return TKV_SOURCE_SHA; }

#ifdef TKV_HASH_DISPATCH
XXH_NO_INLINE XXH_TARGET_AVX2 XXH64_hash_t tkv_xxh3_long_avx2(const void *input, size_t len) {
    return XXH3_hashLong_64b_internal(input, len, XXH3_kSecret, sizeof(XXH3_kSecret), XXH3_accumulate_512_avx2,
                                      XXH3_scrambleAcc_avx2);
}
#endif

/* XXH3-64 (seed 0) of len bytes: with AVX2 where the CPU has it (about twice the SSE2 loop's rate; the disk tier
 * hashes every byte it reads, on the I/O threads), else xxHash's compiled default. */
static uint64_t tkv_xxh3(const void *input, size_t len) {
#ifdef TKV_HASH_DISPATCH
    static int avx2 = -1; /* a benign race: every thread computes the same value */
    if (avx2 < 0) avx2 = __builtin_cpu_supports("avx2") ? 1 : 0;
    if (avx2 && len > XXH3_MIDSIZE_MAX) return tkv_xxh3_long_avx2(input, len);
#endif
    return XXH3_64bits(input, len);
}

typedef struct tkv_batch {
    struct tkv_batch *next; /* FIFO link while pieces remain to be handed out */
    int fd;
    int is_write;
    int64_t chunk;
    int64_t n_req;
    int64_t *offsets;
    int64_t *lengths;
    uint64_t *addrs;
    int32_t *errs;
    int64_t unit;           /* > 0: hash every `unit` bytes of each read piece into digests */
    uint64_t *digests;      /* the caller's array, one digest per unit over all requests in order */
    int64_t *unit_base;     /* index in digests of each request's first unit */
    int64_t next_req;       /* next piece to hand out: request index ... */
    int64_t next_pos;       /* ... and byte position inside it */
    int64_t pieces_left;    /* pieces not yet finished; the batch is done at 0 */
    pthread_cond_t done_cv;
} tkv_batch;

typedef struct tkv_pool {
    pthread_mutex_t mu;
    pthread_cond_t work_cv;
    tkv_batch *head, *tail;
    int stop;
    int nthreads;
    int idle;    /* workers waiting for work */
    int waking;  /* of those, signalled and not yet running: a worker wakes another only if one is left */
    pthread_t *threads;
} tkv_pool;

/* Move `len` bytes at `off`; return 0, an errno, or TKV_EOF. Loops on short transfers and EINTR. */
static int do_io(int fd, int is_write, int64_t off, char *buf, int64_t len) {
    int64_t done = 0;
    while (done < len) {
        ssize_t n = is_write ? pwrite(fd, buf + done, (size_t)(len - done), (off_t)(off + done))
                             : pread(fd, buf + done, (size_t)(len - done), (off_t)(off + done));
        if (n < 0) {
            if (errno == EINTR) continue;
            return errno;
        }
        if (n == 0) return is_write ? EIO : TKV_EOF;
        done += n;
    }
    return 0;
}

/* Workers to wake (the caller holds the lock and signals after releasing it): while pieces are left to hand out
 * and workers sleep, up to TKV_WAKE_FANOUT of them. The submitter wakes one worker and each worker that takes a
 * piece wakes the next ones, so the submitting thread pays one wake-up, not one per worker: each costs a system
 * call and, on a host with few cores, often a context switch (on a 2-core VM, tkv_submit of 6 sector reads took
 * ~60 us of the caller's time waking 6 workers, ~35 us waking one). The fan-out reaches all workers in a few
 * hops, soon enough for pieces that take tens of microseconds or more. */
#define TKV_WAKE_FANOUT 2
static int wake_next(tkv_pool *pool) {
    int sleeping = pool->idle - pool->waking;
    int wake = pool->head == NULL ? 0 : sleeping < TKV_WAKE_FANOUT ? sleeping : TKV_WAKE_FANOUT;
    pool->waking += wake;
    return wake;
}

static void *worker(void *arg) {
    tkv_pool *pool = (tkv_pool *)arg;
    pthread_mutex_lock(&pool->mu);
    for (;;) {
        while (pool->head == NULL && !pool->stop) {
            pool->idle++;
            pthread_cond_wait(&pool->work_cv, &pool->mu);
            pool->idle--;
            if (pool->waking > 0) pool->waking--;
        }
        if (pool->head == NULL) break; /* stop requested and the queue is drained */
        tkv_batch *b = pool->head;
        int64_t req = b->next_req, pos = b->next_pos;
        int64_t len = b->lengths[req] - pos;
        if (len > b->chunk) len = b->chunk;
        b->next_pos += len;
        if (b->next_pos >= b->lengths[req]) {
            b->next_req++;
            b->next_pos = 0;
        }
        if (b->next_req == b->n_req) { /* last piece handed out: dequeue */
            pool->head = b->next;
            if (pool->head == NULL) pool->tail = NULL;
        }
        int skip = b->errs[req] != 0;
        int wake = wake_next(pool);
        pthread_mutex_unlock(&pool->mu);
        while (wake-- > 0) pthread_cond_signal(&pool->work_cv);

        char *addr = (char *)(uintptr_t)b->addrs[req] + pos;
        int err = skip ? 0 : do_io(b->fd, b->is_write, b->offsets[req] + pos, addr, len);
        if (err == 0 && !skip && b->unit > 0) { /* pieces start and end on unit boundaries (tkv_submit) */
            uint64_t *out = b->digests + b->unit_base[req] + pos / b->unit;
            for (int64_t k = 0; k < len / b->unit; k++) out[k] = tkv_xxh3(addr + k * b->unit, (size_t)b->unit);
        }

        pthread_mutex_lock(&pool->mu);
        if (err != 0 && b->errs[req] == 0) b->errs[req] = err;
        if (--b->pieces_left == 0) pthread_cond_broadcast(&b->done_cv);
    }
    pthread_mutex_unlock(&pool->mu);
    return NULL;
}

/* Most threads one pool may have; the Python side refuses more first (settings.MAX_IO_QUEUE_DEPTH). */
#define TKV_MAX_THREADS 256
#define TKV_STACK_BYTES (1 << 20) /* per worker: pread/pwrite and xxh3, no deep calls */

/* Free a pool whose threads were all joined (or never started). */
static void pool_destroy(tkv_pool *pool) {
    pthread_cond_destroy(&pool->work_cv);
    pthread_mutex_destroy(&pool->mu);
    free(pool->threads);
    free(pool);
}

/* Stop and join the workers (each finishes the queued batches first). */
static void pool_stop(tkv_pool *pool) {
    pthread_mutex_lock(&pool->mu);
    pool->stop = 1;
    pthread_cond_broadcast(&pool->work_cv);
    pthread_mutex_unlock(&pool->mu);
    for (int i = 0; i < pool->nthreads; i++) pthread_join(pool->threads[i], NULL);
}

/* A pool of exactly `nthreads` workers, 1 <= nthreads <= TKV_MAX_THREADS; NULL when the count is out of range
 * or not every thread started (a pool with no worker would take batches and never finish them). */
void *tkv_pool_new(int nthreads) {
    if (nthreads < 1 || nthreads > TKV_MAX_THREADS) return NULL;
    tkv_pool *pool = calloc(1, sizeof *pool);
    if (pool == NULL) return NULL;
    pool->threads = calloc((size_t)nthreads, sizeof(pthread_t));
    if (pool->threads == NULL) {
        free(pool);
        return NULL;
    }
    pthread_mutex_init(&pool->mu, NULL);
    pthread_cond_init(&pool->work_cv, NULL);
    pthread_attr_t attr; /* a worker needs a few KiB of stack: not the default 8 MiB of address space each */
    int sized = pthread_attr_init(&attr) == 0;
    if (sized && pthread_attr_setstacksize(&attr, TKV_STACK_BYTES) != 0) {
        pthread_attr_destroy(&attr);
        sized = 0;
    }
    for (int i = 0; i < nthreads; i++) {
        if (pthread_create(&pool->threads[i], sized ? &attr : NULL, worker, pool) != 0) break;
        pool->nthreads++;
    }
    if (sized) pthread_attr_destroy(&attr);
    if (pool->nthreads < nthreads) {
        pool_stop(pool);
        pool_destroy(pool);
        return NULL;
    }
    return pool;
}

/* Finish every queued batch, then stop and join the workers and free the pool. */
void tkv_pool_free(void *p) {
    tkv_pool *pool = (tkv_pool *)p;
    pool_stop(pool);
    pool_destroy(pool);
}

int tkv_pool_threads(void *p) { return ((tkv_pool *)p)->nthreads; }

/* Queue a batch of n >= 1 requests (arrays are copied); NULL if out of memory or if `unit` does not divide
 * every request. With unit > 0 (reads only) the workers write the XXH3-64 of every `unit` bytes into
 * digests[] (one per unit, requests in order), which the caller keeps alive until tkv_wait returned. */
void *tkv_submit(void *p, int fd, int is_write, int64_t chunk, int64_t n, const int64_t *offsets,
                 const int64_t *lengths, const uint64_t *addrs, int64_t unit, uint64_t *digests) {
    tkv_pool *pool = (tkv_pool *)p;
    if (n < 1 || unit < 0 || (unit > 0 && (is_write || digests == NULL))) return NULL;
    for (int64_t i = 0; unit > 0 && i < n; i++)
        if (lengths[i] % unit != 0) return NULL;
    tkv_batch *b = calloc(1, sizeof *b);
    if (b == NULL) return NULL;
    b->offsets = malloc((size_t)n * sizeof(int64_t));
    b->lengths = malloc((size_t)n * sizeof(int64_t));
    b->addrs = malloc((size_t)n * sizeof(uint64_t));
    b->errs = calloc((size_t)n, sizeof(int32_t));
    b->unit_base = unit > 0 ? malloc((size_t)n * sizeof(int64_t)) : NULL;
    if (!b->offsets || !b->lengths || !b->addrs || !b->errs || (unit > 0 && !b->unit_base)) {
        free(b->offsets); free(b->lengths); free(b->addrs); free(b->errs); free(b->unit_base); free(b);
        return NULL;
    }
    memcpy(b->offsets, offsets, (size_t)n * sizeof(int64_t));
    memcpy(b->lengths, lengths, (size_t)n * sizeof(int64_t));
    memcpy(b->addrs, addrs, (size_t)n * sizeof(uint64_t));
    b->fd = fd;
    b->is_write = is_write;
    b->unit = unit;
    b->digests = digests;
    if (unit > 0) { /* whole units per piece: the worker that reads a unit hashes it */
        chunk = chunk / unit * unit;
        if (chunk < unit) chunk = unit;
        int64_t units = 0;
        for (int64_t i = 0; i < n; i++) {
            b->unit_base[i] = units;
            units += lengths[i] / unit;
        }
    }
    b->chunk = chunk;
    b->n_req = n;
    for (int64_t i = 0; i < n; i++) /* a zero-length request is one empty piece */
        b->pieces_left += lengths[i] > 0 ? (lengths[i] + chunk - 1) / chunk : 1;
    pthread_cond_init(&b->done_cv, NULL);

    pthread_mutex_lock(&pool->mu);
    if (pool->tail) pool->tail->next = b; else pool->head = b;
    pool->tail = b;
    /* wake one worker, which wakes more while pieces are left (wake_next); never every worker: a one-block read
     * woke all of them to fight over the lock, which cost ~0.3 ms per small read on a 2-core host
     * (docs/benchmarks.md) */
    int wake = pool->idle - pool->waking > 0;
    pool->waking += wake;
    pthread_mutex_unlock(&pool->mu);
    if (wake) pthread_cond_signal(&pool->work_cv);
    return b;
}

/* XXH3-64 (seed 0) of n rows of row_bytes bytes, the first at base and each `stride` bytes after the last. */
void tkv_xxh3_rows(const char *base, int64_t stride, int64_t row_bytes, int64_t n, uint64_t *out) {
    for (int64_t i = 0; i < n; i++) out[i] = tkv_xxh3(base + i * stride, (size_t)row_bytes);
}

int tkv_done(void *p, void *bp) {
    tkv_pool *pool = (tkv_pool *)p;
    pthread_mutex_lock(&pool->mu);
    int done = ((tkv_batch *)bp)->pieces_left == 0;
    pthread_mutex_unlock(&pool->mu);
    return done;
}

/* Block until the batch finished. Return the index of the first failed request (its code in *err),
 * or -1 if every request succeeded. */
int64_t tkv_wait(void *p, void *bp, int32_t *err) {
    tkv_pool *pool = (tkv_pool *)p;
    tkv_batch *b = (tkv_batch *)bp;
    pthread_mutex_lock(&pool->mu);
    while (b->pieces_left > 0) pthread_cond_wait(&b->done_cv, &pool->mu);
    pthread_mutex_unlock(&pool->mu);
    for (int64_t i = 0; i < b->n_req; i++) {
        if (b->errs[i] != 0) {
            *err = b->errs[i];
            return i;
        }
    }
    *err = 0;
    return -1;
}

/* Free a finished batch (call tkv_wait first). */
void tkv_batch_free(void *bp) {
    tkv_batch *b = (tkv_batch *)bp;
    pthread_cond_destroy(&b->done_cv);
    free(b->offsets); free(b->lengths); free(b->addrs); free(b->errs); free(b->unit_base); free(b);
}

/* Rounds read through a ring of buffer pieces and handed, each as soon as it landed and was verified, to a consumer
 * (tierkv.tiers.disk._DiskRead.consume_rounds): the loop of _DiskRead.each_round in C, so that a read of many
 * rounds whose consumer is a C kernel (split attention over a bounce buffer) runs no Python per round. Round k
 * lands in piece k % ring; rounds [0, given) were submitted by the caller (their batches in `given_batches`, waited
 * here but freed by the caller), each later round is submitted here into the piece of round k - 1 once round k was
 * reached (the consumer has left that piece), exactly as each_round does. Every round is verified (its digests
 * against `expected`) before the consumer sees it; the first failure stops the loop, and every batch submitted here
 * is waited for and freed before returning, so nothing lands in the pieces afterwards. */
typedef int (*tkv_consumer)(const char *args);

enum { TKV_ROUND_OK = 0, TKV_ROUND_IO = 1, TKV_ROUND_DIGEST = 2, TKV_ROUND_CONSUMER = 3, TKV_ROUND_NOMEM = 4 };

typedef struct {
    int64_t rounds, ring, given, fd, chunk, unit;
    uint64_t pool;
    uint64_t request_start;  /* int64 [rounds + 1]: round k's requests are [request_start[k], request_start[k+1]) */
    uint64_t offsets, lengths; /* int64 per request: file offset and length */
    uint64_t within;         /* uint64 per request: its byte offset in the round's piece */
    uint64_t pieces;         /* uint64 [ring]: the pieces' addresses */
    uint64_t digests;        /* uint64 [rounds]: where each round's digests land (given rounds: their batch's) */
    uint64_t unit_start;     /* int64 [rounds + 1]: round k's digests are expected[unit_start[k] .. unit_start[k+1]) */
    uint64_t expected;       /* uint64 per unit: the digests written */
    uint64_t given_batches;  /* uint64 [given]: the caller's batches (0: one already waited for) */
    uint64_t consumer;       /* a tkv_consumer */
    uint64_t consumer_args;  /* uint64 [rounds]: its argument for each round */
    /* written back: the round that failed (-1: none), what failed (TKV_ROUND_*), the errno / TKV_EOF or the
     * consumer's status, the failed request (absolute index), the nanoseconds spent waiting for rounds */
    int64_t failed, kind, code, request, waited_ns;
} tkv_rounds_args;

int64_t tkv_rounds_args_size(void) { return (int64_t)sizeof(tkv_rounds_args); }

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

int tkv_rounds(char *packed) {
    tkv_rounds_args a;
    memcpy(&a, packed, sizeof a);
    if (a.rounds < 0 || a.ring < 1 || a.given < 0 || a.given > a.rounds || !a.pool || !a.consumer) return -1;
    const int64_t *starts = (const int64_t *)(uintptr_t)a.request_start, *offsets = (const int64_t *)(uintptr_t)a.offsets;
    const int64_t *lengths = (const int64_t *)(uintptr_t)a.lengths, *units = (const int64_t *)(uintptr_t)a.unit_start;
    const uint64_t *within = (const uint64_t *)(uintptr_t)a.within, *pieces = (const uint64_t *)(uintptr_t)a.pieces;
    const uint64_t *digests = (const uint64_t *)(uintptr_t)a.digests, *expected = (const uint64_t *)(uintptr_t)a.expected;
    const uint64_t *given = (const uint64_t *)(uintptr_t)a.given_batches;
    const uint64_t *args = (const uint64_t *)(uintptr_t)a.consumer_args;
    const tkv_consumer consume = (tkv_consumer)(uintptr_t)a.consumer;
    void *pool = (void *)(uintptr_t)a.pool;
    int64_t most = 0; /* requests of the largest round: the scratch of absolute addresses */
    for (int64_t k = 0; k < a.rounds; k++)
        if (starts[k + 1] - starts[k] > most) most = starts[k + 1] - starts[k];
    void **mine = calloc((size_t)(a.rounds > 0 ? a.rounds : 1), sizeof(void *)); /* batches submitted here */
    uint64_t *addrs = malloc((size_t)(most > 0 ? most : 1) * sizeof(uint64_t));
    a.failed = -1;
    a.kind = a.code = a.request = a.waited_ns = 0;
    if (!mine || !addrs) {
        a.failed = 0;
        a.kind = TKV_ROUND_NOMEM;
    }
    for (int64_t k = 0; a.failed < 0 && k < a.rounds; k++) {
        const int64_t next = k + a.ring - 1;
        if (k > 0 && next < a.rounds && next >= a.given) { /* into the piece of round k - 1, left by the consumer */
            const int64_t first = starts[next], n = starts[next + 1] - first;
            for (int64_t i = 0; i < n; i++) addrs[i] = pieces[next % a.ring] + within[first + i];
            mine[next] = n ? tkv_submit(pool, (int)a.fd, 0, a.chunk, n, offsets + first, lengths + first, addrs,
                                        a.unit, (uint64_t *)(uintptr_t)digests[next])
                           : NULL;
            if (n && !mine[next]) {
                a.failed = next;
                a.kind = TKV_ROUND_NOMEM;
                break;
            }
        }
        void *batch = k < a.given ? (void *)(uintptr_t)given[k] : mine[k];
        if (batch) {
            int32_t err = 0;
            const int64_t begun = now_ns();
            const int64_t bad = tkv_wait(pool, batch, &err);
            a.waited_ns += now_ns() - begun;
            if (k >= a.given) {
                tkv_batch_free(batch);
                mine[k] = NULL;
            }
            if (bad >= 0) {
                a.failed = k;
                a.kind = TKV_ROUND_IO;
                a.code = err;
                a.request = starts[k] + bad;
                break;
            }
        }
        const uint64_t *landed = (const uint64_t *)(uintptr_t)digests[k];
        for (int64_t u = units[k]; u < units[k + 1]; u++)
            if (landed[u - units[k]] != expected[u]) {
                a.failed = k;
                a.kind = TKV_ROUND_DIGEST;
                break;
            }
        if (a.failed >= 0) break;
        const int status = consume((const char *)(uintptr_t)args[k]);
        if (status) {
            a.failed = k;
            a.kind = TKV_ROUND_CONSUMER;
            a.code = status;
        }
    }
    for (int64_t k = 0; mine && k < a.rounds; k++) /* in flight after a failure: landed before returning */
        if (mine[k]) {
            int32_t err;
            tkv_wait(pool, mine[k], &err);
            tkv_batch_free(mine[k]);
        }
    for (int64_t k = 0; k < a.given; k++) /* the caller's batches: landed too (the caller frees them) */
        if (given[k]) {
            int32_t err;
            tkv_wait(pool, (void *)(uintptr_t)given[k], &err);
        }
    free(mine);
    free(addrs);
    memcpy(packed, &a, sizeof a);
    return 0;
}
