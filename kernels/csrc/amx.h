// AMX tiles, shared by the kernels that use them (linear_amx.cpp, attention_decode_amx.cpp,
// peak.cpp): whether the compiler takes them (QN_AMX_TILES), the function attribute they are
// compiled with, the palette-1 configuration ldtilecfg reads, and Linux's grant of the tile state
// to the process (asked for once; a CPU without the tiles is refused it).
#pragma once
#if defined(__linux__) && ((defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11) || \
                           (defined(__clang__) && __clang_major__ >= 12))
#define QN_AMX_TILES 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cstdint>

#define QN_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

namespace qwen_npu_cpu {
namespace amx {

struct TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles 0 .. count - 1 as 16 rows of 64 bytes each (palette 1), for the calling thread.
QN_AMX inline void load_full_tiles(int count) {
  TileConfig cfg{};
  cfg.palette = 1;
  for (int t = 0; t < count; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

inline bool granted() {
  static const bool yes = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return yes;
}

}  // namespace amx
}  // namespace qwen_npu_cpu
#endif
