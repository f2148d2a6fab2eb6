// agentspec.kernels._cpu, the module: its bindings, and nothing else. The kernels are the other
// files of kernels/csrc (their entry points: kernels.h); CMakeLists.txt compiles them all into
// this one extension.
#include <nanobind/nanobind.h>

#include "kernels.h"

namespace nb = nanobind;

NB_MODULE(_cpu, m) {
    m.doc() = "agentspec CPU kernels: exact decode / tree-verification attention, row-invariant bf16 linears";
    m.def("abi_version", []() { return 18; });
    m.def("linear_q", &linear_q, nb::arg("x"), nb::arg("x_stride"), nb::arg("M"), nb::arg("q"), nb::arg("scales"),
          nb::arg("mins"), nb::arg("sub_scales"), nb::arg("sub_mins"), nb::arg("fmt"), nb::arg("block"), nb::arg("N"), nb::arg("K"), nb::arg("out"),
          nb::arg("out_stride"), nb::arg("threads") = 0, nb::arg("act") = 0, nb::arg("norm_weight") = 0,
          nb::arg("eps") = 0.0, nb::arg("out_f32") = false,
          "Raw-pointer entry point; call agentspec.kernels.cpu_quant.QuantLinear instead.");
    m.def("qlinear_body", &qlinear_body, "the quantized linears' body at the ISA level set now");
    m.def("repack_k", &repack_k, nb::arg("raw"), nb::arg("raw_stride"), nb::arg("N"), nb::arg("K"), nb::arg("qbits"),
          nb::arg("q"), nb::arg("scale"), nb::arg("mins"), nb::arg("sub"), nb::arg("sub_mins"), nb::arg("threads") = 0,
          "Raw-pointer entry point; call agentspec.kernels.cpu_quant.repack instead.");
    m.def("linear_bf16", &linear_bf16, nb::arg("x"), nb::arg("x_stride"), nb::arg("M"), nb::arg("w_packed"),
          nb::arg("N"), nb::arg("K"), nb::arg("out"), nb::arg("out_stride"), nb::arg("threads") = 0,
          "Raw-pointer entry point; call agentspec.kernels.cpu_linear.PackedLinear instead.");
    m.def("argmax_bf16", &argmax_bf16, nb::arg("x"), nb::arg("x_stride"), nb::arg("M"), nb::arg("N"), nb::arg("out"),
          nb::arg("threads") = 0, "Raw-pointer entry point; call agentspec.kernels.cpu_linear.argmax_rows instead.");
    m.def("prefill_amx_available", &prefill_amx_available,
          "whether this CPU (and OS) runs the AMX prefill attention");
    m.def("prefill_attention", &prefill_attention, nb::arg("q"), nb::arg("q_stride_h"), nb::arg("q_stride_t"),
          nb::arg("k"), nb::arg("k_stride_h"), nb::arg("k_stride_t"), nb::arg("v"), nb::arg("v_stride_h"),
          nb::arg("v_stride_t"), nb::arg("kt2"), nb::arg("vp"), nb::arg("capacity"), nb::arg("start"), nb::arg("T"),
          nb::arg("n_heads"), nb::arg("n_kv_heads"), nb::arg("head_dim"), nb::arg("out"), nb::arg("threads") = 0,
          "Raw-pointer entry point; call agentspec.kernels.cpu_attention.prefill_attention instead.");
    m.def("prefill_bf16_runs", &prefill_bf16_runs,
          "whether prefill_bf16 runs at the ISA level set now (avx512bf16)");
    m.def("prefill_bf16", &prefill_bf16, nb::arg("q"), nb::arg("q_stride_h"), nb::arg("q_stride_t"), nb::arg("k"),
          nb::arg("v"), nb::arg("capacity"), nb::arg("kv_bf16"), nb::arg("start"), nb::arg("T"), nb::arg("n_heads"),
          nb::arg("n_kv_heads"), nb::arg("head_dim"), nb::arg("out"), nb::arg("threads") = 0,
          "Raw-pointer entry point; call agentspec.kernels.cpu_attention.prefill_bf16 instead.");
    m.def("prefill_qkv_attention", &prefill_qkv_attention, nb::arg("qkv"), nb::arg("qkv_stride"), nb::arg("cos"),
          nb::arg("sin"), nb::arg("cs_stride"), nb::arg("k"), nb::arg("v"), nb::arg("kt2"), nb::arg("vp"),
          nb::arg("capacity"), nb::arg("start"), nb::arg("T"), nb::arg("n_heads"), nb::arg("n_kv_heads"),
          nb::arg("head_dim"), nb::arg("out"), nb::arg("threads") = 0,
          "Raw-pointer entry point; call agentspec.kernels.cpu_attention.prefill_qkv_attention instead.");
    m.def("rms_norm_rows", &rms_norm_rows, nb::arg("x"), nb::arg("x_stride"), nb::arg("M"), nb::arg("w"),
          nb::arg("dim"), nb::arg("eps"), nb::arg("out"), nb::arg("out_stride"), nb::arg("threads") = 0,
          "Raw-pointer entry point; call agentspec.kernels.cpu_attention.rms_norm instead.");
    m.def("linear_amx", &linear_amx, nb::arg("x"), nb::arg("x_stride"), nb::arg("M"), nb::arg("w_packed"),
          nb::arg("N"), nb::arg("K"), nb::arg("out"), nb::arg("out_stride"), nb::arg("threads") = 0,
          nb::arg("mode") = 0, nb::arg("res") = 0, nb::arg("res_stride") = 0,
          "Raw-pointer entry point; call agentspec.kernels.cpu_linear.PackedLinear.prefill instead.");
    m.def("attention", &attention,
          nb::arg("q"), nb::arg("q_stride_h"), nb::arg("q_stride_t"), nb::arg("k"), nb::arg("v"),
          nb::arg("capacity"), nb::arg("mask"), nb::arg("mask_stride_t"), nb::arg("out"),
          nb::arg("n_heads"), nb::arg("n_kv_heads"), nb::arg("T"), nb::arg("L"), nb::arg("head_dim"),
          nb::arg("threads") = 0, nb::arg("kv_bf16") = false, nb::arg("group") = 0, nb::arg("dot") = false,
          "Raw-pointer entry point; call agentspec.kernels.cpu_attention.decode_attention instead.");
    m.def("attention_segments", &attention_segments,
          nb::arg("q"), nb::arg("q_stride_h"), nb::arg("q_stride_t"), nb::arg("k_new"), nb::arg("v_new"),
          nb::arg("new_stride_h"), nb::arg("new_stride_t"), nb::arg("segments"), nb::arg("n_segments"),
          nb::arg("out"), nb::arg("n_heads"), nb::arg("n_kv_heads"), nb::arg("head_dim"), nb::arg("threads") = 0,
          nb::arg("kv_bf16") = false, nb::arg("group") = 0, nb::arg("dot") = false,
          "Raw-pointer entry point; call agentspec.kernels.cpu_attention.segment_attention instead.");
    m.def("attention_dot_runs", &attention_dot_runs,
          "whether attention's bfloat16-product mode (dot) runs at the ISA level set now (avx512bf16)");
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
