/* hf_csv's own int8 screen GEMV for x86 AVX2, AVX-VNNI and AVX-512 VNNI (compiled on first use by
   hf_csv_kernels/native.py, for the best path the host runs).

   out[r, i] = (float)(sum_j q[i, j] * a[r, j]) * scale[i] * cr[r]

   q: int8 codes in [-127, 127] (never -128: the sign trick below would overflow; native.py checks), either
   row-major [V, d] or "interleaved": each block of 4 rows (4 * d bytes at row 4b) holds its first d32 = 32 * (d / 32)
   columns as [d32 / 32][4][32] and then its last d - d32 columns row by row; the last V % 4 rows stay
   row-major. a: int8 activations in [-127, 127].

   Exactness: _mm256_maddubs_epi16(|a|, sign(q, a)) multiplies |a_j| <= 127 by +-q_j (|q_j| <= 127) and adds
   pairs: |pair| <= 2 * 127 * 127 = 32258 < 32767, so the int16 saturation never triggers; _mm256_madd_epi16
   by ones widens to int32, and every int32 partial sum is bounded by 127 * 127 * d < 2^31 for d < 133,000.
   So the integer dot product is exact in any order; the float steps are three roundings (int -> float
   when |dot| >= 2^24, and two products), each within u of its result. Rows are shared between threads by
   an atomic counter (dynamic schedule), so a thread on a busy core takes fewer rows instead of making the
   others wait at a join. */
#include <stdint.h>
#include <immintrin.h>
#include <pthread.h>
#include <stdatomic.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* fn(arg) on the calling thread and threads - 1 more (each takes work items from an atomic counter in arg);
   returns how many ran. Built with -fopenmp (native.py does so where torch's own parallel backend is OpenMP),
   the team comes from the process's OpenMP runtime, which is torch's: loaded after torch, this library's
   libgomp.so.1 resolves to the copy torch already mapped. Its workers are the ones that just ran torch's last
   parallel op and still spin-wait for more (GOMP's default wait policy); threads of our own would compete with
   them for the cores during that spin (docs/kernels.md, "Threads").
   Otherwise POSIX threads; a thread that cannot be created just leaves its share to the others. */
#ifdef _OPENMP
#include <omp.h>
static int run_threads(void *(*fn)(void *), void *arg, int threads) {
    int n = 1;
    if (threads > 64) threads = 64;
    if (threads <= 1) {
        fn(arg);
        return 1;
    }
#pragma omp parallel num_threads(threads)
    {
        fn(arg);
#pragma omp master
        n = omp_get_num_threads();
    }
    return n;
}
#else
static int run_threads(void *(*fn)(void *), void *arg, int threads) {
    pthread_t th[64];
    int n = 0;
    if (threads > 64) threads = 64;
    for (int t = 1; t < threads; t++)
        if (pthread_create(&th[n], 0, fn, arg) == 0) n++;
    fn(arg);
    for (int t = 0; t < n; t++) pthread_join(th[t], 0);
    return n + 1;
}
#endif

/* 1 when built with OpenMP (native.py reports which runtime serves the threads). */
int hf_csv_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

typedef struct {
    const int8_t *q; const int8_t *a; const float *scale; const float *cr; float *out;
    int64_t V, d, N, chunk; int il; atomic_long next;
    /* the fused epilogue (hf_csv_screen_bounds; all NULL / 0 for the plain GEMV): */
    const float *wJ, *hJ; int64_t k;  /* outlier columns: W_J in 8-row blocks (see epilogue), h_J [N, k] */
    const float *bias;                /* [V] or NULL */
    const float *t0, *t1, *t2;        /* per-row terms of the radius [V] (t2 may be NULL) */
    const double *coef;               /* [N, 4]: radius = c0 t0 + c1 t1 + c2 t2 + c3 |bias| */
    float *upper;                     /* [N, V] or NULL */
    float *best; int64_t *arg;        /* [chunks, N]: each chunk's largest estimate and its first row */
    int fused;
} job_t;

static inline void emit(const job_t *J, int64_t r, int64_t i, int32_t dot) {
    J->out[r * J->V + i] = (float)dot * J->scale[i] * J->cr[r];
}

/* The next float32 above each lane (+inf stays +inf; -0 and +0 go to the smallest positive subnormal). */
static inline __m128 next_up4(__m128 f) {
    __m128i b = _mm_castps_si128(_mm_add_ps(f, _mm_setzero_ps()));  /* -0 + 0 = +0 */
    const __m128i step = _mm_or_si128(_mm_srai_epi32(b, 31), _mm_set1_epi32(1));  /* -1 if negative, else +1 */
    const __m128i inf = _mm_cmpeq_epi32(b, _mm_set1_epi32(0x7f800000));
    return _mm_castsi128_ps(_mm_blendv_epi8(_mm_add_epi32(b, step), b, inf));
}

/* The fused epilogue over rows [lo, hi) of a chunk (lo a multiple of 8), once est holds the screen's
   fl(fl(fl(dot) s_i) cr_r) there:
   * est += the k-column float32 dot over W_J (FMA chain, then one add; any order of the k-term dot is within
     gamma_{k+2}: docs/certificates.md Lemma 3 / 1'), then + b_i (one add). W_J is read in 8-row blocks
     (wJ[((i / 8) k + j) 8 + i % 8], the rows padded to a multiple of 8), so 8 rows take k FMAs.
   * upper >= est + c0 t0_i + c1 t1_i + c2 t2_i + c3 |b_i| (real sum): rad = the four products and three adds of
     non-negative float64 terms (within 7 2^-53 rad of the real value), x = rad + est (one more rounding, within
     2^-53 |x|), then x += 2^-47 (|x| + rad), which exceeds both errors (and the float64 roundings of the coefficients, a few 2^-53) together with its own rounding (the
     addend is at least 8 ulps of x); x is converted to float32 (nearest) and moved one float up, so upper >= x.
     No product of float32-range operands underflows in float64.
   * the chunk's largest est and its first row (strict >: the first of equal values). */
static void epilogue(const job_t *J, int64_t lo, int64_t hi, int64_t cid) {
    const int64_t V = J->V, k = J->k, n8 = (hi - lo) & ~7LL;
    for (int64_t r = 0; r < J->N; r++) {
        float *est = J->out + r * V;
        if (k) {
            const float *h = J->hJ + r * k;
            for (int64_t i = lo; i < lo + n8; i += 8) {
                const float *w = J->wJ + (i / 8) * k * 8;
                __m256 acc = _mm256_setzero_ps();
                for (int64_t j = 0; j < k; j++)
                    acc = _mm256_fmadd_ps(_mm256_loadu_ps(w + 8 * j), _mm256_set1_ps(h[j]), acc);
                _mm256_storeu_ps(est + i, _mm256_add_ps(_mm256_loadu_ps(est + i), acc));
            }
            for (int64_t i = lo + n8; i < hi; i++) {
                const float *w = J->wJ + (i / 8) * k * 8 + i % 8;
                float acc = 0.0f;
                for (int64_t j = 0; j < k; j++) acc = fmaf(w[8 * j], h[j], acc);
                est[i] = est[i] + acc;
            }
        }
        if (J->bias)
            for (int64_t i = lo; i < hi; i++) est[i] = est[i] + J->bias[i];
        if (J->upper) {
            const double *c = J->coef + 4 * r;
            float *up = J->upper + r * V;
            const __m256d c0 = _mm256_set1_pd(c[0]), c1 = _mm256_set1_pd(c[1]), c2 = _mm256_set1_pd(c[2]),
                          c3 = _mm256_set1_pd(c[3]), eps = _mm256_set1_pd(0x1p-47),
                          absmask = _mm256_castsi256_pd(_mm256_set1_epi64x(0x7fffffffffffffffLL));
            int64_t i = lo;
            for (; i + 4 <= hi; i += 4) {
                __m256d rad = _mm256_mul_pd(c0, _mm256_cvtps_pd(_mm_loadu_ps(J->t0 + i)));
                rad = _mm256_add_pd(rad, _mm256_mul_pd(c1, _mm256_cvtps_pd(_mm_loadu_ps(J->t1 + i))));
                if (J->t2) rad = _mm256_add_pd(rad, _mm256_mul_pd(c2, _mm256_cvtps_pd(_mm_loadu_ps(J->t2 + i))));
                if (J->bias)
                    rad = _mm256_add_pd(rad, _mm256_mul_pd(c3, _mm256_and_pd(absmask, _mm256_cvtps_pd(_mm_loadu_ps(J->bias + i)))));
                __m256d x = _mm256_add_pd(rad, _mm256_cvtps_pd(_mm_loadu_ps(est + i)));
                x = _mm256_add_pd(x, _mm256_mul_pd(eps, _mm256_add_pd(_mm256_and_pd(absmask, x), rad)));
                _mm_storeu_ps(up + i, next_up4(_mm256_cvtpd_ps(x)));
            }
            for (; i < hi; i++) {
                double rad = c[0] * (double)J->t0[i] + c[1] * (double)J->t1[i];
                if (J->t2) rad += c[2] * (double)J->t2[i];
                if (J->bias) rad += c[3] * fabs((double)J->bias[i]);
                double x = rad + (double)est[i];
                x += 0x1p-47 * (fabs(x) + rad);
                up[i] = _mm_cvtss_f32(next_up4(_mm_set_ss((float)x)));
            }
        }
        if (J->best) {
            float b = -INFINITY;
            int64_t arg = -1;
            for (int64_t i = lo; i < hi; i++)
                if (est[i] > b) { b = est[i]; arg = i; }
            J->best[cid * J->N + r] = b;
            J->arg[cid * J->N + r] = arg;
        }
    }
}

static inline int32_t hsum(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

/* acc += per 4-byte group, sum of |x_j| * (sign(x_j) w_j) = sum of w_j x_j, in int32 lanes. One of three paths, chosen
   at build time (native.py compiles the one the host runs, then self-tests it against an int64 reference):
   * AVX-512 VNNI (EVEX, 256-bit with AVX-512VL) and AVX-VNNI (VEX): vpdpbusd multiplies the unsigned |x_j| <= 127 by
     the signed sign(x_j) w_j (|.| <= 127) and adds the four products of each group to the lane without saturation:
     exact while the lane stays below 2^31, which 127 * 127 * d does for d < 133,000 (MAX_D);
   * AVX2: maddubs (pairs, |pair| <= 32258 < 32767: no saturation), madd by ones (int32), add: exact likewise. */
#if defined(HF_CSV_PATH_AVX512VNNI)
#define HF_CSV_PATH_ID 2
#define DOT(acc, w, x, ax) acc = _mm256_dpbusd_epi32(acc, ax, _mm256_sign_epi8(w, x))
#elif defined(HF_CSV_PATH_AVXVNNI)
#define HF_CSV_PATH_ID 1
#define DOT(acc, w, x, ax) acc = _mm256_dpbusd_avx_epi32(acc, ax, _mm256_sign_epi8(w, x))
#else
#define HF_CSV_PATH_ID 0
#define DOT(acc, w, x, ax) \
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w, x)), ones))
#endif

/* Software prefetch distance (bytes) of the interleaved loop: on some hosts the hardware prefetcher alone leaves one core
   streaming the codes below MKL's dense GEMV; the distance is the one measured best there and neutral elsewhere
   (docs/benchmarks.md §9.11). 0 turns it off. */
#ifndef HF_CSV_PREFETCH
#define HF_CSV_PREFETCH 2048
#endif

/* Which DOT this library was built with: 0 AVX2, 1 AVX-VNNI, 2 AVX-512 VNNI. */
int hf_csv_path(void) { return HF_CSV_PATH_ID; }

static void rows(const job_t *J, int64_t lo, int64_t hi) {
    const int64_t d = J->d, d32 = d & ~31LL, N = J->N;
    const __m256i ones = _mm256_set1_epi16(1);
    (void)ones;  /* (the VNNI paths do not widen through it) */
    int64_t i = lo;
    for (; i + 4 <= hi; i += 4) {
        const int8_t *w = J->q + i * d;
        for (int64_t r = 0; r < N; r++) {
            const int8_t *a = J->a + r * d;
            __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
            if (J->il) {
                for (int64_t j = 0; j < d32; j += 32) {
                    const __m256i x = _mm256_loadu_si256((const __m256i *)(a + j)), ax = _mm256_abs_epi8(x);
                    const int8_t *wj = w + 4 * j;
#if HF_CSV_PREFETCH > 0
                    /* one sequential stream: ask for the lines HF_CSV_PREFETCH bytes ahead (a hint; past the end of
                       the codes it is dropped without a fault) */
                    _mm_prefetch((const char *)(wj + HF_CSV_PREFETCH), _MM_HINT_T0);
                    _mm_prefetch((const char *)(wj + HF_CSV_PREFETCH + 64), _MM_HINT_T0);
#endif
                    DOT(s0, _mm256_loadu_si256((const __m256i *)wj), x, ax);
                    DOT(s1, _mm256_loadu_si256((const __m256i *)(wj + 32)), x, ax);
                    DOT(s2, _mm256_loadu_si256((const __m256i *)(wj + 64)), x, ax);
                    DOT(s3, _mm256_loadu_si256((const __m256i *)(wj + 96)), x, ax);
                }
            } else {
                for (int64_t j = 0; j < d32; j += 32) {
                    const __m256i x = _mm256_loadu_si256((const __m256i *)(a + j)), ax = _mm256_abs_epi8(x);
                    DOT(s0, _mm256_loadu_si256((const __m256i *)(w + j)), x, ax);
                    DOT(s1, _mm256_loadu_si256((const __m256i *)(w + d + j)), x, ax);
                    DOT(s2, _mm256_loadu_si256((const __m256i *)(w + 2 * d + j)), x, ax);
                    DOT(s3, _mm256_loadu_si256((const __m256i *)(w + 3 * d + j)), x, ax);
                }
            }
            int32_t t0 = hsum(s0), t1 = hsum(s1), t2 = hsum(s2), t3 = hsum(s3);
            /* the last d % 32 columns: row k of the block has them at w + k * d + j (row-major), or after
               the interleaved part at w + 4 * d32 + k * (d - d32) + (j - d32) (interleaved) */
            const int64_t e = J->il ? d - d32 : d;
            const int8_t *u = J->il ? w + 4 * d32 - d32 : w;
            for (int64_t j = d32; j < d; j++) {
                t0 += u[j] * a[j]; t1 += u[e + j] * a[j]; t2 += u[2 * e + j] * a[j]; t3 += u[3 * e + j] * a[j];
            }
            emit(J, r, i, t0); emit(J, r, i + 1, t1); emit(J, r, i + 2, t2); emit(J, r, i + 3, t3);
        }
    }
    for (; i < hi; i++) { /* the last V % 4 rows: row-major in both layouts */
        const int8_t *w = J->q + i * d;
        for (int64_t r = 0; r < N; r++) {
            const int8_t *a = J->a + r * d;
            int32_t t = 0;
            for (int64_t j = 0; j < d; j++) t += w[j] * a[j];
            emit(J, r, i, t);
        }
    }
}

static void *worker(void *p) {
    job_t *J = (job_t *)p;
    for (;;) {
        int64_t lo = atomic_fetch_add(&J->next, J->chunk);
        if (lo >= J->V) break;
        const int64_t hi = lo + J->chunk < J->V ? lo + J->chunk : J->V;
        rows(J, lo, hi);
        if (J->fused) epilogue(J, lo, hi, lo / J->chunk);
    }
    return 0;
}

/* chunk: rows per work item, rounded up to a multiple of 4 (so 4-row blocks never straddle items) */
int hf_csv_screen_i8(const int8_t *q, const float *scale, int64_t V, int64_t d, const int8_t *a,
                     const float *cr, int64_t N, float *out, int threads, int64_t chunk, int interleaved) {
    job_t J = {q, a, scale, cr, out, V, d, N, chunk > 0 ? (chunk + 3) & ~3LL : 2048, interleaved};
    atomic_init(&J.next, 0);
    return run_threads(worker, &J, threads);
}

/* The screen with its bounds in one call (hf_csv_kernels.screen.screen_bounds_cpu), from the float32 hidden
   states h [N, d]:
   * per row r, on the calling thread (docs/certificates.md §1.1, Lemma 2'): the outlier columns J (k of them)
     are zeroed in h_R; hinf = max_j |h_j|; m = max |h_R| (1 where that is 0); a_j = round(fl(fl(h_j / m) 127))
     for j not in J (|fl(h_j / m)| <= 1, so |a_j| <= 127), 0 on J; cr = fl(m / 127); the norm of h_R (of the whole h
     when rest_norm is 0) as a float64 sum of squares (within (d + 2) 2^-53 relatively), square-rooted and raised
     by 1e-10; coef = (norm K0, m K1 + hinf K2, hinf K3, K4) with the caller's constants K;
   * then est, upper and each chunk's largest est, as the epilogue says, on `threads` threads; top[r] is the
     first row of the largest est (chunks in increasing order, each keeping its first maximum).
   chunk: a multiple of 8. Returns the threads that ran, or -1 if the workspace could not be allocated. */
int hf_csv_screen_bounds(const int8_t *q, const float *scale, int64_t V, int64_t d, const float *h, int64_t N,
                         const int64_t *Jc, int64_t k, const float *wJ, int rest_norm, const double *K,
                         const float *bias, const float *t0, const float *t1, const float *t2,
                         float *est, float *upper, int64_t *top, int threads, int64_t chunk, int interleaved) {
    const int64_t nchunks = (V + chunk - 1) / chunk;
    int8_t *a = malloc((size_t)(N * d));
    float *cr = malloc(sizeof(float) * (size_t)N), *hJ = malloc(sizeof(float) * (size_t)(N * k + 1));
    float *best = malloc(sizeof(float) * (size_t)(nchunks * N));
    double *coef = malloc(sizeof(double) * (size_t)(4 * N));
    int64_t *arg = malloc(sizeof(int64_t) * (size_t)(nchunks * N));
    unsigned char *inJ = calloc((size_t)d, 1);
    int ran = -1;
    if (!a || !cr || !hJ || !best || !coef || !arg || !inJ) goto done;
    for (int64_t j = 0; j < k; j++) inJ[Jc[j]] = 1;
    for (int64_t r = 0; r < N; r++) {
        const float *x = h + r * d;
        float hinf = 0.0f, m = 0.0f;
        double n2 = 0.0;
        for (int64_t j = 0; j < d; j++) {
            const float v = fabsf(x[j]);
            if (v > hinf) hinf = v;
            if (!inJ[j] && v > m) m = v;
            if (!inJ[j] || !rest_norm) n2 += (double)x[j] * (double)x[j];
        }
        if (!(m > 0.0f)) m = 1.0f;
        for (int64_t j = 0; j < d; j++) {
            if (inJ[j]) { a[r * d + j] = 0; continue; }
            const float y = x[j] / m;
            const float z = y * 127.0f;
            a[r * d + j] = (int8_t)nearbyintf(z);
        }
        cr[r] = m / 127.0f;
        for (int64_t j = 0; j < k; j++) hJ[r * k + j] = x[Jc[j]];
        coef[4 * r] = sqrt(n2) * (1.0 + 1e-10) * K[0];
        coef[4 * r + 1] = (double)m * K[1] + (double)hinf * K[2];
        coef[4 * r + 2] = (double)hinf * K[3];
        coef[4 * r + 3] = K[4];
    }
    job_t J = {q, a, scale, cr, est, V, d, N, chunk, interleaved};
    atomic_init(&J.next, 0);
    J.wJ = wJ; J.hJ = hJ; J.k = k; J.bias = bias; J.t0 = t0; J.t1 = t1; J.t2 = t2; J.coef = coef;
    J.upper = upper; J.best = best; J.arg = arg; J.fused = 1;
    ran = run_threads(worker, &J, threads);
    for (int64_t r = 0; r < N; r++) {
        float b = -INFINITY;
        int64_t t = -1;
        for (int64_t c = 0; c < nchunks; c++)
            if (best[c * N + r] > b) { b = best[c * N + r]; t = arg[c * N + r]; }
        top[r] = t;  /* -1 only if every estimate of the row is NaN (the caller then picks any seed) */
    }
done:
    free(a); free(cr); free(hJ); free(best); free(coef); free(arg); free(inJ);
    return ran;
}

/* The smallest code of q (n bytes). */
int hf_csv_min_i8(const int8_t *q, int64_t n) {
    __m256i m = _mm256_set1_epi8(127);
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) m = _mm256_min_epi8(m, _mm256_loadu_si256((const __m256i *)(q + i)));
    int8_t b[32];
    _mm256_storeu_si256((__m256i *)b, m);
    int mn = 127;
    for (int k = 0; k < 32; k++) if (b[k] < mn) mn = b[k];
    for (; i < n; i++) if (q[i] < mn) mn = q[i];
    return mn;
}

/* One block of 4 rows (w: 4 row-major rows of d codes) into the interleaved layout above (o: 4 * d bytes). */
static inline void interleave_block(const int8_t *w, int64_t d, int8_t *o) {
    const int64_t d32 = d & ~31LL;
    for (int64_t j = 0; j < d32; j += 32)
        for (int k = 0; k < 4; k++)
            _mm256_storeu_si256((__m256i *)(o + 4 * j + 32 * k), _mm256_loadu_si256((const __m256i *)(w + k * d + j)));
    for (int k = 0; k < 4; k++)
        memcpy(o + 4 * d32 + k * (d - d32), w + k * d + d32, (size_t)(d - d32));
}

/* The interleaved copy of q (see the layout above) and the smallest code, in one pass. */
int hf_csv_interleave4(const int8_t *q, int64_t V, int64_t d, int8_t *out) {
    const int64_t V4 = V & ~3LL;
    for (int64_t i = 0; i < V4; i += 4) interleave_block(q + i * d, d, out + i * d);
    memcpy(out + V4 * d, q + V4 * d, (size_t)((V - V4) * d));
    return hf_csv_min_i8(q, V * d);
}

/* Per row i of a float32 head w [V, d] and its codes q (int8, scale s_i), in float64 / int64:
   err2[i] = sum_j (w_ij - s_i q_ij)^2, l1q[i] = sum_j |q_ij|, absl1[i] = sum_j |w_ij|.
   s_i q_ij is exact in float64 (24 + 8 bits); each difference, square and add rounds once (relative 2^-53),
   so err2 and absl1 are within (d + 2) 2^-53 relatively of the real sums (every term >= 0); l1q is exact.
   (native.row_terms turns them into rounded-up float32 bounds.) Rows go to threads as in the screen. */
typedef struct {
    const float *w; const int8_t *q; const float *scale; double *err2; int64_t *l1q; double *absl1;
    int64_t V, d, chunk; atomic_long next;
} terms_t;

/* The three sums of one row (the function both the recompute and the quantizer below run, so their terms agree bit
   for bit): 8 partial sums each (two vectors of 4; column j goes to lane j mod 8 below the last multiple of 8, the rest
   to lane 0), then ((p0 + p4) + (p1 + p5)) + ((p2 + p6) + (p3 + p7)). Any order is covered by the error bound. Each
   step is the scalar one: s q_j in float64 is exact; the difference, its square and each add round once. */
static inline void row_terms_1(const float *w, const int8_t *q, double s, int64_t d, double *err2, int64_t *l1q,
                               double *absl1) {
    const __m256d sv = _mm256_set1_pd(s);
    const __m256d absmask = _mm256_castsi256_pd(_mm256_set1_epi64x(0x7fffffffffffffffLL));
    __m256d e0 = _mm256_setzero_pd(), e1 = _mm256_setzero_pd(), a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
    __m256i l = _mm256_setzero_si256();  /* |q| <= 127: each lane below 2^31 for d < MAX_D */
    int64_t j = 0;
    for (; j + 8 <= d; j += 8) {
        const __m256 wf = _mm256_loadu_ps(w + j);
        const __m256d w0 = _mm256_cvtps_pd(_mm256_castps256_ps128(wf)), w1 = _mm256_cvtps_pd(_mm256_extractf128_ps(wf, 1));
        const __m256i qi = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + j)));
        const __m256d q0 = _mm256_cvtepi32_pd(_mm256_castsi256_si128(qi)), q1 = _mm256_cvtepi32_pd(_mm256_extracti128_si256(qi, 1));
        const __m256d x0 = _mm256_sub_pd(w0, _mm256_mul_pd(sv, q0)), x1 = _mm256_sub_pd(w1, _mm256_mul_pd(sv, q1));
        e0 = _mm256_add_pd(e0, _mm256_mul_pd(x0, x0));
        e1 = _mm256_add_pd(e1, _mm256_mul_pd(x1, x1));
        a0 = _mm256_add_pd(a0, _mm256_and_pd(w0, absmask));
        a1 = _mm256_add_pd(a1, _mm256_and_pd(w1, absmask));
        l = _mm256_add_epi32(l, _mm256_abs_epi32(qi));
    }
    double e[8], a[8];
    int32_t li[8];
    _mm256_storeu_pd(e, e0), _mm256_storeu_pd(e + 4, e1), _mm256_storeu_pd(a, a0), _mm256_storeu_pd(a + 4, a1);
    _mm256_storeu_si256((__m256i *)li, l);
    for (; j < d; j++) {
        const double x = (double)w[j] - s * (double)q[j];
        e[0] += x * x;
        a[0] += (double)fabsf(w[j]);
        li[0] += abs((int)q[j]);
    }
    *err2 = ((e[0] + e[4]) + (e[1] + e[5])) + ((e[2] + e[6]) + (e[3] + e[7]));
    *absl1 = ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
    int64_t t = 0;
    for (int k = 0; k < 8; k++) t += li[k];
    *l1q = t;
}

static void *terms_worker(void *p) {
    terms_t *T = (terms_t *)p;
    for (;;) {
        int64_t lo = atomic_fetch_add(&T->next, T->chunk);
        if (lo >= T->V) break;
        int64_t hi = lo + T->chunk < T->V ? lo + T->chunk : T->V;
        for (int64_t i = lo; i < hi; i++)
            row_terms_1(T->w + i * T->d, T->q + i * T->d, (double)T->scale[i], T->d, T->err2 + i, T->l1q + i,
                        T->absl1 + i);
    }
    return 0;
}

int hf_csv_row_terms(const float *w, const int8_t *q, const float *scale, int64_t V, int64_t d,
                     double *err2, int64_t *l1q, double *absl1, int threads) {
    terms_t T = {w, q, scale, err2, l1q, absl1, V, d, 1024};
    atomic_init(&T.next, 0);
    return run_threads(terms_worker, &T, threads);
}

/* The quantizer of hf_csv_kernels.quantize._quantize_chunk (int8), bit for bit, with its terms and the interleaved
   copy in the same pass over the float32 head w [V, d]. Per row: amax = max_j |w_j| (exact); s = amax / 127 (float32,
   correctly rounded, as torch's division), or 1 where that is not > 0 (an all-zero row: any scale is exact);
   q_j = clamp(round(w_j / s), -127, 127) with the float32 quotient correctly rounded and round-half-to-even (torch's
   round); so never -128. Then the row's sums as hf_csv_row_terms (the same function) and, with qi, the rows' 4-row
   interleaved copy (the layout above; chunks of rows are multiples of 4, so a block never straddles two threads).
   Returns 0, or -1 (the outputs partly written) when a weight is not finite. */
typedef struct {
    const float *w; int8_t *q, *qi; float *scale; double *err2; int64_t *l1q; double *absl1;
    int64_t V, d, chunk; atomic_long next; atomic_int bad;
} quant_t;

static int quant_row(const float *w, int64_t d, int8_t *q, float *scale) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 fmax = _mm256_set1_ps(3.40282347e+38f);
    __m256 m = _mm256_setzero_ps(), ok = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    int64_t j = 0;
    for (; j + 8 <= d; j += 8) {
        const __m256 a = _mm256_and_ps(_mm256_loadu_ps(w + j), absmask);
        ok = _mm256_and_ps(ok, _mm256_cmp_ps(a, fmax, _CMP_LE_OQ));  /* false for inf and NaN */
        m = _mm256_max_ps(m, a);
    }
    float mm[8], amax = 0.0f;
    _mm256_storeu_ps(mm, m);
    int bad = _mm256_movemask_ps(ok) != 0xff;
    for (int k = 0; k < 8; k++) if (mm[k] > amax) amax = mm[k];
    for (; j < d; j++) {
        const float a = fabsf(w[j]);
        if (!(a <= 3.40282347e+38f)) bad = 1;
        if (a > amax) amax = a;
    }
    if (bad) return -1;
    float s = amax / 127.0f;
    if (!(s > 0.0f)) s = 1.0f;
    *scale = s;
    const __m256 sv = _mm256_set1_ps(s), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (j = 0; j + 32 <= d; j += 32) {
        __m256i v[4];
        for (int k = 0; k < 4; k++) {
            __m256 x = _mm256_div_ps(_mm256_loadu_ps(w + j + 8 * k), sv);
            x = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            v[k] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(x, lo), hi));  /* integers: converted exactly */
        }
        /* int32 -> int8 (no saturation: |v| <= 127); the packs interleave 128-bit lanes, the permute restores order */
        const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
        _mm256_storeu_si256((__m256i *)(q + j), _mm256_permutevar8x32_epi32(p, perm));
    }
    for (; j < d; j++) {
        float x = nearbyintf(w[j] / s);  /* the default rounding mode: to nearest, ties to even */
        x = x < -127.0f ? -127.0f : (x > 127.0f ? 127.0f : x);
        q[j] = (int8_t)x;
    }
    return 0;
}

static void *quant_worker(void *p) {
    quant_t *T = (quant_t *)p;
    const int64_t d = T->d, V4 = T->V & ~3LL;
    for (;;) {
        if (atomic_load(&T->bad)) break;
        const int64_t lo = atomic_fetch_add(&T->next, T->chunk);
        if (lo >= T->V) break;
        const int64_t hi = lo + T->chunk < T->V ? lo + T->chunk : T->V;
        for (int64_t i = lo; i < hi; i++) {
            if (quant_row(T->w + i * d, d, T->q + i * d, T->scale + i)) {
                atomic_store(&T->bad, 1);
                return 0;
            }
            row_terms_1(T->w + i * d, T->q + i * d, (double)T->scale[i], d, T->err2 + i, T->l1q + i, T->absl1 + i);
        }
        if (T->qi) {
            int64_t i = lo;
            for (; i + 4 <= hi && i < V4; i += 4) interleave_block(T->q + i * d, d, T->qi + i * d);
            if (i < hi) memcpy(T->qi + i * d, T->q + i * d, (size_t)((hi - i) * d));  /* the last V % 4 rows */
        }
    }
    return 0;
}

int hf_csv_quantize_i8(const float *w, int64_t V, int64_t d, int8_t *q, int8_t *qi, float *scale, double *err2,
                       int64_t *l1q, double *absl1, int threads) {
    quant_t T = {w, q, qi, scale, err2, l1q, absl1, V, d, 64};
    atomic_init(&T.next, 0);
    atomic_init(&T.bad, 0);
    run_threads(quant_worker, &T, threads);
    return atomic_load(&T.bad) ? -1 : 0;
}

/* The exact outlier columns of a screen (hf_csv_kernels.screen.make_outliers) in one pass over the rows: wJ[i, t] =
   w[i, cols[t]] (float32 [V, k], copied exactly) and low[i] = sum_t (w[i, cols[t]] - s_i q[i, cols[t]])^2 in float64
   (s_i q exact; the difference, the square and each add round once: within (k + 2) 2^-53 relatively of the real sum,
   any order; make_outliers lowers it by 1e-12 relatively, for k <= 1000). Rows go to threads in chunks. */
typedef struct {
    const float *w; const int8_t *q; const float *scale; const int64_t *cols; float *wJ; double *low;
    int64_t V, d, k, chunk; atomic_long next;
} outl_t;

static void *outl_worker(void *p) {
    outl_t *T = (outl_t *)p;
    for (;;) {
        const int64_t lo = atomic_fetch_add(&T->next, T->chunk);
        if (lo >= T->V) break;
        const int64_t hi = lo + T->chunk < T->V ? lo + T->chunk : T->V;
        for (int64_t i = lo; i < hi; i++) {
            const float *w = T->w + i * T->d;
            const int8_t *q = T->q + i * T->d;
            const double s = (double)T->scale[i];
            float *o = T->wJ + i * T->k;
            double acc = 0;
            for (int64_t t = 0; t < T->k; t++) {
                const int64_t j = T->cols[t];
                const double x = (double)w[j] - s * (double)q[j];
                o[t] = w[j];
                acc += x * x;
            }
            T->low[i] = acc;
        }
    }
    return 0;
}

int hf_csv_outlier_cols(const float *w, const int8_t *q, const float *scale, int64_t V, int64_t d, const int64_t *cols,
                        int64_t k, float *wJ, double *low, int threads) {
    outl_t T = {w, q, scale, cols, wJ, low, V, d, k, 2048};
    atomic_init(&T.next, 0);
    return run_threads(outl_worker, &T, threads);
}

/* ------------------------------------------------------------------------------------------------------------------
   The one-row top-1 epilogue: what hf_csv.certificate.CertifiedHead._topk computes after the screen for one row, k = 1,
   a head without a bias whose values are returned in its own dtype (float32, or bfloat16 with `bf16`), in one call
   instead of about a hundred small torch ops. Each float step below is the torch step it replaces, in the same order
   and rounding (this file is built with -ffp-contract=off, so no product and sum fuse; bfloat16 roundings are to
   nearest, ties to even, as torch's), except the dot products, whose order is free (below). Proofs:
   docs/certificates.md §2.1 (the seed's lower bound and the cut) and §2.0 (the values' slack and the argmax decided
   within it).

   Dot products (the seed's exact value, each candidate's float32 accumulator and sum_j |w_j h_j|, bfloat16 weights
   widened exactly): 8 float32 FMA lanes, a sequential sum of the lanes, then the tail; every term passes through at
   most d / 8 + 14 roundings, <= d + 2 for d >= 16 (below 16: one scalar chain, d roundings), so each value is within
   gamma_{d+2} sum_j |w_j h_j| of the real one (Higham, Lemma 3.1, any order) — the bound the torch path's F.linear
   and sum carry as well.

   h: the row in float32 (a bfloat16 row widened exactly). cst: gamma_{d+2}, (d + 2) 2^-149, max_i ||W_i||_1 (raised),
   max |b| (0), 1 + 1e-6, the slack coefficient 2 gamma (1 + 2 gamma)(1 + 1e-6) and 2 (d + 2) 2^-149, each rounded to
   float32 as torch rounds a Python scalar. Returns the number n of candidates (toks ascending, acc their float32
   accumulators, ent their slacks; logits — float32, or bfloat16 bits — holds the values, acc rounded to the head's
   dtype, on them and -inf elsewhere, mask 1 on them; out = (t, bound, slack, sum of U_i - value_i over S: a
   statistic)), or a negative code, after which the caller runs the torch path: -1 more than `limit` candidates, -2 the
   argmax is not decided within the slack (stock's row needed), -3 a cut that is not finite, -4 a seed out of range or
   a value / slack that is not finite. */
static inline float f_down(float x) { return nextafterf(x, -INFINITY); }
static inline float f_up(float x) { return nextafterf(x, INFINITY); }

static inline float bf2f(uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* float32 -> bfloat16, to nearest, ties to even (c10::BFloat16's rounding; NaN stays a quiet NaN) */
static inline uint16_t f2bf(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* the next bfloat16 toward -inf (up = 0) or +inf (up = 1), for a finite or infinite b (nextafter on the bits) */
static inline uint16_t bf_step(uint16_t b, int up) {
    const float f = bf2f(b);
    if (f != f) return b;
    if (f == 0.0f) return up ? 0x0001u : 0x8001u;
    if (up ? f == INFINITY : f == -INFINITY) return b;
    return (uint16_t)(((f > 0.0f) == (up != 0)) ? b + 1 : b - 1);
}

/* x rounded to the head's dtype (float32: itself), as a float32 */
static inline float vround(float x, int bf16) { return bf16 ? bf2f(f2bf(x)) : x; }

/* _to_dtype: x rounded to bfloat16 toward +inf (up) or -inf, as a float32 (float32: x) */
static inline float to_dtype_dir(float x, int bf16, int up) {
    if (!bf16) return x;
    uint16_t v = f2bf(x);
    const float vf = bf2f(v);
    if (up ? vf < x : vf > x) v = bf_step(v, up);
    return bf2f(v);
}

static void dot_abs(const void *wp, int bf16, const float *h, int64_t d, float *dot, float *absdot) {
    const float *wf = (const float *)wp;
    const uint16_t *wb = (const uint16_t *)wp;
    float s = 0.0f, a = 0.0f;
    int64_t j = 0;
    if (d >= 16) {
        const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
        __m256 vs = _mm256_setzero_ps(), va = _mm256_setzero_ps();
        for (; j + 8 <= d; j += 8) {
            const __m256 wv = bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(
                                         _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(wb + j))), 16))
                                   : _mm256_loadu_ps(wf + j);
            const __m256 hv = _mm256_loadu_ps(h + j);
            vs = _mm256_fmadd_ps(wv, hv, vs);
            va = _mm256_fmadd_ps(_mm256_and_ps(wv, absmask), _mm256_and_ps(hv, absmask), va);
        }
        float bs[8], ba[8];
        _mm256_storeu_ps(bs, vs);
        _mm256_storeu_ps(ba, va);
        for (int l = 0; l < 8; l++) { s = s + bs[l]; a = a + ba[l]; }
    }
    for (; j < d; j++) {
        const float w = bf16 ? bf2f(wb[j]) : wf[j];
        s = s + w * h[j];
        a = a + fabsf(w) * fabsf(h[j]);
    }
    *dot = s;
    *absdot = a;
}

static int64_t top1_row(const void *W, int bf16, int64_t V, int64_t d, const float *h, const float *U, int64_t seed,
                        const float *abs_l1, const float *cst, int64_t limit, void *logits, uint8_t *mask,
                        int64_t *toks, float *acc, float *ent, float *out) {
    const float gam = cst[0], und = cst[1], l1max = cst[2], bmax = cst[3], raise = cst[4], coef = cst[5],
                und2 = cst[6];
    const size_t wsize = bf16 ? 2 : 4;
    if (seed < 0 || seed >= V) return -4;
    float amax = 0.0f;
    for (int64_t j = 0; j < d; j++) { const float v = fabsf(h[j]); if (v > amax) amax = v; }
    /* stock_error: E = (gam (l1max amax + bmax)) raise + und */
    float E = l1max * amax;
    E = E + bmax;
    E = gam * E;
    E = E * raise;
    E = E + und;
    /* the seed's exact value and _stock_lower: lo = down(down(val - err, 2) - E, 2), err = gam |W_s|_1 amax + und */
    float val, ad;
    dot_abs((const char *)W + (size_t)(seed * d) * wsize, bf16, h, d, &val, &ad);
    if (!isfinite(val)) return -4;
    float err = gam * abs_l1[seed];
    err = err * amax;
    err = err + und;
    float lo = f_down(f_down(val - err));
    lo = f_down(f_down(lo - E));
    /* _cut: b = the predecessor of round(lo) in the head's dtype; _cut_at: edge = succ(b) in float32, or in bfloat16
       the midpoint of b and its successor (exact in float32); t = down(edge - E, 2) */
    float b, edge;
    if (bf16) {
        const uint16_t bb = bf_step(f2bf(lo), 0);
        b = bf2f(bb);
        edge = b + bf2f(bf_step(bb, 1));
        edge = edge / 2.0f;
    } else {
        b = f_down(lo);
        edge = f_up(b);
    }
    const float t = f_down(f_down(edge - E));
    /* an infinite edge: b is the dtype's largest finite value, whose successor is +inf; no finite t caps a logit
       that rounds to +inf (the torch path's _cut_at declines the row too) */
    if (!isfinite(t) || !isfinite(b) || !isfinite(edge)) return -3;
    /* S = {i : U_i >= t} (NaN compares false, as in torch) */
    if (limit > V - 1) limit = V - 1;  /* a row holding every token is the torch path's (its bound is -inf) */
    int64_t n = 0, i = 0;
    const __m256 tv = _mm256_set1_ps(t);
    for (; i + 8 <= V; i += 8) {
        unsigned m = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(U + i), tv, _CMP_GE_OQ));
        while (m) {
            if (n >= limit) return -1;
            toks[n++] = i + __builtin_ctz(m);
            m &= m - 1;
        }
    }
    for (; i < V; i++)
        if (U[i] >= t) { if (n >= limit) return -1; toks[n++] = i; }
    /* accumulators, their slacks (CertifiedHead._values: ent = coef sum|w h| + 2 und), the row's slack (their max)
       and the largest value (the accumulator rounded to the head's dtype) */
    float slack = 0.0f, top = -INFINITY;
    for (int64_t m = 0; m < n; m++) {
        float a;
        dot_abs((const char *)W + (size_t)(toks[m] * d) * wsize, bf16, h, d, &acc[m], &a);
        float e = coef * a;
        e = e + und2;
        const float v = vround(acc[m], bf16);
        if (!isfinite(acc[m]) || !isfinite(e) || !isfinite(v)) return -4;
        ent[m] = e;
        if (e > slack) slack = e;
        if (v > top) top = v;
    }
    /* _sparse_undecided: w, the first token of the largest value, is stock's argmax when lo_w > hi_j for every j before
       it and lo_w >= hi_j after it; value_interval: lo = down(acc - s) rounded down to the dtype, hi = up(acc + s)
       rounded up */
    if (n > 0 && slack > 0.0f) {
        int64_t w = 0;
        while (vround(acc[w], bf16) != top) w++;
        const float lo_w = to_dtype_dir(f_down(acc[w] - ent[w]), bf16, 0);
        for (int64_t m = 0; m < n; m++) {
            if (m == w) continue;
            const float hi = to_dtype_dir(f_up(acc[m] + ent[m]), bf16, 1);
            if (m < w ? !(lo_w > hi) : !(lo_w >= hi)) return -2;
        }
    }
    double radius = 0.0;
    if (bf16) {
        uint16_t *lg = (uint16_t *)logits;
        for (int64_t v = 0; v < V; v++) lg[v] = 0xff80u;  /* -inf */
        for (int64_t m = 0; m < n; m++) lg[toks[m]] = f2bf(acc[m]);
    } else {
        float *lg = (float *)logits;
        for (int64_t v = 0; v < V; v++) lg[v] = -INFINITY;
        for (int64_t m = 0; m < n; m++) lg[toks[m]] = acc[m];
    }
    memset(mask, 0, (size_t)V);
    for (int64_t m = 0; m < n; m++) {
        mask[toks[m]] = 1;
        radius += (double)U[toks[m]] - (double)vround(acc[m], bf16);
    }
    out[0] = t;
    out[1] = b;
    out[2] = slack;
    out[3] = (float)radius;
    return n;
}

/* N rows (a batched decode step): row r reads h + r d, U + r V and seeds[r], and writes its logits and mask rows at
   r V, its candidates at toks / acc / ent + r limit, its (t, bound, slack, radius) at out + 4 r and its count at
   counts[r]. Returns the total count, or the first failing row's negative code: the caller's torch path then takes
   the whole call (its dense rows are stock's op over every row of the call). */
int64_t hf_csv_top1(const void *W, int bf16, int64_t V, int64_t d, const float *h, const float *U,
                    const int64_t *seeds, int64_t N, const float *abs_l1, const float *cst, int64_t limit,
                    void *logits, uint8_t *mask, int64_t *toks, float *acc, float *ent, float *out, int64_t *counts) {
    const size_t wsize = bf16 ? 2 : 4;
    int64_t total = 0;
    for (int64_t r = 0; r < N; r++) {
        const int64_t n = top1_row(W, bf16, V, d, h + r * d, U + r * V, seeds[r], abs_l1, cst, limit,
                                   (char *)logits + (size_t)(r * V) * wsize, mask + r * V, toks + r * limit,
                                   acc + r * limit, ent + r * limit, out + 4 * r);
        if (n < 0) return n;
        counts[r] = n;
        total += n;
    }
    return total;
}
