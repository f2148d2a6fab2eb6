// The int8 dot-product rate a tight loop of the quantized linears' own instruction sequence
// reaches on this CPU: the ceiling their bodies are measured against (benchmarks/bench_kernels.py
// quant-linears compiles and runs this; it is not part of the package).
//
//   int8_peak avx2|vnni THREADS SECONDS   ->  {"loop": ..., "threads": T, "gmacs_per_s": ...}
//
// avx2: the AVX2 body's step (kernels/csrc/qlinear_body.inc): two VPMADDUBSW (32 u8 x s8 products
//       each, weights' low and high nibbles against 4 activation bytes broadcast from memory)
//       added in int16, eight of them per VPMADDWD into int32; 4 rows x 2 halves of 8 lanes.
// vnni: the AVX512-VNNI body's step: VPDPBUSD with the 4 activation bytes broadcast from memory
//       ({1to16}), 64 products each; 8 rows.
// Weights stay in registers and activations in L1: no memory stall, no unpacking; what is left is
// the instructions' own throughput.
#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

alignas(64) static int8_t X[8][64];

__attribute__((target("avx2"))) static double avx2_loop(long blocks, int32_t* sink) {
    __m256i lo[2] = {_mm256_set1_epi8(3), _mm256_set1_epi8(5)}, hi[2] = {_mm256_set1_epi8(7), _mm256_set1_epi8(9)};
    __m256i v[4][2];
    for (auto& r : v) r[0] = r[1] = _mm256_setzero_si256();
    const __m256i sc = _mm256_set1_epi16(5);
    for (long b = 0; b < blocks; ++b) {
        __m256i s16[4][2];
        for (auto& r : s16) r[0] = r[1] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int s = 0; s < 4; ++s)
#pragma GCC unroll 4
            for (int m = 0; m < 4; ++m) {
                int32_t a, c;
                std::memcpy(&a, &X[m][8 * s], 4);
                std::memcpy(&c, &X[m][8 * s + 4], 4);
                const __m256i xl = _mm256_set1_epi32(a), xh = _mm256_set1_epi32(c);
                for (int h = 0; h < 2; ++h)
                    s16[m][h] = _mm256_add_epi16(s16[m][h], _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], xl),
                                                                             _mm256_maddubs_epi16(hi[h], xh)));
            }
        for (int m = 0; m < 4; ++m)
            for (int h = 0; h < 2; ++h) v[m][h] = _mm256_add_epi32(v[m][h], _mm256_madd_epi16(s16[m][h], sc));
        __asm__ volatile("" : "+x"(lo[0]), "+x"(lo[1]), "+x"(hi[0]), "+x"(hi[1]));
    }
    int32_t t = 0;
    for (auto& r : v) t += _mm256_extract_epi32(r[0], 1) + _mm256_extract_epi32(r[1], 2);
    *sink = t;
    return (double)blocks * 4 * 4 * 2 * 2 * 32;   // steps x rows x halves x 2 VPMADDUBSW x 32 products
}

__attribute__((target("avx512f,avx512bw,avx512vnni"))) static double vnni_loop(long blocks, int32_t* sink) {
    __m512i lo = _mm512_set1_epi8(3), hi = _mm512_set1_epi8(7);
    __m512i is[8];
    for (auto& r : is) r = _mm512_setzero_si512();
    for (long b = 0; b < blocks; ++b) {
#pragma GCC unroll 4
        for (int s = 0; s < 4; ++s)
#pragma GCC unroll 8
            for (int m = 0; m < 8; ++m) {
                __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(is[m]) : "v"(lo), "m"(*reinterpret_cast<const int32_t*>(&X[m][8 * s])));
                __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(is[m]) : "v"(hi), "m"(*reinterpret_cast<const int32_t*>(&X[m][8 * s + 4])));
            }
        __asm__ volatile("" : "+v"(lo), "+v"(hi));
    }
    alignas(64) int32_t lanes[16];
    int32_t t = 0;
    for (auto& r : is) {
        _mm512_store_si512(lanes, r);
        t += lanes[0] + lanes[15];
    }
    *sink = t;
    return (double)blocks * 4 * 8 * 2 * 64;   // steps x rows x 2 VPDPBUSD x 64 products
}

int main(int argc, char** argv) {
    if (argc != 4) {
        std::fprintf(stderr, "usage: int8_peak avx2|vnni THREADS SECONDS\n");
        return 2;
    }
    const std::string loop = argv[1];
    const int threads = std::atoi(argv[2]);
    const double seconds = std::atof(argv[3]);
    if ((loop != "avx2" && loop != "vnni") || threads < 1 || !(seconds > 0)) {
        std::fprintf(stderr, "int8_peak: bad arguments (loop avx2|vnni, THREADS >= 1, SECONDS > 0)\n");
        return 2;
    }
    __builtin_cpu_init();
    if (loop == "vnni" && !__builtin_cpu_supports("avx512vnni")) {
        std::fprintf(stderr, "int8_peak: this CPU has no AVX512-VNNI\n");
        return 3;
    }
    for (int m = 0; m < 8; ++m)
        for (int i = 0; i < 64; ++i) X[m][i] = (int8_t)(i * 7 + m);
    auto run = [&](long blocks, int32_t* sink) { return loop == "avx2" ? avx2_loop(blocks, sink) : vnni_loop(blocks, sink); };
    // calibrate one thread to ~seconds / 10, then every thread runs the same count at once
    long blocks = 1 << 16;
    int32_t sink = 0;
    for (;;) {
        auto t0 = std::chrono::steady_clock::now();
        run(blocks, &sink);
        double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (dt > seconds / 10) {
            blocks = (long)(blocks * seconds / dt);
            break;
        }
        blocks *= 2;
    }
    std::vector<std::thread> pool;
    std::vector<int32_t> sinks(threads);
    std::vector<double> macs(threads);
    auto t0 = std::chrono::steady_clock::now();
    for (int t = 0; t < threads; ++t)
        pool.emplace_back([&, t] { macs[t] = run(blocks, &sinks[t]); });
    for (auto& th : pool) th.join();
    double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    double total = 0;
    for (double m : macs) total += m;
    long check = sink;
    for (int32_t s : sinks) check += s;
    std::printf("{\"loop\": \"%s\", \"threads\": %d, \"seconds\": %.3f, \"gmacs_per_s\": %.2f, \"check\": %ld}\n",
                loop.c_str(), threads, dt, total / dt / 1e9, check);
    return 0;
}
