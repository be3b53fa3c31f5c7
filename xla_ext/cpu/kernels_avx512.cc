// AVX-512 kernels (explicit intrinsics in target("avx512...") functions; chosen at run time).
// Element diagonals: element_kernels_body.h over one zmm per 16-lane tile.
// Block diagonals: block_kernels_body.h over Zmm (16 lanes), with Ymm<32> for 8-column blocks.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "kernel_table.h"

#define DYNADIAG_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma")))

namespace dynadiag {
namespace {

// The element kernels' 16 lanes in one zmm under a mask register; 32 registers hold tiles of 8
// rows, SDDMM groups of kSegmentGroup segments and the backward's x tiles.
struct Elements {
  using Reg = __m512;
  using Mask = __mmask16;
  static constexpr int kRows = 8;
  static constexpr int kGroup = kSegmentGroup;
  static constexpr int kSumChains = 2;

  template <int R>
  struct XTile {
    __m512 v[R];
    DYNADIAG_TARGET void Set(int r, Reg t) { v[r] = t; }
    DYNADIAG_TARGET Reg Get(int r) const { return v[r]; }
  };

  DYNADIAG_TARGET static Reg Zero() { return _mm512_setzero_ps(); }
  DYNADIAG_TARGET static Reg Fma(Reg a, Reg b, Reg c) { return _mm512_fmadd_ps(a, b, c); }
  DYNADIAG_TARGET static Reg Add(Reg a, Reg b) { return _mm512_add_ps(a, b); }
  DYNADIAG_TARGET static Reg LoadPacked(const float* p) { return _mm512_load_ps(p); }
  DYNADIAG_TARGET static void StorePacked(float* p, Reg v) { _mm512_store_ps(p, v); }

  DYNADIAG_TARGET static Reg Load(const float* p, Mask m) { return _mm512_maskz_loadu_ps(m, p); }

  DYNADIAG_TARGET static Reg Load(const Bf16* p, Mask m) {
    // bfloat16 is the top half of a float32.
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }

  DYNADIAG_TARGET static void Store(float* p, Reg v, Mask m) { _mm512_mask_storeu_ps(p, m, v); }

  DYNADIAG_TARGET static void Store(Bf16* p, Reg v, Mask m) {
    // Round to nearest even, as XLA converts; NaN stays a (quiet) NaN.
    const __m512i u = _mm512_castps_si512(v);
    const __m512i hi = _mm512_srli_epi32(u, 16);
    const __m512i bias = _mm512_add_epi32(_mm512_and_si512(hi, _mm512_set1_epi32(1)),
                                          _mm512_set1_epi32(0x7fff));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, hi, _mm512_set1_epi32(0x40));
    _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(r));
  }
};

#include "vec_ymm.h"
#include "block_kernels_body.h"
#include "few_rows_body.h"

// Sixteen float32 lanes in a zmm register (block_kernels_body.h).
struct Zmm {
  using Reg = __m512;
  using Half = Ymm<32>;
  static constexpr int kWidth = 16;
  static constexpr int kRegisters = 32;

  DYNADIAG_TARGET static Reg Zero() { return _mm512_setzero_ps(); }
  DYNADIAG_TARGET static Reg Load(const float* p) { return _mm512_loadu_ps(p); }
  DYNADIAG_TARGET static Reg Broadcast(const float* p) { return _mm512_set1_ps(*p); }
  DYNADIAG_TARGET static Reg Fma(Reg a, Reg b, Reg c) { return _mm512_fmadd_ps(a, b, c); }
  DYNADIAG_TARGET static void Store(float* p, Reg v) { _mm512_storeu_ps(p, v); }
  DYNADIAG_TARGET static void Store(Bf16* p, Reg v) { Elements::Store(p, v, 0xffff); }
  // p aligned to 64 bytes: a whole cache line written without reading it first.
  DYNADIAG_TARGET static void StoreStream(float* p, Reg v) { _mm512_stream_ps(p, v); }
  DYNADIAG_TARGET static void Fence() { _mm_sfence(); }
};

#include "element_kernels_body.h"

}  // namespace

const Kernels& Avx512Kernels() {
  static const Kernels kernels =
      FamilyKernels<Elements, Ymm<32>, true>("avx512", BlockKernelsOf<Zmm, Ymm<32>>());
  return kernels;
}

}  // namespace dynadiag
