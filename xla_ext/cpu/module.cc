// The `_cpu_ext` Python module: registrations() -> {target name: FFI handler capsule}.
#include <nanobind/nanobind.h>

#include "diag_kernels.h"
#include "ffi_handlers.h"

namespace nb = nanobind;

namespace {

template <typename Fn>
nb::capsule Capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_cpu_ext, m) {
  m.def("registrations", [] {
    nb::dict d;
    d["dynadiag_diag_matmul_fwd"] = Capsule(DynadiagDiagMatmulFwdCpu);
    d["dynadiag_diag_matmul_dx"] = Capsule(DynadiagDiagMatmulDxCpu);
    d["dynadiag_diag_matmul_dvalues"] = Capsule(DynadiagDiagMatmulDvaluesCpu);
    return d;
  });
  m.def("kernel_isa", [] { return dynadiag::IsaName(dynadiag::BestIsa()); },
        "The kernel family the handlers use on this CPU: 'avx512', 'avx2' or 'portable'.");
}
