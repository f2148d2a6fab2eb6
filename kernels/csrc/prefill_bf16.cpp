// agentspec.kernels._cpu: prompt attention with AVX512-BF16's VDPBF16PS, for models whose KV cache
// is float32 or bfloat16 and holds bfloat16 values (the GGUF models: their queries, keys and values
// come out of the projections in bfloat16), on CPUs with AVX512-BF16 and no AMX path for the shape.
//
// Causal attention of a prompt chunk's rows, positions [start, start + T), over every key from
// position 0 (the chunk's own keys already in the cache), as a flash kernel: keys in blocks of
// PKB at absolute positions, a running max, sum and output per row.
//   scores    s_j = (q . k_j) * scale: VDPBF16PS over pairs of dims, float32 sums, then one multiply
//   block     m' = max(m, max_j s_j) over the block's visible keys (exact); alpha = exp(m - m')
//   weights   p_j = exp(s_j - m') rounded to bfloat16 (0 for a key past the row's position)
//   running   l = l * alpha + sum_j p_j (the rounded weights: 16 lane sums, a fixed tree);
//             o = o * alpha + sum_j p_j v_j (VDPBF16PS over pairs of keys, float32 sums)
//   output    o / l, rounded to bfloat16
// Exactness contract: a row's bits depend on its query, the keys and values up to its position and
// the blocks' positions, not on the chunk it sits in, the other rows or the thread count (each row
// is its own lanes in every step; a block with no key visible to a row is skipped, which equals
// running it: alpha = exp(0) = 1 and p = 0, zero products). So a prompt prefilled in any pieces gives the same
// bits, which the prefix cache needs. The weights in bfloat16 are this kernel's one rounding beyond
// float32 attention (the bfloat16 models' decode and AMX kernels round them the same way); scores,
// sums and outputs are float32.
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

#if defined(AGENTSPEC_X86)
#pragma GCC push_options
#pragma GCC target("arch=x86-64-v4,avx512bf16")

namespace {

constexpr int PKB = 64;   // keys per block, at multiples of PKB from position 0
constexpr int PQ = 32;    // query positions per task (their G heads' rows share each block's reads)
constexpr int RT = 6;     // rows (position, head) per register tile: 6 x 4 accumulators of 16 floats

struct Call {
    const uint16_t* q; int64_t q_sh, q_st;  // q[h, t, :] bfloat16 at q + h*q_sh + t*q_st
    const uint32_t* kt;                     // [Hkv][D/2][Lp] keys' dim pairs (bfloat16 x 2)
    const uint32_t* vp;                     // [Hkv][Lp/2][D] values' key pairs
    uint16_t* out;                          // [T][H][D] bfloat16
    int64_t start, Lp;
    int H, Hkv;
    float scale;
};

// scores of R rows (their queries' dim pairs qr[r][0 .. D/2)) against keys [j0, j0 + 64) (kt: the
// kv head's pairs, row stride Lp), scaled; keys past a row's position pos[r] -> -inf
template <int R, int D>
static inline __attribute__((always_inline)) void qk_tile(const uint32_t* const* qr, const uint32_t* kt, int64_t Lp,
                                                        int64_t j0, float scale, const int64_t* pos, float* S) {
    __m512 acc[R][4];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
    const uint32_t* kb = kt + j0;
    for (int i = 0; i < D / 2; ++i) {
        const uint32_t* ki = kb + (int64_t)i * Lp;
        const __m512bh k0 = (__m512bh)_mm512_loadu_si512(ki), k1 = (__m512bh)_mm512_loadu_si512(ki + 16),
                       k2 = (__m512bh)_mm512_loadu_si512(ki + 32), k3 = (__m512bh)_mm512_loadu_si512(ki + 48);
        for (int r = 0; r < R; ++r) {
            const __m512bh b = bf16_pair_bcast(qr[r][i]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], k0, b);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], k1, b);
            acc[r][2] = _mm512_dpbf16_ps(acc[r][2], k2, b);
            acc[r][3] = _mm512_dpbf16_ps(acc[r][3], k3, b);
        }
    }
    const __m512 sc = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int r = 0; r < R; ++r) {
        const int64_t last = pos[r] - j0;   // the row sees keys j0 .. j0 + last
        for (int c = 0; c < 4; ++c) {
            __m512 s = _mm512_mul_ps(acc[r][c], sc);
            if (last < 16 * c + 15) {
                const __mmask16 past = _mm512_cmpgt_epi32_mask(
                    lane, _mm512_set1_epi32((int)std::max<int64_t>(-1, std::min<int64_t>(16, last - 16 * c))));
                s = _mm512_mask_mov_ps(s, past, ninf);
            }
            _mm512_storeu_ps(S + r * PKB + 16 * c, s);
        }
    }
}

// o[r][0 .. D) = o[r] * alpha[r] + sum over the block's key pairs jp of P[r][jp] . vp[jp][0 .. D), for
// R rows (P: bfloat16 weight pairs, 32 a row; vp: the block's value pairs, row stride D), 64 dims a pass
template <int R, int D>
static inline __attribute__((always_inline)) void pv_tile(float* o, const float* alpha, const uint32_t* P,
                                                        const uint32_t* vp) {
    for (int d0 = 0; d0 < D; d0 += 64) {
        __m512 acc[R][4];
        for (int r = 0; r < R; ++r) {
            const __m512 a = _mm512_set1_ps(alpha[r]);
            for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(o + r * D + d0 + 16 * c), a);
        }
        for (int jp = 0; jp < PKB / 2; ++jp) {
            const uint32_t* vr = vp + (int64_t)jp * D + d0;
            const __m512bh v0 = (__m512bh)_mm512_loadu_si512(vr), v1 = (__m512bh)_mm512_loadu_si512(vr + 16),
                           v2 = (__m512bh)_mm512_loadu_si512(vr + 32), v3 = (__m512bh)_mm512_loadu_si512(vr + 48);
            for (int r = 0; r < R; ++r) {
                const __m512bh b = bf16_pair_bcast(P[r * (PKB / 2) + jp]);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], v0, b);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], v1, b);
                acc[r][2] = _mm512_dpbf16_ps(acc[r][2], v2, b);
                acc[r][3] = _mm512_dpbf16_ps(acc[r][3], v3, b);
            }
        }
        for (int r = 0; r < R; ++r)
            for (int c = 0; c < 4; ++c) _mm512_storeu_ps(o + r * D + d0 + 16 * c, acc[r][c]);
    }
}

// The running softmax of one row over a block's scores S[0 .. 64): its weights in bfloat16 pairs
// (P[0 .. 32)), the factor its running output and sum take (alpha), m and l updated
static inline void softmax_block(const float* S, float& m, float& l, float& alpha, uint32_t* P) {
    __m512 s[4];
    for (int c = 0; c < 4; ++c) s[c] = _mm512_loadu_ps(S + 16 * c);
    const float mb = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(s[0], s[1]), _mm512_max_ps(s[2], s[3])));
    const float mn = mb > m ? mb : m;
    alpha = attn::expv<v16, v16i>(v16{} + m, mn)[0];
    __m512 part = _mm512_setzero_ps();
    for (int c = 0; c < 4; c += 2) {
        const __m512 p0 = (__m512)attn::expv<v16, v16i>((v16)s[c], mn);
        const __m512 p1 = (__m512)attn::expv<v16, v16i>((v16)s[c + 1], mn);
        const __m512i pb = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);   // keys 32 (c / 2) + 0 .. 31, in order
        _mm512_storeu_si512(P + 8 * c, pb);
        // the rounded weights as floats: even keys (low halves), odd keys (high halves)
        part = _mm512_add_ps(part, (__m512)_mm512_slli_epi32(pb, 16));
        part = _mm512_add_ps(part, (__m512)_mm512_and_si512(pb, _mm512_set1_epi32((int)0xffff0000u)));
    }
    alignas(64) float lane[16];
    _mm512_store_ps(lane, part);
    for (int w = 8; w >= 1; w /= 2)
        for (int i = 0; i < w; ++i) lane[i] = lane[i] + lane[i + w];
    l = l * alpha + lane[0];
    m = mn;
}

struct TaskScratch {
    std::vector<uint32_t> q;      // [rows][D/2] the task's queries' dim pairs
    std::vector<float> o;         // [rows][D] running outputs
    std::vector<float> m, l;
    std::vector<int64_t> pos;
};

// Rows (position t, head g) of kv head hk for positions [t0, t1) of the chunk, position-major, in
// register tiles of RT; every block up to the last row's position, each read once for all tiles.
template <int D>
void prefill_task(const Call& c, int hk, int t0, int t1, TaskScratch& ts) {
    const int G = c.H / c.Hkv, nrows = (t1 - t0) * G;
    ts.q.resize((size_t)nrows * (D / 2));
    ts.o.assign((size_t)nrows * D, 0.0f);
    ts.m.assign(nrows, -INFINITY);
    ts.l.assign(nrows, 0.0f);
    ts.pos.resize(nrows);
    for (int t = t0; t < t1; ++t)
        for (int g = 0; g < G; ++g) {
            const int r = (t - t0) * G + g;
            std::memcpy(ts.q.data() + (size_t)r * (D / 2),
                        c.q + (int64_t)(hk * G + g) * c.q_sh + (int64_t)t * c.q_st, D * sizeof(uint16_t));
            ts.pos[r] = c.start + t;
        }
    const uint32_t* kt = c.kt + (int64_t)hk * (D / 2) * c.Lp;
    const uint32_t* vp = c.vp + (int64_t)hk * (c.Lp / 2) * D;
    const int64_t last = c.start + t1 - 1;
    alignas(64) float S[RT * PKB];
    alignas(64) uint32_t P[RT * PKB / 2];
    float alpha[RT];
    for (int64_t j0 = 0; j0 <= last; j0 += PKB) {
        for (int r0 = 0; r0 < nrows; r0 += RT) {
            const int R = std::min(RT, nrows - r0);
            const int64_t* pos = ts.pos.data() + r0;
            if (pos[R - 1] < j0) continue;   // no row of the tile sees a key of the block
            const uint32_t* qr[RT];
            for (int r = 0; r < R; ++r) qr[r] = ts.q.data() + (size_t)(r0 + r) * (D / 2);
            switch (R) {
                case 1: qk_tile<1, D>(qr, kt, c.Lp, j0, c.scale, pos, S); break;
                case 2: qk_tile<2, D>(qr, kt, c.Lp, j0, c.scale, pos, S); break;
                case 3: qk_tile<3, D>(qr, kt, c.Lp, j0, c.scale, pos, S); break;
                case 4: qk_tile<4, D>(qr, kt, c.Lp, j0, c.scale, pos, S); break;
                case 5: qk_tile<5, D>(qr, kt, c.Lp, j0, c.scale, pos, S); break;
                default: qk_tile<6, D>(qr, kt, c.Lp, j0, c.scale, pos, S); break;
            }
            for (int r = 0; r < R; ++r) {
                if (pos[r] < j0) {   // skipped: alpha = 1, weights 0 (what running the block gives)
                    alpha[r] = 1.0f;
                    std::memset(P + r * (PKB / 2), 0, sizeof(uint32_t) * (PKB / 2));
                    continue;
                }
                softmax_block(S + r * PKB, ts.m[r0 + r], ts.l[r0 + r], alpha[r], P + r * (PKB / 2));
            }
            float* o = ts.o.data() + (size_t)r0 * D;
            const uint32_t* vb = vp + (j0 / 2) * D;
            switch (R) {
                case 1: pv_tile<1, D>(o, alpha, P, vb); break;
                case 2: pv_tile<2, D>(o, alpha, P, vb); break;
                case 3: pv_tile<3, D>(o, alpha, P, vb); break;
                case 4: pv_tile<4, D>(o, alpha, P, vb); break;
                case 5: pv_tile<5, D>(o, alpha, P, vb); break;
                default: pv_tile<6, D>(o, alpha, P, vb); break;
            }
        }
    }
    for (int t = t0; t < t1; ++t)
        for (int g = 0; g < G; ++g) {
            const int r = (t - t0) * G + g;
            const __m512 il = _mm512_set1_ps(1.0f / ts.l[r]);
            uint16_t* dst = c.out + ((int64_t)t * c.H + hk * G + g) * D;
            for (int d = 0; d < D; d += 16)
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(ts.o.data() + (size_t)r * D + d), il)));
        }
}

// Keys and values of kv head hk, slots [j0, j0 + 64), packed: kt[i][j] = (k[j][2i], k[j][2i+1]),
// vp[j / 2][d] = (v[j][d], v[j + 1][d]); slots >= L zeros
template <int D, typename KV>
void pack_block(const KV* k, const KV* v, int64_t L, int64_t j0, uint32_t* kt, uint32_t* vp, int64_t Lp) {
    alignas(64) uint32_t row[D / 2];
    for (int64_t j = j0; j < j0 + PKB; ++j) {
        if (j < L) {
            for (int d = 0; d < D; d += 32) {
                const __m512i lo = bf16_zext16(k + j * D + d), hi = bf16_zext16(k + j * D + d + 16);
                // pairs (d, d+1): even dims in the low halves
                const __m512i idx_e = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
                const __m512i idx_o = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
                const __m512i e = _mm512_permutex2var_epi32(lo, idx_e, hi), o = _mm512_permutex2var_epi32(lo, idx_o, hi);
                _mm512_storeu_si512(row + d / 2, _mm512_or_si512(e, _mm512_slli_epi32(o, 16)));
            }
        } else {
            std::memset(row, 0, sizeof row);
        }
        for (int i = 0; i < D / 2; ++i) kt[(int64_t)i * Lp + j] = row[i];
    }
    for (int64_t j = j0; j < j0 + PKB; j += 2) {
        uint32_t* dst = vp + (j / 2) * D;
        for (int d = 0; d < D; d += 16) {
            const __m512i a = j < L ? bf16_zext16(v + j * D + d) : _mm512_setzero_si512();
            const __m512i b = j + 1 < L ? bf16_zext16(v + (j + 1) * D + d) : _mm512_setzero_si512();
            _mm512_storeu_si512(dst + d, _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
        }
    }
}

template <int D, typename KV>
void prefill_bf16_t(uintptr_t q, int64_t q_sh, int64_t q_st, uintptr_t k, uintptr_t v, int64_t cap, int64_t start,
                    int T, int H, int Hkv, uintptr_t out, int threads) {
    const int64_t L = start + T;
    const int64_t Lp = (L + PKB - 1) / PKB * PKB;
    static thread_local std::vector<uint32_t> ktb, vpb;
    nb::gil_scoped_release nogil;
    ktb.resize((size_t)Hkv * (D / 2) * Lp);
    vpb.resize((size_t)Hkv * (Lp / 2) * D);
    Call c;
    c.q = reinterpret_cast<const uint16_t*>(q); c.q_sh = q_sh; c.q_st = q_st;
    uint32_t* kt_all = ktb.data();   // (the calling thread's buffers: the team's threads have their own)
    uint32_t* vp_all = vpb.data();
    c.kt = kt_all; c.vp = vp_all;
    c.out = reinterpret_cast<uint16_t*>(out);
    c.start = start; c.Lp = Lp; c.H = H; c.Hkv = Hkv;
    c.scale = (float)(1.0 / std::sqrt((double)D));
    const KV* kc = reinterpret_cast<const KV*>(k);
    const KV* vc = reinterpret_cast<const KV*>(v);
    const int nblk = (int)(Lp / PKB), ntq = (T + PQ - 1) / PQ, ntask = Hkv * ntq;
    if (threads <= 0) threads = omp_get_max_threads();
    threads = std::max(1, std::min(threads, std::max(ntask, Hkv * nblk)));
#pragma omp parallel num_threads(threads)
    {
        static thread_local TaskScratch ts;
#pragma omp for schedule(static)
        for (int i = 0; i < Hkv * nblk; ++i) {
            const int hk = i / nblk;
            pack_block<D, KV>(kc + (int64_t)hk * cap * D, vc + (int64_t)hk * cap * D, L, (int64_t)(i % nblk) * PKB,
                              kt_all + (size_t)hk * (D / 2) * Lp, vp_all + (size_t)hk * (Lp / 2) * D, Lp);
        }
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < ntask; ++i) {
            const int qb = ntq - 1 - i / Hkv;   // the longest (latest) positions first
            prefill_task<D>(c, i % Hkv, qb * PQ, std::min(T, (qb + 1) * PQ), ts);
        }
    }
}

}  // namespace

#pragma GCC pop_options
#endif

bool prefill_bf16_runs() {
#if defined(AGENTSPEC_X86)
    return agentspec_isa() == 4;
#else
    return false;
#endif
}

void prefill_bf16(uintptr_t q, int64_t q_sh, int64_t q_st, uintptr_t k, uintptr_t v, int64_t cap, bool kv_bf16,
                  int64_t start, int T, int H, int Hkv, int head_dim, uintptr_t out, int threads) {
    if (!prefill_bf16_runs()) throw std::invalid_argument("prefill_bf16 needs AVX512-BF16 (ISA level avx512bf16)");
    if (head_dim != 64 && head_dim != 128) throw std::invalid_argument("head_dim must be 64 or 128");
    if (Hkv <= 0 || H % Hkv != 0 || H / Hkv > attn::MAXG) throw std::invalid_argument("bad head counts");
    if (T <= 0 || start < 0 || start + T > cap) throw std::invalid_argument("bad start / T / capacity");
#if defined(AGENTSPEC_X86)
    if (head_dim == 64) {
        if (kv_bf16) prefill_bf16_t<64, uint16_t>(q, q_sh, q_st, k, v, cap, start, T, H, Hkv, out, threads);
        else prefill_bf16_t<64, float>(q, q_sh, q_st, k, v, cap, start, T, H, Hkv, out, threads);
    } else {
        if (kv_bf16) prefill_bf16_t<128, uint16_t>(q, q_sh, q_st, k, v, cap, start, T, H, Hkv, out, threads);
        else prefill_bf16_t<128, float>(q, q_sh, q_st, k, v, cap, start, T, H, Hkv, out, threads);
    }
#else
    (void)q; (void)q_sh; (void)q_st; (void)k; (void)v; (void)kv_bf16; (void)out; (void)threads;
#endif
}
