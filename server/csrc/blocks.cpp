// Fused pre-norm blocks of a Llama-style decoder for float32 activations on AVX2 + FMA CPUs.
//
// One call runs a whole block (norm, projections, rotary, K/V write, attention, residual add, or
// norm, gate/up, SiLU * up, down, residual add) on the rows that keep it, so a decode step costs
// one dispatch per block instead of a dozen eager ops, each with its own allocation and Python
// round trip. Rows that skip the block are not touched: their residual stream passes through and
// their K/V at this layer is never written, as they never read it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/custom_class.h>
#include <torch/library.h>
#include <immintrin.h>

#include <cmath>
#include <optional>
#include <vector>

#include "weight_only.h"

namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// e^x to about 1 ulp on [-87, 88]: x = n ln2 + r, |r| <= ln2/2, e^r by its degree-6 Taylor
// polynomial, 2^n put into the exponent bits.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// [sum(v[0]), ..., sum(v[7])]
inline __m256 hsum8(const __m256 v[8]) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

float exp1(float x) {
  alignas(32) float v[8] = {x};
  _mm256_store_ps(v, exp8(_mm256_load_ps(v)));
  return v[0];
}

// Eight cached K/V values as float32, and back: the cache holds float32 or float16 (F16C,
// round to nearest even).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(at::Half* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

// y = x W^T (+ b); W as the formats store it: [qs, dm] (Q4_1; q8: int8-rounded activations), [q, scales]
// (int8), [bf16 weight] or [float32 weight], then optionally a copy for oneDNN's bf16 matmul (int4bf16,
// int8 with wide, bf16) and, for Q4_1 and int8 with wide, uint8 tiles.
at::Tensor linear(const at::Tensor& x, at::TensorList w, const std::optional<at::Tensor>& bias, bool q8) {
  TORCH_CHECK(!w.empty(), "a linear needs its weight tensors");
  at::Tensor y;
  std::optional<at::Tensor> wide, tiles;
  const bool bf16 = !w[0].is_mkldnn() && w[0].scalar_type() == at::kBFloat16;
  for (size_t i = bf16 ? 1 : 2; i < w.size(); ++i) (w[i].scalar_type() == at::kByte ? tiles : wide) = w[i];
  if (bf16) {
    y = igserve::bf16_linear(x, w[0], wide);
  } else if (w[0].scalar_type() == at::kByte) {
    y = igserve::q4_linear(x, w[0], w[1], q8, wide, tiles);
  } else if (w[0].scalar_type() == at::kChar) {
    y = igserve::i8_linear(x, w[0], w[1], wide, tiles);
  } else {
    TORCH_CHECK(w[0].scalar_type() == at::kFloat, "dense weights must be float32");
    y = igserve::f32_linear(x, w[0]);
  }
  if (bias && bias->defined()) y.add_(*bias);
  return y;
}

// The rows' tokens that run the block: (row, position in the chunk) of kept rows' real tokens.
struct Tokens {
  std::vector<int64_t> row, t;
};

Tokens kept_tokens(const at::Tensor& keep, const at::Tensor& lengths, int64_t n, int64_t T) {
  TORCH_CHECK(keep.scalar_type() == at::kBool && lengths.scalar_type() == at::kLong, "keep is bool, lengths int64");
  TORCH_CHECK(keep.is_contiguous() && lengths.is_contiguous() && keep.numel() == n && lengths.numel() == n,
              "keep and lengths need one entry per row");
  const bool* k = keep.data_ptr<bool>();
  const int64_t* len = lengths.data_ptr<int64_t>();
  Tokens out;
  for (int64_t r = 0; r < keep.numel(); ++r) {
    if (!k[r]) continue;
    TORCH_CHECK(len[r] >= 1 && len[r] <= T, "row length out of range");
    for (int64_t t = 0; t < len[r]; ++t) out.row.push_back(r), out.t.push_back(t);
  }
  return out;
}

// x [M, H]: the gathered tokens of h [n, T, H], RMS-normalised and scaled by w (HF's LlamaRMSNorm
// in float32).
at::Tensor rms_norm(const at::Tensor& h, const Tokens& tok, const at::Tensor& w, double eps) {
  const int64_t T = h.size(1), H = h.size(2), M = tok.row.size();
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() == H, "norm weight must be float32 [H]");
  at::Tensor x = at::empty({M, H}, h.options());
  const float* hp = h.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* xp = x.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    const float* src = hp + (tok.row[m] * T + tok.t[m]) * H;
    float ss = 0;
    for (int64_t i = 0; i < H; ++i) ss += src[i] * src[i];
    const float inv = 1.0f / std::sqrt(ss / H + static_cast<float>(eps));
    for (int64_t i = 0; i < H; ++i) xp[m * H + i] = (src[i] * inv) * wp[i];
  }
  return x;
}

// h[row, t] += out[m] for every gathered token.
void residual_add(const at::Tensor& h, const Tokens& tok, const at::Tensor& out) {
  const int64_t T = h.size(1), H = h.size(2);
  float* hp = h.data_ptr<float>();
  const float* op = out.data_ptr<float>();
  for (size_t m = 0; m < tok.row.size(); ++m) {
    float* dst = hp + (tok.row[m] * T + tok.t[m]) * H;
    for (int64_t i = 0; i < H; ++i) dst[i] = dst[i] + op[m * H + i];
  }
}

void check_h(const at::Tensor& h) {
  TORCH_CHECK(h.dim() == 3 && h.scalar_type() == at::kFloat && h.is_contiguous() && h.device().is_cpu(),
              "h must be a contiguous float32 CPU tensor [n, T, H]");
}

// Rotary on q and k of y [M, (hq + 2 hk) D] at each token's position, k and v into the cache at
// (slot, position), then each token's heads attend over its slot's positions 0 .. position:
// attn [M, hq D]. T: the cache's element type (float or at::Half).
template <typename T>
void attend(const at::Tensor& y, const at::Tensor& cos, const at::Tensor& sin, T* kc, T* vc, const Tokens& tok,
            const std::vector<int64_t>& pos, const int64_t* slot, int64_t hq, int64_t hk, int64_t D, int64_t L,
            float fscale, const at::Tensor& attn) {
  const int64_t M = tok.row.size(), W = (hq + 2 * hk) * D, half = D / 2;
  float* yp = y.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  std::vector<float> tmp(D);
  for (int64_t m = 0; m < M; ++m) {
    const float *c = cp + pos[m] * D, *s = sp + pos[m] * D;
    for (int64_t head = 0; head < hq + hk; ++head) {  // x cos + rotate_half(x) sin, as the reference rounds it
      float* v = yp + m * W + head * D;
      for (int64_t i = 0; i < half; ++i) tmp[i] = v[i] * c[i] + (-v[i + half]) * s[i];
      for (int64_t i = half; i < D; ++i) tmp[i] = v[i] * c[i] + v[i - half] * s[i];
      std::copy(tmp.begin(), tmp.end(), v);
    }
    for (int64_t kh = 0; kh < hk; ++kh) {
      const int64_t at = ((slot[tok.row[m]] * hk + kh) * L + pos[m]) * D;
      for (int64_t i = 0; i < D; i += 8) {
        store8(kc + at + i, _mm256_loadu_ps(yp + m * W + (hq + kh) * D + i));
        store8(vc + at + i, _mm256_loadu_ps(yp + m * W + (hq + hk + kh) * D + i));
      }
    }
  }

  float* ap = attn.data_ptr<float>();
  const int64_t group = hq / hk;
  at::parallel_for(0, M * hq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t m = task / hq, head = task % hq, n = pos[m] + 1;
      const float* q = yp + m * W + head * D;
      const int64_t base = (slot[tok.row[m]] * hk + head / group) * L * D;
      const T *kb = kc + base, *vb = vc + base;
      p.resize(n);
      float best = -INFINITY;
      int64_t j = 0;
      // eight positions at a time: independent FMA chains (one chain per position waits on FMA
      // latency), reduced together by one transposing horizontal add
      __m256 best8 = _mm256_set1_ps(-INFINITY);
      const __m256 vscale = _mm256_set1_ps(fscale);
      for (; j + 8 <= n; j += 8) {
        __m256 acc[8];
        for (int u = 0; u < 8; ++u) acc[u] = _mm256_setzero_ps();
        for (int64_t i = 0; i < D; i += 8) {
          const __m256 qv = _mm256_loadu_ps(q + i);
          for (int u = 0; u < 8; ++u) acc[u] = _mm256_fmadd_ps(qv, load8(kb + (j + u) * D + i), acc[u]);
        }
        const __m256 sc = _mm256_mul_ps(hsum8(acc), vscale);
        _mm256_storeu_ps(p.data() + j, sc);
        best8 = _mm256_max_ps(best8, sc);
      }
      best = std::max(best, hmax(best8));
      for (; j < n; ++j) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t i = 0; i < D; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8(kb + j * D + i), acc);
        p[j] = hsum(acc) * fscale;
        best = std::max(best, p[j]);
      }
      __m256 total8 = _mm256_setzero_ps();
      j = 0;
      for (; j + 8 <= n; j += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p.data() + j), _mm256_set1_ps(best)));
        _mm256_storeu_ps(p.data() + j, e);
        total8 = _mm256_add_ps(total8, e);
      }
      float total = hsum(total8);
      for (; j < n; ++j) total += (p[j] = exp1(p[j] - best));
      const __m256 inv = _mm256_set1_ps(1.0f / total);
      float* out = ap + m * hq * D + head * D;
      int64_t i = 0;
      for (; i + 64 <= D; i += 64) {  // 8 output vectors per pass over the positions: 8 independent chains
        __m256 acc[8];
        for (int u = 0; u < 8; ++u) acc[u] = _mm256_setzero_ps();
        for (int64_t jj = 0; jj < n; ++jj) {
          const __m256 pj = _mm256_set1_ps(p[jj]);
          for (int u = 0; u < 8; ++u) acc[u] = _mm256_fmadd_ps(pj, load8(vb + jj * D + i + 8 * u), acc[u]);
        }
        for (int u = 0; u < 8; ++u) _mm256_storeu_ps(out + i + 8 * u, _mm256_mul_ps(acc[u], inv));
      }
      for (; i < D; i += 8) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t jj = 0; jj < n; ++jj) acc = _mm256_fmadd_ps(_mm256_set1_ps(p[jj]), load8(vb + jj * D + i), acc);
        _mm256_storeu_ps(out + i, _mm256_mul_ps(acc, inv));
      }
    }
  });
}

// One attention block: x = norm(h); q, k, v = x Wqkv; rotary on q and k; k, v into the cache at
// (slot, start + t); each token attends over its slot's positions 0 .. start + t; h += o(attn).
void attn_block(const at::Tensor& h, const at::Tensor& keep, const at::Tensor& norm_w, double eps, at::TensorList qkv,
                const std::optional<at::Tensor>& qkv_bias, at::TensorList o, const std::optional<at::Tensor>& o_bias,
                const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache,
                const at::Tensor& slots, const at::Tensor& starts, const at::Tensor& lengths, int64_t num_heads,
                int64_t num_kv_heads, double scale, bool q8_qkv, bool q8_o) {
  check_h(h);
  const int64_t T = h.size(1);
  const Tokens tok = kept_tokens(keep, lengths, h.size(0), T);
  const int64_t M = tok.row.size();
  if (M == 0) return;
  const int64_t hq = num_heads, hk = num_kv_heads, D = k_cache.size(3), L = k_cache.size(2);
  TORCH_CHECK(hq % hk == 0 && D % 8 == 0 && k_cache.size(1) == hk, "head layout mismatch");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  (k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kHalf) &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "K/V caches must be contiguous float32 or float16 [slots, kv_heads, len, head_dim]");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == D && sin.sizes() == cos.sizes(),
              "cos/sin must be contiguous [positions, head_dim]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && starts.scalar_type() == at::kLong && slots.is_contiguous() &&
                  starts.is_contiguous() && slots.numel() == h.size(0) && starts.numel() == h.size(0),
              "slots and starts: one int64 per row");
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* start = starts.data_ptr<int64_t>();
  std::vector<int64_t> pos(M);
  for (int64_t m = 0; m < M; ++m) {
    pos[m] = start[tok.row[m]] + tok.t[m];
    TORCH_CHECK(pos[m] < L && pos[m] < cos.size(0), "position beyond the cache");
    TORCH_CHECK(slot[tok.row[m]] >= 0 && slot[tok.row[m]] < k_cache.size(0), "slot out of range");
  }

  at::Tensor y = linear(rms_norm(h, tok, norm_w, eps), qkv, qkv_bias, q8_qkv);  // [M, (hq + 2 hk) D]
  TORCH_CHECK(y.size(1) == (hq + 2 * hk) * D, "qkv projection has the wrong width");
  at::Tensor attn = at::empty({M, hq * D}, h.options());
  if (k_cache.scalar_type() == at::kHalf)
    attend(y, cos, sin, k_cache.data_ptr<at::Half>(), v_cache.data_ptr<at::Half>(), tok, pos, slot, hq, hk, D, L,
           static_cast<float>(scale), attn);
  else
    attend(y, cos, sin, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), tok, pos, slot, hq, hk, D, L,
           static_cast<float>(scale), attn);
  residual_add(h, tok, linear(attn, o, o_bias, q8_o));
}

// One FFN block: x = norm(h); g, u = x Wgate_up; h += down(silu(g) * u).
void ffn_block(const at::Tensor& h, const at::Tensor& keep, const at::Tensor& norm_w, double eps, at::TensorList gate_up,
               const std::optional<at::Tensor>& gate_up_bias, at::TensorList down,
               const std::optional<at::Tensor>& down_bias, const at::Tensor& lengths, bool q8_gate_up, bool q8_down) {
  check_h(h);
  const Tokens tok = kept_tokens(keep, lengths, h.size(0), h.size(1));
  const int64_t M = tok.row.size();
  if (M == 0) return;
  at::Tensor gu = linear(rms_norm(h, tok, norm_w, eps), gate_up, gate_up_bias, q8_gate_up);  // [M, 2I]
  const int64_t I = gu.size(1) / 2;
  TORCH_CHECK(I % 8 == 0, "intermediate size must be a multiple of 8");
  at::Tensor a = at::empty({M, I}, h.options());
  const float* gp = gu.data_ptr<float>();
  float* apt = a.data_ptr<float>();
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t i = 0; i < I; i += 8) {
      const __m256 g = _mm256_loadu_ps(gp + m * 2 * I + i), u = _mm256_loadu_ps(gp + m * 2 * I + I + i);
      const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, g))));
      _mm256_storeu_ps(apt + m * I + i, _mm256_mul_ps(silu, u));
    }
  residual_add(h, tok, linear(a, down, down_bias, q8_down));
}

// h [n, T, H] RMS-normalised in place over every position (the final norm), as rms_norm rounds it.
void norm_all(const at::Tensor& h, const at::Tensor& w, double eps) {
  const int64_t H = h.size(2), M = h.size(0) * h.size(1);
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() == H, "norm weight must be float32 [H]");
  float* hp = h.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    float* x = hp + m * H;
    float ss = 0;
    for (int64_t i = 0; i < H; ++i) ss += x[i] * x[i];
    const float inv = 1.0f / std::sqrt(ss / H + static_cast<float>(eps));
    for (int64_t i = 0; i < H; ++i) x[i] = (x[i] * inv) * wp[i];
  }
}

// The decoder's layers held on the C++ side, so that a cached forward is one call from Python
// instead of one per block: converting a block op's twenty arguments costs a few microseconds,
// about what a one-row block's own work outside its matmuls costs. The cache tensors are the
// runner's (written in place); the weights are the runner's too, never copied.
struct FusedStack : torch::CustomClassHolder {
  struct Layer {
    at::Tensor attn_norm, ffn_norm, k_cache, v_cache;
    double attn_eps, ffn_eps, scale;
    std::vector<at::Tensor> qkv, o, gate_up, down;
    std::optional<at::Tensor> qkv_bias, o_bias, gate_up_bias, down_bias;
    bool q8_qkv, q8_o, q8_gate_up, q8_down;
  };
  std::vector<Layer> layers;
  at::Tensor cos, sin, final_norm;
  double final_eps;
  int64_t num_heads, num_kv_heads;

  FusedStack(at::Tensor cos, at::Tensor sin, at::Tensor final_norm, double final_eps, int64_t num_heads,
             int64_t num_kv_heads)
      : cos(std::move(cos)), sin(std::move(sin)), final_norm(std::move(final_norm)), final_eps(final_eps),
        num_heads(num_heads), num_kv_heads(num_kv_heads) {}

  void add_layer(at::Tensor attn_norm, double attn_eps, std::vector<at::Tensor> qkv, std::optional<at::Tensor> qkv_bias,
                 std::vector<at::Tensor> o, std::optional<at::Tensor> o_bias, at::Tensor k_cache, at::Tensor v_cache,
                 double scale, bool q8_qkv, bool q8_o, at::Tensor ffn_norm, double ffn_eps,
                 std::vector<at::Tensor> gate_up, std::optional<at::Tensor> gate_up_bias, std::vector<at::Tensor> down,
                 std::optional<at::Tensor> down_bias, bool q8_gate_up, bool q8_down) {
    layers.push_back({std::move(attn_norm), std::move(ffn_norm), std::move(k_cache), std::move(v_cache), attn_eps,
                      ffn_eps, scale, std::move(qkv), std::move(o), std::move(gate_up), std::move(down),
                      std::move(qkv_bias), std::move(o_bias), std::move(gate_up_bias), std::move(down_bias), q8_qkv,
                      q8_o, q8_gate_up, q8_down});
  }

  // Every block j on the rows whose columns[j] is set (columns: bool [2L, n]), then the final norm,
  // all in place on h.
  void forward(const at::Tensor& h, const at::Tensor& columns, const at::Tensor& slots, const at::Tensor& starts,
               const at::Tensor& lengths) {
    check_h(h);
    const int64_t L = layers.size();
    TORCH_CHECK(columns.scalar_type() == at::kBool && columns.is_contiguous() && columns.dim() == 2 &&
                    columns.size(0) == 2 * L && columns.size(1) == h.size(0),
                "columns must be contiguous bool [2 * layers, rows]");
    for (int64_t i = 0; i < L; ++i) {
      const Layer& f = layers[i];
      attn_block(h, columns[2 * i], f.attn_norm, f.attn_eps, f.qkv, f.qkv_bias, f.o, f.o_bias, cos, sin, f.k_cache,
                 f.v_cache, slots, starts, lengths, num_heads, num_kv_heads, f.scale, f.q8_qkv, f.q8_o);
      ffn_block(h, columns[2 * i + 1], f.ffn_norm, f.ffn_eps, f.gate_up, f.gate_up_bias, f.down, f.down_bias, lengths,
                f.q8_gate_up, f.q8_down);
    }
    norm_all(h, final_norm, final_eps);
  }
};

// The first index of each row's largest value, x [B, V] float32 -> int64 [B] (torch.argmax's
// answer for finite rows; a NaN counts as no value). One pass at memory speed: torch's CPU argmax
// took ~70 µs on a 49k vocabulary, as much as a dozen of a one-row step's blocks.
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) > 0,
              "x must be a contiguous float32 [B, V] tensor");
  const int64_t B = x.size(0), V = x.size(1);
  at::Tensor out = at::empty({B}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    const float* row = xp + b * V;
    // eight lanes keep their own best value and index; the first-index tie rule is applied after
    __m256 best = _mm256_set1_ps(-INFINITY);
    __m256i best_i = _mm256_set1_epi32(-1), idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i step = _mm256_set1_epi32(8);
    int64_t j = 0;
    for (; j + 8 <= V; j += 8, idx = _mm256_add_epi32(idx, step)) {
      const __m256 v = _mm256_loadu_ps(row + j);
      const __m256 gt = _mm256_cmp_ps(v, best, _CMP_GT_OQ);  // strictly greater: a lane keeps its first
      best = _mm256_blendv_ps(best, v, gt);
      best_i = _mm256_blendv_epi8(best_i, idx, _mm256_castps_si256(gt));
    }
    alignas(32) float bv[8];
    alignas(32) int32_t bi[8];
    _mm256_store_ps(bv, best);
    _mm256_store_si256(reinterpret_cast<__m256i*>(bi), best_i);
    float top = -INFINITY;
    int64_t at = -1;
    for (int l = 0; l < 8; ++l)
      if (bi[l] >= 0 && (bv[l] > top || (bv[l] == top && bi[l] < at))) top = bv[l], at = bi[l];
    for (; j < V; ++j)
      if (row[j] > top) top = row[j], at = j;
    op[b] = at < 0 ? 0 : at;  // all -inf (or NaN): the first token, as torch answers for -inf
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(igserve, lib) {
  lib.class_<FusedStack>("FusedStack")
      .def(torch::init<at::Tensor, at::Tensor, at::Tensor, double, int64_t, int64_t>())
      .def("add_layer", &FusedStack::add_layer)
      .def("forward", &FusedStack::forward);
  lib.def("argmax_rows(Tensor x) -> Tensor");
  lib.def(
      "attn_block(Tensor(a!) h, Tensor keep, Tensor norm_w, float eps, Tensor[] qkv, Tensor? qkv_bias, Tensor[] o, "
      "Tensor? o_bias, Tensor cos, Tensor sin, Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor slots, Tensor starts, "
      "Tensor lengths, int num_heads, int num_kv_heads, float scale, bool q8_qkv=False, bool q8_o=False) -> ()");
  lib.def(
      "ffn_block(Tensor(a!) h, Tensor keep, Tensor norm_w, float eps, Tensor[] gate_up, Tensor? gate_up_bias, "
      "Tensor[] down, Tensor? down_bias, Tensor lengths, bool q8_gate_up=False, bool q8_down=False) -> ()");
}

TORCH_LIBRARY_IMPL(igserve, CPU, lib) {
  lib.impl("attn_block", attn_block);
  lib.impl("ffn_block", ffn_block);
  lib.impl("argmax_rows", argmax_rows);
}

TORCH_LIBRARY_IMPL(igserve, MkldnnCPU, lib) {  // int4bf16 layers' oneDNN weights (weight_only.cpp)
  lib.impl("attn_block", attn_block);
  lib.impl("ffn_block", ffn_block);
}
