// Portable kernels (plain C++, whatever the baseline target vectorises): the fallback for CPUs
// without AVX2. Element diagonals: element_kernels_body.h over plain arrays; the block diagonals
// are kernels_portable_blocks.cc's (another file for other compile flags).
#include <algorithm>
#include <cstdint>

#include "kernel_table.h"

namespace dynadiag {
namespace {

#define DYNADIAG_TARGET
#include "block_kernels_body.h"
#include "few_rows_body.h"
#include "portable_lanes.h"

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
  static const Kernels kernels =
      FamilyKernels<Elements, Lanes<8>, false>("portable", PortableBlockKernels());
  return kernels;
}

}  // namespace dynadiag
