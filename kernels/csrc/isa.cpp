// agentspec.kernels._cpu: the ISA level the bfloat16 kernels run at (the levels: bf16.h).
// Each kernel compiled per level (attention_bf16.inc, linear_body.inc) picks its body by
// agentspec_isa() on every call; set_isa caps it (agentspec.kernels.cpu_isa, AGENTSPEC_CPU_ISA).
#include <stdexcept>
#include <string>

#include "bf16.h"
#include "kernels.h"

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

namespace {
int g_isa = -1;  // -1: not chosen yet (isa_max on first use)
}  // namespace

void set_isa(int level) {
    if (level < 0) { g_isa = isa_max(); return; }
    if (!isa_runs(level)) throw std::invalid_argument("this CPU cannot run ISA level " + std::to_string(level));
    g_isa = level;
}

int agentspec_isa() {
    if (g_isa < 0) g_isa = isa_max();
    return g_isa;
}
