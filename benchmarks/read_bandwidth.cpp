// The read bound of a decode step: sum a float32 buffer far larger than the last-level cache, with 256-bit (AVX2)
// or 512-bit (AVX-512) loads, on one thread or an OpenMP team. Four accumulators keep the adds off the critical
// path, so the loop waits on memory only. Built by benchmarks/read_bandwidth.py (torch's cpp_extension).
#include <immintrin.h>
#include <omp.h>
#include <torch/extension.h>

namespace {

__attribute__((target("avx2"))) float sum_avx2(const float* p, int64_t n) {
  __m256 a = _mm256_setzero_ps(), b = a, c = a, d = a;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    a = _mm256_add_ps(a, _mm256_loadu_ps(p + i));
    b = _mm256_add_ps(b, _mm256_loadu_ps(p + i + 8));
    c = _mm256_add_ps(c, _mm256_loadu_ps(p + i + 16));
    d = _mm256_add_ps(d, _mm256_loadu_ps(p + i + 24));
  }
  __m256 s = _mm256_add_ps(_mm256_add_ps(a, b), _mm256_add_ps(c, d));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, s);
  float total = 0;
  for (float v : lanes) total += v;
  for (; i < n; ++i) total += p[i];
  return total;
}

__attribute__((target("avx512f"))) float sum_avx512(const float* p, int64_t n) {
  __m512 a = _mm512_setzero_ps(), b = a, c = a, d = a;
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    a = _mm512_add_ps(a, _mm512_loadu_ps(p + i));
    b = _mm512_add_ps(b, _mm512_loadu_ps(p + i + 16));
    c = _mm512_add_ps(c, _mm512_loadu_ps(p + i + 32));
    d = _mm512_add_ps(d, _mm512_loadu_ps(p + i + 48));
  }
  float total = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a, b), _mm512_add_ps(c, d)));
  for (; i < n; ++i) total += p[i];
  return total;
}

// Seconds to read the whole buffer once (wall clock), with `threads` threads each reading its own contiguous part.
double read_seconds(const torch::Tensor& buffer, int64_t width, int64_t threads) {
  TORCH_CHECK(buffer.scalar_type() == torch::kFloat32 && buffer.is_contiguous(), "a contiguous float32 buffer");
  TORCH_CHECK(width == 256 || width == 512, "width is 256 or 512 bits, got ", width);
  const float* p = buffer.data_ptr<float>();
  const int64_t n = buffer.numel();
  volatile float sink = 0;
  double start = omp_get_wtime();
#pragma omp parallel num_threads(threads)
  {
    const int64_t t = omp_get_thread_num(), team = omp_get_num_threads();
    const int64_t begin = n * t / team, end = n * (t + 1) / team;
    float part = width == 512 ? sum_avx512(p + begin, end - begin) : sum_avx2(p + begin, end - begin);
#pragma omp atomic
    sink += part;
  }
  return omp_get_wtime() - start;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("read_seconds", &read_seconds); }
