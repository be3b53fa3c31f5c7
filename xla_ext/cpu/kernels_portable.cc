// Portable kernels (plain C++, whatever the baseline target vectorises): the fallback for CPUs
// without AVX2. Element diagonals: element_kernels_body.h over plain arrays. Block diagonals:
// block_kernels_body.h over plain arrays with the AVX-512 family's tiling (16 lanes, 32
// registers), so that tiling is tested on CPUs without AVX-512.
#include <algorithm>
#include <cstdint>

#include "kernel_table.h"

namespace dynadiag {
namespace {

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
  static void StoreStream(float* p, const Reg& v) { Store(p, v); }
  static void Fence() {}
};

using Vec = Lanes<16>;

// The element kernels over Lanes<16> under a bit mask, with the AVX2 family's tiles of 4 rows and
// SDDMM groups of 4 segments, and no fused backward.
struct Elements : Lanes<kLanes> {
  using Mask = uint32_t;
  static constexpr int kRows = 4;
  static constexpr int kGroup = 4;

  template <typename T>
  static Reg Load(const T* p, Mask mask) {
    Reg r;
    if (mask == kFullMask) {
      for (int l = 0; l < kLanes; ++l) r.v[l] = ToFloat(p[l]);
    } else {
      for (int l = 0; l < kLanes; ++l) r.v[l] = (mask >> l) & 1u ? ToFloat(p[l]) : 0.0f;
    }
    return r;
  }
  template <typename T>
  static void Store(T* p, const Reg& v, Mask mask) {
    for (int l = 0; l < kLanes; ++l) {
      if ((mask >> l) & 1u) FromFloat(v.v[l], p + l);
    }
  }
  static Reg LoadPacked(const float* p) { return Lanes::Load(p); }
  static void StorePacked(float* p, const Reg& v) { Lanes::Store(p, v); }
};

#include "element_kernels_body.h"

}  // namespace

const Kernels& PortableKernels() {
  static const Kernels kernels = FamilyKernels<Elements, Vec, Lanes<8>, false>("portable");
  return kernels;
}

}  // namespace dynadiag
