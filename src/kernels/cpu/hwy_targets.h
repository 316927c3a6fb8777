// Highway target selection shared by the kernels/cpu/ translation units; include it first, before
// any Highway header. The baseline x86-64 build compiles EMU128 as the static (fallback) target;
// SSSE3 and AVX3_DL add compile time without helping the machines Cachet runs on, so the compiled
// targets are EMU128, SSE4, AVX2 and AVX3 (AVX-512).
#pragma once

#ifndef HWY_DISABLED_TARGETS
#define HWY_DISABLED_TARGETS (HWY_SSSE3 | HWY_AVX3_DL)
#endif
