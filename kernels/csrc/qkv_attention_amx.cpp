// agentspec.kernels._cpu: the AMX kernel of qkv_attention (its mode 1) for bfloat16 models,
// from the fused q|k|v projection to the output projection's input as qkv_attention.cpp's rows
// kernel, on AMX tiles; its own bits (its tiles sum in another order), the same for a draft-tree
// node as for the same token decoded plainly.
//
// AMX decode / verify attention (bfloat16 models; qkv_attention's mode 1, the default where the
// CPU has AMX): the rows of one request share each kv head's keys and values, so rather than one
// task per (row, kv head) that streams them all, the work runs in phases over all of a request's
// rows at once, on AMX tiles (amx.cpp, "AMX phases"):
//   rows    per row: its visible slots, their count, the leading run at their own slots, and
//           which 64-slot blocks it sees (plus rotary and the cache writes);
//   scores  per (kv head, 256-slot chunk), every row tile of the request;
//   softmax per (kv head, row), over the row's compact scores;
//   p @ v   per (kv head, half of d): the 32-key blocks every row holds at its own slots;
//   tail    per (kv head, row): the row's own blocks (draft-tree ancestors, the last partial
//           block), then the output.
#include <nanobind/nanobind.h>

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "attention.h"
#include "kernels.h"

namespace nb = nanobind;
using namespace attn;

namespace {

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

}  // namespace

// Whether mode 1 runs: AMX here, and the bf16 kernels at the top ISA level (AVX512-BF16; a cap
// below it keeps every level's bits equal)
bool decode_amx_runs() { return agentspec_isa() == 4 && prefill_amx_available(); }

namespace attn {

// qkv_attention's AMX kernel (see Work): the phases run over every segment's tasks, with a
// barrier between phases.
void qkv_attention_amx(uintptr_t qkv, int64_t qkv_st, uintptr_t cos, uintptr_t sin, int64_t cs_st,
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

}  // namespace attn
