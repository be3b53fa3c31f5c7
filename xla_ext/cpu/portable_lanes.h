// Plain-array vectors for the portable family's two files (kernels_portable.cc,
// kernels_portable_blocks.cc), included inside their anonymous namespace after the body headers
// as those are. No include guard and no includes.

// W float32 lanes in a plain array; kRegisters only sizes the tiles (as the AVX-512 family's).
template <int W>
struct Lanes {
  struct Reg {
    float v[W];
  };
  using Half = Lanes<W / 2>;
  static constexpr int kWidth = W;
  static constexpr int kRegisters = 32;

  static Reg Zero() { return Reg{}; }
  template <typename T>
  static Reg Load(const T* p) {
    Reg r;
    for (int l = 0; l < W; ++l) r.v[l] = ToFloat(p[l]);
    return r;
  }
  static Reg Add(Reg a, const Reg& b) {
    for (int l = 0; l < W; ++l) a.v[l] += b.v[l];
    return a;
  }
  // Lane i: the sum of the lanes of acc[i].
  static Reg SumLanes(const Reg* acc) {
    Reg r{};
    for (int i = 0; i < W; ++i) {
      for (int l = 0; l < W; ++l) r.v[i] += acc[i].v[l];
    }
    return r;
  }
  static Reg Broadcast(const float* p) {
    Reg r;
    for (int l = 0; l < W; ++l) r.v[l] = *p;
    return r;
  }
  static Reg Fma(const Reg& a, const Reg& b, Reg c) {
    for (int l = 0; l < W; ++l) c.v[l] += a.v[l] * b.v[l];
    return c;
  }
  static void Store(float* p, const Reg& v) {
    for (int l = 0; l < W; ++l) p[l] = v.v[l];
  }
  static void Store(Bf16* p, const Reg& v) {
    for (int l = 0; l < W; ++l) FromFloat(v.v[l], p + l);
  }
  static void StoreStream(float* p, const Reg& v) { Store(p, v); }
  static void Fence() {}
};

