// Standalone check of the quantized linears' SIMD bodies (kernels/csrc/qlinear_body.inc) against
// the plain reference (qscalar), bit for bit, for architectures this machine cannot run natively
// (aarch64 under qemu-user: the NEON body) and natively (x86: AVX2, and AVX512-VNNI and AMX-INT8
// where the CPU has them). Compiled by tests/unit/test_cross_isa.py, no Python or nanobind involved.
// Random weights in every repacked layout (U4 with and without a min, I8 with blocks of 16 and 32,
// with and without a min, U4K, U6K), random rows quantized as linear_q quantizes them (plain and
// with the fused RMSNorm), 1 to 97 rows (AMX: whole 16-row tiles, in pairs and alone, and the rows
// past them), a partial last panel; and each level's activation quantizer against the reference
// quantize_row on rows with NaN, infinities, signed zeros, subnormals, the largest finite values and
// all-zero blocks. Prints "ok <n checked>" or the first mismatch; exit
// status 0 only when every body matches.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "../../kernels/csrc/bf16.h"
#include "../../kernels/csrc/qlinear_body.inc"

int agentspec_isa() { return 0; }

namespace {

struct Case {
    int fmt, B;
    bool min;
};

struct Weights {
    std::vector<uint8_t> q, s8, m8;
    std::vector<float> sc, mn;
    QW w;
};

Weights make_weights(const Case& c, int64_t N, int64_t K, std::mt19937& rng) {
    std::uniform_int_distribution<int> byte(0, 255), six(0, 63);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    Weights W;
    const int64_t NP = (N + 15) / 16, nb = K / c.B, ns = K / 256;
    const int64_t qbytes = c.fmt == FMT_I8 ? 16 * c.B : c.fmt == FMT_U6K ? 16 * c.B * 3 / 4 : 16 * c.B / 2;
    W.q.resize(NP * nb * qbytes);
    for (auto& v : W.q) v = (uint8_t)byte(rng);
    const bool k = c.fmt == FMT_U4K || c.fmt == FMT_U6K;
    W.sc.resize(NP * (k ? ns : nb) * 16);
    for (auto& v : W.sc) v = 0.01f * nd(rng);
    if (c.min) {
        W.mn.resize(NP * (k ? ns : nb) * 16);
        for (auto& v : W.mn) v = -0.01f * std::fabs(nd(rng));
    }
    if (k) {
        W.s8.resize(NP * nb * 16);
        for (auto& v : W.s8) v = (uint8_t)(c.fmt == FMT_U4K ? six(rng) : byte(rng));
        if (c.fmt == FMT_U4K) {
            W.m8.resize(NP * nb * 16);
            for (auto& v : W.m8) v = (uint8_t)six(rng);
        }
    }
    W.w = QW{W.q.data(), W.sc.data(), c.min ? W.mn.data() : nullptr, k ? W.s8.data() : nullptr,
             c.fmt == FMT_U4K ? W.m8.data() : nullptr, c.fmt, c.B, N, K, nb, qbytes, ns};
    return W;
}

// the quantizer of ``body`` against the reference on rows with special values: every output's
// bits; returns how many values were compared, or -1 after printing the first mismatch
long check_quantizer(const QBody& body, std::mt19937& rng) {
    const uint16_t specials[] = {0x7FC0, 0x7F81, 0xFFC0, 0x7F80, 0xFF80, 0x8000, 0x0000, 0x0001, 0x8001,
                                 0x007F, 0x0080, 0x7F7F, 0xFF7F, 0x3F80, 0xBF80};
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::uniform_int_distribution<int> pick(0, (int)(sizeof specials / sizeof specials[0]) - 1), coin(0, 7);
    const int64_t K = 1024;
    long n = 0;
    for (int trial = 0; trial < 40; ++trial) {
        std::vector<uint16_t> x(K), nw(K);
        const float scale = trial % 4 == 0 ? 1e30f : trial % 4 == 1 ? 1e-30f : 3.0f;
        for (auto& v : x) v = coin(rng) == 0 ? specials[pick(rng)] : float_to_bf16(scale * nd(rng));
        for (auto& v : nw) v = trial % 5 == 0 && coin(rng) == 0 ? specials[pick(rng)] : float_to_bf16(0.5f + std::fabs(nd(rng)));
        for (int i = 0; i < 32; ++i) x[32 * (trial % (K / 32)) + i] = trial % 3 == 0 ? 0x7FC0 : 0;  // a block all NaN or all 0
        for (int G : {32, 256})
        for (int B : {16, 32})
            for (int act : {ACT_NONE, ACT_RMSNORM}) {
                std::vector<int8_t> q0(K), q1(K);
                std::vector<float> d0(K / G), d1(K / G), sf0(K / B), sf1(K / B), f(K);
                std::vector<int32_t> s0(K / B), s1(K / B);
                quantize_row(x.data(), K, B, G, q0.data(), d0.data(), s0.data(), sf0.data(), act, nw.data(), 1e-6f, f.data());
                body.quantize(x.data(), K, B, G, q1.data(), d1.data(), s1.data(), sf1.data(), act, nw.data(), 1e-6f, f.data());
                const bool same = std::memcmp(q0.data(), q1.data(), K) == 0 &&
                                  std::memcmp(d0.data(), d1.data(), sizeof(float) * d0.size()) == 0 &&
                                  std::memcmp(s0.data(), s1.data(), sizeof(int32_t) * s0.size()) == 0 &&
                                  std::memcmp(sf0.data(), sf1.data(), sizeof(float) * sf0.size()) == 0;
                if (!same) {
                    std::printf("quantizer mismatch %s trial=%d G=%d B=%d act=%d\n", body.name, trial, G, B, act);
                    return -1;
                }
                n += K;
            }
    }
    return n;
}

}  // namespace

int main() {
    std::vector<QBody> bodies;
#if defined(AGENTSPEC_NEON)
    bodies.push_back(body_for(1));
#elif defined(AGENTSPEC_X86)
    bodies.push_back(body_for(2));
    if (has_vnni()) bodies.push_back(body_for(3));
#if defined(__x86_64__)
    if (has_vnni() && qamx::ready()) bodies.push_back(body_for(4));   // AMX-INT8 (Q6_K's prompt chunks)
#endif
#endif
    if (bodies.empty()) {
        std::puts("no SIMD body on this architecture");
        return 2;
    }
    const Case cases[] = {{FMT_U4, 32, false}, {FMT_U4, 32, true},  {FMT_I8, 16, false}, {FMT_I8, 16, true},
                          {FMT_I8, 32, false}, {FMT_I8, 32, true},  {FMT_U4K, 32, true}, {FMT_U6K, 16, false}};
    std::mt19937 rng(11);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    long checked = 0;
    for (const QBody& b : bodies) {
        const long n = check_quantizer(b, rng);
        if (n < 0) return 1;
        checked += n;
    }
    const int64_t K = 512;
    for (const Case& c : cases) {
        for (int64_t N : {16, 40}) {
            Weights W = make_weights(c, N, K, rng);
            for (int act : {ACT_NONE, ACT_RMSNORM}) {
                for (int64_t M : {1, 2, 3, 4, 5, 9, 12, 15, 64, 65, 80, 97}) {
                    std::vector<uint16_t> x(M * K), nw(K);
                    for (auto& v : x) v = float_to_bf16(3.0f * nd(rng));
                    for (auto& v : nw) v = float_to_bf16(0.5f + std::fabs(nd(rng)));
                    if (M > 1)   // an all-zero block: its activation scale is 0
                        for (int i = 0; i < 32; ++i) x[K + i] = 0;
                    const int G = group_size(c.fmt);
                    std::vector<int8_t> xq(M * K);
                    std::vector<float> dx(M * (K / G)), xsf(M * (K / c.B)), f(K);
                    std::vector<int32_t> xs(M * (K / c.B));
                    for (int64_t m = 0; m < M; ++m)
                        quantize_row(x.data() + m * K, K, c.B, G, xq.data() + m * K, dx.data() + m * (K / G),
                                     xs.data() + m * (K / c.B), xsf.data() + m * (K / c.B), act, nw.data(), 1e-6f,
                                     f.data());
                    std::vector<int32_t> xs2(M * (K / c.B / 2));
                    for (int64_t m = 0; m < M; ++m)
                        pair_sums(xs.data() + m * (K / c.B), K / c.B, xs2.data() + m * (K / c.B / 2));
                    const QX xx{xq.data(), dx.data(), xs.data(), xsf.data(), K, K / G, K / c.B, xs2.data()};
                    const int64_t NP = (N + 15) / 16;
                    std::vector<uint16_t> ref(M * N), got(M * N);
                    qscalar::panels(W.w, xx, M, ref.data(), N, 0, NP);
                    for (const QBody& b : bodies) {
                        const char* name = b.name;
                        std::fill(got.begin(), got.end(), 0xFFFF);
                        b.panels(W.w, xx, M, got.data(), N, 0, NP);
                        for (int64_t i = 0; i < M * N; ++i, ++checked)
                            if (ref[i] != got[i]) {
                                std::printf("mismatch %s fmt=%d B=%d min=%d act=%d M=%ld N=%ld i=%ld: %04x vs %04x\n",
                                            name, c.fmt, c.B, (int)c.min, act, (long)M, (long)N, (long)i, ref[i], got[i]);
                                return 1;
                            }
                    }
                }
            }
        }
    }
    std::printf("ok %ld\n", checked);
    return 0;
}
