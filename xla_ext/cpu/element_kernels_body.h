// The element-diagonal kernels (the KernelTable of kernel_table.h), written once over a 16-lane
// operations type and instantiated by every instruction-set file (kernels_{avx512,avx2,portable}.cc)
// inside its own anonymous namespace, after it has defined DYNADIAG_TARGET and its operations
// type, so each family compiles the same loops with its own target attribute. No include guard
// and no includes (as block_kernels_body.h).
//
// An operations type E holds kLanes float32 lanes in `Reg` (one zmm, two ymm, or a plain array)
// under a lane mask `Mask` (bit l = lane l), and provides:
//   kRows       rows of accumulators per tile in the product and the fused backward (the largest
//               tile; row counts below it take tiles of 4 rows, then single rows);
//   kGroup      SDDMM segments accumulated together (kSegmentGroup is a multiple of it);
//   kSumChains  (fused backward only) independent partial sums of a segment's dvalues (more
//               chains shorten the dependency through acc[s]);
//   XTile<R>    (fused backward only) the R tiles of x held while the backward walks a tile's
//               segments: registers where the family has enough, L1 otherwise (Set(r, v), Get(r));
//   Zero(), Fma(a, b, c) = a * b + c, Add(a, b);
//   Load(const T*, Mask) (lanes outside the mask read nothing and give 0) and
//   Store(T*, Reg, Mask) (bfloat16 rounded to nearest even) for T float and Bf16;
//   LoadPacked(const float*) and StorePacked(float*, Reg): one aligned row of packed floats.

template <class E>
DYNADIAG_TARGET inline typename E::Mask TileMask(int64_t width, int64_t first) {
  const int64_t n = std::min<int64_t>(kLanes, width - first);
  return static_cast<typename E::Mask>((1u << n) - 1u);
}

template <class E>
DYNADIAG_TARGET inline typename E::Mask SegmentMask(const Segment& seg) {
  return static_cast<typename E::Mask>(seg.mask);
}

template <class E, typename T>
DYNADIAG_TARGET void Pack(const PlanView& plan, const T* values, float* vp) {
  for (int64_t s = 0; s < plan.num_segs; ++s) {
    const Segment& seg = plan.segs[s];
    E::StorePacked(vp + s * kLanes, E::Load(values + seg.vbase, SegmentMask<E>(seg)));
  }
}

// R rows: every tile keeps R accumulators in registers; a segment's packed values are loaded
// once and reused for the R rows, so each FMA costs one (unaligned) load of `in`.
template <class E, int R, typename T>
DYNADIAG_TARGET void ProductRows(const PlanView& plan, const float* vp, const T* in,
                                 int64_t in_width, T* out, int64_t out_width) {
  using Reg = typename E::Reg;
  const Segment* segs = plan.segs;
  for (int64_t tile = 0; tile < plan.num_tiles; ++tile) {
    Reg acc[R];
    for (int r = 0; r < R; ++r) acc[r] = E::Zero();
    const int64_t end = plan.tile_begin[tile + 1];
    for (int64_t s = plan.tile_begin[tile]; s < end; ++s) {
      const Reg v = E::LoadPacked(vp + s * kLanes);
      const auto m = SegmentMask<E>(segs[s]);
      const T* src = in + segs[s].c0;
      for (int r = 0; r < R; ++r) acc[r] = E::Fma(v, E::Load(src + r * in_width, m), acc[r]);
    }
    const int64_t o0 = tile * kLanes;
    const auto om = TileMask<E>(out_width, o0);
    for (int r = 0; r < R; ++r) E::Store(out + r * out_width + o0, acc[r], om);
  }
}

template <class E, typename T>
DYNADIAG_TARGET void Product(const PlanView& plan, const float* vp, const T* in,
                             int64_t in_width, T* out, int64_t out_width, int64_t rows) {
  int64_t r = 0;
  for (; r + E::kRows <= rows; r += E::kRows) {
    ProductRows<E, E::kRows>(plan, vp, in + r * in_width, in_width, out + r * out_width,
                             out_width);
  }
  if constexpr (E::kRows > 4) {
    for (; r + 4 <= rows; r += 4) {
      ProductRows<E, 4>(plan, vp, in + r * in_width, in_width, out + r * out_width, out_width);
    }
  }
  for (; r < rows; ++r) {
    ProductRows<E, 1>(plan, vp, in + r * in_width, in_width, out + r * out_width, out_width);
  }
}

// Groups of kGroup segments of one tile share each load of `tiled`; their partial sums stay in
// registers for all `rows` rows.
template <class E, typename T>
DYNADIAG_TARGET void Sddmm(const PlanView& plan, const T* tiled, int64_t tiled_width,
                           const T* gathered, int64_t gathered_width, int64_t rows, float* acc) {
  using Reg = typename E::Reg;
  using Mask = typename E::Mask;
  constexpr int G = E::kGroup;
  static_assert(kSegmentGroup % G == 0, "plans are padded to groups of kSegmentGroup");
  const Segment* segs = plan.segs;
  for (int64_t tile = 0; tile < plan.num_tiles; ++tile) {
    const int64_t t0 = tile * kLanes;
    const Mask tm = TileMask<E>(tiled_width, t0);
    const int64_t end = plan.tile_begin[tile + 1];
    for (int64_t s = plan.tile_begin[tile]; s < end; s += G) {
      Reg a[G];
      const T* src[G];
      Mask m[G];
      for (int g = 0; g < G; ++g) {
        a[g] = E::LoadPacked(acc + (s + g) * kLanes);
        src[g] = gathered + segs[s + g].c0;
        m[g] = SegmentMask<E>(segs[s + g]);
      }
      for (int64_t r = 0; r < rows; ++r) {
        const Reg f = E::Load(tiled + r * tiled_width + t0, tm);
        for (int g = 0; g < G; ++g) {
          a[g] = E::Fma(f, E::Load(src[g] + r * gathered_width, m[g]), a[g]);
        }
      }
      for (int g = 0; g < G; ++g) E::StorePacked(acc + (s + g) * kLanes, a[g]);
    }
  }
}

// R rows of the fused backward: per tile, R dx accumulators in registers and R tiles of x in an
// XTile; each segment loads its dy window once per row and feeds both FMAs.
template <class E, int R, typename T>
DYNADIAG_TARGET void BackwardRows(const PlanView& plan, int64_t tile_begin, int64_t tile_end,
                                  const float* vp, const T* dy, int64_t dy_width, const T* x,
                                  T* dx, int64_t width, float* acc) {
  using Reg = typename E::Reg;
  constexpr int C = E::kSumChains;
  const Segment* segs = plan.segs;
  for (int64_t tile = tile_begin; tile < tile_end; ++tile) {
    const int64_t o0 = tile * kLanes;
    const auto tm = TileMask<E>(width, o0);
    typename E::template XTile<R> xt;
    Reg out[R];
    for (int r = 0; r < R; ++r) {
      xt.Set(r, E::Load(x + r * width + o0, tm));
      out[r] = E::Zero();
    }
    const int64_t end = plan.tile_begin[tile + 1];
    for (int64_t s = plan.tile_begin[tile]; s < end; ++s) {
      const Reg v = E::LoadPacked(vp + s * kLanes);
      const auto m = SegmentMask<E>(segs[s]);
      const T* src = dy + segs[s].c0;
      Reg a[C];
      a[0] = E::LoadPacked(acc + s * kLanes);
      for (int c = 1; c < C; ++c) a[c] = E::Zero();
      for (int r = 0; r < R; ++r) {
        const Reg w = E::Load(src + r * dy_width, m);
        out[r] = E::Fma(v, w, out[r]);
        a[r % C] = E::Fma(xt.Get(r), w, a[r % C]);
      }
      for (int c = 1; c < C; ++c) a[0] = E::Add(a[0], a[c]);
      E::StorePacked(acc + s * kLanes, a[0]);
    }
    for (int r = 0; r < R; ++r) E::Store(dx + r * width + o0, out[r], tm);
  }
}

template <class E, typename T>
DYNADIAG_TARGET void Backward(const PlanView& plan, int64_t tile_begin, int64_t tile_end,
                              const float* vp, const T* dy, int64_t dy_width, const T* x, T* dx,
                              int64_t width, int64_t rows, float* acc) {
  int64_t r = 0;
  for (; r + E::kRows <= rows; r += E::kRows) {
    BackwardRows<E, E::kRows>(plan, tile_begin, tile_end, vp, dy + r * dy_width, dy_width,
                              x + r * width, dx + r * width, width, acc);
  }
  if constexpr (E::kRows > 4) {
    for (; r + 4 <= rows; r += 4) {
      BackwardRows<E, 4>(plan, tile_begin, tile_end, vp, dy + r * dy_width, dy_width,
                         x + r * width, dx + r * width, width, acc);
    }
  }
  for (; r < rows; ++r) {
    BackwardRows<E, 1>(plan, tile_begin, tile_end, vp, dy + r * dy_width, dy_width, x + r * width,
                       dx + r * width, width, acc);
  }
}

// The family's entry points: the element kernels over E (kFused: with the fused backward;
// without it, null, and jobs run `product` and `sddmm`), the few-row element loops over F, and
// `blocks` (BlockKernelsOf, or a file's own).
template <class E, class F, bool kFused>
Kernels FamilyKernels(const char* name, const BlockKernels& blocks) {
  KernelTable<float> f32{Pack<E, float>, Product<E, float>, Sddmm<E, float>, nullptr};
  KernelTable<Bf16> bf16{Pack<E, Bf16>, Product<E, Bf16>, Sddmm<E, Bf16>, nullptr};
  if constexpr (kFused) {
    f32.backward = Backward<E, float>;
    bf16.backward = Backward<E, Bf16>;
  }
  return {name,
          f32,
          bf16,
          blocks,
          {FewTriad<float>, FewElementProduct<F, float>, FewRowDot<F>},
          {FewTriad<Bf16>, FewElementProduct<F, Bf16>, FewRowDot<F>}};
}
