// SwiGLU on fp32 CPU tensors, one pass over memory each way:
//   forward:  out = silu(a) * b                     (reads a, b; writes out)
//   backward: grad_a = g * b * s' (a), grad_b = g * silu(a)  (reads g, a, b; writes both)
// with silu(a) = a / (1 + exp(-a)) and s'(a) = sig * (1 + a * (1 - sig)), sig = 1 / (1 + exp(-a)).
//
// Eager PyTorch spends two passes forward (silu, then the product) and three backward (two
// products and silu_backward), each writing a full-size temporary; on the (tokens, width)
// activations of an MLP those passes are memory-bound, so fusing them cuts the bytes moved. The
// arithmetic is PyTorch's own, operation for operation (its vectorized silu and silu_backward,
// Sleef's exp with 1-ulp error, the same association, the compiler's default FMA contraction as
// in PyTorch's build), so the results equal eager PyTorch's bit for bit on this build (tested).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <tuple>

// Sleef's vector exp, exported by libtorch_cpu (what PyTorch's Vectorized<float>::exp calls).
extern "C" {
#if defined(__AVX512F__)
__m512 Sleef_expf16_u10(__m512);
#else
__m256 Sleef_expf8_u10(__m256);
#endif
}

namespace {

#if defined(__AVX512F__)
using vec = __m512;
constexpr int64_t W = 16;
inline vec load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, vec v) { _mm512_storeu_ps(p, v); }
inline vec set1(float f) { return _mm512_set1_ps(f); }
inline vec add(vec a, vec b) { return _mm512_add_ps(a, b); }
inline vec sub(vec a, vec b) { return _mm512_sub_ps(a, b); }
inline vec mul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec div(vec a, vec b) { return _mm512_div_ps(a, b); }
inline vec neg(vec a) {  // flip the sign bit (AVX-512F has no float xor; DQ does)
  return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_set1_epi32(INT32_MIN)));
}
inline vec vexp(vec a) { return Sleef_expf16_u10(a); }
#else
using vec = __m256;
constexpr int64_t W = 8;
inline vec load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, vec v) { _mm256_storeu_ps(p, v); }
inline vec set1(float f) { return _mm256_set1_ps(f); }
inline vec add(vec a, vec b) { return _mm256_add_ps(a, b); }
inline vec sub(vec a, vec b) { return _mm256_sub_ps(a, b); }
inline vec mul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline vec div(vec a, vec b) { return _mm256_div_ps(a, b); }
inline vec neg(vec a) { return _mm256_xor_ps(set1(-0.f), a); }
inline vec vexp(vec a) { return Sleef_expf8_u10(a); }
#endif

constexpr int64_t GRAIN = 32768;  // elements per task: at::parallel_for's usual grain

void check(const char* what, const torch::Tensor& t, const torch::Tensor& like) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.is_contiguous(),
              "swiglu: ", what, " must be a contiguous float32 CPU tensor");
  TORCH_CHECK(t.sizes() == like.sizes(), "swiglu: ", what, " has shape ", t.sizes(),
              ", expected ", like.sizes());
}

}  // namespace

torch::Tensor swiglu_forward(torch::Tensor a, torch::Tensor b) {
  check("a", a, a);
  check("b", b, a);
  auto out = torch::empty_like(a);
  const float *ap = a.data_ptr<float>(), *bp = b.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, a.numel(), GRAIN, [&](int64_t begin, int64_t end) {
    const vec one = set1(1.f);
    int64_t i = begin;
    for (; i + W <= end; i += W) {
      const vec x = load(ap + i);
      const vec silu = div(x, add(one, vexp(neg(x))));
      store(op + i, mul(silu, load(bp + i)));
    }
    for (; i < end; ++i) op[i] = ap[i] / (1.f + std::exp(-ap[i])) * bp[i];
  });
  return out;
}

std::tuple<torch::Tensor, torch::Tensor> swiglu_backward(torch::Tensor g, torch::Tensor a,
                                                         torch::Tensor b) {
  check("a", a, a);
  check("b", b, a);
  check("the output gradient", g, a);
  auto grad_a = torch::empty_like(a), grad_b = torch::empty_like(b);
  const float *gp = g.data_ptr<float>(), *ap = a.data_ptr<float>(), *bp = b.data_ptr<float>();
  float *gap = grad_a.data_ptr<float>(), *gbp = grad_b.data_ptr<float>();
  at::parallel_for(0, a.numel(), GRAIN, [&](int64_t begin, int64_t end) {
    const vec one = set1(1.f);
    int64_t i = begin;
    for (; i + W <= end; i += W) {
      const vec x = load(ap + i), gv = load(gp + i);
      const vec e = add(one, vexp(neg(x)));
      const vec sig = div(one, e);
      store(gbp + i, mul(gv, div(x, e)));                             // g * silu(a)
      const vec dsilu = mul(mul(gv, load(bp + i)), sig);              // (g * b) * sig ...
      store(gap + i, mul(dsilu, add(one, mul(x, sub(one, sig)))));    // ... * (1 + a (1 - sig))
    }
    for (; i < end; ++i) {
      const float x = ap[i], e = 1.f + std::exp(-x), sig = 1.f / e;
      gbp[i] = gp[i] * (x / e);
      gap[i] = gp[i] * bp[i] * sig * (1.f + x * (1.f - sig));
    }
  });
  return {grad_a, grad_b};
}
