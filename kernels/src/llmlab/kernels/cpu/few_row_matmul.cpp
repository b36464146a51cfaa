// x @ W.T for a few rows of x (decoding: one row per sequence, k + 1 when verifying drafts),
// W in fp32 or as weight-only bf16, int8 or int4, on a CPU with AVX2 + FMA (AVX-512 where the
// build targets it).
//
// Decoding reads every weight once per step, so the product is bound by the bytes it reads. Each
// kernel reads a weight vector once and uses it for several rows of x (MKL's sgemm reads fp32
// weights at 0.8x the one-row rate for 3 rows and below 0.5x from 4 rows on: measured); the
// quantized ones read the packed bytes and widen them in registers, 4x (int8) or ~7x (int4)
// fewer bytes than an fp32 product.
// Layouts (llmlab.kernels.quantized for the packed ones):
//   fp32: w (O, I) float32:                           out[r, o] = sum_i x[r, i] * w[o, i]
//   bf16: w (O, I) bfloat16 (widened by a 16-bit shift): out[r, o] = sum_i x[r, i] * w[o, i],
//         stored in tiles of 8 output rows, each tile chunk by chunk (the bf16 section)
//   int8: w (O, I) int8, scales (O,) fp32:            out[r, o] = s_o * sum_i x[r, i] * w[o, i]
//   int4: w (O, I/2) uint8, scales (O, I/G) fp32: per group of G inputs, byte j holds value j in
//         its low nibble and value j + G/2 in its high nibble, both stored as q + 8 (q in -8..7):
//         out[r, o] = sum_g s_{o,g} * sum_{i in g} x[r, i] * q[o, i]
// fp32 takes rows of x eight at a time (each output's sum runs in the same order whatever the
// tile: a row's result does not depend on what it is batched with); the packed kinds take rows
// four at a time, then two, then one. Output rows are tiled two to eight at a time (several
// weight streams in flight); ranges of output rows are the tasks of at::parallel_for. With
// AVX-512 VNNI, rows of x against int8 or int4 weights take integer dot products instead, one
// output row after another, up to four rows of x per weight load (the VNNI section below).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

// One vector type for the build's widest ISA: AVX-512 (16 lanes, 32 registers) where the
// compiler targets it, else AVX2 + FMA (8 lanes, 16 registers). widen(p): W weights at p (fp32,
// int8 or bf16) as fp32; widen_low(v): the low W int8 lanes of v as fp32. ACCUMULATORS: how
// many vector accumulators a tile may keep beside its rows of x and a weight vector.
#if defined(__AVX512F__)
using vec = __m512;
constexpr int W = 16;
constexpr int ACCUMULATORS = 24;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline vec vset1(float f) { return _mm512_set1_ps(f); }
inline float vsum(vec v) { return _mm512_reduce_add_ps(v); }
inline vec widen_low(__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)); }
inline vec widen(const float* p) { return _mm512_loadu_ps(p); }
inline vec widen(const int8_t* p) {
  return widen_low(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline vec widen(const uint16_t* p) {  // bf16: the top half of an fp32
  const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}
// 2W bf16 weights at p as fp32, in lanes: the even ones (each 32-bit lane's low half, shifted
// up) and the odd ones (its high half, masked): no cross-lane widening
inline void widen_pairs(const uint16_t* p, vec& even, vec& odd) {
  const __m512i v = _mm512_loadu_si512(p);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(0xffff0000)));
}
#else
using vec = __m256;
constexpr int W = 8;
constexpr int ACCUMULATORS = 10;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec vset1(float f) { return _mm256_set1_ps(f); }
inline float vsum(vec v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_hadd_ps(lo, lo);
  lo = _mm_hadd_ps(lo, lo);
  return _mm_cvtss_f32(lo);
}
inline vec widen_low(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }
inline vec widen(const float* p) { return _mm256_loadu_ps(p); }
inline vec widen(const int8_t* p) {
  return widen_low(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline vec widen(const uint16_t* p) {  // bf16: the top half of an fp32
  const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}
inline void widen_pairs(const uint16_t* p, vec& even, vec& odd) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xffff0000)));
}
#endif

inline float scalar(float v) { return v; }
inline float scalar(int8_t v) { return static_cast<float>(v); }
inline float scalar(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// OT output rows at once for R rows of x; every widened weight vector serves all R rows. The
// OT rows are adjacent in memory: while reading a cache line of each, the kernel prefetches the
// same line of the next tile (OT rows further), so a tile starts with its lines on the way; a
// prefetch only at a line's distance ahead left each row's first lines uncovered (on a 1.2 GB
// int8 sweep: 17 GB/s, now 21; fp32 F.linear reads 27). One row of x against fp32 or bf16
// weights (rows of 3 KiB and more in the models here) leaves the hardware prefetchers enough
// time, and the extra streams then cost: no prefetch there (Llama-1B's matrices in turn, 2
// threads: fp32 30.0 -> 31.7 GB/s, MKL 30.9; bf16 on an AMD EPYC, same window, ~8 % faster
// without); with more rows of x a line takes longer to use and the prefetch pays again (8 rows
// against 50257 x 768, one thread: 1.9x MKL without it, 2.9x with).
// T: float, int8_t (scaled per output row) or uint16_t (bf16 bits); scales null: unscaled.
template <typename T, int R, int OT>
void dense_tile(const float* x, int64_t in, const T* w, const float* scales, float* out,
                int64_t out_features, int64_t o) {
  constexpr int64_t L = 64 / sizeof(T);  // weights per cache line: a whole number of vectors
  vec acc[OT][R];
  for (int t = 0; t < OT; ++t)
    for (int r = 0; r < R; ++r) acc[t][r] = vzero();
  int64_t i = 0;
  for (; i + L <= in; i += L) {
    if constexpr (R > 1 || std::is_same_v<T, int8_t>)
      for (int t = 0; t < OT; ++t)
        _mm_prefetch(reinterpret_cast<const char*>(w + (o + t + OT) * in + i), _MM_HINT_T0);
    for (int64_t j = i; j < i + L; j += W) {
      vec xs[R];
      for (int r = 0; r < R; ++r) xs[r] = vload(x + r * in + j);
      for (int t = 0; t < OT; ++t) {
        const vec wv = widen(w + (o + t) * in + j);
        for (int r = 0; r < R; ++r) acc[t][r] = vfma(wv, xs[r], acc[t][r]);
      }
    }
  }
  for (; i + W <= in; i += W) {
    vec xs[R];
    for (int r = 0; r < R; ++r) xs[r] = vload(x + r * in + i);
    for (int t = 0; t < OT; ++t) {
      const vec wv = widen(w + (o + t) * in + i);
      for (int r = 0; r < R; ++r) acc[t][r] = vfma(wv, xs[r], acc[t][r]);
    }
  }
  for (int t = 0; t < OT; ++t) {
    const T* row = w + (o + t) * in;
    for (int r = 0; r < R; ++r) {
      float sum = vsum(acc[t][r]);
      for (int64_t j = i; j < in; ++j) sum += x[r * in + j] * scalar(row[j]);
      out[r * out_features + o + t] = scales ? sum * scales[o + t] : sum;
    }
  }
}

// Output rows per tile for R rows of x in the packed kinds' tiles (OT * R accumulators <= 16).
template <int R>
constexpr int packed_tile() { return R == 4 ? 2 : R == 2 ? 4 : 8; }

// Output rows per tile for R rows of fp32 products: as many weight streams as the registers
// allow, at most 8.
template <int R>
constexpr int fp32_tile() { return std::max(1, std::min(8, ACCUMULATORS / R)); }

template <typename T, int R, int OT = packed_tile<R>()>
void dense_rows(const float* x, int64_t in, const T* w, const float* scales, float* out,
                int64_t out_features, int64_t o_begin, int64_t o_end) {
  int64_t o = o_begin;
  for (; o + OT <= o_end; o += OT) dense_tile<T, R, OT>(x, in, w, scales, out, out_features, o);
  for (; o < o_end; ++o) dense_tile<T, R, 1>(x, in, w, scales, out, out_features, o);
}


#if defined(__AVX512VNNI__)
// Rows of x against int8 or int4 weights with AVX-512 VNNI: each row is rounded per block of
// VB inputs to 16 bits (q = round(x / s_b), s_b = max |x| / QMAX over the block) and split into
// two 8-bit limbs, q = 256 hi + lo, so that vpdpbusd multiplies 64 weights by 64 limbs and sums
// them four by four into int32 lanes in one instruction; per block the two lane sums combine
// exactly into sum w q, are converted and scaled once. The only rounding beyond fp32 sums is x's
// to 16 bits per block: at most max|x_b| / (2 QMAX) per input.
//   int8: hi signed, lo unsigned (0..255); sum lo w directly, sum hi w as
//         sum (w + 128) hi - 128 sum hi (vpdpbusd wants one unsigned side; w ^ 0x80 is w + 128):
//         the 128 sum hi terms of all blocks are one number, subtracted at the end.
//   int4: the stored nibbles u = q + 8 are the unsigned side; both limbs signed
//         (lo in -128..127, hence QMAX 32639: hi stays within -128..127); sum (u - 8) x is
//         sum u x - 8 sum x, the second a fixed vector per block of x.
// Each thread walks its output rows one after another, a single sequential stream: on an AMD
// EPYC (Zen 4) that read the 1B-shaped model's int8 matrices at 28-35 GB/s, interleaving 8 rows
// (8 streams 2 KiB apart, next tile prefetched) at 16-21 (2 threads, measured in one window).
constexpr int64_t VB = 128;

struct Blocks {  // one row of x rounded to 16 bits per block of VB inputs
  std::vector<int32_t> q;
  std::vector<float> scale;  // (in / VB): s_b
  bool representable = true;  // false: x holds what limbs cannot carry (round_blocks)
};

Blocks round_blocks(const float* x, int64_t in, float qmax) {
  Blocks B{std::vector<int32_t>(in), std::vector<float>(in / VB)};
  const __m512 zero = _mm512_setzero_ps();
  for (int64_t b = 0; b < in / VB; ++b) {
    const float* xb = x + b * VB;
    __m512 m = zero;
    __mmask16 finite = 0xFFFF;
    for (int64_t i = 0; i < VB; i += 16) {
      const __m512 v = _mm512_loadu_ps(xb + i);
      finite &= _mm512_cmp_ps_mask(_mm512_mul_ps(v, zero), zero, _CMP_EQ_OQ);  // inf*0 is NaN
      m = _mm512_max_ps(m, _mm512_abs_ps(v));
    }
    const float top = _mm512_reduce_max_ps(m);
    const float step_inverse = top > 0 ? qmax / top : 0.f;
    // an inf or NaN: the caller widens instead, which propagates it; so does a block of
    // subnormal values, whose step's inverse overflows
    if (finite != 0xFFFF || !std::isfinite(step_inverse)) {
      B.representable = false;
      return B;
    }
    const __m512 inv = _mm512_set1_ps(step_inverse);
    for (int64_t i = 0; i < VB; i += 16)  // rounds to nearest even, as lrint
      _mm512_storeu_si512(B.q.data() + b * VB + i,
                          _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + i), inv)));
    B.scale[b] = top / qmax;
  }
  return B;
}

struct Int8Limbs {
  std::vector<int8_t> hi;   // q >> 8 (floor)
  std::vector<uint8_t> lo;  // q - 256 hi, 0..255
  std::vector<float> scale;
  double bias = 0;  // sum_b s_b * 128 * 256 * sum_{i in b} hi_i
};

Int8Limbs int8_limbs(const Blocks& B, int64_t in) {
  Int8Limbs L{std::vector<int8_t>(in), std::vector<uint8_t>(in), B.scale};
  for (int64_t b = 0; b < in / VB; ++b) {
    __m512i sum_hi = _mm512_setzero_si512();
    for (int64_t i = b * VB; i < (b + 1) * VB; i += 16) {
      const __m512i q = _mm512_loadu_si512(B.q.data() + i);
      const __m512i hi = _mm512_srai_epi32(q, 8);
      sum_hi = _mm512_add_epi32(sum_hi, hi);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(L.hi.data() + i), _mm512_cvtepi32_epi8(hi));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(L.lo.data() + i),
                       _mm512_cvtepi32_epi8(_mm512_and_si512(q, _mm512_set1_epi32(255))));
    }
    L.bias += static_cast<double>(B.scale[b]) * 32768.0 *
              static_cast<double>(_mm512_reduce_add_epi32(sum_hi));
  }
  return L;
}

// R rows of x (each its own limbs) against output rows o_begin..o_end, one output row after
// another; every row's sums run exactly as they would alone (the weights are only shared), so a
// row's result does not depend on the rows it is batched with.
template <int R>
void int8_vnni_rows(const Int8Limbs* const* L, int64_t in, const int8_t* w, const float* scales,
                    float* const* out, int64_t o_begin, int64_t o_end) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t o = o_begin; o < o_end; ++o) {
    const int8_t* row = w + o * in;
    __m512 total[R];
    for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < in / VB; ++b) {  // VB = 128: two 64-byte vectors per block
      __m512i acc_hi[R][2], acc_lo[R][2];
      for (int u = 0; u < 2; ++u) {
        const int64_t j = b * VB + 64 * u;
        const __m512i wv = _mm512_loadu_si512(row + j);
        const __m512i flipped = _mm512_xor_si512(wv, flip);
        for (int r = 0; r < R; ++r) {
          const __m512i hi = _mm512_loadu_si512(L[r]->hi.data() + j);
          const __m512i lo = _mm512_loadu_si512(L[r]->lo.data() + j);
          acc_hi[r][u] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), flipped, hi);
          acc_lo[r][u] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, wv);
        }
      }
      for (int r = 0; r < R; ++r) {  // 256 hi + lo per lane stays below 2^27: exact in int32
        const __m512i q = _mm512_add_epi32(
            _mm512_slli_epi32(_mm512_add_epi32(acc_hi[r][0], acc_hi[r][1]), 8),
            _mm512_add_epi32(acc_lo[r][0], acc_lo[r][1]));
        total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(L[r]->scale[b]), total[r]);
      }
    }
    for (int r = 0; r < R; ++r)
      out[r][o] = scales[o] * static_cast<float>(_mm512_reduce_add_ps(total[r]) - L[r]->bias);
  }
}

// int4: the limbs of each block laid out as the nibbles meet them. Block b is the 64 bytes
// [64 b, 64 b + 64) of a weight row (inputs [128 b, 128 b + 128)): byte p holds in its low
// nibble the input g G + j and in its high nibble g G + j + G / 2 (g = p / (G/2), j = p % (G/2),
// module header). hi/lo: per block, 64 limbs in low-nibble order then 64 in high-nibble order.
struct Int4Limbs {
  std::vector<int8_t> hi, lo;  // (in): q = 256 hi + lo, both signed
  std::vector<float> scale;    // (in / VB)
  std::vector<int32_t> minus;  // (in / VB, 16): per lane, 8 x the sum of the q it meets
};

Int4Limbs int4_limbs(const Blocks& B, int64_t in, int64_t group) {
  Int4Limbs L{std::vector<int8_t>(in), std::vector<int8_t>(in), B.scale,
              std::vector<int32_t>(in / VB * 16, 0)};
  const int64_t half = group / 2;
  for (int64_t b = 0; b < in / VB; ++b) {
    int32_t ordered[VB];  // the block's q as the bytes meet them: low nibbles', then high's
    for (int64_t i = 0; i < VB; i += 16) {  // 16 inputs: one half of one group (half >= 16)
      const int64_t g = i / group, k = i % group;  // group within the block, offset in it
      const int64_t at = (k < half ? 0 : 64) + g * half + k % half;
      const __m512i q = _mm512_loadu_si512(B.q.data() + b * VB + i);
      _mm512_storeu_si512(ordered + at, q);
      const __m512i hi = _mm512_srai_epi32(_mm512_add_epi32(q, _mm512_set1_epi32(128)), 8);
      const __m512i lo = _mm512_sub_epi32(q, _mm512_slli_epi32(hi, 8));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(L.hi.data() + b * VB + at),
                       _mm512_cvtepi32_epi8(hi));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(L.lo.data() + b * VB + at),
                       _mm512_cvtepi32_epi8(lo));
    }
    for (int64_t lane = 0; lane < 16; ++lane)
      for (int64_t k = 0; k < 4; ++k)
        L.minus[b * 16 + lane] += 8 * (ordered[4 * lane + k] + ordered[64 + 4 * lane + k]);
  }
  return L;
}

// int4 reads more slowly than its instructions allow without help: prefetching 2 KiB ahead in
// the row (past its end: into the next row) read the 1B-shaped model's int4 matrices at 24-25
// GB/s (packed bytes and scales) against 21-23 without, 1 KiB and 4-8 KiB ahead in between (AMD
// EPYC, 2 threads, one window); two rows at a time (shared limb loads) read at 13-16.
constexpr int64_t INT4_PREFETCH = 2048;

template <int R>  // R rows of x, as int8_vnni_rows
void int4_vnni_rows(const Int4Limbs* const* L, int64_t in, const uint8_t* w, const float* scales,
                    int64_t group, float* const* out, int64_t o_begin, int64_t o_end) {
  const int64_t blocks = in / VB, groups = in / group;
  const __m512i low = _mm512_set1_epi8(0x0F);
  // lane l of a block sums bytes 4l..4l+3, all in the block's group 4 l / (G/2)
  const __m512i lane_group = _mm512_srli_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
      group == 32 ? 2 : group == 64 ? 3 : 4);
  const __mmask16 block_groups = static_cast<__mmask16>((1 << (VB / group)) - 1);
  for (int64_t o = o_begin; o < o_end; ++o) {
    const uint8_t* row = w + o * (in / 2);
    const float* row_scales = scales + o * groups;
    if (o + 1 < o_end)  // the next row's scales: a second stream the prefetchers would miss
      for (int64_t k = 0; k < groups; k += 16)
        _mm_prefetch(reinterpret_cast<const char*>(row_scales + groups + k), _MM_HINT_T0);
    __m512 total[R][2];
    for (int r = 0; r < R; ++r) total[r][0] = total[r][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      _mm_prefetch(reinterpret_cast<const char*>(row + 64 * b + INT4_PREFETCH), _MM_HINT_T0);
      const __m512i bytes = _mm512_loadu_si512(row + 64 * b);
      const __m512i u_low = _mm512_and_si512(bytes, low);
      const __m512i u_high = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);
      const __m512 s = _mm512_permutexvar_ps(
          lane_group, _mm512_maskz_loadu_ps(block_groups, row_scales + b * (VB / group)));
      for (int r = 0; r < R; ++r) {
        const int8_t* hi = L[r]->hi.data() + b * VB;
        const int8_t* lo = L[r]->lo.data() + b * VB;
        __m512i acc_hi =
            _mm512_dpbusd_epi32(_mm512_setzero_si512(), u_low, _mm512_loadu_si512(hi));
        acc_hi = _mm512_dpbusd_epi32(acc_hi, u_high, _mm512_loadu_si512(hi + 64));
        __m512i acc_lo =
            _mm512_dpbusd_epi32(_mm512_setzero_si512(), u_low, _mm512_loadu_si512(lo));
        acc_lo = _mm512_dpbusd_epi32(acc_lo, u_high, _mm512_loadu_si512(lo + 64));
        // per lane sum u q - 8 sum q: below 2^22 in magnitude, exact in int32 and in fp32
        const __m512i q = _mm512_sub_epi32(
            _mm512_add_epi32(_mm512_slli_epi32(acc_hi, 8), acc_lo),
            _mm512_loadu_si512(L[r]->minus.data() + b * 16));
        total[r][b & 1] = _mm512_fmadd_ps(
            _mm512_mul_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(L[r]->scale[b])), s,
            total[r][b & 1]);
      }
    }
    for (int r = 0; r < R; ++r)
      out[r][o] = _mm512_reduce_add_ps(_mm512_add_ps(total[r][0], total[r][1]));
  }
}

// Every row of x that rounds to limbs takes the VNNI kernels, four, two or one rows at a time;
// a row holding what limbs cannot carry (inf, NaN, a subnormal block) is left to the caller's
// exact path (returned). Each task walks its output rows in blocks of `block` rows (~64 KiB of
// weights) and runs every row tile over a block before the next: the weights come from memory
// once, the later tiles find them in cache.
template <typename Limbs, typename MakeLimbs, typename Tile>
std::vector<int64_t> vnni_rows(const float* x, int64_t rows, int64_t in, float qmax, float* out,
                               int64_t out_features, int64_t grain, int64_t block,
                               MakeLimbs make_limbs, Tile tile) {
  std::vector<Limbs> limbs;
  std::vector<int64_t> taken, left;
  limbs.reserve(rows);
  for (int64_t r = 0; r < rows; ++r) {
    const Blocks B = round_blocks(x + r * in, in, qmax);
    if (B.representable) {
      limbs.push_back(make_limbs(B));
      taken.push_back(r);
    } else {
      left.push_back(r);
    }
  }
  const int64_t n = static_cast<int64_t>(taken.size());
  if (n == 0) return left;
  std::vector<const Limbs*> L(n);
  std::vector<float*> outs(n);
  for (int64_t k = 0; k < n; ++k) {
    L[k] = &limbs[k];
    outs[k] = out + taken[k] * out_features;
  }
  at::parallel_for(0, out_features, grain, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; o += block) {
      const int64_t o_end = std::min(end, o + block);
      int64_t k = 0;
      for (; k + 4 <= n; k += 4) tile(std::integral_constant<int, 4>{}, &L[k], &outs[k], o, o_end);
      for (; k + 2 <= n; k += 2) tile(std::integral_constant<int, 2>{}, &L[k], &outs[k], o, o_end);
      for (; k < n; ++k) tile(std::integral_constant<int, 1>{}, &L[k], &outs[k], o, o_end);
    }
  });
  return left;
}
#endif

// bf16 weights are stored in tiles of BF16_TILE output rows, each tile chunk by chunk: chunk k
// holds the tile's rows' inputs [k C, k C + C) one row after another (C = bf16_chunk(I), as
// llmlab.kernels.quantized.pack lays them). A tile is then one sequential stream whose pieces
// all meet the same C inputs of x (4 KiB of fp32 at C = 1024, cached), and x is read in pair
// order (per 2W inputs: the W even ones, then the W odd ones) so that one full-width load of
// weights widens in lanes (widen_pairs). On an AMD EPYC (Zen 4), Llama-1B-shaped matrices in
// turn, 2 threads, one row read at ~0.85-0.93 of torch.sum's rate over the same bytes, where
// row-major weights (8 interleaved rows against all 8 KiB of x) read at ~0.75 and the tiles with
// cross-lane widening at ~0.85 (same windows). Rows past the last whole tile, and widths no chunk
// of 64 or more divides (C = I), stay row-major and take dense_rows. Each output's sum runs over
// its inputs in one order, one vector accumulator, whatever the rows of x beside it: a row's
// result is the same bits alone or batched.
constexpr int64_t BF16_TILE = 8;

int64_t bf16_chunk(int64_t in) {
  for (const int64_t chunk : {1024, 512, 256, 128, 64})
    if (in % chunk == 0) return chunk;
  return in;
}

// rows of x (rows, in) in pair order: per 2W inputs, the W even ones, then the W odd ones
std::vector<float> in_pair_order(const float* x, int64_t rows, int64_t in) {
  std::vector<float> pairs(rows * in);
  for (int64_t i = 0; i < rows * in; i += 2 * W)
    for (int k = 0; k < W; ++k) {
      pairs[i + k] = x[i + 2 * k];
      pairs[i + W + k] = x[i + 2 * k + 1];
    }
  return pairs;
}

// R rows of x (in pair order) against the tiles [t_begin, t_end); each row piece's accumulators
// live in registers while it streams (R of them, beside two vectors of weights).
template <int R>
void bf16_tiles(const float* x, int64_t in, int64_t chunk, const uint16_t* w, float* out,
                int64_t out_features, int64_t t_begin, int64_t t_end) {
  for (int64_t tile = t_begin; tile < t_end; ++tile) {
    const uint16_t* piece = w + tile * BF16_TILE * in;
    vec acc[BF16_TILE][R];
    for (int t = 0; t < BF16_TILE; ++t)
      for (int r = 0; r < R; ++r) acc[t][r] = vzero();
    for (int64_t c = 0; c < in; c += chunk) {
      for (int t = 0; t < BF16_TILE; ++t, piece += chunk) {
        vec a[R];
        for (int r = 0; r < R; ++r) a[r] = acc[t][r];
        for (int64_t j = 0; j < chunk; j += 2 * W) {
          vec even, odd;
          widen_pairs(piece + j, even, odd);
          for (int r = 0; r < R; ++r) {
            const float* xs = x + r * in + c + j;
            a[r] = vfma(odd, vload(xs + W), vfma(even, vload(xs), a[r]));
          }
        }
        for (int r = 0; r < R; ++r) acc[t][r] = a[r];
      }
    }
    for (int t = 0; t < BF16_TILE; ++t)
      for (int r = 0; r < R; ++r) out[r * out_features + tile * BF16_TILE + t] = vsum(acc[t][r]);
  }
}

template <int R, int OT>
void int4_tile(const float* x, int64_t in, const uint8_t* w, const float* scales, int64_t group,
               float* out, int64_t out_features, int64_t o) {
  const int64_t groups = in / group, half = group / 2;
  const __m128i low = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
  vec total[OT][R];
  for (int t = 0; t < OT; ++t)
    for (int r = 0; r < R; ++r) total[t][r] = vzero();
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t base = g * group;
    for (int t = 0; t < OT; ++t) {
      const uint8_t* bytes = w + (o + t) * (in / 2) + g * half;
      if ((g * half) % 64 == 0)  // a new cache line: fetch the next tile's (as dense_tile)
        _mm_prefetch(reinterpret_cast<const char*>(bytes + OT * (in / 2)), _MM_HINT_T0);
      vec acc[R];
      for (int r = 0; r < R; ++r) acc[r] = vzero();
      for (int64_t j = 0; j < half; j += 16) {  // 16 bytes: inputs j..j+15 and half+j..
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + j));
        __m128i lo = _mm_sub_epi8(_mm_and_si128(b, low), eight);
        __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(b, 4), low), eight);
        for (int k = 0; k < 16; k += W) {  // AVX-512: once; AVX2: twice, 8 lanes each
          const vec l = widen_low(lo), h = widen_low(hi);
          for (int r = 0; r < R; ++r) {
            const float* xr = x + r * in + base + j + k;
            acc[r] = vfma(l, vload(xr), acc[r]);
            acc[r] = vfma(h, vload(xr + half), acc[r]);
          }
          lo = _mm_srli_si128(lo, 8);
          hi = _mm_srli_si128(hi, 8);
        }
      }
      const vec s = vset1(scales[(o + t) * groups + g]);
      for (int r = 0; r < R; ++r) total[t][r] = vfma(acc[r], s, total[t][r]);
    }
  }
  for (int t = 0; t < OT; ++t)
    for (int r = 0; r < R; ++r) out[r * out_features + o + t] = vsum(total[t][r]);
}

template <int R>
void int4_rows(const float* x, int64_t in, const uint8_t* w, const float* scales, int64_t group,
               float* out, int64_t out_features, int64_t o_begin, int64_t o_end) {
  constexpr int OT = R == 4 ? 2 : R == 2 ? 4 : 8;
  int64_t o = o_begin;
  for (; o + OT <= o_end; o += OT)
    int4_tile<R, OT>(x, in, w, scales, group, out, out_features, o);
  for (; o < o_end; ++o) int4_tile<R, 1>(x, in, w, scales, group, out, out_features, o);
}

// Rows in tiles of 4, 2, 1 (each tile reuses the widened weights for all its rows).
template <typename Fn4, typename Fn2, typename Fn1>
void by_row_tiles(int64_t rows, int64_t in, int64_t out_features, Fn4 f4, Fn2 f2, Fn1 f1,
                  int64_t o_begin = 0) {
  // at least ~64 KiB of weights per task: fewer, larger tasks for small matrices
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(in, 1));
  at::parallel_for(o_begin, out_features, grain, [&](int64_t begin, int64_t end) {
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) f4(r, begin, end);
    for (; r + 2 <= rows; r += 2) f2(r, begin, end);
    for (; r < rows; ++r) f1(r, begin, end);
  });
}

void check(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scales,
           torch::ScalarType wtype, int64_t in) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && scales.device().is_cpu(),
              "few_row_matmul: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && scales.scalar_type() == torch::kFloat32,
              "few_row_matmul: x and scales must be float32");
  TORCH_CHECK(w.scalar_type() == wtype, "few_row_matmul: weight dtype ", w.scalar_type());
  TORCH_CHECK(x.dim() == 2 && x.size(1) == in, "few_row_matmul: x must be (rows, ", in, ")");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && scales.is_contiguous(),
              "few_row_matmul: contiguous tensors only");
}

}  // namespace

torch::Tensor int8_matmul(torch::Tensor x, torch::Tensor w, torch::Tensor scales) {
  const int64_t out_features = w.size(0), in = w.size(1), rows = x.size(0);
  check(x, w, scales, torch::kInt8, in);
  TORCH_CHECK(scales.numel() == out_features, "few_row_matmul: one scale per output row");
  auto out = torch::empty({rows, out_features}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
#if defined(__AVX512VNNI__)
  if (in % VB == 0) {  // rows of x through VNNI; rows holding an inf/NaN: the widening path
    const int64_t grain = std::max<int64_t>(1, 65536 / in);
    const std::vector<int64_t> left = vnni_rows<Int8Limbs>(
        xp, rows, in, 32767.f, op, out_features, grain, grain,
        [&](const Blocks& B) { return int8_limbs(B, in); },
        [&](auto R, const Int8Limbs* const* L, float* const* outs, int64_t b, int64_t e) {
          int8_vnni_rows<decltype(R)::value>(L, in, wp, sp, outs, b, e);
        });
    if (!left.empty())
      at::parallel_for(0, out_features, grain, [&](int64_t b, int64_t e) {
        for (const int64_t r : left)
          dense_rows<int8_t, 1>(xp + r * in, in, wp, sp, op + r * out_features, out_features, b, e);
      });
    return out;
  }
#endif
  by_row_tiles(rows, in, out_features,
      [&](int64_t r, int64_t b, int64_t e) { dense_rows<int8_t, 4>(xp + r * in, in, wp, sp, op + r * out_features, out_features, b, e); },
      [&](int64_t r, int64_t b, int64_t e) { dense_rows<int8_t, 2>(xp + r * in, in, wp, sp, op + r * out_features, out_features, b, e); },
      [&](int64_t r, int64_t b, int64_t e) { dense_rows<int8_t, 1>(xp + r * in, in, wp, sp, op + r * out_features, out_features, b, e); });
  return out;
}

torch::Tensor bf16_matmul(torch::Tensor x, torch::Tensor w) {
  const int64_t out_features = w.size(0), in = w.size(1), rows = x.size(0);
  check(x, w, x, torch::kBFloat16, in);
  auto out = torch::empty({rows, out_features}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  float* op = out.data_ptr<float>();
  const float* none = nullptr;
  const int64_t chunk = bf16_chunk(in);
  const int64_t tiles = chunk < in ? out_features / BF16_TILE : 0;
  const std::vector<float> pairs = tiles ? in_pair_order(xp, rows, in) : std::vector<float>();
  const float* pp = pairs.data();
  // every row tile of x over a weight tile while it is cached (8 rows x I x 2 bytes)
  const int64_t grain = std::max<int64_t>(1, 65536 / (BF16_TILE * 2 * in));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile) {
      int64_t r = 0;
      for (; r + 4 <= rows; r += 4)
        bf16_tiles<4>(pp + r * in, in, chunk, wp, op + r * out_features, out_features, tile, tile + 1);
      for (; r + 2 <= rows; r += 2)
        bf16_tiles<2>(pp + r * in, in, chunk, wp, op + r * out_features, out_features, tile, tile + 1);
      for (; r < rows; ++r)
        bf16_tiles<1>(pp + r * in, in, chunk, wp, op + r * out_features, out_features, tile, tile + 1);
    }
  });
  if (tiles * BF16_TILE == out_features) return out;
  by_row_tiles(rows, in, out_features,  // the row-major rest
      [&](int64_t r, int64_t b, int64_t e) { dense_rows<uint16_t, 4>(xp + r * in, in, wp, none, op + r * out_features, out_features, b, e); },
      [&](int64_t r, int64_t b, int64_t e) { dense_rows<uint16_t, 2>(xp + r * in, in, wp, none, op + r * out_features, out_features, b, e); },
      [&](int64_t r, int64_t b, int64_t e) { dense_rows<uint16_t, 1>(xp + r * in, in, wp, none, op + r * out_features, out_features, b, e); },
      tiles * BF16_TILE);
  return out;
}

torch::Tensor int4_matmul(torch::Tensor x, torch::Tensor w, torch::Tensor scales, int64_t group) {
  const int64_t out_features = w.size(0), in = w.size(1) * 2, rows = x.size(0);
  check(x, w, scales, torch::kUInt8, in);
  TORCH_CHECK(group % 32 == 0 && in % group == 0, "few_row_matmul: int4 group ", group,
              " must be a multiple of 32 dividing ", in);
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == out_features && scales.size(1) == in / group,
              "few_row_matmul: int4 scales must be (", out_features, ", ", in / group, ")");
  auto out = torch::empty({rows, out_features}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
#if defined(__AVX512VNNI__)
  if (in % VB == 0 && VB % group == 0) {  // as int8
    const int64_t grain = std::max<int64_t>(1, 32768 / in);
    const std::vector<int64_t> left = vnni_rows<Int4Limbs>(
        xp, rows, in, 32639.f, op, out_features, grain, 4 * grain,
        [&](const Blocks& B) { return int4_limbs(B, in, group); },
        [&](auto R, const Int4Limbs* const* L, float* const* outs, int64_t b, int64_t e) {
          int4_vnni_rows<decltype(R)::value>(L, in, wp, sp, group, outs, b, e);
        });
    if (!left.empty())
      at::parallel_for(0, out_features, grain, [&](int64_t b, int64_t e) {
        for (const int64_t r : left)
          int4_rows<1>(xp + r * in, in, wp, sp, group, op + r * out_features, out_features, b, e);
      });
    return out;
  }
#endif
  by_row_tiles(rows, in, out_features,
      [&](int64_t r, int64_t b, int64_t e) { int4_rows<4>(xp + r * in, in, wp, sp, group, op + r * out_features, out_features, b, e); },
      [&](int64_t r, int64_t b, int64_t e) { int4_rows<2>(xp + r * in, in, wp, sp, group, op + r * out_features, out_features, b, e); },
      [&](int64_t r, int64_t b, int64_t e) { int4_rows<1>(xp + r * in, in, wp, sp, group, op + r * out_features, out_features, b, e); });
  return out;
}

// fp32 weights: rows of x in tiles of 8 (then one tile of the rest). With more than one row tile,
// each task walks its output rows in blocks of about 64 KiB of weights (a multiple of 24 rows:
// every AVX-512 tile width of fp32_tile divides it, so no block ends in one-row tiles) and runs
// every row tile over a block before the next: the weights come from memory once and the later
// row tiles find them in cache.
constexpr int64_t FP32_ROW_TILE = 8;

template <int R>
void fp32_tile_rows(const float* x, int64_t in, const float* w, float* out, int64_t out_features,
                    int64_t o_begin, int64_t o_end) {
  dense_rows<float, R, fp32_tile<R>()>(x, in, w, nullptr, out, out_features, o_begin, o_end);
}

void fp32_rows(const float* x, int64_t rows, int64_t in, const float* w, float* out,
               int64_t out_features, int64_t o_begin, int64_t o_end) {
  using Tile = void (*)(const float*, int64_t, const float*, float*, int64_t, int64_t, int64_t);
  static constexpr Tile tiles[] = {nullptr, fp32_tile_rows<1>, fp32_tile_rows<2>,
                                   fp32_tile_rows<3>, fp32_tile_rows<4>, fp32_tile_rows<5>,
                                   fp32_tile_rows<6>, fp32_tile_rows<7>, fp32_tile_rows<8>};
  if (rows <= FP32_ROW_TILE) {  // one tile: each weight is read once whatever the order
    tiles[rows](x, in, w, out, out_features, o_begin, o_end);
    return;
  }
  const int64_t block = (16384 / std::max<int64_t>(in, 1) / 24 + 1) * 24;
  for (int64_t o = o_begin; o < o_end; o += block) {
    const int64_t end = std::min(o_end, o + block);
    for (int64_t r = 0; r < rows; r += FP32_ROW_TILE) {
      const int64_t n = std::min(FP32_ROW_TILE, rows - r);
      tiles[n](x + r * in, in, w, out + r * out_features, out_features, o, end);
    }
  }
}

torch::Tensor fp32_matmul(torch::Tensor x, torch::Tensor w) {
  const int64_t out_features = w.size(0), in = w.size(1), rows = x.size(0);
  check(x, w, x, torch::kFloat32, in);
  auto out = torch::empty({rows, out_features}, x.options());
  if (rows == 0) return out;
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(in, 1));
  at::parallel_for(0, out_features, grain, [&](int64_t b, int64_t e) {
    fp32_rows(xp, rows, in, wp, op, out_features, b, e);
  });
  return out;
}
