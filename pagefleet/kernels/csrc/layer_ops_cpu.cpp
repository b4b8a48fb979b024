// The elementwise ops of a Llama decoder layer, fused: RMSNorm (with the residual add that
// precedes it) and SiLU(gate) * up. fp32 rows, plain C++ with a C ABI (no torch headers),
// called through ctypes (pagefleet/kernels/cpu_attention.py, CpuAttentionBackend).
//
// Why: in torch each of these is 3-7 separate ops, each a dispatch (~5 us) and a pass over
// memory with a fresh allocation; per layer that is ~12% of a bench-model step.
//
// Rounding: RMSNorm follows HF's op order exactly (r = residual + x; mean = sum(r*r) / n;
// inv = 1 / sqrt(mean + eps); out = w * (r * inv)) with every product rounded to fp32 as
// torch rounds it; only the sum's order differs (accumulated in double here, a cascade of
// fp32 partial sums in torch), so outputs agree to about one fp32 ulp. SiLU uses a
// polynomial exp (relative error ~2e-7) instead of torch's SLEEF one.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "fast_exp.h"

namespace {

// Rows x columns below which one thread does the whole call: thread start-up (~5 us) would
// cost more than it saves on a decode step's few rows.
constexpr int64_t kParallelMinElems = 1 << 16;

// No fused multiply-add in the norm: torch rounds r * r, r * inv and w * (...) separately.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
void norm_row(const float* x, float* res, const float* w, float* out, int cols, float eps) {
  double ss = 0.0;
  const float* src = x;
  if (res != nullptr) {
#pragma omp simd reduction(+ : ss)
    for (int j = 0; j < cols; ++j) {
      const float r = res[j] + x[j];
      res[j] = r;
      const float sq = r * r;
      ss += static_cast<double>(sq);
    }
    src = res;
  } else {
#pragma omp simd reduction(+ : ss)
    for (int j = 0; j < cols; ++j) {
      const float sq = x[j] * x[j];
      ss += static_cast<double>(sq);
    }
  }
  const float mean = static_cast<float>(ss) / static_cast<float>(cols);
  const float inv = 1.0f / std::sqrt(mean + eps);
#pragma omp simd
  for (int j = 0; j < cols; ++j) {
    const float scaled = src[j] * inv;
    out[j] = w[j] * scaled;
  }
}
#pragma GCC pop_options

void silu_mul_row(const float* g, const float* u, float* out, int cols) {
#pragma omp simd
  for (int j = 0; j < cols; ++j) {
    const float e = pf::exp_clamped(-g[j]);
    out[j] = (g[j] / (1.0f + e)) * u[j];
  }
}

}  // namespace

extern "C" {

// out[i] = RMSNorm(x[i] (+ residual[i])) * w for rows i < rows, cols elements each, rows
// *_stride elements apart. residual may be null; when given, residual[i] becomes
// residual[i] + x[i] (in place) and is what is normalised. out must not overlap x or
// residual.
void pf_rms_norm(const float* x, int64_t x_stride, float* residual, int64_t res_stride,
                 const float* w, float* out, int64_t out_stride, int64_t rows, int cols,
                 float eps, int threads) {
  const bool par = threads > 1 && rows > 1 && rows * cols >= kParallelMinElems;
#pragma omp parallel for schedule(static) num_threads(threads) if (par)
  for (int64_t i = 0; i < rows; ++i) {
    norm_row(x + i * x_stride, residual == nullptr ? nullptr : residual + i * res_stride, w,
             out + i * out_stride, cols, eps);
  }
}

// out[i] = silu(gate_up[i][:cols]) * gate_up[i][cols:2*cols], silu(g) = g / (1 + exp(-g)).
void pf_silu_mul(const float* gate_up, int64_t gu_stride, float* out, int64_t out_stride,
                 int64_t rows, int cols, int threads) {
  const bool par = threads > 1 && rows > 1 && rows * cols >= kParallelMinElems;
#pragma omp parallel for schedule(static) num_threads(threads) if (par)
  for (int64_t i = 0; i < rows; ++i) {
    const float* g = gate_up + i * gu_stride;
    silu_mul_row(g, g + cols, out + i * out_stride, cols);
  }
}

}  // extern "C"
