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
// bf16 x bf16 products; it does not flush subnormals as the instruction does).
#include <nanobind/nanobind.h>

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>

#include "bf16.h"

namespace nb = nanobind;

namespace {

constexpr int MR_MAX = 6;   // rows per tile (6 x 4 accumulators + 4 weight vectors fit 32 zmm)
constexpr int PANELS = 4;   // 16-column panels per tile

#define LN_NS lin_emul
#define LN_DP dp_emul
#define LN_ATTR __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#include "linear_body.inc"
#undef LN_NS
#undef LN_DP
#undef LN_ATTR

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")
#define LN_NS lin_hw
#define LN_DP dp_hw
#define LN_ATTR
#include "linear_body.inc"
#undef LN_NS
#undef LN_DP
#undef LN_ATTR
#pragma GCC pop_options

// x: bfloat16 [M, K] (row stride x_st elements, even; K even); wp: packed [ceil(N/16), K/2, 16, 2];
// out: bfloat16 [M, N] (row stride o_st). impl: 1 = AVX512-BF16, 0 = emulation.
void linear_bf16(uintptr_t x, int64_t x_st, int64_t M, uintptr_t wp, int64_t N, int64_t K, uintptr_t out,
                 int64_t o_st, int impl, int threads) {
    if (M <= 0 || N <= 0 || K <= 0 || K % 2 != 0 || x_st % 2 != 0 || x_st < K || o_st < N)
        throw std::invalid_argument("linear_bf16: bad shapes or strides");
    if (impl == 1 && !__builtin_cpu_supports("avx512bf16"))
        throw std::invalid_argument("linear_bf16: this CPU has no AVX512-BF16");
    const uint32_t* xp = reinterpret_cast<const uint32_t*>(x);
    const uint32_t* w = reinterpret_cast<const uint32_t*>(wp);
    uint16_t* o = reinterpret_cast<uint16_t*>(out);
    const int64_t K2 = K / 2, NP = (N + 15) / 16, xs = x_st / 2;
    if (threads <= 0) threads = omp_get_max_threads();
    threads = (int)std::max<int64_t>(1, std::min<int64_t>(threads, NP));
    nb::gil_scoped_release nogil;
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t p0 = NP * t / nt, p1 = NP * (t + 1) / nt;
        if (impl == 1) lin_hw::panels(xp, xs, M, w, K2, o, o_st, N, p0, p1);
        else lin_emul::panels(xp, xs, M, w, K2, o, o_st, N, p0, p1);
    }
}

}  // namespace

void register_linear(nb::module_& m) {
    m.def("linear_bf16", &linear_bf16, nb::arg("x"), nb::arg("x_stride"), nb::arg("M"), nb::arg("w_packed"),
          nb::arg("N"), nb::arg("K"), nb::arg("out"), nb::arg("out_stride"), nb::arg("impl"), nb::arg("threads") = 0,
          "Raw-pointer entry point; call agentspec.kernels.cpu_linear.PackedLinear instead.");
}
