// The block-diagonal kernels, written once over a vector type and instantiated by every
// instruction-set file (kernels_{avx512,avx2,portable}.cc) inside its own anonymous namespace,
// after it has defined DYNADIAG_TARGET (its target attribute) and its vector types. The AVX-512
// and AVX2 kernels are therefore the same code over 16- and 8-lane registers, and the portable
// family (plain arrays with the AVX-512 tiling) runs the 16-lane tiling on any CPU, so the tests
// cover it where no AVX-512 is at hand. No include guard and no includes: the including file
// provides <algorithm>, <cstdint> and kernel_table.h, and includes this once.
//
// A vector type V provides `Reg`, `kWidth` (float32 lanes), `kRegisters` (vector registers of the
// family), `Half` (a type of kWidth / 2 lanes, for blocks narrower than kWidth) and the static
// functions Zero(), Load(p), Broadcast(p), Fma(a, b, c) = a * b + c, Store(float*, v) and
// Store(Bf16*, v) (rounded to nearest even).
//
// Both products are small dense GEMMs on a register tile of MR rows x NV vectors of output
// columns: per input column j, NV loads of packed values and MR broadcasts feed MR * NV FMAs (6 x 2
// ymm with AVX2: 8 loads for 12 FMAs, the shape of a dense GEMM's micro-kernel).

// Rows of a register tile with NV vectors per row: about three quarters of the registers hold
// accumulators, the rest the values and a broadcast. Capped at 12 rows: each row is one more
// pointer into `in`.
// Register tiles are arrays indexed by compile-time loops: they are unrolled early, so that the
// arrays become registers.
#define DYNADIAG_UNROLL _Pragma("GCC unroll 16")

template <class V, int NV>
constexpr int kTileRows = std::min(12, V::kRegisters * 3 / 4 / NV);

// The largest power of two below n (1 for n <= 2): the first tile of the ragged rows after the
// full tiles, which then take tiles of H, H / 2, ..., 1 rows.
constexpr int TailRows(int n) {
  int h = 1;
  while (h * 2 < n) h *= 2;
  return h;
}

// Output columns per register tile for blocks of b columns: one vector of Half below kWidth,
// one vector at kWidth, two above (b is a power of two, at least 8).
template <class V>
int64_t TileColumns(int64_t b) {
  if (b < V::kWidth) return V::Half::kWidth;
  return b == V::kWidth ? V::kWidth : 2 * V::kWidth;
}

// Panels of output block o are entry_begin[o] * b * b floats into `panels`; inside, for every
// tile of nr output columns n, the entries' [b][nr] panels one after the other:
// panel[j][i] = input column j to output column n + i of the entry's block.
template <class V, typename T>
DYNADIAG_TARGET void BlockPack(const BlockPlanView& plan, const T* values, float* panels) {
  const int64_t b = plan.b, bb = b * b, nr = TileColumns<V>(b);
  for (int64_t o = 0; o < plan.num_out_blocks; ++o) {
    const int64_t first = plan.entry_begin[o], count = plan.entry_begin[o + 1] - first;
    float* dst = panels + first * bb;
    for (int64_t n = 0; n < b; n += nr) {
      for (int64_t e = 0; e < count; ++e) {
        const T* v = values + plan.value_block[first + e] * bb;
        for (int64_t j = 0; j < b; ++j, dst += nr) {
          if (plan.transpose) {
            for (int64_t i = 0; i < nr; ++i) dst[i] = ToFloat(v[(n + i) * b + j]);
          } else {
            for (int64_t i = 0; i < nr; ++i) dst[i] = ToFloat(v[j * b + n + i]);
          }
        }
      }
    }
  }
}

// MR rows x NV vectors of output columns, summed over `count` entries that read the input blocks
// `in_block`. One output block's column tile: vector v's weight for input column j at panel + (j
// NV + v) kWidth, its outputs at out + v kWidth. `Group`: each vector its own block's panel (panel
// + v panel_gap + j kWidth) and columns (out + v out_gap). `stream`: `out` is float32 with
// every vector aligned, written with streaming stores.
template <class V, int NV, int MR, bool Group, typename T>
DYNADIAG_TARGET void ProductTile(const float* panel, int64_t panel_gap, int64_t b, int64_t count,
                                 const int32_t* in_block, const float* in, int64_t in_width,
                                 T* out, int64_t out_gap, int64_t out_width, bool stream) {
  using Reg = typename V::Reg;
  constexpr int64_t step = Group ? V::kWidth : NV * V::kWidth;
  if constexpr (!Group) panel_gap = out_gap = V::kWidth;
  Reg acc[MR][NV];
  DYNADIAG_UNROLL
  for (int r = 0; r < MR; ++r) {
    DYNADIAG_UNROLL
    for (int v = 0; v < NV; ++v) acc[r][v] = V::Zero();
  }
  for (int64_t e = 0; e < count; ++e) {
    const float* src = in + in_block[e] * b;
    for (int64_t j = 0; j < b; ++j, panel += step) {
      Reg w[NV];
      DYNADIAG_UNROLL
      for (int v = 0; v < NV; ++v) w[v] = V::Load(panel + v * panel_gap);
      DYNADIAG_UNROLL
      for (int r = 0; r < MR; ++r) {
        const Reg a = V::Broadcast(src + r * in_width + j);
        DYNADIAG_UNROLL
        for (int v = 0; v < NV; ++v) acc[r][v] = V::Fma(a, w[v], acc[r][v]);
      }
    }
  }
  DYNADIAG_UNROLL
  for (int r = 0; r < MR; ++r) {
    DYNADIAG_UNROLL
    for (int v = 0; v < NV; ++v) {
      T* p = out + r * out_width + v * out_gap;
      if constexpr (std::is_same_v<T, float>) {
        if (stream) {
          V::StoreStream(p, acc[r][v]);
          continue;
        }
      }
      V::Store(p, acc[r][v]);
    }
  }
}

// A tile's arguments but the rows: where its panels and outputs are (ProductTile).
struct TileSpan {
  const float* panel;
  int64_t panel_gap, count;
  const int32_t* in_block;
  int64_t out_gap;
};

// `rows` (< 2 H) ragged rows: a tile of H rows if they fill one, then the rest with H / 2.
template <class V, int NV, bool Group, int H, typename T>
DYNADIAG_TARGET void ProductTail(const TileSpan& t, int64_t b, const float* in, int64_t in_width,
                                 T* out, int64_t out_width, int64_t rows, bool stream) {
  if constexpr (H >= 1) {
    if (rows >= H) {
      ProductTile<V, NV, H, Group>(t.panel, t.panel_gap, b, t.count, t.in_block, in, in_width,
                                   out, t.out_gap, out_width, stream);
      in += H * in_width;
      out += H * out_width;
      rows -= H;
    }
    ProductTail<V, NV, Group, H / 2>(t, b, in, in_width, out, out_width, rows, stream);
  }
}

// Every row: tiles of the family's MR rows, then the ragged rest. Not inlined: inlined three
// times into ProductTiles, its outer loops spilled registers, which cost the blocks of 8 (eight
// inner steps per entry) 3-7% where no block has a group.
template <class V, int NV, bool Group, typename T>
__attribute__((noinline)) DYNADIAG_TARGET void ProductRows(const TileSpan& t, int64_t b,
                                                           const float* in, int64_t in_width,
                                                           T* out, int64_t out_width,
                                                           int64_t rows, bool stream) {
  constexpr int MR = kTileRows<V, NV>;
  int64_t r = 0;
  for (; r + MR <= rows; r += MR) {
    ProductTile<V, NV, MR, Group>(t.panel, t.panel_gap, b, t.count, t.in_block,
                                  in + r * in_width, in_width, out + r * out_width, t.out_gap,
                                  out_width, stream);
  }
  ProductTail<V, NV, Group, TailRows(MR)>(t, b, in + r * in_width, in_width,
                                          out + r * out_width, out_width, rows - r, stream);
}

// Blocks of a group (BlockPlanView::group) computed together per tile: 4 with 32 registers
// (6 rows x 4 vectors: 10 loads for 24 FMAs, against 13 for 12 one block at a time), else 2.
template <class V>
constexpr int kGroupTile = V::kRegisters >= 32 ? 4 : 2;

// Output block by output block, column tile by column tile; the rows run innermost, so a tile's
// panels (count * b * nr floats) stay in L1 while every row of the chunk passes. With `stream`, a
// float32 output whose vectors are all aligned is written with streaming stores: each element is
// written once, so reading its cache line first (what a plain store does) only adds traffic.
// `Grouped` (blocks one vector wide, NV = 1): the blocks of a group share their tiles.
template <class V, int NV, bool Grouped, typename T>
DYNADIAG_TARGET void ProductTiles(const BlockPlanView& plan, const float* panels, const float* in,
                                  int64_t in_width, T* out, int64_t out_width, int64_t rows,
                                  bool stream) {
  constexpr int64_t nr = NV * V::kWidth;
  const int64_t b = plan.b, bb = b * b;
  constexpr uintptr_t kAlign = sizeof(float) * V::kWidth;
  stream = stream && std::is_same_v<T, float> &&
           reinterpret_cast<uintptr_t>(out) % kAlign == 0 && out_width % V::kWidth == 0;
  for (int64_t o = 0; o < plan.num_out_blocks; ++o) {
    const int64_t first = plan.entry_begin[o], count = plan.entry_begin[o + 1] - first;
    int64_t members = Grouped ? plan.group[o] : 1;
    if (members == 0) continue;  // computed with the first block of its group
    if constexpr (Grouped) {
      const int64_t step = plan.group_step[o];
      TileSpan t{panels + first * bb, (plan.entry_begin[o + step] - first) * bb, count,
                 plan.in_block + first, step * b};
      T* dst = out + o * b;
      constexpr int G = kGroupTile<V>;
      for (; members >= G; members -= G, t.panel += G * t.panel_gap, dst += G * t.out_gap) {
        ProductRows<V, G, true>(t, b, in, in_width, dst, out_width, rows, stream);
      }
      if (G > 2 && members >= 2) {
        ProductRows<V, 2, true>(t, b, in, in_width, dst, out_width, rows, stream);
        members -= 2;
        t.panel += 2 * t.panel_gap;
        dst += 2 * t.out_gap;
      }
      if (members == 1) {
        ProductRows<V, 1, false>(t, b, in, in_width, dst, out_width, rows, stream);
      }
      continue;
    }
    for (int64_t n = 0; n < b; n += nr) {
      const TileSpan t{panels + first * bb + n * count * b, 0, count, plan.in_block + first, 0};
      ProductRows<V, NV, false>(t, b, in, in_width, out + o * b + n, out_width, rows, stream);
    }
  }
  if (stream) V::Fence();  // the streamed lines reach memory before the task reports done
}

template <class V, typename T>
DYNADIAG_TARGET void BlockProduct(const BlockPlanView& plan, const float* panels, const float* in,
                                  int64_t in_width, T* out, int64_t out_width, int64_t rows,
                                  bool stream) {
  if (plan.b < V::kWidth) {
    ProductTiles<typename V::Half, 1, true>(plan, panels, in, in_width, out, out_width, rows,
                                            stream);
  } else if (plan.b == V::kWidth) {
    ProductTiles<V, 1, true>(plan, panels, in, in_width, out, out_width, rows, stream);
  } else {
    ProductTiles<V, 2, false>(plan, panels, in, in_width, out, out_width, rows, stream);
  }
}

// acc[i][v] (+)= sum_r dy[r, i] * x[r, v-th vector] for MR rows i of the block and NV vectors of
// its columns: per row of the batch, NV loads of x and MR broadcasts of dy feed MR * NV FMAs.
template <class V, int NV, int MR>
DYNADIAG_TARGET void SddmmTile(const float* dy, int64_t dy_stride, const float* x,
                               int64_t x_stride, int64_t rows, float* acc, int64_t acc_stride,
                               bool accumulate) {
  using Reg = typename V::Reg;
  Reg c[MR][NV];
  DYNADIAG_UNROLL
  for (int i = 0; i < MR; ++i) {
    DYNADIAG_UNROLL
    for (int v = 0; v < NV; ++v) {
      c[i][v] = accumulate ? V::Load(acc + i * acc_stride + v * V::kWidth) : V::Zero();
    }
  }
  for (int64_t r = 0; r < rows; ++r, dy += dy_stride, x += x_stride) {
    Reg xv[NV];
    DYNADIAG_UNROLL
    for (int v = 0; v < NV; ++v) xv[v] = V::Load(x + v * V::kWidth);
    DYNADIAG_UNROLL
    for (int i = 0; i < MR; ++i) {
      const Reg a = V::Broadcast(dy + i);
      DYNADIAG_UNROLL
      for (int v = 0; v < NV; ++v) c[i][v] = V::Fma(a, xv[v], c[i][v]);
    }
  }
  DYNADIAG_UNROLL
  for (int i = 0; i < MR; ++i) {
    DYNADIAG_UNROLL
    for (int v = 0; v < NV; ++v) V::Store(acc + i * acc_stride + v * V::kWidth, c[i][v]);
  }
}

// `count` (< 2 H) ragged block rows, as ProductTail.
template <class V, int NV, int H>
DYNADIAG_TARGET void SddmmTail(const float* dy, int64_t dy_stride, const float* x,
                               int64_t x_stride, int64_t rows, float* acc, int64_t acc_stride,
                               bool accumulate, int64_t count) {
  if constexpr (H >= 1) {
    if (count >= H) {
      SddmmTile<V, NV, H>(dy, dy_stride, x, x_stride, rows, acc, acc_stride, accumulate);
      dy += H;
      acc += H * acc_stride;
      count -= H;
    }
    SddmmTail<V, NV, H / 2>(dy, dy_stride, x, x_stride, rows, acc, acc_stride, accumulate,
                            count);
  }
}

// Column tile by column tile (its x columns stay in L1), then every tile of block rows.
template <class V, int NV>
DYNADIAG_TARGET void SddmmTiles(int64_t b, const float* dy, int64_t dy_stride, const float* x,
                                int64_t x_stride, int64_t rows, float* acc, bool accumulate) {
  constexpr int MR = kTileRows<V, NV>;
  constexpr int64_t nr = NV * V::kWidth;
  for (int64_t n = 0; n < b; n += nr) {
    int64_t i = 0;
    for (; i + MR <= b; i += MR) {
      SddmmTile<V, NV, MR>(dy + i, dy_stride, x + n, x_stride, rows, acc + i * b + n, b,
                           accumulate);
    }
    SddmmTail<V, NV, TailRows(MR)>(dy + i, dy_stride, x + n, x_stride, rows, acc + i * b + n, b,
                                   accumulate, b - i);
  }
}

template <class V>
DYNADIAG_TARGET void BlockSddmm(int64_t b, const float* dy, int64_t dy_stride, const float* x,
                                int64_t x_stride, int64_t rows, float* acc, bool accumulate) {
  if (b < V::kWidth) {
    SddmmTiles<typename V::Half, 1>(b, dy, dy_stride, x, x_stride, rows, acc, accumulate);
  } else if (b == V::kWidth) {
    SddmmTiles<V, 1>(b, dy, dy_stride, x, x_stride, rows, acc, accumulate);
  } else {
    SddmmTiles<V, 2>(b, dy, dy_stride, x, x_stride, rows, acc, accumulate);
  }
}

// The entries of the instruction-set file's Kernels table, for vector type V.
template <class V>
constexpr BlockKernelTable<float> kBlockTableF32{BlockPack<V, float>, BlockProduct<V, float>};
template <class V>
constexpr BlockKernelTable<Bf16> kBlockTableBf16{BlockPack<V, Bf16>, BlockProduct<V, Bf16>};
