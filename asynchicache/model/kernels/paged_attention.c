/* Attention over a paged KV pool, reading K and V where they lie (no gather).
 *
 * Built by model/native.py with the machine's C compiler, once per
 * instruction set (`-march=x86-64-v4`: LANES 16; `-march=x86-64-v3`, AVX2: LANES 8;
 * vec.h), and called through ctypes, which releases the GIL. Float32, head_dim a
 * multiple of 16 (whole vectors of either width). Below, "16" is LANES on AVX-512;
 * on AVX2 chunks of keys and tiles of query vectors are 8 (other sums' order: the
 * pages' numerics version, native.py).
 *
 * Pool: page p's K for token t and KV head h starts at
 *     k_base + p * page_stride + t * token_stride + h * head_dim
 * and V at the same offsets from v_base (both views of one layer of the
 * page-first pool [pages, layers, 2, page_size, kv_heads, head_dim]).
 *
 * Work: an item is one sequence's run of query rows (a prefill chunk, or one
 * decode row): `items[i] = {table offset, first row, rows, first row's
 * position}`. Row r (position pos) attends causally to keys [0, pos] of its
 * sequence, within `window` keys when window > 0. Each query head g of KV head
 * h = g / (heads / kv_heads) reads h's keys (grouped-query attention).
 *
 * Tasks: an item with few rows (a decode: rows x heads <= MAX_Q) is one task over
 * every KV head, so each of its pages is read once, in order; a longer one is a task
 * per block of rows and KV head (up to MAX_Q query vectors: rows x the heads of the
 * group). A task goes through its keys in chunks of up to 16 (never across a page):
 * the chunk's K is transposed once into a [head_dim][16] block, so a query's
 * 16 scores are head_dim vector FMAs; then an online softmax (running max
 * and sum, as flash attention) and the chunk's V added in with broadcast
 * weights. Exponentials are a vector polynomial (Cephes' expf: within 2 ulp).
 *
 * A prompt's block of one KV head (at least 16 query vectors) goes another way,
 * `lanes_d`: its vectors 16 to a tile, one per lane, so scores need no transpose of
 * K and the online softmax needs no horizontal max or sum (each lane keeps its own).
 * 1,032 prompt rows of SmolLM2's shape, one thread: 11.4 -> 9.0-9.9 ms a layer. Tiles go
 * two at a time (each broadcast key dim feeds both) and V is added in 32 dims at a time
 * (each broadcast weight feeds two dim chunks): fewer loads per FMA, the same sums in the
 * same order; 1,546 rows, one thread, another host: 28.1 -> 22.6-24.8 ms a layer.
 */

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec.h"

#define MAX_D 256
#define MAX_Q 96

static inline vf qs_vec(const float *row, int32_t c) { return *(const vf *)(row + c * LANES); }

typedef struct {
    const float *k_base, *v_base;
    int64_t page_stride, token_stride;
    int64_t q_stride; /* floats from one query row to the next (heads x head_dim or more) */
    int32_t heads, kv_heads, head_dim, page_size;
    int64_t window;
} Pool;

#define QB 8 /* query vectors that share each load of K and V (a prompt's rows) */
#define QD 4 /* the same for few vectors per KV head (a decode: the heads of a group) */

/* The online softmax of query vectors [j0, j0 + qn) over one chunk of keys: scores s
 * (unscaled: q was scaled), masked by their positions; the weights go to p, and each
 * running max/sum and accumulator is corrected. Returns whether any key counted. */
static inline __attribute__((always_inline)) int softmax_chunk(
    vf *s, float (*p)[LANES], float *m, float *l, float *corr, const int64_t *qpos, int32_t j0,
    int32_t nq, int64_t k0, int64_t nk, int64_t window, const int32_t qn) {
    vi lane;
    for (int t = 0; t < LANES; t++) lane[t] = t;
    const vi key = lane + (int32_t)k0; /* positions fit in int32: a context is < 2^31 */
    int any = 0;
    for (int32_t q = 0; q < qn; q++) {
        const int32_t j = j0 + q;
        corr[q] = 1.0f;
        if (j >= nq || k0 > qpos[j]) { /* padding, or every key in its future */
            memset(p[q], 0, sizeof(p[q]));
            continue;
        }
        const int32_t pos = (int32_t)qpos[j];
        vi valid = (lane < (int32_t)nk) & (key <= pos);
        if (window > 0) valid &= key > (int32_t)(pos - window);
        vf sj = vselect(valid, s[q], vsplat(-FLT_MAX));
        if (m[j] > -FLT_MAX && !any_lane(sj > m[j])) {
            /* No score above the running max (most chunks once a row has seen a few): the
             * max stays, the correction is exp(0) = 1, so skip the horizontal max, the
             * scalar exp and the rescale, whose latency chain dominated the chunk. The
             * same numbers as the general path below, bit for bit. */
            vf pj = vselect(valid, vexp(sj - m[j]), vsplat(0.0f));
            l[j] += hsum(pj);
            vstore(p[q], pj);
            any = 1;
            continue;
        }
        const float cmax = hmax(sj);
        if (cmax == -FLT_MAX) { /* all outside the window */
            memset(p[q], 0, sizeof(p[q]));
            continue;
        }
        const float mnew = cmax > m[j] ? cmax : m[j];
        corr[q] = expf(m[j] - mnew);
        vf pj = vselect(valid, vexp(sj - mnew), vsplat(0.0f));
        l[j] = l[j] * corr[q] + hsum(pj);
        m[j] = mnew;
        vstore(p[q], pj);
        any = 1;
    }
    return any;
}

/* LANES vectors' horizontal sums as one vector, lane t the sum of v[t]: a tree of
 * shuffles (LANES - 1 steps), the same tree as hsum's for each vector, whose lanes come
 * out in bit-reversed order, put back at the end. */
#if LANES == 16
static inline vf sum_lanes(vf *v) {
    for (int i = 0; i < 8; i++)
        v[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18,
                                       19, 20, 21, 22, 23) +
               __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24,
                                       25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)
        v[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9,
                                       10, 11, 24, 25, 26, 27) +
               __builtin_shufflevector(v[2 * i], v[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13,
                                       14, 15, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)
        v[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9,
                                       24, 25, 12, 13, 28, 29) +
               __builtin_shufflevector(v[2 * i], v[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11,
                                       26, 27, 14, 15, 30, 31);
    vf z = __builtin_shufflevector(v[0], v[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28,
                                    14, 30) +
            __builtin_shufflevector(v[0], v[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29,
                                    15, 31);
    return __builtin_shufflevector(z, z, 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
}
#else
static inline vf sum_lanes(vf *v) {
    for (int i = 0; i < 4; i++)
        v[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
               __builtin_shufflevector(v[2 * i], v[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int i = 0; i < 2; i++)
        v[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
               __builtin_shufflevector(v[2 * i], v[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    vf z = __builtin_shufflevector(v[0], v[1], 0, 8, 2, 10, 4, 12, 6, 14) +
            __builtin_shufflevector(v[0], v[1], 1, 9, 3, 11, 5, 13, 7, 15);
    return __builtin_shufflevector(z, z, 0, 4, 2, 6, 1, 5, 3, 7);
}
#endif

/* Scores of up to QD query vectors against a chunk's keys read as they lie (no
 * transpose: worth it for a few vectors, as a decode's group). */
static inline __attribute__((always_inline)) void direct_scores(
    vf *s, float (*qs)[MAX_D], int32_t j0, const float *kp, int64_t ts, int64_t nk,
    const int32_t D) {
    const int32_t DV = D / LANES;
    vf part[QD][LANES];
    for (int64_t t = 0; t < LANES; t++) {
        if (t >= nk) {
            for (int32_t b = 0; b < QD; b++) part[b][t] = vsplat(0.0f);
            continue;
        }
        vf k[MAX_D / LANES];
        for (int32_t c = 0; c < DV; c++) k[c] = vload(kp + t * ts + c * LANES);
        for (int32_t b = 0; b < QD; b++) {
            vf a = qs_vec(qs[j0 + b], 0) * k[0];
            for (int32_t c = 1; c < DV; c++) a += qs_vec(qs[j0 + b], c) * k[c];
            part[b][t] = a;
        }
    }
    for (int32_t b = 0; b < QD; b++) s[b] = sum_lanes(part[b]);
}

/* Query vectors of one block: rows [r0, r0 + nr) of an item, for KV heads [h0, h0 + nh)
 * and every query head of their groups, over their keys. A chunk of keys is read once for
 * all nh heads (a decode row takes every head: each page is read once, in order). Vector
 * j = (head hh, row r, query g of the group) sits at j = (hh * nr + r) * group + g.
 * Inlined per head_dim D so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void block_d(
    const Pool *pool, const int64_t *table, const float *q, float *out, int64_t r0, int64_t nr,
    int64_t pos0, int32_t h0, int32_t nh, float scale, const int32_t D, const int32_t QN) {
    const int32_t DV = D / LANES, group = pool->heads / pool->kv_heads;
    const int32_t per_head = (int32_t)nr * group, nq = nh * per_head;
    float qs[MAX_Q + QB][MAX_D] __attribute__((aligned(64)));
    float acc[MAX_Q + QB][MAX_D] __attribute__((aligned(64)));
    float kt[MAX_D][LANES] __attribute__((aligned(64)));
    float p[QB][LANES] __attribute__((aligned(64)));
    float m[MAX_Q + QB], l[MAX_Q + QB], corr[QB];
    int64_t qpos[MAX_Q + QB];
    for (int32_t j = 0; j < nq; j++) {
        const int64_t r = (j % per_head) / group;
        const int32_t head = (h0 + j / per_head) * group + j % group;
        const float *src = q + (r0 + r) * pool->q_stride + head * D;
        for (int32_t i = 0; i < D; i++) qs[j][i] = src[i] * scale;
        memset(acc[j], 0, sizeof(float) * D);
        m[j] = -FLT_MAX;
        l[j] = 0.0f;
        qpos[j] = pos0 + r;
    }
    for (int32_t j = nq; j < nq + QB; j++) memset(qs[j], 0, sizeof(float) * D);
    const int direct = QN == QD; /* few vectors a head: scores without the transpose */
    const int64_t last = pos0 + nr - 1; /* keys the block's last row sees: [0, last] */
    int64_t first = 0;
    if (pool->window > 0 && pos0 - pool->window + 1 > 0) first = pos0 - pool->window + 1;
    const int64_t ps = pool->page_size, ts = pool->token_stride;
    for (int64_t k0 = first - first % ps; k0 <= last;) {
        const int64_t page = table[k0 / ps], in_page = k0 % ps;
        int64_t nk = ps - in_page < LANES ? ps - in_page : LANES;
        if (k0 + nk > last + 1) nk = last + 1 - k0;
        if (in_page == 0 && k0 + ps <= last) { /* fetch the next page while this one computes */
            const int64_t next = table[k0 / ps + 1] * pool->page_stride;
            const int64_t span = ps * ts; /* floats of one page's K (or V) in this layer */
            for (int64_t f = 0; f < span; f += 16) {
                __builtin_prefetch(pool->k_base + next + f);
                __builtin_prefetch(pool->v_base + next + f);
            }
        }
        for (int32_t hh = 0; hh < nh; hh++) {
            const int64_t at = page * pool->page_stride + in_page * ts + (int64_t)(h0 + hh) * D;
            const float *kp = pool->k_base + at, *vp = pool->v_base + at;
            if (!direct)
                for (int64_t t = 0; t < LANES; t++)
                    for (int32_t i = 0; i < D; i++) kt[i][t] = t < nk ? kp[t * ts + i] : 0.0f;
            const int32_t jb = hh * per_head, je = jb + per_head;
            for (int32_t j0 = jb; j0 < je; j0 += QN) {
                vf s[QB];
                if (direct) {
                    direct_scores(s, qs, j0, kp, ts, nk, D);
                } else {
                    for (int32_t b = 0; b < QN; b++) s[b] = vsplat(0.0f);
                    for (int32_t i = 0; i < D; i++) {
                        const vf kv = vload(kt[i]);
                        for (int32_t b = 0; b < QN; b++) s[b] += qs[j0 + b][i] * kv;
                    }
                }
                if (!softmax_chunk(s, p, m, l, corr, qpos, j0, je, k0, nk, pool->window, QN))
                    continue;
                for (int32_t c = 0; c < DV; c++) { /* QN accumulators of 16 dims at a time */
                    vf a[QB];
                    for (int32_t b = 0; b < QN; b++) a[b] = vload(acc[j0 + b] + c * LANES) * corr[b];
                    for (int64_t t = 0; t < nk; t++) {
                        const vf vt = vload(vp + t * ts + c * LANES);
                        for (int32_t b = 0; b < QN; b++) a[b] += p[b][t] * vt;
                    }
                    for (int32_t b = 0; b < QN; b++) vstore(acc[j0 + b] + c * LANES, a[b]);
                }
            }
        }
        k0 += nk;
    }
    for (int32_t j = 0; j < nq; j++) {
        const int64_t r = (j % per_head) / group;
        const int32_t head = (h0 + j / per_head) * group + j % group;
        float *dst = out + ((r0 + r) * pool->heads + head) * D;
        const float inv = l[j] > 0.0f ? 1.0f / l[j] : 0.0f;
        for (int32_t i = 0; i < D; i++) dst[i] = acc[j][i] * inv;
    }
}

/* Prompt rows of one KV head with at least a tile of query vectors: the vectors go 16 to
 * a tile, one per lane (vector j = row r, query head g of the group: j = r * group + g).
 * Scores then need no transpose of K: a key's scores for a tile's 16 vectors are head_dim
 * FMAs of the tile's transposed queries with that key's dims broadcast, in the same order
 * as the block path's sums. The online softmax runs lane-wise (each lane its own running
 * max and sum, with no horizontal reduction), and V is added in with each vector's weights
 * broadcast. A tile goes through all its keys before the next (its queries and sums stay in
 * L1), in chunks of up to 16 keys, never across a page. */

static inline __attribute__((always_inline)) void tile_scores(
    vf *s, float (*qt)[LANES], const float *kp, int64_t ts, int64_t nk, const int32_t D) {
    for (int t = 0; t < LANES; t++) s[t] = vsplat(0.0f);
    if (nk == LANES) {
        for (int32_t i = 0; i < D; i++) {
            const vf qv = vload(qt[i]);
            for (int t = 0; t < LANES; t++) s[t] += qv * kp[t * ts + i];
        }
        return;
    }
    for (int32_t i = 0; i < D; i++) {
        const vf qv = vload(qt[i]);
        for (int t = 0; t < nk; t++) s[t] += qv * kp[t * ts + i];
    }
}

/* Scores of two tiles against one chunk (sa for qa's vectors, sb for qb's): eight keys at
 * a time, so each broadcast key dim feeds two FMAs and the 16 sums stay in registers. The
 * same sums in the same order as `tile_scores` of each tile. */
static inline __attribute__((always_inline)) void tile_scores2(
    vf *sa, vf *sb, float (*qa)[LANES], float (*qb)[LANES], const float *kp, int64_t ts,
    int64_t nk, const int32_t D) {
    for (int t0 = 0; t0 < LANES; t0 += LANES / 2) {
        vf a[LANES / 2], b[LANES / 2];
        for (int t = 0; t < LANES / 2; t++) a[t] = b[t] = vsplat(0.0f);
        const int64_t n = nk - t0 < LANES / 2 ? nk - t0 : LANES / 2;
        if (n == LANES / 2) {
            for (int32_t i = 0; i < D; i++) {
                const vf x = vload(qa[i]), y = vload(qb[i]);
                for (int t = 0; t < LANES / 2; t++) {
                    const float k = kp[(t0 + t) * ts + i];
                    a[t] += x * k;
                    b[t] += y * k;
                }
            }
        } else {
            for (int32_t i = 0; i < D; i++) {
                const vf x = vload(qa[i]), y = vload(qb[i]);
                for (int t = 0; t < n; t++) {
                    const float k = kp[(t0 + t) * ts + i];
                    a[t] += x * k;
                    b[t] += y * k;
                }
            }
        }
        for (int t = 0; t < LANES / 2; t++) {
            sa[t0 + t] = a[t];
            sb[t0 + t] = b[t];
        }
    }
}

/* A tile: 16 query vectors (transposed, scaled), their accumulators, running max and sum,
 * positions (-1: padding) and first and last row. */
typedef struct {
    float qt[MAX_D][LANES] __attribute__((aligned(64)));
    float acc[LANES][MAX_D] __attribute__((aligned(64)));
    vf m, l;
    vi qpos;
    int64_t lo, hi;
} Tile;

/* One chunk of keys (its scores s; vp: V of nk keys from position k0) into a tile's running
 * max, sum and accumulators. */
static inline __attribute__((always_inline)) void tile_chunk(
    Tile *tile, vf *s, const float *vp, int64_t ts, int64_t k0, int64_t nk, int64_t window,
    const int32_t D) {
    float p[LANES][LANES] __attribute__((aligned(64)));
    float cs[LANES] __attribute__((aligned(64)));
    vi valid[LANES];
    float(*acc)[MAX_D] = tile->acc;
    vf *m = &tile->m, *l = &tile->l;
    const vi qpos = tile->qpos;
    const int64_t lo = tile->lo, hi = tile->hi;
    const int whole = nk == LANES && k0 + nk - 1 <= lo && (window <= 0 || k0 > hi - window);
    vf cmax = vsplat(-FLT_MAX);
    for (int t = 0; t < LANES; t++) {
        if (!whole) {
            const int32_t key = (int32_t)(k0 + t), in_chunk = t < nk ? -1 : 0;
            valid[t] = (qpos >= key) & in_chunk;
            if (window > 0) valid[t] &= qpos < key + (int32_t)window;
            s[t] = vselect(valid[t], s[t], vsplat(-FLT_MAX));
        }
        cmax = vmax(cmax, s[t]);
    }
    const vf mnew = vmax(*m, cmax);
    const vf corr = vexp(*m - mnew);
    vf sum = vsplat(0.0f);
    for (int t = 0; t < LANES; t++) {
        vf pt = vexp(s[t] - mnew);
        if (!whole) pt = vselect(valid[t], pt, vsplat(0.0f));
        sum += pt;
        vstore(p[t], pt);
    }
    *l = *l * corr + sum;
    *m = mnew;
    vstore(cs, corr);
    /* V in: half the tile's vectors at a time over 32 dims (16 accumulators), so each
     * broadcast weight feeds two FMAs; the same sums in the same order as one dim chunk
     * at a time. A head_dim of an odd number of chunks does its last chunk alone. */
    const int32_t DV = D / LANES;
    int32_t c = 0;
    for (; c + 2 <= DV; c += 2)
        for (int u0 = 0; u0 < LANES; u0 += LANES / 2) {
            vf a0[LANES / 2], a1[LANES / 2];
            for (int u = 0; u < LANES / 2; u++) {
                a0[u] = vload(acc[u0 + u] + c * LANES) * cs[u0 + u];
                a1[u] = vload(acc[u0 + u] + (c + 1) * LANES) * cs[u0 + u];
            }
            for (int64_t t = 0; t < nk; t++) {
                const vf v0 = vload(vp + t * ts + c * LANES);
                const vf v1 = vload(vp + t * ts + (c + 1) * LANES);
                for (int u = 0; u < LANES / 2; u++) {
                    a0[u] += p[t][u0 + u] * v0;
                    a1[u] += p[t][u0 + u] * v1;
                }
            }
            for (int u = 0; u < LANES / 2; u++) {
                vstore(acc[u0 + u] + c * LANES, a0[u]);
                vstore(acc[u0 + u] + (c + 1) * LANES, a1[u]);
            }
        }
    for (; c < DV; c++) {
        vf a[LANES];
        for (int t = 0; t < LANES; t++) a[t] = vload(acc[t] + c * LANES) * cs[t];
        for (int64_t t = 0; t < nk; t++) {
            const vf vt = vload(vp + t * ts + c * LANES);
            for (int u = 0; u < LANES; u++) a[u] += p[t][u] * vt;
        }
        for (int t = 0; t < LANES; t++) vstore(acc[t] + c * LANES, a[t]);
    }
}

/* Tile b's vectors of rows [r0, r0 + nr) of KV head h: queries, positions, rows. */
static inline __attribute__((always_inline)) void tile_load(
    Tile *tile, const Pool *pool, const float *q, int64_t r0, int64_t pos0, int32_t h,
    int32_t b, int32_t nq, float scale, const int32_t D) {
    const int32_t group = pool->heads / pool->kv_heads;
    tile->m = vsplat(-FLT_MAX);
    tile->l = vsplat(0.0f);
    for (int t = 0; t < LANES; t++) {
        const int32_t j = b * LANES + t;
        memset(tile->acc[t], 0, sizeof(float) * D);
        if (j >= nq) { /* padding: sees no key */
            tile->qpos[t] = -1;
            for (int32_t i = 0; i < D; i++) tile->qt[i][t] = 0.0f;
            continue;
        }
        const float *src = q + (r0 + j / group) * pool->q_stride + (h * group + j % group) * D;
        for (int32_t i = 0; i < D; i++) tile->qt[i][t] = src[i] * scale;
        tile->qpos[t] = (int32_t)(pos0 + j / group);
    }
    tile->lo = pos0 + (b * LANES) / group;
    tile->hi = pos0 + ((b * LANES + LANES < nq ? b * LANES + LANES : nq) - 1) / group;
}

static inline __attribute__((always_inline)) void tile_store(
    const Tile *tile, const Pool *pool, float *out, int64_t r0, int32_t h, int32_t b,
    int32_t nq, const int32_t D) {
    const int32_t group = pool->heads / pool->kv_heads;
    float ls[LANES] __attribute__((aligned(64)));
    vstore(ls, tile->l);
    for (int t = 0; t < LANES && b * LANES + t < nq; t++) {
        const int32_t j = b * LANES + t;
        float *dst = out + ((r0 + j / group) * pool->heads + h * group + j % group) * D;
        const float inv = ls[t] > 0.0f ? 1.0f / ls[t] : 0.0f;
        for (int32_t i = 0; i < D; i++) dst[i] = tile->acc[t][i] * inv;
    }
}

/* Tiles two at a time (the last alone when their count is odd), through all their keys:
 * the pair's queries and sums stay in L1, and each key dim read feeds both tiles. */
static inline __attribute__((always_inline)) void lanes_d(
    const Pool *pool, const int64_t *table, const float *q, float *out, int64_t r0, int64_t nr,
    int64_t pos0, int32_t h, float scale, const int32_t D) {
    const int32_t group = pool->heads / pool->kv_heads;
    const int32_t nq = (int32_t)nr * group, tiles = (nq + LANES - 1) / LANES;
    const int64_t ps = pool->page_size, ts = pool->token_stride, window = pool->window;
    Tile pair[2];
    for (int32_t b = 0; b < tiles; b += 2) {
        const int two = b + 1 < tiles;
        Tile *ta = &pair[0], *tb = &pair[1];
        tile_load(ta, pool, q, r0, pos0, h, b, nq, scale, D);
        if (two) tile_load(tb, pool, q, r0, pos0, h, b + 1, nq, scale, D);
        const int64_t hi = two ? tb->hi : ta->hi;
        const int64_t first = window > 0 && ta->lo - window + 1 > 0 ? ta->lo - window + 1 : 0;
        for (int64_t k0 = first - first % ps; k0 <= hi;) {
            const int64_t page = table[k0 / ps], in_page = k0 % ps;
            int64_t nk = ps - in_page < LANES ? ps - in_page : LANES;
            if (k0 + nk > hi + 1) nk = hi + 1 - k0;
            if (in_page == 0 && k0 + ps <= hi) { /* fetch the next page's rows of this head */
                const int64_t next = table[k0 / ps + 1] * pool->page_stride + (int64_t)h * D;
                for (int64_t t = 0; t < ps; t++)
                    for (int32_t f = 0; f < D; f += 16) {
                        __builtin_prefetch(pool->k_base + next + t * ts + f);
                        __builtin_prefetch(pool->v_base + next + t * ts + f);
                    }
            }
            const int64_t at = page * pool->page_stride + in_page * ts + (int64_t)h * D;
            const float *kp = pool->k_base + at, *vp = pool->v_base + at;
            vf sa[LANES], sb[LANES];
            if (two) tile_scores2(sa, sb, ta->qt, tb->qt, kp, ts, nk, D);
            else tile_scores(sa, ta->qt, kp, ts, nk, D);
            /* A chunk wholly after the first tile's rows counts for the second alone. */
            if (k0 <= ta->hi) tile_chunk(ta, sa, vp, ts, k0, nk, window, D);
            if (two) tile_chunk(tb, sb, vp, ts, k0, nk, window, D);
            k0 += nk;
        }
        tile_store(ta, pool, out, r0, h, b, nq, D);
        if (two) tile_store(tb, pool, out, r0, h, b + 1, nq, D);
    }
}

#define BLOCK_ARGS                                                                            \
    const Pool *pool, const int64_t *table, const float *q, float *out, int64_t r0, int64_t nr, \
        int64_t pos0, int32_t h0, int32_t nh, float scale
#define BLOCK_PASS pool, table, q, out, r0, nr, pos0, h0, nh, scale

/* One instance per head_dim (64, 128, any) and group shape: few vectors a KV head (a
 * decode's group of at most QD query heads) or many (a prompt's rows). */
static void block_64_few(BLOCK_ARGS) { block_d(BLOCK_PASS, 64, QD); }
static void block_64_many(BLOCK_ARGS) { block_d(BLOCK_PASS, 64, QB); }
static void block_128_few(BLOCK_ARGS) { block_d(BLOCK_PASS, 128, QD); }
static void block_128_many(BLOCK_ARGS) { block_d(BLOCK_PASS, 128, QB); }
static void block_any_few(BLOCK_ARGS) { block_d(BLOCK_PASS, pool->head_dim, QD); }
static void block_any_many(BLOCK_ARGS) { block_d(BLOCK_PASS, pool->head_dim, QB); }

#define LANES_ARGS                                                                            \
    const Pool *pool, const int64_t *table, const float *q, float *out, int64_t r0, int64_t nr, \
        int64_t pos0, int32_t h, float scale
#define LANES_PASS pool, table, q, out, r0, nr, pos0, h, scale
static void lanes_64(LANES_ARGS) { lanes_d(LANES_PASS, 64); }
static void lanes_128(LANES_ARGS) { lanes_d(LANES_PASS, 128); }
static void lanes_any(LANES_ARGS) { lanes_d(LANES_PASS, pool->head_dim); }

static void block(BLOCK_ARGS) {
    const int64_t vectors = nr * (pool->heads / pool->kv_heads); /* per KV head */
    const int few = vectors <= QD;
    if (nh == 1 && vectors >= LANES) { /* a prompt's rows */
        if (pool->head_dim == 64) lanes_64(pool, table, q, out, r0, nr, pos0, h0, scale);
        else if (pool->head_dim == 128) lanes_128(pool, table, q, out, r0, nr, pos0, h0, scale);
        else lanes_any(pool, table, q, out, r0, nr, pos0, h0, scale);
        return;
    }
    if (pool->head_dim == 64) (few ? block_64_few : block_64_many)(BLOCK_PASS);
    else if (pool->head_dim == 128) (few ? block_128_few : block_128_many)(BLOCK_PASS);
    else (few ? block_any_few : block_any_many)(BLOCK_PASS);
}

/* items: [n_items][4] = {table offset into `tables`, first row, rows, first row's position}.
 * q: rows of [heads][head_dim] q_stride floats apart; out: [T][heads][head_dim]. The work is a list of tasks (item, block of rows, KV head);
 * this call does tasks task_begin, task_begin + task_step, ... (threads share a call's work
 * by striding). Returns 0, or -1 when the shapes are unsupported. */
int paged_attention_f32(const float *k_base, const float *v_base, int64_t page_stride,
                        int64_t token_stride, int32_t heads, int32_t kv_heads, int32_t head_dim,
                        int32_t page_size, int64_t window, float scale, const float *q,
                        int64_t q_stride, float *out, const int64_t *tables, const int64_t *items,
                        int64_t n_items, int64_t task_begin, int64_t task_step) {
    if (head_dim % 16 || head_dim > MAX_D || kv_heads <= 0 || heads % kv_heads) return -1;
    const int32_t group = heads / kv_heads;
    if (group > MAX_Q || task_step <= 0) return -1;
    const Pool pool = {k_base, v_base, page_stride, token_stride, q_stride, heads,
                       kv_heads, head_dim, page_size, window};
    int64_t task = 0;
    for (int64_t i = 0; i < n_items; i++) {
        const int64_t *it = items + 4 * i;
        const int64_t *table = tables + it[0];
        if (it[2] * heads <= MAX_Q) { /* few rows (a decode): every head at once */
            if (task++ % task_step == task_begin)
                block(&pool, table, q, out, it[1], it[2], it[3], 0, kv_heads, scale);
            continue;
        }
        for (int64_t r = 0; r < it[2]; r += MAX_Q / group) {
            const int64_t nr = it[2] - r < MAX_Q / group ? it[2] - r : MAX_Q / group;
            for (int32_t h = 0; h < kv_heads; h++, task++)
                if (task % task_step == task_begin)
                    block(&pool, table, q, out, it[1] + r, nr, it[3] + r, h, 1, scale);
        }
    }
    return 0;
}
