// Intel AMX kernels (tile matrix multiply, bf16 -> float32): prefill attention, RMSNorm rows, the
// row-invariant linears and the AMX phases of decode attention (qkv_attention_amx.cpp).
//
// Prefill attention of a bfloat16 model, over the packed KV cache the decode kernels keep
// (kt2 [Hkv, D/2, cap, 2] is already AMX's
// VNNI operand layout for q . k, vp [Hkv, cap/2, D, 2] the one for p @ v).
//
// One task is one kv head's G query heads (G <= 4) at one tile of 16 consecutive query positions,
// the tiles aligned to absolute positions (multiples of 16; the engine's prompt chunks start at
// multiples of 256); each load of 16 keys into a tile serves the G heads. The keys are first
// copied into contiguous 16-key blocks (kt2's rows lie a capacity apart, one cache set).
// For a row at position p (it sees keys 0..p):
//   s_j  = (q / 8) . k_j                  tile dot products over d in two fixed halves (float32)
//   m    = max_j s_j                       over the visible keys
//   p_j  = 2^(s_j log2e - m log2e)         float32 (one FMA, base-2 polynomial), 0 for j > p
//   l    = sum_j p_j                       16 lane accumulators in key order, then a fixed tree
//   o    = (sum_j bf16(p_j) v_j) / l       tile products over 32-key steps in key order
// Two passes (all scores, then p @ v) instead of an online softmax: the output accumulators stay
// in tile registers and are never rescaled. Every reduction runs over keys in ascending order in
// fixed steps, and keys a row cannot see add exact zeros, so a row's bits depend only on its own
// query, the keys it sees and its position: the same whichever chunk or thread computes it.
// Deterministic for any thread count. Not bitwise equal to the decode kernel (prefill never was:
// see agentspec/backends/embedded/prefix_cache.py for the precision argument).

#include <nanobind/nanobind.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "kernels.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define AGENTSPEC_AMX 1
#endif

namespace nb = nanobind;

namespace {

// linear_amx's output modes (see lin_out)
enum Epilogue { PLAIN = 0, RESIDUAL = 1, SILU = 2 };

constexpr int D = 64;
constexpr int TM = 16;   // query rows per tile
constexpr int MAXG = 4;  // query heads per kv head (one score tile each)

#if defined(AGENTSPEC_AMX)

bool cpu_has_amx() {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid_max(0, nullptr) < 7) return false;
    __cpuid_count(7, 0, a, b, c, d);
    const bool amx_bf16 = d & (1u << 22), amx_tile = d & (1u << 24);
    const bool avx512_bf16 = [] {
        unsigned a1 = 0, b1 = 0, c1 = 0, d1 = 0;
        __cpuid_count(7, 1, a1, b1, c1, d1);
        return (a1 & (1u << 5)) != 0;
    }();
    __builtin_cpu_init();
    const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    return amx_bf16 && amx_tile && avx512 && avx512_bf16;
}

// Linux hands out the AMX tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM,
// XFEATURE_XTILEDATA): once per process, for every thread.
bool amx_ready() {
    static const bool ok = [] {
        if (!cpu_has_amx()) return false;
        constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
        return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }();
    return ok;
}

#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))

struct alignas(64) TileConfig {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

AMX_TARGET static void tiles_on() {
    TileConfig cfg;
    std::memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; ++i) {  // every tile 16 rows x 64 bytes
        cfg.colsb[i] = 64;
        cfg.rows[i] = 16;
    }
    // GCC does not see _tile_loadconfig read `cfg` and may drop the stores above (an inlined
    // copy then configures zero-row tiles, and the first tile instruction faults)
    asm volatile("" : : "r"(&cfg) : "memory");
    _tile_loadconfig(&cfg);
}

AMX_TARGET static void tiles_off() { _tile_release(); }

// exp(x) for x <= 0 (2^n * poly(r), r = x - n ln 2 in [-ln2/2, ln2/2], degree-6 polynomial, FMA);
// x < -60 (and -inf) gives exactly 0
AMX_TARGET static inline __m512 exp_neg(__m512 x) {
    const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-60.0f), _CMP_GE_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(-60.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 z = _mm512_set1_ps(1.0f / 720.0f);
    z = _mm512_fmadd_ps(z, r, _mm512_set1_ps(1.0f / 120.0f));
    z = _mm512_fmadd_ps(z, r, _mm512_set1_ps(1.0f / 24.0f));
    z = _mm512_fmadd_ps(z, r, _mm512_set1_ps(1.0f / 6.0f));
    z = _mm512_fmadd_ps(z, r, _mm512_set1_ps(0.5f));
    z = _mm512_fmadd_ps(z, r, _mm512_set1_ps(1.0f));
    z = _mm512_fmadd_ps(z, r, _mm512_set1_ps(1.0f));
    return _mm512_maskz_mov_ps(keep, _mm512_scalef_ps(z, n));
}

constexpr float LOG2E = 1.44269504088896341f;

// 2^t for t <= ~0 (a softmax numerator): 2^n * poly(t - n), n = round(t), a degree-5 fit of 2^f on
// [-1/2, 1/2] (relative error < 3e-7 in float32); t below -150 gives 0
AMX_TARGET static inline __m512 exp2_poly(__m512 t) {
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 z = _mm512_set1_ps(1.3400432166e-03f);
    z = _mm512_fmadd_ps(z, f, _mm512_set1_ps(9.6760370979e-03f));
    z = _mm512_fmadd_ps(z, f, _mm512_set1_ps(5.5503272142e-02f));
    z = _mm512_fmadd_ps(z, f, _mm512_set1_ps(2.4022107356e-01f));
    z = _mm512_fmadd_ps(z, f, _mm512_set1_ps(6.9314720671e-01f));
    z = _mm512_fmadd_ps(z, f, _mm512_set1_ps(1.0000000755e+00f));
    return _mm512_scalef_ps(z, n);
}

struct Scratch {
    std::vector<float> s;     // [G, 16, Ls] scores
    std::vector<uint16_t> p;  // [G, 16, Ls] bf16 probabilities (tile rows)
};

struct Args {
    const uint16_t* q; int64_t q_sh, q_st;  // bf16 q[h, t, :] (rotated), unit stride in d
    const uint16_t* kb;                      // keys in 16-key blocks: [Hkv, nkb, D/2, 16, 2]
    int64_t nkb;
    const uint16_t* vp;                      // one layer: [Hkv, cap/2, D, 2]
    int64_t cap;
    uint16_t* out;                           // bf16 [T, H, D]
    int H, Hkv, T;
    int64_t start;
};

static inline uint16_t bf16_bits(float f) {  // round to nearest even (finite inputs)
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
static inline float bf16_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// One task: the G query heads of kv head `hk` (G <= 4) at the 16 positions of tile `ti`.
AMX_TARGET static void tile_task(const Args& a, int hk, int ti, Scratch& sc) {
    const int G = a.H / a.Hkv;
    const int t0 = ti * TM;
    const int nrows = std::min(TM, a.T - t0);
    const int64_t pos0 = a.start + t0;
    const int64_t nkeys = pos0 + nrows;                 // keys 0 .. last row's position
    const int64_t Ls = (nkeys + 31) / 32 * 32;          // score / probability columns (32-key steps)
    // row strides padded by a cache line: rows a power of two apart would share one cache set
    const int64_t ss = Ls + 16, ps = Ls + 32;
    sc.s.resize((size_t)G * TM * ss);
    sc.p.resize((size_t)G * TM * ps);
    float* S = sc.s.data();
    uint16_t* P = sc.p.data();

    // q / 8 (exact in bf16), zero rows past T
    alignas(64) uint16_t qb[MAXG][TM][D];
    for (int g = 0; g < G; ++g)
        for (int r = 0; r < TM; ++r) {
            if (r < nrows) {
                const uint16_t* qr = a.q + (int64_t)(hk * G + g) * a.q_sh + (int64_t)(t0 + r) * a.q_st;
                for (int d = 0; d < D; ++d) qb[g][r][d] = bf16_bits(bf16_float(qr[d]) * 0.125f);
            } else {
                std::memset(qb[g][r], 0, sizeof qb[g][r]);
            }
        }

    // scores, 16 keys per step: one load of the keys' two d-halves serves the G heads
    const uint16_t* kb = a.kb + (int64_t)hk * a.nkb * (D / 2) * 32;
    const int64_t sgs = (int64_t)TM * ss, pgs = (int64_t)TM * ps;  // one head's scores / probabilities
    for (int64_t j0 = 0; j0 < Ls; j0 += 16) {
        const uint16_t* blk = kb + (j0 / 16) * (D / 2) * 32;
        _tile_loadd(2, blk, 64);
        _tile_loadd(3, blk + 16 * 32, 64);
#define AS_SCORE(g, tile)                                        \
        if ((g) < G) {                                           \
            _tile_loadd(0, &qb[g][0][0], D * 2);                 \
            _tile_loadd(1, &qb[g][0][32], D * 2);                \
            _tile_zero(tile);                                    \
            _tile_dpbf16ps(tile, 0, 2);                          \
            _tile_dpbf16ps(tile, 1, 3);                          \
            _tile_stored(tile, S + (g) * sgs + j0, ss * 4);          \
        }
        AS_SCORE(0, 4) AS_SCORE(1, 5) AS_SCORE(2, 6) AS_SCORE(3, 7)
#undef AS_SCORE
    }

    // softmax numerators per row, as bf16 tile rows; 1 / sum kept per row
    float inv_l[MAXG][TM];
    for (int g = 0; g < G; ++g)
        for (int r = 0; r < TM; ++r) {
            uint16_t* pr = P + g * pgs + (int64_t)r * ps;
            if (r >= nrows) {
                std::memset(pr, 0, sizeof(uint16_t) * Ls);
                inv_l[g][r] = 0.0f;
                continue;
            }
            const float* sr = S + g * sgs + (int64_t)r * ss;
            const int64_t nv = pos0 + r + 1;  // visible keys
            __m512 mx = _mm512_set1_ps(-INFINITY);
            for (int64_t j = 0; j < nv; j += 16) {
                const int64_t left = nv - j;
                const __mmask16 lanes = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
                mx = _mm512_mask_max_ps(mx, lanes, mx, _mm512_loadu_ps(sr + j));
            }
            // p_j = 2^(s_j log2(e) - m log2(e)): one FMA and the base-2 polynomial
            const __m512 ml = _mm512_set1_ps(_mm512_reduce_max_ps(mx) * LOG2E);
            const __m512 l2e = _mm512_set1_ps(LOG2E);
            __m512 acc = _mm512_setzero_ps();
            const int64_t full = nv / 16 * 16;
            int64_t j = 0;
            for (; j < full; j += 16) {  // every key visible
                const __m512 p = exp2_poly(_mm512_fmsub_ps(_mm512_loadu_ps(sr + j), l2e, ml));
                acc = _mm512_add_ps(acc, p);
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + j), (__m256i)_mm512_cvtneps_pbh(p));
            }
            if (j < nv) {  // the diagonal block: keys past the row's position give exact zeros
                const __mmask16 lanes = (__mmask16)((1u << (nv - j)) - 1);
                const __m512 p = _mm512_maskz_mov_ps(lanes, exp2_poly(_mm512_fmsub_ps(_mm512_loadu_ps(sr + j), l2e, ml)));
                acc = _mm512_add_ps(acc, p);
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + j), (__m256i)_mm512_cvtneps_pbh(p));
                j += 16;
            }
            for (; j < Ls; j += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + j), _mm256_setzero_si256());
            // fixed pairwise tree over the 16 lanes
            alignas(64) float lane[16];
            _mm512_store_ps(lane, acc);
            for (int w = 8; w >= 1; w /= 2)
                for (int i = 0; i < w; ++i) lane[i] = lane[i] + lane[i + w];
            inv_l[g][r] = 1.0f / lane[0];
        }

    // o = p @ v per head, 32 keys per step, 4 tiles of 16 dims
    const uint16_t* vp = a.vp + (int64_t)hk * (a.cap / 2) * D * 2;
    for (int g = 0; g < G; ++g) {
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
        const uint16_t* pg = P + g * pgs;
        for (int64_t j0 = 0; j0 < Ls; j0 += 32) {
            _tile_loadd(0, pg + j0, ps * 2);
            const uint16_t* vb = vp + (j0 / 2) * D * 2;
            _tile_loadd(1, vb, D * 4);
            _tile_loadd(2, vb + 32, D * 4);
            _tile_loadd(3, vb + 64, D * 4);
            _tile_dpbf16ps(4, 0, 1);
            _tile_dpbf16ps(5, 0, 2);
            _tile_loadd(1, vb + 96, D * 4);
            _tile_dpbf16ps(6, 0, 3);
            _tile_dpbf16ps(7, 0, 1);
        }
        alignas(64) float ob[TM][D];
        _tile_stored(4, &ob[0][0], D * 4);
        _tile_stored(5, &ob[0][16], D * 4);
        _tile_stored(6, &ob[0][32], D * 4);
        _tile_stored(7, &ob[0][48], D * 4);
        for (int r = 0; r < nrows; ++r) {
            uint16_t* o = a.out + ((int64_t)(t0 + r) * a.H + hk * G + g) * D;
            const __m512 il = _mm512_set1_ps(inv_l[g][r]);
            for (int d = 0; d < D; d += 16)
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + d),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(&ob[r][d]), il)));
        }
    }
}

AMX_TARGET static void run_tasks(const Args& a, int threads, std::vector<Scratch>& pool) {
    const int tiles = (a.T + TM - 1) / TM;
    const int n = a.Hkv * tiles;
    if ((int)pool.size() < threads) pool.resize(threads);
#pragma omp parallel num_threads(threads)
    {
        Scratch& sc = pool[omp_get_thread_num()];
        tiles_on();
        // kv head by kv head (the threads share its keys and values in cache), the longest
        // tiles (latest positions) first
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < n; ++i) tile_task(a, i / tiles, tiles - 1 - i % tiles, sc);
        tiles_off();
    }
}

#endif  // AGENTSPEC_AMX

#if defined(AGENTSPEC_AMX)
// ---------------------------------------------------------------------------------------------
// y = x @ W.T for a prompt chunk's rows with AMX tiles, over the panel-packed weights the decode
// linears keep (kernels/csrc/linear.cpp: [ceil(N/16), K/2, 16, 2]; a panel's 16 pair-rows at
// K-block kb are one 1 KB AMX B operand tile, 64 bytes a row). x rows are the A tiles, 16 rows
// by 32 columns, read in place. Each output (m, n) is TDPBF16PS's float32 accumulation over the
// K-blocks in ascending order, rounded once to bfloat16: it depends on row m of x alone, never on
// how many rows share the call, where the row sits in it or how panels are split between
// threads (row- and thread-invariant, as the prompt chunks' exactness argument needs). Not the
// decode linears' bits (their VDPBF16PS chain adds a pair in another order).
// Threads take contiguous runs of panel pairs; each pair streams once from memory and serves
// every row (2 x 2 tiles: four accumulators, two row tiles, two weight tiles).

template <int MA, int NB>
AMX_TARGET static inline void lin_block(const uint16_t* a0, int64_t as0, const uint16_t* a1, int64_t as1,
                                        const uint16_t* w0, const uint16_t* w1, int64_t kbs, float* cbuf) {
    _tile_zero(4);
    if (NB == 2) _tile_zero(5);
    if (MA == 2) _tile_zero(6);
    if (MA == 2 && NB == 2) _tile_zero(7);
    for (int64_t kb = 0; kb < kbs; ++kb) {
        _tile_loadd(2, w0 + kb * 512, 64);
        if (NB == 2) _tile_loadd(3, w1 + kb * 512, 64);
        _tile_loadd(0, a0 + kb * 32, as0 * 2);
        _tile_dpbf16ps(4, 0, 2);
        if (NB == 2) _tile_dpbf16ps(5, 0, 3);
        if (MA == 2) {
            _tile_loadd(1, a1 + kb * 32, as1 * 2);
            _tile_dpbf16ps(6, 1, 2);
            if (NB == 2) _tile_dpbf16ps(7, 1, 3);
        }
    }
    _tile_stored(4, cbuf, 128);
    if (NB == 2) _tile_stored(5, cbuf + 16, 128);
    if (MA == 2) _tile_stored(6, cbuf + 16 * 32, 128);
    if (MA == 2 && NB == 2) _tile_stored(7, cbuf + 16 * 32 + 16, 128);
}

// bf16 -> float32 of 16 lanes, and float32 -> bf16 (round to nearest even) -> float32
AMX_TARGET static inline __m512 widen16(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
AMX_TARGET static inline __m256i round16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }
AMX_TARGET static inline __m512 rounded(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(round16(v)), 16));
}


AMX_TARGET static void norm_row(const uint16_t* x, const uint16_t* w, int64_t dim, float eps, uint16_t* o) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; d += 16) {
        const __m512 v = widen16(x + d);
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    alignas(64) float lane[16];
    _mm512_store_ps(lane, acc);
    for (int k = 8; k >= 1; k /= 2)
        for (int i = 0; i < k; ++i) lane[i] = lane[i] + lane[i + k];
    const __m512 r = _mm512_set1_ps(1.0f / std::sqrt(lane[0] / (float)dim + eps));
    for (int64_t d = 0; d < dim; d += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + d),
                            round16(_mm512_mul_ps(_mm512_mul_ps(widen16(x + d), r), widen16(w + d))));
}

// What happens to a 16-column accumulator row on its way out (torch's roundings, step by step):
//   PLAIN     o = bf16(acc)
//   RESIDUAL  o = bf16(res + bf16(acc))                       (x + linear(..) in bf16)
//   SILU      o = bf16(bf16(silu(bf16(g))) * bf16(u))          (silu(gate) * up in bf16), g the
//             accumulator of gate panel p, u of up panel p + NP/2 (w_gate_up = [gate; up])

struct LinArgs {
    const uint16_t* x; int64_t xs, M; const uint16_t* xt;  // rows; zero-padded last partial tile
    const uint16_t* w; int64_t N, K;                        // packed weight, its N (gate|up for SILU)
    uint16_t* out; int64_t os;                              // [M, N] (SILU: [M, N/2])
    const uint16_t* res; int64_t rs;                        // RESIDUAL: [M, N] (may be `out`)
    int mode;
};

AMX_TARGET static inline void lin_out(const LinArgs& a, const float* c, int64_t row, int64_t col, int nb,
                                      int64_t cols) {
    uint16_t* o = a.out + row * a.os + col;
    if (a.mode == SILU) {  // c[0..16): gate, c[16..32): up, one output panel
        const __m512 g = rounded(_mm512_load_ps(c)), u = rounded(_mm512_load_ps(c + 16));
        // silu(g) = g / (1 + e) for g >= 0, g e / (1 + e) for g < 0, with e = exp(-|g|) <= 1
        const __m512 e = exp_neg(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
        const __mmask16 neg = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
        const __m512 num = _mm512_mask_mul_ps(g, neg, g, e);
        const __m512 sl = rounded(_mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), round16(_mm512_mul_ps(sl, u)));
        return;
    }
    for (int h = 0; h < nb; ++h) {
        const int64_t n = std::min<int64_t>(16, cols - 16 * h);
        if (n <= 0) break;
        __m512 v = _mm512_load_ps(c + 16 * h);
        const __mmask16 lanes = n == 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
        if (a.mode == RESIDUAL) {
            const uint16_t* r = a.res + row * a.rs + col + 16 * h;
            const __m512 rv = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, r)), 16));
            v = _mm512_add_ps(rv, rounded(v));
        }
        _mm256_mask_storeu_epi16(o + 16 * h, lanes, round16(v));
    }
}

// Units [u0, u1) of output columns: a unit is a pair of 16-column panels (p = 2u, 2u + 1), or
// for SILU the gate panel u with its up panel u + NP/2. Blocked for the caches: a group of units
// whose weights fit L2 streams from memory once, while 256-row blocks of x take turns over it.
AMX_TARGET static void linear_rows(const LinArgs& a, int64_t u0, int64_t u1) {
    const int64_t K2 = a.K / 2, kbs = a.K / 32, mt = (a.M + 15) / 16, mfull = a.M / 16;
    const int64_t NP = (a.N + 15) / 16;
    const bool silu = a.mode == SILU;
    const int64_t unit_bytes = 2 * K2 * 64;
    const int64_t group = std::max<int64_t>(1, (int64_t)(640 << 10) / unit_bytes);
    constexpr int64_t MB = 16;  // row tiles per block (256 rows)
    alignas(64) float cbuf[32 * 32];
    for (int64_t g0 = u0; g0 < u1; g0 += group) {
        const int64_t g1 = std::min(u1, g0 + group);
        for (int64_t i0 = 0; i0 < mt; i0 += MB) {
            const int64_t i1 = std::min(mt, i0 + MB);
            for (int64_t u = g0; u < g1; ++u) {
                const int64_t p = silu ? u : 2 * u;
                const int nb = silu || p + 1 < NP ? 2 : 1;
                const uint16_t* w0 = a.w + p * K2 * 32;
                const uint16_t* w1 = silu ? a.w + (p + NP / 2) * K2 * 32 : w0 + K2 * 32;
                for (int64_t i = i0; i < i1; i += 2) {
                    const int ma = i + 1 < i1 ? 2 : 1;
                    const uint16_t* a0 = i < mfull ? a.x + i * 16 * a.xs : a.xt;
                    const int64_t as0 = i < mfull ? a.xs : a.K;
                    const uint16_t* a1 = i + 1 < mfull ? a.x + (i + 1) * 16 * a.xs : a.xt;
                    const int64_t as1 = i + 1 < mfull ? a.xs : a.K;
                    if (ma == 2 && nb == 2) lin_block<2, 2>(a0, as0, a1, as1, w0, w1, kbs, cbuf);
                    else if (ma == 2) lin_block<2, 1>(a0, as0, a1, as1, w0, w1, kbs, cbuf);
                    else if (nb == 2) lin_block<1, 2>(a0, as0, a1, as1, w0, w1, kbs, cbuf);
                    else lin_block<1, 1>(a0, as0, a1, as1, w0, w1, kbs, cbuf);
                    const int64_t rows = std::min<int64_t>(16 * ma, a.M - i * 16);
                    const int64_t c0 = p * 16, cols = silu ? 16 : std::min<int64_t>(16 * nb, a.N - c0);
                    for (int64_t r = 0; r < rows; ++r) lin_out(a, cbuf + r * 32, i * 16 + r, c0, nb, cols);
                }
            }
        }
    }
}

#endif  // AGENTSPEC_AMX (linear)

}  // namespace

// Whether this CPU (and OS) run AMX-BF16 (AVX-512 with it): the prefill kernels here and the
// decode kernel's phases below (qkv_attention_amx.cpp)
bool prefill_amx_available() {
#if defined(AGENTSPEC_AMX)
    return amx_ready();
#else
    return false;
#endif
}

namespace {

// One key / value row (bf16 [D]) of kv head `hk` into the layer's packed copies at `slot`:
// kt2 [Hkv, D/2, cap, 2] (d-pairs a capacity apart) and vp [Hkv, cap/2, D, 2] (slot pairs)
static inline void pack_slot(const uint16_t* kr, const uint16_t* vr, int hk, int64_t slot, int64_t cap, uint16_t* kt,
                             uint16_t* vpp) {
    uint16_t* kp = kt + (int64_t)hk * (D / 2) * cap * 2 + slot * 2;
    for (int i = 0; i < D / 2; ++i) {
        kp[(int64_t)i * cap * 2] = kr[2 * i];
        kp[(int64_t)i * cap * 2 + 1] = kr[2 * i + 1];
    }
    uint16_t* vq = vpp + ((int64_t)hk * (cap / 2) + slot / 2) * D * 2 + (slot & 1);
    for (int d = 0; d < D; ++d) vq[2 * d] = vr[d];
}

#if defined(AGENTSPEC_AMX)
// The chunk's rows (q bf16 [H, T, D] at strides q_sh / q_st) attend over kt2 / vp, which already
// hold keys and values 0 .. start + T. Runs without the GIL (the caller released it).
static void attend_packed(const uint16_t* q, int64_t q_sh, int64_t q_st, const uint16_t* kt, const uint16_t* vpp,
                          int64_t cap, int64_t start, int T, int H, int Hkv, uint16_t* out, int threads) {
    // the keys in 16-key blocks, each two contiguous AMX operand tiles (kt2's rows lie a
    // capacity apart: one tile load would touch 16 lines of one cache set)
    const int64_t Ls = (start + T + 31) / 32 * 32;
    const int64_t nkb = Ls / 16;
    static thread_local std::vector<uint16_t> kbuf;  // the calling thread's, kept between calls
    kbuf.resize(std::max(kbuf.size(), (size_t)Hkv * nkb * (D / 2) * 32));
    uint16_t* const kb = kbuf.data();  // (inside the parallel regions `kbuf` would name each worker's own)
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t hb = 0; hb < Hkv * nkb; ++hb) {
        const int64_t hk = hb / nkb, b = hb % nkb;
        const uint16_t* src = kt + hk * (D / 2) * cap * 2 + b * 32;
        uint16_t* dst = kb + hb * (D / 2) * 32;
        for (int i = 0; i < D / 2; ++i) std::memcpy(dst + i * 32, src + (int64_t)i * cap * 2, 64);
    }
    Args a{q, q_sh, q_st, kb, nkb, vpp, cap, out, H, Hkv, T, start};
    // the calling thread's scratch buffers (one per worker), kept between calls: a fresh megabyte
    // would page-fault in again on every call
    static thread_local std::vector<Scratch> pool;
    run_tasks(a, threads, pool);  // (a reference: the workers use the caller's pool)
}

// bf16 rotary embedding of one head row (D = 64, rotate_half layout), rounded as torch rounds
// x * cos + rotate_half(x) * sin in bfloat16: bf16(bf16(x c) + bf16(r s))
AMX_TARGET static inline void rope_row(const uint16_t* x, const uint16_t* c, const uint16_t* sn, uint16_t* o) {
    for (int h = 0; h < 2; ++h) {
        const __m512 lo = widen16(x + 16 * h), hi = widen16(x + 32 + 16 * h);
        const __m512 clo = widen16(c + 16 * h), chi = widen16(c + 32 + 16 * h);
        const __m512 slo = widen16(sn + 16 * h), shi = widen16(sn + 32 + 16 * h);
        const __m512 olo = _mm512_add_ps(rounded(_mm512_mul_ps(lo, clo)),
                                         rounded(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), hi), slo)));
        const __m512 ohi = _mm512_add_ps(rounded(_mm512_mul_ps(hi, chi)), rounded(_mm512_mul_ps(lo, shi)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16 * h), round16(olo));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 32 + 16 * h), round16(ohi));
    }
}

// One chunk row of the fused projection: q rotated into qr [H, T, D]; k rotated and v written at
// `slot` of the float32 cache (kc / vc [Hkv, cap, D]) and of its packed copies kt2 / vp
AMX_TARGET static void rope_scatter_row(const uint16_t* row, const uint16_t* c, const uint16_t* s, uint16_t* qr,
                                        int t, int T, int H, int Hkv, int64_t slot, int64_t cap, float* kc,
                                        float* vc, uint16_t* kt, uint16_t* vpp) {
    for (int h = 0; h < H; ++h) rope_row(row + h * D, c, s, qr + ((int64_t)h * T + t) * D);
    for (int hk = 0; hk < Hkv; ++hk) {
        alignas(64) uint16_t kr[D];
        rope_row(row + (H + hk) * D, c, s, kr);
        const uint16_t* vr = row + (H + Hkv + hk) * D;
        float* kd = kc + ((int64_t)hk * cap + slot) * D;
        float* vd = vc + ((int64_t)hk * cap + slot) * D;
        for (int d = 0; d < D; d += 16) {
            _mm512_storeu_ps(kd + d, widen16(kr + d));
            _mm512_storeu_ps(vd + d, widen16(vr + d));
        }
        pack_slot(kr, vr, hk, slot, cap, kt, vpp);
    }
}
#endif

}  // namespace

// Pack the chunk's keys / values (bf16 [Hkv, T, D], strides in elements) into kt2 / vp at slots
// [start, start + T), then attend. out: bf16 [T, H, D].
void prefill_attention(uintptr_t q, int64_t q_sh, int64_t q_st, uintptr_t k, int64_t k_sh, int64_t k_st,
                       uintptr_t v, int64_t v_sh, int64_t v_st, uintptr_t kt2, uintptr_t vp, int64_t cap,
                       int64_t start, int T, int H, int Hkv, int head_dim, uintptr_t out, int threads) {
    if (head_dim != D) throw std::invalid_argument("head_dim must be 64");
    if (Hkv <= 0 || H % Hkv != 0 || H / Hkv > MAXG)
        throw std::invalid_argument("n_heads must be 1 to 4 times n_kv_heads");
    if (start < 0 || start % TM != 0) throw std::invalid_argument("a prefill chunk must start at a multiple of 16");
    if (T <= 0 || cap % 64 != 0 || start + T > cap) throw std::invalid_argument("chunk outside the cache");
#if defined(AGENTSPEC_AMX)
    if (!amx_ready()) throw std::runtime_error("AMX is not available on this CPU");
    if (threads <= 0) threads = omp_get_max_threads();
    nb::gil_scoped_release nogil;
    uint16_t* kt = reinterpret_cast<uint16_t*>(kt2);
    uint16_t* vpp = reinterpret_cast<uint16_t*>(vp);
    const uint16_t* kk = reinterpret_cast<const uint16_t*>(k);
    const uint16_t* vv = reinterpret_cast<const uint16_t*>(v);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int hk = 0; hk < Hkv; ++hk) {
        for (int t = 0; t < T; ++t) {
            const int64_t s = start + t;
            const uint16_t* kr = kk + (int64_t)hk * k_sh + (int64_t)t * k_st;
            const uint16_t* vr = vv + (int64_t)hk * v_sh + (int64_t)t * v_st;
            pack_slot(kr, vr, hk, s, cap, kt, vpp);
        }
    }
    attend_packed(reinterpret_cast<const uint16_t*>(q), q_sh, q_st, kt, vpp, cap, start, T, H, Hkv,
                  reinterpret_cast<uint16_t*>(out), threads);
#else
    (void)q; (void)q_sh; (void)q_st; (void)k; (void)k_sh; (void)k_st; (void)v; (void)v_sh; (void)v_st;
    (void)kt2; (void)vp; (void)out; (void)threads;
    throw std::runtime_error("AMX prefill attention needs an x86-64 build");
#endif
}


// A prompt chunk's attention from the fused projection qkv (bf16 [T, (H + 2 Hkv) D], row stride
// qkv_st): rotary embedding of q and k (cos / sin bf16 [T, D], row stride cs_st, the chunk's
// positions), the keys and values written at slots [start, start + T) of the layer's float32 cache
// (kf / vf [Hkv, cap, D]) and its packed copies (kt2 / vp), then the causal attention as
// prefill_attention. out: bf16 [T, H, D].
void prefill_qkv_attention(uintptr_t qkv, int64_t qkv_st, uintptr_t cos, uintptr_t sin, int64_t cs_st,
                           uintptr_t kf, uintptr_t vf, uintptr_t kt2, uintptr_t vp, int64_t cap, int64_t start,
                           int T, int H, int Hkv, int head_dim, uintptr_t out, int threads) {
    if (head_dim != D) throw std::invalid_argument("head_dim must be 64");
    if (Hkv <= 0 || H % Hkv != 0 || H / Hkv > MAXG)
        throw std::invalid_argument("n_heads must be 1 to 4 times n_kv_heads");
    if (start < 0 || start % TM != 0) throw std::invalid_argument("a prefill chunk must start at a multiple of 16");
    if (T <= 0 || cap % 64 != 0 || start + T > cap) throw std::invalid_argument("chunk outside the cache");
    if (qkv_st < (int64_t)(H + 2 * Hkv) * D || cs_st < D) throw std::invalid_argument("bad strides");
#if defined(AGENTSPEC_AMX)
    if (!amx_ready()) throw std::runtime_error("AMX is not available on this CPU");
    if (threads <= 0) threads = omp_get_max_threads();
    nb::gil_scoped_release nogil;
    static thread_local std::vector<uint16_t> qbuf;  // rotated q [H, T, D], kept between calls
    qbuf.resize(std::max(qbuf.size(), (size_t)H * T * D));
    uint16_t* const qr = qbuf.data();
    const uint16_t* x = reinterpret_cast<const uint16_t*>(qkv);
    const uint16_t* cs = reinterpret_cast<const uint16_t*>(cos);
    const uint16_t* sn = reinterpret_cast<const uint16_t*>(sin);
    float* kc = reinterpret_cast<float*>(kf);
    float* vc = reinterpret_cast<float*>(vf);
    uint16_t* kt = reinterpret_cast<uint16_t*>(kt2);
    uint16_t* vpp = reinterpret_cast<uint16_t*>(vp);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int t = 0; t < T; ++t)
        rope_scatter_row(x + (int64_t)t * qkv_st, cs + (int64_t)t * cs_st, sn + (int64_t)t * cs_st, qr, t, T, H, Hkv,
                         start + t, cap, kc, vc, kt, vpp);
    attend_packed(qr, (int64_t)T * D, D, kt, vpp, cap, start, T, H, Hkv, reinterpret_cast<uint16_t*>(out), threads);
#else
    (void)qkv; (void)qkv_st; (void)cos; (void)sin; (void)cs_st; (void)kf; (void)vf; (void)kt2; (void)vp;
    (void)out; (void)threads;
    throw std::runtime_error("AMX prefill attention needs an x86-64 build");
#endif
}

// RMSNorm of bf16 rows (as torch's fused rms_norm rounds it in bfloat16): out = bf16((x r) w),
// r = 1 / sqrt(mean(x^2) + eps) in float32 (the sum over 16 lanes, then a fixed tree). Row-wise.
void rms_norm_rows(uintptr_t x, int64_t x_st, int64_t M, uintptr_t w, int64_t dim, double eps, uintptr_t out,
                   int64_t o_st, int threads) {
    if (M <= 0 || dim <= 0 || dim % 16 != 0 || x_st < dim || o_st < dim)
        throw std::invalid_argument("rms_norm_rows: bad shapes (dim a multiple of 16)");
#if defined(AGENTSPEC_AMX)
    if (!prefill_amx_available()) throw std::runtime_error("needs AVX-512 with AMX here");
    if (threads <= 0) threads = omp_get_max_threads();
    nb::gil_scoped_release nogil;
    const uint16_t* xp = reinterpret_cast<const uint16_t*>(x);
    const uint16_t* wp = reinterpret_cast<const uint16_t*>(w);
    uint16_t* op = reinterpret_cast<uint16_t*>(out);
    const float e = (float)eps;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t m = 0; m < M; ++m) norm_row(xp + m * x_st, wp, dim, e, op + m * o_st);
#else
    (void)x; (void)x_st; (void)w; (void)eps; (void)out; (void)o_st; (void)threads;
    throw std::runtime_error("needs an x86-64 build");
#endif
}

// x: bfloat16 [M, K] (row stride x_st elements), wp: packed [ceil(N/16), K/2, 16, 2], K a multiple
// of 32; out: bfloat16 [M, N] (row stride o_st), [M, N/2] for mode SILU (N/2 a multiple of 16);
// res: mode RESIDUAL's bfloat16 [M, N] (row stride r_st; may be out).
void linear_amx(uintptr_t x, int64_t x_st, int64_t M, uintptr_t wp, int64_t N, int64_t K, uintptr_t out,
                int64_t o_st, int threads, int mode, uintptr_t res, int64_t r_st) {
    if (M <= 0 || N <= 0 || K <= 0 || K % 32 != 0 || x_st < K || o_st < (mode == SILU ? N / 2 : N))
        throw std::invalid_argument("linear_amx: bad shapes or strides (K must be a multiple of 32)");
    if (mode < PLAIN || mode > SILU) throw std::invalid_argument("linear_amx: mode must be 0, 1 or 2");
    if (mode == SILU && N % 32 != 0) throw std::invalid_argument("linear_amx: SILU needs N a multiple of 32");
    if (mode == RESIDUAL && (res == 0 || r_st < N)) throw std::invalid_argument("linear_amx: bad residual");
#if defined(AGENTSPEC_AMX)
    if (!amx_ready()) throw std::runtime_error("AMX is not available on this CPU");
    if (threads <= 0) threads = omp_get_max_threads();
    const int64_t NP = (N + 15) / 16;
    // units a thread takes: panel pairs, or (SILU) gate panels, each with its up panel
    const int64_t units = mode == SILU ? NP / 2 : (NP + 1) / 2;
    threads = (int)std::max<int64_t>(1, std::min<int64_t>(threads, units));
    nb::gil_scoped_release nogil;
    const uint16_t* xp = reinterpret_cast<const uint16_t*>(x);
    // rows past the last whole 16-row tile, zero-padded to a tile
    static thread_local std::vector<uint16_t> tail;
    const int64_t mfull = M / 16;
    const uint16_t* xt = nullptr;
    if (M % 16) {
        tail.assign((size_t)16 * K, 0);
        for (int64_t r = 0; r < M - mfull * 16; ++r)
            std::memcpy(tail.data() + r * K, xp + (mfull * 16 + r) * x_st, (size_t)K * 2);
        xt = tail.data();
    }
    const LinArgs a{xp, x_st, M, xt, reinterpret_cast<const uint16_t*>(wp), N, K, reinterpret_cast<uint16_t*>(out),
                    o_st, reinterpret_cast<const uint16_t*>(res), r_st, mode};
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t q0 = units * t / nt, q1 = units * (t + 1) / nt;
        tiles_on();
        linear_rows(a, q0, q1);
        tiles_off();
    }
#else
    (void)x; (void)x_st; (void)wp; (void)out; (void)o_st; (void)threads; (void)res;
    throw std::runtime_error("AMX linear needs an x86-64 build");
#endif
}

// ---------------------------------------------------------------------------------------------
// AMX phases of the decode / verify attention (qkv_attention_amx.cpp; the default on CPUs
// with AMX). Query rows m are a request's (row, head) pairs of one kv head, 16 to a tile.
//   scores  S[m][j] = TDPBF16PS(q_m[0:32] . k_j[0:32]) then += (q_m[32:64] . k_j[32:64]), from
//           kt2 in place (its d-pair rows are AMX's VNNI B layout for 16 keys);
//   p @ v   o_m = sum over the row's compact keys in 32-key blocks, in order, of TDPBF16PS
//           (p_m[block] . v[block]): blocks every row of the request holds at their own slots
//           come straight from vp, with 16 rows per tile; a row's other blocks (its draft-tree
//           ancestors, the last partial block, zero-padded: exact zero products) from values
//           gathered into the same layout, the row alone.
// TDPBF16PS computes each output element from its own A row and B column only, so a row's bits
// depend on its compact sequence of keys alone, never on which rows share its tile or which of
// its blocks came from vp: a draft-tree node gets the bits of the same token decoded plainly.
// (Not the VDPBF16PS kernels' bits: the tile sums a block in another order. The engine runs one
// or the other for every decode / verify row of a process.)

#if defined(AGENTSPEC_AMX)
// Tile configuration on / off for the calling thread: around a thread's calls below.
AMX_TARGET void amx_decode_tiles(bool on) {
    if (on) tiles_on();
    else tiles_off();
}

// Scores of ntiles tiles of 16 query rows (qb: [ntiles][16][64] bf16, q / 8, row-major) against
// slots [j0, j1) of one kv head's kt2 ([D/2, cap, 2]); need[b]: compute 64-slot block j0/64 + b.
// S: row 0 at slot 0, row stride ss floats (16 rows per tile are stored, valid or not). Each
// 32-key step's key tiles are loaded once for every row tile; the next block is prefetched.
AMX_TARGET void amx_decode_scores(const uint16_t* qb, int ntiles, const uint16_t* kt2, int64_t cap, int j0, int j1,
                                  const uint8_t* need, float* S, int64_t ss) {
    for (int jb = j0; jb < j1; jb += 64) {
        if (!need[(jb - j0) / 64]) continue;
        if (jb + 64 < j1)
            for (int i = 0; i < D / 2; ++i) {
                const char* pf = reinterpret_cast<const char*>(kt2 + ((int64_t)i * cap + jb + 64) * 2);
                for (int l = 0; l < 256; l += 64) _mm_prefetch(pf + l, _MM_HINT_T0);
            }
        const int je = std::min(j1, jb + 64);
        for (int j = jb; j < je; j += 32) {
            const bool two = j + 32 <= je;
            _tile_loadd(2, kt2 + (int64_t)j * 2, cap * 4);
            _tile_loadd(3, kt2 + ((int64_t)16 * cap + j) * 2, cap * 4);
            if (two) {
                _tile_loadd(5, kt2 + (int64_t)(j + 16) * 2, cap * 4);
                _tile_loadd(6, kt2 + ((int64_t)16 * cap + j + 16) * 2, cap * 4);
            }
            for (int rt = 0; rt < ntiles; ++rt) {
                const uint16_t* q = qb + (int64_t)rt * 16 * D;
                float* st = S + (int64_t)rt * 16 * ss;
                _tile_loadd(0, q, D * 2);
                _tile_loadd(1, q + 32, D * 2);
                _tile_zero(4);
                _tile_dpbf16ps(4, 0, 2);
                _tile_dpbf16ps(4, 1, 3);
                _tile_stored(4, st + j, ss * 4);
                if (two) {
                    _tile_zero(7);
                    _tile_dpbf16ps(7, 0, 5);
                    _tile_dpbf16ps(7, 1, 6);
                    _tile_stored(7, st + j + 16, ss * 4);
                }
            }
        }
    }
}

// The shared blocks' p @ v for lanes [32h, 32h + 32) of d, for ntiles tiles of 16 rows:
// acc[m][32] (row stride acs floats) = sum over compact keys [0, E) (E a multiple of 32) of P rows
// (bf16, row stride ps) times vp ([cap/2, D, 2] of one kv head), block by block in order. The
// first row tile streams the values; the others find them in cache.
AMX_TARGET void amx_decode_pv(const uint16_t* P, int64_t ps, const uint16_t* vp, int E, int h, int ntiles,
                              float* acc, int64_t acs) {
    const uint16_t* vh = vp + 32 * h * 2;
    for (int rt = 0; rt < ntiles; ++rt) {
        const uint16_t* pr = P + (int64_t)rt * 16 * ps;
        _tile_zero(4);
        _tile_zero(5);
        int j0 = 0;
        for (; j0 + 64 <= E; j0 += 64) {
            _tile_loadd(0, pr + j0, ps * 2);
            _tile_loadd(1, vh + (int64_t)(j0 / 2) * D * 2, D * 4);
            _tile_loadd(2, vh + (int64_t)(j0 / 2) * D * 2 + 32, D * 4);
            _tile_loadd(3, pr + j0 + 32, ps * 2);
            _tile_loadd(6, vh + (int64_t)(j0 / 2 + 16) * D * 2, D * 4);
            _tile_loadd(7, vh + (int64_t)(j0 / 2 + 16) * D * 2 + 32, D * 4);
            _tile_dpbf16ps(4, 0, 1);
            _tile_dpbf16ps(5, 0, 2);
            _tile_dpbf16ps(4, 3, 6);
            _tile_dpbf16ps(5, 3, 7);
        }
        if (j0 < E) {
            _tile_loadd(0, pr + j0, ps * 2);
            _tile_loadd(1, vh + (int64_t)(j0 / 2) * D * 2, D * 4);
            _tile_loadd(2, vh + (int64_t)(j0 / 2) * D * 2 + 32, D * 4);
            _tile_dpbf16ps(4, 0, 1);
            _tile_dpbf16ps(5, 0, 2);
        }
        _tile_stored(4, acc + (int64_t)rt * 16 * acs, acs * 4);
        _tile_stored(5, acc + (int64_t)rt * 16 * acs + 16, acs * 4);
    }
}

// Softmax of one row's compact scores Sg[0..n) (float32) into P (bf16): p_i = 2^(s_i log2e -
// m log2e) / sum (one FMA and the base-2 polynomial; the sum over 16 lanes in order of i, then a
// fixed tree), P zero from n to a multiple of 32. A function of the row's scores alone.
AMX_TARGET void amx_softmax_row(float* Sg, int n, uint16_t* P) {
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int j = 0; j < n; j += 16) {
        const int left = n - j;
        const __mmask16 lanes = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
        mx = _mm512_mask_max_ps(mx, lanes, mx, _mm512_maskz_loadu_ps(lanes, Sg + j));
    }
    const __m512 ml = _mm512_set1_ps(_mm512_reduce_max_ps(mx) * LOG2E);
    const __m512 l2e = _mm512_set1_ps(LOG2E);
    __m512 acc = _mm512_setzero_ps();
    for (int j = 0; j < n; j += 16) {
        const int left = n - j;
        const __mmask16 lanes = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
        const __m512 p = _mm512_maskz_mov_ps(lanes, exp2_poly(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(lanes, Sg + j), l2e, ml)));
        _mm512_storeu_ps(Sg + j, p);
        acc = _mm512_add_ps(acc, p);
    }
    alignas(64) float lane[16];
    _mm512_store_ps(lane, acc);
    for (int w = 8; w >= 1; w /= 2)
        for (int i = 0; i < w; ++i) lane[i] = lane[i] + lane[i + w];
    const __m512 inv = _mm512_set1_ps(1.0f / lane[0]);
    const int n32 = (n + 31) / 32 * 32;
    for (int j = 0; j < n32; j += 16) {
        const int left = n - j;
        const __mmask16 lanes = left >= 16 ? (__mmask16)0xffff : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
        const __m512 p = _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, Sg + j), inv);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(P + j), (__m256i)_mm512_cvtneps_pbh(p));
    }
}

// One row's own blocks: acc[64] += sum over nblk 32-key blocks of prow[32 b ..] (bf16) times
// vb[b] ([16 pairs][D][2] bf16, gathered), in order.
AMX_TARGET void amx_decode_pv_row(const uint16_t* prow, const uint16_t* vb, int nblk, float* acc) {
    alignas(64) float tmp[16][16];
    for (int c = 0; c < 4; ++c) {
        _tile_loadd(4, acc + 16 * c, 0);  // every tile row the accumulator (row 0 is kept)
        for (int b = 0; b < nblk; ++b) {
            _tile_loadd(0, prow + 32 * b, 0);
            _tile_loadd(1, vb + ((int64_t)b * 16 * D + 16 * c) * 2, D * 4);
            _tile_dpbf16ps(4, 0, 1);
        }
        _tile_stored(4, &tmp[0][0], 64);
        std::memcpy(acc + 16 * c, tmp[0], sizeof tmp[0]);
    }
}
#else
void amx_softmax_row(float*, int, uint16_t*) { throw std::runtime_error("AMX needs an x86-64 build"); }
void amx_decode_tiles(bool) { throw std::runtime_error("AMX needs an x86-64 build"); }
void amx_decode_scores(const uint16_t*, int, const uint16_t*, int64_t, int, int, const uint8_t*, float*, int64_t) {
    throw std::runtime_error("AMX needs an x86-64 build");
}
void amx_decode_pv(const uint16_t*, int64_t, const uint16_t*, int, int, int, float*, int64_t) {
    throw std::runtime_error("AMX needs an x86-64 build");
}
void amx_decode_pv_row(const uint16_t*, const uint16_t*, int, float*) {
    throw std::runtime_error("AMX needs an x86-64 build");
}
#endif
