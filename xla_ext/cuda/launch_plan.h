// The launch plan of the CUDA kernels, defined once: the constants of their tiling and grids and
// the host functions that turn a product's shapes into its grid and workspace. Plain host C++ (no
// CUDA types) read by the kernels (diag_kernels.cuh, block_kernels.cuh), their launch sequences
// (diag_launch.cuh), both builds of the handlers (CUDA and the host emulation), and Python: the
// _plan_ext module (plan/module.cc) hands the same constants and plans to dynadiag_jax/launch_plan.py,
// which the lowering (workspace sizes) and the cost model (dynadiag_jax/gpu_cost.py) use.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string_view>

namespace dynadiag {
namespace cuda {

// ---- element diagonals (diag_kernels.cuh) ------------------------------------------------------
constexpr int kTile = 16;            // structure granularity = wmma m16n16k16
constexpr int kTileArea = kTile * kTile;
constexpr int kElemRows = 128;       // rows of x per product thread block
constexpr int kElemThreads = 256;    // 8 warps of 16 rows (tensor cores); 16 outputs x 16 row groups
constexpr int kElemWarps = kElemThreads / 32;
constexpr int kElemGroups = kElemThreads / kTile;
constexpr int kElemRowsPerThread = kElemRows / kElemGroups;
constexpr int kStageTiles = 2;       // tiles per pipeline stage of the tensor-core path
constexpr int kPlanThreads = 256;
constexpr int kMaxPlanBlocks = 4096;  // input blocks the plan counts in shared memory
constexpr int kTileCost = 16, kEntryCost = 1;
constexpr int kPathDiagonal = 0, kPathTensorCore = 1, kPathPoison = 2;
// dvalues: 32 consecutive t per warp, 8 warps over rows, 8 diagonals per block.
constexpr int kSddmmLanes = 32;
constexpr int kSddmmWarps = 8;
constexpr int kSddmmDiags = 8;
constexpr int kSddmmThreads = kSddmmLanes * kSddmmWarps;
constexpr int kReduceThreads = 256;
static_assert(kElemWarps * kTile == kElemRows, "one 16-row wmma tile per warp");
static_assert(kElemGroups * kElemRowsPerThread == kElemRows, "the diagonal path covers the slab");
static_assert(kSddmmDiags == kSddmmWarps, "the SDDMM reduction maps one diagonal to one warp");

// ---- block diagonals (block_kernels.cuh) -----------------------------------------------------
constexpr int kBlockRows = 128;
constexpr int kBlockThreads = 256;
constexpr int kBlockWarps = kBlockThreads / 32;
constexpr int kBlockMaxCols = 128;                   // output columns of a panel
constexpr int kBlockSlice = 16;                      // contraction columns per slice
constexpr int kBlockSddmmStageRows = 16;             // CUDA-core SDDMM
constexpr int kBlockSddmmMaxElems = 16384;           // accumulators of one SDDMM thread block
constexpr int kBlockSddmmStageBytes = 16384;         // operands of one stage
constexpr int kTcPad = 8;                            // elements added to every tensor-core shared row
constexpr int kTcStages = 3;                         // tensor-core product and SDDMM: stages in shared
                                                     // memory (kTcStages - 1 load while one is used)
constexpr int kTcSddmmChunks = 3;                    // tensor-core SDDMM: 16-byte chunks per thread and stage

// Tensor-core block SDDMM (TcSddmm): rows per stage, and the operand blocks one stage holds (its
// padded rows within kBlockSddmmStageBytes, at most kTcSddmmChunks chunks per thread; 2-byte types).
constexpr int tc_sddmm_stage_rows(int64_t b) { return b <= 32 ? 32 : 16; }
constexpr int64_t tc_sddmm_max_blocks(int64_t b) {
  const int64_t rows = tc_sddmm_stage_rows(b);
  const int64_t by_bytes = kBlockSddmmStageBytes / (rows * (b + kTcPad) * 2);
  const int64_t by_chunks = int64_t(kTcSddmmChunks) * kBlockThreads / (rows * b / 8);
  return by_bytes < by_chunks ? by_bytes : by_chunks;
}

// ---- grids and workspaces ----------------------------------------------------------------------
constexpr size_t kWorkspaceAlign = 256;
// Element dvalues: split the rows over grid.z until about kSddmmTargetBlocks blocks are in flight,
// keeping at least kSddmmRowsPerSplit rows per split.
constexpr int64_t kSddmmRowsPerSplit = 256;
constexpr int64_t kSddmmMaxSplits = 64;
constexpr int64_t kSddmmTargetBlocks = 512;
// Block dvalues: the same idea over its 1-D grid.
constexpr int64_t kBlockSddmmTargetCtas = 1024;
constexpr int64_t kBlockSddmmMaxSplits = 64;
constexpr int64_t kBlockSddmmRowsPerSplit = 512;
constexpr int64_t kMaxGridYZ = 65535;
constexpr int64_t kMaxGridX = std::numeric_limits<int32_t>::max();

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline size_t align_up(size_t n) { return (n + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign; }

// ---- element diagonals --------------------------------------------------------------------------
// Forward (transpose = false: out = y, in = x) or dx (transpose = true: out = dx, in = dy) of
// W[out_features, in_features]. Workspace segments (256-byte aligned): the diagonal lists
// [n_ob, K] and their lengths [n_ob] (out-moving products), then for 16-bit dtypes with at most
// kMaxPlanBlocks input blocks the structure: touched input blocks [n_ob, n_qb], their number
// [n_ob], the path [n_ob] and the packed 16x16 tiles [n_ob * n_qb, 16, 16] (2-byte elements).
struct ProductPlan {
  int32_t P, D, n_mb, n_tb, n_ob, n_qb;
  bool out_moving, lists, tiles;
  size_t list_at, nlist_at, tiles_at, ntiles_at, path_at, packed_at, workspace_bytes;
};

inline ProductPlan plan_product(int64_t in_features, int64_t out_features, bool transpose, int64_t K,
                                bool tensor_cores) {
  ProductPlan p{};
  const bool tall = out_features >= in_features;
  p.P = static_cast<int32_t>(tall ? out_features : in_features);
  p.D = static_cast<int32_t>(tall ? in_features : out_features);
  p.n_mb = static_cast<int32_t>(ceil_div(p.P, kTile));
  p.n_tb = static_cast<int32_t>(ceil_div(p.D, kTile));
  p.out_moving = transpose ? !tall : tall;
  p.n_ob = p.out_moving ? p.n_mb : p.n_tb;
  p.n_qb = p.out_moving ? p.n_tb : p.n_mb;
  p.lists = p.out_moving;
  p.tiles = tensor_cores && p.n_qb <= kMaxPlanBlocks;
  size_t at = 0;
  p.list_at = at;
  at += p.lists ? align_up(sizeof(int32_t) * size_t(p.n_ob) * size_t(K)) : 0;
  p.nlist_at = at;
  at += p.lists ? align_up(sizeof(int32_t) * size_t(p.n_ob)) : 0;
  p.tiles_at = at;
  at += p.tiles ? align_up(sizeof(int32_t) * size_t(p.n_ob) * p.n_qb) : 0;
  p.ntiles_at = at;
  at += p.tiles ? align_up(sizeof(int32_t) * size_t(p.n_ob)) : 0;
  p.path_at = at;
  at += p.tiles ? align_up(sizeof(int32_t) * size_t(p.n_ob)) : 0;
  p.packed_at = at;
  at += p.tiles ? align_up(2 * size_t(p.n_ob) * p.n_qb * kTileArea) : 0;
  p.workspace_bytes = at;
  return p;
}

// dvalues: float partial sums [splits, K, D] when splits > 1. With a smaller workspace than
// requested (e.g. a vmapped call that multiplied the rows) the plan uses fewer splits.
struct SddmmPlan {
  int32_t splits;
  int64_t rows_per_split;
  size_t workspace_bytes;
};

inline SddmmPlan plan_sddmm(int64_t rows, int64_t in_features, int64_t out_features, int64_t K,
                            size_t available = std::numeric_limits<size_t>::max()) {
  const int64_t D = in_features < out_features ? in_features : out_features;
  const int64_t blocks = ceil_div(D, kSddmmLanes) * ceil_div(K, kSddmmDiags);
  int64_t splits = ceil_div(rows, kSddmmRowsPerSplit);
  if (splits > kSddmmMaxSplits) splits = kSddmmMaxSplits;
  if (blocks > 0 && splits > ceil_div(kSddmmTargetBlocks, blocks))
    splits = ceil_div(kSddmmTargetBlocks, blocks);
  const size_t per_split = sizeof(float) * size_t(K) * size_t(D);
  if (per_split > 0 && splits > 1 && size_t(splits) * per_split > available)
    splits = static_cast<int64_t>(available / per_split);
  if (splits < 2 || per_split == 0) splits = 1;
  SddmmPlan p{};
  p.splits = static_cast<int32_t>(splits);
  p.rows_per_split = rows > 0 ? ceil_div(rows, splits) : 0;
  p.workspace_bytes = splits > 1 ? size_t(splits) * per_split : 0;
  return p;
}

// ---- block diagonals ----------------------------------------------------------------------------
struct BlockGeometry {
  int32_t b, P_b, L_b, wraps;
  bool tall;
};

inline BlockGeometry block_geometry(int64_t in_features, int64_t out_features, int64_t b) {
  BlockGeometry g{};
  const int64_t nb_in = in_features / b, nb_out = out_features / b;
  g.b = static_cast<int32_t>(b);
  g.tall = out_features >= in_features;
  g.P_b = static_cast<int32_t>(nb_in < nb_out ? nb_in : nb_out);
  g.L_b = static_cast<int32_t>(nb_in < nb_out ? nb_out : nb_in);
  g.wraps = static_cast<int32_t>(ceil_div(g.L_b, g.P_b));
  return g;
}

// Panels of the fwd (transpose = false) or dx product (block_kernels.cuh); no workspace. On tensor
// cores `cols` is the kernel's panel width (the panel's output blocks, rounded up to a power of
// two) and `slab_rows` its rows per thread block (TcPanel); on CUDA cores kBlockRows.
struct BlockProductPlan {
  BlockGeometry g;
  bool out_long, tensor_cores;
  int32_t per_panel, n_panels, cols, slab_rows;
};

inline int32_t tc_panel_cols(int32_t per_panel, int32_t b) {
  int32_t cols = b;
  while (cols < per_panel * b) cols *= 2;
  return cols;
}
inline int32_t tc_slab_rows(int32_t cols) { return cols >= kBlockMaxCols ? kBlockRows : 2 * kBlockRows; }

inline BlockProductPlan plan_block_product(int64_t in_features, int64_t out_features, bool transpose,
                                           int64_t b, bool tensor_core_dtype) {
  BlockProductPlan p{};
  p.g = block_geometry(in_features, out_features, b);
  p.out_long = transpose ? !p.g.tall : p.g.tall;
  p.tensor_cores = tensor_core_dtype && b % 16 == 0;
  const int32_t fit = static_cast<int32_t>(kBlockMaxCols / b > 1 ? kBlockMaxCols / b : 1);
  p.per_panel = p.out_long ? (p.g.wraps < fit ? p.g.wraps : fit) : 1;
  p.n_panels = p.g.P_b * (p.out_long ? static_cast<int32_t>(ceil_div(p.g.wraps, p.per_panel)) : 1);
  p.cols = p.tensor_cores ? tc_panel_cols(p.per_panel, p.g.b) : 0;
  p.slab_rows = p.tensor_cores ? tc_slab_rows(p.cols) : kBlockRows;
  return p;
}

// Thread blocks of the block SDDMM: (residue, wrap chunk, diagonal group, row split); float32
// partial sums [splits, K, L_b, b, b] when splits > 1 (fewer splits with a smaller workspace).
struct BlockSddmmPlan {
  BlockGeometry g;
  bool tensor_cores;
  int32_t per_cta, chunks, diags, groups, splits, stage_rows;
  int64_t rows_per_split;
  size_t workspace_bytes;
};

inline BlockSddmmPlan plan_block_sddmm(int64_t rows, int64_t in_features, int64_t out_features, int64_t K,
                                       int64_t b, size_t itemsize, bool tensor_core_dtype,
                                       size_t available = std::numeric_limits<size_t>::max()) {
  BlockSddmmPlan p{};
  p.g = block_geometry(in_features, out_features, b);
  p.tensor_cores = tensor_core_dtype && b % 16 == 0;
  const int64_t cap = kBlockSddmmMaxElems / (b * b) > 1 ? kBlockSddmmMaxElems / (b * b) : 1;
  int64_t root = static_cast<int64_t>(std::sqrt(static_cast<double>(cap)));
  while (root * root > cap) --root;
  while ((root + 1) * (root + 1) <= cap) ++root;
  p.per_cta = static_cast<int32_t>(p.g.wraps < root ? p.g.wraps : root);
  p.stage_rows = p.tensor_cores ? tc_sddmm_stage_rows(b) : kBlockSddmmStageRows;
  const int64_t stage_blocks = p.tensor_cores
                                   ? tc_sddmm_max_blocks(b)
                                   : kBlockSddmmStageBytes / (kBlockSddmmStageRows * b * int64_t(itemsize));
  const int64_t room = stage_blocks - p.per_cta;
  int64_t diags = K > 1 ? K : 1;
  if (diags > cap / p.per_cta) diags = cap / p.per_cta;
  if (diags > room) diags = room;
  if (diags < 1) diags = 1;
  p.diags = static_cast<int32_t>(diags);
  p.groups = static_cast<int32_t>(ceil_div(K, diags));
  p.chunks = static_cast<int32_t>(ceil_div(p.g.wraps, p.per_cta));
  const int64_t base = int64_t(p.g.P_b) * p.chunks * (p.groups > 1 ? p.groups : 1);
  int64_t splits = ceil_div(rows, kBlockSddmmRowsPerSplit);
  if (splits > kBlockSddmmMaxSplits) splits = kBlockSddmmMaxSplits;
  if (splits > ceil_div(kBlockSddmmTargetCtas, base)) splits = ceil_div(kBlockSddmmTargetCtas, base);
  const size_t per_split = sizeof(float) * size_t(K) * size_t(p.g.L_b) * size_t(b) * size_t(b);
  if (per_split > 0 && splits > 1 && size_t(splits) * per_split > available)
    splits = static_cast<int64_t>(available / per_split);
  if (splits < 2 || per_split == 0) splits = 1;
  p.splits = static_cast<int32_t>(splits);
  p.rows_per_split = rows > 0 ? ceil_div(rows, splits) : 0;
  p.workspace_bytes = splits > 1 ? size_t(splits) * per_split : 0;
  return p;
}

// ---- limits, checked by the handlers before launching; nullptr when the shapes fit --------------
inline const char* product_limits(const ProductPlan& p, int64_t rows) {
  if (int64_t(p.n_ob) * ceil_div(rows, kElemRows) > kMaxGridX) return "too many rows for one launch";
  return nullptr;
}

inline const char* sddmm_limits(int64_t K, int64_t D) {
  if (ceil_div(K, kSddmmDiags) > kMaxGridYZ) return "too many diagonals for one launch (at most 524280)";
  if (ceil_div(D, kSddmmLanes) > kMaxGridX) return "diagonals too long for one launch";
  return nullptr;
}

inline const char* block_product_limits(const BlockProductPlan& p, int64_t rows) {
  if (int64_t(p.n_panels) * ceil_div(rows, p.slab_rows) > kMaxGridX) return "too many rows for one launch";
  return nullptr;
}

inline const char* block_sddmm_limits(const BlockSddmmPlan& p) {
  if (int64_t(p.g.P_b) * p.chunks * p.groups * p.splits > kMaxGridX) return "too many blocks for one launch";
  return nullptr;
}

// Bytes of workspace the target `op` ("fwd", "dx", "dvalues") needs: tensor_cores for the 16-bit
// dtypes (the larger plan), block_size 1 for element diagonals.
inline size_t workspace_bytes(std::string_view op, int64_t rows, int64_t in_features, int64_t out_features,
                              int64_t num_diagonals, bool tensor_cores, int64_t block_size) {
  if (block_size > 1) {
    if (op != "dvalues") return 0;
    return plan_block_sddmm(rows, in_features, out_features, num_diagonals, block_size, tensor_cores ? 2 : 4,
                            tensor_cores)
        .workspace_bytes;
  }
  if (op == "dvalues") return plan_sddmm(rows, in_features, out_features, num_diagonals).workspace_bytes;
  return plan_product(in_features, out_features, op == "dx", num_diagonals, tensor_cores).workspace_bytes;
}

// Why the target `op` cannot run in one launch at these sizes (the message its handler returns), or
// nullptr: the lowering asks first, so a size beyond a grid limit is an error at trace time.
inline const char* launch_limits(std::string_view op, int64_t rows, int64_t in_features, int64_t out_features,
                                 int64_t num_diagonals, bool tensor_cores, int64_t block_size) {
  if (block_size > 1) {
    if (op == "dvalues")
      return block_sddmm_limits(plan_block_sddmm(rows, in_features, out_features, num_diagonals, block_size,
                                                 tensor_cores ? 2 : 4, tensor_cores));
    return block_product_limits(plan_block_product(in_features, out_features, op == "dx", block_size, tensor_cores),
                                rows);
  }
  if (op == "dvalues")
    return sddmm_limits(num_diagonals, in_features < out_features ? in_features : out_features);
  return product_limits(plan_product(in_features, out_features, op == "dx", num_diagonals, tensor_cores), rows);
}

}  // namespace cuda
}  // namespace dynadiag
