// The launch policy of cuda/diag_launch.cuh for the host emulation: runs each launch under the
// emulation's checks and checks the outputs the sequence declares (launch.output) - each element
// written exactly once - when the sequence ends (finish()).
#pragma once

#include <cstddef>
#include <cstring>
#include <string>
#include <utility>

#include "emu/simt.h"

namespace dynadiag {
namespace emu_host {

class EmuLauncher {
 public:
  template <class... P, class... A>
  void operator()(dim3 grid, dim3 block, void (*kernel)(P...), A&&... args) {
    if (error_ != emu::Error::kSuccess) return;
    emu::launch_checked(&outputs_, grid, block, kernel, std::forward<A>(args)...);
    error_ = emu::last_error();
    if (error_ == emu::Error::kCheckFailed) message_ = emu::last_error_message();
  }
  void memset(void* p, size_t bytes) {
    if (bytes == 0) return;
    outputs_.memset(p, bytes);
    std::memset(p, 0, bytes);
  }
  template <class T>
  void output(T* p, size_t count, size_t row_length, const char* name) {
    outputs_.add(p, sizeof(T), count, row_length, name);
  }
  // Ends the sequence: the first launch error, else whether every output element was written.
  emu::Error finish() {
    if (error_ == emu::Error::kSuccess) {
      message_ = outputs_.finish();
      if (!message_.empty()) error_ = emu::Error::kCheckFailed;
    }
    return error_;
  }
  emu::Error error() const { return error_; }
  // What went wrong: the check's report, or the launch error's description.
  std::string message() const {
    return error_ == emu::Error::kCheckFailed ? message_ : emu::error_string(error_);
  }

 private:
  emu::OutputCheck outputs_;
  emu::Error error_ = emu::Error::kSuccess;
  std::string message_;
};

}  // namespace emu_host
}  // namespace dynadiag
