// The portable family's block diagonals: block_kernels_body.h over plain arrays with the AVX-512
// family's tiling (16 lanes, 32 registers), so that tiling is tested on CPUs without AVX-512, and
// few_rows_body.h's block loops over 8 lanes. A file of their own: CMakeLists.txt compiles it at
// -O2, the element kernels (kernels_portable.cc) at -O3.
#include <algorithm>
#include <cstdint>

#include "kernel_table.h"

namespace dynadiag {
namespace {

#define DYNADIAG_TARGET
#include "block_kernels_body.h"
#include "few_rows_body.h"
#include "portable_lanes.h"

}  // namespace

const BlockKernels& PortableBlockKernels() {
  static const BlockKernels kernels = BlockKernelsOf<Lanes<16>, Lanes<8>>();
  return kernels;
}

}  // namespace dynadiag
