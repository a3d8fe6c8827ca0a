// w4a16 GEMV/GEMM for a few rows on AVX2 + FMA (x86-64-v3): edge_avx2::w4a16_linear.
//
// Weights are the checkpoint's own row-major format (kernels/int4.py), read as they are, no repack:
//   qweight uint8 [N, K/2]   byte j of row n: k=2j in the low nibble, k=2j+1 in the high nibble
//   scales, zeros bf16 [N, K/g]   w = (q - 8) * scale + zero
// Per output channel n and group g:  y[m, n] += s * sum_k q_k x[m, k]  +  (z - 8 s) * sum_k x[m, k]
// so the inner loop is one multiply-add per weight on the raw code (no dequantize): the scale and the zero apply
// once per group. Activations are de-interleaved once per call into even-k and odd-k fp32 planes, so the low
// nibbles of 8 bytes meet x[2j..] and the high ones x[2j+1..] with plain vector loads; the per-group sums of x
// are computed once per call too.
//
// Inner step, 8 bytes = 16 weights: vpmovzxbd (8 bytes -> 8 x i32), and 0xF / shift 4, two int->float converts,
// then two FMAs per activation row. Parallel over output channels (at::parallel_for), rows in blocks of 4.

#include <immintrin.h>
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <algorithm>
#include <vector>

namespace {

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v);
  __m128 hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  __m128 shuf = _mm_movehdup_ps(lo);
  __m128 sums = _mm_add_ps(lo, shuf);
  shuf = _mm_movehl_ps(shuf, sums);
  sums = _mm_add_ss(sums, shuf);
  return _mm_cvtss_f32(sums);
}

// Sums of 8 vectors, one per lane: [sum(v0), ..., sum(v7)].
inline __m256 hsum8(const __m256* v) {
  const __m256 h01 = _mm256_hadd_ps(v[0], v[1]), h23 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 h45 = _mm256_hadd_ps(v[4], v[5]), h67 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
  return _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20), _mm256_permute2f128_ps(h0123, h4567, 0x31));
}

// 8 bf16 -> 8 fp32.
inline __m256 load_bf16x8(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// sum_k q_k x[r, k] over one group of channel `wrow`, for MB rows: acc[r] (8 lanes still to be summed).
template <int MB, int GROUP>
inline void group_dot(const uint8_t* wrow, const float* xe, const float* xo, int64_t half_k, int64_t base,
                      __m256* acc) {
  const __m256i low_mask = _mm256_set1_epi32(0x0F);
  // Chains per row: even and odd k, and for up to 2 rows, alternate 8-byte steps too (4 chains per row).
  constexpr int CH = MB <= 2 ? 2 : 1;
  __m256 even_acc[CH][MB], odd_acc[CH][MB];
  for (int c = 0; c < CH; ++c)
    for (int r = 0; r < MB; ++r) even_acc[c][r] = odd_acc[c][r] = _mm256_setzero_ps();
  for (int j = 0; j < GROUP / 2; j += 8 * CH) {
    for (int c = 0; c < CH; ++c) {
      const int jj = j + 8 * c;
      const __m256i wide =
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(wrow + base + jj)));
      const __m256 q_low = _mm256_cvtepi32_ps(_mm256_and_si256(wide, low_mask));  // k = 2(base+jj+i)
      const __m256 q_high = _mm256_cvtepi32_ps(_mm256_srli_epi32(wide, 4));       // k = 2(base+jj+i)+1
      for (int r = 0; r < MB; ++r) {
        even_acc[c][r] = _mm256_fmadd_ps(q_low, _mm256_loadu_ps(xe + r * half_k + base + jj), even_acc[c][r]);
        odd_acc[c][r] = _mm256_fmadd_ps(q_high, _mm256_loadu_ps(xo + r * half_k + base + jj), odd_acc[c][r]);
      }
    }
  }
  for (int c = 1; c < CH; ++c)
    for (int r = 0; r < MB; ++r) {
      even_acc[0][r] = _mm256_add_ps(even_acc[0][r], even_acc[c][r]);
      odd_acc[0][r] = _mm256_add_ps(odd_acc[0][r], odd_acc[c][r]);
    }
  for (int r = 0; r < MB; ++r) acc[r] = _mm256_add_ps(even_acc[0][r], odd_acc[0][r]);
}

// Output channel `col` for MB activation rows from `m0`; writes y[m0 .. m0+MB, col].
// Scales and zeros apply once per group, 8 groups at a time as vectors: the 8 groups' sums are transposed into
// one vector (hsum8) and meet 8 scales and 8 zeros in two FMAs. Per group one at a time (broadcast, scalar
// zero term) cost 0.79 ms at 4096x4096 g64 M=1, 1 thread.
template <int MB, int GROUP>
void channel(const uint8_t* qweight, const uint16_t* scales, const uint16_t* zeros, const float* xe, const float* xo,
             const float* xsum, float* y, int64_t col, int64_t m0, int64_t n, int64_t k) {
  const int64_t half_k = k / 2;
  const int64_t groups = k / GROUP;
  const uint8_t* wrow = qweight + col * half_k;
  const uint16_t* srow = scales + col * groups;
  const uint16_t* zrow = zeros + col * groups;
  const float* xe_r = xe + m0 * half_k;
  const float* xo_r = xo + m0 * half_k;
  const float* xs_r = xsum + m0 * groups;
  __m256 total[MB];
  for (int r = 0; r < MB; ++r) total[r] = _mm256_setzero_ps();
  const __m256 eight = _mm256_set1_ps(8.f);
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8) {
    __m256 sums[MB][8];
    for (int i = 0; i < 8; ++i) {
      __m256 acc[MB];
      group_dot<MB, GROUP>(wrow, xe_r, xo_r, half_k, (g + i) * (GROUP / 2), acc);
      for (int r = 0; r < MB; ++r) sums[r][i] = acc[r];
    }
    const __m256 s = load_bf16x8(srow + g);
    const __m256 z = _mm256_fnmadd_ps(eight, s, load_bf16x8(zrow + g));  // zero - 8 * scale
    for (int r = 0; r < MB; ++r) {
      total[r] = _mm256_fmadd_ps(s, hsum8(sums[r]), total[r]);
      total[r] = _mm256_fmadd_ps(z, _mm256_loadu_ps(xs_r + r * groups + g), total[r]);
    }
  }
  float tail[MB];
  for (int r = 0; r < MB; ++r) tail[r] = 0.f;
  for (; g < groups; ++g) {  // the last groups % 8
    const float s = bf16_to_float(srow[g]);
    const float z = bf16_to_float(zrow[g]) - 8.f * s;
    __m256 acc[MB];
    group_dot<MB, GROUP>(wrow, xe_r, xo_r, half_k, g * (GROUP / 2), acc);
    for (int r = 0; r < MB; ++r) tail[r] += s * hsum(acc[r]) + z * xs_r[r * groups + g];
  }
  for (int r = 0; r < MB; ++r) y[(m0 + r) * n + col] = hsum(total[r]) + tail[r];
}

template <int GROUP>
void channels(const uint8_t* wp, const uint16_t* sp, const uint16_t* zp, const float* xe, const float* xo,
              const float* xs, float* yp, int64_t begin, int64_t end, int64_t m, int64_t n, int64_t k) {
  // Channel outermost: its weights come from memory once and stay in L1 for every block of rows.
  for (int64_t c = begin; c < end; ++c) {
    int64_t m0 = 0;
    for (; m0 + 4 <= m; m0 += 4) channel<4, GROUP>(wp, sp, zp, xe, xo, xs, yp, c, m0, n, k);
    switch (m - m0) {
      case 3: channel<3, GROUP>(wp, sp, zp, xe, xo, xs, yp, c, m0, n, k); break;
      case 2: channel<2, GROUP>(wp, sp, zp, xe, xo, xs, yp, c, m0, n, k); break;
      case 1: channel<1, GROUP>(wp, sp, zp, xe, xo, xs, yp, c, m0, n, k); break;
      default: break;
    }
  }
}

at::Tensor w4a16_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                        const at::Tensor& zeros, int64_t group) {
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
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat || x.scalar_type() == at::kHalf,
              "x: expected bf16, fp16 or fp32, got ", x.scalar_type());
  auto out_shape = x.sizes().vec();
  out_shape.back() = n;
  const at::Tensor x2 = x.reshape({-1, k}).contiguous();  // [M, K]
  const int64_t m = x2.size(0);
  at::Tensor out = at::empty({m, n}, x.options());  // [M, N] in x's dtype
  if (m == 0 || n == 0) {
    return out.reshape(out_shape);
  }
  // Activations in one scratch buffer, filled here rather than by ATen ops (each op costs microseconds, as much as
  // a 576x576 GEMV): even-k plane [M, K/2], odd-k plane [M, K/2], per-group sums [M, K/g], then y [M, N] fp32.
  std::vector<float> scratch(static_cast<size_t>(m * k + m * groups + m * n));
  float* xe_w = scratch.data();
  float* xo_w = xe_w + m * (k / 2);
  float* xs_w = xo_w + m * (k / 2);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x2.scalar_type(), "w4a16_linear_planes", [&] {
    const scalar_t* xp = x2.data_ptr<scalar_t>();
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t g = 0; g < groups; ++g) {
        float sum = 0.f;
        for (int64_t j = g * group / 2; j < (g + 1) * group / 2; ++j) {
          const float even = static_cast<float>(xp[r * k + 2 * j]);
          const float odd = static_cast<float>(xp[r * k + 2 * j + 1]);
          xe_w[r * (k / 2) + j] = even;
          xo_w[r * (k / 2) + j] = odd;
          sum += even + odd;
        }
        xs_w[r * groups + g] = sum;
      }
    }
  });
  at::Tensor qw = qweight.contiguous();
  at::Tensor sc = scales.contiguous();
  at::Tensor ze = zeros.contiguous();
  const uint8_t* wp = qw.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(sc.data_ptr<at::BFloat16>());
  const uint16_t* zp = reinterpret_cast<const uint16_t*>(ze.data_ptr<at::BFloat16>());
  const float* xe = xe_w;
  const float* xo = xo_w;
  const float* xs = xs_w;
  float* yp = xs_w + m * groups;
  // Grain: enough channels that a task streams tens of KB of weights.
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, k / 2));  // ~16 KB of weights a task
  // Two channels per tile (x loaded once for both) measured 2x slower at M=1 (1.53 vs 0.81 ms, 4096x4096 g64,
  // 1 thread, Zen 5, 2026-11-30); K in chunks that keep x in L1 measured slower at M=4 (3.5 vs 2.2 ms).
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    switch (group) {
      case 32: channels<32>(wp, sp, zp, xe, xo, xs, yp, begin, end, m, n, k); break;
      case 64: channels<64>(wp, sp, zp, xe, xo, xs, yp, begin, end, m, n, k); break;
      default: channels<128>(wp, sp, zp, xe, xo, xs, yp, begin, end, m, n, k); break;
    }
  });
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "w4a16_linear_out", [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    for (int64_t i = 0; i < m * n; ++i) op[i] = static_cast<scalar_t>(yp[i]);
  });
  return out.reshape(out_shape);
}

}  // namespace

TORCH_LIBRARY(edge_avx2, m) {
  m.def("w4a16_linear(Tensor x, Tensor qweight, Tensor scales, Tensor zeros, int group) -> Tensor");
}

TORCH_LIBRARY_IMPL(edge_avx2, CPU, m) {
  m.impl("w4a16_linear", &w4a16_linear);
}
