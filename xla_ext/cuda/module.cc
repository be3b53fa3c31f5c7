// nanobind module _cuda_ext: the CUDA targets as {target name: capsule}, registered for platform
// "CUDA" under the same names as the CPU targets. Host-compiled; the kernels live in the .cu.
#include <cuda_runtime_api.h>
#include <nanobind/nanobind.h>

#include "xla/ffi/api/c_api.h"

extern "C" {
XLA_FFI_Error* DynadiagCudaFwd(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* DynadiagCudaDx(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* DynadiagCudaDvalues(XLA_FFI_CallFrame* call_frame);
}

namespace nb = nanobind;

NB_MODULE(_cuda_ext, m) {
  m.attr("ffi_api") = nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
  // The CUDA runtime linked in (1000 * major + 10 * minor): JAX's CUDA plugin must be that major.
  m.attr("cuda_runtime_version") = CUDART_VERSION;
  m.def("registrations", [] {
    nb::dict d;
    d["dynadiag_diag_matmul_v2_fwd"] = nb::capsule(reinterpret_cast<void*>(DynadiagCudaFwd));
    d["dynadiag_diag_matmul_v2_dx"] = nb::capsule(reinterpret_cast<void*>(DynadiagCudaDx));
    d["dynadiag_diag_matmul_v2_dvalues"] = nb::capsule(reinterpret_cast<void*>(DynadiagCudaDvalues));
    return d;
  });
}
