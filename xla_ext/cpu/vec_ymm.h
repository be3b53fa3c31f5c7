// Eight float32 lanes in a ymm register: the vector type of block_kernels_body.h for the AVX2
// family, and the half-width type of the AVX-512 family. Like the body, it is included inside the
// instruction-set file's anonymous namespace after DYNADIAG_TARGET (no include guard; the file
// provides <immintrin.h> and kernel_table.h).

// float32 -> bfloat16 bits in the low half of each 32-bit lane (round to nearest even, as XLA
// converts; NaN stays a quiet NaN).
DYNADIAG_TARGET inline __m256i RoundToBf16(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i hi = _mm256_srli_epi32(u, 16);
  const __m256i bias = _mm256_add_epi32(_mm256_and_si256(hi, _mm256_set1_epi32(1)),
                                        _mm256_set1_epi32(0x7fff));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
}

// kRegisterCount: the vector registers of the family (16 with AVX2, 32 with AVX-512VL).
template <int kRegisterCount>
struct Ymm {
  using Reg = __m256;
  using Half = Ymm;  // blocks are never narrower than 8 columns
  static constexpr int kWidth = 8;
  static constexpr int kRegisters = kRegisterCount;

  DYNADIAG_TARGET static Reg Zero() { return _mm256_setzero_ps(); }
  DYNADIAG_TARGET static Reg Load(const float* p) { return _mm256_loadu_ps(p); }
  DYNADIAG_TARGET static Reg Load(const Bf16* p) {  // widened: bfloat16 is a float's top half
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  DYNADIAG_TARGET static Reg Add(Reg a, Reg b) { return _mm256_add_ps(a, b); }
  // Lane i: the sum of the 8 lanes of acc[i] (a transpose and add in three steps).
  DYNADIAG_TARGET static Reg SumLanes(const Reg* acc) {
    // Per 128-bit half: s0 holds the partial sums of acc[0..3], s1 those of acc[4..7].
    const __m256 s0 =
        _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
    const __m256 s1 =
        _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20),
                         _mm256_permute2f128_ps(s0, s1, 0x31));
  }
  DYNADIAG_TARGET static Reg Broadcast(const float* p) { return _mm256_broadcast_ss(p); }
  DYNADIAG_TARGET static Reg Fma(Reg a, Reg b, Reg c) { return _mm256_fmadd_ps(a, b, c); }
  DYNADIAG_TARGET static void Store(float* p, Reg v) { _mm256_storeu_ps(p, v); }
  // p aligned to 32 bytes: written without reading its cache line first.
  DYNADIAG_TARGET static void StoreStream(float* p, Reg v) { _mm256_stream_ps(p, v); }
  DYNADIAG_TARGET static void Fence() { _mm_sfence(); }
  DYNADIAG_TARGET static void Store(Bf16* p, Reg v) {
    const __m256i r = RoundToBf16(v);  // < 2^16 per lane: the unsigned pack is exact
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
  }
};
