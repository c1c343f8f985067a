// What more than one kernel uses on x86: which vector paths this CPU takes, and the AVX-512 exponential of
// non-positive arguments (attention.cpp's softmax, kda.cpp's decayed scores). Included inside each source's
// own #if for x86 code.
#pragma once

#include <immintrin.h>

#include <cstdlib>
#include <cstring>

namespace hz {

// Whether the AVX-512 paths run (F and BW), asked once per process. HORIZON_AVX512=0 sends every kernel to its
// AVX2 or portable path as if the CPU lacked AVX-512 (AMX included): to compare the paths, and to test the
// AVX2 ones on an AVX-512 machine.
inline bool cpu_has_avx512() {
  static const bool has = [] {
    const char* env = std::getenv("HORIZON_AVX512");
    if (env != nullptr && std::strcmp(env, "0") == 0) return false;
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  }();
  return has;
}

// AVX2 with FMA (every x86-64 server core since Haswell and Zen 1): the kernels' 8-lane paths.
inline bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}

// exp(x) for x <= 0, relative error ~2e-7: Cody-Waite reduction by ln 2 and a degree-6 polynomial (Cephes'
// expf); below -87 it returns ~1e-38 instead of underflowing (callers zero the lanes they do not want, or
// multiply such values into nothing).
__attribute__((target("avx512f"))) inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(y, n);
}

}  // namespace hz
