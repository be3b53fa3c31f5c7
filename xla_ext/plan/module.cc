// nanobind module _plan_ext: the launch plan of the CUDA kernels (cuda/launch_plan.h) for Python
// (dynadiag_jax/launch_plan.py). Plain host code, built with every installation, GPU or not, so
// the lowering and the cost model read the plan the kernels are compiled with.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string_view.h>

#include <cstddef>
#include <cstdint>
#include <limits>

#include "cuda/launch_plan.h"

namespace nb = nanobind;
namespace c = dynadiag::cuda;

namespace {

constexpr size_t kUnlimited = std::numeric_limits<size_t>::max();

nb::dict constants() {
  nb::dict d;
  d["TILE"] = c::kTile;
  d["WORKSPACE_ALIGN"] = c::kWorkspaceAlign;
  d["ELEM_ROWS"] = c::kElemRows;
  d["ELEM_WARPS"] = c::kElemWarps;
  d["ELEM_GROUPS"] = c::kElemGroups;
  d["TILE_COST"] = c::kTileCost;
  d["ENTRY_COST"] = c::kEntryCost;
  d["MAX_PLAN_BLOCKS"] = c::kMaxPlanBlocks;
  d["PATH_DIAGONAL"] = c::kPathDiagonal;
  d["PATH_TENSOR_CORE"] = c::kPathTensorCore;
  d["SDDMM_LANES"] = c::kSddmmLanes;
  d["SDDMM_DIAGS"] = c::kSddmmDiags;
  d["REDUCE_THREADS"] = c::kReduceThreads;
  d["BLOCK_ROWS"] = c::kBlockRows;
  d["BLOCK_WARPS"] = c::kBlockWarps;
  d["BLOCK_SLICE"] = c::kBlockSlice;
  d["PLAN_WARPS"] = c::kPlanThreads / 32;
  d["SDDMM_WARPS"] = c::kSddmmWarps;
  return d;
}

nb::dict product_plan(int64_t in_features, int64_t out_features, bool transpose, int64_t K, bool tensor_cores) {
  const c::ProductPlan p = c::plan_product(in_features, out_features, transpose, K, tensor_cores);
  nb::dict d;
  d["n_mb"] = p.n_mb;
  d["n_tb"] = p.n_tb;
  d["out_moving"] = p.out_moving;
  d["n_ob"] = p.n_ob;
  d["n_qb"] = p.n_qb;
  d["lists"] = p.lists;
  d["tiles"] = p.tiles;
  d["list_at"] = p.list_at;
  d["nlist_at"] = p.nlist_at;
  d["tiles_at"] = p.tiles_at;
  d["ntiles_at"] = p.ntiles_at;
  d["path_at"] = p.path_at;
  d["packed_at"] = p.packed_at;
  d["nbytes"] = p.workspace_bytes;
  return d;
}

int32_t sddmm_splits(int64_t rows, int64_t in_features, int64_t out_features, int64_t K) {
  return c::plan_sddmm(rows, in_features, out_features, K).splits;
}

nb::dict block_product_plan(int64_t in_features, int64_t out_features, bool transpose, int64_t b,
                            bool tensor_core_dtype) {
  const c::BlockProductPlan p = c::plan_block_product(in_features, out_features, transpose, b, tensor_core_dtype);
  nb::dict d;
  d["out_long"] = p.out_long;
  d["tensor_cores"] = p.tensor_cores;
  d["wraps"] = p.g.wraps;
  d["wraps_per_panel"] = p.per_panel;
  d["n_panels"] = p.n_panels;
  d["cols"] = p.cols;
  d["slab_rows"] = p.slab_rows;
  return d;
}

nb::dict block_sddmm_plan(int64_t rows, int64_t in_features, int64_t out_features, int64_t K, int64_t b,
                          size_t itemsize, bool tensor_core_dtype, size_t available) {
  const c::BlockSddmmPlan p =
      c::plan_block_sddmm(rows, in_features, out_features, K, b, itemsize, tensor_core_dtype, available);
  nb::dict d;
  d["tensor_cores"] = p.tensor_cores;
  d["wraps_per_cta"] = p.per_cta;
  d["wrap_chunks"] = p.chunks;
  d["diags_per_cta"] = p.diags;
  d["groups"] = p.groups;
  d["splits"] = p.splits;
  d["rows_per_split"] = p.rows_per_split;
  d["stage_rows"] = p.stage_rows;
  d["workspace_bytes"] = p.workspace_bytes;
  return d;
}

// The handler's message for sizes beyond one launch, or None.
nb::object launch_limits(std::string_view op, int64_t rows, int64_t in_features, int64_t out_features, int64_t K,
                         bool tensor_cores, int64_t block_size) {
  const char* e = c::launch_limits(op, rows, in_features, out_features, K, tensor_cores, block_size);
  if (e) return nb::str(e);
  return nb::none();
}

}  // namespace

NB_MODULE(_plan_ext, m) {
  m.def("constants", &constants);
  m.def("product_plan", &product_plan, nb::arg("in_features"), nb::arg("out_features"), nb::arg("transpose"),
        nb::arg("num_diagonals"), nb::arg("tensor_cores"));
  m.def("sddmm_splits", &sddmm_splits, nb::arg("rows"), nb::arg("in_features"), nb::arg("out_features"),
        nb::arg("num_diagonals"));
  m.def("block_product_plan", &block_product_plan, nb::arg("in_features"), nb::arg("out_features"),
        nb::arg("transpose"), nb::arg("block_size"), nb::arg("tensor_core_dtype"));
  m.def("block_sddmm_plan", &block_sddmm_plan, nb::arg("rows"), nb::arg("in_features"), nb::arg("out_features"),
        nb::arg("num_diagonals"), nb::arg("block_size"), nb::arg("itemsize"), nb::arg("tensor_core_dtype"),
        nb::arg("available") = kUnlimited);
  m.def("launch_limits", &launch_limits, nb::arg("op"), nb::arg("rows"), nb::arg("in_features"),
        nb::arg("out_features"), nb::arg("num_diagonals"), nb::arg("tensor_cores"), nb::arg("block_size") = 1);
  m.def("workspace_bytes", &c::workspace_bytes, nb::arg("op"), nb::arg("rows"), nb::arg("in_features"),
        nb::arg("out_features"), nb::arg("num_diagonals"), nb::arg("tensor_cores"), nb::arg("block_size") = 1);
}
