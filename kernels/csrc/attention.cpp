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
// batching); both run row_task per (row, kv head), over keys transposed per call into scratch.
#include <nanobind/nanobind.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "attention.h"
#include "kernels.h"

namespace nb = nanobind;
using namespace attn;

namespace {

// Keys of kv head hk, slots [j0, j1) (multiple of 16), transposed to kt[hk][d][j]; HD: head_dim.
template <int HD>
static inline __attribute__((always_inline)) void transpose_keys_t(const Args& a, int hk, int j0, int j1) {
    const float* k = a.k + (int64_t)hk * a.cap * HD;
    float* kt = const_cast<float*>(a.kt) + (int64_t)hk * HD * a.Lr;
    for (int jb = j0; jb < j1; jb += 16) {
        float blk[HD][16];
        for (int l = 0; l < 16; ++l) {
            int j = jb + l;
            if (j < a.L) {
                const float* kr = k + (int64_t)j * HD;
                for (int d = 0; d < HD; ++d) blk[d][l] = kr[d];
            } else {
                for (int d = 0; d < HD; ++d) blk[d][l] = 0.0f;
            }
        }
        for (int d = 0; d < HD; ++d)
            std::memcpy(kt + (int64_t)d * a.Lr + jb, blk[d], sizeof blk[d]);
    }
}

AGENTSPEC_CLONES
void transpose_keys_64(const Args& a, int hk, int j0, int j1) { transpose_keys_t<64>(a, hk, j0, j1); }
AGENTSPEC_CLONES
void transpose_keys_128(const Args& a, int hk, int j0, int j1) { transpose_keys_t<128>(a, hk, j0, j1); }

// One (row t, kv head hk): the G query heads h = hk*G + g of row t; HD: head_dim (64 or 128).
template <int G, int HD>
static inline __attribute__((always_inline)) void row_body(const Args& a, int hk, int t, Scratch& sc) {
    const int Lr = a.Lr;
    sc.s.resize((size_t)G * Lr);
    sc.idx.resize((size_t)Lr);
    float* S = sc.s.data();
    int32_t* idx = sc.idx.data();

    const uint8_t* mr = a.mask == nullptr ? nullptr : a.mask + (int64_t)t * a.m_st;
    const int n = visible_slots(a, mr, idx);
    float* outp = a.out + ((int64_t)t * a.H + (int64_t)hk * G) * HD;
    if (n == 0) {  // a row that sees nothing: zeros (never produced by the engine)
        std::memset(outp, 0, sizeof(float) * G * HD);
        return;
    }

    float qs[G][HD];
    for (int g = 0; g < G; ++g) {
        const float* qr = a.q + (int64_t)(hk * G + g) * a.q_sh + (int64_t)t * a.q_st;
        for (int d = 0; d < HD; ++d) qs[g][d] = qr[d] * a.scale;
    }

    // scores of the 64-slot blocks holding a visible key: one lane per slot, summed over d in order
    const float* kt = a.kt + (int64_t)hk * HD * a.Lr;
    const int last = idx[n - 1];
    for (int jb = 0; jb <= last; jb += KB) {
        if (mr != nullptr) {  // skip blocks with no visible key (pad rows, masked prefixes)
            int je = std::min(jb + KB, a.L);
            bool any = false;
            for (int j = jb; j < je; ++j) any |= mr[j] != 0;
            if (!any) continue;
        }
        const int nc = std::min(KB, Lr - jb) / 16;  // Lr is a multiple of 16
        if (nc == 4) {
            v16 acc[G][4];
            for (int g = 0; g < G; ++g)
                for (int c = 0; c < 4; ++c) acc[g][c] = v16{};
            for (int d = 0; d < HD; ++d) {
                const float* kr = kt + (int64_t)d * a.Lr + jb;
                v16 k0 = load16(kr), k1 = load16(kr + 16), k2 = load16(kr + 32), k3 = load16(kr + 48);
                for (int g = 0; g < G; ++g) {
                    const float qd = qs[g][d];
                    acc[g][0] = acc[g][0] + qd * k0;
                    acc[g][1] = acc[g][1] + qd * k1;
                    acc[g][2] = acc[g][2] + qd * k2;
                    acc[g][3] = acc[g][3] + qd * k3;
                }
            }
            for (int g = 0; g < G; ++g)
                for (int c = 0; c < 4; ++c) store16(S + (int64_t)g * Lr + jb + 16 * c, acc[g][c]);
        } else {
            for (int c = 0; c < nc; ++c) {
                v16 acc[G];
                for (int g = 0; g < G; ++g) acc[g] = v16{};
                for (int d = 0; d < HD; ++d) {
                    v16 k0 = load16(kt + (int64_t)d * a.Lr + jb + 16 * c);
                    for (int g = 0; g < G; ++g) acc[g] = acc[g] + qs[g][d] * k0;
                }
                for (int g = 0; g < G; ++g) store16(S + (int64_t)g * Lr + jb + 16 * c, acc[g]);
            }
        }
    }

    for (int g = 0; g < G; ++g) softmax_visible(S + (int64_t)g * Lr, n, mr != nullptr, idx);

    // o = p @ v, sequentially over the visible keys, one lane per d; 64 dims at a time (each lane's
    // sum is its own, so splitting d changes no bits and keeps the accumulators in registers)
    const float* v = a.v + (int64_t)hk * a.cap * HD;
    for (int d0 = 0; d0 < HD; d0 += 64) {
        v16 acc[G][4];
        for (int g = 0; g < G; ++g)
            for (int c = 0; c < 4; ++c) acc[g][c] = v16{};
        for (int i = 0; i < n; ++i) {
            const float* vr = v + (int64_t)idx[i] * HD + d0;
            v16 v0 = load16(vr), v1 = load16(vr + 16), v2 = load16(vr + 32), v3 = load16(vr + 48);
            for (int g = 0; g < G; ++g) {
                const float w = S[(int64_t)g * Lr + i];
                acc[g][0] = acc[g][0] + w * v0;
                acc[g][1] = acc[g][1] + w * v1;
                acc[g][2] = acc[g][2] + w * v2;
                acc[g][3] = acc[g][3] + w * v3;
            }
        }
        for (int g = 0; g < G; ++g)
            for (int c = 0; c < 4; ++c) store16(outp + g * HD + d0 + 16 * c, acc[g][c]);
    }
}

template <int HD>
static inline __attribute__((always_inline)) void row_task_t(const Args& a, int hk, int t, Scratch& sc) {
    switch (a.H / a.Hkv) {
        case 1: return row_body<1, HD>(a, hk, t, sc);
        case 2: return row_body<2, HD>(a, hk, t, sc);
        case 3: return row_body<3, HD>(a, hk, t, sc);
        case 4: return row_body<4, HD>(a, hk, t, sc);
        case 5: return row_body<5, HD>(a, hk, t, sc);
        case 6: return row_body<6, HD>(a, hk, t, sc);
        case 7: return row_body<7, HD>(a, hk, t, sc);
        default: return row_body<8, HD>(a, hk, t, sc);
    }
}

AGENTSPEC_CLONES
void row_task_64(const Args& a, int hk, int t, Scratch& sc) { row_task_t<64>(a, hk, t, sc); }
AGENTSPEC_CLONES
void row_task_128(const Args& a, int hk, int t, Scratch& sc) { row_task_t<128>(a, hk, t, sc); }

template <int HD>
void transpose_keys(const Args& a, int hk, int j0, int j1) {
    if constexpr (HD == 64) transpose_keys_64(a, hk, j0, j1); else transpose_keys_128(a, hk, j0, j1);
}

template <int HD>
void row_task(const Args& a, int hk, int t, Scratch& sc) {
    if constexpr (HD == 64) row_task_64(a, hk, t, sc); else row_task_128(a, hk, t, sc);
}

// The float32 kernel's head shapes: head_dim 64 or 128, 1 to MAXG query heads per kv head.
void check_heads_f32(int H, int Hkv, int head_dim) {
    if (head_dim != 64 && head_dim != 128) throw std::invalid_argument("head_dim must be 64 or 128");
    if (Hkv <= 0 || H % Hkv != 0 || H / Hkv > MAXG) throw std::invalid_argument("bad head counts");
}

}  // namespace

namespace {

template <int HD>
void attention_t(uintptr_t q, int64_t q_sh, int64_t q_st, uintptr_t k, uintptr_t v, int64_t cap,
                 uintptr_t mask, int64_t m_st, uintptr_t out, int H, int Hkv, int T, int L, int threads) {
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
    static thread_local std::vector<float> kt;
    kt.resize((size_t)Hkv * HD * a.Lr);
    a.kt = kt.data();
    const int nchunk = (a.Lr + 255) / 256;
    const int ntask = Hkv * T;
    if (threads <= 0) threads = omp_get_max_threads();
    threads = std::max(1, std::min(threads, std::max(ntask, Hkv * nchunk)));
#pragma omp parallel num_threads(threads)
    {
        static thread_local Scratch sc;
#pragma omp for schedule(static)
        for (int c = 0; c < Hkv * nchunk; ++c) {
            int hk = c / nchunk, ch = c % nchunk;
            transpose_keys<HD>(a, hk, ch * 256, std::min(a.Lr, ch * 256 + 256));
        }
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < ntask; ++i) row_task<HD>(a, i % Hkv, i / Hkv, sc);
    }
}

}  // namespace

void attention(uintptr_t q, int64_t q_sh, int64_t q_st, uintptr_t k, uintptr_t v, int64_t cap,
               uintptr_t mask, int64_t m_st, uintptr_t out, int H, int Hkv, int T, int L, int head_dim,
               int threads) {
    check_heads_f32(H, Hkv, head_dim);
    if (head_dim == 64) attention_t<64>(q, q_sh, q_st, k, v, cap, mask, m_st, out, H, Hkv, T, L, threads);
    else attention_t<128>(q, q_sh, q_st, k, v, cap, mask, m_st, out, H, Hkv, T, L, threads);
}

// Several requests' rows in one call (continuous batching): segment s owns rows
// [row_off, row_off + T) of q / k_new / v_new / out and one layer of its own KV cache. The new
// keys and values are first written at cache slots [L - T, L); then every (segment, kv head,
// row) runs row_task exactly as `attention` would for that segment alone, so the bits do not
// depend on the other segments. segs: int64 [S, 8] = k, v, capacity, L, mask, mask_stride,
// row_off, T.
namespace {

template <int HD>
void attention_segments_t(uintptr_t q, int64_t q_sh, int64_t q_st, uintptr_t k_new, uintptr_t v_new, int64_t kn_sh,
                          int64_t kn_st, uintptr_t segs_ptr, int S, uintptr_t out, int H, int Hkv, int threads) {
    if (S <= 0) throw std::invalid_argument("no segments");
    const int64_t* sg = reinterpret_cast<const int64_t*>(segs_ptr);
    std::vector<Args> args(S);
    std::vector<size_t> kt_off(S + 1, 0);
    std::vector<int> row_base(S + 1, 0), tr_base(S + 1, 0);
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
        kt_off[s + 1] = kt_off[s] + (size_t)Hkv * HD * a.Lr;
        row_base[s + 1] = row_base[s] + Hkv * a.T;
        tr_base[s + 1] = tr_base[s] + Hkv * ((a.Lr + 255) / 256);
    }
    nb::gil_scoped_release nogil;
    static thread_local std::vector<float> kt;
    kt.resize(kt_off[S]);
    for (int s = 0; s < S; ++s) args[s].kt = kt.data() + kt_off[s];
    const float* kn = reinterpret_cast<const float*>(k_new);
    const float* vn = reinterpret_cast<const float*>(v_new);
    const int nrows = row_base[S], ntr = tr_base[S];
    if (threads <= 0) threads = omp_get_max_threads();
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
            std::memcpy(const_cast<float*>(a.k) + dst, kn + src, sizeof(float) * HD);
            std::memcpy(const_cast<float*>(a.v) + dst, vn + src, sizeof(float) * HD);
        }
#pragma omp for schedule(static)
        for (int c = 0; c < ntr; ++c) {
            int s = int(std::upper_bound(tr_base.begin(), tr_base.end(), c) - tr_base.begin()) - 1;
            const Args& a = args[s];
            int nchunk = (a.Lr + 255) / 256, j = c - tr_base[s], hk = j / nchunk, ch = j % nchunk;
            transpose_keys<HD>(a, hk, ch * 256, std::min(a.Lr, ch * 256 + 256));
        }
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < nrows; ++i) {
            int s = int(std::upper_bound(row_base.begin(), row_base.end(), i) - row_base.begin()) - 1;
            int j = i - row_base[s];
            row_task<HD>(args[s], j % Hkv, j / Hkv, sc);
        }
    }
}

}  // namespace

void attention_segments(uintptr_t q, int64_t q_sh, int64_t q_st, uintptr_t k_new, uintptr_t v_new, int64_t kn_sh,
                        int64_t kn_st, uintptr_t segs_ptr, int S, uintptr_t out, int H, int Hkv, int head_dim,
                        int threads) {
    check_heads_f32(H, Hkv, head_dim);
    if (head_dim == 64)
        attention_segments_t<64>(q, q_sh, q_st, k_new, v_new, kn_sh, kn_st, segs_ptr, S, out, H, Hkv, threads);
    else
        attention_segments_t<128>(q, q_sh, q_st, k_new, v_new, kn_sh, kn_st, segs_ptr, S, out, H, Hkv, threads);
}
