// Prefill attention of a bfloat16 model with Intel AMX (tile matrix multiply, bf16 -> float32),
// over the packed KV cache the decode kernels keep (kt2 [Hkv, D/2, cap, 2] is already AMX's
// VNNI operand layout for q . k, vp [Hkv, cap/2, D, 2] the one for p @ v).
//
// One task is one kv head's G query heads (G <= 4) at one tile of 16 consecutive query positions,
// the tiles aligned to absolute positions (multiples of 16; the engine's prompt chunks start at
// multiples of 256); each load of 16 keys into a tile serves the G heads. The keys are first
// copied into contiguous 16-key blocks (kt2's rows lie a capacity apart, one cache set).
// For a row at position p (it sees keys 0..p):
//   s_j  = (q / 8) . k_j                  tile dot products over d in two fixed halves (float32)
//   m    = max_j s_j                       over the visible keys
//   p_j  = exp(s_j - m)                    float32 (FMA polynomial), 0 for j > p
//   l    = sum_j p_j                       16 lane accumulators in key order, then a fixed tree
//   o    = (sum_j bf16(p_j) v_j) / l       tile products over 32-key steps in key order
// Two passes (all scores, then p @ v) instead of an online softmax: the output accumulators stay
// in tile registers and are never rescaled. Every reduction runs over keys in ascending order in
// fixed steps, and keys a row cannot see add exact zeros, so a row's bits depend only on its own
// query, the keys it sees and its position: the same whichever chunk or thread computes it.
// Deterministic for any thread count. Not bitwise equal to the decode kernel (prefill never was:
// see agentspec/engine/prefix_cache.py for the precision argument).

#include <nanobind/nanobind.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define AGENTSPEC_AMX 1
#endif

namespace nb = nanobind;

namespace {

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
            const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
            __m512 acc = _mm512_setzero_ps();
            for (int64_t j = 0; j < Ls; j += 16) {
                const int64_t left = nv - j;
                const __mmask16 lanes = left >= 16 ? (__mmask16)0xffff
                                        : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
                __m512 p = _mm512_maskz_mov_ps(lanes, exp_neg(_mm512_sub_ps(_mm512_loadu_ps(sr + j), m)));
                acc = _mm512_add_ps(acc, p);
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + j), (__m256i)_mm512_cvtneps_pbh(p));
            }
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

bool prefill_amx_available() {
#if defined(AGENTSPEC_AMX)
    return amx_ready();
#else
    return false;
#endif
}

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
            uint16_t* kd = kt + (int64_t)hk * (D / 2) * cap * 2 + s * 2;
            for (int i = 0; i < D / 2; ++i) {
                kd[(int64_t)i * cap * 2] = kr[2 * i];
                kd[(int64_t)i * cap * 2 + 1] = kr[2 * i + 1];
            }
            uint16_t* vd = vpp + ((int64_t)hk * (cap / 2) + s / 2) * D * 2 + (s & 1);
            for (int d = 0; d < D; ++d) vd[2 * d] = vr[d];
        }
    }
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
    Args a{reinterpret_cast<const uint16_t*>(q), q_sh, q_st, kb, nkb, vpp, cap,
           reinterpret_cast<uint16_t*>(out), H, Hkv, T, start};
    // the calling thread's scratch buffers (one per worker), kept between calls: a fresh megabyte
    // would page-fault in again on every call
    static thread_local std::vector<Scratch> pool;
    run_tasks(a, threads, pool);  // (a reference: the workers use the caller's pool)
#else
    (void)q; (void)q_sh; (void)q_st; (void)k; (void)k_sh; (void)k_st; (void)v; (void)v_sh; (void)v_st;
    (void)kt2; (void)vp; (void)out; (void)threads;
    throw std::runtime_error("AMX prefill attention needs an x86-64 build");
#endif
}

}  // namespace

void register_prefill(nb::module_& m) {
    m.def("prefill_amx_available", &prefill_amx_available,
          "whether this CPU (and OS) runs the AMX prefill attention");
    m.def("prefill_attention", &prefill_attention, nb::arg("q"), nb::arg("q_stride_h"), nb::arg("q_stride_t"),
          nb::arg("k"), nb::arg("k_stride_h"), nb::arg("k_stride_t"), nb::arg("v"), nb::arg("v_stride_h"),
          nb::arg("v_stride_t"), nb::arg("kt2"), nb::arg("vp"), nb::arg("capacity"), nb::arg("start"), nb::arg("T"),
          nb::arg("n_heads"), nb::arg("n_kv_heads"), nb::arg("head_dim"), nb::arg("out"), nb::arg("threads") = 0,
          "Raw-pointer entry point; call agentspec.kernels.cpu_attention.prefill_attention instead.");
}
