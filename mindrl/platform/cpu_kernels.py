"""Fused elementwise kernels for fp32 training on CPU: SwiGLU, RMSNorm and RoPE, forward and backward; attention's
masked softmax and its backward; the log-probabilities' softmax statistics and gradient. For the CPU rollout engine
(`mindrl.rollout.vllm_ops`): the sampling step, and a GEMM for its linear layers (weights packed into panels; tiles
that prefetch the next panel while they compute, so that a decode step's weights, read once per step at 64 rows, do
not stall it; AVX-512 or AVX2 intrinsics where -march has them).

On a CPU the actor update's GEMMs run near the matmul peak (MKL / oneDNN), and what is left is elementwise work that
torch runs as one pass over memory per op: SwiGLU's backward alone is four passes (a product, silu's backward, silu
recomputed, a product) plus a fresh tensor, RMSNorm's backward five, RoPE six. Each kernel here does its op in one
pass: a loop over rows that OpenMP splits between the threads, vectorised by the compiler (RMSNorm's forward: a
sum of squares and one pass writing y and the output, where torch's decomposition writes x^2, reads it back, then
multiplies twice).

They are C, compiled once per machine with the host's C compiler (`$CC`, else `cc` or `gcc`; `-O3 -march=native`)
into mindrl's cache directory (`native_build.cache_dir()`), under a name that carries a hash of the source, the flags,
the compiler and the CPU's model and flags (a cache shared by other machines never runs another CPU's build). The
library is linked against the OpenMP runtime torch itself loaded, so the kernels use torch's thread pool and its
thread count (`torch.get_num_threads()`), not a second pool spinning against it. Where there is no compiler, no
OpenMP runtime in torch, or the build or the load fails, `load()` returns None (with a warning saying why) and
mindrl's torch-op forms run instead (`mindrl.models.fused`); MINDRL_CPU_KERNELS=0 turns the kernels off.

Accuracy: `exp` is computed in the kernels (Cody-Waite range reduction, a degree-7 polynomial, the exponent set in
the bits): SiLU's forward and backward are within the same distance of the fp64 values as torch's own kernels
(tests/platform/test_cpu_kernels.py), not bit-identical to them. RoPE and RMSNorm do the same products and sums as
the torch forms, built without contraction into FMAs (`-ffp-contract=off`): RoPE is bit-identical to megatron's
unfused form; RMSNorm's reductions (the sum of squares, the backward's dot products) add in another order, so its
values differ from torch's in the last bits, as close to the fp64 ones. The attention softmax and its backward are as
close to the fp64 values as torch's masked_fill + softmax and softmax backward; the log-probs' sums of exp(z) are
accumulated in double, closer to the fp64 sums than torch's fp32 reductions.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform as _platform
import subprocess
import warnings

import torch

from mindrl.platform.detect import env_switch
from mindrl.platform.native_build import c_compiler, cache_dir, compile_library, failure_detail

ENV = "MINDRL_CPU_KERNELS"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off")
# -z defs: a compiler whose OpenMP calls another runtime (clang's __kmpc_*) fails to link, instead of at load
LINK = ("-lm", "-Wl,-z,defs")

SOURCE = r"""
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
"""

_P, _I, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "mindrl_swiglu_fwd": ([_P, _P, _I, _I, _INT], None),
    "mindrl_swiglu_bwd": ([_P, _P, _P, _I, _I, _INT], None),
    "mindrl_rms_norm_fwd": ([_P, _P, _P, _P, _P, _I, _I, ctypes.c_float, _INT], None),
    "mindrl_rms_norm_bwd": ([_P, _P, _P, _P, _P, _P, _I, _I, _INT], _INT),
    "mindrl_rope": ([_P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _I, _INT, _INT], None),
    "mindrl_masked_softmax_fwd": ([_P, _P, _I, _I, _I, _I, _I, ctypes.c_float, _INT], None),
    "mindrl_softmax_bwd": ([_P, _P, _I, _I, ctypes.c_float, _INT], None),
    "mindrl_softmax_stats": ([_P, _I, _P, _P, _P, _I, _I, ctypes.c_float, _INT], None),
    "mindrl_softmax_grad": ([_P, _I, _P, _P, _P, _I, _I, ctypes.c_float, _INT], None),
    "mindrl_sample_rows": ([_P, _P, _P, _P, _I, _I, _INT], None),
    "mindrl_count_at_least": ([_P, _I, _P, _P, _I, _I, _INT], None),
    "mindrl_gemm_panel": ([], _INT),
    "mindrl_gemm_pack": ([_P, _P, _I, _I, _INT], None),
    "mindrl_gemm": ([_P, _I, _P, _P, _P, _I, _I, _I, _I, _INT], None),
}


def enabled() -> bool:
    """Whether the kernels may be used (MINDRL_CPU_KERNELS, `env_switch`)."""
    return env_switch(ENV)


def torch_openmp_runtime() -> str | None:
    """The path of the OpenMP runtime (libgomp) this process loaded for torch, None where torch has none."""
    if not torch.backends.openmp.is_available():
        return None
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/libgomp" in line}
    except OSError:
        return None
    own = [p for p in paths if p.startswith(os.path.dirname(torch.__file__))]
    found = own or sorted(paths)
    return found[0] if found else None


def _cpu_identity() -> str:
    """The CPU's model name and feature flags (what -march=native compiles for)."""
    keep = []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags")):
                    keep.append(line.strip())
                if len(keep) == 2:
                    break
    except OSError:
        pass
    return "\n".join(keep) or _platform.processor()


def build(directory: str, march: str = "native") -> str | None:
    """The kernels' shared library in `directory`, compiled there unless this source, flags, compiler and CPU have
    one already; None (with a warning) where it cannot be built. `march` other than "native" (e.g. "x86-64-v3", AVX2)
    builds for that target, for tests."""
    gomp = torch_openmp_runtime()
    compiler = c_compiler()
    if gomp is None or compiler is None:
        why = "torch has no OpenMP runtime loaded" if gomp is None else "no C compiler ($CC, cc or gcc)"
        warnings.warn(f"mindrl: CPU kernels not built ({why}): the torch-op forms run instead", stacklevel=2)
        return None
    flags = [f if f != "-march=native" else f"-march={march}" for f in FLAGS]
    key = hashlib.sha256("\n".join([SOURCE, *flags, *LINK, os.path.realpath(compiler), gomp, _cpu_identity()]).encode())
    path = os.path.join(directory, f"libmindrl_cpu_kernels_{key.hexdigest()[:16]}.so")
    if os.path.isfile(path):
        return path
    try:
        compile_library(compiler, SOURCE, path, flags, [gomp, *LINK, f"-Wl,-rpath,{os.path.dirname(gomp)}"])
    except (OSError, subprocess.CalledProcessError) as e:
        warnings.warn(
            f"mindrl: could not build the CPU kernels into {path} with {compiler}: {e} {failure_detail(e)}; the "
            f"torch-op forms run instead ({ENV}=0 silences this)",
            stacklevel=2,
        )
        return None
    return path


class Kernels:
    """The loaded library, with torch-level calls. Each takes fp32 host tensors (see `takes`)."""

    def __init__(self, path: str):
        self.path = path
        lib = ctypes.CDLL(path)
        for name, (args, res) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, res
        self._lib = lib
        self._panel = lib.mindrl_gemm_panel()  # the GEMM's packed panel width (outputs), fixed by the build

    @staticmethod
    def takes(*tensors: torch.Tensor) -> bool:
        """Whether the kernels cover these tensors: fp32, in host memory, not needing autograd's graph here."""
        return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)

    def swiglu_forward(self, x: torch.Tensor) -> torch.Tensor:
        """silu(a) * b for x = [a, b] on the last dimension."""
        x = x.contiguous()
        half = x.shape[-1] // 2
        out = torch.empty(x.shape[:-1] + (half,), dtype=x.dtype)
        self._lib.mindrl_swiglu_fwd(x.data_ptr(), out.data_ptr(), x.numel() // max(1, 2 * half), half, _threads())
        return out

    def swiglu_backward(self, x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """The gradient of swiglu_forward at x, for the output's gradient `grad`."""
        x, grad = x.contiguous(), grad.contiguous()
        half = x.shape[-1] // 2
        dx = torch.empty(x.shape, dtype=x.dtype)
        rows = x.numel() // max(1, 2 * half)
        self._lib.mindrl_swiglu_bwd(x.data_ptr(), grad.data_ptr(), dx.data_ptr(), rows, half, _threads())
        return dx

    def rms_norm_forward(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(weight * y, y, rstd) with y = x * rstd, rstd = 1 / sqrt(mean(x^2, last dim) + eps) of shape [..., 1]
        (what torch's `_fused_rms_norm` returns, the sum of squares in another order)."""
        x, weight = x.contiguous(), weight.contiguous()
        hidden = x.shape[-1]
        y, out = torch.empty(x.shape, dtype=torch.float32), torch.empty(x.shape, dtype=torch.float32)
        rstd = torch.empty(x.shape[:-1] + (1,), dtype=torch.float32)
        self._lib.mindrl_rms_norm_fwd(
            x.data_ptr(), weight.data_ptr(), y.data_ptr(), out.data_ptr(), rstd.data_ptr(),
            x.numel() // max(1, hidden), hidden, eps, _threads(),
        )  # fmt: skip
        return out, y, rstd

    def rms_norm_backward(
        self,
        grad: torch.Tensor,
        y: torch.Tensor,
        rstd: torch.Tensor,
        weight: torch.Tensor,
        need_dx: bool,
        need_dw: bool,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(dx, dw) of out = weight * y, y = x * rstd (rows of y's last dimension); None where not needed."""
        grad, y, rstd, weight = grad.contiguous(), y.contiguous(), rstd.contiguous(), weight.contiguous()
        hidden = y.shape[-1]
        dx = torch.empty(y.shape, dtype=torch.float32) if need_dx else None
        dw = torch.empty(hidden, dtype=torch.float32) if need_dw else None
        status = self._lib.mindrl_rms_norm_bwd(
            grad.data_ptr(), y.data_ptr(), rstd.data_ptr(), weight.data_ptr(),
            dx.data_ptr() if dx is not None else None, dw.data_ptr() if dw is not None else None,
            y.numel() // max(1, hidden), hidden, _threads(),
        )  # fmt: skip
        if status:
            raise MemoryError(f"mindrl_rms_norm_bwd could not allocate {_threads()} x {hidden} floats")
        return dx, dw

    def rope(self, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: int) -> torch.Tensor | None:
        """RoPE (sign 1) or its transpose (sign -1) of t [s, b, heads, dim] with cos / sin [s, 1, 1, half] (see
        `mindrl.models.fused._rotate`); None where the shapes are not that layout (the caller's form runs)."""
        if t.dim() != 4 or t.stride(-1) != 1 or cos.dim() != 4:
            return None
        s, b, heads, dim = t.shape
        half = cos.shape[-1]
        if cos.shape != (s, 1, 1, half) or sin.shape != cos.shape or 2 * half > dim:
            return None
        cos, sin = cos.reshape(s, half).contiguous(), sin.reshape(s, half).contiguous()
        out = torch.empty(t.shape, dtype=t.dtype)
        self._lib.mindrl_rope(
            t.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), s, b, heads, dim, half,
            t.stride(0), t.stride(1), t.stride(2), 1 if sign > 0 else -1, _threads(),
        )  # fmt: skip
        return out

    def masked_softmax_(self, scores: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor | None:
        """In place: scores [n, rows_per_b, sq, s] (contiguous) become softmax(scale * scores) over the last
        dimension with the keys where mask [n, 1, sq, s] (bool, True = masked; a stride-0 batch dimension allowed)
        is set excluded; a row with every key masked becomes NaN, as torch's softmax of -inf. None where the layouts
        are not these (the caller's torch ops run)."""
        n, per_b, sq, s = scores.shape
        ok = scores.is_contiguous() and mask.dtype == torch.bool and mask.dim() == 4 and mask.shape == (n, 1, sq, s)
        if not ok or (sq > 1 and mask.stride(2) != s) or (s > 1 and mask.stride(3) != 1):
            return None
        self._lib.mindrl_masked_softmax_fwd(
            scores.data_ptr(), mask.data_ptr(), n, per_b, sq, s, mask.stride(0) if n > 1 else 0, scale, _threads()
        )
        return scores

    def softmax_backward_(self, probs: torch.Tensor, grad: torch.Tensor, scale: float) -> torch.Tensor:
        """In place: grad (the probabilities' gradient) becomes the scores' gradient, probs * (grad - sum(grad *
        probs)) * scale over the last dimension. Both contiguous, the same shape."""
        probs, s = probs.contiguous(), probs.shape[-1]
        assert grad.is_contiguous() and grad.shape == probs.shape
        self._lib.mindrl_softmax_bwd(probs.data_ptr(), grad.data_ptr(), probs.numel() // max(1, s), s, scale,
                                     _threads())  # fmt: skip
        return grad

    def softmax_stats(
        self, x: torch.Tensor, shift: torch.Tensor, temperature: float, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(sum exp(z), sum exp(z) z or None) per row of x [rows, v] (fp32, last dimension contiguous), z = x /
        temperature - shift (one value per row), in one read of x."""
        rows, v = x.shape
        shift = shift.contiguous()
        s0 = torch.empty(rows, dtype=torch.float32)
        s2 = torch.empty(rows, dtype=torch.float32) if with_entropy else None
        self._lib.mindrl_softmax_stats(
            x.data_ptr(), x.stride(0), shift.data_ptr(), s0.data_ptr(), s2.data_ptr() if s2 is not None else None,
            rows, v, temperature, _threads(),
        )  # fmt: skip
        return s0, s2

    def softmax_grad(
        self, x: torch.Tensor, lse: torch.Tensor, neg_grad: torch.Tensor, temperature: float
    ) -> torch.Tensor:
        """exp(x / temperature - lse) * neg_grad (lse, neg_grad: one value per row) for x [rows, v] (fp32, last
        dimension contiguous): the log-probabilities' gradient before the label's term, one read and one write."""
        rows, v = x.shape
        lse, neg_grad = lse.contiguous(), neg_grad.contiguous()
        grad = torch.empty(rows, v, dtype=torch.float32)
        self._lib.mindrl_softmax_grad(
            x.data_ptr(), x.stride(0), lse.data_ptr(), neg_grad.data_ptr(), grad.data_ptr(), rows, v, temperature,
            _threads(),
        )  # fmt: skip
        return grad

    def sample_rows(self, logits: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [rows] int64, log_softmax(logits)) for logit rows [rows, v] (fp32; -inf excludes a token) and one
        uniform in [0, 1) per row (fp64): each row's token drawn by inverse CDF from softmax(logits). A row with no
        finite positive probability mass (a NaN, or every entry -inf) raises ValueError naming it."""
        logits, uniforms = logits.contiguous(), uniforms.to(torch.float64).contiguous()
        rows, v = logits.shape
        assert uniforms.shape == (rows,), (uniforms.shape, rows)
        ids = torch.empty(rows, dtype=torch.int64)
        logprobs = torch.empty(rows, v, dtype=torch.float32)
        self._lib.mindrl_sample_rows(
            logits.data_ptr(), uniforms.data_ptr(), logprobs.data_ptr(), ids.data_ptr(), rows, v, _threads()
        )
        bad = (ids < 0).nonzero()
        if len(bad):
            r = int(bad[0])
            raise ValueError(
                f"cannot sample row {r} of {rows}: its logits have no finite probability mass (NaN or every token "
                f"excluded; max {logits[r].max().item()}, NaNs {int(logits[r].isnan().sum())})"
            )
        return ids, logprobs

    def count_at_least(self, x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """(x >= values).sum(-1) for x [rows, v] (fp32, last dimension contiguous) and values [rows, 1] or [rows],
        int64, in one read of x without a boolean tensor."""
        rows, v = x.shape
        values = values.reshape(rows).to(torch.float32).contiguous()
        counts = torch.empty(rows, dtype=torch.int64)
        self._lib.mindrl_count_at_least(
            x.data_ptr(), x.stride(0), values.data_ptr(), counts.data_ptr(), rows, v, _threads()
        )
        return counts

    def gemm_pack(self, weight: torch.Tensor) -> torch.Tensor:
        """A linear layer's weight [n, k] (fp32) in the layout `gemm` reads: panels of the build's width of outputs,
        k steps of them each (zero past n), 64-byte aligned. A copy: later changes to the weight are not seen."""
        n, k = weight.shape
        weight = weight.contiguous()
        nr = self._panel
        packed = torch.empty((n + nr - 1) // nr * nr * k, dtype=torch.float32)
        if packed.data_ptr() % 64:  # torch's host allocations are 64-byte aligned; the kernel's panel loads rely on it
            raise RuntimeError(
                f"gemm_pack: a {packed.numel()}-float buffer at {packed.data_ptr():#x} is not 64-byte aligned"
            )
        self._lib.mindrl_gemm_pack(weight.data_ptr(), packed.data_ptr(), n, k, _threads())
        return packed

    def gemm(self, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., k] @ w^T + bias -> [..., n] (fp32) for w [n, k] packed by `gemm_pack` (so `packed` holds ceil(n /
        panel) * panel * k floats) and bias [n] or None."""
        k = x.shape[-1]
        rows = x.reshape(-1, k) if x.dim() != 2 else x
        if rows.stride(-1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < k):
            rows = rows.contiguous()
        nr = self._panel
        if packed.numel() != (n + nr - 1) // nr * nr * k:
            raise ValueError(
                f"gemm: packed weight of {packed.numel()} floats is not one of [{n}, {k}] ({nr}-wide panels)"
            )
        if bias is not None:
            bias = bias.contiguous()
            if bias.numel() != n:
                raise ValueError(f"gemm: bias of {bias.numel()} floats for {n} outputs")
        m = rows.shape[0]
        out = torch.empty(m, n, dtype=torch.float32)
        self._lib.mindrl_gemm(
            rows.data_ptr(), rows.stride(0) if m > 1 else k, packed.data_ptr(),
            bias.data_ptr() if bias is not None else None, out.data_ptr(), n, m, n, k, _threads(),
        )  # fmt: skip
        return out.reshape(*x.shape[:-1], n)


def _threads() -> int:
    return max(1, torch.get_num_threads())


@functools.cache
def _load(march: str) -> Kernels | None:
    path = build(cache_dir(), march)
    if path is None:
        return None
    try:
        return Kernels(path)
    except (OSError, AttributeError) as e:  # a library this process cannot load, or one without every kernel
        warnings.warn(
            f"mindrl: could not load the CPU kernels {path}: {e}; the torch-op forms run instead", stacklevel=2
        )
        return None


def load(march: str = "native") -> Kernels | None:
    """This process's kernels (built on first use), or None where they are off or cannot be built."""
    if not enabled():
        return None
    return _load(march)
