// The `_cpu_ext` Python module: registrations() -> {target name: FFI handler capsule}, plus the
// kernel family in use and a test entry point that runs one kernel family directly.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "diag_kernels.h"
#include "ffi_handlers.h"
#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

namespace {

template <typename Fn>
nb::capsule Capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

using Array = nb::ndarray<nb::numpy, nb::c_contig, nb::device::cpu>;
using Offsets = nb::ndarray<const int32_t, nb::numpy, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

constexpr dynadiag::Isa kIsas[] = {dynadiag::Isa::kPortable, dynadiag::Isa::kAvx2,
                                   dynadiag::Isa::kAvx512};

dynadiag::Isa IsaFromName(const std::string& name) {
  for (dynadiag::Isa isa : kIsas) {
    if (name == dynadiag::IsaName(isa) && isa <= dynadiag::BestIsa()) return isa;
  }
  throw std::invalid_argument("isa '" + name + "' is not supported on this CPU");
}

// Element type of a float32 array, or of a uint16 array holding bfloat16 bits (numpy arrays
// of ml_dtypes.bfloat16 do not cross DLPack).
dynadiag::ElemType TypeOf(const Array& a, const char* name) {
  if (a.dtype() == nb::dtype<float>()) return dynadiag::ElemType::kF32;
  if (a.dtype() == nb::dtype<uint16_t>()) return dynadiag::ElemType::kBF16;
  throw std::invalid_argument(std::string(name) + " must be float32 or uint16 (bfloat16 bits)");
}

void CheckShape(const Array& a, const char* name, const std::vector<int64_t>& dims) {
  bool ok = a.ndim() == dims.size();
  std::string text;
  for (size_t i = 0; i < dims.size(); ++i) {
    ok = ok && static_cast<int64_t>(a.shape(i)) == dims[i];
    text += (i ? ", " : "") + std::to_string(dims[i]);
  }
  if (!ok) throw std::invalid_argument(std::string(name) + " must have shape [" + text + "]");
}

// The diagonal matrix of a test call; `values` (or dvalues) of rank 4 are block diagonals.
dynadiag::DiagMatrix MatrixOf(const Array& values, const Offsets& offsets, int64_t in,
                              int64_t out) {
  const int64_t block = values.ndim() == 4 ? static_cast<int64_t>(values.shape(3)) : 1;
  if (block < 1 || in % block != 0 || out % block != 0) {
    throw std::invalid_argument("the block size must divide in and out");
  }
  const int64_t p =
      block > 1 ? std::min(in, out) / block : std::max(in, out);
  for (size_t k = 0; k < offsets.shape(0); ++k) {
    if (offsets.data()[k] < 0 || offsets.data()[k] >= p) {
      throw std::invalid_argument("offsets must lie in [0, P)");
    }
  }
  return {in, out, static_cast<int64_t>(offsets.shape(0)), offsets.data(), nullptr, block};
}

// w.perm from a test call's optional `perm`, which must be a permutation of [0, in).
void SetPerm(const std::optional<Offsets>& perm, dynadiag::DiagMatrix& w) {
  if (!perm) return;
  if (static_cast<int64_t>(perm->shape(0)) != w.in) {
    throw std::invalid_argument("perm must have shape [in]");
  }
  std::vector<bool> seen(w.in, false);
  for (int64_t j = 0; j < w.in; ++j) {
    const int32_t p = perm->data()[j];
    if (p < 0 || p >= w.in || seen[p]) {
      throw std::invalid_argument("perm must be a permutation of [0, in)");
    }
    seen[p] = true;
  }
  w.perm = perm->data();
}

// values / dvalues shape: [K, min(in, out)] or [K, L_b, b, b].
std::vector<int64_t> ValuesShape(const dynadiag::DiagMatrix& w) {
  if (w.block == 1) return {w.k, std::min(w.in, w.out)};
  return {w.k, std::max(w.in, w.out) / w.block, w.block, w.block};
}

// Runs one kernel of one family with `workers` tasks (called one after another, last first).
// Test-only; `out` is written in place.
void RunKernel(const std::string& op, const std::string& isa_name, Array a, Array b,
               Offsets offsets, Array out, int64_t in_features, int64_t out_features,
               int64_t workers, std::optional<Offsets> perm) {
  const dynadiag::Isa isa = IsaFromName(isa_name);
  const dynadiag::ElemType type = TypeOf(a, "a");
  if (TypeOf(b, "b") != type || TypeOf(out, "out") != type) {
    throw std::invalid_argument("a, b and out must share one dtype");
  }
  const bool dvalues = op == "dvalues";
  dynadiag::DiagMatrix w = MatrixOf(dvalues ? out : b, offsets, in_features, out_features);
  SetPerm(perm, w);
  const int64_t rows = a.ndim() == 2 ? static_cast<int64_t>(a.shape(0)) : -1;
  CheckShape(a, "a", {rows, op == "fwd" ? in_features : out_features});
  if (dvalues) {
    CheckShape(b, "b", {rows, in_features});
    CheckShape(out, "out", ValuesShape(w));
  } else {
    CheckShape(b, "b", ValuesShape(w));
    CheckShape(out, "out", {rows, op == "fwd" ? out_features : in_features});
  }
  std::unique_ptr<dynadiag::Job> job;
  if (op == "fwd") {  // a = x, b = values, out = y
    w.values = b.data();
    job = dynadiag::MakeFwdJob({type, rows, w, a.data(), out.data()}, workers, isa);
  } else if (op == "dx") {  // a = dy, b = values, out = dx
    w.values = b.data();
    job = dynadiag::MakeDxJob({type, rows, w, a.data(), out.data()}, workers, isa);
  } else if (dvalues) {  // a = dy, b = x, out = dvalues
    job = dynadiag::MakeDvaluesJob({type, rows, w, a.data(), b.data(), out.data()}, workers, isa);
  } else {
    throw std::invalid_argument("op must be fwd, dx or dvalues");
  }
  for (int64_t i = job->num_tasks() - 1; i >= 0; --i) job->RunTask(i);
}

// The backward target's job (fused where the family has one) of family `isa`: dx and dvalues
// from dy, x and values (test-only).
void RunBackward(const std::string& isa_name, Array dy, Array x, Array values, Offsets offsets,
                 Array dx, Array dvalues, int64_t workers, std::optional<Offsets> perm) {
  const dynadiag::Isa isa = IsaFromName(isa_name);
  const dynadiag::ElemType type = TypeOf(dy, "dy");
  for (const auto& [a, name] : {std::pair{&x, "x"}, {&values, "values"}, {&dx, "dx"},
                                {&dvalues, "dvalues"}}) {
    if (TypeOf(*a, name) != type) throw std::invalid_argument("operands must share one dtype");
  }
  if (dy.ndim() != 2 || x.ndim() != 2) throw std::invalid_argument("dy and x must be 2-D");
  const int64_t rows = static_cast<int64_t>(dy.shape(0));
  const int64_t in = static_cast<int64_t>(x.shape(1)), out = static_cast<int64_t>(dy.shape(1));
  dynadiag::DiagMatrix w = MatrixOf(values, offsets, in, out);
  w.values = values.data();
  SetPerm(perm, w);
  CheckShape(x, "x", {rows, in});
  CheckShape(dx, "dx", {rows, in});
  CheckShape(values, "values", ValuesShape(w));
  CheckShape(dvalues, "dvalues", ValuesShape(w));
  auto job = dynadiag::MakeBwdJob({type, rows, w, dy.data(), x.data(), dx.data(), dvalues.data()},
                                  workers, isa);
  for (int64_t i = job->num_tasks() - 1; i >= 0; --i) job->RunTask(i);
}

}  // namespace

NB_MODULE(_cpu_ext, m) {
  // The XLA FFI API the handlers were compiled against: a jaxlib older than it refuses them.
  m.attr("ffi_api") = nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
  m.def("registrations", [] {
    nb::dict d;
    d["dynadiag_diag_matmul_v2_fwd"] = Capsule(DynadiagDiagMatmulFwdCpu);
    d["dynadiag_diag_matmul_v2_dx"] = Capsule(DynadiagDiagMatmulDxCpu);
    d["dynadiag_diag_matmul_v2_dvalues"] = Capsule(DynadiagDiagMatmulDvaluesCpu);
    d["dynadiag_diag_matmul_v2_bwd"] = Capsule(DynadiagDiagMatmulBwdCpu);
    d["dynadiag_diag_matmul_permuted_v1_fwd"] = Capsule(DynadiagDiagMatmulPermutedFwdCpu);
    d["dynadiag_diag_matmul_permuted_v1_dx"] = Capsule(DynadiagDiagMatmulPermutedDxCpu);
    d["dynadiag_diag_matmul_permuted_v1_dvalues"] = Capsule(DynadiagDiagMatmulPermutedDvaluesCpu);
    d["dynadiag_diag_matmul_permuted_v1_bwd"] = Capsule(DynadiagDiagMatmulPermutedBwdCpu);
    d["dynadiag_gate_rank_v1"] = Capsule(DynadiagGateRankCpu);
    return d;
  });
  m.def("kernel_isa", [] { return std::string(dynadiag::IsaName(dynadiag::BestIsa())); },
        "The kernel family the handlers use on this CPU: 'avx512', 'avx2' or 'portable'.");
  m.def("supported_isas", [] {
    std::vector<std::string> names;
    for (dynadiag::Isa isa : kIsas) {
      if (isa <= dynadiag::BestIsa()) names.emplace_back(dynadiag::IsaName(isa));
    }
    return names;
  }, "Kernel families this CPU can run (for tests).");
  m.def("_run_kernel", &RunKernel, nb::arg("op"), nb::arg("isa"), nb::arg("a"), nb::arg("b"),
        nb::arg("offsets"), nb::arg("out"), nb::arg("in_features"), nb::arg("out_features"),
        nb::arg("workers"), nb::arg("perm") = nb::none(),
        "Test hook: runs kernel `op` of family `isa` on numpy arrays (2-D rows; values [K, D] or "
        "[K, L_b, b, b]), writing `out`; `perm` (int32 [in]) is the input permutation.");
  m.def("_run_backward", &RunBackward, nb::arg("isa"), nb::arg("dy"), nb::arg("x"),
        nb::arg("values"), nb::arg("offsets"), nb::arg("dx"), nb::arg("dvalues"),
        nb::arg("workers"), nb::arg("perm") = nb::none(),
        "Test hook: the backward target's job (dx and dvalues) of family `isa`, writing dx and "
        "dvalues; `perm` (int32 [in]) is the input permutation.");
}
