/* The row-wise steps of a decoder layer, one pass over each token's row.
 *
 * Built into one library with paged_attention.c (model/native.py) and called
 * through ctypes by model/row_ops.py. Torch runs each of these steps as several
 * whole-tensor passes (an RMSNorm is a norm, a multiply by its inverse and one by the
 * weight, each reading and writing [tokens, hidden]; SiLU and the multiply by `up` write
 * a [tokens, intermediate] temporary between them); a long prompt's rows then leave the
 * caches between passes. Here each row is read once and written once while it sits in L1.
 *
 * Float32; any width (a tail shorter than LANES goes lane by lane). Each function does rows
 * [r0, r1): threads share a call by rows. Strides are in floats.
 *
 * Numerics follow the reference (Hugging Face's Llama): RMSNorm in float32, the mean of
 * squares then 1 / sqrt(mean + eps), x times it, then times the weight; SiLU as
 * x / (1 + exp(-x)); rotary as "rotate half" (x1 cos - x2 sin, x2 cos + x1 sin). The sums
 * are ordered differently from torch's (last bits: NATIVE_NUMERICS_VERSION).
 */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec.h"

/* Sum of squares of n floats: LANES accumulators, then a tree. */
static inline float sum_squares(const float *x, int64_t n) {
    vf acc = vsplat(0.0f);
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        const vf v = vload(x + i);
        acc += v * v;
    }
    float s = hsum(acc);
    for (; i < n; i++) s += x[i] * x[i];
    return s;
}

/* out = x / rms(x) * w for one row of n. */
static inline void norm_row(const float *x, const float *w, float *out, int64_t n, float eps) {
    const float inv = 1.0f / sqrtf(sum_squares(x, n) / (float)n + eps);
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) vstore(out + i, (vload(x + i) * inv) * vload(w + i));
    for (; i < n; i++) out[i] = (x[i] * inv) * w[i];
}

/* out[r] = RMSNorm(x[r]) * w. */
void rms_norm_f32(const float *x, int64_t x_stride, const float *w, float *out,
                  int64_t out_stride, int64_t n, float eps, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) norm_row(x + r * x_stride, w, out + r * out_stride, n, eps);
}

/* res[r] += delta[r] (the residual stream, in place), then out[r] = RMSNorm(res[r]) * w. */
void add_rms_norm_f32(float *res, int64_t res_stride, const float *delta, int64_t delta_stride,
                      const float *w, float *out, int64_t out_stride, int64_t n, float eps,
                      int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
        float *x = res + r * res_stride;
        const float *d = delta + r * delta_stride;
        int64_t i = 0;
        for (; i + LANES <= n; i += LANES) vstore(x + i, vload(x + i) + vload(d + i));
        for (; i < n; i++) x[i] += d[i];
        norm_row(x, w, out + r * out_stride, n, eps);
    }
}

/* exp(x) for any x: the shared vexp (exact down to -87) with its input kept below the
 * float range's top (exp(88.7) overflows). */
static inline vf vexp_any(vf x) {
    const vf hi = vsplat(88.0f);
    return vexp(vselect(x > hi, hi, x));
}

/* out[r][i] = silu(gu[r][i]) * gu[r][n + i]: gate and up side by side in one row of 2n. */
void silu_mul_f32(const float *gu, int64_t gu_stride, float *out, int64_t out_stride, int64_t n,
                  int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
        const float *g = gu + r * gu_stride, *u = g + n;
        float *o = out + r * out_stride;
        int64_t i = 0;
        for (; i + LANES <= n; i += LANES) {
            const vf x = vload(g + i);
            vstore(o + i, x / (1.0f + vexp_any(-x)) * vload(u + i));
        }
        for (; i < n; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* Rotate `heads` vectors of head_dim in each row of x in place ("rotate half"): the first
 * half x1 and the second x2 become x1 cos - x2 sin and x2 cos + x1 sin, with the row's
 * cos/sin [head_dim / 2] (rows cs_stride apart). */
void rotary_f32(float *x, int64_t x_stride, int64_t heads, int64_t head_dim, const float *cos_,
                const float *sin_, int64_t cs_stride, int64_t r0, int64_t r1) {
    const int64_t half = head_dim / 2;
    for (int64_t r = r0; r < r1; r++) {
        const float *c = cos_ + r * cs_stride, *s = sin_ + r * cs_stride;
        for (int64_t h = 0; h < heads; h++) {
            float *x1 = x + r * x_stride + h * head_dim, *x2 = x1 + half;
            int64_t i = 0;
            for (; i + LANES <= half; i += LANES) {
                const vf a = vload(x1 + i), b = vload(x2 + i);
                const vf cv = vload(c + i), sv = vload(s + i);
                vstore(x1 + i, a * cv - b * sv);
                vstore(x2 + i, b * cv + a * sv);
            }
            for (; i < half; i++) {
                const float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[i] + a * s[i];
            }
        }
    }
}

/* Copy token rows of n floats (src, src_stride apart) to their slots in a pool: row r goes
 * to base + pages[r] * page_stride + offsets[r] * slot_stride (a layer's K or V view). */
void scatter_rows_f32(float *base, int64_t page_stride, int64_t slot_stride, const float *src,
                      int64_t src_stride, int64_t n, const int64_t *pages, const int64_t *offsets,
                      int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++)
        memcpy(base + pages[r] * page_stride + offsets[r] * slot_stride, src + r * src_stride,
               sizeof(float) * (size_t)n);
}

/* The vector bytes this library was built for (native.py checks them on load), and its
 * lanes (they order the sums: the pages' numerics version). */
int32_t kernel_vector_bytes(void) { return VEC_BYTES; }
int32_t kernel_lanes(void) { return LANES; }
