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
// No fused multiply-add (-ffp-contract=off) and no fast-math, so every ISA level's body
// (attention_f32.inc, at 16, 8 or 4 lanes) performs the same IEEE operations: the same bits.
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

// One butterfly stage S of a W x W transpose (attention_f32.inc's transpose16): rows x (= row i)
// and y (= row i + S) swap their off-diagonal S-blocks: x[j] <- (j & S) ? y[j - S] : x[j],
// y[j] <- (j & S) ? y[j] : x[j + S] (shuffle indices >= W pick from y).
#define AS_LO16_1 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30
#define AS_HI16_1 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31
#define AS_LO16_2 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29
#define AS_HI16_2 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31
#define AS_LO16_4 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27
#define AS_HI16_4 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31
#define AS_LO16_8 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define AS_HI16_8 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define AS_LO8_1 0, 8, 2, 10, 4, 12, 6, 14
#define AS_HI8_1 1, 9, 3, 11, 5, 13, 7, 15
#define AS_LO8_2 0, 1, 8, 9, 4, 5, 12, 13
#define AS_HI8_2 2, 3, 10, 11, 6, 7, 14, 15
#define AS_LO8_4 0, 1, 2, 3, 8, 9, 10, 11
#define AS_HI8_4 4, 5, 6, 7, 12, 13, 14, 15
#define AS_LO4_1 0, 4, 2, 6
#define AS_HI4_1 1, 5, 3, 7
#define AS_LO4_2 0, 1, 4, 5
#define AS_HI4_2 2, 3, 6, 7
#define AS_STAGE(W, S)                                                                \
    for (int i = 0; i < W; ++i)                                                       \
        if (!(i & S)) {                                                               \
            V x = r[i], y = r[i + S];                                                 \
            r[i] = __builtin_shufflevector(x, y, AS_LO##W##_##S);                     \
            r[i + S] = __builtin_shufflevector(x, y, AS_HI##W##_##S);                 \
        }

// The kernel's body per ISA level (agentspec_isa(), bf16.h), at the vector width of its registers;
// the same bits at each. Arm keeps 16 lanes (4 NEON registers a vector; not measured at 4).
#if defined(AGENTSPEC_X86)
#define AF_NS f32_base
#define AF_W 4
#include "attention_f32.inc"

#pragma GCC push_options
#pragma GCC target("arch=x86-64-v3")
#define AF_NS f32_avx2
#define AF_W 8
#include "attention_f32.inc"
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("arch=x86-64-v4")
#define AF_NS f32_avx512
#define AF_W 16
#include "attention_f32.inc"
#pragma GCC pop_options

// The bfloat16-product mode (attention_dp.inc): AVX512-BF16 only
#pragma GCC push_options
#pragma GCC target("arch=x86-64-v4,avx512bf16")
#include "attention_dp.inc"
#pragma GCC pop_options
#else
#define AF_NS f32_base
#define AF_W 16
#include "attention_f32.inc"
#endif

// A level's entry points for head_dim HD and cache type KV: the transposed copy of a call's keys
// (transpose_keys) and one group of rows (group_task); chosen per call from agentspec_isa().
struct Kernels {
    void (*transpose_keys)(const Args&, int, int, int);
    void (*group_task)(const Args&, int, int, int, Scratch&);
};

// dot: the bfloat16-product mode (needs level 4, which the entry points check)
template <int HD, typename KV>
Kernels kernels_for(int isa, bool dot) {
#if defined(AGENTSPEC_X86)
    if (dot) return {nullptr, dp_bf16::group_task<HD, KV>};   // (no shared copy: each group packs its blocks)
    if (isa >= 3) return {f32_avx512::transpose_keys<HD, KV>, f32_avx512::group_task<HD, KV>};
    if (isa == 2) return {f32_avx2::transpose_keys<HD, KV>, f32_avx2::group_task<HD, KV>};
#endif
    (void)isa; (void)dot;
    return {f32_base::transpose_keys<HD, KV>, f32_base::group_task<HD, KV>};
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
void check_heads_f32(int H, int Hkv, int head_dim, bool dot) {
    if (head_dim != 64 && head_dim != 128) throw std::invalid_argument("head_dim must be 64 or 128");
    if (Hkv <= 0 || H % Hkv != 0 || H / Hkv > MAXG) throw std::invalid_argument("bad head counts");
    if (dot && !attention_dot_runs())
        throw std::invalid_argument("the bfloat16-product attention needs AVX512-BF16 (ISA level avx512bf16)");
}

}  // namespace

bool attention_dot_runs() {
#if defined(AGENTSPEC_X86)
    return agentspec_isa() == 4;
#else
    return false;
#endif
}

namespace {

template <int HD, typename KV>
void attention_t(uintptr_t q, int64_t q_sh, int64_t q_st, uintptr_t k, uintptr_t v, int64_t cap,
                 uintptr_t mask, int64_t m_st, uintptr_t out, int H, int Hkv, int T, int L, int threads, int group,
                 bool dot) {
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
    const Kernels kf = kernels_for<HD, KV>(agentspec_isa(), dot);
    static thread_local std::vector<float> kt;
    const bool copy = ng > LOCAL_T && !dot;   // (the bfloat16-product mode packs per group)
    if (copy) kt.resize((size_t)Hkv * HD * a.Lr);
    a.kt = copy ? kt.data() : nullptr;
    const int nchunk = copy ? (a.Lr + 255) / 256 : 0;
    const int ntask = Hkv * ng;
    threads = std::max(1, std::min(threads, std::max(ntask, Hkv * nchunk)));
#pragma omp parallel num_threads(threads)
    {
        static thread_local Scratch sc;
#pragma omp for schedule(static)
        for (int c = 0; c < Hkv * nchunk; ++c) {
            int hk = c / nchunk, ch = c % nchunk;
            kf.transpose_keys(a, hk, ch * 256, std::min(a.Lr, ch * 256 + 256));
        }
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < ntask; ++i) {
            const int t0 = (i / Hkv) * rg;
            kf.group_task(a, i % Hkv, t0, std::min(rg, T - t0), sc);
        }
    }
}

}  // namespace

void attention(uintptr_t q, int64_t q_sh, int64_t q_st, uintptr_t k, uintptr_t v, int64_t cap,
               uintptr_t mask, int64_t m_st, uintptr_t out, int H, int Hkv, int T, int L, int head_dim,
               int threads, bool kv_bf16, int group, bool dot) {
    check_heads_f32(H, Hkv, head_dim, dot);
    auto run = [&](auto hd, auto kv) {
        attention_t<decltype(hd)::value, typename decltype(kv)::type>(q, q_sh, q_st, k, v, cap, mask, m_st, out, H,
                                                                        Hkv, T, L, threads, group, dot);
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
                          int group, bool dot) {
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
        const bool copy = ng > LOCAL_T && !dot;   // a shared transposed copy of the keys (else per block, in group_body)
        kt_off[s + 1] = kt_off[s] + (copy ? (size_t)Hkv * HD * a.Lr : 0);
        row_base[s + 1] = row_base[s] + Hkv * a.T;
        task_base[s + 1] = task_base[s] + Hkv * ng;
        tr_base[s + 1] = tr_base[s] + (copy ? Hkv * ((a.Lr + 255) / 256) : 0);
    }
    const Kernels kf = kernels_for<HD, KV>(agentspec_isa(), dot);
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
            kf.transpose_keys(a, hk, ch * 256, std::min(a.Lr, ch * 256 + 256));
        }
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < ntask; ++i) {
            int s = int(std::upper_bound(task_base.begin(), task_base.end(), i) - task_base.begin()) - 1;
            int j = i - task_base[s], t0 = (j / Hkv) * rg;
            kf.group_task(args[s], j % Hkv, t0, std::min(rg, args[s].T - t0), sc);
        }
    }
}

}  // namespace

void attention_segments(uintptr_t q, int64_t q_sh, int64_t q_st, uintptr_t k_new, uintptr_t v_new, int64_t kn_sh,
                        int64_t kn_st, uintptr_t segs_ptr, int S, uintptr_t out, int H, int Hkv, int head_dim,
                        int threads, bool kv_bf16, int group, bool dot) {
    check_heads_f32(H, Hkv, head_dim, dot);
    auto run = [&](auto hd, auto kv) {
        attention_segments_t<decltype(hd)::value, typename decltype(kv)::type>(q, q_sh, q_st, k_new, v_new, kn_sh,
                                                                                 kn_st, segs_ptr, S, out, H, Hkv,
                                                                                 threads, group, dot);
    };
    dispatch(head_dim, kv_bf16, run);
}
