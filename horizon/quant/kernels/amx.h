// Intel AMX (Sapphire Rapids and later): whether this process may use its tiles, and what every AMX loop here
// shares (rows.cpp's bf16 path, mxfp4.cpp's bf16-activation path): the tile setup and the scatter of C^T tiles
// into rows of out. One tile register holds 16 rows of 64 bytes; `tdpbf16ps`
// multiplies a 16 x 32 bf16 tile A by a 32 x 16 bf16 tile B given as 16 rows of pairs (B[k/2][n][k%2]) and
// adds the fp32 products into a 16 x 16 fp32 tile, each product exact (bf16 x bf16 fits fp32).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__) && defined(__linux__)
#define HZ_HAS_AMX_CODE 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "simd.h"
#define HZ_AMX_TARGET __attribute__((target("avx512f,avx512bw,amx-tile,amx-bf16")))
#else
#define HZ_HAS_AMX_CODE 0
#endif

namespace hz {

#if HZ_HAS_AMX_CODE

// The CPU has AMX-BF16, Linux grants this process the tile state (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA, once per process: without it the first tile instruction faults; oneDNN asks for the
// same permission, and asking twice is harmless), and HORIZON_AMX is not "0" (the AVX-512 paths instead,
// read once per process: for comparisons, and a way around a hypervisor that hides the state it promised).
inline bool amx_usable() {
  static const bool ok = [] {
    const char* env = std::getenv("HORIZON_AMX");
    if (env != nullptr && std::strcmp(env, "0") == 0) return false;
    if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16") || !hz::cpu_has_avx512())
      return false;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// Every tile register 16 rows x 64 bytes (palette 1). Per thread: call once before a loop's tile
// instructions and release after.
struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

HZ_AMX_TARGET inline void tiles_begin() {
  TileConfig cfg{};
  cfg.palette = 1;
  for (int i = 0; i < 8; ++i) {
    cfg.colsb[i] = 64;
    cfg.rows[i] = 16;
  }
  // GCC 12's _tile_loadconfig does not tell the compiler it reads cfg, which then drops the stores above
  // (the first tile instruction raised #UD); the barrier keeps them
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

HZ_AMX_TARGET inline void tiles_end() { _tile_release(); }

// Accumulator tiles of C^T = W x^T, stored to c as nt consecutive [16 weight rows][16 rows of x] blocks, into out:
// column m of each is row rows[m] of out (cnt <= 16 of them), from column n0 on (out has N columns).
inline void scatter_tiles(const float* c, int nt, int64_t cnt, const int64_t* rows, float* out, int64_t N, int64_t n0) {
  for (int64_t m = 0; m < cnt; ++m) {
    float* o = out + rows[m] * N + n0;
    for (int j = 0; j < nt; ++j)
      for (int r = 0; r < 16; ++r) o[16 * j + r] = c[j * 256 + r * 16 + m];
  }
}

#else

inline bool amx_usable() { return false; }

#endif

}  // namespace hz
