/* MLX's CPU quantization, byte for byte, where MLX's own CPU code is slow.
 *
 * affine_quantize: mx.quantize with mode "affine" (int4, int8), the whole of it.
 * group_absmax, scaled_codes: the per-weight work of the fp modes (nvfp4, mxfp4, mxfp8), which
 * MLX's CPU path does as composed ops, for fp4 an argmin(|wq - LUT|) over a 16-wide expansion
 * of every weight (0.03 GB/s, 16 floats of memory per weight). The per-group scales between
 * the two steps stay MLX's own ops (runner/quant_cpu.py).
 *
 * affine_quantize
 *
 * MLX's own CPU path (fast::Quantize::eval_cpu) runs a scalar loop with a division per weight:
 * about 0.6 GB/s of bf16 on one core, the largest single cost of `ferry create -q int4`. This
 * file does the same float32 arithmetic in the same order (per group: min, max, scale, edge,
 * q0, bias; per weight: rint((w - bias) / scale), clamped to [0, 2^bits - 1]), eight lanes at a
 * time where AVX2 is there, so its output is identical to MLX's, bit for bit, and several
 * times faster. Scales and biases are rounded to the source dtype as MLX does (bf16: round to
 * nearest even, NaN to 0x7FC0).
 *
 * Layout written (affine): out is [groups * group * bits / 32] uint32, 32 / bits values per
 * word, the lowest bits first (little endian, so 8-bit values are plain bytes); one scale and
 * one bias per group. Single-threaded: the caller runs one call per thread.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1, DTYPE_F16 = 2 };
#define MAX_GROUP 128

static inline float bf16_to_f32(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    if (isnan(f)) return 0x7FC0;
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += ((u >> 16) & 1) + 0x7FFFu;
    return (uint16_t)(u >> 16);
}

#ifdef __F16C__
static inline float f16_to_f32(uint16_t v) { return _cvtsh_ss(v); }
static inline uint16_t f32_to_f16(float f) { return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }
#else
static inline float f16_to_f32(uint16_t v) {
    _Float16 h;
    memcpy(&h, &v, sizeof h);
    return (float)h;
}
static inline uint16_t f32_to_f16(float f) {
    _Float16 h = (_Float16)f;
    uint16_t v;
    memcpy(&v, &h, sizeof v);
    return v;
}
#endif

/* One group's weights as float32 (exact for every source dtype). */
static inline void widen(const void *w, int dtype, int64_t at, int group, float *dst) {
    if (dtype == DTYPE_F32) {
        memcpy(dst, (const float *)w + at, (size_t)group * sizeof(float));
    } else if (dtype == DTYPE_BF16) {
        const uint16_t *src = (const uint16_t *)w + at;
        int j = 0;
#ifdef __AVX2__
        for (; j + 8 <= group; j += 8) {
            __m128i h = _mm_loadu_si128((const __m128i *)(src + j));
            _mm256_storeu_ps(dst + j, _mm256_castsi256_ps(
                _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
        }
#endif
        for (; j < group; j++) dst[j] = bf16_to_f32(src[j]);
    } else {
        const uint16_t *src = (const uint16_t *)w + at;
        for (int j = 0; j < group; j++) dst[j] = f16_to_f32(src[j]);
    }
}

static inline void store_param(void *p, int dtype, int64_t i, float v) {
    if (dtype == DTYPE_F32) ((float *)p)[i] = v;
    else if (dtype == DTYPE_BF16) ((uint16_t *)p)[i] = f32_to_bf16(v);
    else ((uint16_t *)p)[i] = f32_to_f16(v);
}

#ifdef __AVX2__
/* The low bytes of four vectors of 32-bit lanes (each 0..255), stored as 32 bytes in order:
 * packs work within 128-bit halves, and the permute puts the bytes back in order. */
static inline void store_bytes32(const __m256i lanes[4], uint8_t *out) {
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    __m256i bytes = _mm256_packus_epi16(_mm256_packus_epi32(lanes[0], lanes[1]),
                                        _mm256_packus_epi32(lanes[2], lanes[3]));
    _mm256_storeu_si256((__m256i *)out, _mm256_permutevar8x32_epi32(bytes, order));
}
#endif

/* q[j] = clamp(rint((x[j] - bias) / scale), 0, n_bins) as integers. NaN weights become 0. */
static inline void levels(const float *x, int group, float bias, float scale, float n_bins,
                          uint8_t *q) {
    int j = 0;
#ifdef __AVX2__
    const __m256 vb = _mm256_set1_ps(bias), vs = _mm256_set1_ps(scale);
    const __m256 zero = _mm256_setzero_ps(), top = _mm256_set1_ps(n_bins);
    for (; j + 32 <= group; j += 32) {
        __m256i lanes[4];
        for (int k = 0; k < 4; k++) {
            __m256 v = _mm256_div_ps(_mm256_sub_ps(_mm256_loadu_ps(x + j + 8 * k), vb), vs);
            v = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            v = _mm256_min_ps(_mm256_max_ps(v, zero), top); /* max_ps gives 0 for NaN */
            lanes[k] = _mm256_cvttps_epi32(v);
        }
        store_bytes32(lanes, q + j);
    }
#endif
    for (; j < group; j++) {
        float v = rintf((x[j] - bias) / scale);
        v = v < 0.0f ? 0.0f : v;
        v = v > n_bins ? n_bins : v;
        q[j] = v == v ? (uint8_t)v : 0;
    }
}

/* The group's minimum and maximum as std::min / std::max fold them (a NaN never wins). */
static inline void extremes(const float *x, int group, float *lo, float *hi) {
    float w_min = INFINITY, w_max = -INFINITY;
    int j = 0;
#ifdef __AVX2__
    __m256 vmin = _mm256_set1_ps(INFINITY), vmax = _mm256_set1_ps(-INFINITY);
    for (; j + 8 <= group; j += 8) { /* (x, acc): a NaN x gives acc back */
        __m256 v = _mm256_loadu_ps(x + j);
        vmin = _mm256_min_ps(v, vmin);
        vmax = _mm256_max_ps(v, vmax);
    }
    float mins[8], maxs[8];
    _mm256_storeu_ps(mins, vmin);
    _mm256_storeu_ps(maxs, vmax);
    for (int k = 0; k < 8; k++) {
        w_min = mins[k] < w_min ? mins[k] : w_min;
        w_max = w_max < maxs[k] ? maxs[k] : w_max;
    }
#endif
    for (; j < group; j++) {
        w_max = w_max < x[j] ? x[j] : w_max;
        w_min = x[j] < w_min ? x[j] : w_min;
    }
    *lo = w_min;
    *hi = w_max;
}

static inline void pack(const uint8_t *q, int group, int bits, uint8_t *out) {
    if (bits == 8) {
        memcpy(out, q, (size_t)group);
    } else if (bits == 4) {
        for (int j = 0; j < group / 2; j++) out[j] = (uint8_t)(q[2 * j] | (q[2 * j + 1] << 4));
    } else { /* bits == 2 */
        for (int j = 0; j < group / 4; j++)
            out[j] = (uint8_t)(q[4 * j] | (q[4 * j + 1] << 2) | (q[4 * j + 2] << 4)
                               | (q[4 * j + 3] << 6));
    }
}

/* Returns 0, or -1 for a combination MLX does not define (nothing is written then). */
int affine_quantize(const void *w, int dtype, int64_t n_groups, int group, int bits,
                    uint32_t *out, void *scales, void *biases) {
    if ((group != 32 && group != 64 && group != 128) || (bits != 2 && bits != 4 && bits != 8)
        || dtype < DTYPE_F32 || dtype > DTYPE_F16)
        return -1;
    const float n_bins = (float)((1 << bits) - 1), eps = 1e-7f;
    const int out_bytes = group * bits / 8;
    float x[MAX_GROUP];
    uint8_t q[MAX_GROUP];
    for (int64_t g = 0; g < n_groups; g++) {
        widen(w, dtype, g * group, group, x);
        float w_min, w_max;
        extremes(x, group, &w_min, &w_max);
        int mask = fabsf(w_min) > fabsf(w_max);
        float scale = (w_max - w_min) / n_bins;
        scale = scale < eps ? eps : scale;
        scale = mask ? scale : -scale;
        float edge = mask ? w_min : w_max;
        float q0 = rintf(edge / scale);
        float bias = 0.0f;
        if (q0 != 0.0f) {
            scale = edge / q0;
            bias = edge;
        }
        levels(x, group, bias, scale, n_bins, q);
        pack(q, group, bits, (uint8_t *)out + g * out_bytes);
        store_param(scales, dtype, g, scale);
        store_param(biases, dtype, g, bias);
    }
    return 0;
}

static const float FP4_LUT[16] = {+0.0f, +0.5f, +1.0f, +1.5f, +2.0f, +3.0f, +4.0f, +6.0f,
                                  -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* A float rounded to the dtype MLX holds an op's result in (bf16, f16: nearest even). */
static inline float narrow(float v, int dtype) {
    if (dtype == DTYPE_BF16) return bf16_to_f32(f32_to_bf16(v));
    if (dtype == DTYPE_F16) return f16_to_f32(f32_to_f16(v));
    return v;
}

/* The index of the first smallest |narrow(v - LUT[k])|, as MLX's argmin finds it (strict <,
 * so a NaN is never picked over index 0). */
static inline uint32_t fp4_code(float v, int dtype) {
    float best = fabsf(narrow(v - FP4_LUT[0], dtype));
    uint32_t index = 0;
    for (uint32_t k = 1; k < 16; k++) {
        float d = fabsf(narrow(v - FP4_LUT[k], dtype));
        if (d < best) {
            best = d;
            index = k;
        }
    }
    return index;
}

#if defined(__AVX2__) && defined(__F16C__)
static inline __m256 narrow8(__m256 v, int dtype) {
    if (dtype == DTYPE_BF16) { /* a quiet NaN stays a NaN, and compares false either way */
        __m256i u = _mm256_castps_si256(v);
        __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        u = _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
        return _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32((int)0xFFFF0000u)));
    }
    if (dtype == DTYPE_F16)
        return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    return v;
}

/* Eight codes packed into one word, the first in the lowest bits. */
static inline uint32_t fp4_word8(__m256 v, int dtype) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 best = _mm256_andnot_ps(sign, narrow8(_mm256_sub_ps(v, _mm256_set1_ps(FP4_LUT[0])),
                                                 dtype));
    __m256i index = _mm256_setzero_si256();
    for (int k = 1; k < 16; k++) {
        __m256 d = _mm256_andnot_ps(sign, narrow8(_mm256_sub_ps(v, _mm256_set1_ps(FP4_LUT[k])),
                                                  dtype));
        __m256 less = _mm256_cmp_ps(d, best, _CMP_LT_OQ);
        best = _mm256_blendv_ps(best, d, less);
        index = _mm256_blendv_epi8(index, _mm256_set1_epi32(k), _mm256_castps_si256(less));
    }
    index = _mm256_sllv_epi32(index, _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
    __m128i folded = _mm_or_si128(_mm256_castsi256_si128(index),
                                  _mm256_extracti128_si256(index, 1));
    folded = _mm_or_si128(folded, _mm_shuffle_epi32(folded, 0x4E));
    folded = _mm_or_si128(folded, _mm_shuffle_epi32(folded, 0xB1));
    return (uint32_t)_mm_cvtsi128_si32(folded);
}

/* to_fp8_e4m3 of eight lanes, as 32-bit lanes holding the byte. */
static inline __m256i fp8_lanes(__m256 v) {
    const __m256i denorm = _mm256_set1_epi32(141 << 23);
    __m256i bits = _mm256_castps_si256(v);
    __m256i sign = _mm256_and_si256(bits, _mm256_set1_epi32((int)0x80000000u));
    bits = _mm256_xor_si256(bits, sign);
    __m256i low = _mm256_sub_epi32(_mm256_castps_si256(
        _mm256_add_ps(_mm256_castsi256_ps(bits), _mm256_castsi256_ps(denorm))), denorm);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 20), _mm256_set1_epi32(1));
    __m256i high = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(
        bits, _mm256_set1_epi32((int)(((uint32_t)(7 - 127) << 23) + 0x7FFFFu))), odd), 20);
    /* bits has no sign bit now, so signed compares order it as unsigned */
    __m256i is_low = _mm256_cmpgt_epi32(_mm256_set1_epi32(121 << 23), bits);
    __m256i is_sat = _mm256_cmpgt_epi32(bits, _mm256_set1_epi32((int)((543u << 21) - 1)));
    __m256i result = _mm256_blendv_epi8(high, low, is_low);
    result = _mm256_blendv_epi8(result, _mm256_set1_epi32(0x7E), is_sat);
    result = _mm256_or_si256(result, _mm256_srli_epi32(sign, 24));
    return _mm256_and_si256(result, _mm256_set1_epi32(0xFF));
}

/* 32 values divided by d, rounded to `dtype`, as e4m3 bytes in order. */
static inline void fp8_bytes32(const float *x, float d, int dtype, uint8_t *out) {
    const __m256 vd = _mm256_set1_ps(d);
    __m256i lanes[4];
    for (int k = 0; k < 4; k++)
        lanes[k] = fp8_lanes(narrow8(_mm256_div_ps(_mm256_loadu_ps(x + 8 * k), vd), dtype));
    store_bytes32(lanes, out);
}
#endif

/* MLX's float -> e4m3 conversion (detail::ToFP8), bit for bit: round to nearest even,
 * saturating at 448 (0x7E), a NaN included. */
static inline uint8_t to_fp8_e4m3(float f) {
    const uint32_t fp8_max = 543u << 21, denorm_mask = 141u << 23;
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    uint32_t sign = bits & 0x80000000u;
    bits ^= sign;
    uint8_t result;
    if (bits >= fp8_max) {
        result = 0x7E;
    } else if (bits < (121u << 23)) {
        float a, b;
        memcpy(&a, &bits, sizeof a);
        memcpy(&b, &denorm_mask, sizeof b);
        float sum = a + b;
        uint32_t low;
        memcpy(&low, &sum, sizeof low);
        result = (uint8_t)(low - denorm_mask);
    } else {
        uint32_t high = bits + (((uint32_t)(7 - 127) << 23) + 0x7FFFFu) + ((bits >> 20) & 1u);
        result = (uint8_t)(high >> 20);
    }
    return (uint8_t)(result | (sign >> 24));
}

/* out[g] = max |w| over group g (exact; a NaN anywhere in the group makes it NaN, so the
 * caller can leave such a tensor to MLX). Returns 0, or -1 for what it does not take. */
int group_absmax(const void *w, int dtype, int64_t n_groups, int group, float *out) {
    if (dtype < DTYPE_F32 || dtype > DTYPE_F16 || group < 1 || group > MAX_GROUP) return -1;
    float x[MAX_GROUP];
    for (int64_t g = 0; g < n_groups; g++) {
        widen(w, dtype, g * group, group, x);
        float m = 0.0f;
        int nan = 0, j = 0;
#ifdef __AVX2__
        const __m256 sign = _mm256_set1_ps(-0.0f);
        __m256 vm = _mm256_setzero_ps(), vnan = _mm256_setzero_ps();
        for (; j + 8 <= group; j += 8) {
            __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(x + j));
            vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
            vm = _mm256_max_ps(vm, a);
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, vm);
        for (int k = 0; k < 8; k++) m = lanes[k] > m ? lanes[k] : m;
        nan = _mm256_movemask_ps(vnan) != 0;
#endif
        for (; j < group; j++) {
            float a = fabsf(x[j]);
            nan |= a != a;
            m = a > m ? a : m;
        }
        out[g] = nan ? NAN : m;
    }
    return 0;
}

enum { CODES_FP4 = 0, CODES_FP4_F32 = 1, CODES_FP8 = 2 };

/* The fp modes' per-weight step: v = w / divisor[g], rounded to the source dtype (MLX divides
 * in it), then its code: e2m1 (the first nearest LUT entry, each difference rounded to the
 * source dtype, or kept in float32 for CODES_FP4_F32: nvfp4 multiplies by a float32 1.0 first)
 * packed eight to a word, or e4m3 bytes. `group` a multiple of 8. Returns 0, or -1. */
int scaled_codes(const void *w, int dtype, int64_t n_groups, int group, const float *divisor,
                 int kind, void *out) {
    if (dtype < DTYPE_F32 || dtype > DTYPE_F16 || group < 8 || group > MAX_GROUP || group % 8
        || kind < CODES_FP4 || kind > CODES_FP8)
        return -1;
    const int sub_dtype = kind == CODES_FP4_F32 ? DTYPE_F32 : dtype;
    float x[MAX_GROUP];
    for (int64_t g = 0; g < n_groups; g++) {
        widen(w, dtype, g * group, group, x);
        const float d = divisor[g];
        if (kind == CODES_FP8) {
            uint8_t *bytes = (uint8_t *)out + g * group;
            int j = 0;
#if defined(__AVX2__) && defined(__F16C__)
            for (; j + 32 <= group; j += 32) fp8_bytes32(x + j, d, dtype, bytes + j);
#endif
            for (; j < group; j++) bytes[j] = to_fp8_e4m3(narrow(x[j] / d, dtype));
            continue;
        }
        uint32_t *words = (uint32_t *)out + g * (group / 8);
        for (int j = 0; j < group; j += 8) {
#if defined(__AVX2__) && defined(__F16C__)
            __m256 v = narrow8(_mm256_div_ps(_mm256_loadu_ps(x + j), _mm256_set1_ps(d)), dtype);
            words[j / 8] = fp4_word8(v, sub_dtype);
#else
            uint32_t word = 0;
            for (int k = 0; k < 8; k++)
                word |= fp4_code(narrow(x[j + k] / d, dtype), sub_dtype) << (4 * k);
            words[j / 8] = word;
#endif
        }
    }
    return 0;
}
