// agentspec.kernels._cpu: decode / tree-verification attention over a float32 KV cache on CPU.
//
// Exact by construction. For one (query row, query head) the kernel visits the row's visible keys
// (mask true) in ascending slot order; after a committed prefix a draft-tree node's visible tree
// slots are its ancestors in depth order, so it sees the same key/value vectors in the same order
// as the same token does in plain decoding, where they sit at consecutive slots. Every reduction
// below has a fixed shape over that *compact* sequence of visible keys (or over head_dim), never
// over slot numbers, so a token's output is bit for bit the same in both cases:
//   score_n  = sum_{d=0..D-1} (q_d * scale) * k_{n,d}       sequential in d (one SIMD lane per key)
//   m        = max_n score_n                                  (exact in any order)
//   p_n      = exp(score_n - m)                               (polynomial below, plain + and *)
//   sum      = 16 lane partial sums over n (lane n % 16, sequential), then a fixed pairwise tree
//   o_d      = sum_n (p_n / sum) * v_{n,d}                   sequential in n (one lane per d)
// No fused multiply-add (-ffp-contract=off) and no fast-math, so every target_clones variant (and
// every compiler vectorisation of these loops) performs the same IEEE operations: the same bits.
// (Explicit FMAs were tried: no faster on Zen 4, whose separate add pipes already overlap the
// multiplies, and GCC spilled the accumulators of a per-lane fmaf loop.)
//
// `attention` serves one request's rows, `attention_segments` several requests' (continuous
// batching); both run group_task per (group of a segment's rows, kv head), over keys transposed
// (copies: no arithmetic) per call into scratch or, for one or two groups, a block at a time as
// the group reads them.
#include <nanobind/nanobind.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "attention.h"
#include "kernels.h"

namespace nb = nanobind;
using namespace attn;

namespace {

// Groups of rows (of one segment and kv head) up to which each group transposes its keys a
// block at a time (decode: the cache read once); more groups share one transposed copy per call.
constexpr int LOCAL_T = 2;
// Rows per group at most (they share each block of keys and values), and the values' chunk
// (keys at a time per row: 64 x head_dim values, L1-sized).
constexpr int MAXR = 8;
constexpr int VC = 64;

// Rows per group for a call of `units` (row, kv head) tasks on `threads` threads: as many as
// keep two groups per thread for the dynamic schedule, 1 to MAXR. Any grouping gives the same bits.
// `group` > 0 asks for that many (at most MAXR): the tests' and benchmarks' handle.
static inline int group_rows(int units, int threads, int group) {
    if (group > 0) return std::min(MAXR, group);
    return std::max(1, std::min(MAXR, units / std::max(1, 2 * threads)));
}

// Rows per group for one segment's call (``decode_attention``: one request's decode or verify
// rows): the fewest groups that keep every thread busy (kv heads x groups a multiple of the threads
// where the rows allow it). Each group reads the layer's keys and values once, and at a decode step
// they are cold (the weights streamed through the caches since the last layer's), so a few rows
// cost least in one pass: the 1.5B's 2 kv heads on 2 threads at 5.6k keys, 3 rows 1.35 -> 1.13 ms
// a layer, 5 rows 1.88 -> 1.59. Any grouping gives the same bits.
static inline int segment_group_rows(int T, int Hkv, int threads, int group) {
    if (group > 0) return std::min(MAXR, group);
    const int ng = std::max(1, std::min(T, threads / std::gcd(Hkv, threads)));   // Hkv, threads >= 1
    return std::min(MAXR, (T + ng - 1) / ng);
}

// 16 consecutive cache values as floats: float32, or bfloat16 (exact: the value shifted into a
// float's high half), so a bfloat16 cache computes what a float32 cache holding the same values does.
typedef uint16_t v16h __attribute__((vector_size(32)));
static inline v16 load_kv(const float* p) { return load16(p); }
static inline v16 load_kv(const uint16_t* p) {
    v16h h;
    std::memcpy(&h, p, sizeof h);
    return (v16)(__builtin_convertvector(h, v16u) << 16);
}

// One butterfly stage of a 16 x 16 transpose: rows x (= row i) and y (= row i + S) swap their
// off-diagonal S-blocks: x[j] <- (j & S) ? y[j - S] : x[j], y[j] <- (j & S) ? y[j] : x[j + S].
#define AS_LO1 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30
#define AS_HI1 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31
#define AS_LO2 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29
#define AS_HI2 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31
#define AS_LO4 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27
#define AS_HI4 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31
#define AS_LO8 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define AS_HI8 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define AS_STAGE(S)                                                                   \
    for (int i = 0; i < 16; ++i)                                                      \
        if (!(i & S)) {                                                               \
            v16 x = r[i], y = r[i + S];                                               \
            r[i] = __builtin_shufflevector(x, y, AS_LO##S);                           \
            r[i + S] = __builtin_shufflevector(x, y, AS_HI##S);                       \
        }

// Keys [j, j + n) (n <= 16, the rest zeros) of a [slots, HD] cache, values d0..d0+15 of each,
// transposed: dst[d * dst_st + l] = k[j + l][d0 + d]. Copies only: the bits of the keys.
template <typename KV>
static inline __attribute__((always_inline)) void transpose16(const KV* k, int64_t k_st, int n, float* dst,
                                                              int64_t dst_st) {
    v16 r[16];
    for (int l = 0; l < 16; ++l) r[l] = l < n ? load_kv(k + (int64_t)l * k_st) : v16{};
    AS_STAGE(1) AS_STAGE(2) AS_STAGE(4) AS_STAGE(8)
    // after the four stages r[d][l] = k[l][d]
    for (int d = 0; d < 16; ++d) store16(dst + (int64_t)d * dst_st, r[d]);
}

// Keys of kv head hk, slots [jb, jb + 16 * nb) (multiple of 16; slots >= L read as zeros),
// transposed into dst[d * dst_st + (j - jb)]; HD: head_dim.
// The block is first read in address order, one load a cache line: the transposes read it 16
// keys by 16 dims at a time, down a column of cache lines a key's HD values apart, which the
// hardware prefetchers do not follow, and at a decode step the keys come cold from memory (the
// weights streamed through the caches since this layer last ran). Read in order they stream: the
// 1.5B's 2 kv heads at 5.6k keys, 1 / 2 / 4 rows 0.77 / 0.97 / 1.43 -> 0.67 / 0.87 / 1.31 ms a
// layer on Zen 4 (software prefetches of this or later blocks gained nothing). Loads only: the
// keys' bits go through the transposes as before.
template <int HD, typename KV>
static inline __attribute__((always_inline)) void transpose_block(const Args& a, int hk, int jb, int nb, float* dst,
                                                                  int64_t dst_st) {
    const KV* k = reinterpret_cast<const KV*>(a.k) + (int64_t)hk * a.cap * HD;
    {
        const volatile char* p = reinterpret_cast<const volatile char*>(k + (int64_t)jb * HD);
        const int64_t bytes = (int64_t)std::max(0, std::min(16 * nb, a.L - jb)) * HD * (int64_t)sizeof(KV);
        for (int64_t o = 0; o < bytes; o += 64) (void)p[o];
    }
    for (int b = 0; b < nb; ++b) {
        const int j = jb + 16 * b, n = std::max(0, std::min(16, a.L - j));
        for (int d0 = 0; d0 < HD; d0 += 16)
            transpose16(k + (int64_t)j * HD + d0, HD, n, dst + (int64_t)d0 * dst_st + 16 * b, dst_st);
    }
}

// the dispatched (target_clones) transposes: head_dim 64 / 128, a float32 (f) or bfloat16 (h)
// cache; called (not inlined) from group_body and transpose_keys, so the shuffles are compiled
// once per ISA variant
AGENTSPEC_CLONES
void transpose_block_64f(const Args& a, int hk, int jb, int nb, float* dst, int64_t dst_st) {
    transpose_block<64, float>(a, hk, jb, nb, dst, dst_st);
}
AGENTSPEC_CLONES
void transpose_block_128f(const Args& a, int hk, int jb, int nb, float* dst, int64_t dst_st) {
    transpose_block<128, float>(a, hk, jb, nb, dst, dst_st);
}
AGENTSPEC_CLONES
void transpose_block_64h(const Args& a, int hk, int jb, int nb, float* dst, int64_t dst_st) {
    transpose_block<64, uint16_t>(a, hk, jb, nb, dst, dst_st);
}
AGENTSPEC_CLONES
void transpose_block_128h(const Args& a, int hk, int jb, int nb, float* dst, int64_t dst_st) {
    transpose_block<128, uint16_t>(a, hk, jb, nb, dst, dst_st);
}

template <int HD, typename KV>
void transpose_into(const Args& a, int hk, int jb, int nb, float* dst, int64_t dst_st) {
    constexpr bool f = std::is_same_v<KV, float>;
    if constexpr (HD == 64) (f ? transpose_block_64f : transpose_block_64h)(a, hk, jb, nb, dst, dst_st);
    else (f ? transpose_block_128f : transpose_block_128h)(a, hk, jb, nb, dst, dst_st);
}

// scores of GN heads (queries qs[g * HD + d], scaled) against the nc 16-key chunks of a
// transposed key block (kb[d * kst + j]), into S[g * Lr + jb + j]
template <int GN, int HD>
static inline __attribute__((always_inline)) void score_heads(const float* qs, const float* kb, int64_t kst, int nc,
                                                            float* S, int64_t Lr, int jb) {
    if (nc == 4) {
        v16 acc[GN][4];
        for (int g = 0; g < GN; ++g)
            for (int c = 0; c < 4; ++c) acc[g][c] = v16{};
        for (int d = 0; d < HD; ++d) {
            const float* kr = kb + (int64_t)d * kst;
            v16 k0 = load16(kr), k1 = load16(kr + 16), k2 = load16(kr + 32), k3 = load16(kr + 48);
            for (int g = 0; g < GN; ++g) {
                const float qd = qs[g * HD + d];
                acc[g][0] = acc[g][0] + qd * k0;
                acc[g][1] = acc[g][1] + qd * k1;
                acc[g][2] = acc[g][2] + qd * k2;
                acc[g][3] = acc[g][3] + qd * k3;
            }
        }
        for (int g = 0; g < GN; ++g)
            for (int c = 0; c < 4; ++c) store16(S + (int64_t)g * Lr + jb + 16 * c, acc[g][c]);
    } else {
        for (int c = 0; c < nc; ++c) {
            v16 acc[GN];
            for (int g = 0; g < GN; ++g) acc[g] = v16{};
            for (int d = 0; d < HD; ++d) {
                v16 k0 = load16(kb + (int64_t)d * kst + 16 * c);
                for (int g = 0; g < GN; ++g) acc[g] = acc[g] + qs[g * HD + d] * k0;
            }
            for (int g = 0; g < GN; ++g) store16(S + (int64_t)g * Lr + jb + 16 * c, acc[g]);
        }
    }
}

// o[g, 0 .. HD) += sum over the visible keys i in [c0, c1) of p[g, i] * v[idx[i], 0 .. HD),
// sequentially in i, for GN heads (o: the row's output, the running sums between chunks). Each
// key's whole value row at once (HD / 16 vectors), so the values stream in address order: split
// into 64-dim halves, two passes each read every other half cache-line run of a cold chunk, which
// cost the 1.5B at 5.6k keys 0.71 against 0.61 ms a layer for one row on Zen 4.
template <int GN, int HD, typename KV>
static inline __attribute__((always_inline)) void pv_heads(float* o, const float* S, int64_t Lr, const KV* v,
                                                         const int32_t* idx, int c0, int c1) {
    constexpr int NV = HD / 16;
    v16 acc[GN][NV];
    for (int g = 0; g < GN; ++g)
        for (int c = 0; c < NV; ++c) acc[g][c] = load16(o + g * HD + 16 * c);
    for (int i = c0; i < c1; ++i) {
        const KV* vr = v + (int64_t)idx[i] * HD;
        v16 vv[NV];
        for (int c = 0; c < NV; ++c) vv[c] = load_kv(vr + 16 * c);
        for (int g = 0; g < GN; ++g) {
            const float w = S[(int64_t)g * Lr + i];
            for (int c = 0; c < NV; ++c) acc[g][c] = acc[g][c] + w * vv[c];
        }
    }
    for (int g = 0; g < GN; ++g)
        for (int c = 0; c < NV; ++c) store16(o + g * HD + 16 * c, acc[g][c]);
}

// pv_heads for the n (1 .. N) heads of one pass, at the shape compiled for n
template <int N, int HD, typename KV>
static inline __attribute__((always_inline)) void pv_pass(int n, float* o, const float* S, int64_t Lr, const KV* v,
                                                        const int32_t* idx, int c0, int c1) {
    if (n >= N) pv_heads<N, HD, KV>(o, S, Lr, v, idx, c0, c1);
    else if constexpr (N > 1) pv_pass<N - 1, HD, KV>(n, o, S, Lr, v, idx, c0, c1);
}

// One (kv head hk, rows t0 .. t0 + nr): for each row t, the G query heads h = hk*G + g of row t;
// HD: head_dim (64 or 128); KV: the cache's element type (float, or uint16_t for bfloat16).
// The rows of a group share the reads of the cache: each 64-key block of keys (transposed) and
// each 64-key chunk of values is loaded once and used by every row of the group while it sits
// in L1 (a row alone would stream the whole cache from memory: at 4k context, its 4 MB per kv
// head and layer, about as long as the row's share of the weights). Each row's arithmetic is
// the one-row kernel's, in the same order (its partial sums of p @ v go through its output
// between chunks: stores and loads, exact), so a row's bits depend neither on the group nor on
// the other rows.
template <int HD, typename KV>
static inline __attribute__((always_inline)) void group_body(const Args& a, int hk, int t0, int nr, Scratch& sc) {
    const int Lr = a.Lr, G = a.H / a.Hkv;
    sc.s.resize((size_t)nr * G * Lr);
    sc.idx.resize((size_t)nr * Lr);
    sc.q.resize((size_t)nr * G * HD);
    int nv[MAXR], lastr[MAXR];
    const uint8_t* mrs[MAXR];
    int last = -1, nmax = 0;
    for (int r = 0; r < nr; ++r) {
        const int t = t0 + r;
        const uint8_t* mr = a.mask == nullptr ? nullptr : a.mask + (int64_t)t * a.m_st;
        int32_t* idx = sc.idx.data() + (size_t)r * Lr;
        mrs[r] = mr;
        nv[r] = visible_slots(a, mr, idx);
        float* outp = a.out + ((int64_t)t * a.H + (int64_t)hk * G) * HD;
        std::memset(outp, 0, sizeof(float) * G * HD);  // a row that sees nothing: zeros (never produced by the engine)
        lastr[r] = nv[r] ? idx[nv[r] - 1] : -1;
        last = std::max(last, lastr[r]);
        nmax = std::max(nmax, nv[r]);
        float* qs = sc.q.data() + (size_t)r * G * HD;
        for (int g = 0; g < G; ++g) {
            const float* qr = a.q + (int64_t)(hk * G + g) * a.q_sh + (int64_t)t * a.q_st;
            for (int d = 0; d < HD; ++d) qs[g * HD + d] = qr[d] * a.scale;
        }
    }
    if (nmax == 0) return;

    // scores of the 64-slot blocks holding a visible key: one lane per slot, summed over d in order.
    // The keys come transposed: from the call's shared copy (a.kt, several groups per kv head), or
    // (a.kt null) transposed here a block at a time into an L1-sized buffer, so the cache is read
    // once and no copy of it goes through memory. The same values either way.
    const bool shared = a.kt != nullptr;
    const float* kt = shared ? a.kt + (int64_t)hk * HD * a.Lr : nullptr;
    const int64_t kst = shared ? a.Lr : KB;
    alignas(64) float kblk[HD * KB];   // unused with the shared copy
    for (int jb = 0; jb <= last; jb += KB) {
        const int je = std::min(jb + KB, a.L);
        bool need[MAXR], any = false;
        for (int r = 0; r < nr; ++r) {
            bool nd = jb <= lastr[r];
            if (nd && mrs[r] != nullptr) {  // skip blocks with no visible key (pad rows, masked prefixes)
                bool v = false;
                for (int j = jb; j < je; ++j) v |= mrs[r][j] != 0;
                nd = v;
            }
            need[r] = nd;
            any |= nd;
        }
        if (!any) continue;
        const int nc = std::min(KB, Lr - jb) / 16;  // Lr is a multiple of 16
        const float* kb = shared ? kt + jb : kblk;
        if (!shared) transpose_into<HD, KV>(a, hk, jb, nc, kblk, KB);
        for (int r = 0; r < nr; ++r) {
            if (!need[r]) continue;
            const float* qs = sc.q.data() + (size_t)r * G * HD;
            float* S = sc.s.data() + (size_t)r * G * Lr;
            for (int g0 = 0; g0 < G; g0 += GC) {
                const float* q0 = qs + g0 * HD;
                float* S0 = S + (int64_t)g0 * Lr;
                switch (std::min(GC, G - g0)) {
                    case 1: score_heads<1, HD>(q0, kb, kst, nc, S0, Lr, jb); break;
                    case 2: score_heads<2, HD>(q0, kb, kst, nc, S0, Lr, jb); break;
                    case 3: score_heads<3, HD>(q0, kb, kst, nc, S0, Lr, jb); break;
                    default: score_heads<4, HD>(q0, kb, kst, nc, S0, Lr, jb); break;
                }
            }
        }
    }

    for (int r = 0; r < nr; ++r)
        if (nv[r])
            for (int g = 0; g < G; ++g)
                softmax_visible(sc.s.data() + ((size_t)r * G + g) * Lr, nv[r], mrs[r] != nullptr,
                                sc.idx.data() + (size_t)r * Lr);

    // o = p @ v, sequentially over each row's visible keys, one lane per d; a key's whole value row
    // for PG heads a pass (each lane's sum is its own, so how the heads split changes no bits; PG
    // keeps the accumulators in registers), VC keys at a time for every row of the group (the
    // partial sums kept in the row's output between chunks, which started at zeros above)
    const KV* v = reinterpret_cast<const KV*>(a.v) + (int64_t)hk * a.cap * HD;
    constexpr int PG = HD == 64 ? GC : 2;
    for (int c0 = 0; c0 < nmax; c0 += VC) {
        for (int r = 0; r < nr; ++r) {
            if (nv[r] <= c0) continue;
            const int c1 = std::min(c0 + VC, nv[r]);
            const int32_t* idx = sc.idx.data() + (size_t)r * Lr;
            const float* S = sc.s.data() + (size_t)r * G * Lr;
            float* outp = a.out + ((int64_t)(t0 + r) * a.H + (int64_t)hk * G) * HD;
            for (int g0 = 0; g0 < G; g0 += PG)   // PG heads' accumulators (PG x HD / 16 vectors) a pass
                pv_pass<PG, HD, KV>(std::min(PG, G - g0), outp + g0 * HD, S + (int64_t)g0 * Lr, Lr, v, idx, c0, c1);
        }
    }
}

AGENTSPEC_CLONES
void group_task_64f(const Args& a, int hk, int t0, int nr, Scratch& sc) { group_body<64, float>(a, hk, t0, nr, sc); }
AGENTSPEC_CLONES
void group_task_128f(const Args& a, int hk, int t0, int nr, Scratch& sc) { group_body<128, float>(a, hk, t0, nr, sc); }
AGENTSPEC_CLONES
void group_task_64h(const Args& a, int hk, int t0, int nr, Scratch& sc) { group_body<64, uint16_t>(a, hk, t0, nr, sc); }
AGENTSPEC_CLONES
void group_task_128h(const Args& a, int hk, int t0, int nr, Scratch& sc) { group_body<128, uint16_t>(a, hk, t0, nr, sc); }

// Keys of kv head hk, slots [j0, j1) (multiple of 16), transposed to kt[hk][d][j]
template <int HD, typename KV>
void transpose_keys(const Args& a, int hk, int j0, int j1) {
    float* kt = const_cast<float*>(a.kt) + (int64_t)hk * HD * a.Lr;
    transpose_into<HD, KV>(a, hk, j0, (j1 - j0) / 16, kt + j0, a.Lr);
}

template <int HD, typename KV>
void group_task(const Args& a, int hk, int t0, int nr, Scratch& sc) {
    constexpr bool f = std::is_same_v<KV, float>;
    if constexpr (HD == 64) (f ? group_task_64f : group_task_64h)(a, hk, t0, nr, sc);
    else (f ? group_task_128f : group_task_128h)(a, hk, t0, nr, sc);
}

template <typename T> struct Tag { using type = T; };

// run(head_dim as an integral_constant, the cache's element type as a Tag)
template <typename F>
void dispatch(int head_dim, bool kv_bf16, F&& run) {
    using H64 = std::integral_constant<int, 64>;
    using H128 = std::integral_constant<int, 128>;
    if (head_dim == 64) {
        if (kv_bf16) run(H64{}, Tag<uint16_t>{}); else run(H64{}, Tag<float>{});
    } else {
        if (kv_bf16) run(H128{}, Tag<uint16_t>{}); else run(H128{}, Tag<float>{});
    }
}

// The float32 kernel's head shapes: head_dim 64 or 128, 1 to MAXG query heads per kv head.
void check_heads_f32(int H, int Hkv, int head_dim) {
    if (head_dim != 64 && head_dim != 128) throw std::invalid_argument("head_dim must be 64 or 128");
    if (Hkv <= 0 || H % Hkv != 0 || H / Hkv > MAXG) throw std::invalid_argument("bad head counts");
}

}  // namespace

namespace {

template <int HD, typename KV>
void attention_t(uintptr_t q, int64_t q_sh, int64_t q_st, uintptr_t k, uintptr_t v, int64_t cap,
                 uintptr_t mask, int64_t m_st, uintptr_t out, int H, int Hkv, int T, int L, int threads, int group) {
    if (T <= 0 || L <= 0 || L > cap) throw std::invalid_argument("bad T / L / capacity");
    Args a;
    a.q = reinterpret_cast<const float*>(q); a.q_sh = q_sh; a.q_st = q_st;
    a.k = reinterpret_cast<const float*>(k); a.v = reinterpret_cast<const float*>(v);
    a.cap = cap;
    a.mask = reinterpret_cast<const uint8_t*>(mask); a.m_st = m_st;
    a.out = reinterpret_cast<float*>(out);
    a.H = H; a.Hkv = Hkv; a.T = T; a.L = L;
    a.scale = (float)(1.0 / std::sqrt((double)HD));
    a.Lr = (L + 15) / 16 * 16;
    nb::gil_scoped_release nogil;
    if (threads <= 0) threads = omp_get_max_threads();
    const int rg = segment_group_rows(T, Hkv, threads, group), ng = (T + rg - 1) / rg;
    static thread_local std::vector<float> kt;
    if (ng > LOCAL_T) kt.resize((size_t)Hkv * HD * a.Lr);
    a.kt = ng > LOCAL_T ? kt.data() : nullptr;
    const int nchunk = ng > LOCAL_T ? (a.Lr + 255) / 256 : 0;
    const int ntask = Hkv * ng;
    threads = std::max(1, std::min(threads, std::max(ntask, Hkv * nchunk)));
#pragma omp parallel num_threads(threads)
    {
        static thread_local Scratch sc;
#pragma omp for schedule(static)
        for (int c = 0; c < Hkv * nchunk; ++c) {
            int hk = c / nchunk, ch = c % nchunk;
            transpose_keys<HD, KV>(a, hk, ch * 256, std::min(a.Lr, ch * 256 + 256));
        }
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < ntask; ++i) {
            const int t0 = (i / Hkv) * rg;
            group_task<HD, KV>(a, i % Hkv, t0, std::min(rg, T - t0), sc);
        }
    }
}

}  // namespace

void attention(uintptr_t q, int64_t q_sh, int64_t q_st, uintptr_t k, uintptr_t v, int64_t cap,
               uintptr_t mask, int64_t m_st, uintptr_t out, int H, int Hkv, int T, int L, int head_dim,
               int threads, bool kv_bf16, int group) {
    check_heads_f32(H, Hkv, head_dim);
    auto run = [&](auto hd, auto kv) {
        attention_t<decltype(hd)::value, typename decltype(kv)::type>(q, q_sh, q_st, k, v, cap, mask, m_st, out, H,
                                                                        Hkv, T, L, threads, group);
    };
    dispatch(head_dim, kv_bf16, run);
}

// Several requests' rows in one call (continuous batching): segment s owns rows
// [row_off, row_off + T) of q / k_new / v_new / out and one layer of its own KV cache. The new
// keys and values are first written at cache slots [L - T, L); then every (segment, kv head,
// group of rows) runs group_task; each row computes exactly what `attention` does for it, so
// the bits do not depend on the other segments (nor rows). segs: int64 [S, 8] = k, v, capacity, L, mask, mask_stride,
// row_off, T.
namespace {

template <int HD, typename KV>
void attention_segments_t(uintptr_t q, int64_t q_sh, int64_t q_st, uintptr_t k_new, uintptr_t v_new, int64_t kn_sh,
                          int64_t kn_st, uintptr_t segs_ptr, int S, uintptr_t out, int H, int Hkv, int threads,
                          int group) {
    if (S <= 0) throw std::invalid_argument("no segments");
    const int64_t* sg = reinterpret_cast<const int64_t*>(segs_ptr);
    std::vector<Args> args(S);
    std::vector<size_t> kt_off(S + 1, 0);
    std::vector<int> row_base(S + 1, 0), tr_base(S + 1, 0), task_base(S + 1, 0);
    if (threads <= 0) threads = omp_get_max_threads();
    int units = 0;
    for (int s = 0; s < S; ++s) units += Hkv * (int)sg[(int64_t)s * 8 + 7];
    const int rg = group_rows(units, threads, group);
    const float scale = (float)(1.0 / std::sqrt((double)HD));
    for (int s = 0; s < S; ++s) {
        const int64_t* r = sg + (int64_t)s * 8;
        Args& a = args[s];
        a.k = reinterpret_cast<const float*>(r[0]); a.v = reinterpret_cast<const float*>(r[1]);
        a.cap = r[2]; a.L = (int)r[3];
        a.mask = reinterpret_cast<const uint8_t*>(r[4]); a.m_st = r[5];
        const int64_t off = r[6];
        a.T = (int)r[7];
        if (a.T <= 0 || a.L < a.T || a.L > a.cap) throw std::invalid_argument("bad segment T / L / capacity");
        a.q = reinterpret_cast<const float*>(q) + off * q_st; a.q_sh = q_sh; a.q_st = q_st;
        a.out = reinterpret_cast<float*>(out) + off * (int64_t)H * HD;
        a.H = H; a.Hkv = Hkv; a.scale = scale;
        a.Lr = (a.L + 15) / 16 * 16;
        const int ng = (a.T + rg - 1) / rg;
        const bool copy = ng > LOCAL_T;   // a shared transposed copy of the keys (else per block, in group_body)
        kt_off[s + 1] = kt_off[s] + (copy ? (size_t)Hkv * HD * a.Lr : 0);
        row_base[s + 1] = row_base[s] + Hkv * a.T;
        task_base[s + 1] = task_base[s] + Hkv * ng;
        tr_base[s + 1] = tr_base[s] + (copy ? Hkv * ((a.Lr + 255) / 256) : 0);
    }
    nb::gil_scoped_release nogil;
    static thread_local std::vector<float> kt;
    kt.resize(kt_off[S]);
    for (int s = 0; s < S; ++s) args[s].kt = kt_off[s + 1] > kt_off[s] ? kt.data() + kt_off[s] : nullptr;
    const float* kn = reinterpret_cast<const float*>(k_new);
    const float* vn = reinterpret_cast<const float*>(v_new);
    const int nrows = row_base[S], ntr = tr_base[S], ntask = task_base[S];
    threads = std::max(1, std::min(threads, std::max(nrows, ntr)));
#pragma omp parallel num_threads(threads)
    {
        static thread_local Scratch sc;
#pragma omp for schedule(static)
        for (int i = 0; i < nrows; ++i) {  // write the new keys / values into each cache
            int s = int(std::upper_bound(row_base.begin(), row_base.end(), i) - row_base.begin()) - 1;
            const Args& a = args[s];
            int j = i - row_base[s], hk = j % Hkv, t = j / Hkv;
            int64_t src = (int64_t)hk * kn_sh + (sg[(int64_t)s * 8 + 6] + t) * kn_st;
            int64_t dst = ((int64_t)hk * a.cap + (a.L - a.T + t)) * HD;
            KV* kd = reinterpret_cast<KV*>(const_cast<float*>(a.k)) + dst;
            KV* vd = reinterpret_cast<KV*>(const_cast<float*>(a.v)) + dst;
            if constexpr (std::is_same_v<KV, float>) {
                std::memcpy(kd, kn + src, sizeof(float) * HD);
                std::memcpy(vd, vn + src, sizeof(float) * HD);
            } else {  // rounded as torch rounds a float32 tensor copied into a bfloat16 one
                for (int d = 0; d < HD; d += 16) {
                    store_bf16(kd + d, load16(kn + src + d));
                    store_bf16(vd + d, load16(vn + src + d));
                }
            }
        }
#pragma omp for schedule(static)
        for (int c = 0; c < ntr; ++c) {
            int s = int(std::upper_bound(tr_base.begin(), tr_base.end(), c) - tr_base.begin()) - 1;
            const Args& a = args[s];
            int nchunk = (a.Lr + 255) / 256, j = c - tr_base[s], hk = j / nchunk, ch = j % nchunk;
            transpose_keys<HD, KV>(a, hk, ch * 256, std::min(a.Lr, ch * 256 + 256));
        }
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < ntask; ++i) {
            int s = int(std::upper_bound(task_base.begin(), task_base.end(), i) - task_base.begin()) - 1;
            int j = i - task_base[s], t0 = (j / Hkv) * rg;
            group_task<HD, KV>(args[s], j % Hkv, t0, std::min(rg, args[s].T - t0), sc);
        }
    }
}

}  // namespace

void attention_segments(uintptr_t q, int64_t q_sh, int64_t q_st, uintptr_t k_new, uintptr_t v_new, int64_t kn_sh,
                        int64_t kn_st, uintptr_t segs_ptr, int S, uintptr_t out, int H, int Hkv, int head_dim,
                        int threads, bool kv_bf16, int group) {
    check_heads_f32(H, Hkv, head_dim);
    auto run = [&](auto hd, auto kv) {
        attention_segments_t<decltype(hd)::value, typename decltype(kv)::type>(q, q_sh, q_st, k_new, v_new, kn_sh,
                                                                                 kn_st, segs_ptr, S, out, H, Hkv,
                                                                                 threads, group);
    };
    dispatch(head_dim, kv_bf16, run);
}
