// What more than one kernel uses on x86: which vector paths this CPU takes, and the AVX-512 and AVX2 exponentials
// of non-positive arguments (attention.cpp's softmax, kda.cpp's decayed scores). Included inside each source's
// own #if for x86 code.
#pragma once

#include <immintrin.h>

#include <cstdint>
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

// The AVX2 paths' horizontal sum of 8 lanes, in one order everywhere: the halves, then pairs, then the last two.
__attribute__((target("avx2,fma"))) inline float hsum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

// Lanes 0 .. n-1 of 8 all ones, the rest zero (n clamped to [0, 8]): masks for maskload, maskstore, blendv, and.
__attribute__((target("avx2,fma"))) inline __m256i lanes_below(int64_t n) {
  const int k = static_cast<int>(n < 0 ? 0 : n > 8 ? 8 : n);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(k), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// exp(x) for x <= 0, relative error ~2e-7: Cody-Waite reduction by ln 2 and a degree-6 polynomial (Cephes'
// expf); below -87 it returns ~1e-38 instead of underflowing (callers zero the lanes they do not want, or
// multiply such values into nothing).
namespace exp_coef {
constexpr float kMin = -87.0f, kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                            4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
}  // namespace exp_coef

__attribute__((target("avx512f"))) inline __m512 exp_nonpositive(__m512 x) {
  using namespace exp_coef;
  x = _mm512_max_ps(x, _mm512_set1_ps(kMin));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), x);
  __m512 y = _mm512_set1_ps(kPoly[0]);
  for (int i = 1; i < 6; ++i) y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kPoly[i]));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(y, n);
}

// The same on 8 lanes (AVX2 + FMA), the same operations in the same order, so the same bits: 2^n is built in the
// exponent field (n >= -126 after the clamp, so a normal number) and multiplied in, which rounds as scalef does.
__attribute__((target("avx2,fma"))) inline __m256 exp_nonpositive(__m256 x) {
  using namespace exp_coef;
  x = _mm256_max_ps(x, _mm256_set1_ps(kMin));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), x);
  __m256 y = _mm256_set1_ps(kPoly[0]);
  for (int i = 1; i < 6; ++i) y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kPoly[i]));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(pow2));
}

}  // namespace hz
