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

// The work the emulated kernels counted since the last reset, per kernel (cuda/kernel_common.cuh).
struct KernelCount {
  std::string kernel;
  int64_t ctas, mma, fma, load_bytes, store_bytes;
};
std::vector<KernelCount> kernel_counts();
void reset_kernel_counts();

}  // namespace emu_host
}  // namespace dynadiag
