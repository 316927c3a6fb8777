// The AVX-512 VNNI kernels (quant_int8.cc, attention_int8.cc) are written with intrinsics and a
// target attribute: Debian 12's Highway 1.0.3 has no int8 dot-product op and its AVX3_DL target
// does not enable avx512vnni. They run only where HasInt8Kernels() says the CPU has the features.
#pragma once

// GCC 12 reports the _mm512_undefined_* placeholders inside its own AVX-512 intrinsics as
// uninitialized (a false positive fixed in later GCCs).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#define CACHET_INT8_TARGET \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq,avx512vnni")))
