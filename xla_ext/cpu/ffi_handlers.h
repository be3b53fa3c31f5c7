// XLA FFI handlers of the CPU targets listed in docs/kernel_abi.md.
#ifndef DYNADIAG_XLA_EXT_CPU_FFI_HANDLERS_H_
#define DYNADIAG_XLA_EXT_CPU_FFI_HANDLERS_H_

#include "xla/ffi/api/c_api.h"

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

#endif  // DYNADIAG_XLA_EXT_CPU_FFI_HANDLERS_H_
