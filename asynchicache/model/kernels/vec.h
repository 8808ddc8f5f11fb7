/* Float32 vectors for the native kernels (GCC's vector extension), as wide as the
 * hardware's: 16 lanes (one AVX-512 register) where the build targets AVX-512, 8 (one
 * AVX2 register) where it targets AVX2, and 16 elsewhere (two or four instructions an
 * operation, as NEON). A vector wider than the hardware's is not split into registers
 * by GCC: its comparisons and shuffles go lane by lane through memory (an AVX2 build of
 * 16-lane code ran attention ~100x slower than AVX-512). The few operations the kernels
 * share: loads and stores at any alignment, lane selection, exp, and horizontal max and
 * sum as trees. The lane count orders the sums (chunks of LANES keys, trees of LANES):
 * the two widths give other last bits, so native.py names their pages apart
 * (NATIVE_NUMERICS_VERSION and NATIVE8_NUMERICS_VERSION in common/keys.py). */

#ifndef ASYNCHICACHE_VEC_H
#define ASYNCHICACHE_VEC_H

#include <stdint.h>

/* The hardware vector the compiler targets, in bytes. */
#if defined(__AVX512F__)
#define VEC_BYTES 64
#elif defined(__AVX2__) && defined(__FMA__)
#define VEC_BYTES 32
#elif defined(__ARM_NEON) || defined(__SSE2__)
#define VEC_BYTES 16
#else
#define VEC_BYTES 0
#endif
/* native.py passes the width it asked for: a compiler that did not target it (an old one
 * that ignores -march=x86-64-v4, a flag lost on the way) fails the build here instead of
 * lowering the vectors to narrower or scalar code that runs many times slower. */
#if defined(VEC_EXPECT) && VEC_EXPECT != VEC_BYTES
#error "the kernels were not built for the vector width asked for (VEC_EXPECT)"
#endif

#if VEC_BYTES == 32
#define LANES 8
#else
#define LANES 16
#endif

typedef float vf __attribute__((vector_size(4 * LANES)));
typedef float vfu __attribute__((vector_size(4 * LANES), aligned(4)));
typedef int32_t vi __attribute__((vector_size(4 * LANES)));

static inline vf vload(const float *p) { return *(const vfu *)p; }
static inline void vstore(float *p, vf v) { *(vfu *)p = v; }
static inline vf vsplat(float x) {
    vf z = {0};
    return z + x;
}
static inline vf vselect(vi mask, vf a, vf b) { /* mask lanes -1: a, 0: b */
    return (vf)(((vi)a & mask) | ((vi)b & ~mask));
}

/* exp(x) lane-wise for x <= 0 (a score less the running max); below -87 gives ~0. */
static inline vf vexp(vf x) {
    const vf lo = vsplat(-87.0f);
    x = vselect(x < lo, lo, x);
    vf fx = x * 1.44269504088896341f;
    vi n = __builtin_convertvector(fx, vi); /* truncation toward zero */
    vf nf = __builtin_convertvector(n, vf);
    vi over = nf > fx; /* floor for negatives */
    n = n + over;      /* -1 where truncation rounded up */
    nf = __builtin_convertvector(n, vf);
    x = x - nf * 0.693359375f - nf * -2.12194440e-4f;
    vf y = vsplat(1.9875691500E-4f);
    y = y * x + 1.3981999507E-3f;
    y = y * x + 8.3334519073E-3f;
    y = y * x + 4.1665795894E-2f;
    y = y * x + 1.6666665459E-1f;
    y = y * x + 5.0000001201E-1f;
    y = y * x * x + x + 1.0f;
    vi bits = (n + 127) << 23;
    return y * (vf)bits;
}

static inline vf vmax(vf a, vf b) { return vselect(a > b, a, b); }

/* Each lane with its partner `d` lanes away (d = LANES / 2, ..., 1): one level of a tree
 * that reduces a vector's lanes (a serial chain would cost more than what it reduces). */
#if LANES == 16
#define SWAP8(v) __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7)
#define SWAP4(v) __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11)
#define SWAP2(v) __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13)
#define SWAP1(v) __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14)
#define TREE(v, op) (v = op(v, SWAP8(v)), v = op(v, SWAP4(v)), v = op(v, SWAP2(v)), v = op(v, SWAP1(v)))
#else
#define SWAP4(v) __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3)
#define SWAP2(v) __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5)
#define SWAP1(v) __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6)
#define TREE(v, op) (v = op(v, SWAP4(v)), v = op(v, SWAP2(v)), v = op(v, SWAP1(v)))
#endif
#define VOR(a, b) ((a) | (b))
#define VADD(a, b) ((a) + (b))

/* Whether any lane of a comparison's mask is set. */
static inline int any_lane(vi v) {
    TREE(v, VOR);
    return v[0] != 0;
}

/* Horizontal max and sum. */
static inline float hmax(vf v) {
    TREE(v, vmax);
    return v[0];
}

static inline float hsum(vf v) {
    TREE(v, VADD);
    return v[0];
}

#endif
