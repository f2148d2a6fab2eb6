// agentspec.kernels._cpu: decode / tree-verification attention over a float32 KV cache on CPU.
//
// Exact by construction. For one (query row, query head) the kernel visits the row's visible keys
// (mask true) in ascending slot order; after a committed prefix a draft-tree node's visible tree
// slots are its ancestors in depth order, so it sees the same key/value vectors in the same order
// as the same token does in plain decoding, where they sit at consecutive slots. Every reduction
// below has a fixed shape over that *compact* sequence of visible keys (or over head_dim), never
// over slot numbers, so a token's output is bit for bit the same in both cases:
//   score_n  = sum_{d=0..63} (q_d * scale) * k_{n,d}        sequential in d (one SIMD lane per key)
//   m        = max_n score_n                                  (exact in any order)
//   p_n      = exp(score_n - m)                               (polynomial below, plain + and *)
//   sum      = 16 lane partial sums over n (lane n % 16, sequential), then a fixed pairwise tree
//   o_d      = sum_n (p_n / sum) * v_{n,d}                   sequential in n (one lane per d)
// No fused multiply-add (-ffp-contract=off) and no fast-math, so every target_clones variant (and
// every compiler vectorisation of these loops) performs the same IEEE operations: the same bits.
// (Explicit FMAs were tried: no faster on Zen 4, whose separate add pipes already overlap the
// multiplies, and GCC spilled the accumulators of a per-lane fmaf loop.)
//
// qkv_attention is the whole attention of a decoder layer for decode / verify rows, from the
// fused q|k|v projection to the output-projection input: rotary embedding (rounded step by step
// as torch computes it in the model's dtype), writing the new keys / values into the float32
// cache, attention over the cache, and rounding the result to the model's dtype. The cache keeps
// its keys transposed as well ([Hkv, D, capacity]), so the score loop reads them directly.
#include <nanobind/nanobind.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "bf16.h"

namespace nb = nanobind;

namespace {

constexpr int D = 64;        // head_dim (SmolLM2-135M)
constexpr int KB = 64;       // keys per score block (4 x 16 floats)
constexpr int MAXG = 8;      // query heads per kv head supported

static inline v16 load16(const float* p) { v16 x; std::memcpy(&x, p, sizeof x); return x; }
static inline void store16(float* p, v16 x) { std::memcpy(p, &x, sizeof x); }
static inline v16 splat(float x) { return v16{} + x; }

// exp(x - m) for x <= m (Cephes expf: range reduction by ln 2, degree-5 polynomial, 2^n from the
// exponent bits), plain float arithmetic. Arguments below CUT give exactly 0: those terms are
// < e^-60 of the largest one (no effect on a float32 result), and keeping them would make
// denormal products in p @ v, which are very slow on x86.
constexpr float CUT = -60.0f;
static inline v16 exp16(v16 x, float m) {
    v16 t = x - m;
    v16i low = t < CUT;
    t = low ? splat(CUT) : t;
    v16 fx = t * 1.44269504088896341f + 0.5f;
    v16 fi = __builtin_convertvector(__builtin_convertvector(fx, v16i), v16);  // toward zero
    fi = fi > fx ? fi - 1.0f : fi;                                             // floor
    v16 r = t - fi * 0.693359375f;
    r = r - fi * -2.12194440e-4f;
    v16 z = splat(1.9875691500e-4f);
    z = z * r + 1.3981999507e-3f;
    z = z * r + 8.3334519073e-3f;
    z = z * r + 4.1665795894e-2f;
    z = z * r + 1.6666665459e-1f;
    z = z * r + 5.0000001201e-1f;
    z = z * (r * r) + r;
    z = z + 1.0f;
    v16i bits = (__builtin_convertvector(fi, v16i) + 127) << 23;
    v16 pow2 = (v16)bits;
    v16 p = z * pow2;
    return low ? v16{} : p;
}

struct Args {
    const float* q; int64_t q_sh, q_st;    // q[h, t, :] at q + h*q_sh + t*q_st (unit stride in d)
    const float* k; const float* v;        // [Hkv, cap, D] contiguous
    int64_t cap;
    const uint8_t* mask; int64_t m_st;     // mask[t, j] at mask + t*m_st + j; nullptr: all visible
    float* out;                            // [T, H, D] contiguous
    int H, Hkv, T, L;
    float scale;
    const float* kt;                       // scratch: keys transposed, kt[hk][d][j] at kt + (hk*D + d)*Lr + j
    const uint16_t* kt2;                   // bfloat16 models: packed keys / values (see qkv_attention)
    const uint16_t* vp;
    int Lr;
};

// Keys of kv head hk, slots [j0, j1) (multiple of 16), transposed to kt[hk][d][j].
AGENTSPEC_CLONES
void transpose_keys(const Args& a, int hk, int j0, int j1) {
    const float* k = a.k + (int64_t)hk * a.cap * D;
    float* kt = const_cast<float*>(a.kt) + (int64_t)hk * D * a.Lr;
    for (int jb = j0; jb < j1; jb += 16) {
        float blk[D][16];
        for (int l = 0; l < 16; ++l) {
            int j = jb + l;
            if (j < a.L) {
                const float* kr = k + (int64_t)j * D;
                for (int d = 0; d < D; ++d) blk[d][l] = kr[d];
            } else {
                for (int d = 0; d < D; ++d) blk[d][l] = 0.0f;
            }
        }
        for (int d = 0; d < D; ++d)
            std::memcpy(kt + (int64_t)d * a.Lr + jb, blk[d], sizeof blk[d]);
    }
}

struct Scratch {
    std::vector<float> s;      // [G, Lr] scores, then compact probabilities
    std::vector<int32_t> idx;  // compact visible slots
    std::vector<uint16_t> pb;  // [G, Lr + 2] probabilities in bfloat16 (bfloat16 models)
};

// AMX decode / verify attention (bfloat16 models; qkv_attention's mode 1, the default where the
// CPU has AMX): the rows of one request share each kv head's keys and values, so rather than one
// task per (row, kv head) that streams them all, the work runs in phases over all of a request's
// rows at once, on AMX tiles (prefill_amx.cpp, "AMX phases"):
//   rows    per row: its visible slots, their count, the leading run at their own slots, and
//           which 64-slot blocks it sees (plus rotary and the cache writes);
//   scores  per (kv head, 256-slot chunk), every row tile of the request;
//   softmax per (kv head, row), over the row's compact scores;
//   p @ v   per (kv head, half of d): the 32-key blocks every row holds at its own slots;
//   tail    per (kv head, row): the row's own blocks (draft-tree ancestors, the last partial
//           block), then the output.
struct Work {
    int32_t* idx;         // [T][Lr] visible slots of each row, ascending
    int32_t* n;           // [T] how many
    int32_t* run;         // [T] leading i with idx[i] == i
    uint8_t* vb;          // [T][nb] whether the row sees a key in 64-slot block b
    float* S;             // [Hkv][Mp][ss] scores, then p (compact); row t G + g
    uint16_t* PB;         // [Hkv][Mp][ps] p / sum in bfloat16, zero from n to a multiple of 32
    float* acc;           // [Hkv][Mp][D] p @ v accumulators
    const uint32_t* qp;   // [T][H][D/2] q / 8 as bfloat16 pairs
    int nb;
    int Mp;               // T G rounded up to a whole AMX tile (16 rows)
    int64_t ss, ps;       // row strides of S and PB: Lr + 16 and Lr + 32 (rows a power of two
                          // apart would share cache sets)
};

// Row t's visible slots (mask row mr; nullptr: all L), ascending, into idx; returns how many.
static inline __attribute__((always_inline)) int visible_slots(const Args& a, const uint8_t* mr, int32_t* idx) {
    int n = 0;
    if (mr == nullptr) {
        for (int j = 0; j < a.L; ++j) idx[j] = j;
        n = a.L;
    } else {
        for (int j = 0; j < a.L; ++j)
            if (mr[j]) idx[n++] = j;
    }
    return n;
}

// Softmax of one head's scores Sg[slot] over the visible slots idx[0..n) (compacted in place
// first when `compact`): Sg[i] = p_i / sum for i < n, 0 up to the next multiple of 16.
static inline __attribute__((always_inline)) void softmax_visible(float* Sg, int n, bool compact, const int32_t* idx) {
    const int n16 = (n + 15) / 16 * 16;
    // compact in place (idx[i] >= i, so reading ahead of writing is safe); a leading run with
    // idx[i] == i (the committed prefix) is already in place
    if (compact) {
        int i = 0;
        while (i < n && idx[i] == i) ++i;
        for (; i < n; ++i) Sg[i] = Sg[idx[i]];
    }
    for (int i = n; i < n16; ++i) Sg[i] = Sg[0];  // pad to 16 (ignored below)
    // max: exact in any order
    v16 mx = load16(Sg);
    for (int i = 16; i < n16; i += 16) {
        v16 x = load16(Sg + i);
        mx = x > mx ? x : mx;
    }
    float m = mx[0];
    for (int l = 1; l < 16; ++l) m = mx[l] > m ? mx[l] : m;
    // p = exp(s - m); sum: lane i % 16 in order of i, then a fixed pairwise tree
    v16 part{};
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        v16 p = exp16(load16(Sg + i), m);
        store16(Sg + i, p);
        part = part + p;
    }
    if (i < n) {
        v16 p = exp16(load16(Sg + i), m);
        for (int l = n - i; l < 16; ++l) p[l] = 0.0f;
        store16(Sg + i, p);
        part = part + p;
    }
    float pt[16];
    store16(pt, part);
    for (int w = 8; w >= 1; w /= 2)
        for (int l = 0; l < w; ++l) pt[l] = pt[l] + pt[l + w];
    const v16 inv_sum = splat(1.0f / pt[0]);
    for (int j = 0; j < n16; j += 16) store16(Sg + j, load16(Sg + j) * inv_sum);  // p / sum
}

// The rows phase of the AMX kernel (see Work) for row t.
static void row_info(const Args& a, const Work& w, int t) {
    const uint8_t* mr = a.mask == nullptr ? nullptr : a.mask + (int64_t)t * a.m_st;
    int32_t* idx = w.idx + (int64_t)t * a.Lr;
    const int n = visible_slots(a, mr, idx);
    int run = 0;
    while (run < n && idx[run] == run) ++run;
    w.n[t] = n;
    w.run[t] = run;
    uint8_t* vb = w.vb + (int64_t)t * w.nb;
    std::memset(vb, 0, (size_t)w.nb);
    if (run > 0) std::memset(vb, 1, (size_t)((run - 1) / KB + 1));
    for (int i = run; i < n; ++i) vb[idx[i] / KB] = 1;
}

// One (row t, kv head hk): the G query heads h = hk*G + g of row t.
template <int G>
static inline __attribute__((always_inline)) void row_body(const Args& a, int hk, int t, Scratch& sc) {
    const int Lr = a.Lr;
    sc.s.resize((size_t)G * Lr);
    sc.idx.resize((size_t)Lr);
    float* S = sc.s.data();
    int32_t* idx = sc.idx.data();

    const uint8_t* mr = a.mask == nullptr ? nullptr : a.mask + (int64_t)t * a.m_st;
    const int n = visible_slots(a, mr, idx);
    float* outp = a.out + ((int64_t)t * a.H + (int64_t)hk * G) * D;
    if (n == 0) {  // a row that sees nothing: zeros (never produced by the engine)
        std::memset(outp, 0, sizeof(float) * G * D);
        return;
    }

    float qs[G][D];
    for (int g = 0; g < G; ++g) {
        const float* qr = a.q + (int64_t)(hk * G + g) * a.q_sh + (int64_t)t * a.q_st;
        for (int d = 0; d < D; ++d) qs[g][d] = qr[d] * a.scale;
    }

    // scores of the 64-slot blocks holding a visible key: one lane per slot, summed over d in order
    const float* kt = a.kt + (int64_t)hk * D * a.Lr;
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
            for (int d = 0; d < D; ++d) {
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
                for (int d = 0; d < D; ++d) {
                    v16 k0 = load16(kt + (int64_t)d * a.Lr + jb + 16 * c);
                    for (int g = 0; g < G; ++g) acc[g] = acc[g] + qs[g][d] * k0;
                }
                for (int g = 0; g < G; ++g) store16(S + (int64_t)g * Lr + jb + 16 * c, acc[g]);
            }
        }
    }

    for (int g = 0; g < G; ++g) softmax_visible(S + (int64_t)g * Lr, n, mr != nullptr, idx);

    // o = p @ v, sequentially over the visible keys, one lane per d
    const float* v = a.v + (int64_t)hk * a.cap * D;
    v16 acc[G][4];
    for (int g = 0; g < G; ++g)
        for (int c = 0; c < 4; ++c) acc[g][c] = v16{};
    for (int i = 0; i < n; ++i) {
        const float* vr = v + (int64_t)idx[i] * D;
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
        for (int c = 0; c < 4; ++c) store16(outp + g * D + 16 * c, acc[g][c]);
}

AGENTSPEC_CLONES
void row_task(const Args& a, int hk, int t, Scratch& sc) {
    switch (a.H / a.Hkv) {
        case 1: return row_body<1>(a, hk, t, sc);
        case 2: return row_body<2>(a, hk, t, sc);
        case 3: return row_body<3>(a, hk, t, sc);
        case 4: return row_body<4>(a, hk, t, sc);
        case 5: return row_body<5>(a, hk, t, sc);
        case 6: return row_body<6>(a, hk, t, sc);
        case 7: return row_body<7>(a, hk, t, sc);
        default: return row_body<8>(a, hk, t, sc);
    }
}

void attention(uintptr_t q, int64_t q_sh, int64_t q_st, uintptr_t k, uintptr_t v, int64_t cap,
               uintptr_t mask, int64_t m_st, uintptr_t out, int H, int Hkv, int T, int L, int head_dim,
               int threads) {
    if (head_dim != D) throw std::invalid_argument("head_dim must be 64");
    if (Hkv <= 0 || H % Hkv != 0 || H / Hkv > MAXG) throw std::invalid_argument("bad head counts");
    if (T <= 0 || L <= 0 || L > cap) throw std::invalid_argument("bad T / L / capacity");
    Args a;
    a.q = reinterpret_cast<const float*>(q); a.q_sh = q_sh; a.q_st = q_st;
    a.k = reinterpret_cast<const float*>(k); a.v = reinterpret_cast<const float*>(v);
    a.cap = cap;
    a.mask = reinterpret_cast<const uint8_t*>(mask); a.m_st = m_st;
    a.out = reinterpret_cast<float*>(out);
    a.H = H; a.Hkv = Hkv; a.T = T; a.L = L;
    a.scale = (float)(1.0 / std::sqrt((double)D));
    a.Lr = (L + 15) / 16 * 16;
    nb::gil_scoped_release nogil;
    static thread_local std::vector<float> kt;
    kt.resize((size_t)Hkv * D * a.Lr);
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
            transpose_keys(a, hk, ch * 256, std::min(a.Lr, ch * 256 + 256));
        }
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < ntask; ++i) row_task(a, i % Hkv, i / Hkv, sc);
    }
}

// Several requests' rows in one call (continuous batching): segment s owns rows
// [row_off, row_off + T) of q / k_new / v_new / out and one layer of its own KV cache. The new
// keys and values are first written at cache slots [L - T, L); then every (segment, kv head,
// row) runs row_task exactly as `attention` would for that segment alone, so the bits do not
// depend on the other segments. segs: int64 [S, 8] = k, v, capacity, L, mask, mask_stride,
// row_off, T.
void attention_segments(uintptr_t q, int64_t q_sh, int64_t q_st, uintptr_t k_new, uintptr_t v_new, int64_t kn_sh,
                        int64_t kn_st, uintptr_t segs_ptr, int S, uintptr_t out, int H, int Hkv, int head_dim,
                        int threads) {
    if (head_dim != D) throw std::invalid_argument("head_dim must be 64");
    if (Hkv <= 0 || H % Hkv != 0 || H / Hkv > MAXG) throw std::invalid_argument("bad head counts");
    if (S <= 0) throw std::invalid_argument("no segments");
    const int64_t* sg = reinterpret_cast<const int64_t*>(segs_ptr);
    std::vector<Args> args(S);
    std::vector<size_t> kt_off(S + 1, 0);
    std::vector<int> row_base(S + 1, 0), tr_base(S + 1, 0);
    const float scale = (float)(1.0 / std::sqrt((double)D));
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
        a.out = reinterpret_cast<float*>(out) + off * (int64_t)H * D;
        a.H = H; a.Hkv = Hkv; a.scale = scale;
        a.Lr = (a.L + 15) / 16 * 16;
        kt_off[s + 1] = kt_off[s] + (size_t)Hkv * D * a.Lr;
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
            int64_t dst = ((int64_t)hk * a.cap + (a.L - a.T + t)) * D;
            std::memcpy(const_cast<float*>(a.k) + dst, kn + src, sizeof(float) * D);
            std::memcpy(const_cast<float*>(a.v) + dst, vn + src, sizeof(float) * D);
        }
#pragma omp for schedule(static)
        for (int c = 0; c < ntr; ++c) {
            int s = int(std::upper_bound(tr_base.begin(), tr_base.end(), c) - tr_base.begin()) - 1;
            const Args& a = args[s];
            int nchunk = (a.Lr + 255) / 256, j = c - tr_base[s], hk = j / nchunk, ch = j % nchunk;
            transpose_keys(a, hk, ch * 256, std::min(a.Lr, ch * 256 + 256));
        }
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < nrows; ++i) {
            int s = int(std::upper_bound(row_base.begin(), row_base.end(), i) - row_base.begin()) - 1;
            int j = i - row_base[s];
            row_task(args[s], j % Hkv, j / Hkv, sc);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// bfloat16 models: qkv_attention
//
// The whole attention of a decoder layer for decode / verify rows, from the fused q|k|v
// projection to the output projection's input, in one call: rotary embedding (rounded step by
// step as torch computes it in bfloat16), the new keys / values written into the float32 cache
// and into two packed bfloat16 copies of it, then attention with bfloat16 dot products:
//   kt2: uint16 [n_layers, Hkv, D/2, cap, 2]: (k[s][2i], k[s][2i+1]) for slot s, pair i
//   vp:  uint16 [n_layers, Hkv, cap/2, D, 2]: (v[2j][d], v[2j+1][d]) for slot pair j
// Keys and values of a bfloat16 model are bfloat16 values, so the copies are exact. One 32-bit
// pair is one lane of VDPBF16PS (AVX512-BF16), which adds a[2i+1]*b[2i+1], then a[2i]*b[2i], to a
// float32 lane: products of bfloat16 values are exact in float32, one rounding per addition.
//   score_n = dot over d pairs in order of (q_d / 8, bf16) and k_{n,d}   (one lane per key)
//   softmax as in row_body (float32), p_n = exp(score_n - m) / sum rounded to bfloat16
//   o_d     = dot over visible-key pairs (compact index 2j, 2j+1) in order of p and v_{.,d}
// As in row_body, every reduction runs over the row's compact sequence of visible keys, so a
// draft-tree node gets the same bits as the same token in plain decoding. Value pairs come from
// vp where the pair's keys sit at slots equal to their compact indices (the committed prefix),
// else they are packed on the fly from the float32 cache: the same bits either way. Rounding p
// to bfloat16 before p @ v is what flash attention does for bfloat16 models.
// Machines without AVX512-BF16 run an emulation (plain float32 adds in the same order; it
// does not flush subnormals as the instruction does).

// One body per ISA level (bf16.h): the same bits in each.
#define AS_NS bf16_scalar
#define AS_DP dp_emul
#define AS_ATTR
#include "attention_bf16.inc"

#if defined(AGENTSPEC_NEON)
#define AS_NS bf16_neon
#define AS_DP dp_neon
#define AS_ATTR
#include "attention_bf16.inc"
#endif

#if defined(AGENTSPEC_X86)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi,bmi2,lzcnt,movbe,popcnt")
#define AS_NS bf16_avx2  // (no AS_DP: AS_AVX2 replaces every loop that uses it)
#define AS_ATTR
#define AS_AVX2 1
#include "attention_bf16.inc"
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi,bmi2,lzcnt,movbe,popcnt,avx512f,avx512bw,avx512vl,avx512dq,avx512cd")
#define AS_NS bf16_avx512
#define AS_DP dp_fma512
#define AS_ATTR
#include "attention_bf16.inc"
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi,bmi2,lzcnt,movbe,popcnt,avx512f,avx512bw,avx512vl,avx512dq,avx512cd,avx512bf16")
#define AS_NS bf16_hw
#define AS_DP dp_hw
#define AS_ATTR
#include "attention_bf16.inc"
#pragma GCC pop_options
#endif

using row_fn = void (*)(const Args&, int, int, Scratch&);

static row_fn bf16_row_for(int isa) {
    switch (isa) {
#if defined(AGENTSPEC_X86)
        case 4: return bf16_hw::row_task;
        case 3: return bf16_avx512::row_task;
        case 2: return bf16_avx2::row_task;
#endif
#if defined(AGENTSPEC_NEON)
        case 1: return bf16_neon::row_task;
#endif
        default: return bf16_scalar::row_task;
    }
}

// Rotary embedding of one head (HF rotate_half layout) as torch computes it in bfloat16:
//   y = x * cos + cat(-x[D/2:], x[:D/2]) * sin, each product and the sum rounded to bfloat16.
static inline float rb(float f) { return bf16_to_float(float_to_bf16(f)); }
static inline void rope_head(const uint16_t* x, const uint16_t* cs, const uint16_t* sn, float* y) {
    constexpr int half = D / 2;
    for (int d = 0; d < D; ++d) {
        const float xd = bf16_to_float(x[d]);
        const float rot = d < half ? -bf16_to_float(x[d + half]) : bf16_to_float(x[d - half]);
        y[d] = rb(rb(xd * bf16_to_float(cs[d])) + rb(rot * bf16_to_float(sn[d])));
    }
}

static inline void put_packed(uint16_t* kt2, uint16_t* vp, int64_t cap, int hk, int64_t slot, const float* k,
                              const float* v) {
    uint16_t* kd = kt2 + ((int64_t)hk * (D / 2) * cap + slot) * 2;
    uint16_t* vd = vp + (((int64_t)hk * (cap / 2) + slot / 2) * D) * 2 + (slot & 1);
    for (int i = 0; i < D / 2; ++i) {
        kd[(int64_t)i * cap * 2] = float_to_bf16(k[2 * i]);
        kd[(int64_t)i * cap * 2 + 1] = float_to_bf16(k[2 * i + 1]);
    }
    for (int d = 0; d < D; ++d) vd[2 * d] = float_to_bf16(v[d]);
}

// Rotary embedding of row r of a segment; its new key / value into the cache and packed copies.
static void rope_row(const Args& a, int64_t slot, const uint16_t* x, const uint16_t* c, const uint16_t* sv, float* q) {
    const int H = a.H, Hkv = a.Hkv;
    for (int h = 0; h < H; ++h) rope_head(x + h * D, c, sv, q + (int64_t)h * D);
    for (int hk = 0; hk < Hkv; ++hk) {
        float kr[D], vr[D];
        rope_head(x + (H + hk) * D, c, sv, kr);
        const uint16_t* vx = x + (H + Hkv + hk) * D;
        for (int d = 0; d < D; ++d) vr[d] = bf16_to_float(vx[d]);
        std::memcpy(const_cast<float*>(a.k) + ((int64_t)hk * a.cap + slot) * D, kr, sizeof kr);
        std::memcpy(const_cast<float*>(a.v) + ((int64_t)hk * a.cap + slot) * D, vr, sizeof vr);
        put_packed(const_cast<uint16_t*>(a.kt2), const_cast<uint16_t*>(a.vp), a.cap, hk, slot, kr, vr);
    }
}

// Whether mode 1 runs: AMX here, and the bf16 kernels at the top ISA level (AVX512-BF16; a cap
// below it keeps every level's bits equal)
static bool decode_amx_runs() { return agentspec_isa() == 4 && prefill_amx_available(); }

// The AMX scores of every row tile of kv head hk over 64-slot blocks [b0, b1).
static void amx_scores_task(const Args& a, const Work& w, int hk, int b0, int b1) {
    const int G = a.H / a.Hkv, M = a.T * G;
    static thread_local std::vector<uint16_t> qb;
    qb.resize((size_t)w.Mp * D);
    for (int m = 0; m < w.Mp; ++m) {
        uint16_t* dst = qb.data() + (int64_t)m * D;
        if (m < M)
            std::memcpy(dst, w.qp + ((int64_t)(m / G) * a.H + (int64_t)hk * G + m % G) * (D / 2), sizeof(uint16_t) * D);
        else
            std::memset(dst, 0, sizeof(uint16_t) * D);
    }
    uint8_t need[16];
    bool any = false;
    for (int b = b0; b < b1; ++b) {
        uint8_t x = 0;
        for (int t = 0; t < a.T; ++t) x |= w.vb[(int64_t)t * w.nb + b];
        need[b - b0] = x;
        any |= x != 0;
    }
    if (!any) return;
    const uint16_t* kt2 = a.kt2 + (int64_t)hk * (D / 2) * a.cap * 2;
    amx_decode_scores(qb.data(), w.Mp / 16, kt2, a.cap, b0 * KB, std::min(a.Lr, b1 * KB), need,
                      w.S + (int64_t)hk * w.Mp * w.ss, w.ss);
}

// AMX softmax of row t's G heads of kv head hk: compacted as softmax_visible compacts them, then
// amx_softmax_row (the AMX path's own rounding: a fused exp, as its tiles' sums are its own).
static void amx_softmax_task(const Args& a, const Work& w, int hk, int t) {
    const int G = a.H / a.Hkv, n = w.n[t];
    if (n == 0) return;
    const int32_t* idx = w.idx + (int64_t)t * a.Lr;
    for (int g = 0; g < G; ++g) {
        const int64_t m = (int64_t)hk * w.Mp + (int64_t)t * G + g;
        float* Sg = w.S + m * w.ss;
        if (a.mask != nullptr)
            for (int i = w.run[t]; i < n; ++i) Sg[i] = Sg[idx[i]];  // idx[i] >= i: in place
        amx_softmax_row(Sg, n, w.PB + m * w.ps);
    }
}

// The shared blocks every row of the segment holds at its own slots (compact keys [0, E))
static int amx_shared(const Args& a, const Work& w) {
    int E = a.Lr;
    for (int t = 0; t < a.T; ++t) E = std::min(E, w.run[t]);
    return E / 32 * 32;
}

// Row t of kv head hk: its own 32-key blocks from E on (values gathered in the vp layout,
// zero past the row's keys) on top of the shared blocks' accumulators, then the output in bf16.
static void amx_row_task(const Args& a, const Work& w, int hk, int t, int E, uint16_t* o, int64_t o_st) {
    const int G = a.H / a.Hkv;
    const int n = w.n[t];
    uint16_t* dst = o + (int64_t)t * o_st + (int64_t)hk * G * D;
    if (n == 0) {  // a row that sees nothing: zeros (never produced by the engine)
        std::memset(dst, 0, sizeof(uint16_t) * G * D);
        return;
    }
    const int nblk = ((n + 31) / 32 * 32 - E) / 32;
    static thread_local std::vector<uint16_t> vb;
    vb.resize((size_t)nblk * 16 * D * 2);
    const int32_t* idx = w.idx + (int64_t)t * a.Lr;
    const float* v = a.v + (int64_t)hk * a.cap * D;
    for (int j = 0; j < nblk * 16; ++j) {
        const int i0 = E + 2 * j, i1 = i0 + 1;
        uint16_t* dp = vb.data() + (int64_t)j * D * 2;
        for (int h = 0; h < 2; ++h) {
            const int i = h ? i1 : i0;
            if (i < n) {
                const float* vr = v + (int64_t)idx[i] * D;
                for (int d = 0; d < D; ++d) dp[2 * d + h] = float_to_bf16(vr[d]);
            } else {
                for (int d = 0; d < D; ++d) dp[2 * d + h] = 0;
            }
        }
    }
    for (int g = 0; g < G; ++g) {
        const int64_t m = (int64_t)hk * w.Mp + (int64_t)t * G + g;
        float* acc = w.acc + m * D;  // the shared blocks' sums (zero for E = 0)
        if (nblk > 0) amx_decode_pv_row(w.PB + m * w.ps + E, vb.data(), nblk, acc);
        for (int d = 0; d < D; d += 16) store_bf16(dst + g * D + d, load16(acc + d));
    }
}

// qkv_attention's AMX kernel (see Work): the phases run over every segment's tasks, with a
// barrier between phases.
static void qkv_attention_amx(uintptr_t qkv, int64_t qkv_st, uintptr_t cos, uintptr_t sin, int64_t cs_st,
                              std::vector<Args>& args, const std::vector<int64_t>& start,
                              const std::vector<int64_t>& off, const std::vector<int>& seg_of_row, int R,
                              uintptr_t out, int64_t out_st, int threads) {
    const int S = (int)args.size();
    const int H = args[0].H, Hkv = args[0].Hkv, G = H / Hkv;
    constexpr int CHUNK = 4;  // 64-slot blocks per scores task
    std::vector<Work> work(S);
    std::vector<size_t> o_idx(S + 1, 0), o_vb(S + 1, 0), o_s(S + 1, 0), o_pb(S + 1, 0), o_acc(S + 1, 0);
    std::vector<int> b_sc(S + 1, 0), b_row(S + 1, 0), b_pv(S + 1, 0);
    for (int s = 0; s < S; ++s) {
        const Args& a = args[s];
        Work& w = work[s];
        w.nb = (a.Lr + KB - 1) / KB;
        w.Mp = (a.T * G + 15) / 16 * 16;
        w.ss = a.Lr + 16;
        w.ps = a.Lr + 32;
        o_idx[s + 1] = o_idx[s] + (size_t)a.T * a.Lr;
        o_vb[s + 1] = o_vb[s] + (size_t)a.T * w.nb;
        o_s[s + 1] = o_s[s] + (size_t)Hkv * w.Mp * w.ss;
        o_pb[s + 1] = o_pb[s] + (size_t)Hkv * w.Mp * w.ps;
        o_acc[s + 1] = o_acc[s] + (size_t)Hkv * w.Mp * D;
        b_sc[s + 1] = b_sc[s] + Hkv * ((w.nb + CHUNK - 1) / CHUNK);
        b_row[s + 1] = b_row[s] + Hkv * a.T;  // softmax, then the tails
        b_pv[s + 1] = b_pv[s] + Hkv * 2;
    }
    nb::gil_scoped_release nogil;
    static thread_local std::vector<int32_t> idx, cnt;
    static thread_local std::vector<uint8_t> vb;
    static thread_local std::vector<float> sc, ac;
    static thread_local std::vector<uint16_t> pb;
    static thread_local std::vector<uint32_t> qp;
    idx.resize(o_idx[S]);
    cnt.resize((size_t)2 * R);
    vb.resize(o_vb[S]);
    sc.resize(o_s[S] + 16 * 16);  // + a tile's overhang past the last row's stride
    pb.resize(o_pb[S] + 16 * 32);
    ac.resize(o_acc[S]);
    qp.resize((size_t)R * H * (D / 2));
    for (int s = 0; s < S; ++s) {
        Work& w = work[s];
        w.idx = idx.data() + o_idx[s];
        w.n = cnt.data() + off[s];
        w.run = cnt.data() + R + off[s];
        w.vb = vb.data() + o_vb[s];
        w.S = sc.data() + o_s[s];
        w.PB = pb.data() + o_pb[s];
        w.acc = ac.data() + o_acc[s];
        w.qp = qp.data() + off[s] * H * (D / 2);
    }
    uint32_t* const qpp = qp.data();
    const uint16_t* in = reinterpret_cast<const uint16_t*>(qkv);
    const uint16_t* cs = reinterpret_cast<const uint16_t*>(cos);
    const uint16_t* sn = reinterpret_cast<const uint16_t*>(sin);
    uint16_t* o = reinterpret_cast<uint16_t*>(out);
    const float scale = args[0].scale;
    const auto seg_of = [](const std::vector<int>& base, int i) {
        return int(std::upper_bound(base.begin(), base.end(), i) - base.begin()) - 1;
    };
    if (threads <= 0) threads = omp_get_max_threads();
    threads = std::max(1, std::min(threads, std::max({R, b_sc[S], b_pv[S]})));
#pragma omp parallel num_threads(threads)
    {
        amx_decode_tiles(true);
#pragma omp for schedule(static)
        for (int r = 0; r < R; ++r) {  // rotary, cache writes, q / 8 in bf16 pairs, the row's visible slots
            const int s = seg_of_row[r];
            const Args& a = args[s];
            static thread_local std::vector<float> qv;
            qv.resize((size_t)H * D);
            float* const qr = qv.data();
            rope_row(a, start[s] + (r - off[s]), in + (int64_t)r * qkv_st, cs + (int64_t)r * cs_st,
                     sn + (int64_t)r * cs_st, qr);
            for (int e = 0; e < H * D / 2; ++e)
                qpp[(int64_t)r * H * (D / 2) + e] = (uint32_t)float_to_bf16(qr[2 * e] * scale) |
                                                    ((uint32_t)float_to_bf16(qr[2 * e + 1] * scale) << 16);
            row_info(a, work[s], (int)(r - off[s]));
        }
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < b_sc[S]; ++i) {
            const int s = seg_of(b_sc, i);
            const Work& w = work[s];
            const int nch = (w.nb + CHUNK - 1) / CHUNK;
            const int j = i - b_sc[s], hk = j / nch, b0 = (j % nch) * CHUNK;
            amx_scores_task(args[s], w, hk, b0, std::min(w.nb, b0 + CHUNK));
        }
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < b_row[S]; ++i) {
            const int s = seg_of(b_row, i);
            const int j = i - b_row[s];
            amx_softmax_task(args[s], work[s], j % Hkv, j / Hkv);
        }
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < b_pv[S]; ++i) {
            const int s = seg_of(b_pv, i);
            const Args& a = args[s];
            const Work& w = work[s];
            const int j = i - b_pv[s], h = j % 2, hk = j / 2;
            const int64_t m0 = (int64_t)hk * w.Mp;
            amx_decode_pv(w.PB + m0 * w.ps, w.ps, a.vp + (int64_t)hk * (a.cap / 2) * D * 2, amx_shared(a, w), h,
                          w.Mp / 16, w.acc + m0 * D + 32 * h, D);
        }
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < b_row[S]; ++i) {
            const int s = seg_of(b_row, i);
            const int j = i - b_row[s];
            amx_row_task(args[s], work[s], j % Hkv, j / Hkv, amx_shared(args[s], work[s]), o + off[s] * out_st,
                         out_st);
        }
        amx_decode_tiles(false);
    }
}

// segs: int64 [S, 11] = k, v (layer 0 of the float32 cache [n_layers, Hkv, cap, D]), kt2, vp
// (layer 0 of the packed copies), cap, L, mask, mask_stride, row_off, T, start: the segment's T
// rows are written at cache slots [start, start + T) of `layer` and attend over slots [0, L) as
// mask ([T, >= L] bool; 0 = all) says. qkv: bfloat16 [R, H*D + 2*Hkv*D] (row stride qkv_st);
// cos / sin: bfloat16 [R, D] (row stride cs_st); out: bfloat16 [R, H*D] (row stride out_st).
// mode: 0 one row_task per (row, kv head); 1 the AMX kernel (see Work; where the CPU has AMX and
// the kernels run at the top ISA level, else 0), its own bits.
void qkv_attention(uintptr_t qkv, int64_t qkv_st, uintptr_t cos, uintptr_t sin, int64_t cs_st, uintptr_t segs,
                   int S, int layer, uintptr_t out, int64_t out_st, int H, int Hkv, int head_dim, int threads,
                   int mode) {
    if (head_dim != D) throw std::invalid_argument("head_dim must be 64");
    if (Hkv <= 0 || H % Hkv != 0 || H / Hkv > MAXG) throw std::invalid_argument("bad head counts");
    if (S <= 0) throw std::invalid_argument("no segments");
    const int64_t* sg = reinterpret_cast<const int64_t*>(segs);
    const int G = H / Hkv;
    std::vector<Args> args(S);
    std::vector<int> row_base(S + 1, 0), seg_of_row;
    std::vector<int64_t> start(S), off(S);
    const float scale = (float)(1.0 / std::sqrt((double)D));
    int R = 0;
    for (int s = 0; s < S; ++s) {
        const int64_t* r = sg + (int64_t)s * 11;
        Args& a = args[s];
        a.cap = r[4];
        if (a.cap <= 0 || a.cap % 16 != 0) throw std::invalid_argument("capacity must be a positive multiple of 16");
        const int64_t lay = (int64_t)layer * Hkv * a.cap * D;
        a.k = reinterpret_cast<const float*>(r[0]) + lay;
        a.v = reinterpret_cast<const float*>(r[1]) + lay;
        a.kt2 = reinterpret_cast<const uint16_t*>(r[2]) + lay;
        a.vp = reinterpret_cast<const uint16_t*>(r[3]) + lay;
        a.kt = nullptr; a.Lr = 0;
        a.L = (int)r[5];
        a.mask = reinterpret_cast<const uint8_t*>(r[6]); a.m_st = r[7];
        off[s] = r[8];
        a.T = (int)r[9];
        start[s] = r[10];
        if (a.T <= 0 || a.L <= 0 || a.L > a.cap || start[s] < 0 || start[s] + a.T > a.cap)
            throw std::invalid_argument("bad segment T / L / start / capacity");
        if (off[s] != R) throw std::invalid_argument("segments must cover rows in order");
        R += a.T;
        a.H = H; a.Hkv = Hkv; a.scale = scale;
        a.Lr = (a.L + 15) / 16 * 16;
        row_base[s + 1] = row_base[s] + Hkv * a.T;
        for (int t = 0; t < a.T; ++t) seg_of_row.push_back(s);
    }
    if (mode == 1 && decode_amx_runs()) {
        qkv_attention_amx(qkv, qkv_st, cos, sin, cs_st, args, start, off, seg_of_row, R, out, out_st, threads);
        return;
    }
    const row_fn row_task = bf16_row_for(agentspec_isa());
    nb::gil_scoped_release nogil;
    static thread_local std::vector<float> qf, of;
    qf.resize((size_t)R * H * D);
    of.resize((size_t)R * H * D);
    float* const qfp = qf.data();  // (inside the parallel region `qf` would name each thread's own)
    for (int s = 0; s < S; ++s) {
        args[s].q = qfp + off[s] * H * D; args[s].q_sh = D; args[s].q_st = (int64_t)H * D;
        args[s].out = of.data() + off[s] * H * D;
    }
    const uint16_t* in = reinterpret_cast<const uint16_t*>(qkv);
    const uint16_t* cs = reinterpret_cast<const uint16_t*>(cos);
    const uint16_t* sn = reinterpret_cast<const uint16_t*>(sin);
    uint16_t* o = reinterpret_cast<uint16_t*>(out);
    const int nrows = row_base[S];
    if (threads <= 0) threads = omp_get_max_threads();
    threads = std::max(1, std::min(threads, nrows));
#pragma omp parallel num_threads(threads)
    {
        static thread_local Scratch sc;
#pragma omp for schedule(static)
        for (int r = 0; r < R; ++r) {  // rotary embedding; new keys / values into the cache
            const int s = seg_of_row[r];
            rope_row(args[s], start[s] + (r - off[s]), in + (int64_t)r * qkv_st, cs + (int64_t)r * cs_st,
                     sn + (int64_t)r * cs_st, qfp + (int64_t)r * H * D);
        }
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < nrows; ++i) {
            const int s = int(std::upper_bound(row_base.begin(), row_base.end(), i) - row_base.begin()) - 1;
            const int j = i - row_base[s], hk = j % Hkv, t = j / Hkv;
            const Args& a = args[s];
            row_task(a, hk, t, sc);
            const float* src = a.out + ((int64_t)t * H + (int64_t)hk * G) * D;
            uint16_t* dst = o + (off[s] + t) * out_st + (int64_t)hk * G * D;
            for (int e = 0; e < G * D; ++e) dst[e] = float_to_bf16(src[e]);
        }
    }
}

// Re-derive the packed copies of `slots` (every layer) from the float32 cache, after torch wrote
// or moved those slots (prefill, commit of a branch).
void sync_packed(uintptr_t k, uintptr_t v, uintptr_t kt2, uintptr_t vp, int64_t cap, int n_layers, int Hkv,
                 int head_dim, uintptr_t slots, int n) {
    if (head_dim != D) throw std::invalid_argument("head_dim must be 64");
    if (cap <= 0 || cap % 16 != 0) throw std::invalid_argument("capacity must be a positive multiple of 16");
    const int64_t* sl = reinterpret_cast<const int64_t*>(slots);
    for (int i = 0; i < n; ++i)
        if (sl[i] < 0 || sl[i] >= cap) throw std::invalid_argument("slot out of range");
    nb::gil_scoped_release nogil;
#pragma omp parallel for schedule(static)
    for (int lh = 0; lh < n_layers * Hkv; ++lh) {
        const int64_t lay = (int64_t)(lh / Hkv) * Hkv * cap * D;
        const int hk = lh % Hkv;
        const float* kl = reinterpret_cast<const float*>(k) + lay;
        const float* vl = reinterpret_cast<const float*>(v) + lay;
        for (int i = 0; i < n; ++i) {
            const int64_t s = sl[i];
            put_packed(reinterpret_cast<uint16_t*>(kt2) + lay, reinterpret_cast<uint16_t*>(vp) + lay, cap, hk, s,
                       kl + ((int64_t)hk * cap + s) * D, vl + ((int64_t)hk * cap + s) * D);
        }
    }
}

// The best ISA level this CPU runs (bf16.h)
int isa_max() {
#if defined(AGENTSPEC_X86)
    __builtin_cpu_init();
    const bool v3 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c") && __builtin_cpu_supports("bmi2");
    const bool v4 = v3 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                    __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    if (v4 && __builtin_cpu_supports("avx512bf16")) return 4;
    if (v4) return 3;
    if (v3) return 2;
    return 0;
#elif defined(AGENTSPEC_NEON)
    return 1;
#else
    return 0;
#endif
}

bool isa_runs(int level) {
    const int top = isa_max();
    if (level == 0 || level == top) return true;
#if defined(AGENTSPEC_X86)
    return level >= 2 && level <= top;
#else
    return false;
#endif
}

int g_isa = -1;  // -1: not chosen yet (isa_max on first use)

void set_isa(int level) {
    if (level < 0) { g_isa = isa_max(); return; }
    if (!isa_runs(level)) throw std::invalid_argument("this CPU cannot run ISA level " + std::to_string(level));
    g_isa = level;
}

}  // namespace

int agentspec_isa() {
    if (g_isa < 0) g_isa = isa_max();
    return g_isa;
}

void register_linear(nb::module_& m);   // linear.cpp
void register_prefill(nb::module_& m);  // prefill_amx.cpp

NB_MODULE(_cpu, m) {
    m.doc() = "agentspec CPU kernels: exact decode / tree-verification attention, row-invariant bf16 linears";
    m.def("abi_version", []() { return 9; });
    register_linear(m);
    register_prefill(m);
    m.def("attention", &attention,
          nb::arg("q"), nb::arg("q_stride_h"), nb::arg("q_stride_t"), nb::arg("k"), nb::arg("v"),
          nb::arg("capacity"), nb::arg("mask"), nb::arg("mask_stride_t"), nb::arg("out"),
          nb::arg("n_heads"), nb::arg("n_kv_heads"), nb::arg("T"), nb::arg("L"), nb::arg("head_dim"),
          nb::arg("threads") = 0,
          "Raw-pointer entry point; call agentspec.kernels.cpu_attention.decode_attention instead.");
    m.def("attention_segments", &attention_segments,
          nb::arg("q"), nb::arg("q_stride_h"), nb::arg("q_stride_t"), nb::arg("k_new"), nb::arg("v_new"),
          nb::arg("new_stride_h"), nb::arg("new_stride_t"), nb::arg("segments"), nb::arg("n_segments"),
          nb::arg("out"), nb::arg("n_heads"), nb::arg("n_kv_heads"), nb::arg("head_dim"), nb::arg("threads") = 0,
          "Raw-pointer entry point; call agentspec.kernels.cpu_attention.segment_attention instead.");
    m.def("sync_packed", &sync_packed, nb::arg("k"), nb::arg("v"), nb::arg("kt2"), nb::arg("vp"), nb::arg("capacity"),
          nb::arg("n_layers"), nb::arg("n_kv_heads"), nb::arg("head_dim"), nb::arg("slots"), nb::arg("n_slots"),
          "Raw-pointer entry point; call KVCache.sync instead.");
    m.def("isa_max", &isa_max, "the best ISA level this CPU runs (0 scalar, 1 neon, 2 avx2, 3 avx512, 4 avx512bf16)");
    m.def("isa_runs", &isa_runs, nb::arg("level"), "whether this CPU runs ISA level `level`");
    m.def("set_isa", &set_isa, nb::arg("level"), "run the bfloat16 kernels at ISA level `level` (-1: the best)");
    m.def("isa", &agentspec_isa, "the ISA level the bfloat16 kernels run now");
    m.def("decode_amx_runs", &decode_amx_runs, "whether qkv_attention's mode 1 runs on AMX now (else it runs mode 0)");
    m.def("qkv_attention", &qkv_attention,
          nb::arg("qkv"), nb::arg("qkv_stride"), nb::arg("cos"), nb::arg("sin"),
          nb::arg("cos_stride"), nb::arg("segments"), nb::arg("n_segments"), nb::arg("layer"), nb::arg("out"),
          nb::arg("out_stride"), nb::arg("n_heads"), nb::arg("n_kv_heads"), nb::arg("head_dim"),
          nb::arg("threads") = 0, nb::arg("mode") = 1,
          "Raw-pointer entry point; call agentspec.kernels.cpu_attention.QKVAttention instead.");
}
