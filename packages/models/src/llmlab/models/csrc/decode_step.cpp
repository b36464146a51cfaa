// One decode token of llmlab.models.GPT or Llama in one native call (llmlab/models/native.py).
//
// Each model's forward in its order, with paged attention for the one new token: its key and
// value are written into the KV pool at its slot, and it attends over its sequence's keys
// through the block table. What it saves is the interpreter and ATen's fixed cost on tiny
// tensors: a step of a small model is ~70 ops around its matrix products (native.py's docstring
// has the serving benchmark's figures). The products, GELU, SiLU-gating and adds are ATen's; on
// fp32 CPU tensors the norms, RoPE and the attention are plain loops here, whose work is far
// below ATen's fixed cost per call at this size; they agree with ATen's to fp32 rounding. GPT's step uses ATen's for those too on other dtypes and devices (the keys gathered
// through the table, one SDPA call); Llama's is fp32 CPU only.
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
  Tensor keys, values;  // this layer's pool, (num_blocks, block_size, H, D)
};

Norm norm(const pybind11::tuple& t) {
  Norm n{t[0].cast<Maybe>(), t[1].cast<Maybe>(), t[2].cast<double>()};
  n.loop = (!n.weight || plain_fp32(*n.weight)) && (!n.bias || plain_fp32(*n.bias));
  return n;
}

Linear linear(const pybind11::tuple& t) {
  return Linear{t[0].cast<Tensor>(), t[1].cast<Maybe>()};
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

// Where a sequence's keys are: pool blocks of `block_size` slots, listed in order by its block
// table; `length` keys, the last one the new token's.
struct Pages {
  const std::vector<int64_t>& table;
  int64_t block_size, length;
  int64_t slot(int64_t position) const {
    return table[position / block_size] * block_size + position % block_size;
  }
};

// fp32 CPU attention of one query over a sequence's keys in the pools (num_blocks, block_size,
// H_kv, D), block by block through the table; query head h (its D floats at q + h * q_stride)
// reads KV head h / (H / H_kv). Softmax in the max-subtracted form; `scores` is the caller's
// scratch (one per call: the GIL is released, so two threads may step at once).
void attend(const float* q, int64_t q_stride, const float* keys, const float* values,
            const Pages& pages, int64_t heads, int64_t kv_heads, int64_t dim, float scale,
            std::vector<float>& scores, float* out) {
  const int64_t row = kv_heads * dim, group = heads / kv_heads;
  scores.resize(pages.length);
  // calls fn(s, offset of key s's row) for every key, one block at a time
  auto each_key = [&](auto&& fn) {
    for (int64_t s = 0, i = 0; s < pages.length; ++i) {
      const int64_t base = pages.table[i] * pages.block_size * row;
      const int64_t n = std::min(pages.block_size, pages.length - s);
      for (int64_t j = 0; j < n; ++j, ++s) fn(s, base + j * row);
    }
  };
  for (int64_t h = 0; h < heads; ++h) {
    const float* qh = q + h * q_stride;
    const int64_t kv = (h / group) * dim;
    float top = -INFINITY;
    each_key([&](int64_t s, int64_t at) {
      scores[s] = dot(qh, keys + at + kv, dim) * scale;
      top = std::max(top, scores[s]);
    });
    float total = 0.f;
    for (int64_t s = 0; s < pages.length; ++s) total += scores[s] = std::exp(scores[s] - top);
    float* o = out + h * dim;
    std::fill(o, o + dim, 0.f);
    each_key([&](int64_t s, int64_t at) {
      const float* v = values + at + kv;
      const float p = scores[s];
      for (int64_t d = 0; d < dim; ++d) o[d] += p * v[d];
    });
    const float inv = 1.f / total;
    for (int64_t d = 0; d < dim; ++d) o[d] *= inv;
  }
}

// GPT's fp32 CPU attention of one token: its q, k and v are rows of `qkv` (H heads of
// [q, k, v], D each, as GPT's fused projection stores them); k and v go to the token's slot,
// then `attend`.
void attend_fp32(const float* qkv, float* keys, float* values, const Pages& pages, int64_t heads,
                 int64_t dim, float scale, std::vector<float>& scores, float* out) {
  const int64_t row = heads * dim, last = pages.slot(pages.length - 1);
  for (int64_t h = 0; h < heads; ++h) {
    std::copy_n(qkv + (3 * h + 1) * dim, dim, keys + last * row + h * dim);
    std::copy_n(qkv + (3 * h + 2) * dim, dim, values + last * row + h * dim);
  }
  attend(qkv, 3 * dim, keys, values, pages, heads, heads, dim, scale, scores, out);
}

// Any dtype or device: the same through ATen, the keys gathered by slot into (1, H, length, D).
Tensor attend_aten(const std::vector<Tensor>& qkv, const Tensor& keys, const Tensor& values,
                   const Pages& pages, int64_t heads, int64_t dim, double scale) {
  const Tensor flat_k = keys.view({-1, heads, dim}), flat_v = values.view({-1, heads, dim});
  const int64_t last = pages.slot(pages.length - 1);
  flat_k[last].copy_(qkv[1].reshape({heads, dim}));
  flat_v[last].copy_(qkv[2].reshape({heads, dim}));
  std::vector<int64_t> slots(pages.length);
  for (int64_t s = 0; s < pages.length; ++s) slots[s] = pages.slot(s);
  const Tensor index = at::tensor(slots, at::TensorOptions().dtype(at::kLong)).to(keys.device());
  auto gather = [&](const Tensor& flat) {
    return flat.index_select(0, index).view({1, pages.length, heads, dim}).transpose(1, 2);
  };
  return at::scaled_dot_product_attention(qkv[0].transpose(1, 2), gather(flat_k),
                                          gather(flat_v), /*attn_mask=*/std::nullopt,
                                          /*dropout_p=*/0.0, /*is_causal=*/false, scale)
      .transpose(1, 2)
      .reshape({1, 1, heads * dim});
}

// Checks what ATen's indexing would have checked, before anything is written; the pages.
Pages check_step(const Tensor& pool, const Tensor& embedding, int64_t positions, int64_t token,
                 int64_t position, const std::vector<int64_t>& table, const char* who) {
  const int64_t num_blocks = pool.size(0), block_size = pool.size(1);
  const int64_t used = position / block_size + 1;
  TORCH_CHECK(token >= 0 && token < embedding.size(0) && position >= 0 && position < positions,
              who, ": token ", token, " at position ", position, " is outside the ",
              embedding.size(0), "-token vocabulary or the ", positions, " positions");
  TORCH_CHECK(static_cast<int64_t>(table.size()) >= used, who, ": position ", position,
              " needs ", used, " blocks of ", block_size, " slots in the block table, which lists ",
              table.size());
  for (int64_t i = 0; i < used; ++i) {
    TORCH_CHECK(table[i] >= 0 && table[i] < num_blocks, who, ": block ", table[i],
                " (table entry ", i, ") is not in the pool's ", num_blocks, " blocks");
  }
  return Pages{table, block_size, position + 1};
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

  // The logits (1, 1, V) of `token` at `position` of a sequence whose keys are in the pool
  // blocks `table` lists in order (the new token's slot included).
  Tensor step(int64_t token, int64_t position, const std::vector<int64_t>& table) {
    c10::InferenceMode inference;
    const Pages pages = check_step(blocks_.front().keys, wte_, wpe_.size(0), token, position,
                                   table, "GPTDecodeStep");
    std::vector<float> scores;  // attention scores, one buffer for every layer of this call
    Tensor x = (wte_[token] + wpe_[position]).view({1, 1, width_});
    for (const Block& b : blocks_) {
      Tensor qkv = b.qkv(b.ln_1(x));  // (1, 1, 3 C): H heads of [q, k, v]
      Tensor y;
      if (plain_fp32(qkv) && plain_fp32(b.keys) && plain_fp32(b.values)) {
        y = at::empty({1, 1, width_}, qkv.options());
        attend_fp32(qkv.data_ptr<float>(), b.keys.data_ptr<float>(), b.values.data_ptr<float>(),
                    pages, heads_, dim_, static_cast<float>(scale_), scores, y.data_ptr<float>());
      } else {
        y = attend_aten(qkv.view({1, 1, heads_, 3, dim_}).unbind(3), b.keys, b.values, pages,
                        heads_, dim_, scale_);
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
};

// RMSNorm of one fp32 row as HF's LlamaRMSNorm computes it: w * (x * rsqrt(mean(x^2) + eps)).
// `row` may be a strided view (a tied embedding stored column-major): read contiguously.
Tensor rms_norm(const Tensor& row, const Tensor& weight, double eps) {
  const Tensor x = row.contiguous();
  const int64_t n = x.size(-1);
  const float* in = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  double squares = 0.0;
  for (int64_t i = 0; i < n; ++i) squares += static_cast<double>(in[i]) * in[i];
  const float r = static_cast<float>(1.0 / std::sqrt(squares / n + eps));
  Tensor y = at::empty_like(x);
  float* out = y.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (in[i] * r);
  return y;
}

// RoPE of `heads` rows of D floats at one position, HF's rotate-half form product for product:
// (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) over the two halves; cos/sin hold D/2 angles.
void rope(const float* x, int64_t heads, int64_t dim, const float* cos, const float* sin,
          float* out) {
  const int64_t half = dim / 2;
  for (int64_t h = 0; h < heads; ++h, x += dim, out += dim) {
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = x[i], x2 = x[i + half];
      out[i] = x1 * cos[i] + x2 * -sin[i];
      out[i + half] = x2 * cos[i] + x1 * sin[i];
    }
  }
}

struct LlamaBlock {
  Tensor attn_norm;
  Linear q, k, v, o;
  Tensor mlp_norm;
  Linear gate, up, down;
  Tensor keys, values;  // this layer's pool, (num_blocks, block_size, H_kv, D)
};

// llmlab.models.Llama's decode step, fp32 on a CPU only (the Python side checks): grouped-query
// attention with RoPE from the model's own (positions, D/2) cos/sin tables, the gated MLP.
class LlamaDecodeStep {
 public:
  // blocks: per layer (attn_norm, q, k, v, o, mlp_norm, gate, up, down, keys, values), a norm
  // as its weight and a linear as (weight, bias).
  LlamaDecodeStep(Tensor embed, const std::vector<pybind11::tuple>& blocks, Tensor norm,
                  const pybind11::tuple& lm_head, Tensor cos, Tensor sin, double eps,
                  int64_t heads, int64_t kv_heads)
      : embed_(std::move(embed)), norm_(std::move(norm)), lm_head_(linear(lm_head)),
        cos_(std::move(cos)), sin_(std::move(sin)), eps_(eps), heads_(heads),
        kv_heads_(kv_heads) {
    for (const auto& b : blocks) {
      blocks_.push_back(LlamaBlock{b[0].cast<Tensor>(), linear(b[1]), linear(b[2]),
                                   linear(b[3]), linear(b[4]), b[5].cast<Tensor>(),
                                   linear(b[6]), linear(b[7]), linear(b[8]), b[9].cast<Tensor>(),
                                   b[10].cast<Tensor>()});
    }
    TORCH_CHECK(!blocks_.empty() && heads_ > 0 && kv_heads_ > 0 && heads_ % kv_heads_ == 0,
                "LlamaDecodeStep: ", heads_, " query heads over ", kv_heads_, " KV heads");
    dim_ = blocks_.front().keys.size(-1);
    const int64_t width = embed_.size(1);
    TORCH_CHECK(plain_fp32(cos_) && plain_fp32(sin_) && cos_.dim() == 2 &&
                    cos_.size(1) == dim_ / 2 && sin_.sizes() == cos_.sizes(),
                "LlamaDecodeStep: cos/sin tables must be fp32 (positions, ", dim_ / 2, ")");
    // the loops below trust these widths: q/k/v rows, the pools, the norms
    for (const LlamaBlock& b : blocks_) {
      TORCH_CHECK(b.q.weight.size(0) == heads_ * dim_ && b.k.weight.size(0) == kv_heads_ * dim_ &&
                      b.v.weight.size(0) == kv_heads_ * dim_ && plain_fp32(b.keys) &&
                      plain_fp32(b.values) && b.keys.size(-2) == kv_heads_ &&
                      b.values.sizes() == b.keys.sizes() && b.attn_norm.numel() == width &&
                      b.mlp_norm.numel() == width && plain_fp32(b.attn_norm) &&
                      plain_fp32(b.mlp_norm),
                  "LlamaDecodeStep: a layer's projections, pools or norms disagree with ",
                  heads_, " heads over ", kv_heads_, " of ", dim_, " and width ", width);
    }
    TORCH_CHECK(norm_.numel() == width && plain_fp32(norm_), "LlamaDecodeStep: final norm");
    scale_ = static_cast<float>(1.0 / std::sqrt(static_cast<double>(dim_)));
  }

  Tensor step(int64_t token, int64_t position, const std::vector<int64_t>& table) const {
    c10::InferenceMode inference;
    const Pages pages = check_step(blocks_.front().keys, embed_, cos_.size(0), token, position,
                                   table, "LlamaDecodeStep");
    const int64_t half = dim_ / 2, row = kv_heads_ * dim_, last = pages.slot(position);
    const float* cos = cos_.data_ptr<float>() + position * half;
    const float* sin = sin_.data_ptr<float>() + position * half;
    std::vector<float> scores, rotated(heads_ * dim_);
    Tensor x = embed_[token].view({1, 1, embed_.size(1)});
    for (const LlamaBlock& b : blocks_) {
      const Tensor h = rms_norm(x, b.attn_norm, eps_);
      const Tensor q = b.q(h), k = b.k(h), v = b.v(h);
      float* keys = b.keys.data_ptr<float>();
      float* values = b.values.data_ptr<float>();
      rope(q.data_ptr<float>(), heads_, dim_, cos, sin, rotated.data());
      rope(k.data_ptr<float>(), kv_heads_, dim_, cos, sin, keys + last * row);
      std::copy_n(v.data_ptr<float>(), row, values + last * row);
      Tensor y = at::empty({1, 1, heads_ * dim_}, x.options());
      attend(rotated.data(), dim_, keys, values, pages, heads_, kv_heads_, dim_, scale_, scores,
             y.data_ptr<float>());
      x = x + b.o(y);
      const Tensor g = rms_norm(x, b.mlp_norm, eps_);
      x = x + b.down(at::silu(b.gate(g)) * b.up(g));
    }
    return lm_head_(rms_norm(x, norm_, eps_));
  }

 private:
  Tensor embed_;
  std::vector<LlamaBlock> blocks_;
  Tensor norm_;
  Linear lm_head_;
  Tensor cos_, sin_;  // (positions, D/2), fp32
  double eps_;
  int64_t heads_, kv_heads_, dim_ = 0;
  float scale_ = 1.f;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<LlamaDecodeStep>(m, "LlamaDecodeStep")
      .def(pybind11::init<Tensor, const std::vector<pybind11::tuple>&, Tensor,
                          const pybind11::tuple&, Tensor, Tensor, double, int64_t, int64_t>())
      .def("__call__", &LlamaDecodeStep::step,
           pybind11::call_guard<pybind11::gil_scoped_release>());
  pybind11::class_<GPTDecodeStep>(m, "GPTDecodeStep")
      .def(pybind11::init<Tensor, Tensor, const std::vector<pybind11::tuple>&,
                          const pybind11::tuple&, const pybind11::tuple&, int64_t>())
      // the GIL is released: a server's event loop runs while a step computes
      .def("__call__", &GPTDecodeStep::step, pybind11::call_guard<pybind11::gil_scoped_release>());
}
