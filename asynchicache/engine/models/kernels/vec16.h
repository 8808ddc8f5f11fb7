/* 16-lane float32 vectors for the native kernels (GCC's vector extension: one
 * AVX-512 instruction per operation, or two AVX2 or four NEON ones), and the few
 * operations on them that the kernels share: loads and stores at any alignment,
 * lane selection, exp, and horizontal max and sum. */

#ifndef ASYNCHICACHE_VEC16_H
#define ASYNCHICACHE_VEC16_H

#include <stdint.h>

#define LANES 16
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));
typedef int32_t i16 __attribute__((vector_size(64)));

static inline v16 vload(const float *p) { return *(const v16u *)p; }
static inline void vstore(float *p, v16 v) { *(v16u *)p = v; }
static inline v16 vsplat(float x) {
    v16 z = {0};
    return z + x;
}
static inline v16 vselect(i16 mask, v16 a, v16 b) { /* mask lanes -1: a, 0: b */
    return (v16)(((i16)a & mask) | ((i16)b & ~mask));
}

/* exp(x) lane-wise for x <= 0 (a score less the running max); below -87 gives ~0. */
static inline v16 vexp(v16 x) {
    const v16 lo = vsplat(-87.0f);
    x = vselect(x < lo, lo, x);
    v16 fx = x * 1.44269504088896341f;
    i16 n = __builtin_convertvector(fx, i16); /* truncation toward zero */
    v16 nf = __builtin_convertvector(n, v16);
    i16 over = nf > fx; /* floor for negatives */
    n = n + over;       /* -1 where truncation rounded up */
    nf = __builtin_convertvector(n, v16);
    x = x - nf * 0.693359375f - nf * -2.12194440e-4f;
    v16 y = vsplat(1.9875691500E-4f);
    y = y * x + 1.3981999507E-3f;
    y = y * x + 8.3334519073E-3f;
    y = y * x + 4.1665795894E-2f;
    y = y * x + 1.6666665459E-1f;
    y = y * x + 5.0000001201E-1f;
    y = y * x * x + x + 1.0f;
    i16 bits = (n + 127) << 23;
    return y * (v16)bits;
}

static inline v16 vmax(v16 a, v16 b) { return vselect(a > b, a, b); }

/* Whether any lane of a comparison's mask is set (an OR tree of shuffles). */
static inline int any_lane(i16 v) {
    v |= __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v |= __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    v |= __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    v |= __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    return v[0] != 0;
}

/* Horizontal max and sum as trees of shuffles (a serial chain of 16 would cost more
 * than the 16 scores it reduces). */
static inline float hmax(v16 v) {
    v = vmax(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
    v = vmax(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
    v = vmax(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
    v = vmax(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
    return v[0];
}

static inline float hsum(v16 v) {
    v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    return v[0];
}

#endif
