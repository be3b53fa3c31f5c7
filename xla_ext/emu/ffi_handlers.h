// Symbols of the emulated CUDA targets, for the nanobind module (which must not see the kernels).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "xla/ffi/api/c_api.h"

extern "C" {
XLA_FFI_Error* DynadiagEmuFwd(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* DynadiagEmuDx(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* DynadiagEmuDvalues(XLA_FFI_CallFrame* call_frame);
}

namespace dynadiag {
namespace emu_host {

// Workspace the handlers need ("fwd", "dx" or "dvalues"); the plan the Python mirror must match.
size_t workspace_bytes(const std::string& op, int64_t rows, int64_t in_features, int64_t out_features,
                       int64_t num_diagonals, bool tensor_cores, int64_t block_size);

// The work the emulated kernels counted since the last reset, per kernel (cuda/kernel_common.cuh).
struct KernelCount {
  std::string kernel;
  int64_t ctas, mma, fma, load_bytes, store_bytes;
};
std::vector<KernelCount> kernel_counts();
void reset_kernel_counts();

}  // namespace emu_host
}  // namespace dynadiag
