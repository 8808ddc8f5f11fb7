/* Each kernel's call shared by an OpenMP team: torch's own threads.
 *
 * The library is built with -fopenmp and its libgomp is the one torch loaded (the same
 * soname: one runtime, one pool of threads, model/native.py checks). A call here opens a
 * parallel region as torch's ops do, so the row kernels and the attention run on the
 * threads that run the matmuls, not on a Python worker beside them: no GIL, no queue
 * hand-off, and no second set of threads taking the cores OpenMP's threads need (on 2
 * cores those fought at every op of a prefill).
 *
 * The parts are those the Python threads used (row ops: rows [r0, r1) cut in `parts`
 * equal runs; attention: tasks strided by part), and every row and task is computed by
 * one thread whatever the split: the results are bitwise those of one thread.
 * Without OpenMP (`kernel_team` 0) each runs on the calling thread alone.
 */

#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

void rms_norm_f32(const float *x, int64_t x_stride, const float *w, float *out,
                  int64_t out_stride, int64_t n, float eps, int64_t r0, int64_t r1);
void add_rms_norm_f32(float *res, int64_t res_stride, const float *delta, int64_t delta_stride,
                      const float *w, float *out, int64_t out_stride, int64_t n, float eps,
                      int64_t r0, int64_t r1);
void silu_mul_f32(const float *gu, int64_t gu_stride, float *out, int64_t out_stride, int64_t n,
                  int64_t r0, int64_t r1);
void rotary_f32(float *x, int64_t x_stride, int64_t heads, int64_t head_dim, const float *cos_,
                const float *sin_, int64_t cs_stride, int64_t r0, int64_t r1);
void scatter_rows_f32(float *base, int64_t page_stride, int64_t slot_stride, const float *src,
                      int64_t src_stride, int64_t n, const int64_t *pages, const int64_t *offsets,
                      int64_t r0, int64_t r1);
int paged_attention_f32(const float *k_base, const float *v_base, int64_t page_stride,
                        int64_t token_stride, int32_t heads, int32_t kv_heads, int32_t head_dim,
                        int32_t page_size, int64_t window, float scale, const float *q,
                        int64_t q_stride, float *out, const int64_t *tables, const int64_t *items,
                        int64_t n_items, int64_t task_begin, int64_t task_step);

int32_t kernel_team(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

#ifdef _OPENMP
#define PART() omp_get_thread_num()
#define PARTS() omp_get_num_threads()
#define TEAM _Pragma("omp parallel num_threads(threads)")
#else
#define PART() 0
#define PARTS() 1
#define TEAM
#endif

/* This thread's run of rows [r0, r1) (as model/row_ops.py cut them for Python threads). */
#define MY_ROWS                                                     \
    const int64_t p_ = PART(), n_ = PARTS(), len_ = r1 - r0;        \
    const int64_t a_ = r0 + len_ * p_ / n_, b_ = r0 + len_ * (p_ + 1) / n_;

void rms_norm_f32_team(const float *x, int64_t x_stride, const float *w, float *out,
                       int64_t out_stride, int64_t n, float eps, int64_t r0, int64_t r1,
                       int32_t threads) {
    TEAM {
        MY_ROWS
        rms_norm_f32(x, x_stride, w, out, out_stride, n, eps, a_, b_);
    }
}

void add_rms_norm_f32_team(float *res, int64_t res_stride, const float *delta,
                           int64_t delta_stride, const float *w, float *out, int64_t out_stride,
                           int64_t n, float eps, int64_t r0, int64_t r1, int32_t threads) {
    TEAM {
        MY_ROWS
        add_rms_norm_f32(res, res_stride, delta, delta_stride, w, out, out_stride, n, eps, a_, b_);
    }
}

void silu_mul_f32_team(const float *gu, int64_t gu_stride, float *out, int64_t out_stride,
                       int64_t n, int64_t r0, int64_t r1, int32_t threads) {
    TEAM {
        MY_ROWS
        silu_mul_f32(gu, gu_stride, out, out_stride, n, a_, b_);
    }
}

void rotary_f32_team(float *x, int64_t x_stride, int64_t heads, int64_t head_dim,
                     const float *cos_, const float *sin_, int64_t cs_stride, int64_t r0,
                     int64_t r1, int32_t threads) {
    TEAM {
        MY_ROWS
        rotary_f32(x, x_stride, heads, head_dim, cos_, sin_, cs_stride, a_, b_);
    }
}

void scatter_rows_f32_team(float *base, int64_t page_stride, int64_t slot_stride,
                           const float *src, int64_t src_stride, int64_t n, const int64_t *pages,
                           const int64_t *offsets, int64_t r0, int64_t r1, int32_t threads) {
    TEAM {
        MY_ROWS
        scatter_rows_f32(base, page_stride, slot_stride, src, src_stride, n, pages, offsets, a_,
                         b_);
    }
}

int paged_attention_f32_team(const float *k_base, const float *v_base, int64_t page_stride,
                             int64_t token_stride, int32_t heads, int32_t kv_heads,
                             int32_t head_dim, int32_t page_size, int64_t window, float scale,
                             const float *q, int64_t q_stride, float *out, const int64_t *tables,
                             const int64_t *items, int64_t n_items, int32_t threads) {
    int rc = 0;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads) reduction(| : rc)
#endif
    rc |= paged_attention_f32(k_base, v_base, page_stride, token_stride, heads, kv_heads,
                              head_dim, page_size, window, scale, q, q_stride, out, tables,
                              items, n_items, PART(), PARTS());
    return rc;
}
