// Kernels of the diagonal-sparse product (docs/design.md sections 1 and 5).
//
// Plain structs only: pointers and sizes, no XLA or nanobind headers. The FFI handlers
// (ffi_handlers.cc) validate every operand before filling these structs, so the kernels trust
// them: offsets lie in [0, P), shapes agree, and pointers are valid for the sizes given.
//
// Each product is prepared as a `Job` (the per-call plan built from the offsets, packed values
// and per-worker scratch) whose `RunTask(i)` the caller runs once for every i in
// [0, num_tasks()), on any threads and in any order; the job is finished when all have returned.
#ifndef DYNADIAG_XLA_EXT_CPU_DIAG_KERNELS_H_
#define DYNADIAG_XLA_EXT_CPU_DIAG_KERNELS_H_

#include <cstdint>
#include <memory>

namespace dynadiag {

enum class ElemType { kF32, kBF16 };

// W[out, in] as K wrapped diagonals.
//
// Element diagonals (block == 1): P = max(in, out) candidates of length D = min(in, out).
// Tall (out >= in): diagonal d holds W[(j + d) % out, j] = values[k, j].
// Wide (out < in):  diagonal d holds W[i, (i + d) % in] = values[k, i].
//
// Block diagonals (block == b >= 2, b divides in and out; nb_in = in / b, nb_out = out / b):
// P_b = min(nb_in, nb_out) candidates, each a chain of L_b = max(nb_in, nb_out) b x b blocks.
// Tall (out >= in): block t of diagonal d sits at block row t, block column (t + d) % nb_in.
// Wide (out < in):  block t of diagonal d sits at block row (t + d) % nb_out, block column t.
// values[k, t, i, j] = W[block_row * b + i, block_col * b + j].
//
// With `perm` (a permutation of [0, in)) the matrix is W P, input column perm[j] of the rows
// taking the place of column j: the forward reads x[r, perm[j]], dx writes dx[r, perm[j]], and
// dvalues reads x through perm. The jobs gather (scatter) through it where they copy a chunk of
// rows anyway, so no pass over the whole x (dx) is added.
struct DiagMatrix {
  int64_t in;
  int64_t out;
  int64_t k;
  const int32_t* offsets;  // [k], each in [0, P) (element) or [0, P_b) (block)
  const void* values;      // [k, min(in, out)] (element) or [k, L_b, b, b] (block)
  int64_t block = 1;
  const int32_t* perm = nullptr;  // [in], a permutation of [0, in); null: the identity
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

// dvalues[k, t] = sum_r dy[r, row(k, t)] * x[r, col(k, t)] (w.values is unused); for blocks,
// dvalues[k, t] = dy[:, rows of the block]^T @ x[:, columns of the block].
struct DvaluesArgs {
  ElemType type;
  int64_t rows;
  DiagMatrix w;
  const void* dy;  // [rows, out]
  const void* x;   // [rows, in]
  void* dvalues;   // like w.values
};

// dx = dy @ W and dvalues together (one sweep over dy; w.values is used for dx).
struct BwdArgs {
  ElemType type;
  int64_t rows;
  DiagMatrix w;
  const void* dy;  // [rows, out]
  const void* x;   // [rows, in]
  void* dx;        // [rows, in]
  void* dvalues;   // like w.values
};

// The kernel families; `BestIsa()` is the fastest one this CPU runs.
enum class Isa { kPortable, kAvx2, kAvx512 };

Isa BestIsa();
const char* IsaName(Isa isa);

class Job {
 public:
  virtual ~Job() = default;
  virtual int64_t num_tasks() const = 0;
  virtual void RunTask(int64_t task) = 0;
};

// `workers` is how many threads may run tasks at once (the tasks balance work dynamically);
// `isa` must be supported by this CPU (at most BestIsa()). w.block picks element or block
// diagonals. May throw std::bad_alloc.
std::unique_ptr<Job> MakeFwdJob(const FwdArgs& args, int64_t workers, Isa isa);
std::unique_ptr<Job> MakeDxJob(const DxArgs& args, int64_t workers, Isa isa);
std::unique_ptr<Job> MakeDvaluesJob(const DvaluesArgs& args, int64_t workers, Isa isa);
std::unique_ptr<Job> MakeBwdJob(const BwdArgs& args, int64_t workers, Isa isa);

}  // namespace dynadiag

#endif  // DYNADIAG_XLA_EXT_CPU_DIAG_KERNELS_H_
