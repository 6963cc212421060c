// The host's limits, measured as an engine meets them (edgeflow/estimate/probe.py): a read-only stream over a buffer
// far larger than the last-level cache, and independent fp32 FMAs, each on `threads` threads started together.
// Built like cpu_native's kernels (-O3 -mavx2 -mfma), so an AVX2 load and an AVX2 FMA are what is counted.
#include <immintrin.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct {
    float *p;
    size_t n;           // floats, a multiple of 64
    long iters;         // fma: loop trips
    pthread_barrier_t *start;
    double seconds;     // this thread's time, barrier to end
    float sink;         // keeps the loads and FMAs alive
} job_t;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void *touch_job(void *arg) {  // first touch from the thread that will read it (its NUMA node, its pages)
    job_t *j = arg;
    for (size_t i = 0; i < j->n; i++) j->p[i] = (float)(i & 1023);
    return NULL;
}

static void *read_job(void *arg) {
    job_t *j = arg;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    pthread_barrier_wait(j->start);
    double t0 = now();
    for (size_t i = 0; i < j->n; i += 64) {
        a0 = _mm256_add_ps(a0, _mm256_load_ps(j->p + i));
        a1 = _mm256_add_ps(a1, _mm256_load_ps(j->p + i + 8));
        a2 = _mm256_add_ps(a2, _mm256_load_ps(j->p + i + 16));
        a3 = _mm256_add_ps(a3, _mm256_load_ps(j->p + i + 24));
        a4 = _mm256_add_ps(a4, _mm256_load_ps(j->p + i + 32));
        a5 = _mm256_add_ps(a5, _mm256_load_ps(j->p + i + 40));
        a6 = _mm256_add_ps(a6, _mm256_load_ps(j->p + i + 48));
        a7 = _mm256_add_ps(a7, _mm256_load_ps(j->p + i + 56));
    }
    j->seconds = now() - t0;
    __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                             _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)));
    float out[8];
    _mm256_storeu_ps(out, s);
    j->sink = out[0] + out[7];
    return NULL;
}

static void *fma_job(void *arg) {
    job_t *j = arg;
    // 10 independent chains: enough to cover the FMA latency (4-5 cycles) on two pipes
    __m256 a[10], x = _mm256_set1_ps(0.999999f), y = _mm256_set1_ps(1e-7f);
    for (int k = 0; k < 10; k++) a[k] = _mm256_set1_ps((float)k);
    pthread_barrier_wait(j->start);
    double t0 = now();
    for (long i = 0; i < j->iters; i++)
        for (int k = 0; k < 10; k++) a[k] = _mm256_fmadd_ps(a[k], x, y);
    j->seconds = now() - t0;
    float out[8];
    __m256 s = a[0];
    for (int k = 1; k < 10; k++) s = _mm256_add_ps(s, a[k]);
    _mm256_storeu_ps(out, s);
    j->sink = out[0];
    return NULL;
}

static double run(void *(*fn)(void *), job_t *jobs, int threads) {
    pthread_t tid[256];
    pthread_barrier_t start;
    pthread_barrier_init(&start, NULL, (unsigned)threads);
    for (int t = 0; t < threads; t++) {
        jobs[t].start = &start;
        pthread_create(&tid[t], NULL, fn, &jobs[t]);
    }
    double slowest = 0;
    for (int t = 0; t < threads; t++) {
        pthread_join(tid[t], NULL);
        if (jobs[t].seconds > slowest) slowest = jobs[t].seconds;
    }
    pthread_barrier_destroy(&start);
    return slowest;
}

// Bytes per second read by `threads` threads, each streaming its share of a `bytes` buffer once; best of `repeats`.
// 0 when the buffer cannot be allocated or threads is outside 1..256.
double probe_read_bytes_s(long bytes, int threads, int repeats) {
    if (threads < 1 || threads > 256 || repeats < 1) return 0;
    size_t per = ((size_t)bytes / sizeof(float) / (size_t)threads) / 64 * 64;
    if (per == 0) return 0;
    float *buf = NULL;
    if (posix_memalign((void **)&buf, 64, per * (size_t)threads * sizeof(float)) != 0) return 0;
    job_t jobs[256];
    memset(jobs, 0, sizeof jobs);
    pthread_t tid[256];
    for (int t = 0; t < threads; t++) {
        jobs[t].p = buf + (size_t)t * per;
        jobs[t].n = per;
        pthread_create(&tid[t], NULL, touch_job, &jobs[t]);
    }
    for (int t = 0; t < threads; t++) pthread_join(tid[t], NULL);
    double best = 0;
    for (int r = 0; r < repeats; r++) {
        double s = run(read_job, jobs, threads);
        double rate = (double)per * (double)threads * sizeof(float) / s;
        if (rate > best) best = rate;
    }
    free(buf);
    return best;
}

// fp32 FLOPs per second of `threads` threads of 8-wide FMAs (2 FLOPs per lane), `iters` trips of 10 each; best of
// `repeats`.
double probe_fma_flops_s(long iters, int threads, int repeats) {
    if (threads < 1 || threads > 256 || repeats < 1 || iters < 1) return 0;
    job_t jobs[256];
    memset(jobs, 0, sizeof jobs);
    double best = 0;
    for (int r = 0; r < repeats; r++) {
        for (int t = 0; t < threads; t++) jobs[t].iters = iters;
        double s = run(fma_job, jobs, threads);
        double rate = (double)iters * 10.0 * 8.0 * 2.0 * threads / s;
        if (rate > best) best = rate;
    }
    return best;
}
