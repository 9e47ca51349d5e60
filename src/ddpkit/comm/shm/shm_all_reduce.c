/*
 * Shared-memory all_reduce among the ranks of one node.
 *
 * Plain C11 (atomics, POSIX shared memory), no Python or torch headers: the
 * Python side loads this file's shared library with ctypes and passes raw
 * pointers (tensor.data_ptr()). The design is explained in __init__.py of
 * this package; this file holds the segment layout, the barrier and the
 * reduction kernels.
 *
 * Segment layout (one per communicator, created by rank 0):
 *
 *   | header (128 B) | ctl[0] ... ctl[n-1] (128 B each) | pad to 4 KiB |
 *   | slot(0, parity 0) | slot(0, parity 1) | slot(1, 0) | ... | slot(n-1, 1) |
 *
 * ctl[r] is written only by rank r (its barrier counter and the descriptor of
 * its current call), except for the count of peers sleeping on that counter;
 * slot(r, p) is written only by rank r. Every "phase" (a one-shot call, or
 * one chunk of a chunked call) uses the slots of parity phase % 2, so no
 * extra barrier protects a buffer a slower rank is still reading: a rank
 * writes into phase k + 2's slots only after a barrier that every rank
 * reaches after it finished reading phase k's. In a chunked call, slot(r, p)
 * holds one region per rank at fixed offsets: region j carries the sub-chunk
 * rank j reduces, and region r rank r's reduced result.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

/* Bump whenever the exported functions, the codes or the segment layout change:
 * the Python side refuses a library whose version differs from its own. */
#define DDPKIT_SHM_ABI_VERSION 1

#ifndef DDPKIT_SHM_SOURCE_HASH
#define DDPKIT_SHM_SOURCE_HASH ""
#endif

#define MAGIC UINT64_C(0x314d48534b504444) /* "DDPKSHM1" */
#define LINE 128 /* two cache lines: the adjacent-line prefetcher pairs them */
#define PAGE 4096
#define MAX_RANKS 1024

/* Return codes, mirrored in _lib.py. */
#define RC_OK 0
#define RC_AGAIN 1 /* still waiting: call ddpkit_shm_resume (lets Python handle signals) */
#define RC_TIMEOUT (-1)  /* info[0] = rank waited for, info[1] = waited ns */
#define RC_PEER_DEAD (-2) /* info[0] = rank whose process is gone */
#define RC_ABORTED (-3)  /* info[0] = rank that aborted the communicator */
#define RC_MISMATCH (-4) /* info[0] = rank, info[1] = its numel, info[2] = dtype, info[3] = op */
#define RC_BROKEN (-5)   /* an earlier call failed; the communicator is unusable */
#define RC_BAD_ARG (-6)
#define RC_BAD_SEGMENT (-7) /* segment does not match (size, version, world size) */
#define RC_RANK_TAKEN (-8)  /* another live process holds this rank's lock */
/* Other negative values: -errno of a failed system call (setup only). */

enum { DT_F32, DT_F64, DT_F16, DT_BF16, DT_U8, DT_I8, DT_I16, DT_I32, DT_I64, NUM_DTYPES };
enum { OP_SUM, OP_PRODUCT, OP_MIN, OP_MAX, OP_AVG, NUM_OPS };

static const size_t ELEM_SIZE[NUM_DTYPES] = {4, 8, 2, 2, 1, 1, 2, 4, 8};

typedef struct {
    uint64_t magic;
    uint32_t abi_version;
    uint32_t world_size;
    uint64_t slot_bytes;
    uint64_t one_shot_max_bytes;
    uint64_t total_bytes;
    _Atomic uint32_t num_attached;
    _Atomic int32_t aborted_by; /* 0: healthy; r + 1: rank r gave up */
} header_t;

typedef struct {
    /* Number of barriers this rank has arrived at, modulo 2^32 (compared with
     * wrap-around arithmetic); also the futex word peers sleep on. */
    _Atomic uint32_t seq;
    _Atomic uint32_t sleepers; /* peers sleeping on seq: the arriving rank wakes them */
    uint64_t desc[2][2];       /* per phase parity: {numel, dtype | op << 8} of the call */
} ctl_t;

_Static_assert(sizeof(header_t) <= LINE, "header must fit one line");
_Static_assert(sizeof(ctl_t) <= LINE, "ctl must fit one line");

enum { STEP_IDLE, STEP_COPY_IN, STEP_FIRST_WAIT, STEP_WAIT };

typedef struct comm {
    int fd;
    int rank, world_size;
    uint8_t *base;
    size_t total_bytes, slot_bytes, one_shot_max_bytes;
    size_t region_bytes; /* a slot holds one region per rank in chunked calls */
    header_t *hdr;
    uint8_t *ctl_base;
    uint8_t *data_base;
    int64_t timeout_ns;
    int64_t spin_ns, spin_budget_ns; /* most and current spinning before sleeping */
    uint32_t seq;   /* barriers arrived at (mirror of ctl[rank].seq) */
    uint64_t phase; /* phases completed: picks the slot parity */
    int broken;
    struct comm *next; /* list of open communicators, for the fork handler */

    /* The call in progress (a call returns RC_AGAIN and resumes from here). */
    int step;
    uint8_t *data;
    uint64_t numel;
    int dtype, op, one_shot;
    size_t esize, chunk_elems, num_chunks, chunk;
    int wait_peer; /* first rank not yet seen at the current barrier */
    int slept;     /* the current wait went to sleep */
    uint64_t wait_t0, last_liveness_check;
} comm_t;

/* ------------------------------------------------------------------------ */
/* Open communicators, so a forked child can drop its copy of the file locks. */

static pthread_mutex_t registry_lock = PTHREAD_MUTEX_INITIALIZER;
static comm_t *registry;
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

/* A forked child (a DataLoader worker, say) inherits the segment's file
 * descriptor and with it the lock that tells peers "this rank is alive".
 * Closing the child's copy keeps that signal tied to the rank's own process. */
static void atfork_child(void) {
    for (comm_t *c = registry; c; c = c->next) {
        if (c->fd >= 0) {
            close(c->fd);
            c->fd = -1;
        }
    }
}

static void install_atfork(void) { pthread_atfork(NULL, NULL, atfork_child); }

static void registry_add(comm_t *c) {
    pthread_once(&atfork_once, install_atfork);
    pthread_mutex_lock(&registry_lock);
    c->next = registry;
    registry = c;
    pthread_mutex_unlock(&registry_lock);
}

static void registry_remove(comm_t *c) {
    pthread_mutex_lock(&registry_lock);
    for (comm_t **p = &registry; *p; p = &(*p)->next) {
        if (*p == c) {
            *p = c->next;
            break;
        }
    }
    pthread_mutex_unlock(&registry_lock);
}

/* ------------------------------------------------------------------------ */
/* Time, pausing, liveness. */

static inline uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * UINT64_C(1000000000) + (uint64_t)ts.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Each rank holds an open-file-description lock on byte `rank` of the segment
 * for as long as its process lives; the kernel drops it when the process dies,
 * however it dies. A peer whose byte is unlocked is gone. */
static int lock_rank_byte(int fd, int rank) {
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = rank, .l_len = 1, .l_pid = 0};
    if (fcntl(fd, F_OFD_SETLK, &fl) == 0) return RC_OK;
    return (errno == EAGAIN || errno == EACCES) ? RC_RANK_TAKEN : -errno;
}

static int rank_is_alive(int fd, int rank) {
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = rank, .l_len = 1, .l_pid = 0};
    if (fd < 0 || fcntl(fd, F_OFD_GETLK, &fl) != 0) return 1; /* cannot tell: rely on the timeout */
    return fl.l_type != F_UNLCK;
}

static inline ctl_t *ctl(comm_t *c, int rank) { return (ctl_t *)(c->ctl_base + (size_t)rank * LINE); }

static inline uint8_t *slot(comm_t *c, int rank, uint64_t phase) {
    return c->data_base + ((size_t)rank * 2 + (phase & 1)) * c->slot_bytes;
}

static long futex(_Atomic uint32_t *word, int op, uint32_t value, const struct timespec *timeout) {
    /* Not FUTEX_PRIVATE: the word is in memory shared between processes. */
    return syscall(SYS_futex, (uint32_t *)word, op, value, timeout, NULL, 0);
}

static int fail(comm_t *c, int rc) {
    int32_t healthy = 0;
    c->broken = 1;
    c->step = STEP_IDLE;
    /* Tell the peers at once rather than letting each wait out its timeout.
     * (A mismatch needs no telling: every rank sees it at the same barrier.) */
    if (rc != RC_MISMATCH && atomic_compare_exchange_strong(&c->hdr->aborted_by, &healthy, c->rank + 1))
        futex(&ctl(c, c->rank)->seq, FUTEX_WAKE, INT_MAX, NULL);
    return rc;
}

static inline int arrived(uint32_t seq, uint32_t target) { return (int32_t)(seq - target) >= 0; }

static inline void arrive(comm_t *c) {
    ctl_t *mine = ctl(c, c->rank);
    c->seq++;
    /* seq_cst store, then load: pairs with the sleeper's increment-then-check
     * in wait_peers, so either we see a sleeper or it sees our arrival. */
    atomic_store(&mine->seq, c->seq);
    if (atomic_load(&mine->sleepers)) futex(&mine->seq, FUTEX_WAKE, INT_MAX, NULL);
    c->wait_peer = 0;
    c->wait_t0 = 0;
    c->slept = 0;
}

/* A peer that gave up may have arrived before it did: a late rank must fail
 * too, rather than succeed alone and hang in its next call. */
static int check_aborted(comm_t *c, int64_t *info) {
    int32_t aborted_by = atomic_load_explicit(&c->hdr->aborted_by, memory_order_relaxed);
    if (aborted_by && aborted_by != c->rank + 1) {
        info[0] = aborted_by - 1;
        return fail(c, RC_ABORTED);
    }
    return RC_OK;
}

/* Wait until every peer has arrived at barrier c->seq.
 *
 * Spin with pause first: a peer running on another core arrives within
 * microseconds. Past the spin budget, sleep on the awaited peer's counter (a
 * futex it wakes when it arrives), which frees the core: with more runnable
 * processes than cores, the late peer may be waiting for exactly this core,
 * and a rank waiting for a peer that is checkpointing costs nothing. The
 * budget adapts: halved after a wait that ended asleep, doubled (up to
 * spin_ns) after one that ended spinning, so ranks that have their cores
 * spin and ranks that share them sleep at once (measured on 2 busy cores:
 * 3x faster than a fixed 50 us spin; on idle ones, 2x faster than none).
 * Sleeps last at most 10 ms, to check the timeout, the peer's liveness and
 * whether a peer gave up; every ~50 ms the call returns RC_AGAIN so Python
 * can run signal handlers (Ctrl-C). */
static int wait_peers(comm_t *c, int64_t *info) {
    const uint32_t target = c->seq;
    const uint64_t slice_ns = 50000000, liveness_every_ns = 10000000;
    const struct timespec nap = {0, 10000000};
    uint64_t slice_t0 = 0;
    int j = c->wait_peer, rc;
    for (;;) {
        for (unsigned spins = 0; spins < 128; spins++) {
            while (j < c->world_size &&
                   (j == c->rank || arrived(atomic_load_explicit(&ctl(c, j)->seq, memory_order_acquire), target)))
                j++;
            if (j == c->world_size) {
                c->spin_budget_ns = c->slept ? c->spin_budget_ns / 2
                                             : (c->spin_budget_ns < c->spin_ns / 2 ? c->spin_budget_ns * 2 + 1000
                                                                                  : c->spin_ns);
                return RC_OK;
            }
            cpu_relax();
        }
        c->wait_peer = j;
        uint64_t t = now_ns();
        if (!c->wait_t0) c->wait_t0 = c->last_liveness_check = t;
        if (!slice_t0) slice_t0 = t;
        uint64_t waited = t - c->wait_t0;
        if ((rc = check_aborted(c, info)) != RC_OK) return rc;
        if (t - c->last_liveness_check >= liveness_every_ns) {
            c->last_liveness_check = t;
            if (!rank_is_alive(c->fd, j)) {
                info[0] = j;
                return fail(c, RC_PEER_DEAD);
            }
        }
        if ((int64_t)waited >= c->timeout_ns) {
            info[0] = j;
            info[1] = (int64_t)waited;
            return fail(c, RC_TIMEOUT);
        }
        if (t - slice_t0 >= slice_ns) return RC_AGAIN;
        if ((int64_t)waited >= c->spin_budget_ns) {
            ctl_t *peer = ctl(c, j);
            c->slept = 1;
            atomic_fetch_add(&peer->sleepers, 1);
            uint32_t seen = atomic_load(&peer->seq);
            if (!arrived(seen, target)) futex(&peer->seq, FUTEX_WAIT, seen, &nap);
            atomic_fetch_sub(&peer->sleepers, 1);
        }
    }
}

/* ------------------------------------------------------------------------ */
/* Reduction kernels.
 *
 * dst[i] = src[0][i] (op) src[1][i] (op) ... (op) src[n-1][i], combined in
 * that order (rank order), accumulated in ACC (float for half types), then
 * rounded once. Work goes block by block through a small accumulator on the
 * stack, so every inner loop is a plain elementwise loop the compiler
 * vectorizes, and dst may alias a source. Elementwise IEEE operations give
 * the same bits whether a lane is vectorized or not, and no FMA contraction
 * is allowed (-ffp-contract=off), so every rank computing the same element
 * gets the same bits. */

#define BLOCK 512

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
/* Generic x86-64 code plus an AVX2 clone chosen at load time: safe on any
 * x86-64 machine, fast on the ones that have AVX2 (no -march=native). */
#define KERNEL __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define KERNEL
#endif

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
static inline float f32_from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* IEEE half -> float, exact (normals, subnormals, inf, NaN) and branch-free. */
static inline float f16_to_f32(uint16_t h) {
    const uint32_t w = (uint32_t)h << 16;
    const uint32_t sign = w & UINT32_C(0x80000000);
    const uint32_t two_w = w + w;
    /* Normal: move exponent and mantissa into place, rebias by multiplying. */
    const float normal = f32_from_bits((two_w >> 4) + (UINT32_C(0xE0) << 23)) * 0x1.0p-112f;
    /* Subnormal: the mantissa as the low bits of 0.5's mantissa, minus 0.5. */
    const float subnormal = f32_from_bits((two_w >> 17) | (UINT32_C(126) << 23)) - 0.5f;
    const uint32_t bits = two_w < (UINT32_C(1) << 27) ? f32_bits(subnormal) : f32_bits(normal);
    return f32_from_bits(sign | bits);
}

/* float -> IEEE half, round to nearest even, branch-free: scaling by 2^112
 * then 2^-110 lets the FPU do the rounding at half's precision. */
static inline uint16_t f32_to_f16(float f) {
    float base = (__builtin_fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    const uint32_t w = f32_bits(f);
    const uint32_t shl1_w = w + w;
    const uint32_t sign = w & UINT32_C(0x80000000);
    uint32_t bias = shl1_w & UINT32_C(0xFF000000);
    if (bias < UINT32_C(0x71000000)) bias = UINT32_C(0x71000000);
    base = f32_from_bits((bias >> 1) + UINT32_C(0x07800000)) + base;
    const uint32_t bits = f32_bits(base);
    const uint32_t exp_bits = (bits >> 13) & UINT32_C(0x00007C00);
    const uint32_t mantissa_bits = bits & UINT32_C(0x00000FFF);
    const uint32_t nonsign = exp_bits + mantissa_bits;
    return (uint16_t)((sign >> 16) | (shl1_w > UINT32_C(0xFF000000) ? UINT32_C(0x7E00) : nonsign));
}

static inline float bf16_to_f32(uint16_t b) { return f32_from_bits((uint32_t)b << 16); }

/* float -> bfloat16, round to nearest even; NaN stays a (quiet) NaN. */
static inline uint16_t f32_to_bf16(float f) {
    const uint32_t u = f32_bits(f);
    const uint32_t rounded = (u + UINT32_C(0x7FFF) + ((u >> 16) & 1)) >> 16;
    return (uint16_t)((u & UINT32_C(0x7FFFFFFF)) > UINT32_C(0x7F800000) ? ((u >> 16) | 0x40) : rounded);
}

#define IDENT(x) (x)
#define ADD(a, b) ((a) + (b))
#define MUL(a, b) ((a) * (b))
/* NaN propagates, as in torch.minimum / torch.maximum. */
#define FMIN(a, b) ((b) != (b) ? (b) : ((b) < (a) ? (b) : (a)))
#define FMAX(a, b) ((b) != (b) ? (b) : ((b) > (a) ? (b) : (a)))
#define IMIN(a, b) ((b) < (a) ? (b) : (a))
#define IMAX(a, b) ((b) > (a) ? (b) : (a))

typedef void (*reduce_fn)(void *dst, void *dst2, const void *const *srcs, int nsrc, size_t count);

/* T: element type; ACC: accumulator type; LOAD/STORE convert between them;
 * COMBINE(acc, x); DIVIDE: whether to divide by nsrc at the end (AVG).
 * Two sources (two ranks, the common case) take one fused loop, twice as
 * fast as the blocks. */
#define DEFINE_REDUCE(NAME, T, ACC, LOAD, STORE, COMBINE, DIVIDE)                                 \
    KERNEL static void NAME(void *dst_, void *dst2_, const void *const *srcs, int nsrc, size_t count) { \
        T *dst = (T *)dst_;                                                                        \
        T *dst2 = (T *)dst2_;                                                                      \
        if (nsrc == 2) {                                                                           \
            const T *a = (const T *)srcs[0], *b = (const T *)srcs[1];                              \
            if (dst2) {                                                                            \
                for (size_t i = 0; i < count; i++) {                                               \
                    ACC x = (ACC)COMBINE((ACC)LOAD(a[i]), (ACC)LOAD(b[i]));                        \
                    if (DIVIDE) x = x / (ACC)2;                                                    \
                    dst[i] = dst2[i] = (T)STORE(x);                                                \
                }                                                                                  \
            } else {                                                                               \
                for (size_t i = 0; i < count; i++) {                                               \
                    ACC x = (ACC)COMBINE((ACC)LOAD(a[i]), (ACC)LOAD(b[i]));                        \
                    if (DIVIDE) x = x / (ACC)2;                                                    \
                    dst[i] = (T)STORE(x);                                                          \
                }                                                                                  \
            }                                                                                      \
            return;                                                                                \
        }                                                                                          \
        ACC acc[BLOCK] __attribute__((aligned(64)));                                               \
        for (size_t start = 0; start < count; start += BLOCK) {                                    \
            const size_t m = count - start < BLOCK ? count - start : BLOCK;                        \
            const T *s0 = (const T *)srcs[0] + start;                                              \
            for (size_t i = 0; i < m; i++) acc[i] = (ACC)LOAD(s0[i]);                              \
            for (int k = 1; k < nsrc; k++) {                                                       \
                const T *s = (const T *)srcs[k] + start;                                           \
                for (size_t i = 0; i < m; i++) {                                                   \
                    const ACC x = (ACC)LOAD(s[i]);                                                 \
                    acc[i] = (ACC)COMBINE(acc[i], x);                                              \
                }                                                                                  \
            }                                                                                      \
            if (DIVIDE) {                                                                          \
                const ACC divisor = (ACC)nsrc;                                                     \
                for (size_t i = 0; i < m; i++) acc[i] = acc[i] / divisor;                          \
            }                                                                                      \
            for (size_t i = 0; i < m; i++) dst[start + i] = (T)STORE(acc[i]);                      \
            if (dst2)                                                                              \
                for (size_t i = 0; i < m; i++) dst2[start + i] = (T)STORE(acc[i]);                 \
        }                                                                                          \
    }

/* Floating point: SUM and PRODUCT in the type itself (float for half types). */
#define DEFINE_FLOAT(SUFFIX, T, ACC, LOAD, STORE)                              \
    DEFINE_REDUCE(sum_##SUFFIX, T, ACC, LOAD, STORE, ADD, 0)                   \
    DEFINE_REDUCE(product_##SUFFIX, T, ACC, LOAD, STORE, MUL, 0)               \
    DEFINE_REDUCE(min_##SUFFIX, T, ACC, LOAD, STORE, FMIN, 0)                  \
    DEFINE_REDUCE(max_##SUFFIX, T, ACC, LOAD, STORE, FMAX, 0)                  \
    DEFINE_REDUCE(avg_##SUFFIX, T, ACC, LOAD, STORE, ADD, 1)

DEFINE_FLOAT(f32, float, float, IDENT, IDENT)
DEFINE_FLOAT(f64, double, double, IDENT, IDENT)
DEFINE_FLOAT(f16, uint16_t, float, f16_to_f32, f32_to_f16)
DEFINE_FLOAT(bf16, uint16_t, float, bf16_to_f32, f32_to_bf16)

/* Integers: SUM and PRODUCT wrap around (computed unsigned: signed overflow
 * is undefined in C); AVG sums in 64 bits, then divides, truncating toward
 * zero as C (and NCCL) do. */
#define DEFINE_INT(SUFFIX, T, UT, WIDE)                                       \
    DEFINE_REDUCE(sum_##SUFFIX, T, UT, IDENT, IDENT, ADD, 0)                  \
    DEFINE_REDUCE(product_##SUFFIX, T, UT, IDENT, IDENT, MUL, 0)              \
    DEFINE_REDUCE(min_##SUFFIX, T, T, IDENT, IDENT, IMIN, 0)                  \
    DEFINE_REDUCE(max_##SUFFIX, T, T, IDENT, IDENT, IMAX, 0)                  \
    DEFINE_REDUCE(avg_##SUFFIX, T, WIDE, IDENT, IDENT, ADD, 1)

DEFINE_INT(u8, uint8_t, uint8_t, uint64_t)
DEFINE_INT(i8, int8_t, uint8_t, int64_t)
DEFINE_INT(i16, int16_t, uint16_t, int64_t)
DEFINE_INT(i32, int32_t, uint32_t, int64_t)
DEFINE_INT(i64, int64_t, uint64_t, int64_t)

#define ROW(SUFFIX) {sum_##SUFFIX, product_##SUFFIX, min_##SUFFIX, max_##SUFFIX, avg_##SUFFIX}
static const reduce_fn KERNELS[NUM_DTYPES][NUM_OPS] = {
    ROW(f32), ROW(f64), ROW(f16), ROW(bf16), ROW(u8), ROW(i8), ROW(i16), ROW(i32), ROW(i64),
};

/* ------------------------------------------------------------------------ */
/* Setup and teardown. */

EXPORT int ddpkit_shm_abi_version(void) { return DDPKIT_SHM_ABI_VERSION; }

EXPORT const char *ddpkit_shm_source_hash(void) { return DDPKIT_SHM_SOURCE_HASH; }

static size_t data_offset(int world_size) {
    size_t ctl_end = LINE + (size_t)world_size * LINE;
    return (ctl_end + PAGE - 1) / PAGE * PAGE;
}

static size_t segment_bytes(int world_size, size_t slot_bytes) {
    return data_offset(world_size) + (size_t)world_size * 2 * slot_bytes;
}

EXPORT void ddpkit_shm_close(comm_t *c) {
    if (!c) return;
    registry_remove(c);
    if (c->base) munmap(c->base, c->total_bytes);
    if (c->fd >= 0) close(c->fd);
    free(c);
}

/* Rank 0 creates the segment (exclusively, mode 0600) and initializes it;
 * every other rank maps the existing one. The last rank to map it unlinks its
 * name, so nothing is left in /dev/shm from then on, whatever happens to the
 * processes. Returns RC_OK and *out, or a negative code. */
EXPORT int ddpkit_shm_open(const char *name, int rank, int world_size, uint64_t slot_bytes,
                           uint64_t one_shot_max_bytes, double timeout_s, double spin_s, comm_t **out) {
    *out = NULL;
    if (world_size < 2 || world_size > MAX_RANKS || rank < 0 || rank >= world_size || slot_bytes < PAGE ||
        slot_bytes / (uint64_t)world_size < 64 ||
        slot_bytes % PAGE || one_shot_max_bytes > slot_bytes || !(timeout_s > 0) || !(spin_s >= 0))
        return RC_BAD_ARG;
    comm_t *c = calloc(1, sizeof(comm_t));
    if (!c) return -ENOMEM;
    c->fd = -1;
    c->rank = rank;
    c->world_size = world_size;
    c->timeout_ns = timeout_s >= 9e9 ? INT64_MAX : (int64_t)(timeout_s * 1e9);
    c->spin_ns = c->spin_budget_ns = spin_s >= 9e9 ? INT64_MAX / 4 : (int64_t)(spin_s * 1e9);
    const size_t total = segment_bytes(world_size, slot_bytes);
    int rc;
    if (rank == 0) {
        c->fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
        if (c->fd < 0) goto errno_fail;
        /* Lock before anything else, so a stale-segment sweep never mistakes
         * a segment being set up for an abandoned one. */
        if ((rc = lock_rank_byte(c->fd, rank)) != RC_OK) goto rc_fail;
        /* Reserve the pages now: a full /dev/shm fails here with ENOSPC
         * instead of killing a rank with SIGBUS mid-collective. */
        if ((rc = posix_fallocate(c->fd, 0, (off_t)total)) != 0) {
            rc = -rc;
            goto rc_fail;
        }
    } else {
        c->fd = shm_open(name, O_RDWR | O_CLOEXEC, 0600);
        if (c->fd < 0) goto errno_fail;
        struct stat st;
        if (fstat(c->fd, &st) != 0) goto errno_fail;
        if ((size_t)st.st_size != total) {
            rc = RC_BAD_SEGMENT;
            goto rc_fail;
        }
        if ((rc = lock_rank_byte(c->fd, rank)) != RC_OK) goto rc_fail;
    }
    /* MAP_POPULATE: no page faults in the first collectives. */
    c->base = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, c->fd, 0);
    if (c->base == MAP_FAILED) {
        c->base = NULL;
        goto errno_fail;
    }
    c->total_bytes = total;
    c->hdr = (header_t *)c->base;
    c->ctl_base = c->base + LINE;
    c->data_base = c->base + data_offset(world_size);
    if (rank == 0) {
        /* Fresh tmpfs pages are zero: every counter starts at 0. */
        c->hdr->abi_version = DDPKIT_SHM_ABI_VERSION;
        c->hdr->world_size = (uint32_t)world_size;
        c->hdr->slot_bytes = slot_bytes;
        c->hdr->one_shot_max_bytes = one_shot_max_bytes;
        c->hdr->total_bytes = total;
        atomic_store_explicit((_Atomic uint64_t *)&c->hdr->magic, MAGIC, memory_order_release);
    } else {
        /* Rank 0 finished initializing before it told anyone the name. */
        if (atomic_load_explicit((_Atomic uint64_t *)&c->hdr->magic, memory_order_acquire) != MAGIC ||
            c->hdr->abi_version != DDPKIT_SHM_ABI_VERSION || c->hdr->world_size != (uint32_t)world_size ||
            c->hdr->slot_bytes != slot_bytes || c->hdr->total_bytes != total) {
            rc = RC_BAD_SEGMENT;
            goto rc_fail;
        }
    }
    /* Every rank takes the algorithm parameters from the header, so all ranks
     * agree on which algorithm a given size uses. */
    c->slot_bytes = c->hdr->slot_bytes;
    c->one_shot_max_bytes = c->hdr->one_shot_max_bytes;
    c->region_bytes = c->slot_bytes / (size_t)world_size / 64 * 64;
    madvise(c->base, total, MADV_DONTFORK);
    registry_add(c);
    if (atomic_fetch_add(&c->hdr->num_attached, 1) + 1 == (uint32_t)world_size) shm_unlink(name);
    *out = c;
    return RC_OK;

errno_fail:
    rc = -errno;
rc_fail:
    if (rank == 0 && c->fd >= 0) shm_unlink(name);
    ddpkit_shm_close(c);
    return rc;
}

EXPORT int ddpkit_shm_unlink(const char *name) { return shm_unlink(name) == 0 ? 0 : -errno; }

/* 1 if the segment `name` was abandoned (nobody holds rank 0's lock), 0 if in
 * use, negative errno if it cannot be opened. Used to sweep segments left by
 * a job killed during setup, the only moment a name exists. */
EXPORT int ddpkit_shm_is_abandoned(const char *name) {
    int fd = shm_open(name, O_RDWR | O_CLOEXEC, 0600);
    if (fd < 0) return -errno;
    int alive = rank_is_alive(fd, 0);
    close(fd);
    return !alive;
}

/* Make every peer's pending or next call fail fast (RC_ABORTED). */
EXPORT void ddpkit_shm_abort(comm_t *c) { fail(c, RC_BROKEN); }

/* ------------------------------------------------------------------------ */
/* The collective. */

/* Sub-chunk j of a chunk of `len` elements is [bound(j), bound(j + 1)): equal
 * parts rounded up to whole 64-byte lines, so no two ranks write one cache
 * line; it lives at the fixed offset j * region_bytes of a slot whatever the
 * chunk's length (a shorter last chunk must not move a region a peer may
 * still be reading). */
static inline size_t bound(const comm_t *c, size_t len, int j) {
    const size_t n = (size_t)c->world_size, line = 64 / c->esize;
    const size_t per = ((len + n - 1) / n + line - 1) / line * line;
    const size_t b = per * (size_t)j;
    return b < len ? b : len;
}

static int check_descriptors(comm_t *c, int64_t *info) {
    const ctl_t *mine = ctl(c, c->rank);
    const int p = (int)(c->phase & 1);
    for (int j = 0; j < c->world_size; j++) {
        const ctl_t *other = ctl(c, j);
        if (other->desc[p][0] != mine->desc[p][0] || other->desc[p][1] != mine->desc[p][1]) {
            info[0] = j;
            info[1] = (int64_t)other->desc[p][0];
            info[2] = (int64_t)(other->desc[p][1] & 0xff);
            info[3] = (int64_t)(other->desc[p][1] >> 8);
            return fail(c, RC_MISMATCH);
        }
    }
    return RC_OK;
}

/* Chunk c of the call: its first element, length, and the parity of its slots. */
static inline size_t chunk_first(const comm_t *c, size_t k) { return k * c->chunk_elems; }
static inline size_t chunk_len(const comm_t *c, size_t k) {
    size_t first = chunk_first(c, k);
    return c->numel - first < c->chunk_elems ? c->numel - first : c->chunk_elems;
}

/* Reduce-scatter, first half: hand each peer the sub-chunk of chunk k it reduces. */
static void copy_in(comm_t *c, size_t k) {
    const size_t es = c->esize, len = chunk_len(c, k);
    const uint8_t *data = c->data + chunk_first(c, k) * es;
    uint8_t *mine = slot(c, c->rank, c->phase + k);
    for (int j = 0; j < c->world_size; j++) {
        size_t b0 = bound(c, len, j), b1 = bound(c, len, j + 1);
        if (j != c->rank && b1 > b0) memcpy(mine + j * c->region_bytes, data + b0 * es, (b1 - b0) * es);
    }
}

/* Reduce-scatter, second half: reduce our sub-chunk of chunk k from our own
 * tensor and the peers' copies, straight into our tensor and into our slot
 * (where the peers fetch it). */
static void reduce_own(comm_t *c, size_t k) {
    const int r = c->rank;
    const size_t es = c->esize, len = chunk_len(c, k);
    const size_t b0 = bound(c, len, r), b1 = bound(c, len, r + 1);
    uint8_t *data = c->data + (chunk_first(c, k) + b0) * es;
    const void *srcs[MAX_RANKS];
    if (b1 == b0) return;
    const size_t offset = (size_t)r * c->region_bytes;
    for (int j = 0; j < c->world_size; j++) srcs[j] = j == r ? data : slot(c, j, c->phase + k) + offset;
    KERNELS[c->dtype][c->op](data, slot(c, r, c->phase + k) + offset, srcs, c->world_size, b1 - b0);
}

/* All-gather: fetch the peers' reduced sub-chunks of chunk k. */
static void copy_out(comm_t *c, size_t k) {
    const size_t es = c->esize, len = chunk_len(c, k);
    uint8_t *data = c->data + chunk_first(c, k) * es;
    for (int j = 0; j < c->world_size; j++) {
        size_t b0 = bound(c, len, j), b1 = bound(c, len, j + 1);
        if (j != c->rank && b1 > b0)
            memcpy(data + b0 * es, slot(c, j, c->phase + k) + j * c->region_bytes, (b1 - b0) * es);
    }
}

/* The call as a resumable state machine (a wait may return RC_AGAIN).
 *
 * One-shot: copy in | barrier | reduce everything.
 * Chunked, one barrier per chunk plus one: the barrier after reducing chunk k
 * also covers copying in chunk k + 1 (into the other parity's slots), so
 *
 *   copy_in(0) | B | reduce(0) copy_in(1) | B | copy_out(0) reduce(1) copy_in(2) | B | ...
 *
 * Parity keeps it safe: the slots copy_in(k + 1) writes were last read before
 * the barrier that ended chunk k - 1. */
static int run(comm_t *c, int64_t *info) {
    int rc;
    switch (c->step) {
    case STEP_COPY_IN:
        if (c->one_shot)
            memcpy(slot(c, c->rank, c->phase), c->data, c->numel * c->esize);
        else
            copy_in(c, 0);
        arrive(c);
        c->step = STEP_FIRST_WAIT;
        /* fall through */
    case STEP_FIRST_WAIT:
        if ((rc = wait_peers(c, info)) != RC_OK) return rc;
        if ((rc = check_descriptors(c, info)) != RC_OK) return rc;
        if ((rc = check_aborted(c, info)) != RC_OK) return rc;
        if (c->one_shot) {
            /* Every rank reduces everything, in rank order: same bits everywhere. */
            const void *srcs[MAX_RANKS];
            for (int j = 0; j < c->world_size; j++) srcs[j] = j == c->rank ? c->data : slot(c, j, c->phase);
            KERNELS[c->dtype][c->op](c->data, NULL, srcs, c->world_size, c->numel);
            c->phase += 1;
            c->step = STEP_IDLE;
            return RC_OK;
        }
        reduce_own(c, 0);
        if (c->num_chunks > 1) copy_in(c, 1);
        arrive(c);
        c->step = STEP_WAIT;
        /* fall through */
    case STEP_WAIT:
        for (;;) {
            if ((rc = wait_peers(c, info)) != RC_OK) return rc;
            copy_out(c, c->chunk);
            if (++c->chunk == c->num_chunks) break;
            reduce_own(c, c->chunk);
            if (c->chunk + 1 < c->num_chunks) copy_in(c, c->chunk + 1);
            arrive(c);
        }
        c->phase += c->num_chunks;
        c->step = STEP_IDLE;
        return RC_OK;
    }
    return RC_BAD_ARG;
}

/* In-place all_reduce of `numel` elements at `data`. Returns RC_OK, RC_AGAIN
 * (call ddpkit_shm_resume until it returns something else) or an error. */
EXPORT int ddpkit_shm_all_reduce(comm_t *c, void *data, uint64_t numel, int dtype, int op, int64_t *info) {
    if (c->broken) return RC_BROKEN;
    if (c->step != STEP_IDLE || dtype < 0 || dtype >= NUM_DTYPES || op < 0 || op >= NUM_OPS) return RC_BAD_ARG;
    if (numel == 0) return RC_OK;
    c->data = data;
    c->numel = numel;
    c->dtype = dtype;
    c->op = op;
    c->esize = ELEM_SIZE[dtype];
    c->one_shot = numel * c->esize <= c->one_shot_max_bytes;
    c->chunk_elems = (size_t)c->world_size * c->region_bytes / c->esize;
    c->num_chunks = (numel + c->chunk_elems - 1) / c->chunk_elems;
    c->chunk = 0;
    c->step = STEP_COPY_IN;
    ctl_t *mine = ctl(c, c->rank);
    mine->desc[c->phase & 1][0] = numel;
    mine->desc[c->phase & 1][1] = (uint64_t)dtype | (uint64_t)op << 8;
    return run(c, info);
}

EXPORT int ddpkit_shm_resume(comm_t *c, int64_t *info) {
    if (c->broken) return RC_BROKEN;
    if (c->step == STEP_IDLE) return RC_BAD_ARG;
    return run(c, info);
}
