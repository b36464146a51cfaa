// The Python module of llmlab's C++ CPU kernels (llmlab.kernels.cpu_extension builds every .cpp
// in this folder into one extension): one declaration and one binding per kernel.
#include <torch/extension.h>

#include <tuple>

torch::Tensor fp32_matmul(torch::Tensor x, torch::Tensor w);
torch::Tensor bf16_matmul(torch::Tensor x, torch::Tensor w);
torch::Tensor int8_matmul(torch::Tensor x, torch::Tensor w, torch::Tensor scales);
torch::Tensor int4_matmul(torch::Tensor x, torch::Tensor w, torch::Tensor scales, int64_t group);
torch::Tensor swiglu_forward(torch::Tensor a, torch::Tensor b);
std::tuple<torch::Tensor, torch::Tensor> swiglu_backward(torch::Tensor g, torch::Tensor a,
                                                         torch::Tensor b);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fp32_matmul", &fp32_matmul, "x @ w.T, fp32, rows of x in tiles of 8");
  m.def("bf16_matmul", &bf16_matmul, "x @ W.T, W bfloat16 (O, I) in pack's tiles of 8 rows");
  m.def("int8_matmul", &int8_matmul, "x @ (scales[:, None] * w).T, w int8 (O, I)");
  m.def("int4_matmul", &int4_matmul, "x @ dequantize(w).T, w packed int4 (O, I/2), group-wise scales");
  m.def("swiglu_forward", &swiglu_forward, "silu(a) * b, fp32, one pass");
  m.def("swiglu_backward", &swiglu_backward, "(grad_a, grad_b) of silu(a) * b, one pass");
}
