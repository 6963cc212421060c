// edgeflow cpu_native kernels: an exact int4 Llama decoder step for AVX2 + FMA CPUs, fp32 activations.
//
// Compiled by tasks/engines/cpu_native.py with `cc -O3 -mavx2 -mfma -mf16c -fopenmp -shared -fPIC` and
// called through ctypes (which releases the GIL). No global state: every function works only on the
// buffers it is given, so concurrent calls with separate KV caches and scratch buffers are safe.
//
// 1. q4i_gemm: y[m, n] = sum_g s[n, g] * sum_{k in g} float(q[n, k] - z[n, g]) * x[m, k]  (group 64).
//    q and z are the checkpoint's unsigned 4-bit integers (compressed-tensors stores q + 8; a symmetric
//    scheme has z = 8), so q - z is an exact small integer and the only rounding is the fp32 dot product:
//    the same arithmetic as the fake-quantized model (W = (q - z) * s, then x @ W^T), in another order.
//    Up to 4 activation rows (a decode step of up to 4 streams, or a 4-token prefill chunk) share one
//    unpack of every weight byte, so a batched step costs far less than M separate GEMVs.
//    Layout (tile-interleaved, one sequential stream per 4 output rows): [N/4][G][4 chunks][4 rows][8 B];
//    byte j of row r's chunk c in group g = q[g*64 + 8c + j] | q[g*64 + 32 + 8c + j] << 4.
//    s and z (int32) are [N/4][G][4].
// 2. f32_gemm: the same contract for plain fp32 weights [N, K] (dense checkpoints, dequantized schemes).
// 3. head_argmax: exact greedy argmax of x . E_r over the fp32 lm_head E [V, K] from an int8 per-row
//    copy. With a_r the int8 logit and d_r = ||E_r - Ehat_r||, Cauchy-Schwarz gives
//    |x . E_r - a_r| <= ||x|| d_r; adding an fp32 accumulation slack c_K ||x|| ||E_r|| gives e_r, where c_K
//    covers the rounding of both the int8 pass (8 lanes of K/8 sequential FMAs, then a 3-level sum) and the
//    fp32 rescoring (16 lanes of K/16): about (K/8 + K/16 + 8) unit roundoffs, doubled, and at least 1e-5.
//    Every row with a_r + e_r >= max_j (a_j - e_j) is a candidate: the true argmax is always one of them.
//    Candidates are rescored in fp32 against E; above max_cand candidates one full fp32 pass runs.
// 4. llama_step: a whole Llama decoder pass for M <= 4 rows (RMSNorm, fused qkv, RoPE, KV write, GQA
//    attention, o_proj, residual, RMSNorm, fused gate/up, SiLU * up, down, residual, final norm), so a
//    step has no per-op Python overhead. Row m has its own slot (KV cache) and position; rows of one slot
//    must be consecutive positions (a prefill chunk), rows of different slots are a batched decode step.
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

static inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi); lo = _mm_hadd_ps(lo, lo); lo = _mm_hadd_ps(lo, lo);
    return _mm_cvtss_f32(lo);
}

// split the N/4 row tiles into nth contiguous chunks
#define SPLIT int tid = omp_get_thread_num(), nth = omp_get_num_threads(); int tiles = N / 4;                \
    int r0 = (int)((long)tiles * tid / nth) * 4, r1 = (int)((long)tiles * (tid + 1) / nth) * 4;

// ---------------------------------------------------------------------------------------------- int4
// The 4 output rows of a tile are done R at a time (R = 4 for 1-2 activation rows, 2 for 3-4), so the
// accumulators of 3-4 rows stay in the 16 AVX2 registers instead of spilling; each weight byte is still
// unpacked once per call, for all activation rows.
#define DEFINE_Q4I(MM, R)                                                                                    \
static void q4i_rows_##MM(const float* x, int K, int N, const uint8_t* w, const float* s, const int32_t* z,  \
                          float* y, int r0, int r1) {                                                        \
    const int G = K / 64; const __m256i mask = _mm256_set1_epi32(15);                                       \
    for (int n0 = r0; n0 < r1; n0 += 4) {                                                                    \
        const uint8_t* t = w + (size_t)n0 * K / 2; const float* st = s + (size_t)n0 * G;                     \
        const int32_t* zt = z + (size_t)n0 * G;                                                              \
        for (int rb = 0; rb < 4; rb += R) {                                                                  \
        __m256 acc[MM][R];                                                                                   \
        for (int m = 0; m < MM; m++) for (int r = 0; r < R; r++) acc[m][r] = _mm256_setzero_ps();           \
        for (int g = 0; g < G; g++) {                                                                        \
            __m256 p[MM][R];                                                                                 \
            for (int m = 0; m < MM; m++) for (int r = 0; r < R; r++) p[m][r] = _mm256_setzero_ps();         \
            for (int c = 0; c < 4; c++) {                                                                    \
                const uint8_t* b = t + (size_t)(g * 4 + c) * 32;                                             \
                if (rb == 0) _mm_prefetch((const char*)(b + 512), _MM_HINT_T0);                              \
                for (int r = 0; r < R; r++) {                                                                \
                    const __m256i zz = _mm256_set1_epi32(zt[g * 4 + rb + r]);                                \
                    __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(b + 8 * (rb + r))));   \
                    __m256 lo = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(v, mask), zz));        \
                    __m256 hi = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(v, 4), zz));          \
                    for (int m = 0; m < MM; m++) {                                                           \
                        p[m][r] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(x + (size_t)m * K + g * 64 + 8 * c), p[m][r]);      \
                        p[m][r] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(x + (size_t)m * K + g * 64 + 32 + 8 * c), p[m][r]); \
                    }                                                                                        \
                }                                                                                            \
            }                                                                                                \
            for (int r = 0; r < R; r++) {                                                                    \
                __m256 sv = _mm256_set1_ps(st[g * 4 + rb + r]);                                              \
                for (int m = 0; m < MM; m++) acc[m][r] = _mm256_fmadd_ps(sv, p[m][r], acc[m][r]);            \
            }                                                                                                \
        }                                                                                                    \
        for (int m = 0; m < MM; m++) for (int r = 0; r < R; r++) y[(size_t)m * N + n0 + rb + r] = hsum(acc[m][r]); \
        }                                                                                                    \
    }                                                                                                        \
}
DEFINE_Q4I(1, 4) DEFINE_Q4I(2, 4) DEFINE_Q4I(3, 2) DEFINE_Q4I(4, 2) 

// Any M: chunks of 4 rows, each chunk sharing one unpack of the weights. K % 64 == 0, N % 4 == 0.
void q4i_gemm(const float* x, int M, int K, int N, const uint8_t* w, const float* s, const int32_t* z, float* y, int nt) {
    for (int m0 = 0; m0 < M; m0 += 4) {
        const int mm = M - m0 < 4 ? M - m0 : 4;
        const float* xm = x + (size_t)m0 * K; float* ym = y + (size_t)m0 * N;
        #pragma omp parallel num_threads(nt)
        { SPLIT
          switch (mm) { case 1: q4i_rows_1(xm, K, N, w, s, z, ym, r0, r1); break; case 2: q4i_rows_2(xm, K, N, w, s, z, ym, r0, r1); break;
                        case 3: q4i_rows_3(xm, K, N, w, s, z, ym, r0, r1); break; default: q4i_rows_4(xm, K, N, w, s, z, ym, r0, r1); } }
    }
}

// ---------------------------------------------------------------------------------------------- fp32
#define DEFINE_F32(MM)                                                                                       \
static void f32_rows_##MM(const float* x, int K, int N, const float* w, float* y, int r0, int r1) {         \
    for (int n0 = r0; n0 < r1; n0 += 4) {                                                                    \
        __m256 a[MM][4];                                                                                     \
        for (int m = 0; m < MM; m++) for (int r = 0; r < 4; r++) a[m][r] = _mm256_setzero_ps();             \
        for (int k = 0; k < K; k += 8) {                                                                     \
            __m256 xv[MM];                                                                                   \
            for (int m = 0; m < MM; m++) xv[m] = _mm256_loadu_ps(x + (size_t)m * K + k);                     \
            for (int r = 0; r < 4; r++) {                                                                    \
                __m256 wv = _mm256_loadu_ps(w + (size_t)(n0 + r) * K + k);                                   \
                for (int m = 0; m < MM; m++) a[m][r] = _mm256_fmadd_ps(wv, xv[m], a[m][r]);                  \
            }                                                                                                \
        }                                                                                                    \
        for (int m = 0; m < MM; m++) for (int r = 0; r < 4; r++) y[(size_t)m * N + n0 + r] = hsum(a[m][r]); \
    }                                                                                                        \
}
DEFINE_F32(1) DEFINE_F32(2) DEFINE_F32(3) DEFINE_F32(4)

// Any M; K % 8 == 0, N % 4 == 0.
void f32_gemm(const float* x, int M, int K, int N, const float* w, float* y, int nt) {
    for (int m0 = 0; m0 < M; m0 += 4) {
        const int mm = M - m0 < 4 ? M - m0 : 4;
        const float* xm = x + (size_t)m0 * K; float* ym = y + (size_t)m0 * N;
        #pragma omp parallel num_threads(nt)
        { SPLIT
          switch (mm) { case 1: f32_rows_1(xm, K, N, w, ym, r0, r1); break; case 2: f32_rows_2(xm, K, N, w, ym, r0, r1); break;
                        case 3: f32_rows_3(xm, K, N, w, ym, r0, r1); break; default: f32_rows_4(xm, K, N, w, ym, r0, r1); } }
    }
}

// ---------------------------------------------------------------------------------------------- int8 head
// Tile-interleaved int8 [N/4][K/8][4 rows][8 B], per-row scale s[n]. y = s[n] * sum_k w[n, k] x[m, k].
#define PF 1024
#define DEFINE_Q8I(MM)                                                                                      \
static void q8i_rows_##MM(const float* x, int K, int N, const int8_t* w, const float* s, float* y, int r0, int r1) { \
    for (int n0 = r0; n0 < r1; n0 += 4) {                                                                    \
        const int8_t* t = w + (size_t)n0 * K;                                                                \
        __m256 a[MM][4];                                                                                     \
        for (int m = 0; m < MM; m++) for (int r = 0; r < 4; r++) a[m][r] = _mm256_setzero_ps();             \
        for (int k = 0; k < K; k += 8) {                                                                     \
            _mm_prefetch((const char*)(t + 4 * k + PF), _MM_HINT_T0);                                        \
            __m256i b = _mm256_loadu_si256((const __m256i*)(t + 4 * k));                                     \
            __m128i b01 = _mm256_castsi256_si128(b), b23 = _mm256_extracti128_si256(b, 1);                   \
            __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b01));                                       \
            __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b01, 8)));                    \
            __m256 w2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b23));                                       \
            __m256 w3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b23, 8)));                    \
            for (int m = 0; m < MM; m++) {                                                                   \
                __m256 xv = _mm256_loadu_ps(x + (size_t)m * K + k);                                          \
                a[m][0] = _mm256_fmadd_ps(w0, xv, a[m][0]); a[m][1] = _mm256_fmadd_ps(w1, xv, a[m][1]);      \
                a[m][2] = _mm256_fmadd_ps(w2, xv, a[m][2]); a[m][3] = _mm256_fmadd_ps(w3, xv, a[m][3]);      \
            }                                                                                                \
        }                                                                                                    \
        for (int m = 0; m < MM; m++) for (int r = 0; r < 4; r++) y[(size_t)m * N + n0 + r] = s[n0 + r] * hsum(a[m][r]); \
    }                                                                                                        \
}
DEFINE_Q8I(1) DEFINE_Q8I(2)

void q8i_gemm(const float* x, int M, int K, int N, const int8_t* w, const float* s, float* y, int nt) {
    for (int m0 = 0; m0 < M; m0 += 2) {
        const int mm = M - m0 < 2 ? M - m0 : 2;
        const float* xm = x + (size_t)m0 * K; float* ym = y + (size_t)m0 * N;
        #pragma omp parallel num_threads(nt)
        { SPLIT
          if (mm == 1) q8i_rows_1(xm, K, N, w, s, ym, r0, r1); else q8i_rows_2(xm, K, N, w, s, ym, r0, r1); }
    }
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

// x [M, K]; the int8 copy covers Vp >= V rows (padded to a multiple of 4), E, dn, en cover V rows.
// a: scratch [M, Vp]; cand: [M, V] (row m's candidates, ascending, when ncand[m] >= 0).
// out_tok[m] = argmax; ncand[m] = number of candidates rescored, or -(count) - 1 when the full pass ran.
void head_argmax(const float* x, int M, int K, int V, int Vp, const int8_t* wi, const float* s, const float* dn,
                 const float* en, const float* E, float* a, int* cand, int max_cand, int* out_tok, int* ncand, int nt) {
    q8i_gemm(x, M, K, Vp, wi, s, a, nt);
    const double ck = (K / 8 + K / 16 + 8) * 2.0 * 5.97e-8;  // 2 * (lanes' sequential terms) * 2^-24
    const float slack = (float)(ck > 1e-5 ? ck : 1e-5);
    for (int m = 0; m < M; m++) {
        const float* xm = x + (size_t)m * K; const float* am = a + (size_t)m * Vp; int* cm = cand + (size_t)m * V;
        double ss = 0; for (int i = 0; i < K; i++) ss += (double)xm[i] * xm[i];
        const float xn = (float)sqrt(ss) * 1.000001f;
        float lo = -INFINITY;
        for (int r = 0; r < V; r++) { float e = xn * (dn[r] + slack * en[r]); float v = am[r] - e; if (v > lo) lo = v; }
        int n = 0;
        for (int r = 0; r < V; r++) { float e = xn * (dn[r] + slack * en[r]); if (am[r] + e >= lo) cm[n++] = r; }
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

// ---------------------------------------------------------------------------------------------- decoder step
// Per layer: pointers to its tensors; kind 0 = int4 (w, s, z), 1 = fp32 (w only).
typedef struct { int64_t ln1, qkv_w, qkv_s, qkv_z, o_w, o_s, o_z, ln2, gu_w, gu_s, gu_z, dn_w, dn_s, dn_z, kind, pad; } layer_t;

static void linear(const float* x, int M, int K, int N, int64_t kind, int64_t w, int64_t s, int64_t z, float* y, int nt) {
    if (kind == 1) f32_gemm(x, M, K, N, (const float*)w, y, nt);
    else q4i_gemm(x, M, K, N, (const uint8_t*)w, (const float*)s, (const int32_t*)z, y, nt);
}

static inline float dot_hd(const float* a, const float* b, int n) {  // n % 16 == 0
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    return hsum(_mm256_add_ps(s0, s1));
}

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

// Scratch floats needed by llama_step (for nt threads).
long llama_scratch_floats(int Hd, int H, int KV, int hd, int I, int maxlen, int nt) {
    return 4L * (3L * Hd + (long)(H + 2 * KV) * hd + 3L * I) + (long)nt * maxlen + 64;
}

// h [M, Hd]: token embeddings in, residual stream (clobbered). out [M, Hd]: final-normed hidden states.
// kc, vc: [nL][S][KV][maxlen][hd]. cosT, sinT: [maxlen][hd]. M <= 4.
void llama_step(int M, const int* pos, const int* slot, float* h, const layer_t* Ls, int nL,
                int Hd, int H, int KV, int hd, int I, float eps,
                float* kc, float* vc, int S, int maxlen, const float* cosT, const float* sinT,
                const float* normw, float* out, float* scratch, int nt) {
    const int NQKV = (H + 2 * KV) * hd;
    float* xn = scratch; float* qkv = xn + 4 * Hd; float* att = qkv + 4 * NQKV; float* tmp = att + 4 * Hd;
    float* gu = tmp + 4 * Hd; float* act = gu + 4 * 2 * I; float* sc = act + 4 * I;
    const float scale = 1.0f / sqrtf((float)hd);
    const size_t cstride_l = (size_t)S * KV * maxlen * hd, cstride_s = (size_t)KV * maxlen * hd, cstride_h = (size_t)maxlen * hd;
    for (int l = 0; l < nL; l++) {
        const layer_t* L = Ls + l;
        rmsnorm(h, (const float*)L->ln1, xn, M, Hd, eps);
        linear(xn, M, Hd, NQKV, L->kind, L->qkv_w, L->qkv_s, L->qkv_z, qkv, nt);
        for (int m = 0; m < M; m++) {  // RoPE and KV write for every row first: a prefill chunk is causal
            float* q = qkv + (size_t)m * NQKV; float* k = q + H * hd; float* v = k + KV * hd;
            const float* cs = cosT + (size_t)pos[m] * hd; const float* sn = sinT + (size_t)pos[m] * hd;
            rope(q, H, hd, cs, sn); rope(k, KV, hd, cs, sn);
            for (int g = 0; g < KV; g++) {
                size_t off = l * cstride_l + slot[m] * cstride_s + g * cstride_h + (size_t)pos[m] * hd;
                memcpy(kc + off, k + g * hd, hd * sizeof(float)); memcpy(vc + off, v + g * hd, hd * sizeof(float));
            }
        }
        #pragma omp parallel for num_threads(nt) collapse(2) schedule(static)
        for (int m = 0; m < M; m++) for (int hh = 0; hh < H; hh++) {
            const float* q = qkv + (size_t)m * NQKV + hh * hd; int g = hh / (H / KV); int T = pos[m] + 1;
            const float* K_ = kc + l * cstride_l + slot[m] * cstride_s + g * cstride_h;
            const float* V_ = vc + l * cstride_l + slot[m] * cstride_s + g * cstride_h;
            float* p = sc + (size_t)omp_get_thread_num() * maxlen; float mx = -INFINITY;
            for (int t = 0; t < T; t++) { p[t] = dot_hd(q, K_ + (size_t)t * hd, hd) * scale; if (p[t] > mx) mx = p[t]; }
            float sum = 0; for (int t = 0; t < T; t++) { p[t] = expf(p[t] - mx); sum += p[t]; }
            float* o = att + (size_t)m * Hd + hh * hd; float inv = 1.0f / sum;
            for (int i = 0; i < hd; i++) o[i] = 0;
            for (int t = 0; t < T; t++) { float w = p[t] * inv; for (int i = 0; i < hd; i++) o[i] += w * V_[(size_t)t * hd + i]; }
        }
        linear(att, M, Hd, Hd, L->kind, L->o_w, L->o_s, L->o_z, tmp, nt);
        for (int i = 0; i < M * Hd; i++) h[i] += tmp[i];
        rmsnorm(h, (const float*)L->ln2, xn, M, Hd, eps);
        linear(xn, M, Hd, 2 * I, L->kind, L->gu_w, L->gu_s, L->gu_z, gu, nt);
        for (int m = 0; m < M; m++) for (int i = 0; i < I; i++) {
            float g = gu[(size_t)m * 2 * I + i], u = gu[(size_t)m * 2 * I + I + i];
            act[(size_t)m * I + i] = g / (1.0f + expf(-g)) * u;
        }
        linear(act, M, I, Hd, L->kind, L->dn_w, L->dn_s, L->dn_z, tmp, nt);
        for (int i = 0; i < M * Hd; i++) h[i] += tmp[i];
    }
    rmsnorm(h, normw, out, M, Hd, eps);
}
