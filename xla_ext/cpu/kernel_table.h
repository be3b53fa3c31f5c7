// What the instruction-set-specific kernel files share: the plans they walk and the table of
// entry points each of them fills (internal to the CPU extension; plain structs only).
//
// Element diagonals: a plan cuts every diagonal into straight runs ("segments") of at most 16
// lanes that fall in one 16-column output tile. Lane l of segment s of tile j pairs output column
// 16 j + l with input column c0 + l and with value index vbase + l (in [K, D] row-major order).
//
// Block diagonals: a plan lists, for every b-column block of the output, the b x b blocks of W
// that feed it ("entries"): each reads one b-column block of the input.
#ifndef DYNADIAG_XLA_EXT_CPU_KERNEL_TABLE_H_
#define DYNADIAG_XLA_EXT_CPU_KERNEL_TABLE_H_

#include <cstdint>
#include <cstring>

namespace dynadiag {

constexpr int kLanes = 16;  // output columns per tile (one zmm of float32)
constexpr uint32_t kFullMask = (1u << kLanes) - 1u;  // a segment or tile with every lane

// Segments per tile are padded with empty ones (mask 0) to a multiple of this, so the SDDMM
// kernels can take segments in fixed-size groups.
constexpr int kSegmentGroup = 8;

struct Bf16 {
  uint16_t bits;
};

inline float ToFloat(float v) { return v; }

inline float ToFloat(Bf16 v) {  // bfloat16 is the top half of a float32
  const uint32_t bits = uint32_t{v.bits} << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// One float32 result stored as T. bfloat16 rounds to nearest even, as XLA converts; NaN stays a
// (quiet) NaN.
inline void FromFloat(float f, float* out) { *out = f; }

inline void FromFloat(float f, Bf16* out) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    out->bits = static_cast<uint16_t>((u >> 16) | 0x40u);
    return;
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  out->bits = static_cast<uint16_t>(u >> 16);
}

struct Segment {
  int32_t c0;     // input column of lane 0 (lanes outside `mask` may point outside the row)
  uint32_t mask;  // valid lanes (bit l = lane l; 16 bits)
  int64_t vbase;  // value index of lane 0
};

struct PlanView {
  int64_t num_tiles;
  const int64_t* tile_begin;  // [num_tiles + 1]: tile j owns [tile_begin[j], tile_begin[j+1])
  const Segment* segs;
  int64_t num_segs;
};

template <typename T>
struct KernelTable {
  // vp[s][l] = values[segs[s].vbase + l] as float32 for lanes in the mask, 0 elsewhere.
  void (*pack)(const PlanView& plan, const T* values, float* vp);
  // out[r, 16 j + l] = sum over the segments s of tile j of vp[s][l] * in[r, c0_s + l], for
  // r < rows (every output column of every row is written).
  void (*product)(const PlanView& plan, const float* vp, const T* in, int64_t in_width, T* out,
                  int64_t out_width, int64_t rows);
  // acc[s][l] += sum_{r < rows} tiled[r, 16 j + l] * gathered[r, c0_s + l] for the segments s
  // of every tile j (empty lanes add zeros).
  void (*sddmm)(const PlanView& plan, const T* tiled, int64_t tiled_width, const T* gathered,
                int64_t gathered_width, int64_t rows, float* acc);
  // Both products of the backward pass in one sweep over dy, for tiles [tile_begin, tile_end)
  // (columns of dx and of x) and r < rows: dx[r, 16 j + l] = sum_s vp[s][l] * dy[r, c0_s + l]
  // as `product` does, and acc[s][l] += sum_r x[r, 16 j + l] * dy[r, c0_s + l]. Null where the
  // family has no fused kernel (the job then runs `product` and `sddmm`).
  void (*backward)(const PlanView& plan, int64_t tile_begin, int64_t tile_end, const float* vp,
                   const T* dy, int64_t dy_width, const T* x, T* dx, int64_t width, int64_t rows,
                   float* acc);
};

// out[r, o b + i] = sum over the entries e of output block o of
//     sum_j in[r, in_block[e] b + j] * panel_e[j][i]
// where panel_e is values block value_block[e] (in [K, L_b] order), transposed for the forward
// (W's block maps input j to output i as V[i][j]) and as is for dx (dy @ W: V[i][j] maps dy
// column i to dx column j).
struct BlockPlanView {
  int64_t b;
  int64_t num_out_blocks;
  const int64_t* entry_begin;  // [num_out_blocks + 1]: block o owns [entry_begin[o], ...[o+1])
  const int32_t* in_block;     // [entries]
  const int64_t* value_block;  // [entries]
  bool transpose;
  // [num_out_blocks]: output blocks with the same in_block sequence, equally spaced (the blocks
  // t, t + nb_in, t + 2 nb_in, ... of a tall forward, and likewise in a wide layer's dx), form a
  // group: group[o] = its number of blocks at its first block o, 0 at the others, 1 for a block
  // alone; group_step[o] = the distance from one block of the group to the next. Tiles one vector
  // wide then compute several blocks of a group at once: each broadcast of an input element feeds
  // several vectors.
  const int32_t* group;
  const int32_t* group_step;
};

template <typename T>
struct BlockKernelTable {
  // Packs the panels of every entry into `panels` (entries * b * b floats) in the order
  // `product` reads them; the layout is the family's own.
  void (*pack)(const BlockPlanView& plan, const T* values, float* panels);
  // Every column of out[rows, out_width] as above, from float32 rows in[rows, in_width].
  // `stream`: a float32 `out` that nothing reads soon is written with streaming stores (which
  // skip reading each line first and leave it out of the caches) where its vectors are aligned.
  void (*product)(const BlockPlanView& plan, const float* panels, const float* in,
                  int64_t in_width, T* out, int64_t out_width, int64_t rows, bool stream);
};

// The few-row kernels (few_rows_body.h): W read in place, one diagonal or block at a time.
//
// Element diagonals as the few-row product sees them: diagonal k pairs short-side index j in
// [0, len) with long-side index (j + offsets[k]) % p through values[k * len + j]. `long_dst`: the
// product writes the long side (the forward of a tall W, dx of a wide one) and reads the short.
template <typename T>
struct FewElements {
  const T* values;  // [k, len]
  const int32_t* offsets;  // [k], each in [0, p)
  int64_t k, len, p;
  bool long_dst;
};

template <typename T>
struct FewRowTable {
  // dst[j] += v[j] * src[j] for j < n (one straight run of an element diagonal, one row).
  void (*triad)(const T* v, const float* src, float* dst, int64_t n);
  // dst[r, o] += sum_k values[k, j] * src[r, s] over the diagonals' entries (j, s) of output
  // column o, for r < rows and o in [lo, hi) (lo a multiple of 16; hi too or the row's end);
  // float32 rows src_stride and dst_stride apart.
  void (*product)(const FewElements<T>& e, const float* src, int64_t src_stride, float* dst,
                  int64_t dst_stride, int64_t rows, int64_t lo, int64_t hi);
  // dst[j] += sum_{r < rows} a[r, j] * b[r, j] for j < n (dvalues of one run; float32 rows).
  void (*dot)(const float* a, int64_t a_stride, const float* b, int64_t b_stride, float* dst,
              int64_t rows, int64_t n);
};

// The few-row block loops (few_rows_body.h): one b x b block, b one of the kernel block sizes,
// float32 rows r < rows.
template <typename T>
struct FewBlockTable {
  // y[r, i] += sum_j v[i * b + j] * x[r, j] for i, j < b.
  void (*fwd)(const T* v, int64_t b, const float* x, int64_t x_stride, float* y,
              int64_t y_stride, int64_t rows);
  // dx[r, j] += sum_i dy[r, i] * v[i * b + j].
  void (*dx)(const T* v, int64_t b, const float* dy, int64_t dy_stride, float* dx,
             int64_t dx_stride, int64_t rows);
};

// A family's block-diagonal entries of Kernels (block_kernels_body.h's products and SDDMM, and
// few_rows_body.h's block loops), apart so that a family can compile them in a file of their own.
struct BlockKernels {
  BlockKernelTable<float> f32;
  BlockKernelTable<Bf16> bf16;
  // One b x b block of the block SDDMM: acc[i][j] (+)= sum_{r < rows} dy[r, i] * x[r, j], rows
  // r at dy + r * dy_stride and x + r * x_stride; acc is row-major [b][b]. `accumulate` false
  // overwrites acc.
  void (*sddmm)(int64_t b, const float* dy, int64_t dy_stride, const float* x, int64_t x_stride,
                int64_t rows, float* acc, bool accumulate);
  FewBlockTable<float> few_f32;
  FewBlockTable<Bf16> few_bf16;
};

struct Kernels {
  const char* name;
  KernelTable<float> f32;
  KernelTable<Bf16> bf16;
  BlockKernels blocks;
  FewRowTable<float> f32_few;
  FewRowTable<Bf16> bf16_few;
};

// The AVX families exist on x86-64 only (CMakeLists.txt compiles their files there); elsewhere,
// e.g. aarch64, every call runs the portable kernels.
#if defined(__x86_64__) || defined(_M_X64)
#define DYNADIAG_X86 1
const Kernels& Avx512Kernels();
const Kernels& Avx2Kernels();
#else
#define DYNADIAG_X86 0
#endif
const Kernels& PortableKernels();
// The portable family's block entries (kernels_portable_blocks.cc: compiled at -O2, where -O3
// made them 4-5x slower and took minutes to compile; CMakeLists.txt).
const BlockKernels& PortableBlockKernels();

}  // namespace dynadiag

#endif  // DYNADIAG_XLA_EXT_CPU_KERNEL_TABLE_H_
