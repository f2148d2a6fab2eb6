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
// Activations. Each row of x is quantized on its own (quantize_row: the plain reference, and AVX2
// and AVX-512 versions with the same bits, tested against it): per G columns, d = amax / 127 and
// q = round-to-nearest-even(x / d) in [-127, 127]; G = 32 (llama.cpp's Q8_0 activation), or 256 for
// U4K / U6K (its Q8_K: one scale per super-block, so the blocks' integer sums combine in integers).
// So a row's result depends on that row alone.
//
// Arithmetic of output (m, n), identical at every ISA level. U4 / I8, for each weight block j in
// order:
//   isum = sum_i q_w[i] * q_x[i]       (exact, int32: the order does not matter)
//   t    = (float)isum * d_x(j)
//   acc  = acc + scale_j * t           (a float32 multiply, then an add: no FMA anywhere)
//   acc  = acc + min_j * xsf_j         (types with a min; xsf_j = d_x(j) * (float)sum_i q_x[i])
// U4K / U6K: for each super-block s in order (its blocks j, 6-bit or int8 sub-scales sc_j, m_j),
//   v    = sum_j sc_j * isum_j         (exact, int32: at most 8 * 63 * 32 * 15 * 127, or
//                                      16 * 128 * 16 * 32 * 127)
//   acc  = acc + d_s * ((float)v * d_x(s))
//   acc  = acc + (-dmin_s) * ((float)(sum_j m_j * sum_i q_x[i]) * d_x(s))     (U4K)
// then rounded once to bfloat16. The integer sums are exact in every body (AVX512-VNNI's VPDPBUSD
// on q + 128 minus 128 * sum q_x; AVX2's VPMADDUBSW on |q| and sign-adjusted x, whose int16 pair
// sums cannot saturate: |q| <= 128, |q_x| <= 127; NEON's SMULL / SMLAL int16 products widened by
// SADALP; AMX-INT8's tile products of a whole super-block, the weights times their sub-scales
// split into two bytes: v itself, for prompt chunks of U6K weights), and the float steps are
// the same IEEE operations in the same order, so every level gives the same bits, and a row's bits
// do not depend on how many rows share the call or how the panels are split between threads. The bodies are in qlinear_body.inc (tested standalone too:
// tests/native/qlinear_isa_check.cpp, the NEON body under qemu-user).
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

#include "qlinear_body.inc"

const char* qlinear_body() { return body_for(agentspec_isa()).name; }

// x: bfloat16 [M, K] (row stride x_st); the repacked weight (q, sc, mn: see the header; mn 0 for
// none); out: bfloat16 [M, N] (row stride o_st), or float32 with out_f32 (the accumulators unrounded:
// an output head's logits). Runs the body of the ISA level set by set_isa.
void linear_q(uintptr_t x, int64_t x_st, int64_t M, uintptr_t q, uintptr_t sc, uintptr_t mn, uintptr_t s8,
              uintptr_t m8, int fmt, int B, int64_t N, int64_t K, uintptr_t out, int64_t o_st, int threads, int act,
              uintptr_t norm_w, double eps, bool out_f32) {
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
         reinterpret_cast<const uint8_t*>(m8), fmt, B, N, K, K / B, qbytes, K / 256, out_f32};
    const QBody body = body_for(agentspec_isa());
    const panels_fn panels = body.panels;
    const quantize_fn quantize = body.quantize;
    const int64_t NP = (N + 15) / 16;
    if (threads <= 0) threads = omp_get_max_threads();
    nb::gil_scoped_release nogil;
    static thread_local std::vector<int8_t> xq;
    static thread_local std::vector<float> dx, xsf;
    static thread_local std::vector<int32_t> xs, xs2;
    static thread_local std::vector<float> fbuf;
    const int G = group_size(fmt);   // columns per activation scale
    xq.resize((size_t)(M * K));
    dx.resize((size_t)(M * (K / G)));
    xs.resize((size_t)(M * (K / B)));
    xsf.resize((size_t)(M * (K / B)));
    xs2.resize((size_t)(M * (K / B / 2)));
    const uint16_t* xh = reinterpret_cast<const uint16_t*>(x);
    int8_t* xqp = xq.data();
    float *dxp = dx.data(), *xsfp = xsf.data();
    int32_t *xsp = xs.data(), *xs2p = xs2.data();
    const int qt = (int)std::max<int64_t>(1, std::min<int64_t>(threads, M));
    fbuf.resize((size_t)(qt * K));
    float* fb = fbuf.data();
    const uint16_t* nw = reinterpret_cast<const uint16_t*>(norm_w);
    const float e = (float)eps;
    // one row: quantized, then (Q4_K, the only layout that reads them) its blocks' sums paired (QX::xs2)
    auto row = [&](int64_t m, float* f) {
        quantize(xh + m * x_st, K, B, G, xqp + m * K, dxp + m * (K / G), xsp + m * (K / B), xsfp + m * (K / B), act, nw,
                 e, f);
        if (fmt == FMT_U4K) pair_sums(xsp + m * (K / B), K / B, xs2p + m * (K / B / 2));
    };
    if (qt == 1) {
        for (int64_t m = 0; m < M; ++m) row(m, fb);
    } else {
#pragma omp parallel for num_threads(qt) schedule(static)
        for (int64_t m = 0; m < M; ++m) row(m, fb + (int64_t)omp_get_thread_num() * K);
    }
    const QX xx{xqp, dxp, xsp, xsfp, K, K / G, K / B, xs2p};
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
