/* One-pass copy and checksum partial sums for rlix_plugins.transport._checksum (its module docstring defines
 * the checksum): the bytes are read once from src and written once to dst, and each row's words are summed from
 * the same loads, so the checksums cost no extra trip through memory.
 *
 * Built by _native_checksum.py with the system C compiler (-O3 [-march=native] -pthread); the row loop is plain
 * C that gcc and clang vectorise, plus an AVX2 twin with streaming stores for large copies. All arithmetic is
 * uint32, wrapping modulo 2**32 as the definition's int32 sums do.
 */
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && !defined(__clang__)
/* gcc would otherwise split the row loop into one memcpy of all rows plus a loop that reads src a second time */
#pragma GCC optimize("no-tree-loop-distribute-patterns")
#endif

#define ROW_WORDS 128
#define ROW_BYTES (4 * ROW_WORDS)

/* a word at any address (src and dst need not be 4-byte aligned): compiled to plain unaligned vector loads */
typedef uint32_t word_any __attribute__((aligned(1), may_alias));

/* Copy one 512-byte row, add each word to its column, return the row's word sum. */
static inline uint32_t copy_row(const uint8_t *restrict src, uint8_t *restrict dst, uint32_t *restrict cols) {
    const word_any *s = (const word_any *)src;
    word_any *d = (word_any *)dst;
    uint32_t sum = 0;
    for (int j = 0; j < ROW_WORDS; j++) {
        uint32_t w = s[j];
        d[j] = w;
        cols[j] += w;
        sum += w;
    }
    return sum;
}

#if defined(__AVX2__)
#include <immintrin.h>
/* Copies at least this large store past the caches (non-temporal stores): a plain store first reads the
 * destination line into the cache, a third trip through memory that the bucket's bytes never repay (they are
 * read next by a transfer, long after the copy). Smaller copies stay in the caches, where stores are cheaper. */
#define STREAM_MIN_BYTES (1u << 20)

/* copy_row with non-temporal stores; dst must be 32-byte aligned. */
static inline uint32_t stream_row(const uint8_t *restrict src, uint8_t *restrict dst, uint32_t *restrict cols) {
    __m256i sum = _mm256_setzero_si256();
    for (int v = 0; v < ROW_WORDS / 8; v++) {
        __m256i w = _mm256_loadu_si256((const __m256i *)(src + 32 * v));
        _mm256_stream_si256((__m256i *)(dst + 32 * v), w);
        __m256i *col = (__m256i *)(cols + 8 * v);
        _mm256_store_si256(col, _mm256_add_epi32(_mm256_load_si256(col), w));
        sum = _mm256_add_epi32(sum, w);
    }
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return (uint32_t)_mm_cvtsi128_si32(s);
}
#endif

/* Copy nbytes from src to dst and zero dst[nbytes:padded_bytes] (padded_bytes: nbytes rounded up to a whole
 * row, or more whole rows). out[0] = word sum, out[1] = sum over rows k of (first_row + k + 1) * rowsum_k,
 * out[2 + j] = sum of column j, all over the padded words. src and dst must not overlap; any alignment. */
void rlix_copy_sums(const uint8_t *restrict src, uint8_t *restrict dst, size_t nbytes, size_t padded_bytes,
                    uint64_t first_row, uint32_t *restrict out) {
    uint32_t cols[ROW_WORDS] __attribute__((aligned(64))) = {0};
    uint32_t word_sum = 0, row_weighted = 0;
    uint32_t weight = (uint32_t)(first_row + 1);
    size_t full = nbytes / ROW_BYTES, k = 0;
#if defined(__AVX2__)
    if (nbytes >= STREAM_MIN_BYTES && (uintptr_t)dst % 32 == 0) {
        for (; k < full; k++, weight++) {
            uint32_t s = stream_row(src + k * ROW_BYTES, dst + k * ROW_BYTES, cols);
            word_sum += s;
            row_weighted += weight * s;
        }
        _mm_sfence(); /* order the streamed stores before whatever the caller does next */
    }
#endif
    for (; k < full; k++, weight++) {
        uint32_t s = copy_row(src + k * ROW_BYTES, dst + k * ROW_BYTES, cols);
        word_sum += s;
        row_weighted += weight * s;
    }
    size_t done = full * ROW_BYTES;
    if (done < nbytes) { /* the last row is part src bytes, part zero padding: sum a zero-padded local copy */
        uint8_t tail[ROW_BYTES] __attribute__((aligned(64)));
        memset(tail, 0, ROW_BYTES);
        memcpy(tail, src + done, nbytes - done);
        uint32_t s = copy_row(tail, dst + done, cols);
        word_sum += s;
        row_weighted += weight * s;
        done += ROW_BYTES;
    }
    if (done < padded_bytes) /* whole zero rows add nothing to the sums */
        memset(dst + done, 0, padded_bytes - done);
    out[0] = word_sum;
    out[1] = row_weighted;
    memcpy(out + 2, cols, sizeof cols);
}

/* ---- the parallel form: the caller and a persistent pool of threads split the rows into chunks ----
 * One memory-bound core cannot reach the machine's copy bandwidth. The pool lives here, not in Python: a Python
 * thread pool pays a GIL hand-off and a wake-up per chunk, which on 16 cores costs as much as the copy itself. */

static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER; /* guards job, generation, busy, workers */
static pthread_cond_t pool_wake = PTHREAD_COND_INITIALIZER, pool_idle = PTHREAD_COND_INITIALIZER;
static pthread_mutex_t job_mu = PTHREAD_MUTEX_INITIALIZER; /* one parallel copy at a time */
static struct {
    const uint8_t *src;
    uint8_t *dst;
    size_t nbytes, rows;
    unsigned chunks;
    uint32_t *out;
} job;
static unsigned long generation; /* bumped per job: a worker wakes when it differs from the last one it saw */
static unsigned next_chunk, busy, workers;

/* Take chunks of the current job until none is left; add each chunk's sums into job.out. */
static void run_chunks(void) {
    for (;;) {
        unsigned i = __atomic_fetch_add(&next_chunk, 1, __ATOMIC_RELAXED);
        if (i >= job.chunks)
            return;
        size_t lo = job.rows * i / job.chunks * ROW_BYTES, hi = job.rows * (i + 1) / job.chunks * ROW_BYTES;
        size_t n = job.nbytes <= lo ? 0 : job.nbytes < hi ? job.nbytes - lo : hi - lo;
        uint32_t part[2 + ROW_WORDS];
        rlix_copy_sums(job.src + lo, job.dst + lo, n, hi - lo, lo / ROW_BYTES, part);
        for (int j = 0; j < 2 + ROW_WORDS; j++) /* modular sums: the order chunks finish in cannot matter */
            __atomic_fetch_add(&job.out[j], part[j], __ATOMIC_RELAXED);
    }
}

static void *worker(void *arg) {
    unsigned long seen = (unsigned long)(uintptr_t)arg;
    pthread_mutex_lock(&pool_mu);
    for (;;) {
        while (generation == seen)
            pthread_cond_wait(&pool_wake, &pool_mu);
        seen = generation;
        busy++; /* counted before it touches the job: the caller waits for busy == 0 */
        pthread_mutex_unlock(&pool_mu);
        run_chunks();
        pthread_mutex_lock(&pool_mu);
        if (--busy == 0)
            pthread_cond_broadcast(&pool_idle);
    }
    return NULL;
}

static void after_fork_in_child(void) { /* a forked child has none of the parent's threads */
    pthread_mutex_init(&pool_mu, NULL);
    pthread_mutex_init(&job_mu, NULL);
    pthread_cond_init(&pool_wake, NULL);
    pthread_cond_init(&pool_idle, NULL);
    busy = workers = 0;
}

/* rlix_copy_sums over the whole tensor (first row 0) in `chunks` row-aligned chunks run by the caller and up to
 * chunks - 1 pool threads (started at first need, kept for later calls); out: the combined [2 + 128] sums.
 * While another thread's parallel copy holds the pool, this one runs on the caller alone. */
void rlix_copy_sums_parallel(const uint8_t *src, uint8_t *dst, size_t nbytes, size_t padded_bytes, unsigned chunks,
                             uint32_t *out) {
    if (chunks < 2 || pthread_mutex_trylock(&job_mu) != 0) {
        rlix_copy_sums(src, dst, nbytes, padded_bytes, 0, out);
        return;
    }
    memset(out, 0, (2 + ROW_WORDS) * sizeof *out);
    pthread_mutex_lock(&pool_mu);
    static int at_fork;
    if (!at_fork)
        at_fork = pthread_atfork(NULL, NULL, after_fork_in_child) == 0;
    while (busy) /* a worker that woke late for the last job may still be looking at it */
        pthread_cond_wait(&pool_idle, &pool_mu);
    while (workers < chunks - 1) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&thread, &attr, worker, (void *)(uintptr_t)generation);
        pthread_attr_destroy(&attr);
        if (failed)
            break; /* fewer helpers: the caller takes more chunks */
        workers++;
    }
    job.src = src, job.dst = dst, job.nbytes = nbytes, job.rows = padded_bytes / ROW_BYTES;
    job.chunks = chunks, job.out = out;
    next_chunk = 0;
    generation++;
    pthread_cond_broadcast(&pool_wake);
    pthread_mutex_unlock(&pool_mu);
    run_chunks();
    pthread_mutex_lock(&pool_mu);
    while (busy)
        pthread_cond_wait(&pool_idle, &pool_mu);
    pthread_mutex_unlock(&pool_mu);
    pthread_mutex_unlock(&job_mu);
}
