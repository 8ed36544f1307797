/* mindrl's C kernels for fp32 (and, for the training ops, bf16) work on a CPU, loaded by mindrl/kernels/cpu_kernels.py.

   Training: SwiGLU, RMSNorm and RoPE, forward and backward; attention's masked softmax and its backward; the
   log-probabilities' softmax statistics and gradient. Each does its op in one pass over rows that OpenMP splits
   between torch's threads (torch runs one pass over memory per op: SwiGLU's backward alone is four). The rollout:
   the sampling step (inverse CDF per row), and a GEMM for its linear layers (weights packed into panels; tiles that
   prefetch the next panel while they compute; AVX-512 or AVX2 intrinsics where -march has them).

   Accuracy: exp is computed here (Cody-Waite range reduction, a degree-7 polynomial, the exponent set in the bits):
   SiLU forward and backward are as close to the fp64 values as torch's own kernels, not bit-identical to them. RoPE
   and RMSNorm do the same products and sums as the torch forms, built without contraction into FMAs
   (-ffp-contract=off): RoPE is bit-identical to megatron's unfused form; RMSNorm's reductions add in another order
   (the last bits differ, as close to fp64). The attention softmax and its backward are as close to fp64 as torch's;
   the log-probs' sums of exp(z) are accumulated in double. tests/kernels/test_cpu_kernels.py checks each. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <omp.h>
#if defined(__x86_64__) && (defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__)))
#include <immintrin.h>
#endif

/* e^x: x = n ln2 + r with |r| <= ln2/2 (ln2 split in two for an exact n ln2), e^r by its Taylor polynomial of
   degree 7 (error < 5e-9 relative), times 2^n built in the exponent bits. x is clamped to [-88, 88.7]: n = -127
   builds 0 (e^x below 2^-126 comes out 0), n = 128 builds +inf (overflow, as expf); NaN stays NaN. Branch-free, so
   the loops around it vectorise. */
static inline float exp_f(float x) {
    x = x < -88.0f ? -88.0f : x;
    x = x > 88.7f ? 88.7f : x;
    const float magic = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer held in the low mantissa bits */
    float t = x * 1.44269504088896341f + magic;
    float n = t - magic;
    float r = x - n * 0.693145751953125f;
    r = r - n * 1.428606765330187045e-06f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { float f; int32_t i; } u = {t};
    union { int32_t i; float f; } s = {(u.i - 0x4B400000 + 127) << 23};
    return p * s.f;
}

static inline float sigmoid_f(float a) { return 1.0f / (1.0f + exp_f(-a)); }

/* x [rows, 2h] = [a, b] -> out [rows, h] = silu(a) * b */
void mindrl_swiglu_fwd(const float *x, float *out, int64_t rows, int64_t h, int nt) {
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t r = 0; r < rows; r++) {
        const float *a = x + r * 2 * h, *b = a + h;
        float *o = out + r * h;
#pragma omp simd
        for (int64_t j = 0; j < h; j++) o[j] = a[j] * sigmoid_f(a[j]) * b[j];
    }
}

/* dx [rows, 2h] = [g * b * silu'(a), g * silu(a)], silu'(a) = s + silu(a) (1 - s), s = sigmoid(a) */
void mindrl_swiglu_bwd(const float *x, const float *g, float *dx, int64_t rows, int64_t h, int nt) {
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t r = 0; r < rows; r++) {
        const float *a = x + r * 2 * h, *b = a + h, *gr = g + r * h;
        float *da = dx + r * 2 * h, *db = da + h;
#pragma omp simd
        for (int64_t j = 0; j < h; j++) {
            float s = sigmoid_f(a[j]);
            float silu = a[j] * s;
            da[j] = gr[j] * b[j] * (s + silu * (1.0f - s));
            db[j] = gr[j] * silu;
        }
    }
}

/* RMSNorm: rstd = 1 / sqrt(mean(x^2) + eps) per row, y = x * rstd (kept for backward), out = w * y. */
void mindrl_rms_norm_fwd(const float *x, const float *w, float *y, float *out, float *rstd, int64_t rows, int64_t h,
                         float eps, int nt) {
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * h;
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t j = 0; j < h; j++) ss += xr[j] * xr[j];
        float rs = 1.0f / sqrtf(ss / (float)h + eps);
        rstd[r] = rs;
        float *yr = y + r * h, *o = out + r * h;
#pragma omp simd
        for (int64_t j = 0; j < h; j++) {
            float v = xr[j] * rs;
            yr[j] = v;
            o[j] = w[j] * v;
        }
    }
}

/* RMSNorm's backward from y = x * rstd (fp32) and out = w * y: dw = sum over rows of g * y; dy = g * w,
   dx = (dy - y * mean(dy * y)) * rstd. dx or dw may be NULL (not needed). */
int mindrl_rms_norm_bwd(const float *g, const float *y, const float *rstd, const float *w, float *dx, float *dw,
                        int64_t rows, int64_t h, int nt) {
    float *part = NULL;
    if (dw) {
        part = (float *)calloc((size_t)nt * (size_t)h, sizeof(float));
        if (!part) return 1;
    }
#pragma omp parallel num_threads(nt)
    {
        float *pw = part ? part + (int64_t)omp_get_thread_num() * h : NULL;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            const float *gr = g + r * h, *yr = y + r * h;
            if (pw) {
#pragma omp simd
                for (int64_t j = 0; j < h; j++) pw[j] += gr[j] * yr[j];
            }
            if (dx) {
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t j = 0; j < h; j++) dot += (gr[j] * w[j]) * yr[j];
                dot = dot / (float)h;
                float rs = rstd[r];
                float *o = dx + r * h;
#pragma omp simd
                for (int64_t j = 0; j < h; j++) o[j] = ((gr[j] * w[j]) - yr[j] * dot) * rs;
            }
        }
    }
    if (dw) {
        for (int64_t j = 0; j < h; j++) {
            float acc = 0.0f;
            for (int t = 0; t < nt; t++) acc += part[(int64_t)t * h + j];
            dw[j] = acc;
        }
        free(part);
    }
    return 0;
}

/* RoPE, rotate-half layout: t [S, B, H, D] (strides ss, sb, sh; the last dimension contiguous), cos / sin [S, half]
   -> out [S, B, H, D] contiguous = [x1 cos - x2 sin, x2 cos + x1 sin, rest] (sign > 0), or the transpose
   [x1 cos + x2 sin, x2 cos - x1 sin, rest] (sign < 0, for backward). Each product rounded before the sum. */
void mindrl_rope(const float *t, const float *cs, const float *sn, float *out, int64_t S, int64_t B, int64_t H,
                 int64_t D, int64_t half, int64_t ss, int64_t sb, int64_t sh, int sign, int nt) {
#pragma omp parallel for collapse(2) schedule(static) num_threads(nt)
    for (int64_t p = 0; p < S; p++) {
        for (int64_t bi = 0; bi < B; bi++) {
            const float *c = cs + p * half, *s = sn + p * half;
            for (int64_t hi = 0; hi < H; hi++) {
                const float *x = t + p * ss + bi * sb + hi * sh;
                float *o = out + ((p * B + bi) * H + hi) * D;
                if (sign > 0) {
#pragma omp simd
                    for (int64_t j = 0; j < half; j++) {
                        float x1 = x[j], x2 = x[half + j];
                        o[j] = x1 * c[j] - x2 * s[j];
                        o[half + j] = x2 * c[j] + x1 * s[j];
                    }
                } else {
#pragma omp simd
                    for (int64_t j = 0; j < half; j++) {
                        float x1 = x[j], x2 = x[half + j];
                        o[j] = x1 * c[j] + x2 * s[j];
                        o[half + j] = x2 * c[j] - x1 * s[j];
                    }
                }
                for (int64_t j = 2 * half; j < D; j++) o[j] = x[j];
            }
        }
    }
}

/* ---- bf16 forms of SwiGLU, RMSNorm, RoPE and the log-probs' softmax: bf16 (uint16) in and out, every product and
   sum in fp32 (the sums of exp(z) in double), each output rounded once to the nearest bf16 (ties to even, NaN kept
   NaN: torch's rounding). Plain integer conversions that any x86-64 CPU runs (the compiler vectorises them for the
   -march it builds for); no AVX512-BF16 instruction is needed, so the AVX2 build is the same code. */
typedef uint16_t bf16_t;

static inline float bf_ld(bf16_t h) {
    union { uint32_t i; float f; } u = {(uint32_t)h << 16};
    return u.f;
}

static inline bf16_t bf_st(float f) {
    union { float f; uint32_t i; } u = {f};
    const uint32_t rounded = (u.i + 0x7FFFu + ((u.i >> 16) & 1u)) >> 16;
    return f != f ? (bf16_t)0x7FC0 : (bf16_t)rounded;
}

void mindrl_swiglu_fwd_bf16(const bf16_t *x, bf16_t *out, int64_t rows, int64_t h, int nt) {
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t r = 0; r < rows; r++) {
        const bf16_t *a = x + r * 2 * h, *b = a + h;
        bf16_t *o = out + r * h;
#pragma omp simd
        for (int64_t j = 0; j < h; j++) {
            const float av = bf_ld(a[j]);
            o[j] = bf_st(av * sigmoid_f(av) * bf_ld(b[j]));
        }
    }
}

void mindrl_swiglu_bwd_bf16(const bf16_t *x, const bf16_t *g, bf16_t *dx, int64_t rows, int64_t h, int nt) {
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t r = 0; r < rows; r++) {
        const bf16_t *a = x + r * 2 * h, *b = a + h, *gr = g + r * h;
        bf16_t *da = dx + r * 2 * h, *db = da + h;
#pragma omp simd
        for (int64_t j = 0; j < h; j++) {
            const float av = bf_ld(a[j]), gv = bf_ld(gr[j]);
            const float s = sigmoid_f(av), silu = av * s;
            da[j] = bf_st(gv * bf_ld(b[j]) * (s + silu * (1.0f - s)));
            db[j] = bf_st(gv * silu);
        }
    }
}

/* RMSNorm in bf16: out = w * (x * rstd), rounded once; rstd (fp32) kept. Backward recomputes y = x * rstd from the
   bf16 input rather than keeping an fp32 copy of it. */
void mindrl_rms_norm_fwd_bf16(const bf16_t *x, const bf16_t *w, bf16_t *out, float *rstd, int64_t rows, int64_t h,
                              float eps, int nt) {
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t r = 0; r < rows; r++) {
        const bf16_t *xr = x + r * h;
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t j = 0; j < h; j++) {
            const float v = bf_ld(xr[j]);
            ss += v * v;
        }
        const float rs = 1.0f / sqrtf(ss / (float)h + eps);
        rstd[r] = rs;
        bf16_t *o = out + r * h;
#pragma omp simd
        for (int64_t j = 0; j < h; j++) o[j] = bf_st(bf_ld(w[j]) * (bf_ld(xr[j]) * rs));
    }
}

/* dw (fp32) = sum over rows of g * y; dx = (g w - y mean(g w y)) rstd, y = x * rstd. dx or dw may be NULL. */
int mindrl_rms_norm_bwd_bf16(const bf16_t *g, const bf16_t *x, const float *rstd, const bf16_t *w, bf16_t *dx,
                             float *dw, int64_t rows, int64_t h, int nt) {
    float *part = NULL;
    if (dw) {
        part = (float *)calloc((size_t)nt * (size_t)h, sizeof(float));
        if (!part) return 1;
    }
#pragma omp parallel num_threads(nt)
    {
        float *pw = part ? part + (int64_t)omp_get_thread_num() * h : NULL;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            const bf16_t *gr = g + r * h, *xr = x + r * h;
            const float rs = rstd[r];
            if (pw) {
#pragma omp simd
                for (int64_t j = 0; j < h; j++) pw[j] += bf_ld(gr[j]) * (bf_ld(xr[j]) * rs);
            }
            if (dx) {
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t j = 0; j < h; j++) dot += (bf_ld(gr[j]) * bf_ld(w[j])) * (bf_ld(xr[j]) * rs);
                dot = dot / (float)h;
                bf16_t *o = dx + r * h;
#pragma omp simd
                for (int64_t j = 0; j < h; j++)
                    o[j] = bf_st(((bf_ld(gr[j]) * bf_ld(w[j])) - (bf_ld(xr[j]) * rs) * dot) * rs);
            }
        }
    }
    if (dw) {
        for (int64_t j = 0; j < h; j++) {
            float acc = 0.0f;
            for (int t = 0; t < nt; t++) acc += part[(int64_t)t * h + j];
            dw[j] = acc;
        }
        free(part);
    }
    return 0;
}

/* RoPE in bf16 (see mindrl_rope): cos / sin fp32, each output's two products and their sum in fp32, rounded once. */
void mindrl_rope_bf16(const bf16_t *t, const float *cs, const float *sn, bf16_t *out, int64_t S, int64_t B, int64_t H,
                      int64_t D, int64_t half, int64_t ss, int64_t sb, int64_t sh, int sign, int nt) {
    const float k = sign > 0 ? 1.0f : -1.0f;
#pragma omp parallel for collapse(2) schedule(static) num_threads(nt)
    for (int64_t p = 0; p < S; p++) {
        for (int64_t bi = 0; bi < B; bi++) {
            const float *c = cs + p * half, *s = sn + p * half;
            for (int64_t hi = 0; hi < H; hi++) {
                const bf16_t *x = t + p * ss + bi * sb + hi * sh;
                bf16_t *o = out + ((p * B + bi) * H + hi) * D;
#pragma omp simd
                for (int64_t j = 0; j < half; j++) {
                    const float x1 = bf_ld(x[j]), x2 = bf_ld(x[half + j]), sj = k * s[j];
                    o[j] = bf_st(x1 * c[j] - x2 * sj);
                    o[half + j] = bf_st(x2 * c[j] + x1 * sj);
                }
                for (int64_t j = 2 * half; j < D; j++) o[j] = x[j];
            }
        }
    }
}

/* mindrl_softmax_stats for bf16 logit rows. */
void mindrl_softmax_stats_bf16(const bf16_t *x, int64_t xs, const float *shift, float *s0, float *s2, int64_t rows,
                               int64_t v, float t, int nt) {
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t r = 0; r < rows; r++) {
        const bf16_t *xr = x + r * xs;
        const float sh = shift[r];
        double a = 0.0, b = 0.0;
#pragma omp simd reduction(+ : a, b)
        for (int64_t j = 0; j < v; j++) {
            const float z = (t == 1.0f ? bf_ld(xr[j]) : bf_ld(xr[j]) / t) - sh, e = exp_f(z);
            a += (double)e;
            b += (double)e * (double)z;
        }
        s0[r] = (float)a;
        if (s2) s2[r] = (float)b;
    }
}

/* mindrl_softmax_grad for bf16 logit rows, the gradient written in bf16. */
void mindrl_softmax_grad_bf16(const bf16_t *x, int64_t xs, const float *lse, const float *ng, bf16_t *grad,
                              int64_t rows, int64_t v, float t, int nt) {
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t r = 0; r < rows; r++) {
        const bf16_t *xr = x + r * xs;
        bf16_t *o = grad + r * v;
        const float sh = lse[r], k = ng[r];
#pragma omp simd
        for (int64_t j = 0; j < v; j++) o[j] = bf_st(exp_f((t == 1.0f ? bf_ld(xr[j]) : bf_ld(xr[j]) / t) - sh) * k);
    }
}

/* Attention's masked softmax, in place over scores x [nb, per_b, sq, s] (per_b rows groups of sq query rows per
   batch element): x = softmax(scale * x) over the last dimension, keys with mask[b, i, j] != 0 excluded (probability
   0). mask: uint8 [nb, sq, s] (row stride s), batch stride mask_b (0: one mask for all). A row whose keys are all
   masked becomes NaN, as torch's softmax of a row of -inf. */
void mindrl_masked_softmax_fwd(float *x, const uint8_t *mask, int64_t nb, int64_t per_b, int64_t sq, int64_t s,
                               int64_t mask_b, float scale, int nt) {
    const int64_t rows = nb * per_b * sq;
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *m = mask + (r / (per_b * sq)) * mask_b + (r % sq) * s;
        float *row = x + r * s;
        float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
        for (int64_t j = 0; j < s; j++) {
            const float v = m[j] ? -INFINITY : row[j] * scale;
            row[j] = v;
            mx = mx > v ? mx : v;
        }
        /* a row with every key masked: -inf - -inf is NaN, as torch's softmax of -inf */
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < s; j++) {
            const float e = exp_f(row[j] - mx); /* a masked key: exp(-inf) is 0 exactly */
            row[j] = e;
            sum += e;
        }
        const float inv = 1.0f / sum;
#pragma omp simd
        for (int64_t j = 0; j < s; j++) row[j] *= inv;
    }
}

/* Softmax's backward times the score scale, in place: dp [rows, s] becomes p * (dp - sum_j p dp) * scale. */
void mindrl_softmax_bwd(const float *p, float *dp, int64_t rows, int64_t s, float scale, int nt) {
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t r = 0; r < rows; r++) {
        const float *pr = p + r * s;
        float *g = dp + r * s;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t j = 0; j < s; j++) dot += g[j] * pr[j];
#pragma omp simd
        for (int64_t j = 0; j < s; j++) g[j] = pr[j] * (g[j] - dot) * scale;
    }
}

/* Log-softmax statistics of logit rows x [rows, v] (row stride xs), z = x / t - shift[r] (t = 1: x - shift[r]):
   s0[r] = sum_j exp(z), and where s2 is not NULL s2[r] = sum_j exp(z) z (the entropy's). One read of x; the sums
   are accumulated in double (a row of 8192 terms then rounds once, where fp32 lanes would lose several bits). */
void mindrl_softmax_stats(const float *x, int64_t xs, const float *shift, float *s0, float *s2, int64_t rows,
                          int64_t v, float t, int nt) {
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * xs;
        const float sh = shift[r];
        double a = 0.0, b = 0.0;
        if (t == 1.0f) {
#pragma omp simd reduction(+ : a, b)
            for (int64_t j = 0; j < v; j++) {
                float z = xr[j] - sh, e = exp_f(z);
                a += (double)e;
                b += (double)e * (double)z;
            }
        } else {
#pragma omp simd reduction(+ : a, b)
            for (int64_t j = 0; j < v; j++) {
                float z = xr[j] / t - sh, e = exp_f(z);
                a += (double)e;
                b += (double)e * (double)z;
            }
        }
        s0[r] = (float)a;
        if (s2) s2[r] = (float)b;
    }
}

/* The log-probabilities' gradient apart from the label's term: grad [rows, v] = exp(x / t - lse[r]) * ng[r]
   (ng = -dL/dlogp / t; t = 1: x - lse[r]). One read of x, one write of grad. */
void mindrl_softmax_grad(const float *x, int64_t xs, const float *lse, const float *ng, float *grad, int64_t rows,
                         int64_t v, float t, int nt) {
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * xs;
        float *o = grad + r * v;
        const float sh = lse[r], k = ng[r];
        if (t == 1.0f) {
#pragma omp simd
            for (int64_t j = 0; j < v; j++) o[j] = exp_f(xr[j] - sh) * k;
        } else {
#pragma omp simd
            for (int64_t j = 0; j < v; j++) o[j] = exp_f(xr[j] / t - sh) * k;
        }
    }
}

/* Categorical sampling from logit rows x [rows, v] (contiguous; -inf = excluded), one uniform u[r] in [0, 1) per row:
   ids[r] = the first j whose cumulative probability exceeds u[r] (inverse CDF over softmax(x), the sums in double),
   lp [rows, v] = log_softmax(x). Pass 1: the max; pass 2: e = exp(x - max) into lp and their sum; the search adds
   blocks of 64 until the block that crosses u[r] * sum, then its entries; pass 3: lp = x - logsumexp. A row without
   a finite positive sum (NaN, every entry -inf) gets ids[r] = -1 for the caller to report. */
void mindrl_sample_rows(const float *x, const double *u, float *lp, int64_t *ids, int64_t rows, int64_t v, int nt) {
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * v;
        float *o = lp + r * v;
        float m = -INFINITY;
#pragma omp simd reduction(max : m)
        for (int64_t j = 0; j < v; j++) m = xr[j] > m ? xr[j] : m;
        double s = 0.0;
#pragma omp simd reduction(+ : s)
        for (int64_t j = 0; j < v; j++) {
            const float e = exp_f(xr[j] - m); /* -inf - m: clamped to -88, which exp_f takes to 0 exactly */
            o[j] = e;
            s += (double)e;
        }
        if (!(m > -INFINITY) || !(s > 0.0) || !(s < INFINITY)) {
            ids[r] = -1;
            continue;
        }
        const double target = u[r] * s;
        double c = 0.0;
        int64_t j = 0, t = -1;
        for (; j + 64 <= v; j += 64) {
            double b = 0.0;
#pragma omp simd reduction(+ : b)
            for (int64_t k = 0; k < 64; k++) b += (double)o[j + k];
            if (c + b > target) break;
            c += b;
        }
        for (; j < v; j++) {
            c += (double)o[j];
            if (c > target && o[j] > 0.0f) {
                t = j;
                break;
            }
        }
        if (t < 0) /* rounding left the cumulative sum at or below the target: the last token with mass */
            for (j = v - 1; j >= 0 && t < 0; j--)
                if (o[j] > 0.0f) t = j;
        ids[r] = t;
        const float lse = m + (float)log(s);
#pragma omp simd
        for (int64_t k = 0; k < v; k++) o[k] = xr[k] - lse;
    }
}

/* counts[r] = #{j : x[r, j] >= values[r]} for rows of x [rows, v] (row stride xs): a sampled token's rank. */
void mindrl_count_at_least(const float *x, int64_t xs, const float *values, int64_t *counts, int64_t rows, int64_t v,
                           int nt) {
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * xs;
        const float a = values[r];
        int64_t n = 0;
#pragma omp simd reduction(+ : n)
        for (int64_t j = 0; j < v; j++) n += xr[j] >= a;
        counts[r] = n;
    }
}
/* ---- A GEMM for a rollout engine's linear layers: out [m, n] = x [m, k] @ w^T + bias, w [n, k] a layer's weight,
   packed once per weight load into panels of GEMM_NR outputs (k steps of GEMM_NR contiguous floats). A tile is
   GEMM_MR rows x GEMM_NR outputs held in registers over all of k: per k step two vector loads of the panel, one
   broadcast per row and 2 x GEMM_MR FMAs. Work items are (row block, panel) pairs split between the threads; a row
   block is every row where x's rows fit 512 KiB (a decode step's batch: each panel is read once, by one thread),
   else 128 KiB of them. While a thread computes an item, it prefetches the next item's panel a little per k step:
   at 64 rows the weights of a decode step come from L3 or memory, and oneDNN's kernel (vLLM-CPU's) waits for them.
   Vector intrinsics for AVX-512 and AVX2 + FMA (what -march gives), GCC vectors elsewhere. */
#if defined(__AVX512F__)
#define GEMM_VL 16
#define GEMM_MR 8
typedef __m512 gvec;
#define G_LOAD(p) _mm512_load_ps(p)
#define G_LOADU(p) _mm512_loadu_ps(p)
#define G_SET1(x) _mm512_set1_ps(x)
#define G_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define G_ADD(a, b) _mm512_add_ps(a, b)
#define G_STOREU(p, v) _mm512_storeu_ps(p, v)
#define G_ZERO() _mm512_setzero_ps()
#elif defined(__AVX2__) && defined(__FMA__)
#define GEMM_VL 8
#define GEMM_MR 6
typedef __m256 gvec;
#define G_LOAD(p) _mm256_load_ps(p)
#define G_LOADU(p) _mm256_loadu_ps(p)
#define G_SET1(x) _mm256_set1_ps(x)
#define G_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define G_ADD(a, b) _mm256_add_ps(a, b)
#define G_STOREU(p, v) _mm256_storeu_ps(p, v)
#define G_ZERO() _mm256_setzero_ps()
#else
#define GEMM_VL 4
#define GEMM_MR 4
typedef float gvec __attribute__((vector_size(16)));
static inline gvec g_loadu(const float *p) {
    gvec v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline void g_storeu(float *p, gvec v) { memcpy(p, &v, sizeof v); }
#define G_LOAD(p) g_loadu(p)
#define G_LOADU(p) g_loadu(p)
#define G_SET1(x) ((gvec){0.0f, 0.0f, 0.0f, 0.0f} + (x))
#define G_FMA(a, b, c) ((a) * (b) + (c))
#define G_ADD(a, b) ((a) + (b))
#define G_STOREU(p, v) g_storeu(p, v)
#define G_ZERO() ((gvec){0.0f, 0.0f, 0.0f, 0.0f})
#endif
#define GEMM_NR (2 * GEMM_VL)

int mindrl_gemm_panel(void) { return GEMM_NR; }

/* w [n, k] -> packed[(p * k + kk) * GEMM_NR + j] = w[p * GEMM_NR + j, kk], zero past n. */
void mindrl_gemm_pack(const float *w, float *packed, int64_t n, int64_t k, int nt) {
    const int64_t panels = (n + GEMM_NR - 1) / GEMM_NR;
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t p = 0; p < panels; p++) {
        float *dst = packed + p * k * GEMM_NR;
        for (int j = 0; j < GEMM_NR; j++) {
            const int64_t row = p * GEMM_NR + j;
            if (row < n) {
                const float *src = w + row * k;
                for (int64_t kk = 0; kk < k; kk++) dst[kk * GEMM_NR + j] = src[kk];
            } else {
                for (int64_t kk = 0; kk < k; kk++) dst[kk * GEMM_NR + j] = 0.0f;
            }
        }
    }
}

/* out[r, :nv] = x[r, :k] . the panel's nv outputs (+ bias[:nv]) for r < mr (<= GEMM_MR); pf: pfn bytes of the next
   panel prefetched per k step (NULL: none). Inlined with mr constant for full tiles. */
static inline __attribute__((always_inline)) void gemm_tile(int mr, const float *x, int64_t ldx, const float *pw,
                                                            int64_t k, const float *bias, float *out, int64_t ldo,
                                                            int nv, const char *pf, int64_t pfn) {
    gvec acc[GEMM_MR][2];
#pragma GCC unroll 8
    for (int r = 0; r < GEMM_MR; r++) acc[r][0] = acc[r][1] = G_ZERO();
    for (int64_t kk = 0; kk < k; kk++) {
        const gvec w0 = G_LOAD(pw + kk * GEMM_NR), w1 = G_LOAD(pw + kk * GEMM_NR + GEMM_VL);
        if (pf) __builtin_prefetch(pf + kk * pfn, 0, 3);
#pragma GCC unroll 8
        for (int r = 0; r < GEMM_MR; r++) {
            if (r < mr) {
                const gvec xv = G_SET1(x[r * ldx + kk]);
                acc[r][0] = G_FMA(xv, w0, acc[r][0]);
                acc[r][1] = G_FMA(xv, w1, acc[r][1]);
            }
        }
    }
    float tmp[GEMM_NR];
#pragma GCC unroll 8
    for (int r = 0; r < GEMM_MR; r++) {
        if (r >= mr) continue;
        if (nv == GEMM_NR) {
            gvec a0 = acc[r][0], a1 = acc[r][1];
            if (bias) {
                a0 = G_ADD(a0, G_LOADU(bias));
                a1 = G_ADD(a1, G_LOADU(bias + GEMM_VL));
            }
            G_STOREU(out + r * ldo, a0);
            G_STOREU(out + r * ldo + GEMM_VL, a1);
        } else { /* the last panel: nv valid outputs */
            G_STOREU(tmp, acc[r][0]);
            G_STOREU(tmp + GEMM_VL, acc[r][1]);
            for (int j = 0; j < nv; j++) out[r * ldo + j] = bias ? tmp[j] + bias[j] : tmp[j];
        }
    }
}

/* out [m, n] (row stride ldo) = x [m, k] (row stride ldx) @ w^T + bias (n floats, or NULL); w packed by
   mindrl_gemm_pack (64-byte aligned). */
void mindrl_gemm(const float *x, int64_t ldx, const float *packed, const float *bias, float *out, int64_t ldo,
                 int64_t m, int64_t n, int64_t k, int nt) {
    const int64_t panels = (n + GEMM_NR - 1) / GEMM_NR;
    const int64_t row_bytes = k * (int64_t)sizeof(float);
    int64_t mb = m * row_bytes <= (512 << 10) ? m : (128 << 10) / (row_bytes > 0 ? row_bytes : 1);
    mb = (mb + GEMM_MR - 1) / GEMM_MR * GEMM_MR;
    if (mb < GEMM_MR) mb = GEMM_MR;
    const int64_t items = (m + mb - 1) / mb * panels;
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t it = 0; it < items; it++) {
        const int64_t b = it / panels, p = it % panels;
        const int64_t r0 = b * mb, r1 = r0 + mb < m ? r0 + mb : m;
        const float *pw = packed + p * k * GEMM_NR;
        const float *bp = bias ? bias + p * GEMM_NR : NULL;
        const int nv = (int)(n - p * GEMM_NR < GEMM_NR ? n - p * GEMM_NR : GEMM_NR);
        const int64_t tiles = (r1 - r0 + GEMM_MR - 1) / GEMM_MR;
        /* the next item's panel, a slice per tile: pfn bytes per k step */
        const char *next = it + 1 < items ? (const char *)(packed + ((it + 1) % panels) * k * GEMM_NR) : NULL;
        const int64_t pfn = (GEMM_NR * (int64_t)sizeof(float) + tiles - 1) / tiles;
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t r = r0 + t * GEMM_MR;
            const int mr = (int)(r1 - r < GEMM_MR ? r1 - r : GEMM_MR);
            const char *pf = next ? next + t * k * pfn : NULL;
            if (mr == GEMM_MR)
                gemm_tile(GEMM_MR, x + r * ldx, ldx, pw, k, bp, out + r * ldo + p * GEMM_NR, ldo, nv, pf, pfn);
            else
                gemm_tile(mr, x + r * ldx, ldx, pw, k, bp, out + r * ldo + p * GEMM_NR, ldo, nv, pf, pfn);
        }
    }
}
