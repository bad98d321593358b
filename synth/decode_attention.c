/* One decode step's attention for every row and head, float32, with the voice prefix read where it is shared.
 *
 * Built and loaded by synth/decode_attention.py (cc -O3 -march=native -fopenmp -ffp-contract=off: see there).
 * For q's row r (cache row c = row_ids[r]: a step may decode any set of cache rows) and head h:
 *   keys j in [0, visible[r]): j < shared[c] from the row's voice prefix (prefix_k[c] + h * prefix_head[c] + j * dim),
 *                              else from the row's cache (cache_k + c * row_stride + h * head_stride + j * dim);
 *   scores s_j = (q . k_j) * scale, p = softmax(s), out = sum_j p_j v_j.
 * A row's cache holds a copy of the same prefix positions, so the values are the ones the row would read; what
 * changes is where they come from: rows on one voice read one prefix (cache-resident after the first row) instead
 * of one copy each, and no row reads keys past its own length (the step's key bucket pads them).
 *
 * Every (row, head) is computed by one thread in a fixed order (dot products as 16 lanes summed in a fixed order,
 * one pass for the maximum, exponentials, their sum, then the weighted values in key order): a row's result does
 * not depend on the other rows, on the key bucket or on the thread count (bitwise).
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define LANES 16
#define MAX_DIM 256

/* exp(x) for x <= 0 (scores minus their maximum), Cephes' expf polynomial (relative error ~1e-7), written so the
 * compiler vectorizes the loop that calls it (libm's expf is one call per key; measured: the step 3-4 % faster
 * with this). Inputs below -87 give exp(-87) ~ 1.6e-38 instead of a denormal or 0: nothing next to the maximum's 1. */
static inline float exp_nonpositive(float x) {
    x = fmaxf(x, -87.0f);
    float k = nearbyintf(x * 1.44269504088896341f);
    float r = x - k * 0.693359375f;
    r = r + k * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float y = p * r * r + r + 1.0f;
    union { float f; int32_t i; } scale = {.i = ((int32_t)k + 127) << 23};
    return y * scale.f;
}

typedef float v16f __attribute__((vector_size(64)));

/* q . k over dim (a multiple of 16): lanes accumulate per 16 dimensions, then a fixed pairwise tree over lanes
 * (lane l += lane l + width, width 8, 4, 2, 1), as vector halves where the compiler has __builtin_shufflevector
 * (GCC 12, clang: the same additions in the same order, so the same bits; the kernel ~17 % faster, measured),
 * else (or with -DDECODE_ATTENTION_MEMORY_TREE: tests/synth/test_decode_attention.py compares the two) through
 * memory. */
static inline float dot(const float *a, const float *b, int64_t dim) {
    v16f acc = {0};
    for (int64_t d = 0; d < dim; d += LANES) {
        v16f x, y;
        __builtin_memcpy(&x, a + d, sizeof x);
        __builtin_memcpy(&y, b + d, sizeof y);
        acc += x * y;
    }
#if (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)) && !defined(DECODE_ATTENTION_MEMORY_TREE)
    typedef float v8f __attribute__((vector_size(32)));
    typedef float v4f __attribute__((vector_size(16)));
    typedef float v2f __attribute__((vector_size(8)));
    v8f a8 = __builtin_shufflevector(acc, acc, 0, 1, 2, 3, 4, 5, 6, 7) +
             __builtin_shufflevector(acc, acc, 8, 9, 10, 11, 12, 13, 14, 15);
    v4f a4 = __builtin_shufflevector(a8, a8, 0, 1, 2, 3) + __builtin_shufflevector(a8, a8, 4, 5, 6, 7);
    v2f a2 = __builtin_shufflevector(a4, a4, 0, 1) + __builtin_shufflevector(a4, a4, 2, 3);
    return a2[0] + a2[1];
#else
    float lane[LANES];
    __builtin_memcpy(lane, &acc, sizeof lane);
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int l = 0; l < width; l++) lane[l] += lane[l + width];
    return lane[0];
#endif
}

void decode_attention_f32(int64_t rows, const int64_t *row_ids, int64_t heads, int64_t dim, float scale,
                          const float *q, float *out,
                          const float *cache_k, const float *cache_v, int64_t row_stride, int64_t head_stride,
                          const int64_t *prefix_k, const int64_t *prefix_v, const int64_t *prefix_head,
                          const int64_t *shared, const int64_t *visible, int64_t max_keys, float *scratch,
                          int threads) {
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t h = 0; h < heads; h++) {
            int thread_slot = 0;
#ifdef _OPENMP
            thread_slot = omp_get_thread_num();
#endif
            float *p = scratch + (int64_t)thread_slot * max_keys;
            const float *qrh = q + (r * heads + h) * dim;
            int64_t row = row_ids[r];  /* the cache row of q's row r (a step may decode any set of rows) */
            int64_t n = visible[r] < max_keys ? visible[r] : max_keys;
            int64_t split = shared[row] < n ? shared[row] : n;
            const float *pk = (const float *)(intptr_t)prefix_k[row] + h * prefix_head[row];
            const float *pv = (const float *)(intptr_t)prefix_v[row] + h * prefix_head[row];
            const float *ck = cache_k + row * row_stride + h * head_stride;
            const float *cv = cache_v + row * row_stride + h * head_stride;
            float top = -INFINITY;
            for (int64_t j = 0; j < n; j++) {
                const float *k = j < split ? pk + j * dim : ck + j * dim;
                float s = dot(qrh, k, dim) * scale;
                p[j] = s;
                if (s > top) top = s;
            }
            for (int64_t j = 0; j < n; j++) p[j] = exp_nonpositive(p[j] - top);
            float total = 0.0f;
            for (int64_t j = 0; j < n; j++) total += p[j];
            v16f acc[MAX_DIM / LANES] = {{0}};  /* the output row in registers (dim <= MAX_DIM) */
            int64_t vecs = dim / LANES;
            for (int64_t j = 0; j < n; j++) {
                const float *v = j < split ? pv + j * dim : cv + j * dim;
                float w = p[j] / total;
                for (int64_t c = 0; c < vecs; c++) {
                    v16f x;
                    __builtin_memcpy(&x, v + c * LANES, sizeof x);
                    acc[c] += w * x;
                }
            }
            __builtin_memcpy(out + (r * heads + h) * dim, acc, (size_t)dim * sizeof(float));
        }
    }
}
