// Kernels of the diagonal-sparse product (DESIGN.md sections 1 and 4).
//
// Plain structs only: pointers and sizes, no XLA or nanobind headers. The FFI handlers
// (ffi_handlers.cc) validate every operand before filling these structs, so the kernels trust
// them: offsets lie in [0, P), shapes agree, and pointers are valid for the sizes given.
#ifndef DYNADIAG_XLA_EXT_CPU_DIAG_KERNELS_H_
#define DYNADIAG_XLA_EXT_CPU_DIAG_KERNELS_H_

#include <cstdint>

namespace dynadiag {

enum class ElemType { kF32, kBF16 };

// W[out, in] as K wrapped diagonals: P = max(in, out) candidates of length D = min(in, out).
// Tall (out >= in): diagonal d holds W[(j + d) % out, j] = values[k, j].
// Wide (out < in):  diagonal d holds W[i, (i + d) % in] = values[k, i].
struct DiagMatrix {
  int64_t in;
  int64_t out;
  int64_t k;
  const int32_t* offsets;  // [k], each in [0, max(in, out))
  const void* values;      // [k, min(in, out)]
};

// y[rows, out] = x[rows, in] @ W^T.
struct FwdArgs {
  ElemType type;
  int64_t rows;
  DiagMatrix w;
  const void* x;  // [rows, in]
  void* y;        // [rows, out]
};

// dx[rows, in] = dy[rows, out] @ W.
struct DxArgs {
  ElemType type;
  int64_t rows;
  DiagMatrix w;
  const void* dy;  // [rows, out]
  void* dx;        // [rows, in]
};

// dvalues[k, t] = sum_r dy[r, row(k, t)] * x[r, col(k, t)] (w.values is unused).
struct DvaluesArgs {
  ElemType type;
  int64_t rows;
  DiagMatrix w;
  const void* dy;  // [rows, out]
  const void* x;   // [rows, in]
  void* dvalues;   // [k, min(in, out)]
};

void DiagMatmulFwd(const FwdArgs& args);
void DiagMatmulDx(const DxArgs& args);
void DiagMatmulDvalues(const DvaluesArgs& args);

}  // namespace dynadiag

#endif  // DYNADIAG_XLA_EXT_CPU_DIAG_KERNELS_H_
