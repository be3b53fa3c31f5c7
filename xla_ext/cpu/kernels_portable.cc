// Portable kernels (plain C++, whatever the baseline target vectorises): the fallback for CPUs
// without AVX2, and the structure the SIMD files follow. Block diagonals: block_kernels_body.h
// over plain arrays with the AVX-512 family's tiling (16 lanes, 32 registers), so that tiling is
// tested on CPUs without AVX-512.
#include <algorithm>
#include <cstdint>

#include "kernel_table.h"

namespace dynadiag {
namespace {

constexpr int kRows = 4;
constexpr uint32_t kFull = (1u << kLanes) - 1u;

// 16 lanes of p as float32; lanes outside `mask` are 0 and not read.
template <typename T>
inline void Load(const T* p, uint32_t mask, float* v) {
  if (mask == kFull) {
    for (int l = 0; l < kLanes; ++l) v[l] = ToFloat(p[l]);
  } else {
    for (int l = 0; l < kLanes; ++l) v[l] = (mask >> l) & 1u ? ToFloat(p[l]) : 0.0f;
  }
}

#define DYNADIAG_TARGET
#include "block_kernels_body.h"
#include "few_rows_body.h"

// W float32 lanes in a plain array; kRegisters only sizes the tiles (as the AVX-512 family's).
template <int W>
struct Lanes {
  struct Reg {
    float v[W];
  };
  using Half = Lanes<W / 2>;
  static constexpr int kWidth = W;
  static constexpr int kRegisters = 32;

  static Reg Zero() { return Reg{}; }
  template <typename T>
  static Reg Load(const T* p) {
    Reg r;
    for (int l = 0; l < W; ++l) r.v[l] = ToFloat(p[l]);
    return r;
  }
  static Reg Add(Reg a, const Reg& b) {
    for (int l = 0; l < W; ++l) a.v[l] += b.v[l];
    return a;
  }
  // Lane i: the sum of the lanes of acc[i].
  static Reg SumLanes(const Reg* acc) {
    Reg r{};
    for (int i = 0; i < W; ++i) {
      for (int l = 0; l < W; ++l) r.v[i] += acc[i].v[l];
    }
    return r;
  }
  static Reg Broadcast(const float* p) {
    Reg r;
    for (int l = 0; l < W; ++l) r.v[l] = *p;
    return r;
  }
  static Reg Fma(const Reg& a, const Reg& b, Reg c) {
    for (int l = 0; l < W; ++l) c.v[l] += a.v[l] * b.v[l];
    return c;
  }
  static void Store(float* p, const Reg& v) {
    for (int l = 0; l < W; ++l) p[l] = v.v[l];
  }
  static void Store(Bf16* p, const Reg& v) {
    for (int l = 0; l < W; ++l) FromFloat(v.v[l], p + l);
  }
};

using Vec = Lanes<16>;

template <typename T>
void Pack(const PlanView& plan, const T* values, float* vp) {
  for (int64_t s = 0; s < plan.num_segs; ++s) {
    Load(values + plan.segs[s].vbase, plan.segs[s].mask, vp + s * kLanes);
  }
}

template <int R, typename T>
void ProductRows(const PlanView& plan, const float* vp, const T* in, int64_t in_width, T* out,
                 int64_t out_width) {
  for (int64_t tile = 0; tile < plan.num_tiles; ++tile) {
    float acc[R][kLanes] = {};
    float x[kLanes];
    for (int64_t s = plan.tile_begin[tile]; s < plan.tile_begin[tile + 1]; ++s) {
      const float* v = vp + s * kLanes;
      for (int r = 0; r < R; ++r) {
        Load(in + r * in_width + plan.segs[s].c0, plan.segs[s].mask, x);
        for (int l = 0; l < kLanes; ++l) acc[r][l] += v[l] * x[l];
      }
    }
    const int64_t o0 = tile * kLanes;
    const int64_t n = std::min<int64_t>(kLanes, out_width - o0);
    for (int r = 0; r < R; ++r) {
      for (int64_t l = 0; l < n; ++l) FromFloat(acc[r][l], out + r * out_width + o0 + l);
    }
  }
}

template <typename T>
void Product(const PlanView& plan, const float* vp, const T* in, int64_t in_width, T* out,
             int64_t out_width, int64_t rows) {
  int64_t r = 0;
  for (; r + kRows <= rows; r += kRows) {
    ProductRows<kRows>(plan, vp, in + r * in_width, in_width, out + r * out_width, out_width);
  }
  for (; r < rows; ++r) {
    ProductRows<1>(plan, vp, in + r * in_width, in_width, out + r * out_width, out_width);
  }
}

template <typename T>
void Sddmm(const PlanView& plan, const T* tiled, int64_t tiled_width, const T* gathered,
           int64_t gathered_width, int64_t rows, float* acc) {
  float f[kLanes], g[kLanes];
  for (int64_t tile = 0; tile < plan.num_tiles; ++tile) {
    const int64_t t0 = tile * kLanes;
    const int64_t n = std::min<int64_t>(kLanes, tiled_width - t0);
    const uint32_t tm = (1u << n) - 1u;
    for (int64_t r = 0; r < rows; ++r) {
      Load(tiled + r * tiled_width + t0, tm, f);
      for (int64_t s = plan.tile_begin[tile]; s < plan.tile_begin[tile + 1]; ++s) {
        if (plan.segs[s].mask == 0) continue;
        Load(gathered + r * gathered_width + plan.segs[s].c0, plan.segs[s].mask, g);
        float* a = acc + s * kLanes;
        for (int l = 0; l < kLanes; ++l) a[l] += f[l] * g[l];
      }
    }
  }
}

}  // namespace

const Kernels& PortableKernels() {
  static const Kernels kernels{
      "portable",
      {Pack<float>, Product<float>, Sddmm<float>, nullptr},
      {Pack<Bf16>, Product<Bf16>, Sddmm<Bf16>, nullptr},
      kBlockTableF32<Vec>,
      kBlockTableBf16<Vec>,
      BlockSddmm<Vec>,
      kFewRowTable<Lanes<8>, float>,
      kFewRowTable<Lanes<8>, Bf16>,
  };
  return kernels;
}

}  // namespace dynadiag
