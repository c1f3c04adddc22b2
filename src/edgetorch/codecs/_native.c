/* edgetorch.codecs._native: the CPU kernels of the codecs (bitmap, per-row top-k, 1-bit mask,
 * integer narrowing, quantized) as a small CPython extension in C99 with POSIX threads.
 *
 * Nothing here knows about torch: the Python side (codecs/_cpu_kernels.py) allocates every
 * buffer as a torch tensor and passes its address, length and element width as Python ints.
 * Every kernel but the quantized codec's works on the integer view of a float tensor (16, 32 or
 * 64 bits), so one compiled variant per width serves float16, bfloat16, float32 and float64, and
 * no float is compared: zero, NaN and order are decided on bit patterns (see _native_kernels.h).
 * The quantized codec computes in float32 as its torch reference does (see its section below).
 *
 * Work is split into chunks of CHUNK_BYTES bitmap bytes (8 * CHUNK_BYTES elements). Packing
 * counts each chunk's kept elements first and compacts second, so the values buffer is
 * allocated at its exact size and each chunk knows where its values start.
 *
 * Threads: a pool of detached pthreads that sleep on a condition variable, and an atomic chunk
 * counter per job. The caller claims chunks like any worker, so a share no worker has started
 * is done by the caller; at the end it waits only for chunks a worker is already running,
 * never for a worker to get a core (on a loaded 2-core machine, numba's OpenMP workers made a
 * 1,000-element pack take 32 ms instead of 32 us waiting at a barrier). Neither side spins. A
 * Python thread pool calling GIL-free C per chunk range would have worked too, but each hand-off
 * costs tens of microseconds of interpreter time, which is what a call on a mid-size tensor
 * takes in all; native threads cost one futex wake. The GIL is released while kernels run.
 * After fork() the child has none of the parent's threads: pthread_atfork resets the pool and
 * the child starts new workers on demand.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_AVX2_KERNELS 1
#else
#define HAVE_AVX2_KERNELS 0
#endif

#define NATIVE_ABI 2 /* 2: quantize, dequantize */
#define CHUNK_BYTES 4096                /* 32 Ki elements: a chunk's input stays in L2 while it is read twice */
#define CHUNK_ELEMS (8 * CHUNK_BYTES)
#define MIN_CHUNKS_PER_THREAD 2         /* below that, waking a worker costs what it saves */
#define GIL_FREE_MIN_ELEMS 16384        /* smaller calls finish before another thread could use the GIL */
#define MAX_WORKERS 255

/* ---------------------------------------------------------------------------------------------
 * Tables shared by the kernels (filled once at import)
 */

static uint8_t POP8[256];         /* set bits of a byte */
static uint8_t RANK8[256][8];     /* [byte][j]: set bits of byte below bit j */
static uint8_t COMPRESS8[256][8]; /* [byte][k]: position of the k-th set bit (0 past the last) */
static uint8_t SHUF16C[256][16];  /* pshufb: the set 16-bit lanes of a byte's 8 elements, packed */
static uint8_t SHUF16E[256][16];  /* pshufb: packed 16-bit values spread to the set lanes, 0 elsewhere */
static int32_t IDX64C[16][8];     /* permutevar8x32: the set 64-bit lanes of a nibble, packed */
static int32_t IDX64E[16][8];     /* permutevar8x32: packed 64-bit values spread to the set lanes */

static void fill_tables(void) {
    for (int byte = 0; byte < 256; byte++) {
        int pop = 0;
        for (int j = 0; j < 8; j++) {
            RANK8[byte][j] = (uint8_t)pop;
            if ((byte >> j) & 1) {
                COMPRESS8[byte][pop] = (uint8_t)j;
                SHUF16C[byte][2 * pop] = (uint8_t)(2 * j);
                SHUF16C[byte][2 * pop + 1] = (uint8_t)(2 * j + 1);
                SHUF16E[byte][2 * j] = (uint8_t)(2 * pop);
                SHUF16E[byte][2 * j + 1] = (uint8_t)(2 * pop + 1);
                pop++;
            } else {
                SHUF16E[byte][2 * j] = SHUF16E[byte][2 * j + 1] = 0x80;
            }
        }
        POP8[byte] = (uint8_t)pop;
        for (int k = pop; k < 8; k++) {
            COMPRESS8[byte][k] = 0;
            SHUF16C[byte][2 * k] = SHUF16C[byte][2 * k + 1] = 0x80;
        }
    }
    for (int nib = 0; nib < 16; nib++) {
        int pop = 0;
        for (int j = 0; j < 4; j++) {
            IDX64E[nib][2 * j] = 2 * pop;
            IDX64E[nib][2 * j + 1] = 2 * pop + 1;
            if ((nib >> j) & 1) {
                IDX64C[nib][2 * pop] = 2 * j;
                IDX64C[nib][2 * pop + 1] = 2 * j + 1;
                pop++;
            }
        }
        for (int k = pop; k < 4; k++) IDX64C[nib][2 * k] = IDX64C[nib][2 * k + 1] = 0;
    }
}

/* ---------------------------------------------------------------------------------------------
 * Kernels: the portable set, and on x86-64 copies compiled for AVX2 (with F16C) and for AVX-512F,
 * chosen at run time from what the CPU supports, so the extension runs on any x86-64 and needs no
 * -march
 */

#define FLAG_BLOCK 512 /* elements whose 0/1 flags the portable loops gather before packing bits */

/* Eight 0/1 flags (bytes) as one bitmap byte, flag j -> bit j. As one little-endian word, the
 * multiply moves flag j to bit 56 + j and no two partial products meet, so nothing carries (a
 * portable movemask); elsewhere the bytes are assembled one by one. */
static inline uint8_t flags_to_byte(const uint8_t *f) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    uint64_t w;
    memcpy(&w, f, 8);
    return (uint8_t)((w * 0x0102040810204080ULL) >> 56);
#else
    return (uint8_t)(f[0] | f[1] << 1 | f[2] << 2 | f[3] << 3 | f[4] << 4 | f[5] << 5 | f[6] << 6 | f[7] << 7);
#endif
}

/* ---------------------------------------------------------------------------------------------
 * The quantized codec (quantized.py's module docstring is the format). Unlike the other codecs
 * it is float arithmetic: float32, one IEEE rounding per operation in the reference's order, so
 * the bytes equal the torch ops'. Hence -ffp-contract=off in setup.py (a fused multiply-add
 * rounds once where the reference rounds twice) and no -ffast-math. Conversions between float32
 * and the 16-bit formats are written out below: exact, and vectorisable on every instruction set
 * (the portable build has no F16C).
 */

typedef struct {
    int64_t n, group, groups; /* elements a row, per group, groups a row */
    int64_t row_bytes;        /* ceil(n * bits / 8) */
    int bits, bf16;           /* bf16: 16-bit elements are bfloat16, else float16 */
    int stochastic;
    uint32_t seed_mix;        /* mix32(seed) */
    uint32_t nan16;           /* dequantize: the 16-bit NaN torch's .to() writes (it varies by build) */
    uint8_t *codes;
    float *lo, *scale;
} quant_params;

#define QBLOCK 256          /* the portable loops make (or unpack) 4- and 2-bit codes this many at a time */
#define F32_NAN 0x7FC00000u /* what torch writes for float("nan"): a non-finite group's lo and scale */
#define ALWAYS_INLINE static inline __attribute__((always_inline))

static inline uint32_t f32_bits(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    return b;
}

static inline float f32_from(uint32_t b) {
    float f;
    memcpy(&f, &b, 4);
    return f;
}

/* float16 bits -> float32, exact: a normal half is its bits with the exponent rebiased (+112),
 * a subnormal half is its 10-bit mantissa times 2^-24 (an exact int -> float conversion and a
 * power-of-two product: no subnormal float is touched, so DAZ/FTZ modes cannot change it).
 * The three cases are selected with masks, not ?: (which compilers turn into branches here, and
 * then leave the loop scalar: 15x slower). */
static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = h & 0x7C00u, mag = (uint32_t)(h & 0x7FFF) << 13;
    uint32_t sub = f32_bits((float)(int32_t)(h & 0x3FF) * 0x1p-24f);
    uint32_t is_sub = 0u - (uint32_t)(exp == 0), is_special = 0u - (uint32_t)(exp == 0x7C00u);
    uint32_t normal = (mag + (112u << 23)) & ~(is_sub | is_special);
    return f32_from((sub & is_sub) | ((mag | 0x7F800000u) & is_special) | normal | sign);
}

/* float32 -> float16 bits, rounded to nearest even as F16C and torch do; NaN -> nan16. At or
 * above 2^-14 (a normal half): rebias the exponent and round away 13 mantissa bits (a carry may
 * step into the next exponent, up to Inf); below it, adding 0.5f leaves the value in units of
 * 2^-24, the subnormal half's unit, rounded to nearest even by the addition itself. Selected with
 * masks, as above. */
static inline uint16_t f32_to_f16(float f, uint32_t nan16) {
    uint32_t b = f32_bits(f), a = b & 0x7FFFFFFFu, sign = (b >> 16) & 0x8000u;
    uint32_t t = a - (112u << 23);
    uint32_t normal = (t + 0xFFFu + ((t >> 13) & 1u)) >> 13;
    normal = normal < 0x7C00u ? normal : 0x7C00u;
    uint32_t sub = f32_bits(f32_from(a) + 0.5f) - 0x3F000000u;
    uint32_t is_normal = 0u - (uint32_t)(a >= 0x38800000u), is_nan = 0u - (uint32_t)(a > 0x7F800000u);
    uint32_t h = ((normal & is_normal) | (sub & ~is_normal)) | sign;
    return (uint16_t)((nan16 & is_nan) | (h & ~is_nan));
}

/* float32 -> bfloat16 bits, rounded to nearest even; NaN -> nan16. */
static inline uint16_t f32_to_bf16(float f, uint32_t nan16) {
    uint32_t b = f32_bits(f);
    uint32_t r = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
    return (uint16_t)((b & 0x7FFFFFFFu) > 0x7F800000u ? nan16 : r);
}

/* quantized._mix32: a 32-bit integer finaliser (products wrap mod 2^32 as the reference's masks) */
static inline uint32_t mix32(uint32_t h) {
    h ^= h >> 16;
    h *= 0x7FEB352Du;
    h ^= h >> 15;
    h *= 0x2C1B3C6Du;
    return h ^ (h >> 16);
}

/* quantized._hash_uniform: a float32 in [0, 1) for the element of row-major index idx (mod 2^32) */
static inline float hash_uniform(uint32_t idx, uint32_t seed_mix) {
    return (float)(int32_t)(mix32(idx ^ seed_mix) >> 8) * 0x1p-24f;
}

/* Kernels that do not depend on the element width, compiled once per instruction set. */
#define BYTE_KERNELS(ISA)                                                                          \
    static int64_t popcount_##ISA(const uint8_t *p, int64_t len) {                                 \
        int64_t total = 0, i = 0;                                                                  \
        for (; i + 8 <= len; i += 8) {                                                             \
            uint64_t w;                                                                            \
            memcpy(&w, p + i, 8);                                                                  \
            total += __builtin_popcountll(w);                                                      \
        }                                                                                          \
        for (; i < len; i++) total += POP8[p[i]];                                                  \
        return total;                                                                              \
    }                                                                                              \
    /* bool bytes (0/1) [8 b0, min(8 b1, n)) as bits */                                            \
    static void bits_pack_##ISA(const uint8_t *src, int64_t b0, int64_t b1, int64_t n, uint8_t *bm) { \
        int64_t full = n >> 3, bend = b1 < full ? b1 : full, b = b0;                               \
        for (; b < bend; b++) {                                                                    \
            uint8_t f[8];                                                                          \
            for (int j = 0; j < 8; j++) f[j] = src[8 * b + j] != 0;                                \
            bm[b] = flags_to_byte(f);                                                              \
        }                                                                                          \
        if (b < b1) {                                                                              \
            unsigned byte = 0;                                                                     \
            for (int64_t i = 8 * b; i < n; i++) byte |= (unsigned)(src[i] != 0) << (i & 7);        \
            bm[b] = (uint8_t)byte;                                                                 \
        }                                                                                          \
    }

typedef struct {
    void (*build_range)(const void *x, int64_t s, int64_t e, uint64_t limit, uint8_t *bm);
    void (*compact)(const void *x, const uint8_t *bm, int64_t b0, int64_t b1, int64_t n, void *out, int64_t count);
    void (*scatter)(const uint8_t *bm, int64_t b0, int64_t b1, int64_t n, const void *vals, int64_t o,
                    int64_t nvals, void *out);
    void (*mask_pack)(const void *x, int64_t b0, int64_t b1, int64_t n, int64_t lo, int64_t hi, uint8_t *bm);
    void (*mask_unpack)(const uint8_t *bm, int64_t b0, int64_t b1, int64_t n, uint64_t a, uint64_t c, void *out);
    void (*minmax)(const void *x, int64_t s, int64_t e, int64_t *lo, int64_t *hi);
    void (*convert)(const void *x, int64_t s, int64_t e, void *y, int out_bits);
    int (*select_row)(const void *x, int64_t n, int64_t keep, int64_t *st);
    void (*quantize)(const void *x, const quant_params *q, int64_t g0, int64_t g1);
    void (*dequantize)(const quant_params *q, void *out, int64_t g0, int64_t g1);
} width_ops;

typedef struct {
    const char *name;
    int64_t (*popcount)(const uint8_t *p, int64_t len);
    void (*bits_pack)(const uint8_t *src, int64_t b0, int64_t b1, int64_t n, uint8_t *bm);
    width_ops w[3]; /* 16, 32, 64 bits */
} isa_ops;

#define OPS_OF(WBITS, ISA)                                                                          \
    {build_range_##WBITS##_##ISA, compact_##WBITS##_##ISA, scatter_##WBITS##_##ISA,                 \
     mask_pack_##WBITS##_##ISA,   mask_unpack_##WBITS##_##ISA, minmax_##WBITS##_##ISA,              \
     convert_##WBITS##_##ISA,     select_row_##WBITS##_##ISA,  quantize_##WBITS##_##ISA,                \
     dequantize_##WBITS##_##ISA}

BYTE_KERNELS(generic)
#define ISA generic
#define ISA_AVX2 0
#define ISA_AVX512 0
#include "_native_widths.h"

static const isa_ops GENERIC_OPS = {
    "generic", popcount_generic, bits_pack_generic, {OPS_OF(16, generic), OPS_OF(32, generic), OPS_OF(64, generic)}};

#if HAVE_AVX2_KERNELS
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,popcnt,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,popcnt,f16c")
#endif
BYTE_KERNELS(avx2)
#define ISA avx2
#define ISA_AVX2 1
#define ISA_AVX512 0
#include "_native_widths.h"
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
static const isa_ops AVX2_OPS = {
    "avx2", popcount_avx2, bits_pack_avx2, {OPS_OF(16, avx2), OPS_OF(32, avx2), OPS_OF(64, avx2)}};

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,popcnt,f16c,avx512f"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,popcnt,f16c,avx512f")
#endif
BYTE_KERNELS(avx512)
#define ISA avx512
#define ISA_AVX2 1
#define ISA_AVX512 1
#include "_native_widths.h"
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
static const isa_ops AVX512_OPS = {
    "avx512", popcount_avx512, bits_pack_avx512, {OPS_OF(16, avx512), OPS_OF(32, avx512), OPS_OF(64, avx512)}};
#endif

static const isa_ops *ops = &GENERIC_OPS;

static int width_index(long long width_bytes) {
    return width_bytes == 2 ? 0 : width_bytes == 4 ? 1 : width_bytes == 8 ? 2 : -1;
}

/* ---------------------------------------------------------------------------------------------
 * Huge-page advice: a fresh buffer costs one page fault per 4 KiB on first write, which
 * dominates a pass at memory speed (10M fp32: ~12 ms of faults against ~3 ms of copying). Like
 * numpy, ask for transparent huge pages on large buffers, before their first write. Above
 * 32 MiB glibc always serves a block from its own mapping, so the advice cannot spill onto heap
 * memory that other allocations share.
 */

static int64_t hugepage_min_bytes = (int64_t)32 << 20;
static long page_size = 4096;

static void advise_hugepages(void *p, int64_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (bytes < hugepage_min_bytes || hugepage_min_bytes < 0) return;
    uintptr_t start = ((uintptr_t)p + (uintptr_t)page_size - 1) / (uintptr_t)page_size * (uintptr_t)page_size;
    uintptr_t end = ((uintptr_t)p + (uintptr_t)bytes) / (uintptr_t)page_size * (uintptr_t)page_size;
    if (end > start) (void)madvise((void *)start, end - start, MADV_HUGEPAGE); /* advice: failure changes nothing */
#else
    (void)p;
    (void)bytes;
#endif
}

/* ---------------------------------------------------------------------------------------------
 * Thread pool
 */

typedef void (*task_fn)(void *ctx, int64_t task);

typedef struct {
    task_fn fn;
    void *ctx;
    int64_t n_tasks;
    int64_t next; /* atomic: next task to claim */
    int64_t done; /* atomic: tasks finished */
    int refs;     /* under pool.lock: the caller plus workers that joined */
    uint64_t gen;
} job_t;

static struct {
    pthread_mutex_t lock;
    pthread_cond_t work;     /* workers wait here for a job */
    pthread_cond_t finished; /* the caller waits here for the last running task */
    job_t *job;              /* the job workers may join, or NULL */
    uint64_t gen;
    int workers;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER, NULL, 0, 0};

static void run_tasks(job_t *job) {
    for (;;) {
        int64_t t = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED);
        if (t >= job->n_tasks) return;
        job->fn(job->ctx, t);
        if (__atomic_add_fetch(&job->done, 1, __ATOMIC_ACQ_REL) == job->n_tasks) {
            pthread_mutex_lock(&pool.lock);
            pthread_cond_broadcast(&pool.finished);
            pthread_mutex_unlock(&pool.lock);
        }
    }
}

static void *worker_main(void *arg) {
    (void)arg;
    uint64_t seen = 0;
    pthread_mutex_lock(&pool.lock);
    for (;;) {
        while (pool.job == NULL || pool.job->gen == seen) pthread_cond_wait(&pool.work, &pool.lock);
        job_t *job = pool.job;
        seen = job->gen;
        job->refs++;
        pthread_mutex_unlock(&pool.lock);
        run_tasks(job);
        pthread_mutex_lock(&pool.lock);
        if (--job->refs == 0) free(job);
    }
    return NULL;
}

/* Start workers until there are `want`; called with pool.lock held. Workers block every signal,
 * so Python's handlers keep running on the main thread. */
static void start_workers(int want) {
    if (want > MAX_WORKERS) want = MAX_WORKERS;
    if (pool.workers >= want) return;
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, (size_t)1 << 20);
    while (pool.workers < want) {
        pthread_t t;
        if (pthread_create(&t, &attr, worker_main, NULL) != 0) break; /* fewer helpers: still correct */
        pool.workers++;
    }
    pthread_attr_destroy(&attr);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
}

static void atfork_prepare(void) { pthread_mutex_lock(&pool.lock); }
static void atfork_parent(void) { pthread_mutex_unlock(&pool.lock); }
static void atfork_child(void) {
    /* The child has only the forking thread: no workers, and any job in flight belongs to the
     * parent. Fresh synchronisation objects; a job block owned by the parent's threads is left
     * behind (a few bytes). */
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.work, NULL);
    pthread_cond_init(&pool.finished, NULL);
    pool.job = NULL;
    pool.workers = 0;
}

/* Run fn(ctx, t) for t in [0, n_tasks) on up to `threads` threads, the caller included, giving
 * each thread at least min_per_thread tasks. */
static void parallel_for(int64_t n_tasks, long long threads, int64_t min_per_thread, task_fn fn, void *ctx) {
    if (n_tasks <= 0) return;
    long long useful = n_tasks / min_per_thread;
    if (threads > useful) threads = useful;
    if (threads > MAX_WORKERS + 1) threads = MAX_WORKERS + 1;
    job_t *job = threads > 1 ? (job_t *)malloc(sizeof(job_t)) : NULL;
    if (job != NULL) {
        job->fn = fn;
        job->ctx = ctx;
        job->n_tasks = n_tasks;
        job->next = 0;
        job->done = 0;
        job->refs = 1;
        pthread_mutex_lock(&pool.lock);
        if (pool.job != NULL) { /* another caller's job is in flight: work alone, don't queue */
            pthread_mutex_unlock(&pool.lock);
            free(job);
            job = NULL;
        } else {
            start_workers((int)threads - 1);
            job->gen = ++pool.gen;
            pool.job = job;
            for (long long i = 1; i < threads; i++) pthread_cond_signal(&pool.work);
            pthread_mutex_unlock(&pool.lock);
        }
    }
    if (job == NULL) {
        for (int64_t t = 0; t < n_tasks; t++) fn(ctx, t);
        return;
    }
    run_tasks(job);
    pthread_mutex_lock(&pool.lock);
    while (__atomic_load_n(&job->done, __ATOMIC_ACQUIRE) < n_tasks) pthread_cond_wait(&pool.finished, &pool.lock);
    pool.job = NULL;
    if (--job->refs == 0) free(job);
    pthread_mutex_unlock(&pool.lock);
}

/* Run fn(ctx, t) for t in [0, n_tasks): on up to `threads` threads with the GIL released when
 * the call covers at least GIL_FREE_MIN_ELEMS elements, else on this thread alone. */
static void dispatch_tasks(int64_t elems, int64_t n_tasks, long long threads, task_fn fn, void *ctx) {
    if (elems >= GIL_FREE_MIN_ELEMS) {
        Py_BEGIN_ALLOW_THREADS parallel_for(n_tasks, threads, MIN_CHUNKS_PER_THREAD, fn, ctx);
        Py_END_ALLOW_THREADS
    } else {
        for (int64_t t = 0; t < n_tasks; t++) fn(ctx, t);
    }
}

/* ---------------------------------------------------------------------------------------------
 * Argument parsing: every argument is a Python int (addresses come from Tensor.data_ptr())
 */

static int parse_ints(const char *fname, PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, long long *out) {
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", fname, want, nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) {
        out[i] = PyLong_AsLongLong(args[i]);
        if (out[i] == -1 && PyErr_Occurred()) return -1;
    }
    return 0;
}

#define PTR(v) ((void *)(uintptr_t)(v))

/* The start of every entry point below: its `count` integer arguments (the Python wrappers pass
 * addresses, sizes and flags as ints) parsed into a[], or NULL returned with the error set. */
#define INT_ARGS(count)                                                                            \
    long long a[count];                                                                            \
    (void)self;                                                                                    \
    if (parse_ints(__func__, args, nargs, count, a) < 0) return NULL

static int check_width(long long width) {
    if (width_index(width) < 0) {
        PyErr_Format(PyExc_ValueError, "element width must be 2, 4 or 8 bytes, got %lld", width);
        return -1;
    }
    return 0;
}

static int64_t n_chunks_of(int64_t nbytes) { return (nbytes + CHUNK_BYTES - 1) / CHUNK_BYTES; }

/* ---------------------------------------------------------------------------------------------
 * Bitmap pack, phase 1: bitmap bytes and each chunk's kept count. Rows carry their own rule
 * (per-row top-k); a plain pack is one row.
 */

typedef struct {
    const width_ops *w;
    const char *x;
    int64_t n, rows, rowlen;
    const int64_t *st; /* per row: split, L1, L2 (see select_row) */
    int aligned;       /* one row whose rule is the same everywhere: no partial bytes inside */
    uint8_t *bm;
    int64_t nbytes;
    int64_t *counts;
} build_ctx;

static void build_task(void *p, int64_t c) {
    build_ctx *ctx = (build_ctx *)p;
    int64_t b0 = c * CHUNK_BYTES, b1 = b0 + CHUNK_BYTES < ctx->nbytes ? b0 + CHUNK_BYTES : ctx->nbytes;
    int64_t e0 = 8 * b0, e1 = 8 * b1 < ctx->n ? 8 * b1 : ctx->n;
    if (!ctx->aligned)
        memset(ctx->bm + b0, 0, (size_t)(b1 - b0));
    else if (ctx->n & 7 && b1 == ctx->nbytes)
        ctx->bm[b1 - 1] = 0; /* the partial last byte is OR-ed into */
    for (int64_t r = e0 / ctx->rowlen; r < ctx->rows && r * ctx->rowlen < e1; r++) {
        const int64_t *st = ctx->st + 3 * r;
        int64_t rs = r * ctx->rowlen, re = rs + ctx->rowlen, split = rs + st[0];
        int64_t s = rs > e0 ? rs : e0, e = split < e1 ? split : e1;
        if (s < e) ctx->w->build_range(ctx->x, s, e, (uint64_t)st[1], ctx->bm);
        s = split > e0 ? split : e0;
        e = re < e1 ? re : e1;
        if (s < e) ctx->w->build_range(ctx->x, s, e, (uint64_t)st[2], ctx->bm);
    }
    ctx->counts[c] = ops->popcount(ctx->bm + b0, b1 - b0);
}

static int64_t run_build(build_ctx *ctx, long long threads) {
    int64_t nchunks = n_chunks_of(ctx->nbytes);
    advise_hugepages(ctx->bm, ctx->nbytes);
    parallel_for(nchunks, threads, MIN_CHUNKS_PER_THREAD, build_task, ctx);
    int64_t total = 0;
    for (int64_t c = 0; c < nchunks; c++) total += ctx->counts[c];
    return total;
}

static int check_counts(int64_t nbytes, long long counts) {
    if (n_chunks_of(nbytes) > 1 && counts == 0) {
        PyErr_SetString(PyExc_ValueError, "a tensor of more than one chunk needs a counts buffer");
        return -1;
    }
    return 0;
}

static PyObject *pack_build(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    INT_ARGS(7);
    if (check_width(a[2]) < 0) return NULL;
    int64_t n = a[1], nbytes = (n + 7) / 8, one = 0, st[3] = {0, a[3], a[3]};
    if (check_counts(nbytes, a[5]) < 0) return NULL;
    build_ctx ctx = {&ops->w[width_index(a[2])], (const char *)PTR(a[0]), n, 1, n, st, 1,
                     (uint8_t *)PTR(a[4]), nbytes, a[5] ? (int64_t *)PTR(a[5]) : &one};
    int64_t total;
    if (n >= GIL_FREE_MIN_ELEMS) {
        Py_BEGIN_ALLOW_THREADS total = run_build(&ctx, a[6]);
        Py_END_ALLOW_THREADS
    } else {
        total = run_build(&ctx, 1);
    }
    return PyLong_FromLongLong(total);
}

/* ---------------------------------------------------------------------------------------------
 * Per-row top-k: a threshold per row (rows in parallel), then phase 1 with the rows' rules
 */

typedef struct {
    const width_ops *w;
    const char *x;
    int64_t rowlen, keep, wsize;
    int64_t *st;
    int failed;
} select_ctx;

static void select_task(void *p, int64_t r) {
    select_ctx *ctx = (select_ctx *)p;
    if (ctx->w->select_row(ctx->x + r * ctx->rowlen * ctx->wsize, ctx->rowlen, ctx->keep, ctx->st + 3 * r) < 0)
        __atomic_store_n(&ctx->failed, 1, __ATOMIC_RELAXED);
}

static PyObject *topk_build(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    INT_ARGS(8);
    if (check_width(a[3]) < 0) return NULL;
    int64_t rows = a[1], rowlen = a[2], keep = a[4], n = rows * rowlen, nbytes = (n + 7) / 8, one = 0;
    if (rows < 0 || rowlen < 0 || keep < 0) {
        PyErr_SetString(PyExc_ValueError, "rows, rowlen and keep must be >= 0");
        return NULL;
    }
    if (check_counts(nbytes, a[6]) < 0) return NULL;
    if (n == 0) return PyLong_FromLong(0);
    const width_ops *w = &ops->w[width_index(a[3])];
    int64_t *st = (int64_t *)malloc((size_t)rows * 3 * sizeof(int64_t));
    if (st == NULL) return PyErr_NoMemory();
    long long threads = a[7];
    int big = n >= GIL_FREE_MIN_ELEMS;
    select_ctx sctx = {w, (const char *)PTR(a[0]), rowlen, keep, a[3], st, 0};
    build_ctx bctx = {w, (const char *)PTR(a[0]), n, rows, rowlen, st, 0,
                      (uint8_t *)PTR(a[5]), nbytes, a[6] ? (int64_t *)PTR(a[6]) : &one};
    int64_t total = 0;
    Py_BEGIN_ALLOW_THREADS
    if (keep >= rowlen || keep == 0) {
        /* every non-zero (limit 0), or nothing (no magnitude exceeds the mask itself) */
        int64_t limit = keep ? 0 : (int64_t)((~(uint64_t)0) >> (65 - 8 * a[3]));
        for (int64_t r = 0; r < rows; r++) st[3 * r] = 0, st[3 * r + 1] = st[3 * r + 2] = limit;
    } else {
        /* one task per row: a row is rowlen elements of work, worth a thread of its own when big */
        parallel_for(rows, big ? threads : 1, rowlen >= CHUNK_ELEMS ? 1 : MIN_CHUNKS_PER_THREAD, select_task, &sctx);
    }
    if (!sctx.failed) total = run_build(&bctx, big ? threads : 1);
    Py_END_ALLOW_THREADS
    free(st);
    if (sctx.failed) return PyErr_NoMemory();
    return PyLong_FromLongLong(total);
}

/* ---------------------------------------------------------------------------------------------
 * Bitmap pack, phase 2: the kept elements, each chunk at its prefix-sum offset
 */

typedef struct {
    const width_ops *w;
    const char *x;
    int64_t n, nbytes, wsize;
    const uint8_t *bm;
    const int64_t *offsets; /* nchunks + 1 */
    char *out;
} compact_ctx;

static void compact_task(void *p, int64_t c) {
    compact_ctx *ctx = (compact_ctx *)p;
    int64_t b0 = c * CHUNK_BYTES, b1 = b0 + CHUNK_BYTES < ctx->nbytes ? b0 + CHUNK_BYTES : ctx->nbytes;
    int64_t o = ctx->offsets[c], count = ctx->offsets[c + 1] - o;
    if (count) ctx->w->compact(ctx->x, ctx->bm, b0, b1, ctx->n, ctx->out + o * ctx->wsize, count);
}

static PyObject *pack_compact(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    INT_ARGS(8);
    if (check_width(a[2]) < 0) return NULL;
    int64_t n = a[1], nbytes = (n + 7) / 8, nvals = a[6], nchunks = n_chunks_of(nbytes);
    if (check_counts(nbytes, a[4]) < 0) return NULL;
    if (nvals == 0) Py_RETURN_NONE;
    int64_t single[2] = {0, nvals}, *offsets = single;
    if (nchunks > 1) {
        /* counts -> offsets, one longer than counts: kept in a scratch block */
        offsets = (int64_t *)malloc((size_t)(nchunks + 1) * sizeof(int64_t));
        if (offsets == NULL) return PyErr_NoMemory();
        const int64_t *counts = (const int64_t *)PTR(a[4]);
        offsets[0] = 0;
        for (int64_t c = 0; c < nchunks; c++) offsets[c + 1] = offsets[c] + counts[c];
        if (offsets[nchunks] != nvals) {
            long long total = offsets[nchunks];
            free(offsets);
            return PyErr_Format(PyExc_ValueError, "chunk counts add up to %lld, not %lld values", total,
                                (long long)nvals);
        }
    }
    compact_ctx ctx = {&ops->w[width_index(a[2])], (const char *)PTR(a[0]), n, nbytes, a[2],
                       (const uint8_t *)PTR(a[3]), offsets, (char *)PTR(a[5])};
    advise_hugepages(ctx.out, nvals * a[2]);
    dispatch_tasks(n, nchunks, a[7], compact_task, &ctx);
    if (offsets != single) free(offsets);
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------------------------------------
 * Bitmap unpack: popcounts per chunk, prefix sum, scatter
 */

typedef struct {
    const width_ops *w;
    const uint8_t *bm;
    int64_t n, nbytes, nvals;
    int64_t *offsets;
    const char *vals;
    char *out;
} scatter_ctx;

static void count_task(void *p, int64_t c) {
    scatter_ctx *ctx = (scatter_ctx *)p;
    int64_t b0 = c * CHUNK_BYTES, b1 = b0 + CHUNK_BYTES < ctx->nbytes ? b0 + CHUNK_BYTES : ctx->nbytes;
    int64_t full = ctx->n >> 3, bend = b1 < full ? b1 : full;
    int64_t count = ops->popcount(ctx->bm + b0, bend - b0);
    if (bend < b1) count += POP8[ctx->bm[bend] & ((1u << (ctx->n & 7)) - 1)]; /* unused high bits ignored */
    ctx->offsets[c + 1] = count;
}

static void scatter_task(void *p, int64_t c) {
    scatter_ctx *ctx = (scatter_ctx *)p;
    int64_t b0 = c * CHUNK_BYTES, b1 = b0 + CHUNK_BYTES < ctx->nbytes ? b0 + CHUNK_BYTES : ctx->nbytes;
    ctx->w->scatter(ctx->bm, b0, b1, ctx->n, ctx->vals, ctx->offsets[c], ctx->nvals, ctx->out);
}

static PyObject *unpack(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    INT_ARGS(8);
    if (check_width(a[4]) < 0) return NULL;
    int64_t n = a[6], nbytes = (n + 7) / 8, nvals = a[3], nchunks = n_chunks_of(nbytes);
    if (n < 0 || a[1] != nbytes)
        return PyErr_Format(PyExc_ValueError, "a bitmap of %lld elements has %lld bytes, got %lld",
                            (long long)n, (long long)nbytes, a[1]);
    if (n == 0) {
        if (nvals != 0) return PyErr_Format(PyExc_ValueError, "0 elements but %lld values", (long long)nvals);
        Py_RETURN_NONE;
    }
    int64_t single[2], *offsets = nchunks > 1 ? (int64_t *)malloc((size_t)(nchunks + 1) * sizeof(int64_t)) : single;
    if (offsets == NULL) return PyErr_NoMemory();
    scatter_ctx ctx = {&ops->w[width_index(a[4])], (const uint8_t *)PTR(a[0]), n, nbytes, nvals, offsets,
                       (const char *)PTR(a[2]), (char *)PTR(a[5])};
    int big = n >= GIL_FREE_MIN_ELEMS;
    PyThreadState *ts = big ? PyEval_SaveThread() : NULL;
    /* counting is a 32x smaller pass than scattering: threads only for large bitmaps */
    parallel_for(nchunks, big && nbytes >= (1 << 20) ? a[7] : 1, MIN_CHUNKS_PER_THREAD, count_task, &ctx);
    offsets[0] = 0;
    for (int64_t c = 0; c < nchunks; c++) offsets[c + 1] += offsets[c];
    int ok = offsets[nchunks] == nvals;
    if (ok) {
        advise_hugepages(ctx.out, n * a[4]);
        parallel_for(nchunks, big ? a[7] : 1, MIN_CHUNKS_PER_THREAD, scatter_task, &ctx);
    }
    if (ts != NULL) PyEval_RestoreThread(ts);
    int64_t set_bits = offsets[nchunks];
    if (offsets != single) free(offsets);
    if (!ok)
        return PyErr_Format(PyExc_ValueError, "the bitmap has %lld bits set but there are %lld values",
                            (long long)set_bits, (long long)nvals);
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------------------------------------
 * Byte-range kernels run chunk by chunk: mask pack/unpack, bool bits, min/max, conversion
 */

typedef struct {
    int kind;
    const width_ops *w;
    const char *x;
    char *y;
    int64_t n, nbytes, wsize;
    int64_t lo, hi;      /* mask_pack: order keys; mask_unpack: the two bit patterns */
    int out_bits;        /* convert */
    int64_t *partial;    /* minmax: 2 per chunk */
} range_ctx;

enum { K_MASK_PACK, K_MASK_UNPACK, K_BITS_PACK, K_BITS_UNPACK, K_MINMAX, K_CONVERT };

static const uint64_t *bytes8_table(void) {
    static uint64_t table[256];
    static int ready = 0;
    if (!__atomic_load_n(&ready, __ATOMIC_ACQUIRE)) {
        for (int byte = 0; byte < 256; byte++) {
            uint8_t flags[8]; /* byte j in memory = bit j, whatever the byte order */
            for (int j = 0; j < 8; j++) flags[j] = (uint8_t)((byte >> j) & 1);
            memcpy(&table[byte], flags, 8);
        }
        __atomic_store_n(&ready, 1, __ATOMIC_RELEASE);
    }
    return table;
}

static void range_task(void *p, int64_t c) {
    range_ctx *ctx = (range_ctx *)p;
    int64_t b0 = c * CHUNK_BYTES, b1 = b0 + CHUNK_BYTES < ctx->nbytes ? b0 + CHUNK_BYTES : ctx->nbytes;
    int64_t e0 = 8 * b0, e1 = 8 * b1 < ctx->n ? 8 * b1 : ctx->n;
    switch (ctx->kind) {
    case K_MASK_PACK:
        ctx->w->mask_pack(ctx->x, b0, b1, ctx->n, ctx->lo, ctx->hi, (uint8_t *)ctx->y);
        break;
    case K_MASK_UNPACK:
        ctx->w->mask_unpack((const uint8_t *)ctx->x, b0, b1, ctx->n, (uint64_t)ctx->lo, (uint64_t)ctx->hi, ctx->y);
        break;
    case K_BITS_PACK:
        ops->bits_pack((const uint8_t *)ctx->x, b0, b1, ctx->n, (uint8_t *)ctx->y);
        break;
    case K_BITS_UNPACK: {
        const uint64_t *t8 = bytes8_table();
        const uint8_t *bm = (const uint8_t *)ctx->x;
        int64_t full = ctx->n >> 3, bend = b1 < full ? b1 : full, b = b0;
        for (; b < bend; b++) memcpy(ctx->y + 8 * b, &t8[bm[b]], 8);
        for (int64_t i = 8 * b; i < e1; i++) ctx->y[i] = (char)((bm[b] >> (i & 7)) & 1);
        break;
    }
    case K_MINMAX:
        ctx->w->minmax(ctx->x, e0, e1, ctx->partial + 2 * c, ctx->partial + 2 * c + 1);
        break;
    case K_CONVERT:
        if (ctx->w != NULL) {
            ctx->w->convert(ctx->x, e0, e1, ctx->y, ctx->out_bits);
        } else { /* from int8: widening only */
            const int8_t *x = (const int8_t *)ctx->x;
            if (ctx->out_bits == 16) for (int64_t i = e0; i < e1; i++) ((int16_t *)ctx->y)[i] = x[i];
            else if (ctx->out_bits == 32) for (int64_t i = e0; i < e1; i++) ((int32_t *)ctx->y)[i] = x[i];
            else if (ctx->out_bits == 64) for (int64_t i = e0; i < e1; i++) ((int64_t *)ctx->y)[i] = x[i];
            else for (int64_t i = e0; i < e1; i++) ((int8_t *)ctx->y)[i] = x[i];
        }
        break;
    }
}

static void run_range(range_ctx *ctx, long long threads) {
    dispatch_tasks(ctx->n, n_chunks_of(ctx->nbytes), threads, range_task, ctx);
}

static PyObject *mask_pack(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    INT_ARGS(7);
    if (check_width(a[2]) < 0) return NULL;
    range_ctx ctx = {K_MASK_PACK, &ops->w[width_index(a[2])], (const char *)PTR(a[0]), (char *)PTR(a[5]),
                     a[1], (a[1] + 7) / 8, a[2], a[3], a[4], 0, NULL};
    run_range(&ctx, a[6]);
    Py_RETURN_NONE;
}

static PyObject *mask_unpack(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    INT_ARGS(8);
    if (a[3] != 1 && check_width(a[3]) < 0) return NULL;
    if (a[2] < 0 || a[1] < (a[2] + 7) / 8)
        return PyErr_Format(PyExc_ValueError, "%lld elements need a bitmap of %lld bytes, got %lld", a[2],
                            (a[2] + 7) / 8, a[1]);
    range_ctx ctx = {a[3] == 1 ? K_BITS_UNPACK : K_MASK_UNPACK, a[3] == 1 ? NULL : &ops->w[width_index(a[3])],
                     (const char *)PTR(a[0]), (char *)PTR(a[6]), a[2], (a[2] + 7) / 8, a[3], a[4], a[5], 0, NULL};
    if (a[3] != 1) advise_hugepages(ctx.y, a[2] * a[3]);
    run_range(&ctx, a[7]);
    Py_RETURN_NONE;
}

static PyObject *bits_pack(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    INT_ARGS(4);
    range_ctx ctx = {K_BITS_PACK, NULL, (const char *)PTR(a[0]), (char *)PTR(a[2]), a[1], (a[1] + 7) / 8, 1,
                     0, 0, 0, NULL};
    run_range(&ctx, a[3]);
    Py_RETURN_NONE;
}

static PyObject *minmax(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    INT_ARGS(4);
    if (check_width(a[2]) < 0) return NULL;
    if (a[1] <= 0) {
        PyErr_SetString(PyExc_ValueError, "minmax of no elements");
        return NULL;
    }
    int64_t nbytes = (a[1] + 7) / 8, nchunks = n_chunks_of(nbytes);
    int64_t *partial = (int64_t *)malloc((size_t)nchunks * 2 * sizeof(int64_t));
    if (partial == NULL) return PyErr_NoMemory();
    range_ctx ctx = {K_MINMAX, &ops->w[width_index(a[2])], (const char *)PTR(a[0]), NULL, a[1], nbytes, a[2],
                     0, 0, 0, partial};
    run_range(&ctx, a[3]);
    int64_t lo = partial[0], hi = partial[1];
    for (int64_t c = 1; c < nchunks; c++) {
        lo = partial[2 * c] < lo ? partial[2 * c] : lo;
        hi = partial[2 * c + 1] > hi ? partial[2 * c + 1] : hi;
    }
    free(partial);
    return Py_BuildValue("(LL)", (long long)lo, (long long)hi);
}

static PyObject *convert(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    INT_ARGS(6);
    if ((a[2] != 1 && check_width(a[2]) < 0) || (a[4] != 1 && check_width(a[4]) < 0)) return NULL;
    range_ctx ctx = {K_CONVERT, a[2] == 1 ? NULL : &ops->w[width_index(a[2])], (const char *)PTR(a[0]),
                     (char *)PTR(a[3]), a[1],
                     (a[1] + 7) / 8, a[2], 0, 0, (int)(8 * a[4]), NULL};
    advise_hugepages(ctx.y, a[1] * a[4]);
    run_range(&ctx, a[5]);
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------------------------------------
 * The quantized codec: tasks of whole groups, about a chunk of elements each
 */

typedef struct {
    const width_ops *w;
    const void *x; /* quantize: the input */
    void *out;     /* dequantize: the output */
    quant_params q;
    int64_t per_task, total; /* groups a task, groups in all */
    int64_t elems;
} quant_ctx;

static void quantize_task(void *p, int64_t t) {
    quant_ctx *ctx = (quant_ctx *)p;
    int64_t g0 = t * ctx->per_task, g1 = g0 + ctx->per_task < ctx->total ? g0 + ctx->per_task : ctx->total;
    ctx->w->quantize(ctx->x, &ctx->q, g0, g1);
}

static void dequantize_task(void *p, int64_t t) {
    quant_ctx *ctx = (quant_ctx *)p;
    int64_t g0 = t * ctx->per_task, g1 = g0 + ctx->per_task < ctx->total ? g0 + ctx->per_task : ctx->total;
    ctx->w->dequantize(&ctx->q, ctx->out, g0, g1);
}

/* Checks the layout arguments and fills the shape fields of ctx->q; -1 with an exception set. */
static int quant_layout(quant_ctx *ctx, long long rows, long long n, long long bits, long long group, long long width) {
    memset(ctx, 0, sizeof(*ctx));
    if (check_width(width) < 0) return -1;
    if (rows < 0 || n < 0 || !(bits == 8 || bits == 4 || bits == 2) || group < 8 || group % 8) {
        PyErr_Format(PyExc_ValueError,
                     "rows and n must be >= 0, bits 8, 4 or 2, group a positive multiple of 8; got rows=%lld, "
                     "n=%lld, bits=%lld, group=%lld", rows, n, bits, group);
        return -1;
    }
    ctx->w = &ops->w[width_index(width)];
    ctx->q.n = n;
    ctx->q.group = group;
    ctx->q.groups = (n + group - 1) / group;
    ctx->q.row_bytes = (n * bits + 7) / 8;
    ctx->q.bits = (int)bits;
    ctx->total = rows * ctx->q.groups;
    ctx->elems = rows * n;
    /* a task: the groups of about one chunk (short rows make short groups) */
    int64_t span = group < n ? group : n;
    ctx->per_task = span > 0 && CHUNK_ELEMS / span > 0 ? CHUNK_ELEMS / span : 1;
    return 0;
}

static void run_quant(quant_ctx *ctx, task_fn fn, long long threads) {
    dispatch_tasks(ctx->elems, (ctx->total + ctx->per_task - 1) / ctx->per_task, threads, fn, ctx);
}

static PyObject *quantize(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    INT_ARGS(12);
    quant_ctx ctx;
    if (quant_layout(&ctx, a[1], a[2], a[5], a[6], a[3]) < 0) return NULL;
    if (a[7] < -1 || a[7] > 0xFFFFFFFFLL)
        return PyErr_Format(PyExc_ValueError, "seed must be -1 (nearest) or in [0, 2**32); got %lld", a[7]);
    ctx.x = PTR(a[0]);
    ctx.q.bf16 = a[4] != 0;
    ctx.q.stochastic = a[7] >= 0;
    ctx.q.seed_mix = a[7] >= 0 ? mix32((uint32_t)a[7]) : 0;
    ctx.q.codes = (uint8_t *)PTR(a[8]);
    ctx.q.lo = (float *)PTR(a[9]);
    ctx.q.scale = (float *)PTR(a[10]);
    if (ctx.total == 0) Py_RETURN_NONE;
    advise_hugepages(ctx.q.codes, a[1] * ctx.q.row_bytes);
    run_quant(&ctx, quantize_task, a[11]);
    Py_RETURN_NONE;
}

static PyObject *dequantize(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    INT_ARGS(15);
    quant_ctx ctx;
    if (quant_layout(&ctx, a[6], a[7], a[8], a[9], a[11]) < 0) return NULL;
    if (a[1] != a[6] * ctx.q.row_bytes || a[3] != ctx.total || a[5] != ctx.total)
        return PyErr_Format(PyExc_ValueError,
                            "%lld rows of %lld %lld-bit codes in groups of %lld need %lld code bytes and %lld "
                            "lo and scale values; got %lld, %lld and %lld", a[6], a[7], a[8], a[9],
                            a[6] * (long long)ctx.q.row_bytes, (long long)ctx.total, a[1], a[3], a[5]);
    ctx.out = PTR(a[10]);
    ctx.q.codes = (uint8_t *)PTR(a[0]);
    ctx.q.lo = (float *)PTR(a[2]);
    ctx.q.scale = (float *)PTR(a[4]);
    ctx.q.bf16 = a[12] != 0;
    ctx.q.nan16 = (uint32_t)a[13] & 0xFFFFu;
    if (ctx.total == 0) Py_RETURN_NONE;
    advise_hugepages(ctx.out, a[6] * a[7] * a[11]);
    run_quant(&ctx, dequantize_task, a[14]);
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------------------------------------
 * Introspection and switches (tests, benchmarks, the machine record)
 */

static int avx2_usable(void) {
#if HAVE_AVX2_KERNELS
    __builtin_cpu_init();
    /* F16C: the quantized codec's float16 conversions (every AVX2 CPU has it) */
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("popcnt") && __builtin_cpu_supports("f16c");
#else
    return 0;
#endif
}

static int avx512_usable(void) {
#if HAVE_AVX2_KERNELS
    return avx2_usable() && __builtin_cpu_supports("avx512f");
#else
    return 0;
#endif
}

/* The best instruction set this CPU runs; EDGETORCH_NATIVE_ISA=generic|avx2 caps it. */
static const isa_ops *best_ops(void) {
    const char *cap = getenv("EDGETORCH_NATIVE_ISA");
    if (cap != NULL && strcmp(cap, "generic") == 0) return &GENERIC_OPS;
#if HAVE_AVX2_KERNELS
    if (avx512_usable() && !(cap != NULL && strcmp(cap, "avx2") == 0)) return &AVX512_OPS;
    if (avx2_usable()) return &AVX2_OPS;
#endif
    return &GENERIC_OPS;
}

static PyObject *set_isa(PyObject *self, PyObject *arg) {
    (void)self;
    const char *name = PyUnicode_AsUTF8(arg);
    if (name == NULL) return NULL;
    if (strcmp(name, "generic") == 0) {
        ops = &GENERIC_OPS;
#if HAVE_AVX2_KERNELS
    } else if (strcmp(name, "avx2") == 0 && avx2_usable()) {
        ops = &AVX2_OPS;
    } else if (strcmp(name, "avx512") == 0 && avx512_usable()) {
        ops = &AVX512_OPS;
#endif
    } else {
        return PyErr_Format(PyExc_ValueError, "instruction set %R is not available here", arg);
    }
    Py_RETURN_NONE;
}

static PyObject *isa_list(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    if (avx512_usable()) return Py_BuildValue("(sss)", "generic", "avx2", "avx512");
    return avx2_usable() ? Py_BuildValue("(ss)", "generic", "avx2") : Py_BuildValue("(s)", "generic");
}

static PyObject *get_isa(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyUnicode_FromString(ops->name);
}

static PyObject *set_hugepage_min(PyObject *self, PyObject *arg) {
    (void)self;
    long long v = PyLong_AsLongLong(arg);
    if (v == -1 && PyErr_Occurred()) return NULL;
    long long old = hugepage_min_bytes;
    hugepage_min_bytes = v; /* negative: never advise */
    return PyLong_FromLongLong(old);
}

static PyObject *pool_workers(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    pthread_mutex_lock(&pool.lock);
    int w = pool.workers;
    pthread_mutex_unlock(&pool.lock);
    return PyLong_FromLong(w);
}

static PyObject *build_info(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
#if defined(__clang__)
    const char *compiler = "clang " __clang_version__;
#elif defined(__GNUC__)
    const char *compiler = "gcc " __VERSION__;
#else
    const char *compiler = "unknown";
#endif
    return Py_BuildValue("{s:i,s:s,s:s,s:s,s:i}", "abi", NATIVE_ABI, "compiler", compiler, "isa", ops->name,
                         "built", __DATE__ " " __TIME__, "chunk_elements", CHUNK_ELEMS);
}

/* The entry points' docstrings, beside the table that names them. */
PyDoc_STRVAR(pack_build_doc,
             "pack_build(x, n, width, limit, bitmap, counts, threads) -> kept\n\n"
             "Bitmap of n elements of `width` bytes at address x (keep iff (bits & absmask) > limit)\n"
             "into `bitmap` ((n + 7) // 8 bytes); each chunk's kept count into int64 `counts`\n"
             "(needed when n > CHUNK_ELEMS, else 0). Returns the number kept.");

PyDoc_STRVAR(topk_build_doc,
             "topk_build(x, rows, rowlen, width, keep, bitmap, counts, threads) -> kept\n\n"
             "Like pack_build for rows x rowlen elements, keeping per row the `keep` largest non-zero\n"
             "magnitudes (NaN largest, ties by position, zeros never).");

PyDoc_STRVAR(pack_compact_doc,
             "pack_compact(x, n, width, bitmap, counts, out, nvals, threads)\n\n"
             "The elements of x whose bit is set, in order, into `out` (nvals elements). `counts` is\n"
             "what pack_build or topk_build wrote (it is overwritten), or 0 for one chunk.");

PyDoc_STRVAR(unpack_doc,
             "unpack(bitmap, bitmap_len, vals, nvals, width, out, n, threads)\n\n"
             "n elements into `out`: the values in order where a bit is set, 0 elsewhere. Raises\n"
             "ValueError unless the bitmap has (n + 7) // 8 bytes and n bits set per value.");

PyDoc_STRVAR(mask_pack_doc,
             "mask_pack(x, n, width, lo_key, hi_key, bitmap, threads)\n\n"
             "Bit i set iff lo_key < key(x[i]) < hi_key, key = +|v| or -|v| of the float bits as a\n"
             "signed integer of the same width (NaN is never inside).");

PyDoc_STRVAR(mask_unpack_doc,
             "mask_unpack(bitmap, bitmap_len, n, width, inside_bits, outside_bits, out, threads)\n\n"
             "n elements of `width` bytes (1: bool) into `out`: inside_bits where the bit is set,\n"
             "outside_bits elsewhere (width 1 writes 1 and 0). Raises ValueError if the bitmap has\n"
             "fewer than (n + 7) // 8 bytes.");

PyDoc_STRVAR(bits_pack_doc, "bits_pack(src, n, bitmap, threads)\n\nn bool bytes as bits.");

PyDoc_STRVAR(minmax_doc,
             "minmax(x, n, width, threads) -> (min, max)\n\nOf n > 0 signed integers of `width` bytes, in one pass.");

PyDoc_STRVAR(convert_doc,
             "convert(x, n, width, out, out_width, threads)\n\n"
             "n signed integers of `width` bytes (1, 2, 4, 8) into `out` as `out_width` bytes each;\n"
             "narrowing assumes every value fits (minmax first).");

PyDoc_STRVAR(quantize_doc,
             "quantize(x, rows, n, width, bf16, bits, group, seed, codes, lo, scale, threads)\n\n"
             "The quantized codec's bytes of the row-major [rows, n] float tensor at x (width 2: float16,\n"
             "or bfloat16 if bf16; 4: float32; 8: float64, read as float32): codes (uint8, ceil(n * bits\n"
             "/ 8) bytes a row), lo and scale (float32, ceil(n / group) a row). seed -1 rounds to\n"
             "nearest, 0 <= seed < 2**32 stochastically.");

PyDoc_STRVAR(dequantize_doc,
             "dequantize(codes, codes_len, lo, lo_len, scale, scale_len, rows, n, bits, group, out, width,\n"
             "           bf16, nan16, threads)\n\n"
             "out = lo + code * scale in float32, as [rows, n] elements of `width` bytes (2: float16, or\n"
             "bfloat16 if bf16, rounded to nearest even, NaN written as nan16; 4: float32; 8: float64).\n"
             "Raises ValueError unless codes has rows * ceil(n * bits / 8) bytes and lo and scale have\n"
             "rows * ceil(n / group) elements.");

static PyMethodDef methods[] = {
    {"pack_build", (PyCFunction)(void (*)(void))pack_build, METH_FASTCALL, pack_build_doc},
    {"topk_build", (PyCFunction)(void (*)(void))topk_build, METH_FASTCALL, topk_build_doc},
    {"pack_compact", (PyCFunction)(void (*)(void))pack_compact, METH_FASTCALL, pack_compact_doc},
    {"unpack", (PyCFunction)(void (*)(void))unpack, METH_FASTCALL, unpack_doc},
    {"mask_pack", (PyCFunction)(void (*)(void))mask_pack, METH_FASTCALL, mask_pack_doc},
    {"mask_unpack", (PyCFunction)(void (*)(void))mask_unpack, METH_FASTCALL, mask_unpack_doc},
    {"bits_pack", (PyCFunction)(void (*)(void))bits_pack, METH_FASTCALL, bits_pack_doc},
    {"minmax", (PyCFunction)(void (*)(void))minmax, METH_FASTCALL, minmax_doc},
    {"convert", (PyCFunction)(void (*)(void))convert, METH_FASTCALL, convert_doc},
    {"quantize", (PyCFunction)(void (*)(void))quantize, METH_FASTCALL, quantize_doc},
    {"dequantize", (PyCFunction)(void (*)(void))dequantize, METH_FASTCALL, dequantize_doc},
    {"set_isa", set_isa, METH_O, "set_isa(name): use the 'generic', 'avx2' or 'avx512' kernels (tests)."},
    {"isa", get_isa, METH_NOARGS, "isa() -> the instruction set in use."},
    {"isa_available", isa_list, METH_NOARGS, "isa_available() -> instruction sets this CPU runs."},
    {"set_hugepage_min", set_hugepage_min, METH_O,
     "set_hugepage_min(nbytes) -> old: advise huge pages for outputs of at least nbytes (< 0: never)."},
    {"pool_workers", pool_workers, METH_NOARGS, "pool_workers() -> worker threads started in this process."},
    {"build_info", build_info, METH_NOARGS, "build_info() -> dict: abi, compiler, isa, built, chunk_elements."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "_native",
                                       "CPU kernels of the edgetorch codecs (see _native.c).", -1, methods,
                                       NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__native(void) {
    static int once = 0;
    if (!once) {
        fill_tables();
        (void)bytes8_table();
        long ps = sysconf(_SC_PAGESIZE);
        if (ps > 0) page_size = ps;
        if (pthread_atfork(atfork_prepare, atfork_parent, atfork_child) != 0) {
            PyErr_SetString(PyExc_ImportError, "pthread_atfork failed");
            return NULL;
        }
        ops = best_ops();
        once = 1;
    }
    PyObject *m = PyModule_Create(&moduledef);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "CHUNK_ELEMS", CHUNK_ELEMS) < 0 ||
        PyModule_AddIntConstant(m, "ABI", NATIVE_ABI) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
