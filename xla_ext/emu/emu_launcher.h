// The launch policy of cuda/diag_launch.cuh for the host emulation.
#pragma once

#include <cstddef>
#include <cstring>
#include <utility>

#include "emu/simt.h"

namespace dynadiag {
namespace emu_host {

class EmuLauncher {
 public:
  template <class... P, class... A>
  void operator()(dim3 grid, dim3 block, void (*kernel)(P...), A&&... args) {
    if (error_ != emu::Error::kSuccess) return;
    emu::launch(grid, block, kernel, std::forward<A>(args)...);
    error_ = emu::last_error();
  }
  void memset(void* p, size_t bytes) {
    if (bytes) std::memset(p, 0, bytes);
  }
  emu::Error error() const { return error_; }

 private:
  emu::Error error_ = emu::Error::kSuccess;
};

}  // namespace emu_host
}  // namespace dynadiag
