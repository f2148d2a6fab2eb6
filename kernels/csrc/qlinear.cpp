// agentspec.kernels._cpu: y = x @ W.T with W kept quantized (GGUF's 4- to 8-bit types), for decode,
// verification and prefill rows on CPU.
//
// Weights. agentspec.kernels.cpu_quant repacks every GGUF block type at load into one of four
// layouts, each "w = scale * q + min" per block of B consecutive input columns (B = 32 or 16),
// exactly the value the gguf reference dequantizer gives (the scale and min are float32 products
// of the file's float16 / 6-bit / 8-bit scale fields, exact in float32):
//   U4  q in [0, 15] (Q4_0, Q4_1), B = 32, two per byte; float32 scale and min per block
//   I8  q in [-128, 127] stored as q + 128 (Q5_0, Q5_1, Q5_K, Q8_0, Q2_K, Q3_K), B = 16 or 32;
//       float32 scale (and min) per block
//   U4K Q4_K: U4's nibbles; the scale and min from the super-block's (256 columns) float32 d and
//       -dmin times the block's 6-bit sc and m (bytes): the same products, a quarter of the bytes
//   U6K Q6_K: q + 32 in [0, 63]: its low 4 bits as U4's nibbles (B = 16: two steps), its high 2 bits
//       in one 64-byte plane per block (lane r, byte i: bits 2k..2k+1 for step s = k / 2, half h = k % 2,
//       weight 8s + 4h + i); scale d * sc (int8 sc), and the integer sum corrected by 32 * sum q_x
// Rows come in panels of 16 output rows, interleaved for broadcasting x: per block, "steps" of 64
// bytes, each holding 4 consecutive weights of each of the 16 rows (lane r = bytes 4r .. 4r + 3);
// a nibble step holds 8 weights per row (byte i: weight i in its low nibble, weight i + 4 in its
// high). The scales and mins are arrays of their own, 16 lanes per (panel, block or super-block).
//
// Activations. Each row of x is quantized on its own (quantize_row, one scalar implementation
// every ISA level shares): per 32 columns, d = amax / 127 and q = round-to-nearest-even(x / d) in
// [-127, 127] (llama.cpp's Q8_0 activation). So a row's result depends on that row alone.
//
// Arithmetic of output (m, n), identical at every ISA level: for each weight block j in order,
//   isum = sum_i q_w[i] * q_x[i]       (exact, int32: the order does not matter)
//   t    = (float)isum * d_x(j)
//   acc  = acc + scale_j * t           (a float32 multiply, then an add: no FMA anywhere)
//   acc  = acc + min_j * xsf_j         (types with a min; xsf_j = d_x(j) * (float)sum_i q_x[i])
// then rounded once to bfloat16. The integer sums are exact in every body (AVX512-VNNI's VPDPBUSD
// on q + 128 minus 128 * sum q_x; AVX2's VPMADDUBSW on |q| and sign-adjusted x, whose int16 pair
// sums cannot saturate: |q| <= 128, |q_x| <= 127), and the float steps are the same IEEE
// operations in the same order, so every level gives the same bits, and a row's bits do not
// depend on how many rows share the call or how the panels are split between threads.
#include <nanobind/nanobind.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "bf16.h"
#include "kernels.h"

namespace nb = nanobind;

namespace {

enum { FMT_U4 = 0, FMT_I8 = 1, FMT_U4K = 2, FMT_U6K = 3 };
constexpr int PF_AHEAD = 2048;   // bytes of weights the VNNI body prefetches ahead of the block it reads

struct QW {  // one repacked weight
    const uint8_t* q;
    const float* sc;   // U4 / I8: float32 scale per (panel, block, lane); U4K / U6K: per super-block d
    const float* mn;   // U4 / I8: float32 min (null: none); U4K: per super-block -dmin
    const uint8_t* s8; // U4K: 6-bit sc per (panel, block, lane); U6K: int8 sc
    const uint8_t* m8; // U4K: 6-bit m
    int fmt, B;
    int64_t N, K, nb;  // nb = K / B blocks per row
    int64_t qbytes;    // bytes of q per (panel, block)
    int64_t ns;        // super-blocks (256 columns) per row (U4K / U6K)
};

// lane r's scale and min of block j in panel p (the float32 products the gguf dequantizer forms)
static inline float lane_scale(const QW& w, int64_t p, int64_t j, int r) {
    if (w.fmt == FMT_U4K)
        return w.sc[(p * w.ns + (j * w.B) / 256) * 16 + r] * (float)w.s8[(p * w.nb + j) * 16 + r];
    if (w.fmt == FMT_U6K)
        return w.sc[(p * w.ns + (j * w.B) / 256) * 16 + r] * (float)(int8_t)w.s8[(p * w.nb + j) * 16 + r];
    return w.sc[(p * w.nb + j) * 16 + r];
}
static inline float lane_min(const QW& w, int64_t p, int64_t j, int r) {
    if (w.fmt == FMT_U4K)
        return w.mn[(p * w.ns + (j * w.B) / 256) * 16 + r] * (float)w.m8[(p * w.nb + j) * 16 + r];
    return w.mn[(p * w.nb + j) * 16 + r];
}

struct QX {  // quantized rows of x
    const int8_t* q;   // [M, K]
    const float* dx;   // [M, K / 32]
    const int32_t* xs; // [M, K / B]: sum of q over weight block j
    const float* xsf;  // [M, K / B]: dx(j) * (float)xs
    int64_t K, nbx, nbw;
};

static inline int32_t load_i32(const void* p) { int32_t v; std::memcpy(&v, p, 4); return v; }

// What a row of x goes through before it is quantized (one scalar implementation for every ISA
// level, row by row: the same bits everywhere):
//   ACT_NONE    x as it is
//   ACT_RMSNORM x * r * w rounded to bfloat16, r = 1 / sqrt(sum(x * x) / K + eps) (the sum in
//               column order, float32): a projection's input norm, fused
enum { ACT_NONE = 0, ACT_RMSNORM = 1 };

static inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

// One row of bfloat16 x -> int8 per 32 columns (see the header); xs / xsf per weight block of B.
static void quantize_row(const uint16_t* x, int64_t K, int B, int8_t* q, float* dx, int32_t* xs, float* xsf,
                         int act, const uint16_t* nw, float eps, float* f) {
    if (act == ACT_RMSNORM) {
        float ss = 0.0f;
        for (int64_t i = 0; i < K; ++i) {
            const float v = bf16_to_float(x[i]);
            ss = ss + v * v;
        }
        const float r = 1.0f / std::sqrt(ss / (float)K + eps);
        for (int64_t i = 0; i < K; ++i) f[i] = round_bf16(bf16_to_float(x[i]) * r * bf16_to_float(nw[i]));
    } else {
        for (int64_t i = 0; i < K; ++i) f[i] = bf16_to_float(x[i]);
    }
    for (int64_t b = 0; b < K / 32; ++b) {
        const float* fb = f + 32 * b;
        float amax = 0.0f;
        for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(fb[i]));
        const float d = amax / 127.0f;
        const float id = d != 0.0f && std::isfinite(d) ? 1.0f / d : 0.0f;
        dx[b] = d;
        for (int i = 0; i < 32; ++i) {
            float v = std::nearbyint(fb[i] * id);
            v = std::min(127.0f, std::max(-127.0f, v));
            q[32 * b + i] = (int8_t)(std::isnan(v) ? 0 : (int)v);
        }
    }
    for (int64_t j = 0; j < K / B; ++j) {
        int32_t s = 0;
        for (int i = 0; i < B; ++i) s += q[B * j + i];
        xs[j] = s;
        xsf[j] = dx[(B * j) / 32] * (float)s;
    }
}

static inline int64_t row_block(int64_t K) { return std::max<int64_t>(4, std::min<int64_t>(64, 96 * 1024 / K / 4 * 4)); }

static inline void store_row_bf16(uint16_t* dst, const float* acc, int n) {
    for (int l = 0; l < n; ++l) dst[l] = float_to_bf16(acc[l]);
}

// ---- the plain reference (ISA level 0, and Arm for now): one output at a time ----------------
namespace qscalar {

static void panels(const QW& w, const QX& x, int64_t M, uint16_t* out, int64_t o_st, int64_t p0, int64_t p1) {
    const bool nib = w.fmt != FMT_I8;
    const int steps = nib ? w.B / 8 : w.B / 4;
    for (int64_t p = p0; p < p1; ++p) {
        for (int64_t m = 0; m < M; ++m) {
            float acc[16] = {0};
            const int8_t* xq = x.q + m * x.K;
            for (int64_t j = 0; j < w.nb; ++j) {
                const uint8_t* wb = w.q + (p * w.nb + j) * w.qbytes;
                const int8_t* xb = xq + j * w.B;
                const float dxb = x.dx[m * x.nbx + (j * w.B) / 32];
                for (int r = 0; r < 16; ++r) {
                    int32_t isum = 0;
                    for (int s = 0; s < steps; ++s) {
                        const uint8_t* lane = wb + 64 * s + 4 * r;
                        for (int i = 0; i < 4; ++i) {
                            if (nib) {
                                int32_t lo = lane[i] & 0x0F, hi = lane[i] >> 4;
                                if (w.fmt == FMT_U6K) {
                                    const uint8_t hb = wb[64 * steps + 4 * r + i];
                                    lo |= ((hb >> (2 * (2 * s))) & 3) << 4;
                                    hi |= ((hb >> (2 * (2 * s + 1))) & 3) << 4;
                                }
                                isum += lo * xb[8 * s + i] + hi * xb[8 * s + 4 + i];
                            } else {
                                isum += ((int32_t)lane[i] - 128) * xb[4 * s + i];
                            }
                        }
                    }
                    if (w.fmt == FMT_U6K) isum -= 32 * x.xs[m * x.nbw + j];
                    const float t = (float)isum * dxb;
                    acc[r] = acc[r] + lane_scale(w, p, j, r) * t;
                    if (w.mn) acc[r] = acc[r] + lane_min(w, p, j, r) * x.xsf[m * x.nbw + j];
                }
            }
            const int64_t n0 = 16 * p;
            store_row_bf16(out + m * o_st + n0, acc, (int)std::min<int64_t>(16, w.N - n0));
        }
    }
}

}  // namespace qscalar

#if defined(AGENTSPEC_X86)
// ---- AVX2 (also the AVX-512 level without VNNI): 16 rows as two 8-lane halves -----------------
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi,bmi2,lzcnt,movbe,popcnt")
namespace qavx2 {

// lanes [8h, 8h + 8) of block j's scale / min (U4K / U6K: super-block d times the block's byte)
template <int FMT>
static inline __m256 scale8(const QW& w, int64_t p, int64_t j, int h) {
    if (FMT == FMT_U4K || FMT == FMT_U6K) {
        const __m256 d = _mm256_loadu_ps(w.sc + (p * w.ns + (j * w.B) / 256) * 16 + 8 * h);
        const __m128i b = _mm_loadl_epi64((const __m128i*)(w.s8 + (p * w.nb + j) * 16 + 8 * h));
        return _mm256_mul_ps(d, _mm256_cvtepi32_ps(FMT == FMT_U4K ? _mm256_cvtepu8_epi32(b) : _mm256_cvtepi8_epi32(b)));
    }
    return _mm256_loadu_ps(w.sc + (p * w.nb + j) * 16 + 8 * h);
}
template <int FMT>
static inline __m256 min8(const QW& w, int64_t p, int64_t j, int h) {
    if (FMT == FMT_U4K) {
        const __m256 d = _mm256_loadu_ps(w.mn + (p * w.ns + (j * w.B) / 256) * 16 + 8 * h);
        const __m128i b = _mm_loadl_epi64((const __m128i*)(w.m8 + (p * w.nb + j) * 16 + 8 * h));
        return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)));
    }
    return _mm256_loadu_ps(w.mn + (p * w.nb + j) * 16 + 8 * h);
}

template <int MR, int FMT, bool MIN>
static inline __attribute__((always_inline)) void tile(const QW& w, const QX& x, int64_t m0, int64_t p,
                                                      uint16_t* out, int64_t o_st) {
    __m256 acc[MR][2];
    for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1), low4 = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8((char)0x80);
    const __m256i three = _mm256_set1_epi8(3);
    constexpr bool NIB = FMT != FMT_I8;
    const int steps = NIB ? w.B / 8 : w.B / 4;
    for (int64_t j = 0; j < w.nb; ++j) {
        const uint8_t* wb = w.q + (p * w.nb + j) * w.qbytes;
        __m256i is[MR][2];
        for (int m = 0; m < MR; ++m) is[m][0] = is[m][1] = _mm256_setzero_si256();
        if (FMT == FMT_U4 || FMT == FMT_U4K) {
            // int16 partial sums: 16 products of at most 15 * 127 per lane over the block's 4 steps
            __m256i s16[MR][2];
            for (int m = 0; m < MR; ++m) s16[m][0] = s16[m][1] = _mm256_setzero_si256();
            for (int s = 0; s < steps; ++s) {
                __m256i lo[2], hi[2];
                for (int h = 0; h < 2; ++h) {
                    const __m256i v = _mm256_loadu_si256((const __m256i*)(wb + 64 * s + 32 * h));
                    lo[h] = _mm256_and_si256(v, low4);
                    hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
                }
                for (int m = 0; m < MR; ++m) {
                    const int8_t* xr = x.q + (m0 + m) * x.K + j * w.B + 8 * s;
                    const __m256i xl = _mm256_set1_epi32(load_i32(xr)), xh = _mm256_set1_epi32(load_i32(xr + 4));
                    for (int h = 0; h < 2; ++h)
                        s16[m][h] = _mm256_add_epi16(s16[m][h], _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], xl),
                                                                                 _mm256_maddubs_epi16(hi[h], xh)));
                }
            }
            for (int m = 0; m < MR; ++m)
                for (int h = 0; h < 2; ++h) is[m][h] = _mm256_madd_epi16(s16[m][h], ones);
        } else if (FMT == FMT_U6K) {
            // q + 32 in [0, 63]: a step's two products per int16 lane pair stay under 2 * 2 * 63 * 127
            __m256i hv[2];
            for (int h = 0; h < 2; ++h) hv[h] = _mm256_loadu_si256((const __m256i*)(wb + 64 * steps + 32 * h));
            for (int s = 0; s < steps; ++s) {
                __m256i lo[2], hi[2];
                for (int h = 0; h < 2; ++h) {
                    const __m256i v = _mm256_loadu_si256((const __m256i*)(wb + 64 * s + 32 * h));
                    const __m256i bl = _mm256_and_si256(_mm256_srli_epi16(hv[h], 4 * s), three);
                    const __m256i bh = _mm256_and_si256(_mm256_srli_epi16(hv[h], 4 * s + 2), three);
                    lo[h] = _mm256_or_si256(_mm256_and_si256(v, low4), _mm256_slli_epi16(bl, 4));
                    hi[h] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4), _mm256_slli_epi16(bh, 4));
                }
                for (int m = 0; m < MR; ++m) {
                    const int8_t* xr = x.q + (m0 + m) * x.K + j * w.B + 8 * s;
                    const __m256i xl = _mm256_set1_epi32(load_i32(xr)), xh = _mm256_set1_epi32(load_i32(xr + 4));
                    for (int h = 0; h < 2; ++h)
                        is[m][h] = _mm256_add_epi32(is[m][h], _mm256_madd_epi16(
                            _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], xl), _mm256_maddubs_epi16(hi[h], xh)), ones));
                }
            }
            for (int m = 0; m < MR; ++m) {
                const __m256i c = _mm256_set1_epi32(32 * x.xs[(m0 + m) * x.nbw + j]);
                for (int h = 0; h < 2; ++h) is[m][h] = _mm256_sub_epi32(is[m][h], c);
            }
        } else {
            for (int s = 0; s < steps; ++s) {
                __m256i a[2], sg[2];
                for (int h = 0; h < 2; ++h) {
                    sg[h] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(wb + 64 * s + 32 * h)), flip);
                    a[h] = _mm256_abs_epi8(sg[h]);
                }
                for (int m = 0; m < MR; ++m) {
                    const __m256i xb = _mm256_set1_epi32(load_i32(x.q + (m0 + m) * x.K + j * w.B + 4 * s));
                    for (int h = 0; h < 2; ++h)
                        is[m][h] = _mm256_add_epi32(
                            is[m][h], _mm256_madd_epi16(_mm256_maddubs_epi16(a[h], _mm256_sign_epi8(xb, sg[h])), ones));
                }
            }
        }
        const __m256 sc0 = scale8<FMT>(w, p, j, 0), sc1 = scale8<FMT>(w, p, j, 1);
        __m256 mn0 = _mm256_setzero_ps(), mn1 = mn0;
        if (MIN) {
            mn0 = min8<FMT>(w, p, j, 0);
            mn1 = min8<FMT>(w, p, j, 1);
        }
        for (int m = 0; m < MR; ++m) {
            const __m256 d = _mm256_set1_ps(x.dx[(m0 + m) * x.nbx + (j * w.B) / 32]);
            const __m256 t0 = _mm256_mul_ps(_mm256_cvtepi32_ps(is[m][0]), d);
            const __m256 t1 = _mm256_mul_ps(_mm256_cvtepi32_ps(is[m][1]), d);
            acc[m][0] = _mm256_add_ps(acc[m][0], _mm256_mul_ps(sc0, t0));
            acc[m][1] = _mm256_add_ps(acc[m][1], _mm256_mul_ps(sc1, t1));
            if (MIN) {
                const __m256 xf = _mm256_set1_ps(x.xsf[(m0 + m) * x.nbw + j]);
                acc[m][0] = _mm256_add_ps(acc[m][0], _mm256_mul_ps(mn0, xf));
                acc[m][1] = _mm256_add_ps(acc[m][1], _mm256_mul_ps(mn1, xf));
            }
        }
    }
    const int64_t n0 = 16 * p;
    const int n = (int)std::min<int64_t>(16, w.N - n0);
    for (int m = 0; m < MR; ++m) {
        float a[16];
        _mm256_storeu_ps(a, acc[m][0]);
        _mm256_storeu_ps(a + 8, acc[m][1]);
        store_row_bf16(out + (m0 + m) * o_st + n0, a, n);
    }
}

#include "qlinear_run.inc"

}  // namespace qavx2
#pragma GCC pop_options

// ---- AVX512-VNNI: 16 rows in one zmm, VPDPBUSD ------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi,bmi2,lzcnt,movbe,popcnt,avx512f,avx512bw,avx512vl,avx512dq,avx512cd,avx512vnni")
namespace qvnni {

template <int FMT>
static inline __m512 scale16(const QW& w, int64_t p, int64_t j) {
    if (FMT == FMT_U4K || FMT == FMT_U6K) {
        const __m512 d = _mm512_loadu_ps(w.sc + (p * w.ns + (j * w.B) / 256) * 16);
        const __m128i b = _mm_loadu_si128((const __m128i*)(w.s8 + (p * w.nb + j) * 16));
        return _mm512_mul_ps(d, _mm512_cvtepi32_ps(FMT == FMT_U4K ? _mm512_cvtepu8_epi32(b) : _mm512_cvtepi8_epi32(b)));
    }
    return _mm512_loadu_ps(w.sc + (p * w.nb + j) * 16);
}
template <int FMT>
static inline __m512 min16(const QW& w, int64_t p, int64_t j) {
    if (FMT == FMT_U4K) {
        const __m512 d = _mm512_loadu_ps(w.mn + (p * w.ns + (j * w.B) / 256) * 16);
        const __m128i b = _mm_loadu_si128((const __m128i*)(w.m8 + (p * w.nb + j) * 16));
        return _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)));
    }
    return _mm512_loadu_ps(w.mn + (p * w.nb + j) * 16);
}

template <int MR, int FMT, bool MIN>
static inline __attribute__((always_inline)) void tile(const QW& w, const QX& x, int64_t m0, int64_t p,
                                                      uint16_t* out, int64_t o_st) {
    __m512 acc[MR];
    for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
    const __m512i low4 = _mm512_set1_epi8(0x0F), three = _mm512_set1_epi8(3);
    constexpr bool NIB = FMT != FMT_I8;
    const int steps = NIB ? w.B / 8 : w.B / 4;
    for (int64_t j = 0; j < w.nb; ++j) {
        const uint8_t* wb = w.q + (p * w.nb + j) * w.qbytes;
        _mm_prefetch((const char*)(wb + PF_AHEAD), _MM_HINT_T0);
        _mm_prefetch((const char*)(wb + PF_AHEAD + 64), _MM_HINT_T0);
        _mm_prefetch((const char*)(wb + PF_AHEAD + 128), _MM_HINT_T0);
        _mm_prefetch((const char*)(wb + PF_AHEAD + 192), _MM_HINT_T0);
        __m512i is[MR];
        for (int m = 0; m < MR; ++m) is[m] = _mm512_setzero_si512();
        __m512i hv = _mm512_setzero_si512();
        if (FMT == FMT_U6K) hv = _mm512_loadu_si512((const void*)(wb + 64 * steps));
        for (int s = 0; s < steps; ++s) {
            const __m512i v = _mm512_loadu_si512((const void*)(wb + 64 * s));
            if (NIB) {
                __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
                if (FMT == FMT_U6K) {
                    lo = _mm512_or_si512(lo, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hv, 4 * s), three), 4));
                    hi = _mm512_or_si512(hi, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hv, 4 * s + 2), three), 4));
                }
                for (int m = 0; m < MR; ++m) {
                    const int8_t* xr = x.q + (m0 + m) * x.K + j * w.B + 8 * s;
                    is[m] = _mm512_dpbusd_epi32(is[m], lo, _mm512_set1_epi32(load_i32(xr)));
                    is[m] = _mm512_dpbusd_epi32(is[m], hi, _mm512_set1_epi32(load_i32(xr + 4)));
                }
            } else {
                for (int m = 0; m < MR; ++m)
                    is[m] = _mm512_dpbusd_epi32(is[m], v,
                                                _mm512_set1_epi32(load_i32(x.q + (m0 + m) * x.K + j * w.B + 4 * s)));
            }
        }
        const __m512 sc = scale16<FMT>(w, p, j);
        const __m512 mn = MIN ? min16<FMT>(w, p, j) : _mm512_setzero_ps();
        for (int m = 0; m < MR; ++m) {
            __m512i i = is[m];
            if (FMT == FMT_I8)  // the weights were q + 128
                i = _mm512_sub_epi32(i, _mm512_set1_epi32(128 * x.xs[(m0 + m) * x.nbw + j]));
            if (FMT == FMT_U6K)  // and these q + 32
                i = _mm512_sub_epi32(i, _mm512_set1_epi32(32 * x.xs[(m0 + m) * x.nbw + j]));
            const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(i), _mm512_set1_ps(x.dx[(m0 + m) * x.nbx + (j * w.B) / 32]));
            acc[m] = _mm512_add_ps(acc[m], _mm512_mul_ps(sc, t));
            if (MIN) acc[m] = _mm512_add_ps(acc[m], _mm512_mul_ps(mn, _mm512_set1_ps(x.xsf[(m0 + m) * x.nbw + j])));
        }
    }
    const int64_t n0 = 16 * p;
    const int n = (int)std::min<int64_t>(16, w.N - n0);
    for (int m = 0; m < MR; ++m) {
        float a[16];
        _mm512_storeu_ps(a, acc[m]);
        store_row_bf16(out + (m0 + m) * o_st + n0, a, n);
    }
}

#include "qlinear_run.inc"

}  // namespace qvnni
#pragma GCC pop_options
#endif

using panels_fn = void (*)(const QW&, const QX&, int64_t, uint16_t*, int64_t, int64_t, int64_t);

static bool has_vnni() {
#if defined(AGENTSPEC_X86)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni");
#else
    return false;
#endif
}

static panels_fn panels_for(int isa) {
#if defined(AGENTSPEC_X86)
    static const bool vnni = has_vnni();
    if (isa >= 3 && vnni) return qvnni::panels;
    if (isa >= 2) return qavx2::panels;
#endif
    (void)isa;
    return qscalar::panels;
}

}  // namespace

const char* qlinear_body() {
#if defined(AGENTSPEC_X86)
    const int isa = agentspec_isa();
    if (isa >= 3 && has_vnni()) return "avx512vnni";
    if (isa >= 2) return "avx2";
#endif
    return "scalar";
}

// x: bfloat16 [M, K] (row stride x_st); the repacked weight (q, sc, mn: see the header; mn 0 for
// none); out: bfloat16 [M, N] (row stride o_st). Runs the body of the ISA level set by set_isa.
void linear_q(uintptr_t x, int64_t x_st, int64_t M, uintptr_t q, uintptr_t sc, uintptr_t mn, uintptr_t s8,
              uintptr_t m8, int fmt, int B, int64_t N, int64_t K, uintptr_t out, int64_t o_st, int threads, int act,
              uintptr_t norm_w, double eps) {
    const bool k = fmt == FMT_U4K || fmt == FMT_U6K;
    if (act < ACT_NONE || act > ACT_RMSNORM || (act == ACT_RMSNORM && !norm_w))
        throw std::invalid_argument("linear_q: bad activation mode");
    if (M <= 0 || N <= 0 || K <= 0 || K % 32 != 0 || x_st < K || o_st < N || fmt < FMT_U4 || fmt > FMT_U6K ||
        ((fmt == FMT_U4 || fmt == FMT_U4K) && B != 32) || (fmt == FMT_I8 && B != 16 && B != 32) ||
        (fmt == FMT_U6K && B != 16) || (k && (K % 256 != 0 || !s8)) || (fmt == FMT_U4K && (!mn || !m8)))
        throw std::invalid_argument("linear_q: bad shapes, strides or format");
    const int64_t qbytes = fmt == FMT_I8 ? (int64_t)16 * B : fmt == FMT_U6K ? (int64_t)16 * B * 3 / 4 : (int64_t)16 * B / 2;
    QW w{reinterpret_cast<const uint8_t*>(q), reinterpret_cast<const float*>(sc),
         mn ? reinterpret_cast<const float*>(mn) : nullptr, reinterpret_cast<const uint8_t*>(s8),
         reinterpret_cast<const uint8_t*>(m8), fmt, B, N, K, K / B, qbytes, K / 256};
    const panels_fn panels = panels_for(agentspec_isa());
    const int64_t NP = (N + 15) / 16;
    if (threads <= 0) threads = omp_get_max_threads();
    nb::gil_scoped_release nogil;
    static thread_local std::vector<int8_t> xq;
    static thread_local std::vector<float> dx, xsf;
    static thread_local std::vector<int32_t> xs;
    static thread_local std::vector<float> fbuf;
    xq.resize((size_t)(M * K));
    dx.resize((size_t)(M * (K / 32)));
    xs.resize((size_t)(M * (K / B)));
    xsf.resize((size_t)(M * (K / B)));
    const uint16_t* xh = reinterpret_cast<const uint16_t*>(x);
    int8_t* xqp = xq.data();
    float *dxp = dx.data(), *xsfp = xsf.data();
    int32_t* xsp = xs.data();
    const int qt = (int)std::max<int64_t>(1, std::min<int64_t>(threads, M));
    fbuf.resize((size_t)(qt * K));
    float* fb = fbuf.data();
    const uint16_t* nw = reinterpret_cast<const uint16_t*>(norm_w);
    const float e = (float)eps;
    if (qt == 1) {
        for (int64_t m = 0; m < M; ++m)
            quantize_row(xh + m * x_st, K, B, xqp + m * K, dxp + m * (K / 32), xsp + m * (K / B), xsfp + m * (K / B),
                         act, nw, e, fb);
    } else {
#pragma omp parallel for num_threads(qt) schedule(static)
        for (int64_t m = 0; m < M; ++m)
            quantize_row(xh + m * x_st, K, B, xqp + m * K, dxp + m * (K / 32), xsp + m * (K / B), xsfp + m * (K / B),
                         act, nw, e, fb + (int64_t)omp_get_thread_num() * K);
    }
    const QX xx{xqp, dxp, xsp, xsfp, K, K / 32, K / B};
    uint16_t* o = reinterpret_cast<uint16_t*>(out);
    const int nt = (int)std::max<int64_t>(1, std::min<int64_t>(threads, NP));
#pragma omp parallel num_threads(nt)
    {
        const int t = omp_get_thread_num(), n = omp_get_num_threads();
        panels(w, xx, M, o, o_st, NP * t / n, NP * (t + 1) / n);
    }
}

// ---- repacking at load: Q4_K -> U4K and Q6_K -> U6K, native ----------------------------------
// The layouts cpu_quant._repack_k makes with numpy (and tests against this): per 16-row panel p
// and block b, the block's bytes (U4K: 4 steps x 16 rows x 4 bytes, byte i of a step = weight
// 8s+i | weight 8s+4+i << 4; U6K: the same low nibbles of 16-weight blocks, 2 steps, then a
// 16 x 4-byte plane of the high 2 bits, bits 2k..2k+1 of byte i = weight 8*(k/2) + 4*(k%2) + i),
// and per panel, super-block and row the f16 scales as floats (U4K: d, -dmin; U6K: d), per block
// and row the 6-bit (U4K: scale, min) or int8 (U6K) sub-scales. Rows past N read as zeros.
namespace {

static inline float f16_to_float(uint16_t h) {   // exact, as numpy's float16 -> float32
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else {  // subnormal: normalise
            int e = 113;
            while (!(mant & 0x400u)) { mant <<= 1; --e; }
            bits = sign | ((uint32_t)e << 23) | ((mant & 0x3ffu) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t load_u16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }

// one super-block (256 weights) of one row: the 256 values (Q4_K: 0..15; Q6_K: 0..63)
static inline void q4k_values(const uint8_t* blk, uint8_t* v) {
    const uint8_t* qs = blk + 16;
    for (int c = 0; c < 4; ++c)
        for (int l = 0; l < 32; ++l) {
            v[c * 64 + l] = qs[c * 32 + l] & 0x0F;
            v[c * 64 + 32 + l] = qs[c * 32 + l] >> 4;
        }
}
static inline void q6k_values(const uint8_t* blk, uint8_t* v) {
    const uint8_t *ql = blk, *qh = blk + 128;
    for (int h = 0; h < 2; ++h)
        for (int l = 0; l < 32; ++l) {
            const uint8_t a = ql[h * 64 + l], b = ql[h * 64 + 32 + l], hb = qh[h * 32 + l];
            uint8_t* o = v + h * 128;
            o[l] = (a & 0x0F) | ((hb & 3) << 4);
            o[32 + l] = (b & 0x0F) | (((hb >> 2) & 3) << 4);
            o[64 + l] = (a >> 4) | (((hb >> 4) & 3) << 4);
            o[96 + l] = (b >> 4) | (((hb >> 6) & 3) << 4);
        }
}

}  // namespace

// raw: [N, K / 256 * block bytes] uint8 (rows of row stride raw_st bytes); outputs as
// cpu_quant._repack_k allocates them for NP = ceil(N / 16) panels.
void repack_k(uintptr_t raw, int64_t raw_st, int64_t N, int64_t K, int qbits, uintptr_t q, uintptr_t scale,
              uintptr_t mins, uintptr_t sub, uintptr_t sub_mins, int threads) {
    if (N <= 0 || K <= 0 || K % 256 != 0 || (qbits != 4 && qbits != 6) || (qbits == 4 && (!mins || !sub_mins)))
        throw std::invalid_argument("repack_k: bad shapes or type");
    const int64_t ts = qbits == 4 ? 144 : 210, ns = K / 256, NP = (N + 15) / 16;
    if (raw_st < ns * ts) throw std::invalid_argument("repack_k: row stride below the row's bytes");
    const int64_t nb = qbits == 4 ? K / 32 : K / 16;          // blocks per row
    const int64_t bb = qbits == 4 ? 256 : 192;                // bytes per (panel, block)
    const int per = qbits == 4 ? 8 : 16;                      // blocks per super-block
    const uint8_t* rp = reinterpret_cast<const uint8_t*>(raw);
    uint8_t* qo = reinterpret_cast<uint8_t*>(q);
    float* so = reinterpret_cast<float*>(scale);
    float* mo = reinterpret_cast<float*>(mins);
    uint8_t* s8 = reinterpret_cast<uint8_t*>(sub);
    uint8_t* m8 = reinterpret_cast<uint8_t*>(sub_mins);
    if (threads <= 0) threads = omp_get_max_threads();
    nb::gil_scoped_release nogil;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < NP * ns; ++t) {
        const int64_t p = t / ns, s = t % ns;
        static const uint8_t zeros[210] = {};
        uint8_t v[16][256];
        for (int r = 0; r < 16; ++r) {
            const int64_t row = p * 16 + r;
            const uint8_t* blk = row < N ? rp + row * raw_st + s * ts : zeros;
            float d = f16_to_float(load_u16(qbits == 4 ? blk : blk + 208));
            so[(p * ns + s) * 16 + r] = d;
            if (qbits == 4) {
                q4k_values(blk, v[r]);
                mo[(p * ns + s) * 16 + r] = -f16_to_float(load_u16(blk + 2));
                const uint8_t* sc = blk + 4;   // 12 bytes: d[4], m[4], m_d[4]
                for (int j = 0; j < 8; ++j) {
                    uint8_t a, b;
                    if (j < 4) {
                        a = sc[j] & 0x3F;
                        b = sc[4 + j] & 0x3F;
                    } else {
                        a = (sc[8 + j - 4] & 0x0F) | ((sc[j - 4] >> 2) & 0x30);
                        b = (sc[8 + j - 4] >> 4) | ((sc[4 + j - 4] >> 2) & 0x30);
                    }
                    s8[(p * nb + s * per + j) * 16 + r] = a;
                    m8[(p * nb + s * per + j) * 16 + r] = b;
                }
            } else {
                q6k_values(blk, v[r]);
                for (int j = 0; j < 16; ++j) s8[(p * nb + s * per + j) * 16 + r] = blk[192 + j];
            }
        }
        const int B = qbits == 4 ? 32 : 16, steps = B / 8;
        for (int j = 0; j < per; ++j) {
            uint8_t* o = qo + (p * nb + s * per + j) * bb;
            for (int st = 0; st < steps; ++st)
                for (int r = 0; r < 16; ++r)
                    for (int i = 0; i < 4; ++i) {
                        const uint8_t* w = v[r] + j * B + 8 * st;
                        o[(st * 16 + r) * 4 + i] = (uint8_t)((w[i] & 0x0F) | ((w[4 + i] & 0x0F) << 4));
                    }
            if (qbits == 6) {
                uint8_t* pl = o + steps * 64;
                for (int r = 0; r < 16; ++r)
                    for (int i = 0; i < 4; ++i) {
                        uint8_t b = 0;
                        for (int k = 0; k < 4; ++k) b |= (uint8_t)(((v[r][j * B + 8 * (k / 2) + 4 * (k % 2) + i] >> 4) & 3) << (2 * k));
                        pl[r * 4 + i] = b;
                    }
            }
        }
    }
}
