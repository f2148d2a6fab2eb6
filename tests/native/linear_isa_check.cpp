// Standalone check of the bf16 linear's per-ISA bodies against the scalar one, bit for bit, for
// architectures this machine cannot run natively (aarch64 under qemu-user): compiled by
// tests/unit/test_cross_isa.py with a cross compiler, no Python or nanobind involved.
// Prints "ok <n checked>" or the first mismatch; exit status 0 only when all match.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "../../kernels/csrc/bf16.h"

namespace {
#include "../../kernels/csrc/linear_portable.inc"
}  // namespace

int agentspec_isa() { return 0; }

int main() {
#if !defined(AGENTSPEC_NEON)
    std::puts("no NEON body on this architecture");
    return 2;
#else
    std::mt19937 rng(7);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    long checked = 0;
    for (int64_t M : {1, 2, 3, 5, 8}) {
        for (int64_t N : {16, 40, 300}) {
            const int64_t K = 576, K2 = K / 2, NP = (N + 15) / 16;
            std::vector<uint16_t> x(M * K), w(N * K);
            for (auto& v : x) v = float_to_bf16(nd(rng));
            for (auto& v : w) v = float_to_bf16(0.05f * nd(rng));
            // pack: panel p, pair k, lane l holds w[16p + l, 2k : 2k + 2]
            std::vector<uint32_t> wp(NP * K2 * 16, 0);
            for (int64_t n = 0; n < N; ++n)
                for (int64_t k = 0; k < K2; ++k)
                    wp[((n / 16) * K2 + k) * 16 + n % 16] = (uint32_t)w[n * K + 2 * k] | ((uint32_t)w[n * K + 2 * k + 1] << 16);
            std::vector<uint16_t> a(M * N), b(M * N);
            const uint32_t* xp = reinterpret_cast<const uint32_t*>(x.data());
            lin_scalar::panels(xp, K2, M, wp.data(), K2, a.data(), N, N, 0, NP);
            lin_neon::panels(xp, K2, M, wp.data(), K2, b.data(), N, N, 0, NP);
            for (int64_t i = 0; i < M * N; ++i, ++checked)
                if (a[i] != b[i]) {
                    std::printf("mismatch M=%ld N=%ld i=%ld: %04x vs %04x\n", (long)M, (long)N, (long)i, a[i], b[i]);
                    return 1;
                }
        }
    }
    std::printf("ok %ld\n", checked);
    return 0;
#endif
}
