// Shared by the decode / verify attention kernels of agentspec.kernels._cpu: the float32 kernel
// (attention.cpp), the bfloat16 rows kernel (qkv_attention.cpp) and the AMX one
// (qkv_attention_amx.cpp). Their exactness contract (attention.cpp, top): every reduction runs
// over a row's compact sequence of visible keys, so a draft-tree node gets the bits of the same
// token decoded plainly; visible_slots and softmax_visible below are the part they share.
#pragma once

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "bf16.h"

namespace attn {

constexpr int D = 64;        // head_dim (SmolLM2-135M)
constexpr int KB = 64;       // keys per score block (4 x 16 floats)
constexpr int MAXG = 8;      // query heads per kv head supported
// Query heads per pass of the kernels' dot-product loops at most: a kv head's G query heads go in
// passes of at most GC (7 = 4 + 3) over the same keys / values, read from L1. Each head's
// arithmetic is its own (nothing is summed across heads), so the passes change no bits; they keep
// the compiled code to GC inner shapes instead of one body per G. At GC = 4 a pass of the float32
// kernel keeps 4 x 4 accumulators and a block's 4 key vectors in registers (20 of AVX-512's 32).
constexpr int GC = 4;

static inline v16 load16(const float* p) { v16 x; std::memcpy(&x, p, sizeof x); return x; }
static inline void store16(float* p, v16 x) { std::memcpy(p, &x, sizeof x); }

// Float vectors of W lanes (16, 8 or 4: one zmm, ymm or xmm) and their int32 / uint32 / uint16
// companions: the float32 kernel runs at the width its ISA level has registers for (attention.cpp);
// every operation is elementwise IEEE, so a lane computes the same bits at any width.
template <int W> struct VecW;
template <> struct VecW<16> {
    typedef v16 f;
    typedef v16i i;
    typedef v16u u;
    typedef uint16_t h __attribute__((vector_size(32)));
};
template <> struct VecW<8> {
    typedef float f __attribute__((vector_size(32)));
    typedef int32_t i __attribute__((vector_size(32)));
    typedef uint32_t u __attribute__((vector_size(32)));
    typedef uint16_t h __attribute__((vector_size(16)));
};
template <> struct VecW<4> {
    typedef float f __attribute__((vector_size(16)));
    typedef int32_t i __attribute__((vector_size(16)));
    typedef uint32_t u __attribute__((vector_size(16)));
    typedef uint16_t h __attribute__((vector_size(8)));
};
template <typename V> static inline __attribute__((always_inline)) V vload(const float* p) {
    V x;
    std::memcpy(&x, p, sizeof x);
    return x;
}
template <typename V> static inline __attribute__((always_inline)) void vstore(float* p, V x) {
    std::memcpy(p, &x, sizeof x);
}

// exp(x - m) for x <= m (Cephes expf: range reduction by ln 2, degree-5 polynomial, 2^n from the
// exponent bits), plain float arithmetic, lane by lane (V: VecW<W>::f, VI: its VecW<W>::i).
// Arguments below CUT give exactly 0: those terms are < e^-60 of the largest one (no effect on a
// float32 result), and keeping them would make denormal products in p @ v, which are very slow on x86.
constexpr float CUT = -60.0f;
template <typename V, typename VI>
static inline __attribute__((always_inline)) V expv(V x, float m) {
    V t = x - m;
    VI low = t < CUT;
    t = low ? V{} + CUT : t;
    V fx = t * 1.44269504088896341f + 0.5f;
    V fi = __builtin_convertvector(__builtin_convertvector(fx, VI), V);  // toward zero
    fi = fi > fx ? fi - 1.0f : fi;                                       // floor
    V r = t - fi * 0.693359375f;
    r = r - fi * -2.12194440e-4f;
    V z = V{} + 1.9875691500e-4f;
    z = z * r + 1.3981999507e-3f;
    z = z * r + 8.3334519073e-3f;
    z = z * r + 4.1665795894e-2f;
    z = z * r + 1.6666665459e-1f;
    z = z * r + 5.0000001201e-1f;
    z = z * (r * r) + r;
    z = z + 1.0f;
    VI bits = (__builtin_convertvector(fi, VI) + 127) << 23;
    V pow2 = (V)bits;
    V p = z * pow2;
    return low ? V{} : p;
}

// The head shapes every attention entry point takes: head_dim 64, 1 to MAXG query heads per kv head.
static inline void check_heads(int H, int Hkv, int head_dim) {
    if (head_dim != D) throw std::invalid_argument("head_dim must be 64");
    if (Hkv <= 0 || H % Hkv != 0 || H / Hkv > MAXG) throw std::invalid_argument("bad head counts");
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

struct Scratch {
    std::vector<float> s;      // [G, Lr] scores, then compact probabilities
    std::vector<int32_t> idx;  // compact visible slots
    std::vector<float> q;      // [rows, G, head_dim] a group's scaled queries (attention.cpp)
    std::vector<uint16_t> pb;  // [G, Lr + 2] probabilities in bfloat16 (bfloat16 models)
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
// first when `compact`): Sg[i] = p_i / sum for i < n, 0 up to the next multiple of 16. W: the
// vector width it runs at; the bits are those of 16 lanes at any W (a 16-lane vector is 16 / W
// vectors of W: lane l of vector q is lane q * W + l).
template <int W>
static inline __attribute__((always_inline)) void softmax_w(float* Sg, int n, bool compact, const int32_t* idx) {
    using V = typename VecW<W>::f;
    using VI = typename VecW<W>::i;
    constexpr int NL = 16 / W;
    const int n16 = (n + 15) / 16 * 16;
    // compact in place (idx[i] >= i, so reading ahead of writing is safe); a leading run with
    // idx[i] == i (the committed prefix) is already in place
    if (compact) {
        int i = 0;
        while (i < n && idx[i] == i) ++i;
        for (; i < n; ++i) Sg[i] = Sg[idx[i]];
    }
    for (int i = n; i < n16; ++i) Sg[i] = Sg[0];  // pad to 16 (ignored below)
    // max: lane i % 16 in order of i, then the lanes in order (exact in any order but for NaNs)
    V mx[NL];
    for (int q = 0; q < NL; ++q) mx[q] = vload<V>(Sg + q * W);
    for (int i = 16; i < n16; i += 16)
        for (int q = 0; q < NL; ++q) {
            V x = vload<V>(Sg + i + q * W);
            mx[q] = x > mx[q] ? x : mx[q];
        }
    float pm[16];
    for (int q = 0; q < NL; ++q) vstore(pm + q * W, mx[q]);
    float m = pm[0];
    for (int l = 1; l < 16; ++l) m = pm[l] > m ? pm[l] : m;
    // p = exp(s - m); sum: lane i % 16 in order of i, then a fixed pairwise tree
    V part[NL];
    for (int q = 0; q < NL; ++q) part[q] = V{};
    int i = 0;
    for (; i + 16 <= n; i += 16)
        for (int q = 0; q < NL; ++q) {
            V p = expv<V, VI>(vload<V>(Sg + i + q * W), m);
            vstore(Sg + i + q * W, p);
            part[q] = part[q] + p;
        }
    if (i < n)
        for (int q = 0; q < NL; ++q) {
            V p = expv<V, VI>(vload<V>(Sg + i + q * W), m);
            for (int l = 0; l < W; ++l)
                if (i + q * W + l >= n) p[l] = 0.0f;
            vstore(Sg + i + q * W, p);
            part[q] = part[q] + p;
        }
    float pt[16];
    for (int q = 0; q < NL; ++q) vstore(pt + q * W, part[q]);
    for (int w = 8; w >= 1; w /= 2)
        for (int l = 0; l < w; ++l) pt[l] = pt[l] + pt[l + w];
    const V inv_sum = V{} + 1.0f / pt[0];
    for (int j = 0; j < n16; j += W) vstore(Sg + j, vload<V>(Sg + j) * inv_sum);  // p / sum
}
static inline __attribute__((always_inline)) void softmax_visible(float* Sg, int n, bool compact, const int32_t* idx) {
    softmax_w<16>(Sg, n, compact, idx);
}

// bfloat16 models (qkv_attention.cpp): rotary embedding and the cache writes, shared by
// qkv_attention's two kernels.
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
static inline void rope_row(const Args& a, int64_t slot, const uint16_t* x, const uint16_t* c, const uint16_t* sv,
                            float* q) {
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

// qkv_attention's AMX kernel (qkv_attention_amx.cpp): mode 1 where decode_amx_runs().
void qkv_attention_amx(uintptr_t qkv, int64_t qkv_st, uintptr_t cos, uintptr_t sin, int64_t cs_st,
                       std::vector<Args>& args, const std::vector<int64_t>& start,
                       const std::vector<int64_t>& off, const std::vector<int>& seg_of_row, int R,
                       uintptr_t out, int64_t out_st, int threads);

}  // namespace attn

// The AMX phases of qkv_attention's AMX kernel (amx.cpp, "AMX phases")
void amx_decode_tiles(bool on);
void amx_decode_scores(const uint16_t* qb, int ntiles, const uint16_t* kt2, int64_t cap, int j0, int j1,
                       const uint8_t* need, float* S, int64_t ss);
void amx_decode_pv(const uint16_t* P, int64_t ps, const uint16_t* vp, int E, int h, int ntiles, float* acc,
                   int64_t acs);
void amx_decode_pv_row(const uint16_t* prow, const uint16_t* vb, int nblk, float* acc);
void amx_softmax_row(float* Sg, int n, uint16_t* P);
