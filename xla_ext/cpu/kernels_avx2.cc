// AVX2 + FMA kernels. Element diagonals: element_kernels_body.h with each 16-lane tile as two ymm
// halves and fewer accumulators (16 ymm registers). Block diagonals: block_kernels_body.h over
// Ymm<16>.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "kernel_table.h"

#define DYNADIAG_TARGET __attribute__((target("avx2,fma")))

namespace dynadiag {
namespace {

#include "vec_ymm.h"
#include "block_kernels_body.h"
#include "few_rows_body.h"

using Vec = Ymm<16>;

// The element kernels' 16 lanes as two ymm halves, with fewer accumulators than AVX-512 (16
// registers): tiles of 4 rows, SDDMM groups of 4 segments, and x held in L1 in the backward.
struct Elements {
  struct Reg {
    __m256 lo, hi;
  };
  using Mask = uint32_t;
  static constexpr int kRows = 4;
  static constexpr int kGroup = 4;
  static constexpr int kSumChains = 1;

  template <int R>
  struct XTile {
    alignas(32) float v[R][kLanes];
    DYNADIAG_TARGET void Set(int r, Reg t) {
      _mm256_store_ps(v[r], t.lo);
      _mm256_store_ps(v[r] + 8, t.hi);
    }
    DYNADIAG_TARGET Reg Get(int r) const { return LoadPacked(v[r]); }
  };

  DYNADIAG_TARGET static Reg Zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  DYNADIAG_TARGET static Reg Fma(Reg a, Reg b, Reg c) {
    return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
  }
  DYNADIAG_TARGET static Reg Add(Reg a, Reg b) {
    return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)};
  }
  DYNADIAG_TARGET static Reg LoadPacked(const float* p) {
    return {_mm256_load_ps(p), _mm256_load_ps(p + 8)};
  }
  DYNADIAG_TARGET static void StorePacked(float* p, Reg v) {
    _mm256_store_ps(p, v.lo);
    _mm256_store_ps(p + 8, v.hi);
  }

  // All-ones 32-bit lanes where bit l of `bits` is set (8 lanes).
  DYNADIAG_TARGET static __m256i LaneMask8(uint32_t bits) {
    const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(bits)), sel),
                              sel);
  }

  DYNADIAG_TARGET static Reg Load(const float* p, Mask mask) {
    if (mask == kFullMask) return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
    return {_mm256_maskload_ps(p, LaneMask8(mask & 0xffu)),
            _mm256_maskload_ps(p + 8, LaneMask8(mask >> 8))};
  }

  DYNADIAG_TARGET static Reg Load(const Bf16* p, Mask mask) {
    alignas(32) uint16_t tmp[kLanes];
    const void* src = p;
    if (mask != kFullMask) {  // no 16-bit masked load in AVX2: copy the valid lanes
      for (int l = 0; l < kLanes; ++l) tmp[l] = (mask >> l) & 1u ? p[l].bits : 0;
      src = tmp;
    }
    const __m256i h = _mm256_loadu_si256(static_cast<const __m256i*>(src));
    return {Widen(_mm256_castsi256_si128(h)), Widen(_mm256_extracti128_si256(h, 1))};
  }

  DYNADIAG_TARGET static __m256 Widen(__m128i h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }

  DYNADIAG_TARGET static void Store(float* p, Reg v, Mask mask) {
    if (mask == kFullMask) {
      _mm256_storeu_ps(p, v.lo);
      _mm256_storeu_ps(p + 8, v.hi);
    } else {
      _mm256_maskstore_ps(p, LaneMask8(mask & 0xffu), v.lo);
      _mm256_maskstore_ps(p + 8, LaneMask8(mask >> 8), v.hi);
    }
  }

  DYNADIAG_TARGET static void Store(Bf16* p, Reg v, Mask mask) {
    // packus interleaves 128-bit halves; the permute restores lane order.
    const __m256i h = _mm256_permute4x64_epi64(
        _mm256_packus_epi32(RoundToBf16(v.lo), RoundToBf16(v.hi)), 0xd8);
    if (mask == kFullMask) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
      return;
    }
    alignas(32) uint16_t tmp[kLanes];
    _mm256_store_si256(reinterpret_cast<__m256i*>(tmp), h);
    for (int l = 0; l < kLanes; ++l) {
      if ((mask >> l) & 1u) p[l].bits = tmp[l];
    }
  }
};

#include "element_kernels_body.h"

}  // namespace

const Kernels& Avx2Kernels() {
  static const Kernels kernels =
      FamilyKernels<Elements, Vec, true>("avx2", BlockKernelsOf<Vec, Vec>());
  return kernels;
}

}  // namespace dynadiag
