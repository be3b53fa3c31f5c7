// XLA FFI handlers of the CPU targets listed in docs/kernel_abi.md.
#ifndef DYNADIAG_XLA_EXT_CPU_FFI_HANDLERS_H_
#define DYNADIAG_XLA_EXT_CPU_FFI_HANDLERS_H_

#include <string>

#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"

extern "C" {
XLA_FFI_Error* DynadiagDiagMatmulFwdCpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* DynadiagDiagMatmulDxCpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* DynadiagDiagMatmulDvaluesCpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* DynadiagDiagMatmulBwdCpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* DynadiagDiagMatmulPermutedFwdCpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* DynadiagDiagMatmulPermutedDxCpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* DynadiagDiagMatmulPermutedDvaluesCpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* DynadiagDiagMatmulPermutedBwdCpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* DynadiagGateRankCpu(XLA_FFI_CallFrame* call_frame);
}

namespace dynadiag {

// "[d0, d1, ...]": how the handlers' messages write a shape.
std::string ShapeString(xla::ffi::AnyBuffer::Dimensions dims);

}  // namespace dynadiag

#endif  // DYNADIAG_XLA_EXT_CPU_FFI_HANDLERS_H_
