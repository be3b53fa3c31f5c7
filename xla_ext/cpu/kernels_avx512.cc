// AVX-512 kernels (explicit intrinsics in target("avx512...") functions; chosen at run time).
// Block diagonals: block_kernels_body.h over Zmm (16 lanes), with Ymm<32> for 8-column blocks.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "kernel_table.h"

#define DYNADIAG_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma")))

namespace dynadiag {
namespace {

constexpr int kRows = 8;  // product and fused backward: rows of accumulators per tile

DYNADIAG_TARGET inline __mmask16 TileMask(int64_t width, int64_t first) {
  const int64_t n = std::min<int64_t>(kLanes, width - first);
  return static_cast<__mmask16>((1u << n) - 1u);
}

// 16 elements from p (lanes outside m read nothing and give 0) as float32.
DYNADIAG_TARGET inline __m512 Load(const float* p, __mmask16 m) {
  return _mm512_maskz_loadu_ps(m, p);
}

DYNADIAG_TARGET inline __m512 Load(const Bf16* p, __mmask16 m) {
  // bfloat16 is the top half of a float32.
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

DYNADIAG_TARGET inline void Store(float* p, __m512 v, __mmask16 m) {
  _mm512_mask_storeu_ps(p, m, v);
}

DYNADIAG_TARGET inline void Store(Bf16* p, __m512 v, __mmask16 m) {
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
  DYNADIAG_TARGET static void Store(Bf16* p, Reg v) { dynadiag::Store(p, v, 0xffff); }
};

template <typename T>
DYNADIAG_TARGET void Pack(const PlanView& plan, const T* values, float* vp) {
  for (int64_t s = 0; s < plan.num_segs; ++s) {
    const Segment& seg = plan.segs[s];
    _mm512_store_ps(vp + s * kLanes, Load(values + seg.vbase, static_cast<__mmask16>(seg.mask)));
  }
}

// R rows: every tile keeps R accumulators in registers; a segment's packed values are loaded
// once and reused for the R rows, so each FMA costs one (unaligned) load of `in`.
template <int R, typename T>
DYNADIAG_TARGET void ProductRows(const PlanView& plan, const float* vp, const T* in,
                                 int64_t in_width, T* out, int64_t out_width) {
  const Segment* segs = plan.segs;
  for (int64_t tile = 0; tile < plan.num_tiles; ++tile) {
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    const int64_t end = plan.tile_begin[tile + 1];
    for (int64_t s = plan.tile_begin[tile]; s < end; ++s) {
      const __m512 v = _mm512_load_ps(vp + s * kLanes);
      const __mmask16 m = static_cast<__mmask16>(segs[s].mask);
      const T* src = in + segs[s].c0;
      for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(v, Load(src + r * in_width, m), acc[r]);
    }
    const int64_t o0 = tile * kLanes;
    const __mmask16 om = TileMask(out_width, o0);
    for (int r = 0; r < R; ++r) Store(out + r * out_width + o0, acc[r], om);
  }
}

template <typename T>
DYNADIAG_TARGET void Product(const PlanView& plan, const float* vp, const T* in,
                             int64_t in_width, T* out, int64_t out_width, int64_t rows) {
  int64_t r = 0;
  for (; r + kRows <= rows; r += kRows) {
    ProductRows<kRows>(plan, vp, in + r * in_width, in_width, out + r * out_width, out_width);
  }
  for (; r + 4 <= rows; r += 4) {
    ProductRows<4>(plan, vp, in + r * in_width, in_width, out + r * out_width, out_width);
  }
  for (; r < rows; ++r) {
    ProductRows<1>(plan, vp, in + r * in_width, in_width, out + r * out_width, out_width);
  }
}

// Groups of kSegmentGroup segments of one tile share each load of `tiled`; their partial sums
// stay in registers for all `rows` rows.
template <typename T>
DYNADIAG_TARGET void Sddmm(const PlanView& plan, const T* tiled, int64_t tiled_width,
                           const T* gathered, int64_t gathered_width, int64_t rows, float* acc) {
  constexpr int G = kSegmentGroup;
  const Segment* segs = plan.segs;
  for (int64_t tile = 0; tile < plan.num_tiles; ++tile) {
    const int64_t t0 = tile * kLanes;
    const __mmask16 tm = TileMask(tiled_width, t0);
    const int64_t end = plan.tile_begin[tile + 1];
    for (int64_t s = plan.tile_begin[tile]; s < end; s += G) {
      __m512 a[G];
      const T* src[G];
      __mmask16 m[G];
      for (int g = 0; g < G; ++g) {
        a[g] = _mm512_load_ps(acc + (s + g) * kLanes);
        src[g] = gathered + segs[s + g].c0;
        m[g] = static_cast<__mmask16>(segs[s + g].mask);
      }
      for (int64_t r = 0; r < rows; ++r) {
        const __m512 f = Load(tiled + r * tiled_width + t0, tm);
        for (int g = 0; g < G; ++g) {
          a[g] = _mm512_fmadd_ps(f, Load(src[g] + r * gathered_width, m[g]), a[g]);
        }
      }
      for (int g = 0; g < G; ++g) _mm512_store_ps(acc + (s + g) * kLanes, a[g]);
    }
  }
}

// R rows of the fused backward: per tile, R dx accumulators and R tiles of x stay in registers;
// each segment loads its dy window once per row and feeds both FMAs.
template <int R, typename T>
DYNADIAG_TARGET void BackwardRows(const PlanView& plan, int64_t tile_begin, int64_t tile_end,
                                  const float* vp, const T* dy, int64_t dy_width, const T* x,
                                  T* dx, int64_t width, float* acc) {
  const Segment* segs = plan.segs;
  for (int64_t tile = tile_begin; tile < tile_end; ++tile) {
    const int64_t o0 = tile * kLanes;
    const __mmask16 tm = TileMask(width, o0);
    __m512 xt[R], out[R];
    for (int r = 0; r < R; ++r) {
      xt[r] = Load(x + r * width + o0, tm);
      out[r] = _mm512_setzero_ps();
    }
    const int64_t end = plan.tile_begin[tile + 1];
    for (int64_t s = plan.tile_begin[tile]; s < end; ++s) {
      const __m512 v = _mm512_load_ps(vp + s * kLanes);
      const __mmask16 m = static_cast<__mmask16>(segs[s].mask);
      const T* src = dy + segs[s].c0;
      // Two partial sums halve the dependency chain through acc[s].
      __m512 a0 = _mm512_load_ps(acc + s * kLanes), a1 = _mm512_setzero_ps();
      for (int r = 0; r < R; ++r) {
        const __m512 w = Load(src + r * dy_width, m);
        out[r] = _mm512_fmadd_ps(v, w, out[r]);
        if (r % 2 == 0) {
          a0 = _mm512_fmadd_ps(xt[r], w, a0);
        } else {
          a1 = _mm512_fmadd_ps(xt[r], w, a1);
        }
      }
      _mm512_store_ps(acc + s * kLanes, _mm512_add_ps(a0, a1));
    }
    for (int r = 0; r < R; ++r) Store(dx + r * width + o0, out[r], tm);
  }
}

template <typename T>
DYNADIAG_TARGET void Backward(const PlanView& plan, int64_t tile_begin, int64_t tile_end,
                              const float* vp, const T* dy, int64_t dy_width, const T* x, T* dx,
                              int64_t width, int64_t rows, float* acc) {
  int64_t r = 0;
  for (; r + kRows <= rows; r += kRows) {
    BackwardRows<kRows>(plan, tile_begin, tile_end, vp, dy + r * dy_width, dy_width,
                        x + r * width, dx + r * width, width, acc);
  }
  for (; r + 4 <= rows; r += 4) {
    BackwardRows<4>(plan, tile_begin, tile_end, vp, dy + r * dy_width, dy_width, x + r * width,
                    dx + r * width, width, acc);
  }
  for (; r < rows; ++r) {
    BackwardRows<1>(plan, tile_begin, tile_end, vp, dy + r * dy_width, dy_width, x + r * width,
                    dx + r * width, width, acc);
  }
}

}  // namespace

const Kernels& Avx512Kernels() {
  static const Kernels kernels{
      "avx512",
      {Pack<float>, Product<float>, Sddmm<float>, Backward<float>},
      {Pack<Bf16>, Product<Bf16>, Sddmm<Bf16>, Backward<Bf16>},
      kBlockTableF32<Zmm>,
      kBlockTableBf16<Zmm>,
      BlockSddmm<Zmm>,
      kFewRowTable<Ymm<32>, float>,
      kFewRowTable<Ymm<32>, Bf16>,
  };
  return kernels;
}

}  // namespace dynadiag
