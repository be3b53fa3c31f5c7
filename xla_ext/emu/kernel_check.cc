// Standalone check of the CUDA kernels under the SIMT emulation, without XLA or Python: first the
// emulation's own checks (simt_selftest.cc), then the forward, dx and dvalues launch sequences on
// small cases against a dense float64 reference, each under the emulation's checks (shared memory,
// every output element written once). tests/test_cuda_checks.py builds it with -fsanitize=thread,
// where any data race in the kernels (a missing barrier) is reported, with
// -fsanitize=address,undefined, and with the planted bugs of cuda/diag_kernels.cuh.
//
//   kernel_check [options]          exit status 0 when every check passes and every result matches
//     --dtype T[,T...]                  only these element types (float32, float16, bfloat16)
//     --seed N, --resident N             the block schedule (emu::set_schedule)
//   kernel_check diverge            runs a kernel with a divergent __syncthreads (must abort)
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda/diag_launch.cuh"
#include "emu/emu_launcher.h"

int simt_selftest();

namespace {

using dynadiag::cuda::ProductArgs;
using dynadiag::cuda::SddmmArgs;
using dynadiag::emu_host::EmuLauncher;

float to_f(float v) { return v; }
float to_f(__half v) { return __half2float(v); }
float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
template <class T>
T from_f(float v) {
  return dynadiag::cuda::from_float<T>(v);
}
template <class T>
double eps();
template <>
double eps<float>() { return 1e-5; }
template <>
double eps<__half>() { return 1.0 / 1024; }
template <>
double eps<__nv_bfloat16>() { return 1.0 / 128; }

struct Case {
  int64_t rows;
  int in, out;
  std::vector<int32_t> offsets;
  const char* name;
};

struct Dense {
  std::vector<double> w;  // [out, in]
};

template <class T>
Dense densify(const Case& c, const std::vector<T>& values) {
  const int P = std::max(c.in, c.out), D = std::min(c.in, c.out);
  const bool tall = c.out >= c.in;
  Dense d{std::vector<double>(size_t(c.out) * c.in, 0.0)};
  for (size_t k = 0; k < c.offsets.size(); ++k)
    for (int t = 0; t < D; ++t) {
      const int m = (t + c.offsets[k]) % P;
      const int r = tall ? m : t, col = tall ? t : m;
      d.w[size_t(r) * c.in + col] += to_f(values[k * D + t]);
    }
  return d;
}

int failures = 0;
int tc_blocks = 0, diag_blocks = 0;

// Largest |got - ref| / (eps * (|terms| sum) + tiny) over all entries; <= 1 passes.
template <class T>
void compare(const char* what, const Case& c, const std::vector<T>& got, const std::vector<double>& ref,
             const std::vector<double>& mag) {
  double worst = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double err = std::fabs(to_f(got[i]) - ref[i]);
    const double bound = 2 * eps<T>() * (mag[i] + std::fabs(ref[i])) + 1e-6;
    if (!(err <= bound)) worst = std::max(worst, std::isnan(err) ? 1e30 : err / bound);
  }
  if (worst > 0) {
    ++failures;
    std::printf("FAIL %-8s %-22s rows=%lld in=%d out=%d K=%zu  worst err/bound %.3g\n", what, c.name,
                static_cast<long long>(c.rows), c.in, c.out, c.offsets.size(), worst);
  }
}

// The emulation's checks of a launch sequence (shared memory, output writes, launch errors).
void check_launch(EmuLauncher& launch, const char* what, const Case& c) {
  if (launch.finish() == emu::Error::kSuccess) return;
  ++failures;
  std::printf("FAIL %-8s %-22s rows=%lld in=%d out=%d K=%zu  %s\n", what, c.name, static_cast<long long>(c.rows),
              c.in, c.out, c.offsets.size(), launch.message().c_str());
}

template <class T>
void run_case(const Case& c, std::mt19937& rng) {
  const int P = std::max(c.in, c.out), D = std::min(c.in, c.out);
  const int K = static_cast<int>(c.offsets.size());
  std::uniform_real_distribution<float> uni(-1.f, 1.f);
  auto fill = [&](size_t n) {
    std::vector<T> v(n);
    for (auto& e : v) e = from_f<T>(uni(rng));
    return v;
  };
  const std::vector<T> x = fill(size_t(c.rows) * c.in), dy = fill(size_t(c.rows) * c.out),
                       values = fill(size_t(K) * D);
  const Dense W = densify(c, values);
  const bool tc = dynadiag::cuda::kHasTensorCorePath<T>;

  // forward and dx through the same launch sequence, with the operands swapped
  for (int transpose = 0; transpose < 2; ++transpose) {
    const int q_dim = transpose ? c.out : c.in, o_dim = transpose ? c.in : c.out;
    const std::vector<T>& in = transpose ? dy : x;
    std::vector<double> ref(size_t(c.rows) * o_dim, 0.0), mag(ref.size(), 0.0);
    for (int64_t b = 0; b < c.rows; ++b)
      for (int o = 0; o < o_dim; ++o)
        for (int q = 0; q < q_dim; ++q) {
          const double w = transpose ? W.w[size_t(q) * c.in + o] : W.w[size_t(o) * c.in + q];
          const double v = to_f(in[b * q_dim + q]);
          ref[b * o_dim + o] += w * v;
          mag[b * o_dim + o] += std::fabs(w * v);
        }
    const auto plan = dynadiag::cuda::plan_product(c.in, c.out, transpose, K, tc);
    std::vector<uint8_t> ws(plan.workspace_bytes + 1);
    std::vector<T> out(ref.size(), from_f<T>(12345.f));
    ProductArgs<T> a{};
    a.in = in.data();
    a.out = out.data();
    a.values = values.data();
    a.offsets = c.offsets.data();
    a.rows = c.rows;
    a.q_dim = q_dim;
    a.o_dim = o_dim;
    a.P = plan.P;
    a.D = plan.D;
    a.K = K;
    EmuLauncher launch;
    dynadiag::cuda::launch_product(launch, plan, a, ws.data());
    check_launch(launch, transpose ? "dx" : "forward", c);
    compare(transpose ? "dx" : "forward", c, out, ref, mag);
    if (plan.tiles && K > 0 && c.rows > 0) {
      const int32_t* path = reinterpret_cast<const int32_t*>(ws.data() + plan.path_at);
      for (int ob = 0; ob < plan.n_ob; ++ob)
        (path[ob] == dynadiag::cuda::kPathTensorCore ? tc_blocks : diag_blocks) += 1;
    }
  }

  // dvalues[k, t] = sum_b dy[b, row] x[b, col]
  std::vector<double> ref(size_t(K) * D, 0.0), mag(ref.size(), 0.0);
  const bool tall = c.out >= c.in;
  for (int k = 0; k < K; ++k)
    for (int t = 0; t < D; ++t) {
      const int m = (t + c.offsets[k]) % P;
      const int r = tall ? m : t, col = tall ? t : m;
      for (int64_t b = 0; b < c.rows; ++b) {
        const double p = double(to_f(dy[b * c.out + r])) * to_f(x[b * c.in + col]);
        ref[size_t(k) * D + t] += p;
        mag[size_t(k) * D + t] += std::fabs(p);
      }
    }
  const auto plan = dynadiag::cuda::plan_sddmm(c.rows, c.in, c.out, K);
  std::vector<uint8_t> ws(plan.workspace_bytes + 1);
  std::vector<T> out(ref.size(), from_f<T>(12345.f));
  SddmmArgs<T> a{tall ? x.data() : dy.data(), tall ? dy.data() : x.data(), c.offsets.data(), out.data(),
                 nullptr, c.rows, 0, P, D, K, 1};
  EmuLauncher launch;
  dynadiag::cuda::launch_sddmm(launch, plan, a, ws.data());
  check_launch(launch, "dvalues", c);
  compare("dvalues", c, out, ref, mag);
}

std::vector<int32_t> random_offsets(int P, int K, std::mt19937& rng) {
  std::vector<int32_t> all(P);
  for (int i = 0; i < P; ++i) all[i] = i;
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(K);
  return all;
}

std::vector<int32_t> band(int start, int K, int P) {
  std::vector<int32_t> o(K);
  for (int i = 0; i < K; ++i) o[i] = (start + i) % P;
  return o;
}

std::vector<Case> cases(std::mt19937& rng) {
  std::vector<Case> cs;
  // shapes: square, tall, wide, odd sizes, a batch spanning two 64-row tiles
  const int shapes[][3] = {{7, 33, 33}, {1, 1, 1}, {5, 17, 40}, {70, 40, 17}, {3, 48, 48}, {9, 7, 33}};
  for (const auto& s : shapes) {
    const int rows = s[0], in = s[1], out = s[2];
    const int P = std::max(in, out);
    cs.push_back({rows, in, out, random_offsets(P, std::max(1, P / 5), rng), "random"});
    // top diagonal = 1 mod 16: it alone touches some tiles, in one corner entry
    cs.push_back({rows, in, out, band(16 * (P / 48) + 2, std::min(P, 16), P), "band"});
  }
  cs.push_back({6, 33, 33, band(0, 33, 33), "K=P"});
  cs.push_back({6, 20, 36, {3, 3, 3, 35, 0, 3}, "repeated"});
  cs.push_back({4, 36, 20, {}, "K=0"});
  cs.push_back({0, 36, 20, {1, 2}, "rows=0"});
  cs.push_back({600, 40, 24, band(5, 8, 40), "split dvalues"});
  return cs;
}

// A kernel where half of the block waits at a different barrier than the other half.
__global__ void divergent_kernel(int* out) {
  if (threadIdx.x < 16) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 1;
}

// Warp sums with both shuffle flavours, checked against the closed form.
__global__ void shuffle_kernel(int* out) {
  int v = static_cast<int>(threadIdx.x);
  for (int s = 16; s > 0; s /= 2) v += __shfl_down_sync(0xffffffffu, v, s);
  int x = static_cast<int>(threadIdx.x);
  for (int s = 1; s < 32; s *= 2) x += __shfl_xor_sync(0xffffffffu, x, s);
  if (threadIdx.x % 32 == 0) out[threadIdx.x / 32] = v;
  out[2 + threadIdx.x] = x;
}

void check_shuffles() {
  std::vector<int> out(66, 0);
  emu::launch(dim3(1), dim3(64), shuffle_kernel, out.data());
  const int lo = 31 * 32 / 2, hi = lo + 32 * 32;
  bool ok = out[0] == lo && out[1] == hi;
  for (int t = 0; t < 64; ++t) ok = ok && out[2 + t] == (t < 32 ? lo : hi);
  if (!ok) {
    ++failures;
    std::printf("FAIL shuffles\n");
  }
}

// The emulation's half and bfloat16 conversions: every finite value survives a round trip, and
// a float exactly between two neighbours rounds to the even one (and just off the midpoint, to
// the nearer one).
template <class H>
void check_conversions(float (*to_float)(H), H (*from_float)(float), const char* name) {
  int bad = 0;
  for (uint32_t h = 0; h < 0xffff; ++h) {
    const H a{static_cast<uint16_t>(h)}, b{static_cast<uint16_t>(h + 1)};
    const float fa = to_float(a), fb = to_float(b);
    if (!std::isfinite(fa) || !std::isfinite(fb)) continue;
    bad += from_float(fa).bits != h;
    if ((h & 0x7fff) == 0x7fff || std::signbit(fa) != std::signbit(fb)) continue;
    const float mid = fa + 0.5f * (fb - fa);  // exact; (fa + fb) / 2 would overflow
    const uint16_t even = (h % 2 == 0) ? h : h + 1;
    bad += from_float(mid).bits != even;
    bad += from_float(std::nextafter(mid, fa)).bits != h;
    bad += from_float(std::nextafter(mid, fb)).bits != h + 1;
  }
  if (bad) {
    ++failures;
    std::printf("FAIL %s conversions: %d wrong\n", name, bad);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "diverge") == 0) {
    std::vector<int> out(32);
    emu::launch(dim3(1), dim3(32), divergent_kernel, out.data());
    std::printf("divergent barrier not detected\n");
    return 3;
  }
  std::string dtype = "all";
  unsigned long long seed = 0x5eed;
  int resident = 3;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string opt = argv[i];
    if (opt == "--dtype") {
      dtype = argv[i + 1];
    } else if (opt == "--seed") {
      seed = std::strtoull(argv[i + 1], nullptr, 0);
    } else if (opt == "--resident") {
      resident = std::atoi(argv[i + 1]);
    } else {
      std::printf("unknown option %s\n", argv[i]);
      return 2;
    }
  }
  // --dtype: "all" or a comma-separated list of float32, float16, bfloat16
  std::vector<std::string> dtypes = {"float32", "float16", "bfloat16"};
  if (dtype != "all") {
    dtypes.clear();
    for (std::size_t start = 0; start <= dtype.size();) {
      const std::size_t end = std::min(dtype.find(',', start), dtype.size());
      dtypes.push_back(dtype.substr(start, end - start));
      start = end + 1;
    }
  }
  for (const auto& name : dtypes) {
    if (name != "float32" && name != "float16" && name != "bfloat16") {
      std::printf("unknown dtype %s\n", name.c_str());
      return 2;
    }
  }
  emu::set_schedule(seed, resident);
  failures += simt_selftest();
  std::mt19937 rng(0);
  check_shuffles();
  check_conversions<__half>(__half2float, __float2half_rn, "half");
  check_conversions<__nv_bfloat16>(__bfloat162float, __float2bfloat16_rn, "bfloat16");
  const auto cs = cases(rng);
  for (const auto& name : dtypes) {
    if (name == "float32") {
      for (const auto& c : cs) run_case<float>(c, rng);
    } else if (name == "float16") {
      for (const auto& c : cs) run_case<__half>(c, rng);
    } else {
      for (const auto& c : cs) run_case<__nv_bfloat16>(c, rng);
    }
  }
  std::printf("%zu cases x %zu dtypes x 3 products, %d failures; output blocks: %d tensor-core, %d diagonal\n",
              cs.size(), dtypes.size(), failures, tc_blocks, diag_blocks);
  const bool both_paths = dtype == "float32" || (tc_blocks > 0 && diag_blocks > 0);
  return failures == 0 && both_paths ? 0 : 1;
}
