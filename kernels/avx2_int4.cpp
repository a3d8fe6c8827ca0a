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
// then two FMAs per activation row. Parallel over output channels (at::parallel_for), rows in blocks of 2.

#include <immintrin.h>
#include <torch/library.h>
#include <ATen/ATen.h>
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

// NB output channels from `col` for MB activation rows from `m0`, over groups [g0, g1); adds into y [M, N].
// Even and odd k accumulate apart: NB x MB x 2 independent FMA chains hide the FMA latency (one shared chain per
// channel ran 2x slower, latency-bound); with the NB x MB totals they fit the 16 ymm registers for NB*MB <= 2.
template <int MB, int NB>
void tile(const uint8_t* qweight, const uint16_t* scales, const uint16_t* zeros, const float* xe, const float* xo,
          const float* xsum, float* y, int64_t col, int64_t m0, int64_t g0, int64_t g1, int64_t n, int64_t k,
          int64_t group) {
  const int64_t half_k = k / 2;
  const int64_t groups = k / group;
  const int64_t group_bytes = group / 2;  // 16, 32 or 64: whole 8-byte steps
  const __m256i low_mask = _mm256_set1_epi32(0x0F);
  __m256 total[NB][MB];
  float zero_part[NB][MB];
  for (int c = 0; c < NB; ++c)
    for (int r = 0; r < MB; ++r) {
      total[c][r] = _mm256_setzero_ps();
      zero_part[c][r] = 0.f;
    }
  for (int64_t g = g0; g < g1; ++g) {
    __m256 acc[NB][MB][2];
    for (int c = 0; c < NB; ++c)
      for (int r = 0; r < MB; ++r) acc[c][r][0] = acc[c][r][1] = _mm256_setzero_ps();
    const int64_t base = g * group_bytes;
    for (int64_t j = 0; j < group_bytes; j += 8) {
      __m256 q_low[NB], q_high[NB];
      for (int c = 0; c < NB; ++c) {
        __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qweight + (col + c) * half_k + base + j));
        __m256i wide = _mm256_cvtepu8_epi32(bytes);                     // 8 x i32, 0..255
        q_low[c] = _mm256_cvtepi32_ps(_mm256_and_si256(wide, low_mask));  // k = 2(base+j+i)
        q_high[c] = _mm256_cvtepi32_ps(_mm256_srli_epi32(wide, 4));       // k = 2(base+j+i)+1
      }
      for (int r = 0; r < MB; ++r) {
        const int64_t off = (m0 + r) * half_k + base + j;
        const __m256 even = _mm256_loadu_ps(xe + off);
        const __m256 odd = _mm256_loadu_ps(xo + off);
        for (int c = 0; c < NB; ++c) {
          acc[c][r][0] = _mm256_fmadd_ps(q_low[c], even, acc[c][r][0]);
          acc[c][r][1] = _mm256_fmadd_ps(q_high[c], odd, acc[c][r][1]);
        }
      }
    }
    for (int c = 0; c < NB; ++c) {
      const float s = bf16_to_float(scales[(col + c) * groups + g]);
      const float z = bf16_to_float(zeros[(col + c) * groups + g]) - 8.f * s;
      const __m256 sv = _mm256_set1_ps(s);
      for (int r = 0; r < MB; ++r) {
        total[c][r] = _mm256_fmadd_ps(sv, _mm256_add_ps(acc[c][r][0], acc[c][r][1]), total[c][r]);
        zero_part[c][r] += z * xsum[(m0 + r) * groups + g];
      }
    }
  }
  for (int c = 0; c < NB; ++c)
    for (int r = 0; r < MB; ++r) y[(m0 + r) * n + col + c] += hsum(total[c][r]) + zero_part[c][r];
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
  auto out_shape = x.sizes().vec();
  out_shape.back() = n;
  at::Tensor x2 = x.reshape({-1, k}).to(at::kFloat).contiguous();  // [M, K] fp32
  const int64_t m = x2.size(0);
  at::Tensor y = at::zeros({m, n}, x2.options());  // [M, N] fp32
  if (m == 0 || n == 0) {
    return y.to(x.scalar_type()).reshape(out_shape);
  }
  at::Tensor planes = x2.view({m, k / 2, 2}).permute({2, 0, 1}).contiguous();  // [2, M, K/2]: even k, odd k
  at::Tensor xsum = x2.view({m, groups, group}).sum(-1).contiguous();          // [M, K/g]
  at::Tensor qw = qweight.contiguous();
  at::Tensor sc = scales.contiguous();
  at::Tensor ze = zeros.contiguous();
  const uint8_t* wp = qw.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(sc.data_ptr<at::BFloat16>());
  const uint16_t* zp = reinterpret_cast<const uint16_t*>(ze.data_ptr<at::BFloat16>());
  const float* xe = planes.data_ptr<float>();
  const float* xo = xe + m * (k / 2);
  const float* xs = xsum.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Grain: enough channels that a task streams tens of KB of weights.
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, k / 2));  // ~16 KB of weights a task
  // One channel at a time, rows in pairs. Two channels per tile (x loaded once for both) measured 2x slower at
  // M=1 (1.53 vs 0.81 ms, 4096x4096 g64, 1 thread, Zen 5, 2026-11-30), so NB stays 1.
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      int64_t m0 = 0;
      for (; m0 + 2 <= m; m0 += 2) tile<2, 1>(wp, sp, zp, xe, xo, xs, yp, c, m0, 0, groups, n, k, group);
      if (m0 < m) tile<1, 1>(wp, sp, zp, xe, xo, xs, yp, c, m0, 0, groups, n, k, group);
    }
  });
  return y.to(x.scalar_type()).reshape(out_shape);
}

}  // namespace

TORCH_LIBRARY(edge_avx2, m) {
  m.def("w4a16_linear(Tensor x, Tensor qweight, Tensor scales, Tensor zeros, int group) -> Tensor");
}

TORCH_LIBRARY_IMPL(edge_avx2, CPU, m) {
  m.impl("w4a16_linear", &w4a16_linear);
}
