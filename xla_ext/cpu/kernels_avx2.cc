// AVX2 + FMA kernels. Element diagonals: the AVX-512 kernels' structure with each 16-lane tile as
// two ymm halves and fewer accumulators (16 ymm registers). Block diagonals: block_kernels_body.h
// over Ymm<16>.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernel_table.h"

#define DYNADIAG_TARGET __attribute__((target("avx2,fma")))

namespace dynadiag {
namespace {

#include "vec_ymm.h"
#include "block_kernels_body.h"
#include "few_rows_body.h"

using Vec = Ymm<16>;

constexpr int kRows = 4;   // product and backward: rows of accumulators per tile
constexpr int kGroup = 4;  // SDDMM: segments accumulated together
static_assert(kSegmentGroup % kGroup == 0, "plans are padded to groups of kSegmentGroup");

constexpr uint32_t kFull = (1u << kLanes) - 1u;

struct V16 {
  __m256 lo, hi;
};

DYNADIAG_TARGET inline V16 Zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }

DYNADIAG_TARGET inline V16 Fma(V16 a, V16 b, V16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}

// All-ones 32-bit lanes where bit l of `bits` is set (8 lanes).
DYNADIAG_TARGET inline __m256i LaneMask8(uint32_t bits) {
  const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(bits)), sel), sel);
}

// 16 elements from p as float32; lanes outside `mask` read nothing and give 0.
DYNADIAG_TARGET inline V16 Load(const float* p, uint32_t mask) {
  if (mask == kFull) return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
  return {_mm256_maskload_ps(p, LaneMask8(mask & 0xffu)),
          _mm256_maskload_ps(p + 8, LaneMask8(mask >> 8))};
}

DYNADIAG_TARGET inline __m256 Widen(__m128i h) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

DYNADIAG_TARGET inline V16 Load(const Bf16* p, uint32_t mask) {
  alignas(32) uint16_t tmp[kLanes];
  const void* src = p;
  if (mask != kFull) {  // no 16-bit masked load in AVX2: copy the valid lanes
    for (int l = 0; l < kLanes; ++l) tmp[l] = (mask >> l) & 1u ? p[l].bits : 0;
    src = tmp;
  }
  const __m256i h = _mm256_loadu_si256(static_cast<const __m256i*>(src));
  return {Widen(_mm256_castsi256_si128(h)), Widen(_mm256_extracti128_si256(h, 1))};
}

DYNADIAG_TARGET inline void Store(float* p, V16 v, uint32_t mask) {
  if (mask == kFull) {
    _mm256_storeu_ps(p, v.lo);
    _mm256_storeu_ps(p + 8, v.hi);
  } else {
    _mm256_maskstore_ps(p, LaneMask8(mask & 0xffu), v.lo);
    _mm256_maskstore_ps(p + 8, LaneMask8(mask >> 8), v.hi);
  }
}

DYNADIAG_TARGET inline void Store(Bf16* p, V16 v, uint32_t mask) {
  // packus interleaves 128-bit halves; the permute restores lane order.
  const __m256i h = _mm256_permute4x64_epi64(
      _mm256_packus_epi32(RoundToBf16(v.lo), RoundToBf16(v.hi)), 0xd8);
  if (mask == kFull) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
    return;
  }
  alignas(32) uint16_t tmp[kLanes];
  _mm256_store_si256(reinterpret_cast<__m256i*>(tmp), h);
  for (int l = 0; l < kLanes; ++l) {
    if ((mask >> l) & 1u) p[l].bits = tmp[l];
  }
}

DYNADIAG_TARGET inline uint32_t TileMask(int64_t width, int64_t first) {
  const int64_t n = std::min<int64_t>(kLanes, width - first);
  return (1u << n) - 1u;
}

template <typename T>
DYNADIAG_TARGET void Pack(const PlanView& plan, const T* values, float* vp) {
  for (int64_t s = 0; s < plan.num_segs; ++s) {
    const Segment& seg = plan.segs[s];
    const V16 v = Load(values + seg.vbase, seg.mask);
    _mm256_store_ps(vp + s * kLanes, v.lo);
    _mm256_store_ps(vp + s * kLanes + 8, v.hi);
  }
}

template <int R, typename T>
DYNADIAG_TARGET void ProductRows(const PlanView& plan, const float* vp, const T* in,
                               int64_t in_width, T* out, int64_t out_width) {
  for (int64_t tile = 0; tile < plan.num_tiles; ++tile) {
    V16 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = Zero();
    const int64_t end = plan.tile_begin[tile + 1];
    for (int64_t s = plan.tile_begin[tile]; s < end; ++s) {
      const V16 v = {_mm256_load_ps(vp + s * kLanes), _mm256_load_ps(vp + s * kLanes + 8)};
      const uint32_t m = plan.segs[s].mask;
      const T* src = in + plan.segs[s].c0;
      for (int r = 0; r < R; ++r) acc[r] = Fma(v, Load(src + r * in_width, m), acc[r]);
    }
    const int64_t o0 = tile * kLanes;
    const uint32_t om = TileMask(out_width, o0);
    for (int r = 0; r < R; ++r) Store(out + r * out_width + o0, acc[r], om);
  }
}

template <typename T>
DYNADIAG_TARGET void Product(const PlanView& plan, const float* vp, const T* in, int64_t in_width,
                           T* out, int64_t out_width, int64_t rows) {
  int64_t r = 0;
  for (; r + kRows <= rows; r += kRows) {
    ProductRows<kRows>(plan, vp, in + r * in_width, in_width, out + r * out_width, out_width);
  }
  for (; r < rows; ++r) {
    ProductRows<1>(plan, vp, in + r * in_width, in_width, out + r * out_width, out_width);
  }
}

template <typename T>
DYNADIAG_TARGET void Sddmm(const PlanView& plan, const T* tiled, int64_t tiled_width,
                         const T* gathered, int64_t gathered_width, int64_t rows, float* acc) {
  constexpr int G = kGroup;
  for (int64_t tile = 0; tile < plan.num_tiles; ++tile) {
    const int64_t t0 = tile * kLanes;
    const uint32_t tm = TileMask(tiled_width, t0);
    const int64_t end = plan.tile_begin[tile + 1];
    for (int64_t s = plan.tile_begin[tile]; s < end; s += G) {
      V16 a[G];
      const T* src[G];
      uint32_t m[G];
      for (int g = 0; g < G; ++g) {
        a[g] = {_mm256_load_ps(acc + (s + g) * kLanes), _mm256_load_ps(acc + (s + g) * kLanes + 8)};
        src[g] = gathered + plan.segs[s + g].c0;
        m[g] = plan.segs[s + g].mask;
      }
      for (int64_t r = 0; r < rows; ++r) {
        const V16 f = Load(tiled + r * tiled_width + t0, tm);
        for (int g = 0; g < G; ++g) a[g] = Fma(f, Load(src[g] + r * gathered_width, m[g]), a[g]);
      }
      for (int g = 0; g < G; ++g) {
        _mm256_store_ps(acc + (s + g) * kLanes, a[g].lo);
        _mm256_store_ps(acc + (s + g) * kLanes + 8, a[g].hi);
      }
    }
  }
}

// The fused backward with R rows: per tile, R dx accumulators in registers and R tiles of x in
// L1 (16 ymm registers cannot hold both); each dy window feeds both FMAs.
template <int R, typename T>
DYNADIAG_TARGET void BackwardRows(const PlanView& plan, int64_t tile_begin, int64_t tile_end,
                                const float* vp, const T* dy, int64_t dy_width, const T* x, T* dx,
                                int64_t width, float* acc) {
  for (int64_t tile = tile_begin; tile < tile_end; ++tile) {
    const int64_t o0 = tile * kLanes;
    const uint32_t tm = TileMask(width, o0);
    V16 out[R];
    alignas(32) float xt[R][kLanes];
    for (int r = 0; r < R; ++r) {
      const V16 t = Load(x + r * width + o0, tm);
      _mm256_store_ps(xt[r], t.lo);
      _mm256_store_ps(xt[r] + 8, t.hi);
      out[r] = Zero();
    }
    for (int64_t s = plan.tile_begin[tile]; s < plan.tile_begin[tile + 1]; ++s) {
      const V16 v = {_mm256_load_ps(vp + s * kLanes), _mm256_load_ps(vp + s * kLanes + 8)};
      const uint32_t m = plan.segs[s].mask;
      const T* src = dy + plan.segs[s].c0;
      V16 a = {_mm256_load_ps(acc + s * kLanes), _mm256_load_ps(acc + s * kLanes + 8)};
      for (int r = 0; r < R; ++r) {
        const V16 w = Load(src + r * dy_width, m);
        out[r] = Fma(v, w, out[r]);
        a = Fma(V16{_mm256_load_ps(xt[r]), _mm256_load_ps(xt[r] + 8)}, w, a);
      }
      _mm256_store_ps(acc + s * kLanes, a.lo);
      _mm256_store_ps(acc + s * kLanes + 8, a.hi);
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
    BackwardRows<kRows>(plan, tile_begin, tile_end, vp, dy + r * dy_width, dy_width, x + r * width,
                    dx + r * width, width, acc);
  }
  for (; r < rows; ++r) {
    BackwardRows<1>(plan, tile_begin, tile_end, vp, dy + r * dy_width, dy_width, x + r * width,
                    dx + r * width, width, acc);
  }
}

}  // namespace

const Kernels& Avx2Kernels() {
  static const Kernels kernels{
      "avx2",
      {Pack<float>, Product<float>, Sddmm<float>, Backward<float>},
      {Pack<Bf16>, Product<Bf16>, Sddmm<Bf16>, Backward<Bf16>},
      kBlockTableF32<Vec>,
      kBlockTableBf16<Vec>,
      BlockSddmm<Vec>,
      kFewRowTable<Vec, float>,
      kFewRowTable<Vec, Bf16>,
  };
  return kernels;
}

}  // namespace dynadiag
