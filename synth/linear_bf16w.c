/* y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]): fp32 activations, weights stored as bfloat16, fp32 FMA.
 *
 * Built and loaded by synth/linear_bf16w.py (cc -O3 -march=native -fopenmp). bf16 -> fp32 is exact (a shift),
 * so this is fp32 arithmetic on the weights' exact values while reading half the bytes of fp32 weights: a
 * decode step at a few rows is bound by how fast the weights stream from memory.
 *
 * Every output is one sequential FMA chain over k = 0..K-1, started from 0, then the bias added: the same
 * operations whatever M is, whatever row tile a row falls in, however k is sliced. A row's result therefore
 * never depends on the other rows of the call (bitwise), which the engine relies on for a seeded segment's
 * tokens to be independent of its batch.
 *
 * Packed weights: [ceil(N / 64)][K][64] bf16 (zero-padded columns), so a group of 64 outputs streams
 * contiguously. Per k, 16 weights are widened in a register (a zero-extend and a shift) and FMA'd into a tile
 * of up to 24 rows: the widening then costs 1/24 of the FMA port's time when the call is compute-bound
 * (prefill, big batches); a tile of 1-4 rows spans the group's 4 vectors, so 4 independent chains per row hide
 * the FMA latency when the call is bound by memory (decode at a few rows).
 * Parallel over groups (OpenMP: the process's one libgomp, the one torch loaded).
 */
#include <stdint.h>
#include <string.h>

typedef float v16f __attribute__((vector_size(64)));

#define VEC 16       /* outputs per vector */
#define GROUP_OUT 64 /* outputs per packed group (the unit of parallel work) */
#define GROUP_VECS (GROUP_OUT / VEC)

#ifndef __AVX512F__
/* A generic-vector build ran 2-8x slower than fp32 oneDNN on an AVX2 CPU (16 registers of half the width
 * cannot hold these tiles), so the bf16 mode is offered on AVX-512 CPUs only. */
#error "linear_bf16w needs an AVX-512 CPU: use cpu_weights=fp32 here"
#endif
#include <immintrin.h>

static inline v16f widen(const uint16_t *p) { /* bf16 -> fp32 exactly: one vpmovzxwd from memory, one shift */
    return (v16f)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)p)), 16));
}

/* Rows go in tiles of 24, the rest in 16, 8, 4, 2, 1. Each tile's rows are first copied k-major into a panel
 * (xp[k * R + r]), so per k the tile's R activations are adjacent and each FMA reads its broadcast operand
 * straight from memory. */
#define MAX_TILE 24

/* Tiles of 4+ rows prefetch the group's weights PREFETCH_K values of k ahead (8 KB; past the group's end it is
 * the next group's, past the buffer's end a prefetch does not fault). Their FMAs take as long as the weights'
 * stream from memory, and without it the two added up instead of overlapping: a full-size Turbo decode step's
 * projections at 8 rows took 110 ms instead of 70 (one thread; BENCHMARKS.md). A 1-row tile is bound by memory
 * alone and the prefetches slowed it (48 -> 60 ms), at 2 rows they changed nothing. Arithmetic unchanged: the
 * same bits. */
#define PREFETCH_K 64

static int64_t tile_rows(int64_t remaining) {
    if (remaining >= MAX_TILE) return MAX_TILE;
    int64_t size = 16;
    while (size > remaining) size /= 2;
    return size;
}

/* acc[r][v] += panel[k, r] * w[k, 16 (v0 + v) + j] for k0 <= k < k1, r < R, v < V, with the accumulators
 * carried in `state` ([R][4] vectors; started from 0 when k0 == 0). V adjacent vectors give V independent FMA
 * chains per row (they hide the FMA latency when R is small); R and V are constants, so inside the k loop the
 * accumulators live in registers. Storing them between k ranges is exact, so any split of k gives the same
 * chain. */
#define TILE(R, V)                                                                                           \
    static inline __attribute__((always_inline)) void tile_##R##x##V(                                        \
        const float *xp, const uint16_t *w, int64_t k0, int64_t k1, v16f *state, int v0) {                   \
        v16f acc[R][V];                                                                                      \
        _Pragma("GCC unroll 24") for (int r = 0; r < R; r++)                                                 \
            _Pragma("GCC unroll 4") for (int v = 0; v < V; v++)                                              \
                acc[r][v] = k0 ? state[r * GROUP_VECS + v0 + v] : (v16f){0};                                 \
        for (int64_t k = k0; k < k1; k++) {                                                                  \
            if (R >= 4 && v0 == 0) { /* the first pass over a k range fetches both of its cache lines */      \
                __builtin_prefetch(w + (k + PREFETCH_K) * GROUP_OUT, 0, 3);                                  \
                __builtin_prefetch(w + (k + PREFETCH_K) * GROUP_OUT + GROUP_OUT / 2, 0, 3);                  \
            }                                                                                                \
            v16f wk[V];                                                                                      \
            _Pragma("GCC unroll 4") for (int v = 0; v < V; v++)                                              \
                wk[v] = widen(w + k * GROUP_OUT + (v0 + v) * VEC);                                           \
            _Pragma("GCC unroll 24") for (int r = 0; r < R; r++) {                                           \
                float xs = xp[k * R + r];                                                                    \
                _Pragma("GCC unroll 4") for (int v = 0; v < V; v++) acc[r][v] += wk[v] * xs;                 \
            }                                                                                                \
        }                                                                                                    \
        _Pragma("GCC unroll 24") for (int r = 0; r < R; r++)                                                 \
            _Pragma("GCC unroll 4") for (int v = 0; v < V; v++) state[r * GROUP_VECS + v0 + v] = acc[r][v];  \
    }
TILE(24, 1) TILE(16, 1) TILE(8, 2) TILE(4, 4) TILE(2, 4) TILE(1, 4)

/* y[r, 0:nn] = state[r] (+ bias): the outputs of one group, nn of its 64 real */
static void finish(const v16f *state, int64_t rows, const float *bias, float *y, int64_t ldy, int64_t nn) {
    for (int64_t r = 0; r < rows; r++) {
        float out[GROUP_OUT];
        memcpy(out, state + r * GROUP_VECS, sizeof out);
        if (bias)
            for (int64_t j = 0; j < nn; j++) out[j] += bias[j];
        memcpy(y + r * ldy, out, nn * sizeof(float));
    }
}

/* Tiles of 1-4 rows cover the group's 4 vectors in one pass over k. Tiles of 8+ rows cover 1-2 vectors per
 * pass, so they go over k in slices of KC (KC x 128 B of weights stays in L1 across the passes). */
#define KC 64

/* one group of 64 outputs (nn of them real) for every row (a switch, not pointers: each tile must inline) */
static void group_rows(const float *panel, const uint16_t *wg, const float *bias, float *y, int64_t ldy,
                       int64_t M, int64_t K, int64_t nn) {
    v16f state[MAX_TILE * GROUP_VECS] __attribute__((aligned(64)));
    for (int64_t m = 0; m < M;) {
        int64_t size = tile_rows(M - m);
        const float *xp = panel + m * K;
#define SLICED(TILE_FN, V)                                                                                   \
    for (int64_t k0 = 0; k0 < K; k0 += KC)                                                                    \
        for (int v0 = 0; v0 < GROUP_VECS; v0 += V) TILE_FN(xp, wg, k0, K - k0 < KC ? K : k0 + KC, state, v0);
        switch (size) {
            case 24: SLICED(tile_24x1, 1) break;
            case 16: SLICED(tile_16x1, 1) break;
            case 8: SLICED(tile_8x2, 2) break;
            case 4: tile_4x4(xp, wg, 0, K, state, 0); break;
            case 2: tile_2x4(xp, wg, 0, K, state, 0); break;
            default: tile_1x4(xp, wg, 0, K, state, 0); break;
        }
#undef SLICED
        finish(state, size, bias, y + m * ldy, ldy, nn);
        m += size;
    }
}

/* x [M, K] (row stride ldx), packed w, bias [N] or NULL, y [M, N] (row stride ldy), panel: M * K floats of
 * scratch (the caller's); threads > 0 */
void linear_f32_bf16w(const float *x, int64_t ldx, const uint16_t *wp, const float *bias, float *y, int64_t ldy,
                      int64_t M, int64_t N, int64_t K, int threads, float *panel) {
    for (int64_t m = 0; m < M;) {
        int64_t size = tile_rows(M - m);
        float *xp = panel + m * K;
        for (int64_t r = 0; r < size; r++)
            for (int64_t k = 0; k < K; k++) xp[k * size + r] = x[(m + r) * ldx + k];
        m += size;
    }
    int64_t ngroups = (N + GROUP_OUT - 1) / GROUP_OUT;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t g = 0; g < ngroups; g++) {
        int64_t n0 = g * GROUP_OUT, nn = N - n0 < GROUP_OUT ? N - n0 : GROUP_OUT;
        group_rows(panel, wp + g * K * GROUP_OUT, bias ? bias + n0 : 0, y + n0, ldy, M, K, nn);
    }
}
