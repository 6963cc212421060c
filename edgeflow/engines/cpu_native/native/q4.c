// edgeflow cpu_native kernels: an int4 Llama decoder step for AVX2 + FMA CPUs (exact int4 weights,
// int16 activations).
//
// Compiled by edgeflow/engines/cpu_native/kernels.py with `cc -O3 -mavx2 -mfma -mf16c -pthread -shared -fPIC` and
// called through ctypes (which releases the GIL). No global state: every function works only on the
// buffers it is given and on the thread team it is handed (0. below), so concurrent calls with separate KV
// caches and scratch buffers are safe (a team runs one parallel region at a time; callers queue for it).
//
// 0. team_*: the session's own worker threads. A parallel region bumps a generation word; workers wait for
//    it by spinning (pause, and a sched_yield every 64 rounds so that whatever else is runnable on that core
//    goes first) for up to spin_ns, then sleep on a futex. Why not OpenMP's passive wait: a decoder step is
//    ~200 regions of 10-60 us on the 30-layer model, and every futex wake-up of an idle vCPU cost about as
//    much as the region (68 tok/s passive vs ~270 spinning on the 2-core Intel VM, BENCHMARKS.md#thread-team). Why not
//    OpenMP's spin: its workers spin without yielding, so on a busy machine they starve the thread they wait
//    for (GOMP_SPINCOUNT=20000: 31 tok/s against 110 passive with one other busy process).
//
// 1. q4i_gemm: y[m, n] = sum_g s[n, g] * xs[m, g] * sum_{k in g} (q[n, k] - z[n, g]) * xq[m, k]  (group 64).
//    q and z are the checkpoint's unsigned 4-bit integers (compressed-tensors stores q + 8; a symmetric
//    scheme has z = 8): the weights are used exactly. The activations are quantized per 64-group to int16
//    (xq, scale xs; 15 bits where fp16 keeps 11), so sum_k (q - z) * xq is an exact integer (vpmaddwd) and
//    the roundings are the activations' (half a step of the group's max) and the fp32 sum over groups.
//    Measured against the fake-quantized model in fp32: logits within 0.5e-4 to 2.5e-4 of their largest
//    magnitude, identical greedy tokens (BENCHMARKS.md#cpu-native-vs-hf). Up to 4 activation rows (a decode step of up to 4
//    streams, or 4 tokens of a prefill chunk) share one unpack of every weight row (2.75 ALU ops per 16
//    weights, against 8 to reach fp32), so a step is close to reading the weights once and a second stream
//    adds only its own multiply-adds. A step of more than 4 rows (a prefill chunk) runs panels instead: 8 weight rows
//    unpacked once per step to int16, then every row's multiply-adds over them, with bitwise the same results.
//    Layout: w [N][G][16] uint16, word i of row n's group g = q[i] | q[16+i] << 4 | q[32+i] << 8 | q[48+i] << 12
//    (indices within the group); s fp32 [N][G], z int16 [N][G].
// 1b. q8w_gemm: the same for 8-bit weights (W8A16, and the 8-bit half of mixed recipes):
//    y[m, n] = sum_g s[n, g] * xs[m, g] * sum_{k in g} (w[n, k] - z[n, g]) * xq[m, k], with w the checkpoint's
//    integer minus 128 (int8) and z its zero point minus 128 (0 when symmetric), so w - z is the stored q - z
//    exactly. Per-channel and larger groups arrive as per-64-group scales (repeated at build). Each vpmaddwd
//    lane (2 products, |q - z| <= 255: < 2^24) converts to fp32 exactly; the four per group are summed in fp32.
//    Layout: w int8 [N][K] row-major, s fp32 [N][G], z int16 [N][G].
// 2. f32_gemm: y = x @ W^T for plain fp32 weights [N, K] (dense checkpoints, dequantized schemes), fp32 throughout.
// 3. head_argmax: exact greedy argmax of x . E_r over the fp32 lm_head E [V, K] from an int8 per-row
//    copy Ehat (row-major [Vp][Kp], K zero-padded to a multiple of 64) and int16 activations xhat (one scale).
//    With a_r = xhat . Ehat_r, d_r = ||E_r - Ehat_r|| and dx = ||x - xhat||, Cauchy-Schwarz gives
//    |x . E_r - a_r| <= ||x|| d_r + dx (||E_r|| + d_r); adding an fp32 rounding slack c_K (||x|| + dx)(||E_r|| + d_r)
//    gives e_r, where c_K covers the rounding of the int8 pass and of the fp32 rescoring (16 lanes of K/16):
//    (K/8 + K/16 + 8) unit roundoffs, doubled, and at least 1e-5 (more than either needs).
//    Every row with a_r + e_r >= max_j (a_j - e_j) is a candidate: the true argmax is always one of them.
//    Candidates are rescored in fp32 against E; above max_cand candidates one full fp32 pass runs.
// 4. llama_step: a whole Llama decoder pass for M <= 64 rows (RMSNorm, fused qkv, RoPE, KV write, GQA
//    attention, o_proj, residual, RMSNorm, fused gate/up, SiLU * up, down, residual, final norm), so a
//    step has no per-op Python overhead. Row m has its own slot (KV cache) and position; the rows of one slot
//    are consecutive positions in order (a prefill chunk, or one decode row), and several slots may share a
//    step (a batched decode step, or the prompts of streams that arrived together).
#define _GNU_SOURCE  // pthread_setname_np
#include <immintrin.h>
#include <math.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#include <stdint.h>
#include <string.h>

static inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi); lo = _mm_hadd_ps(lo, lo); lo = _mm_hadd_ps(lo, lo);
    return _mm_cvtss_f32(lo);
}

// The 8 horizontal sums of a[0..7] as one vector (lane j = hsum(a[j])): 6 hadds, 2 lane permutes and an add.
static inline __m256 hsum8(const __m256* a) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// The same 8 sums, each in hsum's own order (lanes i and i+4, then neighbours, then the two pairs), so that a row's
// result does not depend on which kernel reduced it.
static inline __m256 hsum8_ordered(const __m256* a) {
    __m128 t[8];
    for (int i = 0; i < 8; i++) t[i] = _mm_add_ps(_mm256_castps256_ps128(a[i]), _mm256_extractf128_ps(a[i], 1));
    const __m256 t01 = _mm256_set_m128(t[1], t[0]), t23 = _mm256_set_m128(t[3], t[2]);
    const __m256 t45 = _mm256_set_m128(t[5], t[4]), t67 = _mm256_set_m128(t[7], t[6]);
    const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(t01, t23), _mm256_hadd_ps(t45, t67));  // lanes 0 2 4 6 | 1 3 5 7
    return _mm256_permutevar8x32_ps(u, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// ---------------------------------------------------------------------------------------------- thread team
// Which wait is faster depends on the machine's load and on where the scheduler puts our threads: on the
// quiet 2-core VM spinning made a step ~4x faster, but with a busy process beside it the same spin made
// some runs 5x slower (both our threads on one core, the spinner taking the worker's time slices). So the
// team measures: every PROBE_EVERY decoder steps it runs PROBE_STEPS steps of the same shape spinning and
// PROBE_STEPS sleeping, and keeps the faster. (A probe costs at most 8 of PROBE_EVERY steps in the slower
// policy; a step of another shape restarts it.) Only decode steps (at most DECODE_ROWS rows) are probed or counted:
// a prefill chunk's regions are long, so its waits are few and both policies time alike, and a probe judged on
// prefill steps picked sleeping by chance in 2 of 6 sessions, which then decoded at 90-120 tok/s instead of 200-280
// for the next PROBE_EVERY steps (BENCHMARKS.md#thread-team). A prefill step runs under the policy in force.
#define PROBE_STEPS 4
#define PROBE_EVERY 512
#define PROBE_FIRST 8
// Rows a decode step carries at most: one per stream (cpu_native.MAX_ROWS), the widest row kernel (1-4 rows, q4a_rows).
// A step with more rows is a prefill chunk: the linears take the panel kernels and attention runs by KV group.
#define DECODE_ROWS 4
typedef void (*job_fn)(void* arg, int tid, int nth);
typedef struct team {
    int nt; long spin_ns;
    pthread_t* th;
    pthread_mutex_t lock;           // one region at a time
    job_fn fn; void* arg;           // the region being run
    _Atomic unsigned gen;           // futex word: bumped to start a region (or to stop)
    _Atomic unsigned done;          // futex word: set to gen by the last worker to finish it
    _Atomic int pending;            // workers still in the region
    _Atomic int gen_sleepers, done_sleepers;
    _Atomic int stop;
    _Atomic int spinning;           // 1: waits spin up to spin_ns first; 0: they sleep at once
    _Atomic long regions, sleeps;   // counters for the session's stats
    // the wait-policy probe (team_step_*): steps left until the next probe, the probe's phase, its step
    // shape (rows) and the summed step times of both policies
    pthread_mutex_t probe_lock;
    long until_probe; int phase, probe_rows; long probe_ns[2]; _Atomic long probes, probes_spin;
} team_t;

static long now_ns(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1000000000L + t.tv_nsec; }

// Wait until *w == target: spin up to spin_ns (yielding the core every 64 pauses), then sleep on the futex.
static void wait_for(team_t* t, _Atomic unsigned* w, unsigned target, _Atomic int* sleepers) {
    if (atomic_load_explicit(w, memory_order_acquire) == target) return;
    if (t->spin_ns > 0 && atomic_load_explicit(&t->spinning, memory_order_relaxed)) {
        const long t0 = now_ns();
        for (int i = 1;; i++) {
            if (atomic_load_explicit(w, memory_order_acquire) == target) return;
            if ((i & 63) == 0) { if (now_ns() - t0 > t->spin_ns) break; sched_yield(); }
            else _mm_pause();
        }
    }
    atomic_fetch_add(sleepers, 1);
    atomic_fetch_add_explicit(&t->sleeps, 1, memory_order_relaxed);
    unsigned v;
    while ((v = atomic_load(w)) != target) syscall(SYS_futex, w, FUTEX_WAIT_PRIVATE, v, NULL, NULL, 0);
    atomic_fetch_sub(sleepers, 1);
}

static void wake(_Atomic unsigned* w, _Atomic int* sleepers) {
    if (atomic_load(sleepers)) syscall(SYS_futex, w, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

typedef struct { team_t* t; int tid; } worker_arg;

static void* team_worker(void* p) {
    team_t* t = ((worker_arg*)p)->t; const int tid = ((worker_arg*)p)->tid; free(p);
    pthread_setname_np(pthread_self(), "edgeflow-team");  // what top -H and /proc/<pid>/task/*/comm show
    for (unsigned seen = 0;;) {
        wait_for(t, &t->gen, seen + 1, &t->gen_sleepers); seen++;
        if (atomic_load(&t->stop)) return NULL;
        t->fn(t->arg, tid, t->nt);
        if (atomic_fetch_sub(&t->pending, 1) == 1) { atomic_store(&t->done, seen); wake(&t->done, &t->done_sleepers); }
    }
}

// A team of nt threads (the caller of every region is thread 0, so nt - 1 are started). NULL if nt <= 1 or
// a thread cannot be started (the kernels then run on the caller alone).
void* team_create(int nt, long spin_ns) {
    if (nt <= 1) return NULL;
    team_t* t = (team_t*)calloc(1, sizeof(team_t));
    if (!t) return NULL;
    t->nt = nt; t->spin_ns = spin_ns; t->th = (pthread_t*)calloc((size_t)nt, sizeof(pthread_t));
    pthread_mutex_init(&t->lock, NULL); pthread_mutex_init(&t->probe_lock, NULL);
    atomic_store(&t->spinning, spin_ns > 0); t->until_probe = PROBE_FIRST;
    for (int i = 1; i < nt; i++) {
        worker_arg* a = (worker_arg*)malloc(sizeof(worker_arg)); a->t = t; a->tid = i;
        if (pthread_create(&t->th[i], NULL, team_worker, a) != 0) { free(a); t->nt = i; break; }
    }
    return t;
}

void team_destroy(void* p) {
    team_t* t = (team_t*)p;
    if (!t) return;
    pthread_mutex_lock(&t->lock);
    atomic_store(&t->stop, 1); atomic_fetch_add(&t->gen, 1); wake(&t->gen, &t->gen_sleepers);
    for (int i = 1; i < t->nt; i++) pthread_join(t->th[i], NULL);
    pthread_mutex_unlock(&t->lock); pthread_mutex_destroy(&t->lock); pthread_mutex_destroy(&t->probe_lock);
    free(t->th); free(t);
}

int team_threads(void* p) { return p ? ((team_t*)p)->nt : 1; }
long team_regions(void* p) { return p ? atomic_load(&((team_t*)p)->regions) : 0; }
long team_sleeps(void* p) { return p ? atomic_load(&((team_t*)p)->sleeps) : 0; }
long team_probes(void* p) { return p ? atomic_load(&((team_t*)p)->probes) : 0; }
long team_probes_spin(void* p) { return p ? atomic_load(&((team_t*)p)->probes_spin) : 0; }
int team_spinning(void* p) { return p ? atomic_load(&((team_t*)p)->spinning) : 0; }

static void team_step_begin(team_t* t, int rows) {
    if (!t || t->spin_ns <= 0 || rows > DECODE_ROWS) return;
    pthread_mutex_lock(&t->probe_lock);
    if (t->phase == 0 && --t->until_probe <= 0) { t->phase = 1; t->probe_rows = rows; t->probe_ns[0] = t->probe_ns[1] = 0; }
    if (t->phase > 0 && rows != t->probe_rows) { t->phase = 1; t->probe_rows = rows; t->probe_ns[0] = t->probe_ns[1] = 0; }
    if (t->phase > 0) atomic_store(&t->spinning, t->phase <= PROBE_STEPS);
    pthread_mutex_unlock(&t->probe_lock);
}
static void team_step_end(team_t* t, int rows, long ns) {
    if (!t || t->spin_ns <= 0 || rows > DECODE_ROWS) return;
    pthread_mutex_lock(&t->probe_lock);
    if (t->phase > 0) {
        t->probe_ns[t->phase <= PROBE_STEPS ? 1 : 0] += ns;
        if (++t->phase > 2 * PROBE_STEPS) {
            const int spin = t->probe_ns[1] <= t->probe_ns[0];
            atomic_store(&t->spinning, spin); atomic_fetch_add(&t->probes, 1); atomic_fetch_add(&t->probes_spin, spin);
            t->phase = 0; t->until_probe = PROBE_EVERY;
        }
    }
    pthread_mutex_unlock(&t->probe_lock);
}

// fn(arg, tid, nth) on every thread of the team, the caller included; returns when all are done.
static void team_run(team_t* t, job_fn fn, void* arg) {
    if (!t) { fn(arg, 0, 1); return; }
    pthread_mutex_lock(&t->lock);
    t->fn = fn; t->arg = arg;
    atomic_store(&t->pending, t->nt - 1);
    const unsigned g = atomic_fetch_add(&t->gen, 1) + 1;
    wake(&t->gen, &t->gen_sleepers);
    fn(arg, 0, t->nt);
    if (t->nt > 1) wait_for(t, &t->done, g, &t->done_sleepers);
    atomic_fetch_add_explicit(&t->regions, 1, memory_order_relaxed);
    pthread_mutex_unlock(&t->lock);
}

// split the N/4 row tiles into nth contiguous chunks
#define SPLIT int tiles = N / 4;                                                                        \
    int r0 = (int)((long)tiles * tid / nth) * 4, r1 = (int)((long)tiles * (tid + 1) / nth) * 4;

// ---------------------------------------------------------------------------------------------- activations
// Each 64-element group of an activation row is quantized to int16 with its own scale: xs = max|x| / 32767,
// xq = rint(x / xs). 15 bits per group (fp16 keeps 11), so a group's own outlier costs only that group's
// precision. K % 64 == 0. Out: xq [M, K], xs [M, K/64].
static void quantize_rows(const float* x, int M, int K, int16_t* xq, float* xs) {
    const int G = K / 64; const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int m = 0; m < M; m++) {
        const float* a = x + (size_t)m * K; int16_t* q = xq + (size_t)m * K;
        for (int g = 0; g < G; g++) {
            const float* v = a + g * 64;
            __m256 mx = _mm256_setzero_ps();
            for (int i = 0; i < 64; i += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(v + i)));
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h)); h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
            const float amax = _mm_cvtss_f32(h);
            const float inv = amax > 0 ? 32767.0f / amax : 0.0f;
            xs[(size_t)m * G + g] = amax > 0 ? amax / 32767.0f : 0.0f;
            const __m256 iv = _mm256_set1_ps(inv);
            for (int i = 0; i < 64; i += 16) {  // round to nearest even (the default MXCSR mode)
                __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + i), iv));
                __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + i + 8), iv));
                __m256i pk = _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8);  // packs works per 128-bit lane
                _mm256_storeu_si256((__m256i*)(q + g * 64 + i), pk);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------- int4
// One weight row's group of 64 is 16 uint16 words; word i holds q[i], q[16+i], q[32+i], q[48+i] in bits
// 0-3, 4-7, 8-11, 12-15, so three shifts, three masks and four subtractions of the zero point give four int16
// vectors of q - z (shared by all M activation rows: the per-row work is 4 vpmaddwd, 3 adds, one convert and
// one FMA per 64 weights). The products and the 8 per lane (|q - z| <= 15: <= 8 * 15 * 32767 < 2^22) are
// exact in int32 and in the float they convert to, so each group's sum_k (q - z) xq is exact.
// One 64-group of the int4 layout (16 words) as four int16 vectors of q - z, in k order (the layout above).
static inline void q4_group_unpack(const uint16_t* wg, int16_t z, __m256i u[4]) {
    const __m256i mask = _mm256_set1_epi16(15), v = _mm256_loadu_si256((const __m256i*)wg), zz = _mm256_set1_epi16(z);
    u[0] = _mm256_sub_epi16(_mm256_and_si256(v, mask), zz);
    u[1] = _mm256_sub_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), mask), zz);
    u[2] = _mm256_sub_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 8), mask), zz);
    u[3] = _mm256_sub_epi16(_mm256_srli_epi16(v, 12), zz);
}

#define DEFINE_Q4A(MM)                                                                                       \
static void q4a_rows_##MM(const int16_t* xq, const float* xs, int K, int N, const void* wv,             \
                          const float* s, const int16_t* z, float* y, int r0, int r1) {                      \
    const int G = K / 64; const uint16_t* w = (const uint16_t*)wv; \
    for (int n = r0; n < r1; n++) {                                                                          \
        const uint16_t* wn = w + (size_t)n * G * 16; const float* sn = s + (size_t)n * G;                    \
        const int16_t* zn = z + (size_t)n * G;                                                               \
        __m256 acc[MM]; float sx[MM * G];  /* sx = s[n, g] * xs[m, g], broadcast from memory */            \
        for (int m = 0; m < MM; m++) {                                                                       \
            acc[m] = _mm256_setzero_ps(); int g = 0; const float* xsm = xs + (size_t)m * G;                  \
            for (; g + 8 <= G; g += 8)                                                                       \
                _mm256_storeu_ps(sx + m * G + g, _mm256_mul_ps(_mm256_loadu_ps(sn + g), _mm256_loadu_ps(xsm + g))); \
            for (; g < G; g++) sx[m * G + g] = sn[g] * xsm[g];                                              \
        }                                                                                                    \
        for (int g = 0; g < G; g++) {                                                                        \
            _mm_prefetch((const char*)(wn + g * 16 + 512), _MM_HINT_T0);                                     \
            __m256i u[4]; q4_group_unpack(wn + g * 16, zn[g], u);                                            \
            const __m256i u0 = u[0], u1 = u[1], u2 = u[2], u3 = u[3];                                        \
            for (int m = 0; m < MM; m++) {                                                                   \
                const __m256i* xm = (const __m256i*)(xq + (size_t)m * K + g * 64);                           \
                __m256i p = _mm256_madd_epi16(u0, _mm256_loadu_si256(xm));                                   \
                p = _mm256_add_epi32(p, _mm256_madd_epi16(u1, _mm256_loadu_si256(xm + 1)));                  \
                p = _mm256_add_epi32(p, _mm256_madd_epi16(u2, _mm256_loadu_si256(xm + 2)));                  \
                p = _mm256_add_epi32(p, _mm256_madd_epi16(u3, _mm256_loadu_si256(xm + 3)));                  \
                acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(sx + m * G + g), acc[m]);    \
            }                                                                                                \
        }                                                                                                    \
        for (int m = 0; m < MM; m++) y[(size_t)m * N + n] = hsum(acc[m]);                                    \
    }                                                                                                        \
}
DEFINE_Q4A(1) DEFINE_Q4A(2) DEFINE_Q4A(3) DEFINE_Q4A(4)


#define SPLIT_ROWS \
    int r0 = (int)((long)N * tid / nth), r1 = (int)((long)N * (tid + 1) / nth);

// Any M: one parallel region; each thread takes a range of weight rows and runs the activation rows over
// it in chunks of 4 (each chunk sharing one unpack). K % 64 == 0. `rows` is the width's row kernels for 1-4
// activation rows (Q4_ROWS, Q8_ROWS below): the int4 and int8 weights share everything else. A step of more
// than DECODE_ROWS rows (a prefill chunk) takes the width's panel kernel instead (below).
typedef void (*qrows_fn)(const int16_t* xq, const float* xs, int K, int N, const void* w, const float* s,
                         const int16_t* z, float* y, int r0, int r1);
typedef void (*qpanel_fn)(const int16_t* xq, const float* xs, int M, int K, int N, const void* w, const float* s,
                          const int16_t* z, float* y, int r0, int r1);
typedef struct { const qrows_fn* rows; qpanel_fn panel; const int16_t* xq; const float* xs; int M, K, N; const void* w;
                 const float* s; const int16_t* z; float* y; } qi_job;

static void qi_rows(const qi_job* j, int r0, int r1) {
    const int G = j->K / 64;
    for (int m0 = 0; m0 < j->M; m0 += 4) {
        const int mm = j->M - m0 < 4 ? j->M - m0 : 4;
        j->rows[mm - 1](j->xq + (size_t)m0 * j->K, j->xs + (size_t)m0 * G, j->K, j->N, j->w, j->s, j->z,
                        j->y + (size_t)m0 * j->N, r0, r1);
    }
}

#define PANEL 8  // weight rows a panel kernel unpacks at once (one output vector per activation row)

static void qi_region(void* p, int tid, int nth) {
    const qi_job* j = (const qi_job*)p; const int N = j->N;
    if (j->M <= DECODE_ROWS) { SPLIT_ROWS qi_rows(j, r0, r1); return; }
    const int blocks = N / PANEL;  // whole panels split across the team; the rows after them on the last thread
    const int r0 = (int)((long)blocks * tid / nth) * PANEL, r1 = (int)((long)blocks * (tid + 1) / nth) * PANEL;
    if (r1 > r0) j->panel(j->xq, j->xs, j->M, j->K, N, j->w, j->s, j->z, j->y, r0, r1);
    if (tid == nth - 1 && blocks * PANEL < N) qi_rows(j, blocks * PANEL, N);
}

// Prefill panels: PANEL weight rows unpacked once to int16 q - z (the row kernels' own vectors) into a buffer that
// stays in L1, then every activation row of the step runs over them with its 64-group held in registers. Per row and
// group that is the row kernels' multiply-adds alone (4 vpmaddwd, the group's adds, a convert and an FMA), without
// their unpack (11 ops per group, shared by at most 4 rows). Each output is the same sum in the same order as the
// row kernels' (the same group sums, the same FMA per lane, hsum's order): bitwise the same results, so a prompt's
// hidden states do not depend on the chunk that carried it. While a panel computes, the next one's packed weights are
// prefetched into L2 (the unpack had waited on them). 1.0-1.18x the row kernels' multiply-adds per second at 16 rows
// and 1.10-1.28x at 128 on the 2-core Intel VM (BENCHMARKS.md#kernels-gflops).
#define DEFINE_PANEL(NAME, UNPACK, GROUP, ROW_BYTES)                                                         \
static void NAME(const int16_t* xq, const float* xs, int M, int K, int N, const void* w, const float* s,     \
                 const int16_t* z, float* y, int r0, int r1) {                                               \
    const int G = K / 64; const size_t rb = (size_t)(ROW_BYTES);                                             \
    int16_t* wq = (int16_t*)_mm_malloc((size_t)PANEL * K * sizeof(int16_t), 32);                             \
    float* sx = (float*)_mm_malloc((size_t)M * G * PANEL * sizeof(float), 32);  /* [M][G][PANEL] */          \
    for (int n = r0; n < r1; n += PANEL) {                                                                   \
        if (n + PANEL < r1) /* the next panel's weights into L2 while this one computes */                   \
            for (size_t b = 0; b < PANEL * rb; b += 64) _mm_prefetch((const char*)w + (n + PANEL) * rb + b, _MM_HINT_T1); \
        for (int r = 0; r < PANEL; r++) UNPACK(w, z, K, n + r, wq + (size_t)r * K);                          \
        for (int g = 0; g < G; g++) {  /* sx = s[n + r, g] * xs[m, g], as the row kernels form it */        \
            float sg[PANEL] __attribute__((aligned(32)));                                                    \
            for (int r = 0; r < PANEL; r++) sg[r] = s[(size_t)(n + r) * G + g];                              \
            for (int m = 0; m < M; m++)                                                                      \
                _mm256_store_ps(sx + ((size_t)m * G + g) * PANEL, _mm256_mul_ps(_mm256_load_ps(sg), _mm256_set1_ps(xs[(size_t)m * G + g]))); \
        }                                                                                                    \
        for (int m = 0; m < M; m++) {                                                                        \
            const int16_t* xm = xq + (size_t)m * K; const float* sxm = sx + (size_t)m * G * PANEL;           \
            __m256 acc[PANEL];                                                                               \
            for (int r = 0; r < PANEL; r++) acc[r] = _mm256_setzero_ps();                                    \
            for (int g = 0; g < G; g++) {                                                                    \
                const __m256i* xg = (const __m256i*)(xm + g * 64);                                           \
                const __m256i x0 = _mm256_loadu_si256(xg), x1 = _mm256_loadu_si256(xg + 1);                  \
                const __m256i x2 = _mm256_loadu_si256(xg + 2), x3 = _mm256_loadu_si256(xg + 3);              \
                for (int r = 0; r < PANEL; r++) {                                                            \
                    const __m256i* u = (const __m256i*)(wq + (size_t)r * K + g * 64);                        \
                    acc[r] = _mm256_fmadd_ps(GROUP(u, x0, x1, x2, x3), _mm256_broadcast_ss(sxm + g * PANEL + r), acc[r]); \
                }                                                                                            \
            }                                                                                                \
            _mm256_storeu_ps(y + (size_t)m * N + n, hsum8_ordered(acc));                                     \
        }                                                                                                    \
    }                                                                                                        \
    _mm_free(wq); _mm_free(sx);                                                                              \
}

// Row n of the int4 layout as int16 q - z, in k order (the vectors q4a_rows computes per group).
static void q4_unpack(const void* wv, const int16_t* z, int K, int n, int16_t* out) {
    const int G = K / 64;
    const uint16_t* wn = (const uint16_t*)wv + (size_t)n * G * 16; const int16_t* zn = z + (size_t)n * G;
    for (int g = 0; g < G; g++) {
        __m256i u[4]; q4_group_unpack(wn + g * 16, zn[g], u);
        for (int i = 0; i < 4; i++) _mm256_store_si256((__m256i*)(out + g * 64) + i, u[i]);
    }
}

// A group's sum as q4a_rows forms it: the four vpmaddwd added in int32 (exact), then one convert.
static inline __m256 q4_group(const __m256i* u, __m256i x0, __m256i x1, __m256i x2, __m256i x3) {
    __m256i p = _mm256_madd_epi16(_mm256_load_si256(u), x0);
    p = _mm256_add_epi32(p, _mm256_madd_epi16(_mm256_load_si256(u + 1), x1));
    p = _mm256_add_epi32(p, _mm256_madd_epi16(_mm256_load_si256(u + 2), x2));
    p = _mm256_add_epi32(p, _mm256_madd_epi16(_mm256_load_si256(u + 3), x3));
    return _mm256_cvtepi32_ps(p);
}
DEFINE_PANEL(q4_panel, q4_unpack, q4_group, K / 2)

// y [M, N] from x [M, K]: the activations quantized per 64-group, then the width's row kernels over the team.
static void qi_gemm(const qrows_fn* rows, qpanel_fn panel, const float* x, int M, int K, int N, const void* w, const float* s,
                    const int16_t* z, float* y, void* team) {
    const int G = K / 64;
    int16_t* xq = (int16_t*)_mm_malloc((size_t)M * K * sizeof(int16_t), 32);
    float* xs = (float*)_mm_malloc((size_t)M * G * sizeof(float), 32);
    quantize_rows(x, M, K, xq, xs);
    qi_job j = {rows, panel, xq, xs, M, K, N, w, s, z, y};
    team_run((team_t*)team, qi_region, &j);
    _mm_free(xq); _mm_free(xs);
}

static const qrows_fn Q4_ROWS[4] = {q4a_rows_1, q4a_rows_2, q4a_rows_3, q4a_rows_4};

void q4i_gemm(const float* x, int M, int K, int N, const uint16_t* w, const float* s, const int16_t* z, float* y, void* team) {
    qi_gemm(Q4_ROWS, q4_panel, x, M, K, N, w, s, z, y, team);
}

// ---------------------------------------------------------------------------------------------- int8 weights
// As q4a_rows with 8-bit weights (header, 1b.): a group of 64 is 64 bytes, sign-extended to four int16 vectors.
#define DEFINE_Q8W(MM)                                                                                       \
static void q8w_rows_##MM(const int16_t* xq, const float* xs, int K, int N, const void* wv,             \
                          const float* s, const int16_t* z, float* y, int r0, int r1) {                      \
    const int G = K / 64; const int8_t* w = (const int8_t*)wv;                                               \
    for (int n = r0; n < r1; n++) {                                                                          \
        const int8_t* wn = w + (size_t)n * K; const float* sn = s + (size_t)n * G;                           \
        const int16_t* zn = z + (size_t)n * G;                                                               \
        __m256 acc[MM]; float sx[MM * G];                                                                    \
        for (int m = 0; m < MM; m++) {                                                                       \
            acc[m] = _mm256_setzero_ps(); int g = 0; const float* xsm = xs + (size_t)m * G;                  \
            for (; g + 8 <= G; g += 8)                                                                       \
                _mm256_storeu_ps(sx + m * G + g, _mm256_mul_ps(_mm256_loadu_ps(sn + g), _mm256_loadu_ps(xsm + g))); \
            for (; g < G; g++) sx[m * G + g] = sn[g] * xsm[g];                                              \
        }                                                                                                    \
        for (int g = 0; g < G; g++) {                                                                        \
            const int8_t* b = wn + g * 64;                                                                   \
            _mm_prefetch((const char*)(b + 1024), _MM_HINT_T0);                                              \
            const __m256i zz = _mm256_set1_epi16(zn[g]);                                                     \
            const __m256i u0 = _mm256_sub_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)b)), zz);        \
            const __m256i u1 = _mm256_sub_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(b + 16))), zz); \
            const __m256i u2 = _mm256_sub_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(b + 32))), zz); \
            const __m256i u3 = _mm256_sub_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(b + 48))), zz); \
            for (int m = 0; m < MM; m++) {                                                                   \
                const __m256i* xm = (const __m256i*)(xq + (size_t)m * K + g * 64);                           \
                __m256 f = _mm256_add_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(u0, _mm256_loadu_si256(xm))),           \
                                         _mm256_cvtepi32_ps(_mm256_madd_epi16(u1, _mm256_loadu_si256(xm + 1))));      \
                f = _mm256_add_ps(f, _mm256_add_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(u2, _mm256_loadu_si256(xm + 2))), \
                                                   _mm256_cvtepi32_ps(_mm256_madd_epi16(u3, _mm256_loadu_si256(xm + 3))))); \
                acc[m] = _mm256_fmadd_ps(f, _mm256_broadcast_ss(sx + m * G + g), acc[m]);                     \
            }                                                                                                \
        }                                                                                                    \
        for (int m = 0; m < MM; m++) y[(size_t)m * N + n] = hsum(acc[m]);                                    \
    }                                                                                                        \
}
DEFINE_Q8W(1) DEFINE_Q8W(2) DEFINE_Q8W(3) DEFINE_Q8W(4)

static const qrows_fn Q8_ROWS[4] = {q8w_rows_1, q8w_rows_2, q8w_rows_3, q8w_rows_4};

// Row n of the int8 layout as int16 w - z, in k order (q8w_rows' vectors).
static void q8_unpack(const void* wv, const int16_t* z, int K, int n, int16_t* out) {
    const int G = K / 64; const int8_t* wn = (const int8_t*)wv + (size_t)n * K; const int16_t* zn = z + (size_t)n * G;
    for (int g = 0; g < G; g++) {
        const __m256i zz = _mm256_set1_epi16(zn[g]);
        for (int i = 0; i < 4; i++)
            _mm256_store_si256((__m256i*)(out + g * 64 + i * 16),
                               _mm256_sub_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(wn + g * 64 + i * 16))), zz));
    }
}

// A group's sum as q8w_rows forms it: each vpmaddwd converted (exact), added in fp32 in pairs.
static inline __m256 q8_group(const __m256i* u, __m256i x0, __m256i x1, __m256i x2, __m256i x3) {
    const __m256 f = _mm256_add_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_load_si256(u), x0)),
                                   _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_load_si256(u + 1), x1)));
    return _mm256_add_ps(f, _mm256_add_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_load_si256(u + 2), x2)),
                                          _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_load_si256(u + 3), x3))));
}
DEFINE_PANEL(q8_panel, q8_unpack, q8_group, K)


void q8w_gemm(const float* x, int M, int K, int N, const int8_t* w, const float* s, const int16_t* z, float* y, void* team) {
    qi_gemm(Q8_ROWS, q8_panel, x, M, K, N, w, s, z, y, team);
}

// ---------------------------------------------------------------------------------------------- fp32
// MM activation rows times R weight rows: MM * R accumulators, MM activation vectors and one weight vector live in
// registers. 4 x 3 (17 vectors for AVX2's 16 ymm registers) against the 4 x 4 before it (21, spilling), with the
// team's 2 threads on the 2-core AMD EPYC box: 86-96 against 46-62 GFLOP/s at 16 and 128 rows (python
// benchmarks/kernels.py; BENCHMARKS.md#kernels-gflops). Each output is the same sum in the same order whatever the tiling: results
// are bitwise the same as the 4 x 4 kernel's.
#define DEFINE_F32(MM, R)                                                                                    \
static void f32_rows_##MM##_##R(const float* x, int K, int N, const float* w, float* y, int n0) {         \
    __m256 a[MM][R];                                                                                         \
    for (int m = 0; m < MM; m++) for (int r = 0; r < R; r++) a[m][r] = _mm256_setzero_ps();                 \
    for (int k = 0; k < K; k += 8) {                                                                         \
        __m256 xv[MM];                                                                                       \
        for (int m = 0; m < MM; m++) xv[m] = _mm256_loadu_ps(x + (size_t)m * K + k);                         \
        for (int r = 0; r < R; r++) {                                                                        \
            __m256 wv = _mm256_loadu_ps(w + (size_t)(n0 + r) * K + k);                                       \
            for (int m = 0; m < MM; m++) a[m][r] = _mm256_fmadd_ps(wv, xv[m], a[m][r]);                      \
        }                                                                                                    \
    }                                                                                                        \
    for (int m = 0; m < MM; m++) for (int r = 0; r < R; r++) y[(size_t)m * N + n0 + r] = hsum(a[m][r]);     \
}
DEFINE_F32(1, 3) DEFINE_F32(2, 3) DEFINE_F32(3, 3) DEFINE_F32(4, 3)
DEFINE_F32(1, 1) DEFINE_F32(2, 1) DEFINE_F32(3, 1) DEFINE_F32(4, 1)
// columns r0..r1 of MM rows: tiles of 3 weight rows, then the one or two left over
#define DEFINE_F32_RANGE(MM)                                                                                 \
static void f32_rows_##MM(const float* x, int K, int N, const float* w, float* y, int r0, int r1) {         \
    int n0 = r0;                                                                                             \
    for (; n0 + 3 <= r1; n0 += 3) f32_rows_##MM##_3(x, K, N, w, y, n0);                                      \
    for (; n0 < r1; n0++) f32_rows_##MM##_1(x, K, N, w, y, n0);                                              \
}
DEFINE_F32_RANGE(1) DEFINE_F32_RANGE(2) DEFINE_F32_RANGE(3) DEFINE_F32_RANGE(4)

// Any M; K % 8 == 0, N % 4 == 0.
typedef struct { const float* x; int M, K, N; const float* w; float* y; } f32_job;

static void f32_region(void* p, int tid, int nth) {
    const f32_job* j = (const f32_job*)p; const int M = j->M, K = j->K, N = j->N; const float* w = j->w;
    SPLIT
    for (int m0 = 0; m0 < M; m0 += 4) {
        const int mm = M - m0 < 4 ? M - m0 : 4;
        const float* xm = j->x + (size_t)m0 * K; float* ym = j->y + (size_t)m0 * N;
        switch (mm) { case 1: f32_rows_1(xm, K, N, w, ym, r0, r1); break; case 2: f32_rows_2(xm, K, N, w, ym, r0, r1); break;
                      case 3: f32_rows_3(xm, K, N, w, ym, r0, r1); break; default: f32_rows_4(xm, K, N, w, ym, r0, r1); }
    }
}

void f32_gemm(const float* x, int M, int K, int N, const float* w, float* y, void* team) {
    f32_job j = {x, M, K, N, w, y};
    team_run((team_t*)team, f32_region, &j);
}

// ---------------------------------------------------------------------------------------------- int8 head
// Row-major int8 [Vp][Kp] (K zero-padded to Kp, a multiple of 64), per-row scale s[n]. The head's activations
// take one int16 scale per row (the exact-argmax bound absorbs their rounding, so per-group precision would
// buy nothing), so the products accumulate in int32 across groups (flushed to fp32 every 32 groups, before
// 32 * 8 * 127 * 32767 could overflow): y = s[n] * xs * sum_k w[n, k] xq[k].
static void quantize_rows_1(const float* x, int M, int K, int Kp, int16_t* xq, float* xs) {
    for (int m = 0; m < M; m++) {
        const float* a = x + (size_t)m * K; int16_t* q = xq + (size_t)m * Kp; float amax = 0;
        for (int k = 0; k < K; k++) amax = fmaxf(amax, fabsf(a[k]));
        const float inv = amax > 0 ? 32767.0f / amax : 0.0f;
        xs[m] = amax > 0 ? amax / 32767.0f : 0.0f;
        for (int k = 0; k < Kp; k++) q[k] = k < K ? (int16_t)nearbyintf(a[k] * inv) : 0;
    }
}

#define DEFINE_Q8A(MM)                                                                                      \
static void q8a_rows_##MM(const int16_t* xq, const float* xs, int Kp, int N, const int8_t* w, const float* s, \
                          float* y, int r0, int r1) {                                                        \
    const int G = Kp / 64;                                                                                   \
    for (int n = r0; n < r1; n++) {                                                                          \
        const int8_t* t = w + (size_t)n * Kp;                                                                \
        __m256 acc[MM]; __m256i p[MM];                                                                       \
        for (int m = 0; m < MM; m++) { acc[m] = _mm256_setzero_ps(); p[m] = _mm256_setzero_si256(); }      \
        for (int g = 0; g < G; g++) {                                                                        \
            const int8_t* b = t + g * 64;                                                                    \
            _mm_prefetch((const char*)(b + 1024), _MM_HINT_T0);                                              \
            const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)b));                    \
            const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(b + 16)));             \
            const __m256i w2 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(b + 32)));             \
            const __m256i w3 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(b + 48)));             \
            for (int m = 0; m < MM; m++) {                                                                   \
                const __m256i* xm = (const __m256i*)(xq + (size_t)m * Kp + g * 64);                          \
                p[m] = _mm256_add_epi32(p[m], _mm256_madd_epi16(w0, _mm256_loadu_si256(xm)));                \
                p[m] = _mm256_add_epi32(p[m], _mm256_madd_epi16(w1, _mm256_loadu_si256(xm + 1)));            \
                p[m] = _mm256_add_epi32(p[m], _mm256_madd_epi16(w2, _mm256_loadu_si256(xm + 2)));            \
                p[m] = _mm256_add_epi32(p[m], _mm256_madd_epi16(w3, _mm256_loadu_si256(xm + 3)));            \
            }                                                                                                \
            if ((g & 31) == 31 || g == G - 1)                                                                \
                for (int m = 0; m < MM; m++) {                                                               \
                    acc[m] = _mm256_add_ps(acc[m], _mm256_cvtepi32_ps(p[m])); p[m] = _mm256_setzero_si256(); \
                }                                                                                            \
        }                                                                                                    \
        for (int m = 0; m < MM; m++) y[(size_t)m * N + n] = s[n] * xs[m] * hsum(acc[m]);                     \
    }                                                                                                        \
}
DEFINE_Q8A(1) DEFINE_Q8A(2) DEFINE_Q8A(3) DEFINE_Q8A(4)

// head_bounds' bound on rows [r0, r1): lo/up = a_r -/+ e_r, e_r = xn dn_r + c (en_r + dn_r) in float, 8 rows at a time
// and then one at a time (the same operations, so the same bits either way).
static void bound_rows(const float* a, const float* dn, const float* en, float xn, float c, double* lo, double* up,
                       int r0, int r1) {
    const __m256 vxn = _mm256_set1_ps(xn), vc = _mm256_set1_ps(c);
    int r = r0;
    for (; r + 8 <= r1; r += 8) {
        const __m256 dv = _mm256_loadu_ps(dn + r);
        const __m256 e = _mm256_fmadd_ps(vxn, dv, _mm256_mul_ps(vc, _mm256_add_ps(_mm256_loadu_ps(en + r), dv)));
        const __m256 av = _mm256_loadu_ps(a + r);
        const __m256d a0 = _mm256_cvtps_pd(_mm256_castps256_ps128(av)), a1 = _mm256_cvtps_pd(_mm256_extractf128_ps(av, 1));
        const __m256d e0 = _mm256_cvtps_pd(_mm256_castps256_ps128(e)), e1 = _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1));
        _mm256_storeu_pd(lo + r, _mm256_sub_pd(a0, e0)); _mm256_storeu_pd(lo + r + 4, _mm256_sub_pd(a1, e1));
        _mm256_storeu_pd(up + r, _mm256_add_pd(a0, e0)); _mm256_storeu_pd(up + r + 4, _mm256_add_pd(a1, e1));
    }
    for (; r < r1; r++) {
        const float e = fmaf(xn, dn[r], c * (en[r] + dn[r]));
        lo[r] = (double)a[r] - e; up[r] = (double)a[r] + e;
    }
}

// With lo non-NULL (head_bounds, one row): each thread also bounds the first V of its rows, while they are in cache.
typedef struct { const int16_t* xq; const float* xs; int mm, Kp, N; const int8_t* w; const float* s; float* y;
                 const float* dn; const float* en; double* lo; double* up; int V; float xn, c; } q8_job;

static void q8i_region(void* p, int tid, int nth) {
    const q8_job* j = (const q8_job*)p; const int N = j->N, Kp = j->Kp;
    SPLIT_ROWS
    switch (j->mm) { case 1: q8a_rows_1(j->xq, j->xs, Kp, N, j->w, j->s, j->y, r0, r1); break;
                     case 2: q8a_rows_2(j->xq, j->xs, Kp, N, j->w, j->s, j->y, r0, r1); break;
                     case 3: q8a_rows_3(j->xq, j->xs, Kp, N, j->w, j->s, j->y, r0, r1); break;
                     default: q8a_rows_4(j->xq, j->xs, Kp, N, j->w, j->s, j->y, r0, r1); }
    if (j->lo && r0 < j->V) bound_rows(j->y, j->dn, j->en, j->xn, j->c, j->lo, j->up, r0, r1 < j->V ? r1 : j->V);
}

// y [M, N] from x [M, K] (fp32) against the int8 table [N][Kp]; also returns dx[m] = ||x_m - dequantized xq_m||.
// bounds (M = 1 only; NULL: none): a job whose dn, en, lo, up, V and xn are set, and whose c (head_argmax's
// d + slack (||x|| + d), d = dx[0]) is set here from `slack`.
static void q8i_run(const float* x, int M, int K, int N, const int8_t* w, const float* s, float* y, float* dx, void* team,
                    const q8_job* bounds, float slack) {
    const int Kp = (K + 63) / 64 * 64;
    int16_t* xq = (int16_t*)_mm_malloc((size_t)4 * Kp * sizeof(int16_t), 32); float xs[4];
    for (int m0 = 0; m0 < M; m0 += 4) {
        const int mm = M - m0 < 4 ? M - m0 : 4;
        quantize_rows_1(x + (size_t)m0 * K, mm, K, Kp, xq, xs);
        for (int m = 0; m < mm; m++) {
            double e = 0; const float* a = x + (size_t)(m0 + m) * K;
            for (int k = 0; k < K; k++) { double d = (double)a[k] - (double)xq[(size_t)m * Kp + k] * xs[m]; e += d * d; }
            dx[m0 + m] = (float)(sqrt(e) * (1 + 1e-6));
        }
        q8_job j = {xq, xs, mm, Kp, N, w, s, y + (size_t)m0 * N};
        if (bounds) {
            j.dn = bounds->dn; j.en = bounds->en; j.lo = bounds->lo; j.up = bounds->up; j.V = bounds->V;
            j.xn = bounds->xn; j.c = dx[0] + slack * (bounds->xn + dx[0]);
        }
        team_run((team_t*)team, q8i_region, &j);
    }
    _mm_free(xq);
}

void q8i_gemm(const float* x, int M, int K, int N, const int8_t* w, const float* s, float* y, float* dx, void* team) {
    q8i_run(x, M, K, N, w, s, y, dx, team, NULL, 0);
}

static float dotK(const float* a, const float* b, int K) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= K; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    float r = hsum(_mm256_add_ps(s0, s1));
    for (; i < K; i++) r += a[i] * b[i];
    return r;
}

// y[i] = x . E_r for the n rows r = ids[i] (every row, r = i, when ids is NULL): the same dotK head_argmax rescores
// with, so every exact logit the engine computes for a row is the same number whichever path asks. Sampling's
// rescored rows and its full passes (logprobs) come here: numpy's sgemv ran them on OpenBLAS's own threads, which
// then spin on the second core through the next decoder step: its layers took 3.99-4.69 ms a token against 2.43-2.59
// greedy (top_p 0.9 and top_k 40 at 0.58-0.64x greedy against 0.78-0.86x with those threads off; docs/benchmarks/history/2026-12-05.md).
typedef struct { const float* x; int K; const float* E; const int* ids; int n; float* y; } rows_job;

static void head_rows_region(void* p, int tid, int nth) {
    const rows_job* j = (const rows_job*)p;
    const int i0 = (int)((long)j->n * tid / nth), i1 = (int)((long)j->n * (tid + 1) / nth);
    for (int i = i0; i < i1; i++) {
        const int r = j->ids ? j->ids[i] : i;
        j->y[i] = dotK(j->x, j->E + (size_t)r * j->K, j->K);
    }
}

void head_rows(const float* x, int K, const float* E, const int* ids, int n, float* y, void* team) {
    rows_job j = {x, K, E, ids, n, y};
    if (n < 256) head_rows_region(&j, 0, 1);  // a few hundred rows: less than waking the team costs
    else team_run((team_t*)team, head_rows_region, &j);
}

// x [M, K]; the int8 copy covers Vp >= V rows (row-major [Vp][Kp]), E, dn, en cover V rows.
// a: scratch [M, Vp]; cand: [M, V] (row m's candidates, ascending, when ncand[m] >= 0).
// out_tok[m] = argmax; ncand[m] = number of candidates rescored, or -(count) - 1 when the full pass ran.
void head_argmax(const float* x, int M, int K, int V, int Vp, const int8_t* wi, const float* s, const float* dn,
                 const float* en, const float* E, float* a, int* cand, int max_cand, int* out_tok, int* ncand, void* team) {
    float dx[M];
    q8i_gemm(x, M, K, Vp, wi, s, a, dx, team);
    const double ck = (K / 8 + K / 16 + 8) * 2.0 * 5.97e-8;  // 2 * (lanes' sequential terms) * 2^-24
    const float slack = (float)(ck > 1e-5 ? ck : 1e-5);
    for (int m = 0; m < M; m++) {
        const float* xm = x + (size_t)m * K; const float* am = a + (size_t)m * Vp; int* cm = cand + (size_t)m * V;
        double ss = 0; for (int i = 0; i < K; i++) ss += (double)xm[i] * xm[i];
        // a_r = xhat . Ehat_r, so x . E_r - a_r = x . (E_r - Ehat_r) + (x - xhat) . Ehat_r (+ float rounding):
        // |.| <= ||x|| d_r + ||x - xhat|| (||E_r|| + d_r) + slack (||x|| + ||x - xhat||) (||E_r|| + d_r).
        const float xn = (float)sqrt(ss) * 1.000001f, d = dx[m], xs = slack * (xn + d);
        const float c = d + xs; const __m256 vxn = _mm256_set1_ps(xn), vc = _mm256_set1_ps(c);
        float lo = -INFINITY; int r = 0;
        {   // lo = max_r (a_r - e_r), 8 rows at a time
            __m256 vlo = _mm256_set1_ps(-INFINITY);
            for (; r + 8 <= V; r += 8) {
                __m256 dv = _mm256_loadu_ps(dn + r);
                __m256 e = _mm256_fmadd_ps(vxn, dv, _mm256_mul_ps(vc, _mm256_add_ps(_mm256_loadu_ps(en + r), dv)));
                vlo = _mm256_max_ps(vlo, _mm256_sub_ps(_mm256_loadu_ps(am + r), e));
            }
            float t[8]; _mm256_storeu_ps(t, vlo); for (int i = 0; i < 8; i++) if (t[i] > lo) lo = t[i];
            for (; r < V; r++) { float e = xn * dn[r] + c * (en[r] + dn[r]); if (am[r] - e > lo) lo = am[r] - e; }
        }
        int n = 0; r = 0;
        {   // candidates: a_r + e_r >= lo, in ascending order
            const __m256 vl = _mm256_set1_ps(lo);
            for (; r + 8 <= V; r += 8) {
                __m256 dv = _mm256_loadu_ps(dn + r);
                __m256 e = _mm256_fmadd_ps(vxn, dv, _mm256_mul_ps(vc, _mm256_add_ps(_mm256_loadu_ps(en + r), dv)));
                int bits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_add_ps(_mm256_loadu_ps(am + r), e), vl, _CMP_GE_OQ));
                while (bits) { cm[n++] = r + __builtin_ctz(bits); bits &= bits - 1; }
            }
            for (; r < V; r++) { float e = xn * dn[r] + c * (en[r] + dn[r]); if (am[r] + e >= lo) cm[n++] = r; }
        }
        int best = 0; float bv = -INFINITY;
        if (n <= max_cand) {
            for (int i = 0; i < n; i++) { float v = dotK(xm, E + (size_t)cm[i] * K, K); if (v > bv) { bv = v; best = cm[i]; } }
            ncand[m] = n;
        } else {  // too many candidates: one exact fp32 pass over the whole table
            for (int r = 0; r < V; r++) { float v = dotK(xm, E + (size_t)r * K, K); if (v > bv) { bv = v; best = r; } }
            ncand[m] = -n - 1;
        }
        out_tok[m] = best;
    }
}

// lo[r] <= x . E_r <= up[r] for every row of the head (one activation row x [K]), with head_argmax's bound e_r
// computed the same way; a [Vp] is scratch. What sampling draws from (edgeflow/engines/sampling.py:draw_bounded).
void head_bounds(const float* x, int K, int V, int Vp, const int8_t* wi, const float* s, const float* dn,
                 const float* en, float* a, double* lo, double* up, void* team) {
    const double ck = (K / 8 + K / 16 + 8) * 2.0 * 5.97e-8;
    const float slack = (float)(ck > 1e-5 ? ck : 1e-5);
    double ss = 0; for (int i = 0; i < K; i++) ss += (double)x[i] * x[i];
    q8_job bounds = {0};
    bounds.dn = dn; bounds.en = en; bounds.lo = lo; bounds.up = up; bounds.V = V; bounds.xn = (float)sqrt(ss) * 1.000001f;
    float dx[1];
    q8i_run(x, 1, K, Vp, wi, s, a, dx, team, &bounds, slack);  // the bounds in the gemm's own region (bound_rows)
}

// ---------------------------------------------------------------------------------------------- vector exp
// e^x for 8 floats (Cephes' expf: range reduction by ln 2 in two parts, degree-5 polynomial, 2^n by exponent
// bits; within 2 ulp of expf over the range used here). Scalar expf would cost each stream ~35k libm calls per
// token in a 135M model (softmax over the context and SiLU, per layer), about a fifth of the step.
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3365478515625f));  // 2^n stays a normal float
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}

// ---------------------------------------------------------------------------------------------- sampling envelope
// What draw_bounded's rejection sampler proposes from (edgeflow/engines/sampling.py: Universe), from upper bounds up[V]
// on the (penalised) logits at temperature t: zmax = max(up) / t, cut = (zmax - tail_log) * t and the universe, the
// rows with up >= cut in ascending order (ids, returns their count n); out = {zmax, cut}. With weight non-NULL, also
// each universe row's envelope weight and their running sum cum (in double, in order). A weight only has to bound
// exp(up / t - zmax) from above, not equal it (a proposal is accepted with the exact ratio): exp8 in float, raised
// by 2^-16 over its 2 ulp and the float rounding of the exponent (<= 1e-6 over the universe's [-tail_log, 0]).
// numpy took 0.18 ms at temperature 0.7 and 0.63 ms at 1.0 on the demo's 49,152 rows (an exp and a sequential
// cumsum per row of a universe of 5,000-49,000); docs/benchmarks/history/2026-12-05.md has this one's.
// [a, a + b, a + b + c, a + b + c + d] of [a, b, c, d]
static inline __m256d prefix4(__m256d v) {
    v = _mm256_add_pd(v, _mm256_blend_pd(_mm256_permute4x64_pd(v, 0x90), _mm256_setzero_pd(), 0x1));
    return _mm256_add_pd(v, _mm256_blend_pd(_mm256_permute4x64_pd(v, 0x40), _mm256_setzero_pd(), 0x3));
}

// For each 4-bit mask, the positions of its set bits first (COMPRESS4), and as pairs of float lanes (COMPRESS4_PD)
static const int32_t COMPRESS4[16][4] = {
    {0, 0, 0, 0}, {0, 0, 0, 0}, {1, 0, 0, 0}, {0, 1, 0, 0},
    {2, 0, 0, 0}, {0, 2, 0, 0}, {1, 2, 0, 0}, {0, 1, 2, 0},
    {3, 0, 0, 0}, {0, 3, 0, 0}, {1, 3, 0, 0}, {0, 1, 3, 0},
    {2, 3, 0, 0}, {0, 2, 3, 0}, {1, 2, 3, 0}, {0, 1, 2, 3}};
static const int32_t COMPRESS4_PD[16][8] = {
    {0, 1, 0, 1, 0, 1, 0, 1},
    {0, 1, 0, 1, 0, 1, 0, 1},
    {2, 3, 0, 1, 0, 1, 0, 1},
    {0, 1, 2, 3, 0, 1, 0, 1},
    {4, 5, 0, 1, 0, 1, 0, 1},
    {0, 1, 4, 5, 0, 1, 0, 1},
    {2, 3, 4, 5, 0, 1, 0, 1},
    {0, 1, 2, 3, 4, 5, 0, 1},
    {6, 7, 0, 1, 0, 1, 0, 1},
    {0, 1, 6, 7, 0, 1, 0, 1},
    {2, 3, 6, 7, 0, 1, 0, 1},
    {0, 1, 2, 3, 6, 7, 0, 1},
    {4, 5, 6, 7, 0, 1, 0, 1},
    {0, 1, 4, 5, 6, 7, 0, 1},
    {2, 3, 4, 5, 6, 7, 0, 1},
    {0, 1, 2, 3, 4, 5, 6, 7}};

int head_envelope(const double* up, int V, double t, double tail_log, int* ids, double* weight, double* cum, double* out) {
    double m = -INFINITY; int r = 0;
    {
        __m256d vm = _mm256_set1_pd(-INFINITY);
        for (; r + 4 <= V; r += 4) vm = _mm256_max_pd(vm, _mm256_loadu_pd(up + r));
        double q[4]; _mm256_storeu_pd(q, vm); for (int i = 0; i < 4; i++) if (q[i] > m) m = q[i];
        for (; r < V; r++) if (up[r] > m) m = up[r];
    }
    const double zmax = m / t, cut = (zmax - tail_log) * t;
    out[0] = zmax; out[1] = cut;
    // Branch-free: 4 rows at a time, every lane written and the kept ones moved to the front (COMPRESS4); the count
    // moves past the kept ones, and the lanes after it are written over by the next rows (n <= r: inside [V]).
    int n = 0;
    const __m256d vcut = _mm256_set1_pd(cut);
    for (r = 0; r + 4 <= V; r += 4) {
        const __m256d u = _mm256_loadu_pd(up + r);
        const int mask = _mm256_movemask_pd(_mm256_cmp_pd(u, vcut, _CMP_GE_OQ));
        const __m128i at = _mm_loadu_si128((const __m128i*)COMPRESS4[mask]);
        _mm_storeu_si128((__m128i*)(ids + n), _mm_add_epi32(_mm_set1_epi32(r), at));
        if (weight) {
            const __m256i pairs = _mm256_loadu_si256((const __m256i*)COMPRESS4_PD[mask]);
            _mm256_storeu_pd(weight + n, _mm256_castps_pd(_mm256_permutevar8x32_ps(_mm256_castpd_ps(u), pairs)));
        }
        n += __builtin_popcount(mask);
    }
    for (; r < V; r++) { ids[n] = r; if (weight) weight[n] = up[r]; n += up[r] >= cut; }
    if (!weight) return n;
    const double it = 1.0 / t;
    const __m256 raise = _mm256_set1_ps(1.0f + 0x1p-16f);
    const __m256d vit = _mm256_set1_pd(it), vz = _mm256_set1_pd(zmax);
    __m256d carry = _mm256_setzero_pd();
    int i = 0;
    for (; i + 8 <= n; i += 8) {  // weight[i..] holds the kept rows' bounds until overwritten here
        const __m128 x0 = _mm256_cvtpd_ps(_mm256_fmsub_pd(_mm256_loadu_pd(weight + i), vit, vz));
        const __m128 x1 = _mm256_cvtpd_ps(_mm256_fmsub_pd(_mm256_loadu_pd(weight + i + 4), vit, vz));
        const __m256 w = _mm256_mul_ps(exp8(_mm256_set_m128(x1, x0)), raise);
        const __m256d w0 = _mm256_cvtps_pd(_mm256_castps256_ps128(w)), w1 = _mm256_cvtps_pd(_mm256_extractf128_ps(w, 1));
        _mm256_storeu_pd(weight + i, w0); _mm256_storeu_pd(weight + i + 4, w1);
        const __m256d c0 = _mm256_add_pd(prefix4(w0), carry);
        carry = _mm256_permute4x64_pd(c0, 0xFF);
        const __m256d c1 = _mm256_add_pd(prefix4(w1), carry);
        carry = _mm256_permute4x64_pd(c1, 0xFF);
        _mm256_storeu_pd(cum + i, c0); _mm256_storeu_pd(cum + i + 4, c1);
    }
    double s = _mm256_cvtsd_f64(carry);
    if (i < n) {
        float x[8], w[8]; const int k = n - i;
        for (int j = 0; j < 8; j++) x[j] = j < k ? (float)(weight[i + j] * it - zmax) : 0.0f;
        _mm256_storeu_ps(w, _mm256_mul_ps(exp8(_mm256_loadu_ps(x)), raise));
        for (int j = 0; j < k; j++) { weight[i + j] = w[j]; s += w[j]; cum[i + j] = s; }
    }
    return n;
}

// ---------------------------------------------------------------------------------------------- sampled step
// sampling.py's draw_bounded for a request with temperature t (0: greedy), top_k (0: none), top_p q (1: none) and any
// penalties, without a softcap (that, and logprobs, take sampling.py's own path). lo/up bound the penalised logits
// (the caller applied the penalties to them); a rescored row gets Sampler.penalise's own arithmetic from the table of
// the tokens it touches: ids tids[0..nt) ascending, trep[i] 1 where the repetition penalty rp applies, then tsub[i]
// subtracted. The same algorithm, step for step (`_Envelope`: the universe and its envelope, proposals with redraws
// of rescored rows, the exact acceptance ratio, the nucleus test with its first bound and its rounds of the widest
// rows), without a Python call per proposal and per round: a sampled step's draw cost 0.4-0.7 ms there. x . E_r by dotK, as head_rows. The uniforms come from the
// request's seeded generator, u[0..nu), read in order; a round starts only with enough of them left for itself.
// Returns the token; -1 when the rounds (tries) or the uniforms ran out, -2 when a bound did not hold: the caller reads
// the whole head then. stats[0] += rows rescored, stats[1] += nucleus tests that read every row.
typedef struct {
    const float* x; int K; const float* E; const double* lo; const double* up; int V;
    double t, zmax, cut, tail_w; int n, tail, redraws, bad; long budget, rescored, head_reads;
    int* ids; double* prop; double* cum; double* pen;
    const int64_t* tids; const int* trep; const double* tsub; int nt; double rp;
} sb_t;

static double sb_row(sb_t* s, int k) {  // universe row k's exact logit, rescored once per step
    if (s->pen[k] == s->pen[k]) return s->pen[k];
    const int r = s->ids[k];
    double v = (double)dotK(s->x, s->E + (size_t)r * s->K, s->K);
    int a = 0, b = s->nt;  // the penalties of the token, if it has any
    while (a < b) { const int m = (a + b) >> 1; if (s->tids[m] < r) a = m + 1; else b = m; }
    if (a < s->nt && s->tids[a] == r) {
        if (s->trep[a]) v = v > 0 ? v / s->rp : v * s->rp;
        v -= s->tsub[a];
    }
    s->pen[k] = v; s->budget--; s->rescored++;
    if (!(s->lo[r] <= v && v <= s->up[r])) s->bad = 1;
    return v;
}

static double sb_exact_w(const sb_t* s, double v) { return exp(v / s->t - s->zmax); }

static void sb_sum(sb_t* s) { double c = 0; for (int k = 0; k < s->n; k++) { c += s->prop[k]; s->cum[k] = c; } }

static void sb_widen(sb_t* s) {  // every row into the universe (ids[r] = r), the rescored ones at their exact weights
    for (int r = 0; r < s->V; r++) s->cum[r] = NAN;
    for (int k = 0; k < s->n; k++) s->cum[s->ids[k]] = s->pen[k];
    for (int r = 0; r < s->V; r++) {
        const double p = s->cum[r];
        s->ids[r] = r; s->pen[r] = p;
        s->prop[r] = p == p ? sb_exact_w(s, p) : exp(s->up[r] / s->t - s->zmax);
    }
    s->n = s->V; s->tail = 0;
    sb_sum(s);
}

static void sb_tighten(sb_t* s) {
    for (int k = 0; k < s->n; k++) if (s->pen[k] == s->pen[k]) s->prop[k] = sb_exact_w(s, s->pen[k]);
    sb_sum(s);
}

// _Envelope.propose: a universe row and its weight in the envelope with every rescored row at its exact weight.
static int sb_propose(sb_t* s, const double* u, int* ui, double* w) {
    for (int attempt = 0;; attempt++) {
        if (attempt == s->redraws) sb_tighten(s);  // from here a rescored row's draw always stands
        const double top = s->cum[s->n - 1], r = u[(*ui)++] * (top + s->tail * s->tail_w);
        if (r >= top && s->tail) {  // the tail block: its j-th token in id order, then every row
            long j = (long)((r - top) / s->tail_w); if (j > s->tail - 1) j = s->tail - 1;
            int i = s->V - 1;
            for (int q = 0, c = 0; q < s->V; q++) if (s->up[q] < s->cut && c++ == j) { i = q; break; }
            sb_widen(s);
            *w = s->tail_w; return i;
        }
        int a = 0, b = s->n;  // the first k with cum[k] > r
        while (a < b) { const int m = (a + b) >> 1; if (s->cum[m] > r) b = m; else a = m + 1; }
        const int k = a < s->n ? a : s->n - 1;
        const double p = s->pen[k];
        if (p != p) { *w = s->prop[k]; return k; }
        const double ex = sb_exact_w(s, p);
        if (u[(*ui)++] * s->prop[k] < ex) { *w = ex; return k; }
    }
}

// the k-th largest (0-based) of a[0..m), a reordered (Hoare's selection)
static double kth_largest(double* a, int m, int kth) {
    int lo = 0, hi = m - 1;
    while (lo < hi) {
        const double pivot = a[(lo + hi) >> 1]; int i = lo, j = hi;
        while (i <= j) {
            while (a[i] > pivot) i++;
            while (a[j] < pivot) j--;
            if (i <= j) { const double tmp = a[i]; a[i] = a[j]; a[j] = tmp; i++; j--; }
        }
        if (kth <= j) hi = j; else if (kth >= i) lo = i; else return a[kth];
    }
    return a[lo];
}

// _Envelope.in_nucleus: is universe row j (rescored) among the tokens top_p = q keeps? 1, 0; s->bad set on a broken
// bound. gap, sel: scratch [V].
static int sb_nucleus(sb_t* s, int j, double q, int nucleus_rows, double* gap, double* sel) {
    const double lj = s->pen[j]; const int i = s->ids[j];
    {   // the first bound: A at most the rescored rows before j and the others that can reach lj; B at least the
        // rescored rows from j on
        double ah = lj >= s->cut ? 0.0 : s->tail * s->tail_w, bl = 0;
        for (int k = 0; k < s->n; k++) {
            const double p = s->pen[k];
            if (p == p) { const double w = sb_exact_w(s, p); if (p > lj || (p == lj && s->ids[k] < i)) ah += w; else bl += w; }
            else if (s->up[s->ids[k]] >= lj) ah += s->prop[k];
        }
        if (ah * (1 - q) < q * bl) return 1;
    }
    long rows = nucleus_rows;
    double* wlo = (double*)malloc((size_t)s->V * sizeof(double));  // each row's lower weight, where its side is sure
    if (!wlo) { s->bad = 1; return 0; }
    int wlo_n = -1;
    for (;;) {
        if (wlo_n != s->n) {  // per universe: exp(lo / t - zmax) lowered by 2^-16 (exp8's error and the float exponent)
            wlo_n = s->n;
            const __m256 lower = _mm256_set1_ps(1.0f - 0x1p-16f);
            for (int k0 = 0; k0 < s->n; k0 += 8) {
                float z[8], w[8]; const int kn = s->n - k0 < 8 ? s->n - k0 : 8;
                for (int q8 = 0; q8 < 8; q8++) z[q8] = q8 < kn ? (float)(s->lo[s->ids[k0 + q8]] / s->t - s->zmax) : 0.0f;
                _mm256_storeu_ps(w, _mm256_mul_ps(exp8(_mm256_loadu_ps(z)), lower));
                for (int q8 = 0; q8 < kn; q8++) wlo[k0 + q8] = w[q8];
            }
        }
        const double tail = s->tail * s->tail_w, tail_before = lj >= s->cut ? 0.0 : tail;
        double ae = 0, be = 0, alo = 0, ahi = 0, blo = 0, bhi = 0, open = 0; int m = 0;
        for (int k = 0; k < s->n; k++) {
            const double p = s->pen[k];
            if (p == p) {
                const double w = sb_exact_w(s, p);
                if (p > lj || (p == lj && s->ids[k] < i)) ae += w; else be += w;
                gap[k] = 0; continue;
            }
            const int r = s->ids[k]; const double l = s->lo[r], h = s->up[r];
            double wl = 0;
            if (l > lj) { wl = wlo[k]; alo += wl; ahi += s->prop[k]; }
            else if (h < lj) { wl = wlo[k]; blo += wl; bhi += s->prop[k]; }
            else open += s->prop[k];
            gap[k] = s->prop[k] - wl;
            if (gap[k] != 0) sel[m++] = gap[k];
        }
        const double a_lo = ae + alo, a_hi = ae + ahi + open + tail_before, b_lo = be + blo, b_hi = be + bhi + open + tail;
        if (a_hi * (1 - q) < q * b_lo) { free(wlo); return 1; }
        if (a_lo * (1 - q) >= q * b_hi) { free(wlo); return 0; }
        long take = rows < m ? rows : m; if (take > s->budget) take = s->budget;
        if (take <= 0) {  // the rows allowed are spent (or only the tail is left): read every row, which decides it
            s->head_reads++;
            if (s->tail) { sb_widen(s); j = i; }
            for (int k = 0; k < s->n; k++) sb_row(s, k);
            if (s->bad) { free(wlo); return 0; }
            continue;
        }
        const double thr = kth_largest(sel, m, (int)take - 1);
        long done = 0;
        for (int k = 0; k < s->n && done < take; k++) if (gap[k] > thr) { sb_row(s, k); done++; }
        for (int k = 0; k < s->n && done < take; k++) if (gap[k] == thr && s->pen[k] != s->pen[k]) { sb_row(s, k); done++; }
        if (s->bad) { free(wlo); return 0; }
        rows *= 4;
    }
}

typedef struct { double z; int id; } zid_t;
static int zid_order(const void* a, const void* b) {  // descending z, then ascending id
    const zid_t* x = (const zid_t*)a; const zid_t* y = (const zid_t*)b;
    return x->z > y->z ? -1 : x->z < y->z ? 1 : (x->id > y->id) - (x->id < y->id);
}

// zid_t binary heaps: `best` first puts the (larger z, then smaller id) element on top, else the other one.
static inline int zid_above(zid_t a, zid_t b, int best) {
    const int better = a.z > b.z || (a.z == b.z && a.id < b.id), worse = a.z < b.z || (a.z == b.z && a.id > b.id);
    return best ? better : worse;
}
static void zid_down(zid_t* h, int n, int i, int best) {
    for (;;) {
        int c = 2 * i + 1;
        if (c >= n) return;
        if (c + 1 < n && zid_above(h[c + 1], h[c], best)) c++;
        if (!zid_above(h[c], h[i], best)) return;
        const zid_t t = h[i]; h[i] = h[c]; h[c] = t; i = c;
    }
}
static void zid_heapify(zid_t* h, int n, int best) { for (int i = n / 2 - 1; i >= 0; i--) zid_down(h, n, i, best); }
static zid_t zid_pop(zid_t* h, int* n, int best) {
    const zid_t top = h[0];
    h[0] = h[--*n]; zid_down(h, *n, 0, best);
    return top;
}

static void min_heap_down(double* h, int n, int i) {
    for (;;) {
        int c = 2 * i + 1;
        if (c >= n) return;
        if (c + 1 < n && h[c + 1] < h[c]) c++;
        if (h[i] <= h[c]) return;
        const double t = h[i]; h[i] = h[c]; h[c] = t; i = c;
    }
}

// The k-th largest lower bound among the rows ids[0..n) (ids NULL: rows 0..n), by a min-heap of the k largest in
// heap[0..k): one comparison for most rows (a selection over the whole set cost 160 us a step on the demo student).
static double kth_lower(const double* lo, const int* ids, int n, int k, double* heap) {
    for (int i = 0; i < k; i++) heap[i] = lo[ids ? ids[i] : i];
    for (int i = k / 2 - 1; i >= 0; i--) min_heap_down(heap, k, i);
    for (int i = k; i < n; i++) {
        const double v = lo[ids ? ids[i] : i];
        if (v > heap[0]) { heap[0] = v; min_heap_down(heap, k, 0); }
    }
    return heap[0];
}

static void prefetch_row(const float* r, int K) {
    for (int i = 0; i < K; i += 16) _mm_prefetch((const char*)(r + i), _MM_HINT_T0);
}

// top_k (0 < k < V): draw_bounded's top_k branch and Sampler._draw after it. The rows whose upper bound reaches the
// k-th largest lower bound (taken among the universe when that holds them) can hold the top k. They are rescored in
// descending order of upper bound (a max-heap; the next row's fp32 weights prefetched while one is scored) until the
// k-th largest z = logit / t so far lies above the next row's upper bound / t: no row left can reach the top k then
// (on the demo student at top_k 40, 110 of the ~300 candidates per step). The top k by (z, then id) are kept, top_p
// applied inside them, one uniform draws: the token the whole head gives. -1: more candidates than max_rows.
static int sb_top_k(sb_t* s, int k, double q, double tail_log, long max_rows, double u, double* sel) {
    double env[2];
    const int n = head_envelope(s->up, s->V, s->t, tail_log, s->ids, NULL, NULL, env);
    const double cut = env[1];
    double thr = -INFINITY; int near = 0;
    if (n >= k) {
        thr = kth_lower(s->lo, s->ids, n, k, sel);
        near = thr >= cut;  // every token outside the universe has its upper bound below it
    }
    if (!near) thr = kth_lower(s->lo, NULL, s->V, k, sel);
    int m = 0;
    if (near) { for (int i = 0; i < n; i++) if (s->up[s->ids[i]] >= thr) s->ids[m++] = s->ids[i]; }
    else for (int r = 0; r < s->V; r++) if (s->up[r] >= thr) s->ids[m++] = r;
    if (m > max_rows) return -1;
    zid_t* c = (zid_t*)malloc((size_t)(m + k) * sizeof(zid_t));
    if (!c) return -1;
    zid_t* top = c + m;  // the k best rescored rows, the worst on top once k are in
    for (int i = 0; i < m; i++) { c[i].z = s->up[s->ids[i]] / s->t; c[i].id = s->ids[i]; }
    zid_heapify(c, m, 1);  // the candidates, the highest upper bound on top
    int left = m, done = 0;
    zid_t next = zid_pop(c, &left, 1);  // m >= k: the k rows whose lower bound reaches thr are candidates
    for (int more = 1; more;) {
        if (done >= k && top[0].z > next.z) break;  // every row left has its z below the k-th found
        const zid_t cur = next;
        more = left > 0;
        if (more) { next = zid_pop(c, &left, 1); prefetch_row(s->E + (size_t)next.id * s->K, s->K); }
        s->ids[done] = cur.id; s->pen[done] = NAN; s->n = done + 1;
        const zid_t got = {sb_row(s, done) / s->t, cur.id};
        if (done < k) { top[done] = got; if (done == k - 1) zid_heapify(top, k, 0); }
        else if (zid_above(got, top[0], 1)) { top[0] = got; zid_down(top, k, 0, 0); }
        done++;
    }
    if (s->bad) { free(c); return -2; }
    m = done < k ? done : k;
    memmove(c, top, (size_t)m * sizeof(zid_t));
    qsort(c, (size_t)m, sizeof(zid_t), zid_order);
    const int kk = k < m ? k : m;
    double total = 0;
    for (int i = 0; i < kk; i++) { sel[i] = exp(c[i].z - c[0].z); total += sel[i]; }
    int keep = kk;
    if (q < 1.0) {  // the smallest head of the top k whose mass reaches top_p
        double cum = 0;
        for (int i = 0; i < kk; i++) { cum += sel[i]; if (cum / total >= q) { keep = i + 1; break; } }
    }
    double cum = 0;
    for (int i = 0; i < keep; i++) cum += sel[i];
    const double r = u * cum;
    double acc = 0; int token = c[keep - 1].id;
    for (int i = 0; i < keep; i++) { acc += sel[i]; if (acc > r) { token = c[i].id; break; } }
    free(c);
    return token;
}

int sample_bounded(const float* x, int K, const float* E, const double* lo, const double* up, int V, double t,
                   double q, int top_k, const int64_t* tids, const int* trep, const double* tsub, int nt, double rp,
                   double tail_log, int tries, int redraws, int nucleus_rows, long max_rows,
                   const double* u, int nu, int* ids, double* prop, double* cum, double* pen, double* gap,
                   double* sel, long* stats) {
    double env[2];
    sb_t s = {x, K, E, lo, up, V, t, 0, 0, exp(-tail_log), 0, 0, redraws, 0, max_rows, 0, 0, ids, prop, cum, pen,
              tids, trep, tsub, nt, rp};
    if (t == 0) {  // greedy over the penalised logits: the rows that can be the maximum, rescored; the first maximum wins
        double best_lo = -INFINITY; int m = 0, token = -1; double best = -INFINITY;
        for (int r = 0; r < V; r++) if (lo[r] > best_lo) best_lo = lo[r];
        for (int r = 0; r < V; r++) if (up[r] >= best_lo) ids[m++] = r;
        if (m <= max_rows) {
            s.n = m;
            for (int i = 0; i < m; i++) { pen[i] = NAN; const double v = sb_row(&s, i); if (v > best) { best = v; token = ids[i]; } }
            if (s.bad) token = -2;
        }
        stats[0] += s.rescored;
        return token;
    }
    if (top_k > 0 && top_k < V) {
        const int token = nu > 0 ? sb_top_k(&s, top_k, q, tail_log, max_rows, u[0], sel) : -1;
        stats[0] += s.rescored;
        return token;
    }
    s.n = head_envelope(up, V, t, tail_log, ids, prop, cum, env);
    s.zmax = env[0]; s.cut = env[1]; s.tail = V - s.n;
    for (int k = 0; k < s.n; k++) pen[k] = NAN;
    const int per_round = 2 * (redraws + 1) + 1;
    int ui = 0, token = -1;
    for (int round = 0; round < tries && nu - ui >= per_round; round++) {
        double w;
        const int k = sb_propose(&s, u, &ui, &w);
        const double v = sb_row(&s, k);
        if (s.bad) { token = -2; break; }
        if (u[ui++] * w >= sb_exact_w(&s, v)) continue;  // rejected: the bound overstated this row
        const int id = s.ids[k];
        if (q < 1.0) {
            const int inside = sb_nucleus(&s, k, q, nucleus_rows, gap, sel);
            if (s.bad) { token = -2; break; }
            if (!inside) continue;
        }
        token = id; break;
    }
    stats[0] += s.rescored; stats[1] += s.head_reads;
    return token;
}

// ---------------------------------------------------------------------------------------------- decoder step
// Per layer: pointers to its tensors (0: absent); kind: 2 bits per linear (qkv, o, gate/up, down from the lowest),
// each 0 = int4 (w, s, z), 1 = fp32 (w only), 2 = int8 (w, s, z). Norm weights arrive
// with any family offset folded in (Gemma's 1 + w, at build). window: keys a query sees, itself included (0: all).
typedef struct { int64_t ln1, qkv_w, qkv_s, qkv_z, o_w, o_s, o_z, ln2, gu_w, gu_s, gu_z, dn_w, dn_s, dn_z, kind, window,
                 qkv_b, o_b, q_norm, k_norm, post_attn, post_ffn, cos, sin; } layer_t;
// What the family adds to a Llama step (edgeflow/model/architecture.py): the MLP activation (0 SiLU, 1 GELU-tanh), the attention
// scale and softcap (0: none).
typedef struct { int act; float attn_scale; float attn_softcap; float pad; } family_t;

static void linear(const float* x, int M, int K, int N, int64_t kind, int64_t w, int64_t s, int64_t z, float* y, void* team) {
    if (kind == 1) f32_gemm(x, M, K, N, (const float*)w, y, team);
    else if (kind == 2) q8w_gemm(x, M, K, N, (const int8_t*)w, (const float*)s, (const int16_t*)z, y, team);
    else q4i_gemm(x, M, K, N, (const uint16_t*)w, (const float*)s, (const int16_t*)z, y, team);
}

static void add_bias(float* y, int M, int N, int64_t b) {
    if (!b) return;
    const float* bb = (const float*)b;
    for (int m = 0; m < M; m++) for (int i = 0; i < N; i++) y[(size_t)m * N + i] += bb[i];
}

static inline float dot_hd(const float* a, const float* b, int n) {  // n % 16 == 0
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    return hsum(_mm256_add_ps(s0, s1));
}

// y = w * (x / rms(x)); in place is fine (the sum of squares is taken first).
static void rmsnorm(const float* x, const float* w, float* y, int M, int D, float eps) {
    for (int m = 0; m < M; m++) {
        const float* a = x + (size_t)m * D; float* b = y + (size_t)m * D; double ss = 0;  // fp64 sum: order-robust
        for (int i = 0; i < D; i++) ss += (double)a[i] * a[i];
        float r = 1.0f / sqrtf((float)(ss / D) + eps);
        for (int i = 0; i < D; i++) b[i] = w[i] * (a[i] * r);
    }
}

static void rope(float* v, int nh, int hd, const float* cs, const float* sn) {  // HF rotate_half convention
    int h2 = hd / 2;
    for (int h = 0; h < nh; h++) {
        float* a = v + h * hd;
        for (int i = 0; i < h2; i++) {
            float x1 = a[i], x2 = a[i + h2];
            a[i] = x1 * cs[i] - x2 * sn[i];
            a[i + h2] = x2 * cs[i + h2] + x1 * sn[i + h2];
        }
    }
}

// Rows one llama_step call may carry (a prefill chunk; a decode step has one row per stream).
#define STEP_ROWS 64
int llama_step_rows(void) { return STEP_ROWS; }

// Heads of one KV group that a prefill chunk's attention runs together (ATT_Q below).
#define ATT_Q 3

// Scratch floats needed by llama_step (for nt threads); Q = heads * head_dim (not always the hidden width).
long llama_scratch_floats(int Hd, int H, int KV, int hd, int I, int maxlen, int nt) {
    return (long)STEP_ROWS * (3L * Hd + (long)H * hd + (long)(H + 2 * KV) * hd + 3L * I) + (long)nt * ATT_Q * maxlen + 64;
}

// GQA attention of every (row, head) pair over its slot's KV cache (one layer), split across the team.
typedef struct { int M, H, KV, hd, Q, NQKV, maxlen, window; const int* pos; const int* slot; const float* qkv;
                 const float* kc; const float* vc; size_t cstride_s, cstride_h; float scale, softcap; float* sc; float* att; } attn_job;

// The 4 sums of a[0..3] in hsum8's order for those lanes (so a key's score does not depend on the block size).
static inline __m128 hsum4_as8(const __m256* a) {
    const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}

static inline float softcapped(float a, float cap) { return cap > 0 ? cap * tanhf(a / cap) : a; }  // Gemma 2's, before the softmax

// Scores of NQ queries (heads of one KV group, one row) against keys K_[0..T): p[a][t] = softcap(q_a . k_t * scale), and
// each query's maximum. Keys 8 at a time (for several heads, two halves of 4 against all NQ queries, so each key row is
// read from L2 once for NQ heads), each key's dot product in 8 lanes reduced in hsum8's order; the keys after the last 8 by dot_hd.
// Every score is the same sum in the same order whatever NQ: the one-head decode path and the chunk's path agree bitwise.
static inline __attribute__((always_inline)) void att_scores(const float* const* q, int NQ, const float* K_, int T, int hd,
                                                             float scale, float cap, float* const* p, float* mx) {
    const __m128 vsc = _mm_set1_ps(scale); __m128 vmx[ATT_Q];
    for (int a = 0; a < NQ; a++) vmx[a] = _mm_set1_ps(-INFINITY);
    int t = 0;
    if (NQ == 1) {  // one head (a decode step): 8 keys at a time, 8 independent FMA chains
        __m256 vm8 = _mm256_set1_ps(-INFINITY);
        for (; t + 8 <= T; t += 8) {
            const float* kb = K_ + (size_t)t * hd;
            __m256 acc[8];
            for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
            for (int c = 0; c < hd; c += 8) {
                const __m256 qc = _mm256_loadu_ps(q[0] + c);
                for (int i = 0; i < 8; i++) acc[i] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(kb + (size_t)i * hd + c), acc[i]);
            }
            __m256 sv = _mm256_mul_ps(hsum8(acc), _mm256_set1_ps(scale));
            _mm256_storeu_ps(p[0] + t, sv);
            if (cap > 0) {
                for (int i = 0; i < 8; i++) p[0][t + i] = softcapped(p[0][t + i], cap);
                sv = _mm256_loadu_ps(p[0] + t);
            }
            vm8 = _mm256_max_ps(vm8, sv);
        }
        vmx[0] = _mm_max_ps(_mm256_castps256_ps128(vm8), _mm256_extractf128_ps(vm8, 1));
    }
    for (; t + 8 <= T; t += 8) {
        for (int half = 0; half < 8; half += 4) {
            const float* kb = K_ + (size_t)(t + half) * hd;
            __m256 acc[ATT_Q][4];
            for (int a = 0; a < NQ; a++) for (int i = 0; i < 4; i++) acc[a][i] = _mm256_setzero_ps();
            for (int c = 0; c < hd; c += 8)
                for (int a = 0; a < NQ; a++) {
                    const __m256 qc = _mm256_loadu_ps(q[a] + c);
                    for (int i = 0; i < 4; i++) acc[a][i] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(kb + (size_t)i * hd + c), acc[a][i]);
                }
            for (int a = 0; a < NQ; a++) {
                __m128 sv = _mm_mul_ps(hsum4_as8(acc[a]), vsc);
                _mm_storeu_ps(p[a] + t + half, sv);
                if (cap > 0) {
                    for (int i = 0; i < 4; i++) p[a][t + half + i] = softcapped(p[a][t + half + i], cap);
                    sv = _mm_loadu_ps(p[a] + t + half);
                }
                vmx[a] = _mm_max_ps(vmx[a], sv);
            }
        }
    }
    for (int a = 0; a < NQ; a++) {
        float mv[4]; _mm_storeu_ps(mv, vmx[a]); mx[a] = -INFINITY;
        for (int i = 0; i < 4; i++) if (mv[i] > mx[a]) mx[a] = mv[i];
        for (int u = t; u < T; u++) {
            const float s_ = softcapped(dot_hd(q[a], K_ + (size_t)u * hd, hd) * scale, cap);
            p[a][u] = s_; if (s_ > mx[a]) mx[a] = s_;
        }
    }
}

// p[t] = exp(p[t] - mx) in place; returns their sum (8 lanes, then hsum, then the tail in order).
static inline float att_exp(float* p, int T, float mx) {
    int t = 0; __m256 vs = _mm256_setzero_ps(); const __m256 vm = _mm256_set1_ps(mx);
    for (; t + 8 <= T; t += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + t), vm));
        _mm256_storeu_ps(p + t, e); vs = _mm256_add_ps(vs, e);
    }
    float sum = hsum(vs); for (; t < T; t++) { p[t] = expf(p[t] - mx); sum += p[t]; }
    return sum;
}

// o_a = sum_t p[a][t] V_t * inv[a] for NQ queries over the same V rows. The dims up to the last multiple of 64, 64 at a
// time for one head, 32 for several (NQ x 4 accumulators, each V row read once for NQ heads), each dim summed over t in order; the rest in 16s with
// two position streams, one query at a time. The same sums in the same order whatever NQ.
static inline __attribute__((always_inline)) void att_values(const float* const* p, int NQ, const float* V_, int T, int hd,
                                                             const float* inv, float* const* o) {
    const int dblk = hd / 64 * 64, W = NQ == 1 ? 8 : 4;  // W vectors (8W dims) per block: 8 FMA chains for one head
    for (int d0 = 0; d0 < dblk; d0 += 8 * W) {
        __m256 acc[ATT_Q][8]; const float* vv = V_ + d0;
        for (int a = 0; a < NQ; a++) for (int i = 0; i < W; i++) acc[a][i] = _mm256_setzero_ps();
        for (int u = 0; u < T; u++) {
            const float* vr = vv + (size_t)u * hd;
            for (int a = 0; a < NQ; a++) {
                const __m256 w0 = _mm256_set1_ps(p[a][u]);
                for (int i = 0; i < W; i++) acc[a][i] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(vr + 8 * i), acc[a][i]);
            }
        }
        for (int a = 0; a < NQ; a++) {
            const __m256 vi = _mm256_set1_ps(inv[a]);
            for (int i = 0; i < W; i++) _mm256_storeu_ps(o[a] + d0 + 8 * i, _mm256_mul_ps(acc[a][i], vi));
        }
    }
    for (int a = 0; a < NQ; a++)
        for (int d = dblk; d < hd; d += 16) {  // 16 output dims in registers, two position streams for ILP
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
            const float* vv = V_ + d; const float* pa = p[a]; int u = 0;
            for (; u + 2 <= T; u += 2) {
                const __m256 w0 = _mm256_set1_ps(pa[u]), w1 = _mm256_set1_ps(pa[u + 1]);
                a0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(vv + (size_t)u * hd), a0);
                a1 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(vv + (size_t)u * hd + 8), a1);
                b0 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(vv + (size_t)(u + 1) * hd), b0);
                b1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(vv + (size_t)(u + 1) * hd + 8), b1);
            }
            if (u < T) {
                const __m256 w0 = _mm256_set1_ps(pa[u]);
                a0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(vv + (size_t)u * hd), a0);
                a1 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(vv + (size_t)u * hd + 8), a1);
            }
            const __m256 vi = _mm256_set1_ps(inv[a]);
            _mm256_storeu_ps(o[a] + d, _mm256_mul_ps(_mm256_add_ps(a0, b0), vi));
            _mm256_storeu_ps(o[a] + d + 8, _mm256_mul_ps(_mm256_add_ps(a1, b1), vi));
        }
}

// Row m's heads h0 .. h0 + NQ - 1 (one KV group) over their keys; p_: NQ * maxlen scratch floats.
static inline __attribute__((always_inline)) void attend(const attn_job* j, int m, int h0, int NQ, float* p_) {
    const int hd = j->hd, g = h0 / (j->H / j->KV);
    const int t0 = j->window > 0 && j->pos[m] + 1 > j->window ? j->pos[m] + 1 - j->window : 0;
    const int T = j->pos[m] + 1 - t0;  // keys t0 .. pos: a sliding layer sees the last `window`, itself included
    const float* K_ = j->kc + j->slot[m] * j->cstride_s + g * j->cstride_h + (size_t)t0 * hd;
    const float* V_ = j->vc + j->slot[m] * j->cstride_s + g * j->cstride_h + (size_t)t0 * hd;
    const float* q[ATT_Q]; float* p[ATT_Q]; float* o[ATT_Q]; float mx[ATT_Q], inv[ATT_Q];
    for (int a = 0; a < NQ; a++) {
        q[a] = j->qkv + (size_t)m * j->NQKV + (h0 + a) * hd; p[a] = p_ + (size_t)a * j->maxlen;
        o[a] = j->att + (size_t)m * j->Q + (h0 + a) * hd;
    }
    att_scores(q, NQ, K_, T, hd, j->scale, j->softcap, p, mx);
    for (int a = 0; a < NQ; a++) inv[a] = 1.0f / att_exp(p[a], T, mx[a]);
    att_values((const float* const*)p, NQ, V_, T, hd, inv, o);
}

// A decode step (up to DECODE_ROWS rows) splits its (row, head) pairs across the team; a prefill chunk splits (row,
// KV group) units and runs each group's heads ATT_Q at a time, so that every key and value row read from L2 serves
// ATT_Q heads.
static void attention_region(void* arg, int tid, int nth) {
    const attn_job* j = (const attn_job*)arg;
    const int H = j->H, KV = j->KV, per = H / KV;
    float* p_ = j->sc + (size_t)tid * ATT_Q * j->maxlen;
    if (j->M <= DECODE_ROWS) {
        const int n = j->M * H, i0 = (int)((long)n * tid / nth), i1 = (int)((long)n * (tid + 1) / nth);
        for (int i = i0; i < i1; i++) attend(j, i / H, i % H, 1, p_);
        return;
    }
    const int n = j->M * KV, i0 = (int)((long)n * tid / nth), i1 = (int)((long)n * (tid + 1) / nth);
    for (int i = i0; i < i1; i++) {
        const int m = i / KV, h1 = (i % KV + 1) * per;
        for (int h = (i % KV) * per; h < h1; h += ATT_Q) {
            const int nq = h1 - h < ATT_Q ? h1 - h : ATT_Q;
            if (nq == 3) attend(j, m, h, 3, p_); else if (nq == 2) attend(j, m, h, 2, p_); else attend(j, m, h, 1, p_);
        }
    }
}

// The gated MLP's activation: act(gate) * up for one row; I % 8 == 0 (a multiple of 64 for int4, 8 for fp32).
static void glu_row(const float* gm, float* am, int I, int act) {
    const __m256 one = _mm256_set1_ps(1.0f);
    for (int i = 0; i < I; i += 8) {
        __m256 g = _mm256_loadu_ps(gm + i), a;
        if (act == 0) {  // SiLU: g / (1 + e^-g)
            a = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
        } else {  // GELU, tanh approximation: g * sigmoid(2u) = 0.5 g (1 + tanh u), u = sqrt(2/pi) (g + 0.044715 g^3)
            __m256 u = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                                     _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), g), _mm256_mul_ps(g, g), g));
            a = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_mul_ps(_mm256_set1_ps(-2.0f), u))));
        }
        _mm256_storeu_ps(am + i, _mm256_mul_ps(a, _mm256_loadu_ps(gm + I + i)));
    }
}

// h [M, Hd]: token embeddings in (already scaled by the family's embedding scale), residual stream (clobbered).
// out [M, Hd]: final-normed hidden states. kc, vc: [nL][S][KV][maxlen][hd]. Each layer's cos/sin: [maxlen][hd].
// M <= STEP_ROWS.
void llama_step(int M, const int* pos, const int* slot, float* h, const layer_t* Ls, int nL,
                int Hd, int H, int KV, int hd, int I, float eps, const family_t* fam,
                float* kc, float* vc, int S, int maxlen, const float* normw, float* out, float* scratch, void* team) {
    const int Q = H * hd, NQKV = (H + 2 * KV) * hd;
    const int R = STEP_ROWS;
    float* xn = scratch; float* qkv = xn + R * Hd; float* att = qkv + R * NQKV; float* tmp = att + R * Q;
    float* gu = tmp + R * Hd; float* act = gu + R * 2 * I; float* sc = act + R * I;
    team_step_begin((team_t*)team, M); const long t0 = now_ns();
    const size_t cstride_l = (size_t)S * KV * maxlen * hd, cstride_s = (size_t)KV * maxlen * hd, cstride_h = (size_t)maxlen * hd;
    for (int l = 0; l < nL; l++) {
        const layer_t* L = Ls + l;
        rmsnorm(h, (const float*)L->ln1, xn, M, Hd, eps);
        linear(xn, M, Hd, NQKV, (L->kind >> 0) & 3, L->qkv_w, L->qkv_s, L->qkv_z, qkv, team);
        add_bias(qkv, M, NQKV, L->qkv_b);
        for (int m = 0; m < M; m++) {  // q/k norms, RoPE and KV write for every row first: a prefill chunk is causal
            float* q = qkv + (size_t)m * NQKV; float* k = q + Q; float* v = k + KV * hd;
            if (L->q_norm) { rmsnorm(q, (const float*)L->q_norm, q, H, hd, eps); rmsnorm(k, (const float*)L->k_norm, k, KV, hd, eps); }
            const float* cs = (const float*)L->cos + (size_t)pos[m] * hd; const float* sn = (const float*)L->sin + (size_t)pos[m] * hd;
            rope(q, H, hd, cs, sn); rope(k, KV, hd, cs, sn);
            for (int g = 0; g < KV; g++) {
                size_t off = l * cstride_l + slot[m] * cstride_s + g * cstride_h + (size_t)pos[m] * hd;
                memcpy(kc + off, k + g * hd, hd * sizeof(float)); memcpy(vc + off, v + g * hd, hd * sizeof(float));
            }
        }
        attn_job aj = {M, H, KV, hd, Q, NQKV, maxlen, (int)L->window, pos, slot, qkv, kc + l * cstride_l, vc + l * cstride_l,
                       cstride_s, cstride_h, fam->attn_scale, fam->attn_softcap, sc, att};
        team_run((team_t*)team, attention_region, &aj);
        linear(att, M, Q, Hd, (L->kind >> 2) & 3, L->o_w, L->o_s, L->o_z, tmp, team);
        add_bias(tmp, M, Hd, L->o_b);
        if (L->post_attn) rmsnorm(tmp, (const float*)L->post_attn, tmp, M, Hd, eps);
        for (int i = 0; i < M * Hd; i++) h[i] += tmp[i];
        rmsnorm(h, (const float*)L->ln2, xn, M, Hd, eps);
        linear(xn, M, Hd, 2 * I, (L->kind >> 4) & 3, L->gu_w, L->gu_s, L->gu_z, gu, team);
        for (int m = 0; m < M; m++) glu_row(gu + (size_t)m * 2 * I, act + (size_t)m * I, I, fam->act);
        linear(act, M, I, Hd, (L->kind >> 6) & 3, L->dn_w, L->dn_s, L->dn_z, tmp, team);
        if (L->post_ffn) rmsnorm(tmp, (const float*)L->post_ffn, tmp, M, Hd, eps);
        for (int i = 0; i < M * Hd; i++) h[i] += tmp[i];
    }
    rmsnorm(h, normw, out, M, Hd, eps);
    team_step_end((team_t*)team, M, now_ns() - t0);
}
