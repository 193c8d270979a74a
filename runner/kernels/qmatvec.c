/* Fused dequantize-and-multiply for MLX's affine quantized weights, on the CPU.
 *
 * Layout (what mx.quantize writes): w is [out, in * bits / 32] uint32, each word holding
 * 32 / bits values, the lowest bits first; scales and biases are [out, in / group], and
 * W[o, i] = scale[o, g] * q[o, i] + bias[o, g] with g = i / group.
 *
 * y[r, o] = sum_g scale[o, g] * (q[o, g] . x[r, g]) + bias[o, g] * sum(x[r, g]), so the bias
 * term needs only per-group sums of x, computed once per call. Decode's matrix-vector
 * products are bound by reading the weights, so reading 4 bits instead of 32 per weight is
 * what makes this faster than a float32 GEMV, as well as 8x smaller.
 *
 * Single-threaded on purpose: on a loaded 2-core machine an OpenMP team waits at its barrier for
 * whichever thread was descheduled (measured 0.5 ms one thread vs 0.3-8 ms two, per 2048x768
 * layer), and one thread already outruns MLX's quantized matmul several times over.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

static inline float bf16_to_f32(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float load_scale(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

#ifdef __AVX2__
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* q[0..group) . x[0..group) for one group, as 8 float lanes. */
static inline __m256 group_dot(const uint32_t *w, const float *x, int bits, int group) {
    __m256 acc = _mm256_setzero_ps();
    if (bits == 4) {
        const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
        const __m256i mask = _mm256_set1_epi32(0xF);
        for (int k = 0; k < group / 8; k++) {
            __m256i q = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)w[k]), shifts),
                                         mask);
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), _mm256_loadu_ps(x + 8 * k), acc);
        }
    } else if (bits == 8) {
        const uint8_t *b = (const uint8_t *)w;
        for (int k = 0; k < group / 8; k++) {
            __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + 8 * k)));
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), _mm256_loadu_ps(x + 8 * k), acc);
        }
    } else { /* bits == 2: 16 values per word, two halves of 8 */
        const __m256i lo = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
        const __m256i hi = _mm256_setr_epi32(16, 18, 20, 22, 24, 26, 28, 30);
        const __m256i mask = _mm256_set1_epi32(0x3);
        for (int k = 0; k < group / 16; k++) {
            __m256i word = _mm256_set1_epi32((int)w[k]);
            __m256i q0 = _mm256_and_si256(_mm256_srlv_epi32(word, lo), mask);
            __m256i q1 = _mm256_and_si256(_mm256_srlv_epi32(word, hi), mask);
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q0), _mm256_loadu_ps(x + 16 * k), acc);
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q1), _mm256_loadu_ps(x + 16 * k + 8), acc);
        }
    }
    return acc;
}
#endif

/* Portable version of group_dot, summed to one float. */
static inline float group_dot_scalar(const uint32_t *w, const float *x, int bits, int group) {
    const int per_word = 32 / bits;
    const uint32_t mask = (1u << bits) - 1u;
    float acc = 0.0f;
    for (int i = 0; i < group; i++)
        acc += (float)((w[i / per_word] >> ((i % per_word) * bits)) & mask) * x[i];
    return acc;
}

static float row_dot(const uint32_t *wrow, const void *srow, const void *brow, int scale_bf16,
                     const float *x, const float *xsum, int64_t groups, int bits, int group) {
    const int64_t words = (int64_t)group * bits / 32;
    float bias_part = 0.0f;
#ifdef __AVX2__
    __m256 total = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m256 dot = group_dot(wrow + g * words, x + g * group, bits, group);
        total = _mm256_fmadd_ps(_mm256_set1_ps(load_scale(srow, g, scale_bf16)), dot, total);
        bias_part += load_scale(brow, g, scale_bf16) * xsum[g];
    }
    return hsum(total) + bias_part;
#else
    float total = 0.0f;
    for (int64_t g = 0; g < groups; g++) {
        total += load_scale(srow, g, scale_bf16) *
                 group_dot_scalar(wrow + g * words, x + g * group, bits, group);
        bias_part += load_scale(brow, g, scale_bf16) * xsum[g];
    }
    return total + bias_part;
#endif
}

/* y[rows, out] = x[rows, in] . dequant(w)^T. Returns 0, or -1 for an unsupported shape or width
 * (the caller checks first; this is a last guard, never a silent wrong answer). */
int qmatmul_affine(const float *x, int64_t rows, int64_t in_dims, const uint32_t *w,
                   const void *scales, const void *biases, int scale_bf16, int64_t out_dims,
                   int bits, int group, float *y) {
    if ((bits != 2 && bits != 4 && bits != 8) || group % 16 != 0 || in_dims % group != 0)
        return -1;
    const int64_t groups = in_dims / group;
    const int64_t words = in_dims * bits / 32;
    float *xsum = malloc(sizeof(float) * (size_t)(rows * groups));
    if (xsum == NULL)
        return -1;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t g = 0; g < groups; g++) {
            float s = 0.0f;
            for (int i = 0; i < group; i++)
                s += x[r * in_dims + g * group + i];
            xsum[r * groups + g] = s;
        }
    const size_t sbytes = scale_bf16 ? 2 : 4;
    for (int64_t o = 0; o < out_dims; o++) {
        const uint32_t *wrow = w + o * words;
        const char *srow = (const char *)scales + (size_t)(o * groups) * sbytes;
        const char *brow = (const char *)biases + (size_t)(o * groups) * sbytes;
        for (int64_t r = 0; r < rows; r++)
            y[r * out_dims + o] = row_dot(wrow, srow, brow, scale_bf16, x + r * in_dims,
                                          xsum + r * groups, groups, bits, group);
    }
    free(xsum);
    return 0;
}

/* y[rows, out] = x[rows, in] . w^T for dense bf16 weights w[out, in], on the CPU.
 *
 * A bf16 value is the top half of a float32, so widening is a 16-bit shift and every product is
 * exactly the float32 path's. Decode's matrix-vector products are bound by reading the weights:
 * reading 2 bytes per weight instead of a float32 copy's 4 is the whole gain (and the model keeps
 * its stored size). Four independent accumulators hide the FMA latency; the tail is scalar. */
#ifdef __AVX2__
static inline __m256 bf16x8(const uint16_t *p) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
#endif

static float bf16_row_dot(const uint16_t *w, const float *x, int64_t n) {
    int64_t i = 0;
    float tail = 0.0f;
#ifdef __AVX2__
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    __m256 a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    for (; i + 32 <= n; i += 32) {
        a0 = _mm256_fmadd_ps(bf16x8(w + i), _mm256_loadu_ps(x + i), a0);
        a1 = _mm256_fmadd_ps(bf16x8(w + i + 8), _mm256_loadu_ps(x + i + 8), a1);
        a2 = _mm256_fmadd_ps(bf16x8(w + i + 16), _mm256_loadu_ps(x + i + 16), a2);
        a3 = _mm256_fmadd_ps(bf16x8(w + i + 24), _mm256_loadu_ps(x + i + 24), a3);
    }
    for (; i + 8 <= n; i += 8)
        a0 = _mm256_fmadd_ps(bf16x8(w + i), _mm256_loadu_ps(x + i), a0);
    tail = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#endif
    for (; i < n; i++)
        tail += bf16_to_f32(w[i]) * x[i];
    return tail;
}

int matmul_bf16(const float *x, int64_t rows, int64_t in_dims, const uint16_t *w,
                int64_t out_dims, float *y) {
    if (rows < 0 || in_dims <= 0 || out_dims < 0)
        return -1;
    for (int64_t o = 0; o < out_dims; o++) {
        const uint16_t *wrow = w + o * in_dims;
        for (int64_t r = 0; r < rows; r++)
            y[r * out_dims + o] = bf16_row_dot(wrow, x + r * in_dims, in_dims);
    }
    return 0;
}
