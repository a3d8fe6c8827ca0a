// int4 GEMV/GEMM for a few rows on AVX2 (x86-64-v3): edge_avx2::w4a16_linear and edge_avx2::w4a8_linear (and
// edge_avx2::int4_linear, the cpu_int4 layer op that puts them in front of the Python op for decode rows).
//
// Weights are the checkpoint's own row-major format (kernels/ops/int4.py), read as they are, no repack:
//   qweight uint8 [N, K/2]   byte j of row n: k=2j in the low nibble, k=2j+1 in the high nibble
//   scales, zeros bf16 [N, K/g]   w = (q - 8) * scale + zero
//
// Both ops quantize the activations once per call, per row and group g: xq = round(x / a), a = max|x_g| / QMAX,
// and de-interleave them into even-k and odd-k planes, so the low nibbles of a run of bytes meet xq[2j..] and the
// high ones xq[2j+1..] with plain vector loads. Then, per output channel n and group g, all in integers until the
// group ends:
//   y[m, n] += (scale * a) * sum_k q_k xq_k  +  (zero - 8 scale) * (a * sum_k xq_k)
//   w4a16: xq int16 (QMAX 32767). The rounding of x is at most max|x_g| / 65534 per element: below bf16's own
//          rounding of the group's largest element (max|x_g| / 512), so bf16 activations lose nothing visible.
//          Inner step, 16 bytes = 32 weights: vpmovzxbw, a mask, a shift, two vpmaddwd and an add.
//   w4a8:  xq int8 (QMAX 127), as llama.cpp's Q8 activations. Inner step, 32 bytes = 64 weights: a load, two masks,
//          a shift, two vpmaddubsw (unsigned codes x signed activations, pairs <= 2*15*127: no saturation), one
//          16-bit add; one vpmaddwd by ones per group.
// The int32 sums of 8 groups are transposed into one vector (a tree of hadds) and meet 8 scales and 8 zeros as
// vectors. Parallel over output channels (at::parallel_for), rows in blocks of 2: a block decodes each code once;
// the weights ~8 KB ahead are prefetched.
// Compiled with -mavx2 -mfma -mf16c only, so one binary runs on every AVX2 CPU.
//
// The kernel body (between #else and #endif below) is compiled three times from this one file, which includes
// itself: for AVX2 (vpmaddwd, vpmaddubsw), under `#pragma GCC target("avxvnni")` (vpdpwssd, vpdpbusd), and under
// `target("avx512vnni,avx512vl")` (the same instructions, EVEX-encoded, still on 256-bit vectors); the call picks
// AVX-VNNI where the CPU has it (Alder Lake and later, Zen 5), else AVX512-VNNI (Cascade Lake, Ice Lake, Zen 4),
// unless EDGE_AVX2_VNNI=0. All give the same integer sums, so the same results.

#ifndef EDGE_AVX2_INT4_BODY
#define EDGE_AVX2_INT4_BODY

#include <immintrin.h>
#include <torch/library.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <optional>
#include <vector>
#include <type_traits>
#include <tuple>
#include <cstdlib>

namespace {


inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline float hsum_ps(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// The lane sums of 8 vectors as one vector: [sum(v0), ..., sum(v7)].
inline __m256i hsum8_epi32(const __m256i* v) {
  const __m256i h01 = _mm256_hadd_epi32(v[0], v[1]), h23 = _mm256_hadd_epi32(v[2], v[3]);
  const __m256i h45 = _mm256_hadd_epi32(v[4], v[5]), h67 = _mm256_hadd_epi32(v[6], v[7]);
  const __m256i a = _mm256_hadd_epi32(h01, h23), b = _mm256_hadd_epi32(h45, h67);
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

// 8 bf16 -> 8 fp32.
inline __m256 load_bf16x8(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// Prefetch `bytes` from p, a row the kernel reads a few rows later, into L2 (T1), not L1: a stream of rows brought
// into L1 evicts the activations every channel reads again. Measured on the Zen 4 (benchmarks/gguf_grids.py
// --prefetch, one process per hint, alternating): w4a8 at 2048x5632 from 42 % to 73-80 % of the read bound.
// EDGE_AVX2_PREFETCH=l1 restores the L1 hint (for that comparison).
inline bool prefetch_l1() {
  static const bool l1 = [] {
    const char* env = std::getenv("EDGE_AVX2_PREFETCH");
    return env && std::strcmp(env, "l1") == 0;
  }();
  return l1;
}

inline void prefetch_row(const char* p, int64_t bytes) {
  if (prefetch_l1()) {
    for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
  } else {
    for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T1);
  }
}

// One line of block8_a8's stream, with prefetch_row's hint.
inline void prefetch_line(const char* p) {
  if (prefetch_l1()) {
    _mm_prefetch(p, _MM_HINT_T0);
  } else {
    _mm_prefetch(p, _MM_HINT_T1);
  }
}

template <typename T>
inline __m256i loadu(const T* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// The activations of one call: xe/xo [M, K/2] quantized codes, a [M, G] their scales, xs [M, G] = a * sum xq.
template <typename Q>
struct Acts {
  const Q* xe;
  const Q* xo;
  const float* a;
  const float* xs;
};

// Quantize x [M, K] per row and group into codes of QMAX, de-interleaved into xe and xo (xo null: in order into xe);
// fills a and xs.
template <typename Q, typename T>
void quantize_acts(const T* xp, int64_t m, int64_t k, int64_t group, int qmax, Q* xe, Q* xo, float* a, float* xs) {
  const int64_t groups = k / group, half_k = k / 2;
  std::vector<float> row(static_cast<size_t>(group));
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      float amax = 0.f;
      for (int64_t i = 0; i < group; ++i) {
        row[i] = static_cast<float>(xp[r * k + g * group + i]);
        amax = std::max(amax, std::fabs(row[i]));
      }
      const float scale = amax / static_cast<float>(qmax);
      const float inverse = amax > 0.f ? static_cast<float>(qmax) / amax : 0.f;
      int32_t sum = 0;
      for (int64_t j = 0; j < group / 2; ++j) {
        const int32_t even = static_cast<int32_t>(std::nearbyint(row[2 * j] * inverse));
        const int32_t odd = static_cast<int32_t>(std::nearbyint(row[2 * j + 1] * inverse));
        if (xo != nullptr) {
          xe[r * half_k + g * group / 2 + j] = static_cast<Q>(even);
          xo[r * half_k + g * group / 2 + j] = static_cast<Q>(odd);
        } else {  // in order, one plane [M, K] (the int8 weights' kernel)
          xe[r * k + g * group + 2 * j] = static_cast<Q>(even);
          xe[r * k + g * group + 2 * j + 1] = static_cast<Q>(odd);
        }
        sum += even + odd;
      }
      a[r * groups + g] = scale;
      xs[r * groups + g] = scale * static_cast<float>(sum);
    }
  }
}

// 8 fp32 -> 8 bf16 as c10::BFloat16 rounds them (to nearest even; NaN -> 0x7FC0).
inline __m128i to_bf16x8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC00000), nan);
  const __m256i high = _mm256_srli_epi32(rounded, 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1));
}

// quantize_acts for bf16 rows into int8 codes in order (xo null), on vectors: the same codes, scales and sums
// (cvtps rounds to nearest even as nearbyint does, on the same float products). Scalar, a decode call's rounding
// of K=1536 activations took ~4 us, as long as its GEMV's arithmetic.
inline void quantize_i8_bf16(const uint16_t* xp, int64_t m, int64_t k, int64_t group, int8_t* q, float* a,
                             float* xs) {
  const int64_t groups = k / group;
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const uint16_t* x = xp + r * k + g * group;
      __m256 amax = _mm256_setzero_ps();
      for (int64_t i = 0; i < group; i += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, load_bf16x8(x + i)));
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
      const float top = _mm_cvtss_f32(m4);
      const float inverse = top > 0.f ? 127.f / top : 0.f;
      const __m256 inv = _mm256_set1_ps(inverse);
      __m256i sum = _mm256_setzero_si256();
      for (int64_t i = 0; i < group; i += 8) {
        const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(load_bf16x8(x + i), inv));
        sum = _mm256_add_epi32(sum, v);
        const __m128i p16 = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(q + r * k + g * group + i), _mm_packs_epi16(p16, p16));
      }
      const float scale = top / 127.f;
      a[r * groups + g] = scale;
      xs[r * groups + g] = scale * static_cast<float>(hsum_epi32(sum));
    }
  }
}

}  // namespace

namespace isa_plain {
#define EDGE_AVX2_VNNI 0
#include __FILE__
#undef EDGE_AVX2_VNNI
}  // namespace isa_plain

#pragma GCC push_options
#pragma GCC target("avxvnni")
namespace isa_vnni {
#define EDGE_AVX2_VNNI 1
#define EDGE_DPWSSD _mm256_dpwssd_avx_epi32
#define EDGE_DPBUSD _mm256_dpbusd_avx_epi32
#include __FILE__
#undef EDGE_DPBUSD
#undef EDGE_DPWSSD
#undef EDGE_AVX2_VNNI
}  // namespace isa_vnni
#pragma GCC pop_options

// The same two instructions on 256-bit vectors in their EVEX form (AVX512-VNNI with AVX512VL): CPUs with AVX-512
// VNNI but not AVX-VNNI (Cascade Lake, Ice Lake, Zen 4, and Zen 5 VMs whose hypervisor hides AVX-VNNI) run them.
#pragma GCC push_options
#pragma GCC target("avx512vnni,avx512vl")
namespace isa_vnni512 {
#define EDGE_AVX2_VNNI 1
#define EDGE_DPWSSD _mm256_dpwssd_epi32
#define EDGE_DPBUSD _mm256_dpbusd_epi32
#include __FILE__
#undef EDGE_DPBUSD
#undef EDGE_DPWSSD
#undef EDGE_AVX2_VNNI
}  // namespace isa_vnni512
#pragma GCC pop_options

namespace {

template <typename Q>
using Channels = void (*)(const uint8_t*, const uint16_t*, const uint16_t*, const Acts<Q>&, float*, int64_t, int64_t,
                          int64_t, int64_t, int64_t, int64_t);

// vpdpwssd and vpdpbusd where the CPU has them, unless EDGE_AVX2_VNNI=0: the same integer sums either way.
// 0: the plain AVX2 build; 1: AVX-VNNI (VEX); 2: AVX512-VNNI with AVX512VL (EVEX), where AVX-VNNI is absent.
int vnni_build() {
  static const int build = [] {
    const char* env = std::getenv("EDGE_AVX2_VNNI");
    if (env && std::strcmp(env, "0") == 0) return 0;
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avxvnni")) return 1;
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") ? 2 : 0;
  }();
  return build;
}

bool use_vnni() { return vnni_build() != 0; }

template <typename F>
F pick(F plain, F vnni, F vnni512) {
  return vnni_build() == 1 ? vnni : vnni_build() == 2 ? vnni512 : plain;
}

// x [..., K] as contiguous rows [M, K], and the output's shape [..., N]; x must be bf16, fp16 or fp32.
inline std::tuple<at::Tensor, std::vector<int64_t>> rows_of(const at::Tensor& x, int64_t k, int64_t n) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat || x.scalar_type() == at::kHalf,
              "x: expected bf16, fp16 or fp32, got ", x.scalar_type());
  auto out_shape = x.sizes().vec();
  out_shape.back() = n;
  return {x.reshape({-1, k}).contiguous(), out_shape};
}

// A kernel's fp32 result y [M, N] into out [M, N] in out's dtype (bf16, fp16 or fp32).
inline void copy_out(const float* yp, at::Tensor& out) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "edge_avx2_out", [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    for (int64_t i = 0; i < out.numel(); ++i) op[i] = static_cast<scalar_t>(yp[i]);
  });
}

template <typename Q>
at::Tensor linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& zeros,
                  int64_t group, int qmax, Channels<Q> plain, Channels<Q> vnni, Channels<Q> vnni512) {
  TORCH_CHECK(group == 32 || group == 64 || group == 128, "group: expected 32, 64 or 128, got ", group);
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kByte,
              "qweight: expected uint8 [N, K/2], got ", qweight.scalar_type(), " ", qweight.sizes());
  const int64_t n = qweight.size(0);
  const int64_t k = qweight.size(1) * 2;
  TORCH_CHECK(k % group == 0, "qweight: expected K divisible by group ", group, ", got K=", k);
  TORCH_CHECK(x.size(-1) == k, "x: expected last dim K=", k, ", got ", x.size(-1));
  const int64_t groups = k / group;
  for (const at::Tensor* t : {&scales, &zeros}) {
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->dim() == 2 && t->size(0) == n && t->size(1) == groups,
                "scales/zeros: expected bf16 [", n, ", ", groups, "], got ", t->scalar_type(), " ", t->sizes());
  }
  const auto rows = rows_of(x, k, n);
  const at::Tensor& x2 = std::get<0>(rows);  // [M, K]
  const std::vector<int64_t>& out_shape = std::get<1>(rows);  // [..., N]
  const int64_t m = x2.size(0);
  at::Tensor out = at::empty({m, n}, x.options());  // [M, N] in x's dtype
  if (m == 0 || n == 0) {
    return out.reshape(out_shape);
  }
  // One scratch allocation, filled here rather than by ATen ops (each op costs microseconds, as much as a 576x576
  // GEMV): codes even/odd [M, K/2] each, then scales and sums [M, G] each, then y [M, N] fp32. The code planes are
  // padded by 32 bytes so the last 32-byte load of a row stays inside.
  std::vector<Q> codes(static_cast<size_t>(m * k + 64));
  std::vector<float> scratch(static_cast<size_t>(2 * m * groups + m * n));
  Q* xe_w = codes.data();
  Q* xo_w = xe_w + m * (k / 2);
  float* a_w = scratch.data();
  float* xs_w = a_w + m * groups;
  float* yp = xs_w + m * groups;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x2.scalar_type(), "edge_avx2_quantize", [&] {
    quantize_acts<Q>(x2.data_ptr<scalar_t>(), m, k, group, qmax, xe_w, xo_w, a_w, xs_w);
  });
  const Acts<Q> acts{xe_w, xo_w, a_w, xs_w};
  at::Tensor qw = qweight.contiguous();
  at::Tensor sc = scales.contiguous();
  at::Tensor ze = zeros.contiguous();
  const uint8_t* wp = qw.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(sc.data_ptr<at::BFloat16>());
  const uint16_t* zp = reinterpret_cast<const uint16_t*>(ze.data_ptr<at::BFloat16>());
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, k / 2));  // ~16 KB of weights a task
  const Channels<Q> run = pick(plain, vnni, vnni512);
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) { run(wp, sp, zp, acts, yp, group, begin, end, m, n, k); });
  copy_out(yp, out);
  return out.reshape(out_shape);
}

// The decode-layout ops' common part: x's rows [M, K] quantized to int8 per group of `group` (scratch kept per
// thread across calls: a decode step makes ~120 of them, and each allocation costs as much as a few channels'
// arithmetic), then run(codes, a, xs, xs16, y, yb, begin, end, m) over blocks [begin, end) of 8 output channels,
// writing fp32 y, or bf16 yb (y null) straight into a bf16 output. With sums16, xs16 [M, K/16] int32 = the sum of
// each 16 codes (a weight grid of 16 with an offset: Q6_K); else null.
template <typename Run>
at::Tensor x8_call(const at::Tensor& x, int64_t n, int64_t k, int64_t group, const Run& run, bool sums16 = false) {
  const auto rows = rows_of(x, k, n);
  const at::Tensor& x2 = std::get<0>(rows);  // [M, K]
  const std::vector<int64_t>& out_shape = std::get<1>(rows);  // [..., N]
  const int64_t m = x2.size(0), groups = k / group;
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0) return out.reshape(out_shape);
  thread_local std::vector<int8_t> codes;
  thread_local std::vector<float> scratch;
  thread_local std::vector<int32_t> sixteens;
  const bool bf16_out = x2.scalar_type() == at::kBFloat16;
  codes.resize(static_cast<size_t>(m * k));
  scratch.resize(static_cast<size_t>(2 * m * groups + (bf16_out ? 0 : m * n)));
  sixteens.resize(static_cast<size_t>(sums16 ? m * (k / 16) : 0));
  float* a_w = scratch.data();
  float* xs_w = a_w + m * groups;
  int32_t* xs16 = sums16 ? sixteens.data() : nullptr;
  float* yp = bf16_out ? nullptr : xs_w + m * groups;
  // activations per weight group, as the row-major kernel rounds them: the same integer sums, the same numbers
  if (bf16_out) {
    quantize_i8_bf16(reinterpret_cast<const uint16_t*>(x2.data_ptr<at::BFloat16>()), m, k, group, codes.data(), a_w,
                     xs_w);
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND(at::kHalf, x2.scalar_type(), "edge_avx2_quantize_x8", [&] {
      quantize_acts<int8_t>(x2.data_ptr<scalar_t>(), m, k, group, 127, codes.data(), nullptr, a_w, xs_w);
    });
  }
  if (sums16) {
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t j = 0; j < k / 16; ++j) {
        int32_t sum = 0;
        for (int64_t i = 0; i < 16; ++i) sum += codes[r * k + 16 * j + i];
        xs16[r * (k / 16) + j] = sum;
      }
    }
  }
  uint16_t* ob = bf16_out ? reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) : nullptr;
  const int8_t* cp = codes.data();
  const int64_t grain = std::max<int64_t>(1, 16384 / (k * 4));  // ~16 KB of weights a task
  at::parallel_for(0, n / 8, grain,
                   [&](int64_t begin, int64_t end) { run(cp, a_w, xs_w, xs16, yp, ob, begin, end, m); });
  if (!bf16_out) {
    copy_out(yp, out);
  }
  return out.reshape(out_shape);
}

// The decode layout (block8_a8): qweight uint8 [N/8, K/8, 32], scales and zeros bf16 [N/8, K/g, 8].
at::Tensor w4a8_linear_x8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                          const at::Tensor& zeros, int64_t group) {
  TORCH_CHECK(group == 32 || group == 64 || group == 128, "group: expected 32, 64 or 128, got ", group);
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.size(2) == 32,
              "qweight: expected uint8 [N/8, K/8, 32], got ", qweight.scalar_type(), " ", qweight.sizes());
  const int64_t blocks = qweight.size(0), n = blocks * 8, k = qweight.size(1) * 8;
  TORCH_CHECK(k % group == 0, "qweight: expected K divisible by group ", group, ", got K=", k);
  TORCH_CHECK(x.size(-1) == k, "x: expected last dim K=", k, ", got ", x.size(-1));
  const int64_t groups = k / group;
  for (const at::Tensor* t : {&scales, &zeros}) {
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->dim() == 3 && t->size(0) == blocks &&
                    t->size(1) == groups && t->size(2) == 8,
                "scales/zeros: expected bf16 [", blocks, ", ", groups, ", 8], got ", t->scalar_type(), " ",
                t->sizes());
  }
  at::Tensor qw = qweight.contiguous(), sc = scales.contiguous(), ze = zeros.contiguous();
  const uint8_t* wp = qw.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(sc.data_ptr<at::BFloat16>());
  const uint16_t* zp = reinterpret_cast<const uint16_t*>(ze.data_ptr<at::BFloat16>());
  const auto kernel = pick(isa_plain::blocks8_a8, isa_vnni::blocks8_a8, isa_vnni512::blocks8_a8);
  return x8_call(x, n, k, group, [&](const int8_t* cp, const float* a, const float* xs, const int32_t*, float* yp,
                                     uint16_t* ob, int64_t begin, int64_t end, int64_t m) {
    kernel(wp, sp, zp, cp, a, xs, yp, ob, group, begin, end, m, n, k);
  });
}

// Q4_K in the decode layout (kernels/ops/q4k.py decode_layout): qweight uint8 [N/8, K/8, 32] as w4a8's, meta uint8
// [N/8, K/256, 128] (the 8 channels' d, dmin and 6-bit scales rearranged): 144 bytes per 256 weights, the file's.
at::Tensor q4k_linear_x8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& meta) {
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.size(2) == 32 && qweight.size(1) % 32 == 0,
              "qweight: expected uint8 [N/8, K/8, 32] with K a multiple of 256, got ", qweight.scalar_type(), " ",
              qweight.sizes());
  const int64_t blocks = qweight.size(0), n = blocks * 8, k = qweight.size(1) * 8;
  TORCH_CHECK(meta.dim() == 3 && meta.scalar_type() == at::kByte && meta.size(0) == blocks &&
                  meta.size(1) == k / 256 && meta.size(2) == 128,
              "meta: expected uint8 [", blocks, ", ", k / 256, ", 128], got ", meta.scalar_type(), " ", meta.sizes());
  TORCH_CHECK(x.size(-1) == k, "x: expected last dim K=", k, ", got ", x.size(-1));
  at::Tensor qw = qweight.contiguous(), me = meta.contiguous();
  const uint8_t* wp = qw.data_ptr<uint8_t>();
  const uint8_t* mp = me.data_ptr<uint8_t>();
  const auto kernel = pick(isa_plain::blocks8_q4k, isa_vnni::blocks8_q4k, isa_vnni512::blocks8_q4k);
  return x8_call(x, n, k, 32, [&](const int8_t* cp, const float* a, const float* xs, const int32_t*, float* yp,
                                  uint16_t* ob, int64_t begin, int64_t end, int64_t m) {
    kernel(wp, mp, cp, a, xs, yp, ob, begin, end, m, n, k);
  });
}

// A GGUF's Q6_K tensor in the decode layout (kernels/ops/q6k.py): blocks uint8 [N/8, K/256, 1680], the 8 channels'
// 210 bytes a block each rearranged (block8_q6k). int8 activations per group of 32, as the other x8 kernels.
at::Tensor q6k_linear(const at::Tensor& x, const at::Tensor& blocks) {
  TORCH_CHECK(blocks.dim() == 3 && blocks.scalar_type() == at::kByte && blocks.size(2) == 1680,
              "blocks: expected uint8 [N/8, K/256, 1680], got ", blocks.scalar_type(), " ", blocks.sizes());
  const int64_t n = blocks.size(0) * 8, k = blocks.size(1) * 256;
  TORCH_CHECK(x.size(-1) == k, "x: expected last dim K=", k, ", got ", x.size(-1));
  at::Tensor bl = blocks.contiguous();
  const uint8_t* bp = bl.data_ptr<uint8_t>();
  const auto kernel = pick(isa_plain::blocks8_q6k, isa_vnni::blocks8_q6k, isa_vnni512::blocks8_q6k);
  return x8_call(x, n, k, 32, [&](const int8_t* cp, const float* a, const float*, const int32_t* xs16, float* yp,
                                  uint16_t* ob, int64_t begin, int64_t end, int64_t m) {
    kernel(bp, cp, a, xs16, yp, ob, begin, end, m, n, k);
  }, /*sums16=*/true);
}

// A GGUF's Q8_0 (bits 8) or Q5_0 (bits 5) tensor in the decode layout (kernels/ops/g32.py): blocks uint8
// [N/8, K/32, 272 or 176], the 8 channels' 34 or 22 bytes a block rearranged (block8_g32).
at::Tensor g32_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t bits) {
  TORCH_CHECK(bits == 8 || bits == 5, "bits: expected 8 (Q8_0) or 5 (Q5_0), got ", bits);
  const int64_t bytes = bits == 8 ? 272 : 176;
  TORCH_CHECK(blocks.dim() == 3 && blocks.scalar_type() == at::kByte && blocks.size(2) == bytes,
              "blocks: expected uint8 [N/8, K/32, ", bytes, "], got ", blocks.scalar_type(), " ", blocks.sizes());
  const int64_t n = blocks.size(0) * 8, k = blocks.size(1) * 32;
  TORCH_CHECK(x.size(-1) == k, "x: expected last dim K=", k, ", got ", x.size(-1));
  at::Tensor bl = blocks.contiguous();
  const uint8_t* bp = bl.data_ptr<uint8_t>();
  const auto kernel = pick(isa_plain::blocks8_g32, isa_vnni::blocks8_g32, isa_vnni512::blocks8_g32);
  return x8_call(x, n, k, 32, [&](const int8_t* cp, const float* a, const float*, const int32_t* xs16, float* yp,
                                  uint16_t* ob, int64_t begin, int64_t end, int64_t m) {
    kernel(bp, cp, a, xs16, yp, ob, bits, begin, end, m, n, k);
  }, /*sums16=*/true);
}

at::Tensor w4a16_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                        const at::Tensor& zeros, int64_t group) {
  return linear<int16_t>(x, qweight, scales, zeros, group, 32767, isa_plain::channels_a16, isa_vnni::channels_a16,
                          isa_vnni512::channels_a16);
}

at::Tensor w4a8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const at::Tensor& zeros, int64_t group) {
  if (qweight.dim() == 3) return w4a8_linear_x8(x, qweight, scales, zeros, group);
  return linear<int8_t>(x, qweight, scales, zeros, group, 127, isa_plain::channels_a8, isa_vnni::channels_a8,
                         isa_vnni512::channels_a8);
}

// The 8-bit set's layers: int8 weights per channel (scales bf16 [N]) or per group of 16 or 32 along K (scales
// float32 [N, K/g]: a GGUF's own grid, kernels/ops/int8.py), int16 activations per group of 32.
at::Tensor w8a16_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kChar,
              "qweight: expected int8 [N, K], got ", qweight.scalar_type(), " ", qweight.sizes());
  const int64_t n = qweight.size(0), k = qweight.size(1);
  TORCH_CHECK(k % 32 == 0, "qweight: expected K divisible by 32, got K=", k);
  TORCH_CHECK(x.size(-1) == k, "x: expected last dim K=", k, ", got ", x.size(-1));
  int64_t wgroup = 0;
  if (scales.dim() == 2) {
    TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.size(0) == n && scales.size(1) > 0 &&
                    (scales.size(1) * 16 == k || scales.size(1) * 32 == k),
                "scales: expected float32 [", n, ", K/16 or K/32], got ", scales.scalar_type(), " ", scales.sizes());
    wgroup = k / scales.size(1);
  } else {
    TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && scales.numel() == n,
                "scales: expected bf16 [", n, "], got ", scales.scalar_type(), " ", scales.sizes());
  }
  const auto rows = rows_of(x, k, n);
  const at::Tensor& x2 = std::get<0>(rows);  // [M, K]
  const std::vector<int64_t>& out_shape = std::get<1>(rows);  // [..., N]
  const int64_t m = x2.size(0), groups = k / 32;
  at::Tensor out = at::empty({m, n}, x.options().dtype(at::kFloat));
  if (m == 0 || n == 0) return out.to(x.scalar_type()).reshape(out_shape);
  std::vector<int16_t> xq(static_cast<size_t>(m * k));
  std::vector<float> a(static_cast<size_t>(2 * m * groups));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x2.scalar_type(), "edge_avx2_quantize8", [&] {
    quantize_acts<int16_t>(x2.data_ptr<scalar_t>(), m, k, 32, 32767, xq.data(), nullptr, a.data(), a.data() + m * groups);
  });
  at::Tensor qw = qweight.contiguous(), sc = scales.contiguous();
  const int8_t* wp = qw.data_ptr<int8_t>();
  const void* sp = sc.data_ptr();
  float* yp = out.data_ptr<float>();
  const auto run = pick(isa_plain::channels_int8, isa_vnni::channels_int8, isa_vnni512::channels_int8);
  const int64_t grain = std::max<int64_t>(1, 16384 / k);
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    run(wp, sp, xq.data(), a.data(), yp, wgroup, begin, end, m, n, k);
  });
  return out.to(x.scalar_type()).reshape(out_shape);
}

// A GGUF's Q4_K tensor at its own size (kernels/ops/q4k.py): qweight uint8 [N, K/2] (cpu_int4's row-major nibbles,
// the file's codes) and meta uint8 [N, K/256 * 16] (each block's d, dmin and 6-bit scales as the file holds them):
// 144 bytes per 256 weights, the file's own. int8 activations per group of 32, as w4a8_linear's.
at::Tensor q4k_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& meta) {
  if (qweight.dim() == 3) return q4k_linear_x8(x, qweight, meta);
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kByte && qweight.size(1) % 128 == 0,
              "qweight: expected uint8 [N, K/2] with K a multiple of 256, got ", qweight.scalar_type(), " ",
              qweight.sizes());
  const int64_t n = qweight.size(0), k = qweight.size(1) * 2, groups = k / 32;
  TORCH_CHECK(meta.dim() == 2 && meta.scalar_type() == at::kByte && meta.size(0) == n && meta.size(1) == k / 16,
              "meta: expected uint8 [", n, ", ", k / 16, "], got ", meta.scalar_type(), " ", meta.sizes());
  TORCH_CHECK(x.size(-1) == k, "x: expected last dim K=", k, ", got ", x.size(-1));
  const auto rows = rows_of(x, k, n);
  const at::Tensor& x2 = std::get<0>(rows);  // [M, K]
  const std::vector<int64_t>& out_shape = std::get<1>(rows);  // [..., N]
  const int64_t m = x2.size(0);
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return out.reshape(out_shape);
  std::vector<int8_t> codes(static_cast<size_t>(m * k + 64));
  std::vector<float> scratch(static_cast<size_t>(2 * m * groups + m * n));
  int8_t* xe = codes.data();
  int8_t* xo = xe + m * (k / 2);
  float* a = scratch.data();
  float* xs = a + m * groups;
  float* yp = xs + m * groups;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x2.scalar_type(), "edge_q4k_quantize", [&] {
    quantize_acts<int8_t>(x2.data_ptr<scalar_t>(), m, k, 32, 127, xe, xo, a, xs);
  });
  const Acts<int8_t> acts{xe, xo, a, xs};
  at::Tensor qw = qweight.contiguous(), me = meta.contiguous();
  const uint8_t* wp = qw.data_ptr<uint8_t>();
  const uint8_t* mp = me.data_ptr<uint8_t>();
  const auto run = pick(isa_plain::channels_q4k, isa_vnni::channels_q4k, isa_vnni512::channels_q4k);
  const int64_t grain = std::max<int64_t>(1, 16384 / (k / 2));
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) { run(wp, mp, acts, yp, begin, end, m, n, k); });
  copy_out(yp, out);
  return out.reshape(out_shape);
}

bool vnni_in_use() { return use_vnni(); }

// A cpu_int4 layer whose decode_kernel names an AVX2 kernel (kernels/ops/int4_ops.py, int4_linear_impl's arguments; a
// layer of Q4_K blocks passes their meta uint8 as `scales`, kernels/vllm_plugin/cpu_int4.py CpuQ4kLinearMethod): rows
// as a decode step passes them, [M <= avx2_rows, K] bf16, run the kernel without leaving C++; any other batch goes
// to the Python op vllm::cpu_int4_linear (tinygemm or dequantize + GEMM). A decode step makes ~120 of these calls,
// and the round trip through Python that this skips costs ~5 us each (benchmarks/op_call_cost.py).
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales_and_zeros,
                       const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& zeros, int64_t group,
                       int64_t mode, int64_t dequant_threshold, bool fp32_prefill, int64_t avx2_rows,
                       int64_t avx2_bits) {
  if (x.dim() == 2 && x.size(0) > 0 && x.size(0) <= avx2_rows && x.scalar_type() == at::kBFloat16) {
    if (scales.scalar_type() == at::kByte) return q4k_linear(x, qweight, scales);  // a GGUF's Q4_K blocks (q4k.py)
    return avx2_bits == 8 ? w4a8_linear(x, qweight, scales, zeros, group)
                          : w4a16_linear(x, qweight, scales, zeros, group);
  }
  static const c10::OperatorHandle wide =
      c10::Dispatcher::singleton().findSchemaOrThrow("vllm::cpu_int4_linear", "");
  std::vector<c10::IValue> stack{x, packed, scales_and_zeros, qweight, scales, zeros, group, mode,
                                 dequant_threshold, fp32_prefill, avx2_rows, avx2_bits};
  wide.callBoxed(&stack);
  return stack[0].toTensor();
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}

// Codes of a decode-layout vector (32 signed bytes, byte 4c+t: channel c's t-th of 4 weights) times their channel's
// fp32 scale, rounded to bf16: 4 values into each of the 8 rows at column `col`.
inline void store_x8(__m256i codes, const float* scale, c10::BFloat16* const* row, int64_t col) {
  alignas(32) int8_t q[32];
  _mm256_store_si256(reinterpret_cast<__m256i*>(q), codes);
  for (int c = 0; c < 8; c += 2) {
    const __m128i eight = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 4 * c));
    const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight));
    const __m256 sv = _mm256_setr_m128(_mm_set1_ps(scale[c]), _mm_set1_ps(scale[c + 1]));
    const __m128i h = to_bf16x8(_mm256_mul_ps(v, sv));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(row[c] + col), h);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(row[c + 1] + col), _mm_unpackhi_epi64(h, h));
  }
}

// Weights a block of a decode-layout blocks tensor holds, told by its bytes: Q6_K (1680) 256, Q8_0 and Q5_0 32.
inline int64_t block_weights(int64_t bytes) { return bytes == 1680 ? 256 : 32; }

// The weights a decode-layout blocks tensor stands for, bf16 [N, K]: what a wide batch multiplies by (Q6_K [N/8, K/256,
// 1680], Q8_0 [N/8, K/32, 272], Q5_0 [N/8, K/32, 176]; layouts in kernels/ops/q6k.py and g32.py, whose dequantize_x8
// gives the same values: the signed code times the fp32 scale (d; Q6_K's d sc), rounded to bf16 to nearest even), in
// parallel over blocks of 8 channels. The codes are widened as the decode kernels widen them (avx2_int4.cpp
// block8_g32, block8_q6k).
at::Tensor blocks_dequantize(const at::Tensor& blocks) {
  TORCH_CHECK(blocks.dim() == 3 && blocks.scalar_type() == at::kByte &&
                  (blocks.size(2) == 1680 || blocks.size(2) == 272 || blocks.size(2) == 176),
              "blocks: expected uint8 [N/8, K/block, 1680 (Q6_K), 272 (Q8_0) or 176 (Q5_0)], got ",
              blocks.scalar_type(), " ", blocks.sizes());
  const int64_t bytes = blocks.size(2), nb = blocks.size(1), n = blocks.size(0) * 8;
  const int64_t weights = block_weights(bytes), k = nb * weights;
  at::Tensor bl = blocks.contiguous();
  at::Tensor out = at::empty({n, k}, blocks.options().dtype(at::kBFloat16));
  const uint8_t* bp = bl.data_ptr<uint8_t>();
  c10::BFloat16* op = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, n / 8, 1, [&](int64_t begin, int64_t end) {
    const __m256i four = _mm256_set1_epi8(0x0F), fifth = _mm256_set1_epi8(0x10), top = _mm256_set1_epi8(0x30);
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t blk = 0; blk < nb; ++blk) {
        const uint8_t* p = bp + (b * nb + blk) * bytes;
        float d[8];
        for (int c = 0; c < 8; ++c) d[c] = half_at(p + 2 * c);
        c10::BFloat16* row[8];
        for (int c = 0; c < 8; ++c) row[c] = op + (8 * b + c) * k + blk * weights;
        if (bytes == 272) {
          for (int v = 0; v < 8; ++v) store_x8(loadu(p + 16 + 32 * v), d, row, 4 * v);
        } else if (bytes == 176) {
          const __m256i h = loadu(p + 144);
          const __m256i sixteen = _mm256_set1_epi8(16);
          for (int j = 0; j < 4; ++j) {
            const __m256i v = loadu(p + 16 + 32 * j);
            // bit 2j (2j+1) of each byte of h moved to bit 4: a variable 16-bit shift left by 4-2j (3-2j), or right
            const __m128i lo_shift = _mm_cvtsi32_si128(std::abs(4 - 2 * j));
            const __m128i hi_shift = _mm_cvtsi32_si128(std::abs(3 - 2 * j));
            const __m256i lo_top = 4 - 2 * j >= 0 ? _mm256_sll_epi16(h, lo_shift) : _mm256_srl_epi16(h, lo_shift);
            const __m256i hi_top = 3 - 2 * j >= 0 ? _mm256_sll_epi16(h, hi_shift) : _mm256_srl_epi16(h, hi_shift);
            const __m256i lo = _mm256_or_si256(_mm256_and_si256(v, four), _mm256_and_si256(lo_top, fifth));
            const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), four),
                                               _mm256_and_si256(hi_top, fifth));
            store_x8(_mm256_sub_epi8(lo, sixteen), d, row, 8 * j);
            store_x8(_mm256_sub_epi8(hi, sixteen), d, row, 8 * j + 4);
          }
        } else {
          const __m256i thirty_two = _mm256_set1_epi8(32);
          for (int s = 0; s < 16; ++s) {
            float scale[8];
            for (int c = 0; c < 8; ++c) scale[c] = d[c] * static_cast<float>(static_cast<int8_t>(p[16 + 8 * s + c]));
            const uint8_t* sub = p + 144 + 96 * s;
            const __m256i v0 = loadu(sub), v1 = loadu(sub + 32), h = loadu(sub + 64);
            const __m256i lo0 = _mm256_or_si256(_mm256_and_si256(v0, four),
                                                _mm256_and_si256(_mm256_slli_epi16(h, 4), top));
            const __m256i hi0 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v0, 4), four),
                                                _mm256_and_si256(_mm256_slli_epi16(h, 2), top));
            const __m256i lo1 = _mm256_or_si256(_mm256_and_si256(v1, four), _mm256_and_si256(h, top));
            const __m256i hi1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v1, 4), four),
                                                _mm256_and_si256(_mm256_srli_epi16(h, 2), top));
            store_x8(_mm256_sub_epi8(lo0, thirty_two), scale, row, 16 * s);
            store_x8(_mm256_sub_epi8(hi0, thirty_two), scale, row, 16 * s + 4);
            store_x8(_mm256_sub_epi8(lo1, thirty_two), scale, row, 16 * s + 8);
            store_x8(_mm256_sub_epi8(hi1, thirty_two), scale, row, 16 * s + 12);
          }
        }
      }
    }
  });
  return out;
}

// An 8-bit-set layer kept as a GGUF's own blocks (kernels/ops/int4_ops.py blocks_linear_impl's arguments; Q6_K, Q8_0
// or Q5_0 in their decode layouts, told apart by the last dimension: 1680, 272, 176): rows as a decode step passes
// them, [M <= avx2_rows, K] bf16, run the kernel without leaving C++; any other batch goes to the Python op
// vllm::cpu_blocks_linear (dequantize + GEMM), as int4_linear does.
at::Tensor blocks_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t dequant_threshold, int64_t avx2_rows) {
  if (x.dim() == 2 && x.size(0) > 0 && x.size(0) <= avx2_rows && x.scalar_type() == at::kBFloat16 &&
      blocks.dim() == 3) {
    switch (blocks.size(2)) {
      case 1680: return q6k_linear(x, blocks);
      case 272: return g32_linear(x, blocks, 8);
      case 176: return g32_linear(x, blocks, 5);
      default: break;
    }
  }
  static const c10::OperatorHandle wide =
      c10::Dispatcher::singleton().findSchemaOrThrow("vllm::cpu_blocks_linear", "");
  std::vector<c10::IValue> stack{x, blocks, dequant_threshold, avx2_rows};
  wide.callBoxed(&stack);
  return stack[0].toTensor();
}

// An int4 weight in the decode layout (kernels/ops/avx2_int4.py decode_layout: qweight uint8 [N/8, K/8, 32], byte
// 4c+t of block (b, j) holding channel 8b+c's k=8j+t low and k=8j+4+t high; scales, zeros bf16 [N/8, K/g, 8]) -> w
// [N, K], (q - 8) * scale + zero in fp32 (exact product, one rounding: kernels/ops/int4.py apply_scales), rounded to
// bf16 to nearest even, or kept fp32. A layer holding no tinygemm buffer dequantizes this copy for every batch wider
// than the decode kernel's rows.
template <typename Out>
void dequantize_x8_codes(const uint8_t* q, const c10::BFloat16* sp, const c10::BFloat16* zp, int64_t nb8, int64_t k,
                         int64_t group, Out* out) {
  const int64_t groups = k / group;
  at::parallel_for(0, nb8, 1, [&](int64_t begin, int64_t end) {
    const __m256i low = _mm256_set1_epi32(0x0F), eight = _mm256_set1_epi32(8);
    const __m256i shifts = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t j = 0; j < k / 8; ++j) {
        const uint8_t* bytes = q + (b * (k / 8) + j) * 32;
        const int64_t g = (8 * j) / group;
        for (int c = 0; c < 8; ++c) {
          int32_t four;
          std::memcpy(&four, bytes + 4 * c, 4);
          const __m128i b4 = _mm_cvtsi32_si128(four);
          const __m256i wide = _mm256_cvtepu8_epi32(_mm_unpacklo_epi32(b4, b4));  // bytes t=0..3 twice
          const __m256i codes = _mm256_and_si256(_mm256_srlv_epi32(wide, shifts), low);
          const __m256 centred = _mm256_cvtepi32_ps(_mm256_sub_epi32(codes, eight));
          const int64_t at = (b * groups + g) * 8 + c;
          const __m256 v = _mm256_fmadd_ps(centred, _mm256_set1_ps(static_cast<float>(sp[at])),
                                           _mm256_set1_ps(static_cast<float>(zp[at])));
          Out* row = out + (8 * b + c) * k + 8 * j;
          if constexpr (std::is_same_v<Out, float>) {
            _mm256_storeu_ps(row, v);
          } else {
            _mm_storeu_si128(reinterpret_cast<__m128i*>(row), to_bf16x8(v));
          }
        }
      }
    }
  });
}

at::Tensor int4_dequantize(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& zeros,
                           int64_t group, bool fp32) {
  TORCH_CHECK(qweight.dim() == 3 && qweight.size(2) == 32 && qweight.scalar_type() == at::kByte,
              "qweight: expected uint8 [N/8, K/8, 32] (the decode layout), got ", qweight.scalar_type(), " ",
              qweight.sizes());
  const int64_t nb8 = qweight.size(0), k = qweight.size(1) * 8;
  TORCH_CHECK(group >= 8 && group % 8 == 0 && k % group == 0, "group: expected a multiple of 8 dividing K=", k,
              ", got ", group);
  for (const at::Tensor* t : {&scales, &zeros}) {
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->dim() == 3 && t->size(0) == nb8 &&
                    t->size(1) == k / group && t->size(2) == 8,
                "scales, zeros: expected bf16 [", nb8, ", ", k / group, ", 8], got ", t->scalar_type(), " ",
                t->sizes());
  }
  const at::Tensor q = qweight.contiguous(), s = scales.contiguous(), z = zeros.contiguous();
  at::Tensor out = at::empty({nb8 * 8, k}, qweight.options().dtype(fp32 ? at::kFloat : at::kBFloat16));
  const auto* sp = s.data_ptr<at::BFloat16>();
  const auto* zp = z.data_ptr<at::BFloat16>();
  if (fp32) {
    dequantize_x8_codes(q.data_ptr<uint8_t>(), sp, zp, nb8, k, group, out.data_ptr<float>());
  } else {
    dequantize_x8_codes(q.data_ptr<uint8_t>(), sp, zp, nb8, k, group,
                        reinterpret_cast<c10::BFloat16*>(out.data_ptr<at::BFloat16>()));
  }
  return out;
}

// A GGUF's Q4_K tensor in the decode layout (kernels/ops/q4k.py decode_layout: qweight uint8 [N/8, K/8, 32] as the
// int4 decode layout, meta uint8 [N/8, K/256, 128]) -> w [N, K], d sc_j q - dmin m_j in fp32 as gguf-py's float32
// dequantization gives it (the product rounded, then the difference: no fused multiply-subtract, hence
// fp-contract off), rounded to bf16 to nearest even or kept fp32. A Q4_K layer holding no tinygemm buffer
// dequantizes this for every batch wider than the decode kernel's rows.
template <typename Out>
__attribute__((optimize("fp-contract=off"))) void dequantize_q4k_x8(const uint8_t* q, const uint8_t* meta,
                                                                    int64_t nb8, int64_t k, Out* out) {
  const int64_t blocks = k / 256;
  at::parallel_for(0, nb8, 1, [&](int64_t begin, int64_t end) {
    const __m256i low = _mm256_set1_epi32(0x0F);
    const __m256i shifts = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t blk = 0; blk < blocks; ++blk) {
        const uint8_t* m = meta + (b * blocks + blk) * 128;
        uint8_t values[128];  // 8j+c: channel c's sc_j; 64+8j+c: its m_j
        for (int i = 0; i < 128; ++i) {
          const uint8_t nibble = i < 64 ? (m[32 + i] & 0x0F) : (m[32 + i - 64] >> 4);
          const uint8_t top = (m[96 + i % 32] >> (2 * (i / 32))) & 0x03;
          values[i] = static_cast<uint8_t>(nibble | (top << 4));
        }
        float d[8], dmin[8];
        for (int c = 0; c < 8; ++c) {
          d[c] = half_at(m + 2 * c);
          dmin[c] = half_at(m + 16 + 2 * c);
        }
        for (int j = 0; j < 8; ++j) {
          for (int c = 0; c < 8; ++c) {
            const __m256 scale = _mm256_set1_ps(d[c] * static_cast<float>(values[8 * j + c]));
            const __m256 minimum = _mm256_set1_ps(dmin[c] * static_cast<float>(values[64 + 8 * j + c]));
            for (int i = 0; i < 4; ++i) {
              const int64_t j8 = blk * 32 + j * 4 + i;
              int32_t four;
              std::memcpy(&four, q + (b * (k / 8) + j8) * 32 + 4 * c, 4);
              const __m128i b4 = _mm_cvtsi32_si128(four);
              const __m256i wide = _mm256_cvtepu8_epi32(_mm_unpacklo_epi32(b4, b4));
              const __m256 codes = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(wide, shifts), low));
              const __m256 v = _mm256_sub_ps(_mm256_mul_ps(codes, scale), minimum);
              Out* row = out + (8 * b + c) * k + 8 * j8;
              if constexpr (std::is_same_v<Out, float>) {
                _mm256_storeu_ps(row, v);
              } else {
                _mm_storeu_si128(reinterpret_cast<__m128i*>(row), to_bf16x8(v));
              }
            }
          }
        }
      }
    }
  });
}

at::Tensor q4k_dequantize(const at::Tensor& qweight, const at::Tensor& meta, bool fp32) {
  TORCH_CHECK(qweight.dim() == 3 && qweight.size(2) == 32 && qweight.scalar_type() == at::kByte,
              "qweight: expected uint8 [N/8, K/8, 32] (the decode layout), got ", qweight.scalar_type(), " ",
              qweight.sizes());
  const int64_t nb8 = qweight.size(0), k = qweight.size(1) * 8;
  TORCH_CHECK(k % 256 == 0 && meta.dim() == 3 && meta.scalar_type() == at::kByte && meta.size(0) == nb8 &&
                  meta.size(1) == k / 256 && meta.size(2) == 128,
              "meta: expected uint8 [", nb8, ", ", k / 256, ", 128] (the decode layout's), got ",
              meta.scalar_type(), " ", meta.sizes());
  const at::Tensor q = qweight.contiguous(), m = meta.contiguous();
  at::Tensor out = at::empty({nb8 * 8, k}, qweight.options().dtype(fp32 ? at::kFloat : at::kBFloat16));
  if (fp32) {
    dequantize_q4k_x8(q.data_ptr<uint8_t>(), m.data_ptr<uint8_t>(), nb8, k, out.data_ptr<float>());
  } else {
    dequantize_q4k_x8(q.data_ptr<uint8_t>(), m.data_ptr<uint8_t>(), nb8, k,
                      reinterpret_cast<c10::BFloat16*>(out.data_ptr<at::BFloat16>()));
  }
  return out;
}

// An 8-bit-set layer or head (kernels/ops/int4_ops.py int8_linear_impl's arguments): rows as a decode step passes
// them, [M <= avx2_rows, K] bf16, run w8a16_linear without leaving C++; any other batch goes to the Python op
// vllm::cpu_int8_linear, as int4_linear does. The default model's int8 head is called once a step outside the
// compiled graph, where the Python op's round trip cost ~0.1 ms (docs/reports/2026-12-06-layer-table.md).
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       int64_t dequant_threshold, int64_t avx2_rows) {
  if (x.dim() == 2 && x.size(0) > 0 && x.size(0) <= avx2_rows && x.scalar_type() == at::kBFloat16 &&
      x.size(1) % 32 == 0) {
    return w8a16_linear(x, qweight, scales);
  }
  static const c10::OperatorHandle wide =
      c10::Dispatcher::singleton().findSchemaOrThrow("vllm::cpu_int8_linear", "");
  std::vector<c10::IValue> stack{x, qweight, scales, dequant_threshold, avx2_rows};
  wide.callBoxed(&stack);
  return stack[0].toTensor();
}

// The 8-bit set's embedding lookup (kernels/ops/int4_ops.py int8_embedding_impl, bit for bit): ids [...] -> [..., H]
// bf16, each gathered int8 code times its row's scale (bf16 [N]) or its group's (float32 [N, H/g]) in fp32, rounded
// to bf16 to nearest even. Inside the compiled graph the Python op was a call back into Python every step.
at::Tensor int8_embedding(const at::Tensor& ids, const at::Tensor& qweight, const at::Tensor& scales) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kChar,
              "qweight: expected int8 [N, H], got ", qweight.scalar_type(), " ", qweight.sizes());
  const int64_t n = qweight.size(0), h = qweight.size(1);
  const bool per_row = scales.dim() == 1;
  TORCH_CHECK((per_row && scales.scalar_type() == at::kBFloat16 && scales.size(0) == n) ||
                  (scales.dim() == 2 && scales.scalar_type() == at::kFloat && scales.size(0) == n &&
                   scales.size(1) > 0 && h % scales.size(1) == 0),
              "scales: expected bf16 [", n, "] or float32 [", n, ", H/g], got ", scales.scalar_type(), " ",
              scales.sizes());
  at::Tensor flat = ids.reshape(-1).to(at::kLong).contiguous();
  const int64_t t = flat.size(0);
  const int64_t group = per_row ? h : h / scales.size(1);
  at::Tensor q = qweight.contiguous(), sc = per_row ? scales.to(at::kFloat).contiguous() : scales.contiguous();
  at::Tensor out = at::empty({t, h}, qweight.options().dtype(at::kBFloat16));
  const int64_t* ip = flat.data_ptr<int64_t>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = sc.data_ptr<float>();
  c10::BFloat16* op = out.data_ptr<at::BFloat16>();
  const int64_t groups = h / group;
  for (int64_t r = 0; r < t; ++r) {
    const int64_t id = ip[r];
    TORCH_CHECK(id >= 0 && id < n, "ids: expected values in [0, ", n, "), got ", id);
    const int8_t* row = qp + id * h;
    const float* srow = sp + (per_row ? id : id * groups);
    for (int64_t g = 0; g < groups; ++g) {
      const float s = srow[per_row ? 0 : g];
      for (int64_t j = g * group; j < (g + 1) * group; ++j) {
        op[r * h + j] = c10::BFloat16(static_cast<float>(row[j]) * s);
      }
    }
  }
  auto shape = ids.sizes().vec();
  shape.push_back(h);
  return out.view(shape);
}

// The plugin's linear layers held here by index (kernels/vllm_plugin/layer_table.py): a compiled graph that calls
// layer_linear(x, index) passes one activation and an int a layer, not the layer's tensors (an int4 layer's five, an
// int8 layer's two, a blocks layer's one). Inductor's C++ wrapper takes every tensor a graph reads as an argument on
// each call, through Python (668 on the default model, ~0.8 ms of a decode step before the graph starts;
// docs/reports/2026-12-06-layer-table.md). Set while the engine loads, read by its one stepping thread.
enum class TableKind { int4, int8, blocks };

struct TableLayer {
  TableKind kind;
  at::Tensor t0, t1, t2, t3, t4;  // int4: packed, scales_and_zeros, qweight, scales, zeros; int8: qweight, scales;
                                  // blocks: blocks
  int64_t group, mode, dequant_threshold, avx2_rows, avx2_bits, k;
  bool fp32_prefill;
};

std::vector<std::optional<TableLayer>>& table() {
  static std::vector<std::optional<TableLayer>> layers;
  return layers;
}

void put(int64_t index, TableLayer layer) {
  TORCH_CHECK(index >= 0, "index: expected >= 0, got ", index);
  auto& layers = table();
  if (static_cast<size_t>(index) >= layers.size()) layers.resize(index + 1);
  layers[index] = std::move(layer);
}

void set_int4_layer(int64_t index, const at::Tensor& packed, const at::Tensor& scales_and_zeros,
                    const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& zeros, int64_t group,
                    int64_t mode, int64_t dequant_threshold, bool fp32_prefill, int64_t avx2_rows, int64_t avx2_bits,
                    int64_t k) {
  put(index, TableLayer{TableKind::int4, packed, scales_and_zeros, qweight, scales, zeros, group, mode,
                        dequant_threshold, avx2_rows, avx2_bits, k, fp32_prefill});
}

void set_int8_layer(int64_t index, const at::Tensor& qweight, const at::Tensor& scales, int64_t dequant_threshold,
                    int64_t avx2_rows) {
  put(index, TableLayer{TableKind::int8, qweight, scales, {}, {}, {}, 0, 0, dequant_threshold, avx2_rows, 0,
                        qweight.size(1), false});
}

void set_blocks_layer(int64_t index, const at::Tensor& blocks, int64_t dequant_threshold, int64_t avx2_rows) {
  TORCH_CHECK(blocks.dim() == 3, "blocks: expected a decode layout [N/8, K/block, bytes], got ", blocks.sizes());
  const int64_t k = blocks.size(1) * block_weights(blocks.size(2));
  put(index, TableLayer{TableKind::blocks, blocks, {}, {}, {}, {}, 0, 0, dequant_threshold, avx2_rows, 0, k, false});
}

void forget_layers() { table().clear(); }

int64_t layer_count() {
  int64_t set = 0;
  for (const auto& layer : table()) set += layer.has_value();
  return set;
}

at::Tensor layer_linear(const at::Tensor& x, int64_t index) {
  const auto& layers = table();
  TORCH_CHECK(index >= 0 && static_cast<size_t>(index) < layers.size() && layers[index].has_value(),
              "layer ", index, " was never set (edge_avx2::set_int4_layer, set_int8_layer, set_blocks_layer)");
  const TableLayer& l = *layers[index];
  TORCH_CHECK(x.size(-1) == l.k, "x: expected [..., ", l.k, "] for layer ", index, ", got ", x.sizes());
  switch (l.kind) {
    case TableKind::int4:
      return int4_linear(x, l.t0, l.t1, l.t2, l.t3, l.t4, l.group, l.mode, l.dequant_threshold, l.fp32_prefill,
                         l.avx2_rows, l.avx2_bits);
    case TableKind::int8: return int8_linear(x, l.t0, l.t1, l.dequant_threshold, l.avx2_rows);
    case TableKind::blocks: return blocks_linear(x, l.t0, l.dequant_threshold, l.avx2_rows);
  }
  TORCH_CHECK(false, "layer ", index, ": unknown kind");
}
}  // namespace

TORCH_LIBRARY(edge_avx2, m) {
  m.def("w4a16_linear(Tensor x, Tensor qweight, Tensor scales, Tensor zeros, int group) -> Tensor");
  m.def("w4a8_linear(Tensor x, Tensor qweight, Tensor scales, Tensor zeros, int group) -> Tensor");
  m.def("w8a16_linear(Tensor x, Tensor qweight, Tensor scales) -> Tensor");
  m.def("q4k_linear(Tensor x, Tensor qweight, Tensor meta) -> Tensor");
  m.def("q6k_linear(Tensor x, Tensor blocks) -> Tensor");
  m.def("g32_linear(Tensor x, Tensor blocks, int bits) -> Tensor");
  m.def("blocks_linear(Tensor x, Tensor blocks, int dequant_threshold, int avx2_rows) -> Tensor");
  m.def("blocks_dequantize(Tensor blocks) -> Tensor");
  m.def("int4_dequantize(Tensor qweight, Tensor scales, Tensor zeros, int group, bool fp32) -> Tensor");
  m.def("q4k_dequantize(Tensor qweight, Tensor meta, bool fp32) -> Tensor");
  m.def("int8_embedding(Tensor ids, Tensor qweight, Tensor scales) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor qweight, Tensor scales, int dequant_threshold, int avx2_rows) -> Tensor");
  m.def("uses_vnni() -> bool", &vnni_in_use);
  m.def("int4_linear(Tensor x, Tensor packed, Tensor scales_and_zeros, Tensor qweight, Tensor scales, "
        "Tensor zeros, int group, int mode, int dequant_threshold, bool fp32_prefill, int avx2_rows, "
        "int avx2_bits) -> Tensor");
  m.def("set_int4_layer(int index, Tensor packed, Tensor scales_and_zeros, Tensor qweight, Tensor scales, "
        "Tensor zeros, int group, int mode, int dequant_threshold, bool fp32_prefill, int avx2_rows, "
        "int avx2_bits, int k) -> ()", &set_int4_layer);
  m.def("set_int8_layer(int index, Tensor qweight, Tensor scales, int dequant_threshold, int avx2_rows) -> ()",
        &set_int8_layer);
  m.def("set_blocks_layer(int index, Tensor blocks, int dequant_threshold, int avx2_rows) -> ()",
        &set_blocks_layer);
  m.def("forget_layers() -> ()", &forget_layers);
  m.def("layer_count() -> int", &layer_count);
  m.def("layer_linear(Tensor x, int index) -> Tensor");
}

TORCH_LIBRARY_IMPL(edge_avx2, CPU, m) {
  m.impl("w4a16_linear", &w4a16_linear);
  m.impl("w4a8_linear", &w4a8_linear);
  m.impl("w8a16_linear", &w8a16_linear);
  m.impl("q4k_linear", &q4k_linear);
  m.impl("q6k_linear", &q6k_linear);
  m.impl("g32_linear", &g32_linear);
  m.impl("blocks_linear", &blocks_linear);
  m.impl("blocks_dequantize", &blocks_dequantize);
  m.impl("int4_dequantize", &int4_dequantize);
  m.impl("q4k_dequantize", &q4k_dequantize);
  m.impl("int8_linear", &int8_linear);
  m.impl("int8_embedding", &int8_embedding);
  m.impl("int4_linear", &int4_linear);
  m.impl("layer_linear", &layer_linear);
}

#else  // ---- the body: included three times above, in namespaces isa_plain, isa_vnni and isa_vnni512 ----

// ---- int16 activations: 16 bytes (32 codes) a step ----
// acc[r][i] = the int32 lanes of sum_k q_k xq[r, k] over group i of NG groups from byte `off` of the channel's row.
template <int MB, int GROUP, int NG>
inline void dots_a16(const uint8_t* w, const int16_t* xe, const int16_t* xo, int64_t half_k, int64_t off,
                     __m256i (*acc)[NG]) {
  const __m256i mask = _mm256_set1_epi16(0x0F);
  for (int i = 0; i < NG; ++i) {
    for (int c = 0; c < GROUP / 32; ++c) {
      const int64_t at = off + i * (GROUP / 2) + 16 * c;
      const __m256i wide = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + at)));
      const __m256i lo = _mm256_and_si256(wide, mask);  // q[2j]
      const __m256i hi = _mm256_srli_epi16(wide, 4);    // q[2j+1]
      for (int r = 0; r < MB; ++r) {
#if EDGE_AVX2_VNNI
        __m256i p = c == 0 ? _mm256_setzero_si256() : acc[r][i];
        p = EDGE_DPWSSD(p, lo, loadu(xe + r * half_k + at));
        acc[r][i] = EDGE_DPWSSD(p, hi, loadu(xo + r * half_k + at));
#else
        const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(lo, loadu(xe + r * half_k + at)),
                                           _mm256_madd_epi16(hi, loadu(xo + r * half_k + at)));
        acc[r][i] = c == 0 ? p : _mm256_add_epi32(acc[r][i], p);
#endif
      }
    }
  }
}

template <int MB, int GROUP>
struct A16 {
  using Q = int16_t;
  static constexpr int QMAX = 32767;
  // Per-row int32 sums of 8 groups from byte `off`: out[r] = [dot(g0), ..., dot(g7)].
  static inline void dots8(const uint8_t* w, const Q* xe, const Q* xo, int64_t half_k, int64_t off, __m256i* out) {
    __m256i acc[MB][8];
    dots_a16<MB, GROUP, 8>(w, xe, xo, half_k, off, acc);
    for (int r = 0; r < MB; ++r) out[r] = hsum8_epi32(acc[r]);
  }
  static inline void dot1(const uint8_t* w, const Q* xe, const Q* xo, int64_t half_k, int64_t off, int32_t* out) {
    __m256i acc[MB][1];
    dots_a16<MB, GROUP, 1>(w, xe, xo, half_k, off, acc);
    for (int r = 0; r < MB; ++r) out[r] = hsum_epi32(acc[r][0]);
  }
};

// ---- int8 activations: 32 bytes (64 codes) a step ----
// 16-bit pair sums of unsigned codes times signed activations for 32 bytes from `at`, both nibbles.
inline __m256i pairs_a8(__m256i lo, __m256i hi, const int8_t* xe, const int8_t* xo, int64_t at) {
  return _mm256_add_epi16(_mm256_maddubs_epi16(lo, loadu(xe + at)), _mm256_maddubs_epi16(hi, loadu(xo + at)));
}

// acc + the int32 sums of 4 adjacent products, for 32 bytes from `at`, both nibbles: vpdpbusd with AVX-VNNI, else
// vpmaddubsw pairs, a 16-bit add and a vpmaddwd by ones.
inline __m256i sums_a8(__m256i lo, __m256i hi, const int8_t* xe, const int8_t* xo, int64_t at, __m256i acc) {
#if EDGE_AVX2_VNNI
  acc = EDGE_DPBUSD(acc, lo, loadu(xe + at));
  return EDGE_DPBUSD(acc, hi, loadu(xo + at));
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs_a8(lo, hi, xe, xo, at), _mm256_set1_epi16(1)));
#endif
}

template <int MB, int GROUP>
struct A8 {
  using Q = int8_t;
  static constexpr int QMAX = 127;
  static inline void split(const uint8_t* p, __m256i& lo, __m256i& hi) {
    const __m256i mask = _mm256_set1_epi8(0x0F);
    const __m256i v = loadu(p);
    lo = _mm256_and_si256(v, mask);
    hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
  }
  static inline void dots8(const uint8_t* w, const Q* xe, const Q* xo, int64_t half_k, int64_t off, __m256i* out) {
    [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);
    if constexpr (GROUP == 32) {
      // A 32-byte step covers two groups, one per 128-bit half: after vpmaddwd lanes 0-3 are group 2c, 4-7 2c+1.
      __m256i acc[MB][4];
      for (int c = 0; c < 4; ++c) {
        __m256i lo, hi;
        split(w + off + 32 * c, lo, hi);
        for (int r = 0; r < MB; ++r)
          acc[r][c] = sums_a8(lo, hi, xe + r * half_k, xo + r * half_k, off + 32 * c, _mm256_setzero_si256());
      }
      const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
      for (int r = 0; r < MB; ++r) {
        // [g0, g2, g4, g6 | g1, g3, g5, g7] -> [g0 .. g7]
        const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(acc[r][0], acc[r][1]),
                                            _mm256_hadd_epi32(acc[r][2], acc[r][3]));
        out[r] = _mm256_permutevar8x32_epi32(a, order);
      }
    } else {
      __m256i acc[MB][8];
      for (int i = 0; i < 8; ++i) {
#if EDGE_AVX2_VNNI
        for (int r = 0; r < MB; ++r) acc[r][i] = _mm256_setzero_si256();
        for (int c = 0; c < GROUP / 64; ++c) {
          const int64_t at = off + i * (GROUP / 2) + 32 * c;
          __m256i lo, hi;
          split(w + at, lo, hi);
          for (int r = 0; r < MB; ++r) acc[r][i] = sums_a8(lo, hi, xe + r * half_k, xo + r * half_k, at, acc[r][i]);
        }
#else
        // 16-bit sums stay below 2*15*127 * GROUP/32 <= 15240 for GROUP <= 128: one vpmaddwd per group.
        __m256i sum16[MB];
        for (int c = 0; c < GROUP / 64; ++c) {
          const int64_t at = off + i * (GROUP / 2) + 32 * c;
          __m256i lo, hi;
          split(w + at, lo, hi);
          for (int r = 0; r < MB; ++r) {
            const __m256i p = pairs_a8(lo, hi, xe + r * half_k, xo + r * half_k, at);
            sum16[r] = c == 0 ? p : _mm256_add_epi16(sum16[r], p);
          }
        }
        for (int r = 0; r < MB; ++r) acc[r][i] = _mm256_madd_epi16(sum16[r], ones);
#endif
      }
      for (int r = 0; r < MB; ++r) out[r] = hsum8_epi32(acc[r]);
    }
  }
  static inline void dot1(const uint8_t* w, const Q* xe, const Q* xo, int64_t half_k, int64_t off, int32_t* out) {
    // One group, 16 bytes at a time on 128-bit vectors (any GROUP, including 32 at an odd group).
    const __m128i mask = _mm_set1_epi8(0x0F), ones = _mm_set1_epi16(1);
    __m128i acc[MB];
    for (int r = 0; r < MB; ++r) acc[r] = _mm_setzero_si128();
    for (int c = 0; c < GROUP / 32; ++c) {
      const int64_t at = off + 16 * c;
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + at));
      const __m128i lo = _mm_and_si128(v, mask), hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
      for (int r = 0; r < MB; ++r) {
        const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(xe + r * half_k + at));
        const __m128i o = _mm_loadu_si128(reinterpret_cast<const __m128i*>(xo + r * half_k + at));
        const __m128i p = _mm_add_epi16(_mm_maddubs_epi16(lo, e), _mm_maddubs_epi16(hi, o));
        acc[r] = _mm_add_epi32(acc[r], _mm_madd_epi16(p, ones));
      }
    }
    for (int r = 0; r < MB; ++r) {
      __m128i s = _mm_add_epi32(acc[r], _mm_shuffle_epi32(acc[r], 0x4E));
      s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
      out[r] = _mm_cvtsi128_si32(s);
    }
  }
};

// Where a channel's scale and zero come from, 8 groups at a time (s: scale, z: the coefficient of a * sum xq, i.e.
// zero - 8 scale for cpu_int4's w = (q - 8) scale + zero).
// cpu_int4's bf16 scales and zeros [N, K/GROUP].
struct Bf16Grid {
  const uint16_t* scales;
  const uint16_t* zeros;
  int64_t groups;
  inline void eight(int64_t col, int64_t g, __m256& s, __m256& z) const {
    s = load_bf16x8(scales + col * groups + g);
    z = _mm256_fnmadd_ps(_mm256_set1_ps(8.f), s, load_bf16x8(zeros + col * groups + g));
  }
  inline void one(int64_t col, int64_t g, float& s, float& z) const {
    s = bf16_to_float(scales[col * groups + g]);
    z = bf16_to_float(zeros[col * groups + g]) - 8.f * s;
  }
};

// A GGUF Q4_K tensor's own scales (kernels/ops/q4k.py): per block of 256 weights (8 groups of 32), 16 bytes,
// fp16 d | fp16 dmin | 12 bytes of 6-bit (sc_j, m_j); w = d sc_j q - dmin m_j, so s = d sc_j and z = -dmin m_j.
// The 12 bytes b as 32-bit lanes [L, H, X]: sc_0..3 = L & 63, m_0..3 = H & 63; sc_4..7 = X's low nibbles with L's
// top 2 bits above them, m_4..7 = X's high nibbles with H's top 2 bits above them.
struct Q4kGrid {
  const uint8_t* meta;
  int64_t blocks;
  inline void eight(int64_t col, int64_t g, __m256& s, __m256& z) const {
    const uint8_t* blk = meta + (col * blocks + g / 8) * 16;
    uint32_t dd;
    std::memcpy(&dd, blk, 4);
    const __m128 d = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(dd)));  // [d, dmin, 0, 0]
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk));  // [d dmin, L, H, X] as 32-bit lanes
    const __m128i six = _mm_set1_epi8(0x3F), four = _mm_set1_epi8(0x0F), two = _mm_set1_epi8(0x03);
    const __m128i low = _mm_and_si128(_mm_srli_si128(v, 4), six);  // [sc0-3, m0-3, ...]
    const __m128i top = _mm_slli_epi32(_mm_and_si128(_mm_srli_epi32(_mm_srli_si128(v, 4), 6), two), 4);  // L, H
    const __m128i x = _mm_shuffle_epi32(v, 0xFF);  // X in every lane
    const __m128i nibbles = _mm_and_si128(_mm_srlv_epi32(x, _mm_setr_epi32(0, 4, 0, 0)), four);  // [X lo, X hi]
    const __m128i high = _mm_or_si128(nibbles, top);  // [sc4-7, m4-7, ...]
    const __m128i sm = _mm_unpacklo_epi32(low, high);  // [sc0-3, sc4-7, m0-3, m4-7]
    s = _mm256_mul_ps(_mm256_broadcastss_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm)));
    z = _mm256_mul_ps(_mm256_broadcastss_ps(_mm_sub_ps(_mm_setzero_ps(), _mm_movehdup_ps(d))),
                      _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8))));
  }
  inline void one(int64_t, int64_t, float& s, float& z) const { s = z = 0.f; }  // K is whole blocks: never called
};

// Output channel `col` for MB activation rows from `m0`; writes y[m0 .. m0+MB, col].
template <template <int, int> class Kind, int MB, int GROUP, typename Grid>
void channel(const uint8_t* qweight, const Grid& grid, const Acts<typename Kind<MB, GROUP>::Q>& x, float* y,
             int64_t col, int64_t m0, int64_t n, int64_t k) {
  using K = Kind<MB, GROUP>;
  const int64_t half_k = k / 2;
  const int64_t groups = k / GROUP;
  const uint8_t* wrow = qweight + col * half_k;
  const typename K::Q* xe = x.xe + m0 * half_k;
  const typename K::Q* xo = x.xo + m0 * half_k;
  const float* a = x.a + m0 * groups;
  const float* xs = x.xs + m0 * groups;
  __m256 total[MB];
  for (int r = 0; r < MB; ++r) total[r] = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8) {
    __m256i dots[MB];
    K::dots8(wrow, xe, xo, half_k, g * (GROUP / 2), dots);
    __m256 s, z;
    grid.eight(col, g, s, z);
    for (int r = 0; r < MB; ++r) {
      const __m256 sa = _mm256_mul_ps(s, _mm256_loadu_ps(a + r * groups + g));
      total[r] = _mm256_fmadd_ps(sa, _mm256_cvtepi32_ps(dots[r]), total[r]);
      total[r] = _mm256_fmadd_ps(z, _mm256_loadu_ps(xs + r * groups + g), total[r]);
    }
  }
  float tail[MB];
  for (int r = 0; r < MB; ++r) tail[r] = 0.f;
  for (; g < groups; ++g) {  // the last groups % 8
    float s, z;
    grid.one(col, g, s, z);
    int32_t dot[MB];
    K::dot1(wrow, xe, xo, half_k, g * (GROUP / 2), dot);
    for (int r = 0; r < MB; ++r)
      tail[r] += s * a[r * groups + g] * static_cast<float>(dot[r]) + z * xs[r * groups + g];
  }
  for (int r = 0; r < MB; ++r) y[(m0 + r) * n + col] = hsum_ps(total[r]) + tail[r];
}

template <template <int, int> class Kind, int GROUP, typename Q, typename Grid>
void channels(const uint8_t* wp, const Grid& grid, const Acts<Q>& x, float* yp, int64_t begin, int64_t end,
              int64_t m, int64_t n, int64_t k) {
  // Channel outermost: its weights come from memory once and stay in L1 for every block of rows. The row ~8 KB
  // ahead is prefetched (into L2: prefetch_row): one thread's stream alone reached ~18 GB/s, with it ~29 GB/s (int8,
  // 4096x4096, Zen 5).
  const int64_t half_k = k / 2;
  const int64_t ahead = std::max<int64_t>(1, (8192 + half_k - 1) / half_k);
  for (int64_t c = begin; c < end; ++c) {
    if (c + ahead < end) {
      prefetch_row(reinterpret_cast<const char*>(wp + (c + ahead) * half_k), half_k);
    }
    int64_t m0 = 0;
    for (; m0 + 2 <= m; m0 += 2) channel<Kind, 2, GROUP>(wp, grid, x, yp, c, m0, n, k);
    if (m0 < m) channel<Kind, 1, GROUP>(wp, grid, x, yp, c, m0, n, k);
  }
}


// ---- the decode layout: 8 output channels interleaved (kernels/ops/avx2_int4.py decode_layout) ----
// qweight uint8 [N/8, K/8, 32]: for channels 8b..8b+7 and weights 8j..8j+7, 32 bytes, 4 a channel; byte t of
// channel c holds k = 8j+t in its low nibble and k = 8j+4+t in its high one. scales, zeros bf16 [N/8, G, 8].
// One 32-byte load feeds two vpdpbusd whose int32 lanes are the 8 channels, each against 4 activations broadcast:
// no horizontal sums, and a group's 8 scales are one vector (the row-major kernel above transposes every 8 groups
// through a tree of hadds and finishes a K that is not a multiple of 8 groups on 128-bit vectors).
// Activations int8 in order (xo null in quantize_acts), per weight group.
// The int32 sums of group g (GROUP weights from k = g * GROUP) of one block of 8 channels, for MB rows from m0:
// lane c of sum[r] is channel c's. w: the block's K/8 chunks of 32 bytes.
// One chunk of 8 channels x 8 weights in the decode layout (lo: the codes of its first 4 weights, hi: of the next 4,
// byte 4c+t channel c's) against a row's 8 activations from x: vpdpbusd into acc, or in the plain AVX2 build 16-bit
// pair sums into sum16 (first: the sum's first chunk), which the caller widens into acc.
inline void chunk8_a8(__m256i lo, __m256i hi, const int8_t* x, bool first, __m256i& acc,
                      [[maybe_unused]] __m256i& sum16) {
  int32_t x0, x1;
  std::memcpy(&x0, x, 4);
  std::memcpy(&x1, x + 4, 4);
#if EDGE_AVX2_VNNI
  acc = EDGE_DPBUSD(acc, lo, _mm256_set1_epi32(x0));
  acc = EDGE_DPBUSD(acc, hi, _mm256_set1_epi32(x1));
#else
  const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(x0)),
                                     _mm256_maddubs_epi16(hi, _mm256_set1_epi32(x1)));
  sum16 = first ? p : _mm256_add_epi16(sum16, p);
#endif
}

template <int MB, int GROUP>
inline void group8_a8(const uint8_t* w, const int8_t* xq, int64_t m0, int64_t k, int64_t g, __m256i* sum) {
  const __m256i mask = _mm256_set1_epi8(0x0F);
  [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);
  // Four accumulators a row, one per 8-weight chunk of a 32, so that vpdpbusd (latency ~4 cycles) is not one chain
  // per group: with a single one the 4096x4096 call ran at half the row-major kernel's speed here.
  __m256i acc[MB][4];
  for (int r = 0; r < MB; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_si256();
  // The stream ~8 KB ahead, a group's bytes at a time (blocks are contiguous, so this runs on into the next
  // ones): prefetching a whole next block at its start, as channels() does a row, stalled the loads of this one
  // once a block was 16 KB (K 4096: 1.55x the row-major kernel's time).
  for (int64_t off = 0; off < GROUP * 4; off += 64) prefetch_line(reinterpret_cast<const char*>(w + g * GROUP * 4 + off + 8192));
  for (int c = 0; c < GROUP / 32; ++c) {
    // plain AVX2: 16-bit sums of a 32-weight sub-block: 4 chunks x 2 pairs <= 2*15*127 each = 30480, below
    // saturation; widened once per sub-block (one vpmaddwd per 4 chunks instead of one per chunk)
    [[maybe_unused]] __m256i sum16[MB];
    for (int j = 0; j < 4; ++j) {
      const int64_t kk = g * GROUP + c * 32 + 8 * j;
      const __m256i v = loadu(w + kk * 4);
      const __m256i lo = _mm256_and_si256(v, mask);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
      for (int r = 0; r < MB; ++r) chunk8_a8(lo, hi, xq + (m0 + r) * k + kk, j == 0, acc[r][j], sum16[r]);
    }
#if !EDGE_AVX2_VNNI
    for (int r = 0; r < MB; ++r) acc[r][c % 4] = _mm256_add_epi32(acc[r][c % 4], _mm256_madd_epi16(sum16[r], ones));
#endif
  }
  for (int r = 0; r < MB; ++r)
    sum[r] = _mm256_add_epi32(_mm256_add_epi32(acc[r][0], acc[r][1]), _mm256_add_epi32(acc[r][2], acc[r][3]));
}

// y[m0 .. m0+MB, 8b .. 8b+7] from the fp32 totals: fp32 y, or bf16 rounded as c10 rounds (no fp32 scratch and no copy
// loop after the GEMV).
template <int MB, typename Out>
inline void store8(const __m256* total, Out* y, int64_t b, int64_t m0, int64_t n) {
  for (int r = 0; r < MB; ++r) {
    if constexpr (std::is_same_v<Out, float>) {
      _mm256_storeu_ps(y + (m0 + r) * n + b * 8, total[r]);
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(y + (m0 + r) * n + b * 8), to_bf16x8(total[r]));
    }
  }
}

template <int MB, int GROUP, typename Out>
void block8_a8(const uint8_t* wq, const uint16_t* sp, const uint16_t* zp, const int8_t* xq, const float* a,
               const float* xs, Out* y, int64_t b, int64_t m0, int64_t n, int64_t k) {
  const int64_t groups = k / GROUP;
  const uint8_t* w = wq + b * k * 4;  // K/8 chunks of 32 bytes
  const uint16_t* s8 = sp + b * groups * 8;
  const uint16_t* z8 = zp + b * groups * 8;
  __m256 total[MB];
  for (int r = 0; r < MB; ++r) total[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i sum[MB];
    group8_a8<MB, GROUP>(w, xq, m0, k, g, sum);
    const __m256 s = load_bf16x8(s8 + g * 8);
    const __m256 z = _mm256_fnmadd_ps(_mm256_set1_ps(8.f), s, load_bf16x8(z8 + g * 8));
    for (int r = 0; r < MB; ++r) {
      const int64_t at = (m0 + r) * groups + g;
      total[r] = _mm256_fmadd_ps(_mm256_mul_ps(s, _mm256_set1_ps(a[at])), _mm256_cvtepi32_ps(sum[r]), total[r]);
      total[r] = _mm256_fmadd_ps(z, _mm256_set1_ps(xs[at]), total[r]);
    }
  }
  store8<MB>(total, y, b, m0, n);
}

// ---- Q4_K in the decode layout (kernels/ops/q4k.py decode_layout): the codes as block8_a8's, and per block of 8
// channels and 256 weights 128 bytes, the 8 channels' 16 bytes of the file rearranged: fp16 d[8] | fp16 dmin[8] |
// 64 bytes of low nibbles (byte i: value i in bits 0-3, value i+64 in bits 4-7) | 32 bytes of top bit pairs (byte
// i: values i, i+32, i+64, i+96 at bits 0, 2, 4, 6). Value 8j+c is channel c's sc_j, 64+8j+c its m_j.
// sm[128] <- the 128 six-bit values, one a byte: ~20 vector ops for 8 channels' 8 groups, where the bf16 grid
// loads and widens 16 vectors.
inline void q4k_values8(const uint8_t* meta, uint8_t* sm) {
  const __m256i four = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
  const __m256i n0 = loadu(meta + 32), n1 = loadu(meta + 64), h = loadu(meta + 96);
  // each value's top two bits moved to bits 4-5 (16-bit shifts; the mask drops what crosses a byte)
  const __m256i t0 = _mm256_and_si256(_mm256_slli_epi16(h, 4), top), t1 = _mm256_and_si256(_mm256_slli_epi16(h, 2), top);
  const __m256i t2 = _mm256_and_si256(h, top), t3 = _mm256_and_si256(_mm256_srli_epi16(h, 2), top);
  __m256i* out = reinterpret_cast<__m256i*>(sm);
  _mm256_store_si256(out, _mm256_or_si256(_mm256_and_si256(n0, four), t0));  // sc, values 0-31
  _mm256_store_si256(out + 1, _mm256_or_si256(_mm256_and_si256(n1, four), t1));  // sc, values 32-63
  _mm256_store_si256(out + 2, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(n0, 4), four), t2));  // m 0-31
  _mm256_store_si256(out + 3, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(n1, 4), four), t3));  // m 32-63
}

inline __m256 u8x8_ps(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// w = d sc_j q - dmin m_j: per group s = d sc_j and z = -dmin m_j (the coefficient of a * sum xq), 8 channels a vector.
template <int MB, typename Out>
void block8_q4k(const uint8_t* wq, const uint8_t* meta, const int8_t* xq, const float* a, const float* xs, Out* y,
                int64_t b, int64_t m0, int64_t n, int64_t k) {
  const int64_t groups = k / 32, nblocks = k / 256;
  const uint8_t* w = wq + b * k * 4;
  const uint8_t* mb = meta + b * nblocks * 128;
  alignas(32) uint8_t sm[128];
  __m256 total[MB];
  for (int r = 0; r < MB; ++r) total[r] = _mm256_setzero_ps();
  for (int64_t blk = 0; blk < nblocks; ++blk) {
    const uint8_t* me = mb + blk * 128;
    prefetch_line(reinterpret_cast<const char*>(me + 2048));  // the scales 16 blocks (~18 KB of codes) ahead
    prefetch_line(reinterpret_cast<const char*>(me + 2048 + 64));
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(me)));
    const __m256 nd = _mm256_sub_ps(_mm256_setzero_ps(),
                                    _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(me + 16))));
    q4k_values8(me, sm);
    for (int j = 0; j < 8; ++j) {
      const int64_t g = blk * 8 + j;
      __m256i sum[MB];
      group8_a8<MB, 32>(w, xq, m0, k, g, sum);
      const __m256 s = _mm256_mul_ps(d, u8x8_ps(sm + 8 * j));
      const __m256 z = _mm256_mul_ps(nd, u8x8_ps(sm + 64 + 8 * j));
      for (int r = 0; r < MB; ++r) {
        const int64_t at = (m0 + r) * groups + g;
        total[r] = _mm256_fmadd_ps(_mm256_mul_ps(s, _mm256_set1_ps(a[at])), _mm256_cvtepi32_ps(sum[r]), total[r]);
        total[r] = _mm256_fmadd_ps(z, _mm256_set1_ps(xs[at]), total[r]);
      }
    }
  }
  store8<MB>(total, y, b, m0, n);
}

// ---- Q6_K in the decode layout (kernels/ops/q6k.py decode_layout). Per block of 8 channels and 256 weights, 1680
// bytes (the 8 channels' 210): fp16 d[8] | int8 sc[16 sub-blocks][8 channels] | per sub-block s of 16 weights, 96
// bytes: the low nibbles of weights 16s..16s+7 and of 16s+8..16s+15 as the int4 decode layout's two chunks (byte
// 4c+t: k = 8j+t low, 8j+4+t high), then the top two bits of the four 32-byte vectors those make, at bits 0, 2, 4,
// 6 of the same byte. w = d sc_s (q - 32) with q in 0..63: y += d sc_s (a sum q xq - 32 a sum_16 xq).
// vpdpbusd takes the unsigned 6-bit codes as it takes the 4-bit ones (4 products <= 4*63*127: no saturation; the
// plain AVX2 build's vpmaddubsw pairs <= 2*63*127 = 16002, two of them summed in 16 bits <= 32004).
template <int MB, typename Out>
void block8_q6k(const uint8_t* bp, const int8_t* xq, const float* a, const int32_t* xs16, Out* y, int64_t b,
                int64_t m0, int64_t n, int64_t k) {
  const int64_t nblocks = k / 256, groups = k / 32;
  const uint8_t* base = bp + b * nblocks * 1680;
  const __m256i four = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
  [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);
  __m256 total[MB];
  for (int r = 0; r < MB; ++r) total[r] = _mm256_setzero_ps();
  for (int64_t blk = 0; blk < nblocks; ++blk) {
    const uint8_t* me = base + blk * 1680;
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(me)));
    const int8_t* sc = reinterpret_cast<const int8_t*>(me + 16);
    const uint8_t* q = me + 144;
    // Integers until a group of 32 ends: its two sub-blocks' sc_s (sum q xq - 32 sum_16 xq), |.| < 2^26 (converted
    // to fp32 with its relative rounding, 2^-24), then one conversion and one multiply-add by d a a group, where a
    // conversion and two multiply-adds a sub-block held the kernel near 10 GB/s at 2048x5632.
    for (int g = 0; g < 8; ++g) {
      __m256i iacc[MB];
      for (int r = 0; r < MB; ++r) iacc[r] = _mm256_setzero_si256();
      for (int half = 0; half < 2; ++half) {
        const int s = 2 * g + half;
        const uint8_t* p = q + 96 * s;
        // no software prefetch: with two lines 8 KB ahead a sub-block (as group8_a8's) it read 10-12 GB/s from
        // memory, without 18-23 (benchmarks/gguf_grids, Zen 4, 2026-12-06): the hardware's stream prefetch keeps up
        const __m256i v0 = loadu(p), v1 = loadu(p + 32), h = loadu(p + 64);
        const __m256i lo0 = _mm256_or_si256(_mm256_and_si256(v0, four), _mm256_and_si256(_mm256_slli_epi16(h, 4), top));
        const __m256i hi0 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v0, 4), four),
                                            _mm256_and_si256(_mm256_slli_epi16(h, 2), top));
        const __m256i lo1 = _mm256_or_si256(_mm256_and_si256(v1, four), _mm256_and_si256(h, top));
        const __m256i hi1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v1, 4), four),
                                            _mm256_and_si256(_mm256_srli_epi16(h, 2), top));
        const __m256i sc8 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + 8 * s)));
        const int64_t kk = blk * 256 + 16 * s;
        for (int r = 0; r < MB; ++r) {
          const int8_t* x = xq + (m0 + r) * k + kk;
          int32_t x0, x1, x2, x3;
          std::memcpy(&x0, x, 4);
          std::memcpy(&x1, x + 4, 4);
          std::memcpy(&x2, x + 8, 4);
          std::memcpy(&x3, x + 12, 4);
          // the -32 offset first: sum q xq - 32 sum xq, in int32
          const __m256i offset = _mm256_set1_epi32(-32 * xs16[(m0 + r) * (k / 16) + kk / 16]);
#if EDGE_AVX2_VNNI
          __m256i acc0 = EDGE_DPBUSD(offset, lo0, _mm256_set1_epi32(x0));
          __m256i acc1 = EDGE_DPBUSD(_mm256_setzero_si256(), hi0, _mm256_set1_epi32(x1));
          acc0 = EDGE_DPBUSD(acc0, lo1, _mm256_set1_epi32(x2));
          acc1 = EDGE_DPBUSD(acc1, hi1, _mm256_set1_epi32(x3));
          const __m256i sum = _mm256_add_epi32(acc0, acc1);
#else
          const __m256i p0 = _mm256_add_epi16(_mm256_maddubs_epi16(lo0, _mm256_set1_epi32(x0)),
                                              _mm256_maddubs_epi16(hi0, _mm256_set1_epi32(x1)));
          const __m256i p1 = _mm256_add_epi16(_mm256_maddubs_epi16(lo1, _mm256_set1_epi32(x2)),
                                              _mm256_maddubs_epi16(hi1, _mm256_set1_epi32(x3)));
          const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(p0, ones), _mm256_madd_epi16(p1, ones)),
                                               offset);
#endif
          iacc[r] = _mm256_add_epi32(iacc[r], _mm256_mullo_epi32(sum, sc8));
        }
      }
      for (int r = 0; r < MB; ++r) {
        const __m256 da = _mm256_mul_ps(d, _mm256_set1_ps(a[(m0 + r) * groups + blk * 8 + g]));
        total[r] = _mm256_fmadd_ps(da, _mm256_cvtepi32_ps(iacc[r]), total[r]);
      }
    }
  }
  store8<MB>(total, y, b, m0, n);
}

template <typename Out>
void blocks8_q6k_out(const uint8_t* bp, const int8_t* xq, const float* a, const int32_t* xs16, Out* y, int64_t begin,
                     int64_t end, int64_t m, int64_t n, int64_t k) {
  for (int64_t b = begin; b < end; ++b) {
    int64_t m0 = 0;
    for (; m0 + 2 <= m; m0 += 2) block8_q6k<2, Out>(bp, xq, a, xs16, y, b, m0, n, k);
    if (m0 < m) block8_q6k<1, Out>(bp, xq, a, xs16, y, b, m0, n, k);
  }
}

void blocks8_q6k(const uint8_t* bp, const int8_t* xq, const float* a, const int32_t* xs16, float* y, uint16_t* yb,
                 int64_t begin, int64_t end, int64_t m, int64_t n, int64_t k) {
  if (y == nullptr) {
    blocks8_q6k_out(bp, xq, a, xs16, yb, begin, end, m, n, k);
  } else {
    blocks8_q6k_out(bp, xq, a, xs16, y, begin, end, m, n, k);
  }
}

// ---- Q8_0 and Q5_0 in the decode layout (kernels/ops/g32.py): ggml's symmetric blocks of 32 weights, one fp16 d
// each, w = d q with q = the file's int8 (Q8_0) or its 5-bit code - 16 (Q5_0). Per 8 channels and 32 weights, fp16
// d[8] and then
//   Q8_0, 256 bytes (272 in all, the 8 channels' 34): vector v (32 bytes) byte 4c+t = channel c's q at k = 4v+t;
//   Q5_0, 160 bytes (176, the 8 channels' 22): 4 chunks of 32 bytes as the int4 decode layout's (byte 4c+t: the low
//         4 bits of k = 8j+t in its low nibble, of 8j+4+t in its high one), then 32 bytes of fifth bits: byte 4c+t
//         bit 2j that of k = 8j+t, bit 2j+1 that of 8j+4+t.
// vpdpbusd takes unsigned codes: Q8_0's q + 128 (q xor 0x80) and Q5_0's 0..31, the offset (-128 or -16 times the
// group's activation sum) put in first. The plain AVX2 build multiplies Q8_0 as |q| by the activations with q's sign
// (vpmaddubsw pairs <= 2*128*127 = 32512: no saturation); Q5_0's pairs <= 2*31*127, four of them summed in 16 bits
// <= 31496.
template <int BITS, int MB, typename Out>
void block8_g32(const uint8_t* bp, const int8_t* xq, const float* a, const int32_t* xs16, Out* y, int64_t b,
                int64_t m0, int64_t n, int64_t k) {
  constexpr int64_t BYTES = BITS == 8 ? 272 : 176;
  [[maybe_unused]] constexpr int32_t OFFSET = BITS == 8 ? 128 : 16;
  const int64_t groups = k / 32;
  const uint8_t* base = bp + b * groups * BYTES;
  [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);
  __m256 total[MB];
  for (int r = 0; r < MB; ++r) total[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* blk = base + g * BYTES;
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
    const uint8_t* q = blk + 16;
    __m256i acc[MB];
    for (int r = 0; r < MB; ++r) {
#if EDGE_AVX2_VNNI
      const int32_t* s16 = xs16 + (m0 + r) * (k / 16) + 2 * g;
      acc[r] = _mm256_set1_epi32(-OFFSET * (s16[0] + s16[1]));
#else
      acc[r] = BITS == 8 ? _mm256_setzero_si256()
                         : _mm256_set1_epi32(-OFFSET * (xs16[(m0 + r) * (k / 16) + 2 * g] +
                                                        xs16[(m0 + r) * (k / 16) + 2 * g + 1]));
#endif
    }
    const int8_t* x = xq + m0 * k + g * 32;
    if constexpr (BITS == 8) {
      [[maybe_unused]] const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
      for (int v = 0; v < 8; ++v) {
        const __m256i w = loadu(q + 32 * v);
#if EDGE_AVX2_VNNI
        const __m256i u = _mm256_xor_si256(w, flip);
#else
        const __m256i u = _mm256_abs_epi8(w);
#endif
        for (int r = 0; r < MB; ++r) {
          int32_t x4;
          std::memcpy(&x4, x + r * k + 4 * v, 4);
#if EDGE_AVX2_VNNI
          acc[r] = EDGE_DPBUSD(acc[r], u, _mm256_set1_epi32(x4));
#else
          const __m256i p = _mm256_maddubs_epi16(u, _mm256_sign_epi8(_mm256_set1_epi32(x4), w));
          acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(p, ones));
#endif
        }
      }
    } else {
      const __m256i four = _mm256_set1_epi8(0x0F), fifth = _mm256_set1_epi8(0x10);
      const __m256i h = loadu(q + 128);
      // bit i of each byte moved to bit 4 (16-bit shifts; the mask drops what crosses a byte)
      const __m256i top[8] = {
          _mm256_and_si256(_mm256_slli_epi16(h, 4), fifth), _mm256_and_si256(_mm256_slli_epi16(h, 3), fifth),
          _mm256_and_si256(_mm256_slli_epi16(h, 2), fifth), _mm256_and_si256(_mm256_slli_epi16(h, 1), fifth),
          _mm256_and_si256(h, fifth),                        _mm256_and_si256(_mm256_srli_epi16(h, 1), fifth),
          _mm256_and_si256(_mm256_srli_epi16(h, 2), fifth), _mm256_and_si256(_mm256_srli_epi16(h, 3), fifth)};
      [[maybe_unused]] __m256i sum16[MB];  // plain AVX2: 4 chunks' pairs <= 4*2*31*127 = 31496 in 16 bits
      for (int j = 0; j < 4; ++j) {
        const __m256i v = loadu(q + 32 * j);
        const __m256i lo = _mm256_or_si256(_mm256_and_si256(v, four), top[2 * j]);
        const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), four), top[2 * j + 1]);
        for (int r = 0; r < MB; ++r) chunk8_a8(lo, hi, x + r * k + 8 * j, j == 0, acc[r], sum16[r]);
      }
#if !EDGE_AVX2_VNNI
      for (int r = 0; r < MB; ++r) acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(sum16[r], ones));
#endif
    }
    for (int r = 0; r < MB; ++r) {
      const __m256 da = _mm256_mul_ps(d, _mm256_set1_ps(a[(m0 + r) * groups + g]));
      total[r] = _mm256_fmadd_ps(da, _mm256_cvtepi32_ps(acc[r]), total[r]);
    }
  }
  store8<MB>(total, y, b, m0, n);
}

template <int BITS, typename Out>
void blocks8_g32_out(const uint8_t* bp, const int8_t* xq, const float* a, const int32_t* xs16, Out* y, int64_t begin,
                     int64_t end, int64_t m, int64_t n, int64_t k) {
  for (int64_t b = begin; b < end; ++b) {
    int64_t m0 = 0;
    for (; m0 + 2 <= m; m0 += 2) block8_g32<BITS, 2, Out>(bp, xq, a, xs16, y, b, m0, n, k);
    if (m0 < m) block8_g32<BITS, 1, Out>(bp, xq, a, xs16, y, b, m0, n, k);
  }
}

// bits: 8 (Q8_0) or 5 (Q5_0); fp32 y, or bf16 (yb) when y is null.
void blocks8_g32(const uint8_t* bp, const int8_t* xq, const float* a, const int32_t* xs16, float* y, uint16_t* yb,
                 int64_t bits, int64_t begin, int64_t end, int64_t m, int64_t n, int64_t k) {
  if (bits == 8) {
    if (y == nullptr) blocks8_g32_out<8>(bp, xq, a, xs16, yb, begin, end, m, n, k);
    else blocks8_g32_out<8>(bp, xq, a, xs16, y, begin, end, m, n, k);
  } else {
    if (y == nullptr) blocks8_g32_out<5>(bp, xq, a, xs16, yb, begin, end, m, n, k);
    else blocks8_g32_out<5>(bp, xq, a, xs16, y, begin, end, m, n, k);
  }
}

template <typename Out>
void blocks8_q4k_out(const uint8_t* wq, const uint8_t* meta, const int8_t* xq, const float* a, const float* xs,
                     Out* y, int64_t begin, int64_t end, int64_t m, int64_t n, int64_t k) {
  for (int64_t b = begin; b < end; ++b) {
    int64_t m0 = 0;
    for (; m0 + 2 <= m; m0 += 2) block8_q4k<2, Out>(wq, meta, xq, a, xs, y, b, m0, n, k);
    if (m0 < m) block8_q4k<1, Out>(wq, meta, xq, a, xs, y, b, m0, n, k);
  }
}

// Blocks of 8 channels [begin, end) of y [M, N] for every row: fp32 y, or bf16 (yb) when y is null.
void blocks8_q4k(const uint8_t* wq, const uint8_t* meta, const int8_t* xq, const float* a, const float* xs, float* y,
                 uint16_t* yb, int64_t begin, int64_t end, int64_t m, int64_t n, int64_t k) {
  if (y == nullptr) {
    blocks8_q4k_out(wq, meta, xq, a, xs, yb, begin, end, m, n, k);
  } else {
    blocks8_q4k_out(wq, meta, xq, a, xs, y, begin, end, m, n, k);
  }
}

template <int GROUP, typename Out>
void blocks8_a8_group(const uint8_t* wq, const uint16_t* sp, const uint16_t* zp, const int8_t* xq, const float* a,
                      const float* xs, Out* y, int64_t begin, int64_t end, int64_t m, int64_t n, int64_t k) {
  for (int64_t b = begin; b < end; ++b) {
    int64_t m0 = 0;
    for (; m0 + 2 <= m; m0 += 2) block8_a8<2, GROUP, Out>(wq, sp, zp, xq, a, xs, y, b, m0, n, k);
    if (m0 < m) block8_a8<1, GROUP, Out>(wq, sp, zp, xq, a, xs, y, b, m0, n, k);
  }
}

// Blocks of 8 channels [begin, end) of y [M, N] for every row: fp32 y, or bf16 (yb) when y is null.
void blocks8_a8(const uint8_t* wq, const uint16_t* sp, const uint16_t* zp, const int8_t* xq, const float* a,
                const float* xs, float* y, uint16_t* yb, int64_t group, int64_t begin, int64_t end, int64_t m,
                int64_t n, int64_t k) {
  if (y == nullptr) {
    switch (group) {
      case 32: blocks8_a8_group<32>(wq, sp, zp, xq, a, xs, yb, begin, end, m, n, k); break;
      case 64: blocks8_a8_group<64>(wq, sp, zp, xq, a, xs, yb, begin, end, m, n, k); break;
      default: blocks8_a8_group<128>(wq, sp, zp, xq, a, xs, yb, begin, end, m, n, k); break;
    }
    return;
  }
  switch (group) {
    case 32: blocks8_a8_group<32>(wq, sp, zp, xq, a, xs, y, begin, end, m, n, k); break;
    case 64: blocks8_a8_group<64>(wq, sp, zp, xq, a, xs, y, begin, end, m, n, k); break;
    default: blocks8_a8_group<128>(wq, sp, zp, xq, a, xs, y, begin, end, m, n, k); break;
  }
}

// ---- int8 weights (kernels/ops/int8.py: qweight int8 [N, K]), int16 activations in order, per group of 32 ----
// Per channel (WG 0: scales bf16 [N]):   y[m, n] = s_n * sum_g a[m, g] * sum_{k in g} w[n, k] xq[m, k]
// Per weight group of WG = 32 or 16 (scales float32 [N, K/WG], a GGUF's own grid): each group's integer sum meets
// a[m, g] * s[n, g'] at once; at 16 the two halves of an activation group meet their own weight scales.
template <int MB, int WG>
void int8_channel(const int8_t* qweight, const void* scales, const int16_t* xq, const float* a, float* y,
                  int64_t col, int64_t m0, int64_t n, int64_t k) {
  const int64_t groups = k / 32;
  const int8_t* row = qweight + col * k;
  const float* gs = WG ? static_cast<const float*>(scales) + col * (k / (WG ? WG : 32)) : nullptr;
  // At WG 16 each group's halves meet their own scales: two FMAs a group, into two accumulators, so that they are
  // not one chain (one accumulator kept a channel at 4x2 cycles a group: 21.8 GB/s at 49152x2048 on the Zen 5,
  // against 32.3 at WG 32).
  __m256 acc[MB], acc_hi[MB];
  for (int r = 0; r < MB; ++r) acc[r] = acc_hi[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 32 * g)));
    const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 32 * g + 16)));
    for (int r = 0; r < MB; ++r) {
      const int16_t* x = xq + (m0 + r) * k + 32 * g;
      const float ag = a[(m0 + r) * groups + g];
      if (WG == 16) {
#if EDGE_AVX2_VNNI
        const __m256i p0 = EDGE_DPWSSD(_mm256_setzero_si256(), w0, loadu(x));
        const __m256i p1 = EDGE_DPWSSD(_mm256_setzero_si256(), w1, loadu(x + 16));
#else
        const __m256i p0 = _mm256_madd_epi16(w0, loadu(x));
        const __m256i p1 = _mm256_madd_epi16(w1, loadu(x + 16));
#endif
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(ag * gs[2 * g]), acc[r]);
        acc_hi[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(ag * gs[2 * g + 1]), acc_hi[r]);
      } else {
#if EDGE_AVX2_VNNI
        const __m256i p = EDGE_DPWSSD(EDGE_DPWSSD(_mm256_setzero_si256(), w0, loadu(x)), w1, loadu(x + 16));
#else
        const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(w0, loadu(x)), _mm256_madd_epi16(w1, loadu(x + 16)));
#endif
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(WG ? ag * gs[g] : ag), acc[r]);
      }
    }
  }
  const float s = WG ? 1.f : bf16_to_float(static_cast<const uint16_t*>(scales)[col]);
  for (int r = 0; r < MB; ++r) y[(m0 + r) * n + col] = hsum_ps(WG == 16 ? _mm256_add_ps(acc[r], acc_hi[r]) : acc[r]) * s;
}

template <int WG>
void channels_int8_wg(const int8_t* wp, const void* sp, const int16_t* xq, const float* a, float* yp,
                      int64_t begin, int64_t end, int64_t m, int64_t n, int64_t k) {
  const int64_t ahead = std::max<int64_t>(1, (8192 + k - 1) / k);  // ~8 KB ahead, as channels()
  for (int64_t c = begin; c < end; ++c) {
    if (c + ahead < end) {
      prefetch_row(reinterpret_cast<const char*>(wp + (c + ahead) * k), k);
    }
    int64_t m0 = 0;
    for (; m0 + 2 <= m; m0 += 2) int8_channel<2, WG>(wp, sp, xq, a, yp, c, m0, n, k);
    if (m0 < m) int8_channel<1, WG>(wp, sp, xq, a, yp, c, m0, n, k);
  }
}

// wgroup: 0 (scales bf16 [N]), 16 or 32 (scales float32 [N, K/wgroup]).
void channels_int8(const int8_t* wp, const void* sp, const int16_t* xq, const float* a, float* yp, int64_t wgroup,
                   int64_t begin, int64_t end, int64_t m, int64_t n, int64_t k) {
  switch (wgroup) {
    case 16: channels_int8_wg<16>(wp, sp, xq, a, yp, begin, end, m, n, k); break;
    case 32: channels_int8_wg<32>(wp, sp, xq, a, yp, begin, end, m, n, k); break;
    default: channels_int8_wg<0>(wp, sp, xq, a, yp, begin, end, m, n, k); break;
  }
}

// Output channels [begin, end) of y [M, N] for every row: the entry points the dispatch calls.
template <template <int, int> class Kind, typename Q>
void channels_any_group(const uint8_t* wp, const uint16_t* sp, const uint16_t* zp, const Acts<Q>& x, float* yp,
                        int64_t group, int64_t begin, int64_t end, int64_t m, int64_t n, int64_t k) {
  const Bf16Grid grid{sp, zp, k / group};
  switch (group) {
    case 32: channels<Kind, 32>(wp, grid, x, yp, begin, end, m, n, k); break;
    case 64: channels<Kind, 64>(wp, grid, x, yp, begin, end, m, n, k); break;
    default: channels<Kind, 128>(wp, grid, x, yp, begin, end, m, n, k); break;
  }
}

void channels_a16(const uint8_t* wp, const uint16_t* sp, const uint16_t* zp, const Acts<int16_t>& x, float* yp,
                  int64_t group, int64_t begin, int64_t end, int64_t m, int64_t n, int64_t k) {
  channels_any_group<A16>(wp, sp, zp, x, yp, group, begin, end, m, n, k);
}

void channels_a8(const uint8_t* wp, const uint16_t* sp, const uint16_t* zp, const Acts<int8_t>& x, float* yp,
                 int64_t group, int64_t begin, int64_t end, int64_t m, int64_t n, int64_t k) {
  channels_any_group<A8>(wp, sp, zp, x, yp, group, begin, end, m, n, k);
}

// Q4_K: cpu_int4's codes, the block's own scales (meta: uint8 [N, K/256 * 16]); int8 activations per 32.
void channels_q4k(const uint8_t* wp, const uint8_t* meta, const Acts<int8_t>& x, float* yp, int64_t begin,
                  int64_t end, int64_t m, int64_t n, int64_t k) {
  channels<A8, 32>(wp, Q4kGrid{meta, k / 256}, x, yp, begin, end, m, n, k);
}

#endif  // EDGE_AVX2_INT4_BODY
