// One decode token of llmlab.models.GPT in one native call (see llmlab/models/native.py).
//
// GPT.inference_forward's ops in its order, with the serving engine's one-sequence attention
// (write the new key and value at their slot, attend over a run of consecutive slots). What it
// saves is the interpreter and ATen's fixed cost on tiny tensors: a step of a small model is ~70
// ops around its matrix products, each several microseconds from Python. The products, GELU and
// adds are ATen's; on fp32 CPU tensors the layer norms and the attention (one query) are plain
// loops here, where ATen's kernels spend 5 and 30 microseconds setting up work of well under one;
// they agree with ATen's to fp32 rounding. Other dtypes and devices use ATen's for those too.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

namespace {

using Tensor = at::Tensor;
using Maybe = std::optional<Tensor>;

bool plain_fp32(const Tensor& t) {
  return t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous();
}

struct Norm {
  Maybe weight, bias;
  double eps;
  bool loop = false;  // fp32 CPU weights: the loop below, else at::layer_norm

  // x: (1, 1, C). Statistics in double, as exact as fp32 inputs allow.
  Tensor operator()(const Tensor& x) const {
    if (!loop || !plain_fp32(x)) return at::layer_norm(x, {x.size(-1)}, weight, bias, eps);
    const int64_t n = x.size(-1);
    const float* in = x.data_ptr<float>();
    double sum = 0.0;
    for (int64_t i = 0; i < n; ++i) sum += in[i];
    const double mean = sum / n;
    double squares = 0.0;
    for (int64_t i = 0; i < n; ++i) squares += (in[i] - mean) * (in[i] - mean);
    const float rstd = static_cast<float>(1.0 / std::sqrt(squares / n + eps));
    const float m = static_cast<float>(mean);
    Tensor y = at::empty_like(x);
    float* out = y.data_ptr<float>();
    const float* w = weight ? weight->data_ptr<float>() : nullptr;
    const float* b = bias ? bias->data_ptr<float>() : nullptr;
    for (int64_t i = 0; i < n; ++i) {
      float v = (in[i] - m) * rstd;
      if (w) v *= w[i];
      if (b) v += b[i];
      out[i] = v;
    }
    return y;
  }
};

struct Linear {
  Tensor weight;
  Maybe bias;
  Tensor operator()(const Tensor& x) const { return at::linear(x, weight, bias); }
};

struct Block {
  Norm ln_1;
  Linear qkv, proj;
  Norm ln_2;
  Linear fc, mlp_proj;
  Tensor keys, values;  // this layer's pool, (..., H, D), flat view (slots, H, D)
};

Norm norm(const pybind11::tuple& t) {
  Norm n{t[0].cast<Maybe>(), t[1].cast<Maybe>(), t[2].cast<double>()};
  n.loop = (!n.weight || plain_fp32(*n.weight)) && (!n.bias || plain_fp32(*n.bias));
  return n;
}

Linear linear(const pybind11::tuple& t) {
  return Linear{t[0].cast<Tensor>(), t[1].cast<Maybe>()};
}

// Slots first .. first + length - 1 of a pool as (1, H, length, D): the strides the serving
// engine's view of consecutive blocks has (llmlab.serving.model_runner._pool_span).
Tensor span(const Tensor& pool, int64_t first, int64_t length) {
  const int64_t heads = pool.size(-2), dim = pool.size(-1);
  return pool.as_strided({1, heads, length, dim}, {length * heads * dim, dim, heads * dim, 1},
                         pool.storage_offset() + first * heads * dim);
}

// q . k over `dim` floats in eight independent sums: vectorisable without reordering a sum
// (the compiler may not reassociate one running total), and the same order on every call.
float dot(const float* q, const float* k, int64_t dim) {
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t d = 0;
  for (; d + 8 <= dim; d += 8) {
    for (int j = 0; j < 8; ++j) acc[j] += q[d + j] * k[d + j];
  }
  float tail = 0.f;
  for (; d < dim; ++d) tail += q[d] * k[d];
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) +
         tail;
}

// fp32 CPU attention of one token: its q, k and v are rows of `qkv` (H heads of [q, k, v], D
// each, as GPT's fused projection stores them); k and v are written at `slot` of the pools
// (slots, H, D), then the query attends over slots first .. first + length - 1. Softmax in the
// max-subtracted form; `scores` is reused.
void attend_fp32(const float* qkv, float* keys, float* values, int64_t slot, int64_t first,
                 int64_t length, int64_t heads, int64_t dim, float scale,
                 std::vector<float>& scores, float* out) {
  const int64_t row = heads * dim;
  for (int64_t h = 0; h < heads; ++h) {
    std::copy_n(qkv + (3 * h + 1) * dim, dim, keys + slot * row + h * dim);
    std::copy_n(qkv + (3 * h + 2) * dim, dim, values + slot * row + h * dim);
  }
  scores.resize(length);
  for (int64_t h = 0; h < heads; ++h) {
    const float* q = qkv + 3 * h * dim;
    const int64_t offset = first * row + h * dim;
    float top = -INFINITY;
    for (int64_t s = 0; s < length; ++s) {
      scores[s] = dot(q, keys + offset + s * row, dim) * scale;
      top = std::max(top, scores[s]);
    }
    float total = 0.f;
    for (int64_t s = 0; s < length; ++s) total += scores[s] = std::exp(scores[s] - top);
    float* o = out + h * dim;
    std::fill(o, o + dim, 0.f);
    for (int64_t s = 0; s < length; ++s) {
      const float* v = values + offset + s * row;
      const float p = scores[s];
      for (int64_t d = 0; d < dim; ++d) o[d] += p * v[d];
    }
    const float inv = 1.f / total;
    for (int64_t d = 0; d < dim; ++d) o[d] *= inv;
  }
}

class GPTDecodeStep {
 public:
  // blocks: per layer (ln_1, qkv, proj, ln_2, fc, mlp_proj, keys, values), a norm as
  // (weight, bias, eps) and a linear as (weight, bias), None for a missing bias.
  GPTDecodeStep(Tensor wte, Tensor wpe, const std::vector<pybind11::tuple>& blocks,
                const pybind11::tuple& ln_f, const pybind11::tuple& lm_head, int64_t heads)
      : wte_(std::move(wte)), wpe_(std::move(wpe)), ln_f_(norm(ln_f)), lm_head_(linear(lm_head)),
        heads_(heads) {
    for (const auto& b : blocks) {
      blocks_.push_back(Block{norm(b[0]), linear(b[1]), linear(b[2]), norm(b[3]), linear(b[4]),
                              linear(b[5]), b[6].cast<Tensor>(), b[7].cast<Tensor>()});
    }
    width_ = wte_.size(1);
    dim_ = width_ / heads_;
    scale_ = 1.0 / std::sqrt(static_cast<double>(dim_));
  }

  // The logits (1, 1, V) of `token` at `position`; its key and value go to `slot`, and it
  // attends over slots first .. first + length - 1 (`slot` among them).
  Tensor step(int64_t token, int64_t position, int64_t slot, int64_t first, int64_t length) {
    c10::InferenceMode inference;
    // the loops below index the pools directly: check what ATen's indexing would have checked
    const int64_t slots = blocks_.empty() ? 0 : blocks_[0].keys.numel() / width_;
    TORCH_CHECK(length >= 1 && first >= 0 && first + length <= slots && slot >= first &&
                    slot < first + length,
                "GPTDecodeStep: slot ", slot, " and keys ", first, "..", first + length - 1,
                " must lie in the pool's ", slots, " slots, the slot among the keys");
    Tensor x = (wte_[token] + wpe_[position]).view({1, 1, width_});
    for (const Block& b : blocks_) {
      Tensor qkv = b.qkv(b.ln_1(x));  // (1, 1, 3 C): H heads of [q, k, v]
      Tensor y;
      if (plain_fp32(qkv) && plain_fp32(b.keys) && plain_fp32(b.values)) {
        y = at::empty({1, 1, width_}, qkv.options());
        attend_fp32(qkv.data_ptr<float>(), b.keys.data_ptr<float>(), b.values.data_ptr<float>(),
                    slot, first, length, heads_, dim_, static_cast<float>(scale_),
                    scores_, y.data_ptr<float>());
      } else {  // ATen's: write the slot, one SDPA over a view of the pool
        auto parts = qkv.view({1, 1, heads_, 3, dim_}).unbind(3);
        b.keys.view({-1, heads_, dim_})[slot].copy_(parts[1].reshape({heads_, dim_}));
        b.values.view({-1, heads_, dim_})[slot].copy_(parts[2].reshape({heads_, dim_}));
        y = at::scaled_dot_product_attention(
                parts[0].transpose(1, 2), span(b.keys, first, length),
                span(b.values, first, length), /*attn_mask=*/std::nullopt, /*dropout_p=*/0.0,
                /*is_causal=*/false, scale_)
                .transpose(1, 2)
                .reshape({1, 1, width_});
      }
      x = x + b.proj(y);
      x = x + b.mlp_proj(at::gelu(b.fc(b.ln_2(x)), "tanh"));
    }
    return lm_head_(ln_f_(x));
  }

 private:
  Tensor wte_, wpe_;
  std::vector<Block> blocks_;
  Norm ln_f_;
  Linear lm_head_;
  int64_t heads_, width_ = 0, dim_ = 0;
  double scale_ = 1.0;
  std::vector<float> scores_;  // attention scores, reused: a step allocates no scratch
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<GPTDecodeStep>(m, "GPTDecodeStep")
      .def(pybind11::init<Tensor, Tensor, const std::vector<pybind11::tuple>&,
                          const pybind11::tuple&, const pybind11::tuple&, int64_t>())
      // the GIL is released: a server's event loop runs while a step computes
      .def("__call__", &GPTDecodeStep::step, pybind11::call_guard<pybind11::gil_scoped_release>());
}
