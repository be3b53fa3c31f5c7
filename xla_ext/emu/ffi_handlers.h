// Symbols of the emulated CUDA targets, for the nanobind module (which must not see the kernels).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

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
                       int64_t num_diagonals, bool tensor_cores);

}  // namespace emu_host
}  // namespace dynadiag
