// agentspec.kernels._cpu: qkv_attention, the whole attention of a bfloat16 model's decoder layer
// for decode / verify rows, and sync_packed, which keeps the cache's packed copies.
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
//   softmax as softmax_visible (attention.h; float32), p_n = exp(score_n - m) / sum in bfloat16
//   o_d     = dot over visible-key pairs (compact index 2j, 2j+1) in order of p and v_{.,d}
// As in attention.cpp, every reduction runs over the row's compact sequence of visible keys, so
// a draft-tree node gets the same bits as the same token in plain decoding. Value pairs come from
// vp where the pair's keys sit at slots equal to their compact indices (the committed prefix),
// else they are packed on the fly from the float32 cache: the same bits either way. Rounding p
// to bfloat16 before p @ v is what flash attention does for bfloat16 models.
// Machines without AVX512-BF16 run an emulation (plain float32 adds in the same order; it
// does not flush subnormals as the instruction does).
//
// qkv_attention's mode 0 is the rows kernel here (one row_task per (row, kv head), compiled once
// per ISA level); mode 1 is the AMX kernel (qkv_attention_amx.cpp) where decode_amx_runs().
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

}  // namespace

// segs: int64 [S, 11] = k, v (layer 0 of the float32 cache [n_layers, Hkv, cap, D]), kt2, vp
// (layer 0 of the packed copies), cap, L, mask, mask_stride, row_off, T, start: the segment's T
// rows are written at cache slots [start, start + T) of `layer` and attend over slots [0, L) as
// mask ([T, >= L] bool; 0 = all) says. qkv: bfloat16 [R, H*D + 2*Hkv*D] (row stride qkv_st);
// cos / sin: bfloat16 [R, D] (row stride cs_st); out: bfloat16 [R, H*D] (row stride out_st).
// mode: 0 one row_task per (row, kv head); 1 the AMX kernel (qkv_attention_amx.cpp; where the CPU
// has AMX and the kernels run at the top ISA level, else 0), its own bits.
void qkv_attention(uintptr_t qkv, int64_t qkv_st, uintptr_t cos, uintptr_t sin, int64_t cs_st, uintptr_t segs,
                   int S, int layer, uintptr_t out, int64_t out_st, int H, int Hkv, int head_dim, int threads,
                   int mode) {
    check_heads(H, Hkv, head_dim);
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
