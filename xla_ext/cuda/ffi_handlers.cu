// CUDA FFI handlers of diag_matmul: launch the kernels of diag_kernels.cuh on XLA's stream.
// Scratch memory comes from XLA (the workspace result), there is no host synchronisation, and
// launch errors come back as ffi::Error. Registered for platform "CUDA" under the CPU targets'
// names (module.cc), so dd.diag_matmul picks them up on a GPU without any Python change.
#include <cuda_runtime_api.h>

#include <string>
#include <utility>

#include "cuda/diag_handlers.h"

namespace {

namespace ffi = xla::ffi;

class CudaLauncher {
 public:
  explicit CudaLauncher(cudaStream_t stream) : stream_(stream) {}

  template <class... P, class... A>
  void operator()(dim3 grid, dim3 block, void (*kernel)(P...), A&&... args) {
    if (error_ != cudaSuccess) return;
    kernel<<<grid, block, 0, stream_>>>(std::forward<A>(args)...);
    error_ = cudaGetLastError();
  }
  void memset(void* p, size_t bytes) {
    if (error_ == cudaSuccess && bytes) error_ = cudaMemsetAsync(p, 0, bytes, stream_);
  }
  template <class T>
  void output(T*, size_t, size_t, const char*) {}  // checked by the emulation only
  ffi::Error status() const {
    if (error_ == cudaSuccess) return ffi::Error::Success();
    return ffi::Error::Internal(std::string("dynadiag CUDA kernel launch failed: ") +
                                cudaGetErrorString(error_));
  }

 private:
  cudaStream_t stream_;
  cudaError_t error_ = cudaSuccess;
};

ffi::Error Fwd(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer values, ffi::AnyBuffer offsets,
               ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> workspace) {
  CudaLauncher launch(stream);
  return dynadiag::cuda::product(launch, false, x, values, offsets, y, workspace);
}

ffi::Error Dx(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer values, ffi::AnyBuffer offsets,
              ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> workspace) {
  CudaLauncher launch(stream);
  return dynadiag::cuda::product(launch, true, dy, values, offsets, dx, workspace);
}

ffi::Error Dvalues(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer offsets,
                   ffi::Result<ffi::AnyBuffer> dvalues, ffi::Result<ffi::AnyBuffer> workspace) {
  CudaLauncher launch(stream);
  return dynadiag::cuda::dvalues(launch, dy, x, offsets, dvalues, workspace);
}

}  // namespace

// No host sync and no allocation: safe inside CUDA graphs (command buffers).
XLA_FFI_DEFINE_HANDLER_SYMBOL(DynadiagCudaFwd, Fwd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()            // x[..., in]
                                  .Arg<ffi::AnyBuffer>()            // values[K, D]
                                  .Arg<ffi::AnyBuffer>()            // offsets[K] (int32, checked)
                                  .Ret<ffi::AnyBuffer>()            // y[..., out]
                                  .Ret<ffi::AnyBuffer>(),            // workspace (uint8, checked)
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(DynadiagCudaDx, Dx,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()            // dy[..., out]
                                  .Arg<ffi::AnyBuffer>()            // values[K, D]
                                  .Arg<ffi::AnyBuffer>()            // offsets[K] (int32, checked)
                                  .Ret<ffi::AnyBuffer>()            // dx[..., in]
                                  .Ret<ffi::AnyBuffer>(),            // workspace (uint8, checked)
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(DynadiagCudaDvalues, Dvalues,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()            // dy[..., out]
                                  .Arg<ffi::AnyBuffer>()            // x[..., in]
                                  .Arg<ffi::AnyBuffer>()            // offsets[K] (int32, checked)
                                  .Ret<ffi::AnyBuffer>()            // dvalues[K, D]
                                  .Ret<ffi::AnyBuffer>(),            // workspace (uint8, checked)
                              {ffi::Traits::kCmdBufferCompatible});
