// The entry points of agentspec.kernels._cpu, bound by module.cpp (raw pointers as uintptr_t; the
// Python wrappers in agentspec.kernels check shapes and dtypes and pass data_ptr()s). Each releases
// the GIL while it computes.
#pragma once

#include <cstdint>

// attention.cpp: decode / tree-verification attention over a float32 or bfloat16 KV cache
void attention(uintptr_t q, int64_t q_sh, int64_t q_st, uintptr_t k, uintptr_t v, int64_t cap,
               uintptr_t mask, int64_t m_st, uintptr_t out, int H, int Hkv, int T, int L, int head_dim,
               int threads, bool kv_bf16, int group, bool dot);
void attention_segments(uintptr_t q, int64_t q_sh, int64_t q_st, uintptr_t k_new, uintptr_t v_new, int64_t kn_sh,
                        int64_t kn_st, uintptr_t segs_ptr, int S, uintptr_t out, int H, int Hkv, int head_dim,
                        int threads, bool kv_bf16, int group, bool dot);
// whether their bfloat16-product mode (dot) runs at the ISA level set now (avx512bf16)
bool attention_dot_runs();

// qkv_attention.cpp: a bfloat16 model's whole attention for decode / verify rows; the packed copies
void qkv_attention(uintptr_t qkv, int64_t qkv_st, uintptr_t cos, uintptr_t sin, int64_t cs_st, uintptr_t segs,
                   int S, int layer, uintptr_t out, int64_t out_st, int H, int Hkv, int head_dim, int threads,
                   int mode);
void sync_packed(uintptr_t k, uintptr_t v, uintptr_t kt2, uintptr_t vp, int64_t cap, int n_layers, int Hkv,
                 int head_dim, uintptr_t slots, int n);

// qkv_attention_amx.cpp: whether qkv_attention's mode 1 runs on AMX now
bool decode_amx_runs();

// isa.cpp: the ISA levels of the bfloat16 kernels (bf16.h)
int isa_max();
bool isa_runs(int level);
void set_isa(int level);
int agentspec_isa();

// linear.cpp: row-invariant bfloat16 linear for decode / verify rows
void linear_bf16(uintptr_t x, int64_t x_st, int64_t M, uintptr_t wp, int64_t N, int64_t K, uintptr_t out,
                 int64_t o_st, int threads);

// qlinear.cpp: row-invariant linears over GGUF-quantized weights (repacked: cpu_quant), and the body
// the ISA level set now runs ("amx-int8", "avx512vnni", "avx2", "neon", "scalar")
void linear_q(uintptr_t x, int64_t x_st, int64_t M, uintptr_t q, uintptr_t sc, uintptr_t mn, uintptr_t s8,
              uintptr_t m8, int fmt, int B, int64_t N, int64_t K, uintptr_t out, int64_t o_st, int threads, int act,
              uintptr_t norm_w, double eps, bool out_f32);
const char* qlinear_body();
void repack_k(uintptr_t raw, int64_t raw_st, int64_t N, int64_t K, int qbits, uintptr_t q, uintptr_t scale,
              uintptr_t mins, uintptr_t sub, uintptr_t sub_mins, int threads);

// amx.cpp: AMX prefill attention, RMSNorm rows, linears and the AMX phases of decode attention
bool prefill_amx_available();
void prefill_attention(uintptr_t q, int64_t q_sh, int64_t q_st, uintptr_t k, int64_t k_sh, int64_t k_st,
                       uintptr_t v, int64_t v_sh, int64_t v_st, uintptr_t kt2, uintptr_t vp, int64_t cap,
                       int64_t start, int T, int H, int Hkv, int head_dim, uintptr_t out, int threads);
void prefill_qkv_attention(uintptr_t qkv, int64_t qkv_st, uintptr_t cos, uintptr_t sin, int64_t cs_st,
                           uintptr_t kf, uintptr_t vf, uintptr_t kt2, uintptr_t vp, int64_t cap, int64_t start,
                           int T, int H, int Hkv, int head_dim, uintptr_t out, int threads);
void rms_norm_rows(uintptr_t x, int64_t x_st, int64_t M, uintptr_t w, int64_t dim, double eps, uintptr_t out,
                   int64_t o_st, int threads);
void linear_amx(uintptr_t x, int64_t x_st, int64_t M, uintptr_t wp, int64_t N, int64_t K, uintptr_t out,
                int64_t o_st, int threads, int mode, uintptr_t res, int64_t r_st);

// prefill_bf16.cpp: prompt attention with AVX512-BF16 over a float32 or bfloat16 cache (GGUF models)
bool prefill_bf16_runs();
void prefill_bf16(uintptr_t q, int64_t q_sh, int64_t q_st, uintptr_t k, uintptr_t v, int64_t cap, bool kv_bf16,
                  int64_t start, int T, int H, int Hkv, int head_dim, uintptr_t out, int threads);

// argmax.cpp: the first index of each bfloat16 row's maximum (torch.argmax's), per ISA level
void argmax_bf16(uintptr_t x, int64_t x_st, int64_t M, int64_t N, uintptr_t out, int threads);
