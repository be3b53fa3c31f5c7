// The CUDA targets compiled for the host against the SIMT emulation and registered for the CPU
// platform as dynadiag_emu_diag_matmul_v2_{fwd,dx,dvalues}: the same kernel source and handler code
// as the CUDA build, so the test suite runs the CUDA logic through XLA (impl="cuda_emulated").
#include "emu/ffi_handlers.h"

#include <string>

#include "cuda/diag_handlers.h"
#include "emu/emu_launcher.h"

namespace dynadiag {
namespace emu_host {
namespace {

namespace ffi = xla::ffi;

// EmuLauncher plus the status() the shared handler code expects (called once, after the last
// launch): an emulation check that failed becomes the handler's error, i.e. a Python exception.
class FfiLauncher : public EmuLauncher {
 public:
  ffi::Error status() {
    if (finish() == emu::Error::kSuccess) return ffi::Error::Success();
    return ffi::Error::Internal("emulated CUDA launch failed: " + message());
  }
};

ffi::Error Fwd(ffi::AnyBuffer x, ffi::AnyBuffer values, ffi::AnyBuffer offsets,
               ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> workspace) {
  FfiLauncher launch;
  return cuda::product(launch, false, x, values, offsets, y, workspace);
}

ffi::Error Dx(ffi::AnyBuffer dy, ffi::AnyBuffer values, ffi::AnyBuffer offsets,
              ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> workspace) {
  FfiLauncher launch;
  return cuda::product(launch, true, dy, values, offsets, dx, workspace);
}

ffi::Error Dvalues(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer offsets,
                   ffi::Result<ffi::AnyBuffer> dvalues, ffi::Result<ffi::AnyBuffer> workspace) {
  FfiLauncher launch;
  return cuda::dvalues(launch, dy, x, offsets, dvalues, workspace);
}

}  // namespace
}  // namespace emu_host
}  // namespace dynadiag

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(DynadiagEmuFwd, dynadiag::emu_host::Fwd,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()            // x[..., in]
                                  .Arg<ffi::AnyBuffer>()            // values[K, D]
                                  .Arg<ffi::AnyBuffer>()            // offsets[K] (int32, checked)
                                  .Ret<ffi::AnyBuffer>()            // y[..., out]
                                  .Ret<ffi::AnyBuffer>());           // workspace (uint8, checked)
XLA_FFI_DEFINE_HANDLER_SYMBOL(DynadiagEmuDx, dynadiag::emu_host::Dx,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()            // dy[..., out]
                                  .Arg<ffi::AnyBuffer>()            // values[K, D]
                                  .Arg<ffi::AnyBuffer>()            // offsets[K] (int32, checked)
                                  .Ret<ffi::AnyBuffer>()            // dx[..., in]
                                  .Ret<ffi::AnyBuffer>());           // workspace (uint8, checked)
XLA_FFI_DEFINE_HANDLER_SYMBOL(DynadiagEmuDvalues, dynadiag::emu_host::Dvalues,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()            // dy[..., out]
                                  .Arg<ffi::AnyBuffer>()            // x[..., in]
                                  .Arg<ffi::AnyBuffer>()            // offsets[K] (int32, checked)
                                  .Ret<ffi::AnyBuffer>()            // dvalues[K, D]
                                  .Ret<ffi::AnyBuffer>());           // workspace (uint8, checked)

namespace dynadiag {
namespace emu_host {

std::vector<KernelCount> kernel_counts() {
  static const char* const names[cuda::kNumCountedKernels] = {
      "element_plan", "element_product", "element_sddmm", "sddmm_reduce", "block_product", "block_sddmm"};
  std::vector<KernelCount> out;
  for (int i = 0; i < cuda::kNumCountedKernels; ++i) {
    const cuda::KernelCounter& c = cuda::kernel_counters()[i];
    out.push_back({names[i], c.ctas.load(), c.mma.load(), c.fma.load(), c.load_bytes.load(), c.store_bytes.load()});
  }
  return out;
}

void reset_kernel_counts() {
  for (int i = 0; i < cuda::kNumCountedKernels; ++i) {
    cuda::KernelCounter& c = cuda::kernel_counters()[i];
    c.ctas = c.mma = c.fma = c.load_bytes = c.store_bytes = 0;
  }
}

}  // namespace emu_host
}  // namespace dynadiag
