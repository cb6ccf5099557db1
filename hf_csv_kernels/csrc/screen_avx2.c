/* hf_csv's own int8 screen GEMV for x86 AVX2 (compiled on first use by hf_csv_kernels/native.py).

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

/* fn(arg) on the calling thread and threads - 1 more (each takes work items from an atomic counter in arg);
   returns how many ran. A thread that cannot be created just leaves its share to the others. */
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

typedef struct {
    const int8_t *q; const int8_t *a; const float *scale; const float *cr; float *out;
    int64_t V, d, N, chunk; int il; atomic_long next;
} job_t;

static inline int32_t hsum(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

#define DOT(acc, w, x, ax) \
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w, x)), ones))

static void rows(const job_t *J, int64_t lo, int64_t hi) {
    const int64_t d = J->d, d32 = d & ~31LL, N = J->N, V = J->V;
    const __m256i ones = _mm256_set1_epi16(1);
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
            float *o = J->out + r * V + i;
            const float c = J->cr[r];
            o[0] = (float)t0 * J->scale[i] * c; o[1] = (float)t1 * J->scale[i + 1] * c;
            o[2] = (float)t2 * J->scale[i + 2] * c; o[3] = (float)t3 * J->scale[i + 3] * c;
        }
    }
    for (; i < hi; i++) { /* the last V % 4 rows: row-major in both layouts */
        const int8_t *w = J->q + i * d;
        for (int64_t r = 0; r < N; r++) {
            const int8_t *a = J->a + r * d;
            int32_t t = 0;
            for (int64_t j = 0; j < d; j++) t += w[j] * a[j];
            J->out[r * V + i] = (float)t * J->scale[i] * J->cr[r];
        }
    }
}

static void *worker(void *p) {
    job_t *J = (job_t *)p;
    for (;;) {
        int64_t lo = atomic_fetch_add(&J->next, J->chunk);
        if (lo >= J->V) break;
        rows(J, lo, lo + J->chunk < J->V ? lo + J->chunk : J->V);
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

/* The interleaved copy of q (see the layout above) and the smallest code, in one pass. */
int hf_csv_interleave4(const int8_t *q, int64_t V, int64_t d, int8_t *out) {
    const int64_t d32 = d & ~31LL, V4 = V & ~3LL;
    int mn = 127;
    for (int64_t i = 0; i < V4; i += 4) {
        const int8_t *w = q + i * d;
        int8_t *o = out + i * d;
        for (int64_t j = 0; j < d32; j += 32)
            for (int k = 0; k < 4; k++)
                for (int t = 0; t < 32; t++) {
                    int8_t v = w[k * d + j + t];
                    o[4 * j + 32 * k + t] = v;
                    if (v < mn) mn = v;
                }
        for (int k = 0; k < 4; k++)
            for (int64_t j = d32; j < d; j++) {
                int8_t v = w[k * d + j];
                o[4 * d32 + k * (d - d32) + (j - d32)] = v;
                if (v < mn) mn = v;
            }
    }
    for (int64_t i = V4 * d; i < V * d; i++) {
        out[i] = q[i];
        if (q[i] < mn) mn = q[i];
    }
    return mn;
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

/* Per row i of a float32 head w [V, d] and its codes q (int8, scale s_i), in float64 / int64:
   err2[i] = sum_j (w_ij - s_i q_ij)^2, l1q[i] = sum_j |q_ij|, absl1[i] = sum_j |w_ij|.
   s_i q_ij is exact in float64 (24 + 8 bits); each difference, square and add rounds once (relative 2^-53),
   so err2 and absl1 are within (d + 2) 2^-53 relatively of the real sums (every term >= 0); l1q is exact.
   (native.row_terms turns them into rounded-up float32 bounds.) Rows go to threads as in the screen. */
typedef struct {
    const float *w; const int8_t *q; const float *scale; double *err2; int64_t *l1q; double *absl1;
    int64_t V, d, chunk; atomic_long next;
} terms_t;

static void *terms_worker(void *p) {
    terms_t *T = (terms_t *)p;
    for (;;) {
        int64_t lo = atomic_fetch_add(&T->next, T->chunk);
        if (lo >= T->V) break;
        int64_t hi = lo + T->chunk < T->V ? lo + T->chunk : T->V;
        for (int64_t i = lo; i < hi; i++) {
            const float *w = T->w + i * T->d;
            const int8_t *q = T->q + i * T->d;
            const double s = (double)T->scale[i];
            /* four partial sums each (any order is covered by the error bound), so the loop vectorizes */
            double e[4] = {0, 0, 0, 0}, a[4] = {0, 0, 0, 0};
            int32_t l[4] = {0, 0, 0, 0};  /* |q| <= 127: below 2^31 for d < MAX_D */
            int64_t j = 0;
            for (; j + 4 <= T->d; j += 4)
                for (int k = 0; k < 4; k++) {
                    const double x = (double)w[j + k] - s * (double)q[j + k];
                    e[k] += x * x;
                    a[k] += (double)fabsf(w[j + k]);
                    l[k] += abs((int)q[j + k]);
                }
            for (; j < T->d; j++) {
                const double x = (double)w[j] - s * (double)q[j];
                e[0] += x * x;
                a[0] += (double)fabsf(w[j]);
                l[0] += abs((int)q[j]);
            }
            T->err2[i] = (e[0] + e[1]) + (e[2] + e[3]);
            T->absl1[i] = (a[0] + a[1]) + (a[2] + a[3]);
            T->l1q[i] = (int64_t)l[0] + l[1] + l[2] + l[3];
        }
    }
    return 0;
}

int hf_csv_row_terms(const float *w, const int8_t *q, const float *scale, int64_t V, int64_t d,
                     double *err2, int64_t *l1q, double *absl1, int threads) {
    terms_t T = {w, q, scale, err2, l1q, absl1, V, d, 1024};
    atomic_init(&T.next, 0);
    return run_threads(terms_worker, &T, threads);
}
