// Portable kernels (plain C++, whatever the baseline target vectorises): the fallback for CPUs
// without AVX2, and the structure the SIMD files follow.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernel_table.h"

namespace dynadiag {
namespace {

constexpr int kRows = 4;
constexpr uint32_t kFull = (1u << kLanes) - 1u;

inline float ToFloat(float v) { return v; }

inline float ToFloat(Bf16 v) {
  const uint32_t bits = uint32_t{v.bits} << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// 16 lanes of p as float32; lanes outside `mask` are 0 and not read.
template <typename T>
inline void Load(const T* p, uint32_t mask, float* v) {
  if (mask == kFull) {
    for (int l = 0; l < kLanes; ++l) v[l] = ToFloat(p[l]);
  } else {
    for (int l = 0; l < kLanes; ++l) v[l] = (mask >> l) & 1u ? ToFloat(p[l]) : 0.0f;
  }
}

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
  };
  return kernels;
}

}  // namespace dynadiag
