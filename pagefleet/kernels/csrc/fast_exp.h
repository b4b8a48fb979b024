// exp(x) for the CPU kernels (paged attention's softmax, SiLU), shared so the polynomial
// and its error bound live in one place. Header-only; each kernel is one translation unit.
#pragma once
#include <cstdint>
#include <cstring>
#include <cmath>

namespace pf {

// exp(x) with x clamped to [-87, 88] (so 2^n stays a normal fp32), vectorisable: 2^n * p(r)
// with r in [-ln2/2, ln2/2]; relative error ~2e-7, below fp32 SDPA's own rounding. -inf
// (a softmax's first running max) gives exp(-87), which rescales nothing that matters.
inline float exp_clamped(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723212e-6f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

}  // namespace pf
