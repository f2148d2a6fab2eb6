// agentspec.kernels._cpu: y = x @ W.T for a bfloat16 model's decode / verify rows on CPU.
//
// torch's bfloat16 GEMM streams the weights at a fraction of memory bandwidth for the few rows a
// decode step has (a 2-row forward of SmolLM2-135M spent ~25 ms in it against a ~7 ms DRAM floor)
// and its cost climbs steeply with the row count. This kernel keeps each weight in 16-column
// panels of bfloat16 pairs, [ceil(N/16), K/2, 16, 2], the operand layout of AVX512-BF16's
// VDPBF16PS: a panel streams sequentially, and each pair of x's columns is broadcast against it.
//
// Row-invariant by construction: output (m, n) is the float32 sum, over the K/2 column pairs in
// ascending order, of x[m, 2k] * W[n, 2k] + x[m, 2k+1] * W[n, 2k+1] (one VDPBF16PS step each),
// rounded once to bfloat16. Nothing depends on how many rows share the call, where the row sits
// or how the columns are split between threads, so a token's projections are the same bits in
// a 1-row plain decoding step, a draft tree and a batch of requests.
//
// CPUs without AVX512-BF16 run an emulation of the instruction (two float32 adds of exact
// bf16 x bf16 products, fused multiply-adds where the CPU has them: the same bits; it does not
// flush subnormals as the instruction does), compiled per ISA level (bf16.h).
#include <nanobind/nanobind.h>

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "bf16.h"
#include "kernels.h"

namespace nb = nanobind;

namespace {

// One body per ISA level (bf16.h), each with the tile that fits its registers: LN_MR rows by
// LN_P 16-column panels of float32 accumulators (AVX-512: 6 x 4 x 1 zmm = 24 of 32; AVX2:
// below; NEON: 2 x 2 x 4 = 16 of 32 q registers; scalar: 1 x 2 x 4 = 8 of 16 xmm). The tile
// shape changes only which outputs are computed together, never an output's reduction order.
#include "linear_portable.inc"  // lin_scalar; lin_neon on Arm

#if defined(AGENTSPEC_X86)
// AVX2 + FMA: written with 256-bit intrinsics (GCC keeps 16-lane vector-extension values of the
// generic body on the stack when they only fit two ymm registers each). A 16-column panel is two
// ymm of weight pairs, split into their high and low bf16 halves (as float32: exact); x comes
// widened to float32 once per call, so each pair step is two broadcasts and two FMAs per half,
// the high product first, as VDPBF16PS adds them. Tiles: 1 row x 4 panels (a decode step: 8
// independent accumulator chains) or 2 rows x 2 panels (8 accumulators, 4 weight and 2 broadcast
// registers: 14 of 16).
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi,bmi2,lzcnt,movbe,popcnt")
namespace lin_avx2 {

template <int MR, int P>
static inline __attribute__((always_inline)) void tile(const float* xf, int64_t K, const uint32_t* w, int64_t K2,
                                                      uint16_t* out, int64_t o_st, int64_t n0, int64_t N) {
    __m256 acc[MR][P][2];
    for (int m = 0; m < MR; ++m)
        for (int p = 0; p < P; ++p) acc[m][p][0] = acc[m][p][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K2; ++k) {
        for (int p = 0; p < P; ++p) {
            const Pairs256 wv = load_pairs256(w + (p * K2 + k) * 16);
            for (int m = 0; m < MR; ++m) {
                const __m256 bh = _mm256_broadcast_ss(xf + m * K + 2 * k + 1);
                const __m256 bl = _mm256_broadcast_ss(xf + m * K + 2 * k);
                acc[m][p][0] = dp256(acc[m][p][0], wv.h0, wv.l0, bh, bl);
                acc[m][p][1] = dp256(acc[m][p][1], wv.h1, wv.l1, bh, bl);
            }
        }
    }
    for (int m = 0; m < MR; ++m)
        for (int p = 0; p < P; ++p) {
            const int64_t c = n0 + 16 * p;
            v16 r;
            std::memcpy(&r, acc[m][p], sizeof r);
            store_bf16(out + m * o_st + c, r, (int)std::min<int64_t>(16, N - c));
        }
}

// Panels [p0, p1) for every row; xf: x widened to float32 [M, K] (row stride K).
static void panels_f(const float* xf, int64_t M, const uint32_t* wp, int64_t K2, uint16_t* out, int64_t o_st,
                     int64_t N, int64_t p0, int64_t p1) {
    const int64_t K = 2 * K2;
    if (M == 1) {
        int64_t p = p0;
        for (; p + 4 <= p1; p += 4) tile<1, 4>(xf, K, wp + p * K2 * 16, K2, out, o_st, 16 * p, N);
        for (; p < p1; ++p) tile<1, 1>(xf, K, wp + p * K2 * 16, K2, out, o_st, 16 * p, N);
        return;
    }
    int64_t p = p0;
    for (; p < p1; p += 2) {
        const uint32_t* w = wp + p * K2 * 16;
        const bool two = p + 2 <= p1;
        int64_t m = 0;
        for (; m + 2 <= M; m += 2) {
            if (two) tile<2, 2>(xf + m * K, K, w, K2, out + m * o_st, o_st, 16 * p, N);
            else tile<2, 1>(xf + m * K, K, w, K2, out + m * o_st, o_st, 16 * p, N);
        }
        if (m < M) {
            if (two) tile<1, 2>(xf + m * K, K, w, K2, out + m * o_st, o_st, 16 * p, N);
            else tile<1, 1>(xf + m * K, K, w, K2, out + m * o_st, o_st, 16 * p, N);
        }
    }
}

}  // namespace lin_avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi,bmi2,lzcnt,movbe,popcnt,avx512f,avx512bw,avx512vl,avx512dq,avx512cd")
#define LN_NS lin_avx512
#define LN_DP dp_fma512
#define LN_MR 6
#define LN_P 4
#define LN_ATTR
#include "linear_body.inc"
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi,bmi2,lzcnt,movbe,popcnt,avx512f,avx512bw,avx512vl,avx512dq,avx512cd,avx512bf16")
#define LN_NS lin_hw
#define LN_DP dp_hw
#define LN_MR 6
#define LN_P 4
#define LN_ATTR
#include "linear_body.inc"
#pragma GCC pop_options
#endif

using panels_fn = void (*)(const uint32_t*, int64_t, int64_t, const uint32_t*, int64_t, uint16_t*, int64_t, int64_t,
                           int64_t, int64_t);

static panels_fn panels_for(int isa) {
    switch (isa) {
#if defined(AGENTSPEC_X86)
        case 4: return lin_hw::panels;
        case 3: return lin_avx512::panels;
#endif
#if defined(AGENTSPEC_NEON)
        case 1: return lin_neon::panels;
#endif
        default: return lin_scalar::panels;
    }
}

}  // namespace

// x: bfloat16 [M, K] (row stride x_st elements, even; K even); wp: packed [ceil(N/16), K/2, 16, 2];
// out: bfloat16 [M, N] (row stride o_st). Runs the ISA level set by set_isa (bf16.h).
void linear_bf16(uintptr_t x, int64_t x_st, int64_t M, uintptr_t wp, int64_t N, int64_t K, uintptr_t out,
                 int64_t o_st, int threads) {
    if (M <= 0 || N <= 0 || K <= 0 || K % 2 != 0 || x_st % 2 != 0 || x_st < K || o_st < N)
        throw std::invalid_argument("linear_bf16: bad shapes or strides");
    const int isa = agentspec_isa();
    const panels_fn panels = panels_for(isa);
    const uint32_t* xp = reinterpret_cast<const uint32_t*>(x);
    const uint32_t* w = reinterpret_cast<const uint32_t*>(wp);
    uint16_t* o = reinterpret_cast<uint16_t*>(out);
    const int64_t K2 = K / 2, NP = (N + 15) / 16, xs = x_st / 2;
    if (threads <= 0) threads = omp_get_max_threads();
    threads = (int)std::max<int64_t>(1, std::min<int64_t>(threads, NP));
    nb::gil_scoped_release nogil;
#if defined(AGENTSPEC_X86)
    if (isa == 2) {
        static thread_local std::vector<float> xbuf;
        xbuf.resize((size_t)(M * K));
        float* xf = xbuf.data();
        const uint16_t* xh = reinterpret_cast<const uint16_t*>(x);
        for (int64_t m = 0; m < M; ++m)
            for (int64_t k = 0; k < K; ++k) xf[m * K + k] = bf16_to_float(xh[m * x_st + k]);
#pragma omp parallel num_threads(threads)
        {
            const int t = omp_get_thread_num(), nt = omp_get_num_threads();
            const int64_t p0 = NP * t / nt, p1 = NP * (t + 1) / nt;
            lin_avx2::panels_f(xf, M, w, K2, o, o_st, N, p0, p1);
        }
        return;
    }
#endif
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t p0 = NP * t / nt, p1 = NP * (t + 1) / nt;
        panels(xp, xs, M, w, K2, o, o_st, N, p0, p1);
    }
}

