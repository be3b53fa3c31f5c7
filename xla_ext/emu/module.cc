// nanobind module _emu_ext: the emulated CUDA targets as {target name: capsule}, for the CPU
// platform, plus the kernels' work counters (tests compare them with dynadiag_jax/gpu_cost.py).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "emu/ffi_handlers.h"
#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

NB_MODULE(_emu_ext, m) {
  m.attr("ffi_api") = nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
  m.def("registrations", [] {
    nb::dict d;
    d["dynadiag_emu_diag_matmul_v2_fwd"] = nb::capsule(reinterpret_cast<void*>(DynadiagEmuFwd));
    d["dynadiag_emu_diag_matmul_v2_dx"] = nb::capsule(reinterpret_cast<void*>(DynadiagEmuDx));
    d["dynadiag_emu_diag_matmul_v2_dvalues"] = nb::capsule(reinterpret_cast<void*>(DynadiagEmuDvalues));
    return d;
  });
  // {kernel: {ctas, mma, fma, load_bytes, store_bytes}} counted since the last reset
  m.def("kernel_counts", [] {
    nb::dict d;
    for (const auto& c : dynadiag::emu_host::kernel_counts()) {
      nb::dict e;
      e["ctas"] = c.ctas;
      e["mma"] = c.mma;
      e["fma"] = c.fma;
      e["load_bytes"] = c.load_bytes;
      e["store_bytes"] = c.store_bytes;
      d[c.kernel.c_str()] = e;
    }
    return d;
  });
  m.def("reset_kernel_counts", &dynadiag::emu_host::reset_kernel_counts);
}
