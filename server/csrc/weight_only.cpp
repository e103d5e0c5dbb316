// Weight-only linears for CPUs with AVX2 + FMA: y[R, N] = x[R, K] W^T with float32 activations.
//
// Expanding the weights to float32 is most of the work, so each weight is expanded once per call:
// in registers for up to 4 rows, into a float32 buffer of 12 channels that every row reuses for
// more (batched decode, prefill chunks). Weights are exactly what the formats store: Q4_1 groups
// (w = d*q + m, rounded as q*d then + m, as the float reference does; a single row factors the
// product instead, see tile_q4_row), int8 per output channel (w = s*q, scaled after the dot
// product) and bfloat16 (format bf16: widened exactly); float32 (format fp32) for up to 4 rows only.
//
// q8 (Q4_1 only): the activations are first rounded per row and group of 32 to int8 with one
// float scale (absmax / 127), as llama.cpp's Q8_1 does. A single row then runs integer dot
// products (maddubs: 32 multiply-adds per instruction, about 1.6x faster than expanding Q4_1 to
// float32); more rows run the float32 kernel on the rounded activations, which computes the same
// product to float32 rounding, so a row's result does not depend on the rows batched with it. On
// AVX-512 VNNI a single row runs q8_tile_row instead, over the same groups laid out in 16-channel tiles.
//
// int4bf16 and bf16 (linears that carry a copy for oneDNN, `wide`): from wide_rows() rows oneDNN's bf16
// matmul; for int4bf16 up to tile_rows() rows, on a CPU with AVX-512 VNNI (checked at run time), integer dot products of
// the exact weights with x in two int8 digits, on the same 16-channel tiles (q4_tile_i8x2), first.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <cstdlib>
#include <type_traits>
#include <vector>

#include "weight_only.h"

namespace {

constexpr int64_t GROUP = 32;
// bytes ahead in a channel's weights that the register tiles prefetch: eight channels read side by
// side (one row), or two for up to four rows, outrun the hardware prefetcher (README, "Benchmarks");
// and, as a channel is only K bytes or less, the same place AHEAD channels on (a later tile's), so
// the next tile does not start cold
constexpr int64_t PF = 128, AHEAD = 8;
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Q4_1, repacked at load (q4_pack): a group of 32 is 16 bytes; byte j of half h (8 bytes each)
// holds element 16h + j in its low nibble and 16h + 8 + j in its high one, so each half is one
// 8-byte widening load, then a mask and a shift.
struct Q4 {
  const uint8_t* q;    // [N, K/2]
  const uint32_t* dm;  // [N, K/32]: fp16 d in the low half, fp16 m in the high half, as the GGUF stores them
  int64_t G;           // groups per channel
  const float* xsum = nullptr;  // one row: its sum per group, for the factored product (tile_q4_row)
  struct Channel {
    const uint8_t* q;
    const uint32_t* dm;
    int64_t ahead;  // groups to the same place in the channel AHEAD rows on
    inline void prefetch(int64_t g) const {
      _mm_prefetch(reinterpret_cast<const char*>(q + g * 16 + PF), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(q + (g + ahead) * 16), _MM_HINT_T0);
      if (g % 16 == 0) _mm_prefetch(reinterpret_cast<const char*>(dm + g + ahead), _MM_HINT_T0);
    }
    // the nibbles of group g as float32, in the order expand() produces them
    inline void nibbles(int64_t g, __m256 w[4]) const {
      const __m256i low = _mm256_set1_epi32(15);
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + g * 16 + 8 * h)));
        w[2 * h] = _mm256_cvtepi32_ps(_mm256_and_si256(v, low));
        w[2 * h + 1] = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
      }
    }
    inline void expand(int64_t g, __m256 w[4]) const {
      const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(dm[g])));  // [d, m, 0, 0]
      const __m256 vd = _mm256_broadcastss_ps(f), vm = _mm256_broadcastss_ps(_mm_movehdup_ps(f));
      nibbles(g, w);
      for (int i = 0; i < 4; ++i) w[i] = _mm256_add_ps(_mm256_mul_ps(w[i], vd), vm);
    }
  };
  inline Channel channel(int64_t n) const { return {q + n * G * 16, dm + n * G, AHEAD * G}; }
  inline float scale(int64_t) const { return 1.0f; }
};

// int8 per output channel: the dot product runs on the integers, the scale comes after.
struct I8 {
  const int8_t* q;  // [N, K]
  const float* s;   // [N]
  int64_t K;
  struct Channel {
    const int8_t* q;
    int64_t ahead;  // bytes to the same place in the channel AHEAD rows on
    inline void prefetch(int64_t g) const {
      _mm_prefetch(reinterpret_cast<const char*>(q + g * GROUP + PF), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(q + g * GROUP + ahead), _MM_HINT_T0);
    }
    inline void expand(int64_t g, __m256 w[4]) const {
      for (int i = 0; i < 4; ++i)
        w[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + g * GROUP + 8 * i))));
    }
  };
  inline Channel channel(int64_t n) const { return {q + n * K, AHEAD * K}; }
  inline float scale(int64_t n) const { return s[n]; }
};

// Eight weights as float32: bfloat16 is the high half of its float32, so widening one is exact (a
// widening load and a shift) and the products with float32 x are as the float32 reference rounds them.
inline __m256 widen8(const uint16_t* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline __m256 widen8(const float* p) { return _mm256_loadu_ps(p); }

// A plain [N, K] weight: bfloat16 bits (format bf16) or float32 (format fp32, few rows only:
// f32_linear). Nothing to dequantise; the register tiles read each weight once for all their rows
// and prefetch ahead as for the other formats.
template <typename T>
struct Plain {
  const T* w;  // [N, K]
  int64_t K;
  struct Channel {
    const T* w;
    int64_t ahead;  // elements to the same place AHEAD channels on
    inline void prefetch(int64_t g) const {
      _mm_prefetch(reinterpret_cast<const char*>(w + g * GROUP) + PF, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w + g * GROUP + ahead), _MM_HINT_T0);
    }
    inline void expand(int64_t g, __m256 v[4]) const {
      for (int i = 0; i < 4; ++i) v[i] = widen8(w + g * GROUP + 8 * i);
    }
  };
  inline Channel channel(int64_t n) const { return {w + n * K, AHEAD * K}; }
  inline float scale(int64_t) const { return 1.0f; }
};
using BF16 = Plain<uint16_t>;
using F32 = Plain<float>;

// y[r0 .. r0+RB, n0 .. n0+NC]: every weight group is expanded once and used by RB rows; the
// NC * RB accumulators stay in registers, x is read straight into the FMAs.
template <int NC, int RB, typename W>
inline void tile(const W& w, const float* __restrict x, int64_t K, int64_t r0, int64_t n0, float* __restrict y,
                 int64_t N) {
  typename W::Channel ch[NC];
  for (int c = 0; c < NC; ++c) ch[c] = w.channel(n0 + c);
  __m256 acc[NC][RB];
  for (int c = 0; c < NC; ++c)
    for (int r = 0; r < RB; ++r) acc[c][r] = _mm256_setzero_ps();
  const float* xb = x + r0 * K;
  const int64_t G = K / GROUP;
  for (int64_t g = 0; g < G; ++g) {
    const float* xg = xb + g * GROUP;
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) {
      __m256 wv[4];
      ch[c].prefetch(g);
      ch[c].expand(g, wv);
#pragma GCC unroll 8
      for (int r = 0; r < RB; ++r) {
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) acc[c][r] = _mm256_fmadd_ps(wv[i], _mm256_loadu_ps(xg + r * K + 8 * i), acc[c][r]);
      }
    }
  }
  for (int c = 0; c < NC; ++c)
    for (int r = 0; r < RB; ++r) y[(r0 + r) * N + n0 + c] = hsum(acc[c][r]) * w.scale(n0 + c);
}

// sum over groups of m_g * s[g] for one Q4_1 channel (m: the high fp16 half of each dm word),
// eight groups per step: the min term of a one-row product, kept out of its inner loop.
inline float min_term(const uint32_t* dm, const float* s, int64_t G) {
  __m256 acc = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= G; g += 8) {
    const __m256i v = _mm256_srli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dm + g)), 16);
    const __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    acc = _mm256_fmadd_ps(_mm256_cvtph_ps(h), _mm256_loadu_ps(s + g), acc);
  }
  float total = hsum(acc);
  for (; g < G; ++g) total += _cvtsh_ss(static_cast<uint16_t>(dm[g] >> 16)) * s[g];
  return total;
}

// One row against NC Q4_1 channels, factored as llama.cpp does: sum (d q + m) x = d sum(q x) + m sum(x),
// with sum(x) per group computed once per call. Weight expansion dominates a single row (nothing
// shares it), and this drops its multiply and add per weight; several independent channels keep
// the FMA pipes busy. The result is the dequantised product to float32 rounding, not bit-equal to it.
template <int NC>
inline void tile_q4_row(const Q4& w, const float* __restrict x, int64_t n0, float* __restrict y) {
  Q4::Channel ch[NC];
  for (int c = 0; c < NC; ++c) ch[c] = w.channel(n0 + c);
  __m256 acc[NC];
  for (int c = 0; c < NC; ++c) acc[c] = _mm256_setzero_ps();
  for (int64_t g = 0; g < w.G; ++g) {
    const float* xg = x + g * GROUP;
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) {
      __m256 qv[4];
      ch[c].prefetch(g);
      ch[c].nibbles(g, qv);
      __m256 p = _mm256_mul_ps(qv[0], _mm256_loadu_ps(xg));
      for (int i = 1; i < 4; ++i) p = _mm256_fmadd_ps(qv[i], _mm256_loadu_ps(xg + 8 * i), p);
      const __m256 d = _mm256_cvtph_ps(_mm_set1_epi16(static_cast<short>(ch[c].dm[g])));
      acc[c] = _mm256_fmadd_ps(d, p, acc[c]);
    }
  }
  for (int c = 0; c < NC; ++c) y[n0 + c] = hsum(acc[c]) + min_term(ch[c].dm, w.xsum, w.G);
}

// Activations rounded to int8 per row and group of 32: q8[K] in the weights' nibble order per group
// (elements 0..7, 16..23, 8..15, 24..31, see Q4), d[G] = absmax / 127, s[G] = d * sum(q), and
// optionally the rounded values d * q as float32 in natural order.
struct Q8Rows {
  std::vector<int8_t> q;
  std::vector<float> d, s, x;
  int64_t K, G;
};

inline void q8_row(const float* x, int64_t K, int8_t* q, float* d, float* s, float* xr) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t g = 0; g < K / GROUP; ++g) {
    const float* xg = x + g * GROUP;
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(xg + 8 * i);
    const __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                   _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float dg = _mm_cvtss_f32(m) / 127.0f;
    const __m256 id = _mm256_set1_ps(dg > 0 ? 1.0f / dg : 0.0f), vd = _mm256_set1_ps(dg);
    __m256i qi[4];
    for (int i = 0; i < 4; ++i) {
      qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], id));  // round to nearest even
      if (xr) _mm256_storeu_ps(xr + g * GROUP + 8 * i, _mm256_mul_ps(_mm256_cvtepi32_ps(qi[i]), vd));
    }
    const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_hadd_epi32(s4, s4);
    s4 = _mm_hadd_epi32(s4, s4);
    // packs work per 128-bit lane: bytes come out as dwords [q0 q2 q1 q3 | q0 q2 q1 q3] (4 each)
    const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[2]), _mm256_packs_epi32(qi[1], qi[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + g * GROUP),
                        _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    d[g] = dg;
    s[g] = dg * static_cast<float>(_mm_cvtsi128_si32(s4));
  }
}

Q8Rows q8_rows(const float* x, int64_t R, int64_t K, bool rounded) {
  const int64_t G = K / GROUP;
  Q8Rows r{std::vector<int8_t>(R * K), std::vector<float>(R * G), std::vector<float>(R * G),
           std::vector<float>(rounded ? R * K : 0), K, G};
  at::parallel_for(0, R, 16, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      q8_row(x + i * K, K, r.q.data() + i * K, r.d.data() + i * G, r.s.data() + i * G,
             rounded ? r.x.data() + i * K : nullptr);
  });
  return r;
}

// int4q8's one row on AVX-512 VNNI, over `tiles` (cpu_kernels.pack_q4_tiles): 16 output channels
// share each vector, so 64 nibbles take one load, a mask (a shift for the high ones) and one
// vpdpbusd with four activation bytes broadcast; no per-channel reduction and no shuffles. Per
// channel tile and group: 256 bytes of nibbles (byte 4c + i of block j holds channel c's weight at
// position 4j + i of q8_row's order in its low nibble and at 4j + i + 16 in its high one), then the
// 16 channels' fp16 d, then their fp16 m.
constexpr int64_t TILE_CH = 16, TILE_BYTES = 256 + 64;
// bytes ahead that the tile kernels prefetch into L1, and into L2 further on: one core's sequential
// stream from DRAM runs well below its bandwidth on the hardware prefetcher alone (README, "Weight formats")
constexpr int64_t TILE_PF = 2048, TILE_PF_L2 = 16384;
inline void prefetch_tile_group(const uint8_t* p, int64_t bytes = TILE_BYTES) {
  for (int64_t l = 0; l < bytes; l += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(p + TILE_PF + l), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(p + TILE_PF_L2 + l), _MM_HINT_T1);
  }
}
#define IGSERVE_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c")))

bool has_vnni() {
  static const bool yes = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl");
  return yes;
}

IGSERVE_VNNI void q8_tile_row(const uint8_t* tiles, const Q8Rows& x, int64_t t0, int64_t t1, float* y) {
  const __m512i low = _mm512_set1_epi8(15);
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* p = tiles + t * x.G * TILE_BYTES;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t g = 0; g < x.G; ++g, p += TILE_BYTES) {
      prefetch_tile_group(p);
      const int32_t* xg = reinterpret_cast<const int32_t*>(x.q.data() + g * GROUP);
      __m512i sum = _mm512_setzero_si512();
      for (int j = 0; j < 4; ++j) {
        const __m512i v = _mm512_loadu_si512(p + 64 * j);
        sum = _mm512_dpbusd_epi32(sum, _mm512_and_si512(v, low), _mm512_set1_epi32(xg[j]));
        sum = _mm512_dpbusd_epi32(sum, _mm512_and_si512(_mm512_srli_epi16(v, 4), low), _mm512_set1_epi32(xg[j + 4]));
      }
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 256)));
      const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 288)));
      acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d, _mm512_set1_ps(x.d[g])), acc);
      acc = _mm512_fmadd_ps(m, _mm512_set1_ps(x.s[g]), acc);
    }
    _mm512_storeu_ps(y + t * TILE_CH, acc);
  }
}

// int4bf16's few rows on AVX-512 VNNI, over the same tiles. Each row's x, per group of 32, as two
// int8 digits: x ~ e (256 a + b), e = absmax / (127 * 256), a = round(x / 256e), b = round of the
// rest / e; in q8_row's order, so that four consecutive bytes meet one channel's four nibbles of a
// block. A group's dot product with the nibbles is then one integer, S = 256 sum(q a) + sum(q b),
// |S| < 2^24 and so exact in float32 too: the weights are exact and x is kept to 2^-16 of its
// group's largest value, tighter than bf16's 2^-9 of each value. Then sum (d q + m) x = d e S + m s,
// s = e sum(256 a + b), the sum of the same rounded x (with the min term on the rounded x the
// rounding errors meet the centred weights d q + m, not the larger d q). A group with a NaN or an
// infinity gets e = NaN, so it reaches the output. Every row runs the same instructions in the same
// order, so a row's result does not depend on its batch.
struct I8x2Rows {
  std::vector<int8_t> a, b;  // [R, K] each, q8_row's order per group
  std::vector<float> e, s;   // [R, G]: the digits' unit e and the sum of the rounded x per group
  std::vector<int32_t> t;    // [R, G]: sum(256 a + b), so s = e t
  int64_t K, G;
};

IGSERVE_VNNI I8x2Rows i8x2_rows(const float* x, int64_t R, int64_t K) {
  const int64_t G = K / GROUP;
  I8x2Rows r{std::vector<int8_t>(R * K), std::vector<int8_t>(R * K), std::vector<float>(R * G),
             std::vector<float>(R * G), std::vector<int32_t>(R * G), K, G};
  for (int64_t i = 0; i < R * G; ++i) {
    const float* xg = x + i * GROUP;
    const __m512 lo = _mm512_loadu_ps(xg), hi = _mm512_loadu_ps(xg + 16);  // elements 0..15, 16..31
    const float unit = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi))) / 127.0f;
    const bool any = unit > 0;  // false for an all-zero group (and a NaN one: its sum carries the NaN)
    const __m512 vunit = _mm512_set1_ps(unit), ia = _mm512_set1_ps(any ? 1.0f / unit : 0.0f),
                 ib = _mm512_set1_ps(any ? 256.0f / unit : 0.0f);
    __m128i da[2], db[2];
    __m512i total = _mm512_setzero_si512();  // sum of 256 a + b
    for (int h = 0; h < 2; ++h) {
      const __m512 v = h ? hi : lo;
      const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(v, ia));  // round to nearest even, |qa| <= 127
      const __m512 rest = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(qa), vunit, v);
      const __m512i qb = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(rest, ib)),
                                                           _mm512_set1_epi32(127)), _mm512_set1_epi32(-128));
      da[h] = _mm512_cvtepi32_epi8(qa);
      db[h] = _mm512_cvtepi32_epi8(qb);
      total = _mm512_add_epi32(total, _mm512_add_epi32(_mm512_slli_epi32(qa, 8), qb));
    }
    for (int k = 0; k < 2; ++k) {  // q8_row's order: elements 0..7, 16..23, 8..15, 24..31
      int8_t* o = (k ? r.b : r.a).data() + i * GROUP;
      const __m128i* d = k ? db : da;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o), _mm_unpacklo_epi64(d[0], d[1]));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 16), _mm_unpackhi_epi64(d[0], d[1]));
    }
    const bool finite = std::isfinite(_mm512_reduce_add_ps(_mm512_add_ps(lo, hi)));
    r.e[i] = finite ? unit / 256.0f : std::numeric_limits<float>::quiet_NaN();
    r.t[i] = _mm512_reduce_add_epi32(total);
    r.s[i] = r.e[i] * static_cast<float>(r.t[i]);  // |sum| < 2^24: exact
  }
  return r;
}

// RB rows from r0 against tile t.
template <int RB>
IGSERVE_VNNI void q4_tile_i8x2(const uint8_t* tiles, const I8x2Rows& x, int64_t r0, int64_t t, float* y, int64_t N) {
  const __m512i low = _mm512_set1_epi8(15);
  const uint8_t* p = tiles + t * x.G * TILE_BYTES;
  __m512 acc[RB];
  for (int r = 0; r < RB; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < x.G; ++g, p += TILE_BYTES) {
    prefetch_tile_group(p);
    __m512i sa[RB], sb[RB];
    for (int r = 0; r < RB; ++r) sa[r] = sb[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m512i v = _mm512_loadu_si512(p + 64 * j);
      const __m512i wl = _mm512_and_si512(v, low), wh = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
#pragma GCC unroll 4
      for (int r = 0; r < RB; ++r) {
        const int64_t at = (r0 + r) * x.K + g * GROUP;
        const int32_t* xa = reinterpret_cast<const int32_t*>(x.a.data() + at);
        const int32_t* xb = reinterpret_cast<const int32_t*>(x.b.data() + at);
        sa[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(sa[r], wl, _mm512_set1_epi32(xa[j])), wh,
                                    _mm512_set1_epi32(xa[j + 4]));
        sb[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(sb[r], wl, _mm512_set1_epi32(xb[j])), wh,
                                    _mm512_set1_epi32(xb[j + 4]));
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 256)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 288)));
    for (int r = 0; r < RB; ++r) {
      const int64_t i = (r0 + r) * x.G + g;
      const __m512 sum = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(sa[r], 8), sb[r]));  // exact
      acc[r] = _mm512_fmadd_ps(sum, _mm512_mul_ps(d, _mm512_set1_ps(x.e[i])), acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.s[i]), acc[r]);
    }
  }
  for (int r = 0; r < RB; ++r) _mm512_storeu_ps(y + (r0 + r) * N + t * TILE_CH, acc[r]);
}

// All R rows against tiles [t0, t1): per tile, the rows in passes of up to 4 (the tile stays in L1);
// pass(std::integral_constant<int, RB>, r0, t) runs RB rows from r0 against tile t.
template <typename Pass>
inline void tile_passes(int64_t R, int64_t t0, int64_t t1, Pass&& pass) {
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t r0 = 0; r0 < R; r0 += 4) {
      const int64_t n = std::min<int64_t>(4, R - r0);
      if (n == 4) pass(std::integral_constant<int, 4>{}, r0, t);
      else if (n == 3) pass(std::integral_constant<int, 3>{}, r0, t);
      else if (n == 2) pass(std::integral_constant<int, 2>{}, r0, t);
      else pass(std::integral_constant<int, 1>{}, r0, t);
    }
}

IGSERVE_VNNI void q4_tiles_i8x2(const uint8_t* tiles, const I8x2Rows& x, int64_t R, int64_t t0, int64_t t1, float* y,
                                int64_t N) {
  tile_passes(R, t0, t1, [&](auto rb, int64_t r0, int64_t t) { q4_tile_i8x2<decltype(rb)::value>(tiles, x, r0, t, y, N); });
}

// int4bf16's int8 lm_head for few rows on AVX-512 VNNI, over `tiles` (cpu_kernels.pack_i8_tiles): per
// 16-channel tile and group of 32, eight 64-byte blocks, byte 4c + i of block j holding channel c's
// weight + 128 (unsigned, for vpdpbusd) at position 4j + i of q8_row's order, the digits' order. With
// x in two int8 digits as for int4 (i8x2_rows): sum w (256 a + b) = 256 sum(w' a) + sum(w' b) - 128 t
// for w' = w + 128 and t = sum(256 a + b), all in int32 (|256 sum(w' a)| < 2^31), so the only
// rounding is the int32 to float32 of each group's sum. Then y = scale (sum over groups of e S).
constexpr int64_t I8_TILE_BYTES = 8 * 64;

template <int RB>
IGSERVE_VNNI void i8_tile_i8x2(const uint8_t* tiles, const I8x2Rows& x, const float* scales, int64_t r0, int64_t t,
                               float* y, int64_t N) {
  const uint8_t* p = tiles + t * x.G * I8_TILE_BYTES;
  __m512 acc[RB];
  for (int r = 0; r < RB; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < x.G; ++g, p += I8_TILE_BYTES) {
    prefetch_tile_group(p, I8_TILE_BYTES);
    __m512i sa[RB], sb[RB];
    for (int r = 0; r < RB; ++r) sa[r] = sb[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const __m512i v = _mm512_loadu_si512(p + 64 * j);
#pragma GCC unroll 4
      for (int r = 0; r < RB; ++r) {
        const int64_t at = (r0 + r) * x.K + g * GROUP;
        sa[r] = _mm512_dpbusd_epi32(sa[r], v, _mm512_set1_epi32(reinterpret_cast<const int32_t*>(x.a.data() + at)[j]));
        sb[r] = _mm512_dpbusd_epi32(sb[r], v, _mm512_set1_epi32(reinterpret_cast<const int32_t*>(x.b.data() + at)[j]));
      }
    }
    for (int r = 0; r < RB; ++r) {
      const int64_t i = (r0 + r) * x.G + g;
      const __m512i sum = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(sa[r], 8), sb[r]),
                                           _mm512_set1_epi32(128 * x.t[i]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(x.e[i]), acc[r]);
    }
  }
  const __m512 sc = _mm512_loadu_ps(scales + t * TILE_CH);
  for (int r = 0; r < RB; ++r) _mm512_storeu_ps(y + (r0 + r) * N + t * TILE_CH, _mm512_mul_ps(acc[r], sc));
}

IGSERVE_VNNI void i8_tiles_i8x2(const uint8_t* tiles, const I8x2Rows& x, const float* scales, int64_t R, int64_t t0,
                                int64_t t1, float* y, int64_t N) {
  tile_passes(R, t0, t1, [&](auto rb, int64_t r0, int64_t t) {
    i8_tile_i8x2<decltype(rb)::value>(tiles, x, scales, r0, t, y, N);
  });
}

// One row against NC Q4_1 channels with integer dot products:
// sum (dw q + m)(dx p) = dw dx sum(q p) + m dx sum(p).
template <int NC>
inline void tile_q8(const Q4& w, const Q8Rows& x, int64_t n0, float* __restrict y) {
  typename Q4::Channel ch[NC];
  for (int c = 0; c < NC; ++c) ch[c] = w.channel(n0 + c);
  __m256 acc[NC];
  for (int c = 0; c < NC; ++c) acc[c] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(15);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < x.G; ++g) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q.data() + g * GROUP));
    const float xd = x.d[g];
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) {
      ch[c].prefetch(g);
      const __m128i qv = _mm_loadu_si128(reinterpret_cast<const __m128i*>(ch[c].q + g * 16));
      const __m256i wq = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(qv, 4), qv), low);
      const float d = _cvtsh_ss(static_cast<uint16_t>(ch[c].dm[g]));
      const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(wq, xv), ones);
      acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * xd), acc[c]);
    }
  }
  for (int c = 0; c < NC; ++c) y[n0 + c] = hsum(acc[c]) + min_term(ch[c].dm, x.s.data(), x.G);
}

// Tile shapes: channels x rows per pass for several rows, channels per pass for one row.
constexpr int MULTI_NC = 2, MULTI_RB = 4, SINGLE_NC = 8, ROW_NC = 8;
constexpr int64_t EXPAND_ROWS = 4;  // the expanded path from 5 rows (a hand-run A/B: README, "Benchmarks")
// From wide_rows() rows a linear that carries a bfloat16 copy of its weight (format int4bf16) runs
// oneDNN's bf16 matmul instead of the float32 kernels below. The crossover: on AVX-512 BF16
// between 12 and 16 rows (bench/results/kernels*.json); with AMX tiles oneDNN reads the bf16
// weights at memory speed from a few rows on and wins from 5, so nothing is left for the float32
// kernels between the few-row tiles and it (README, "Weight formats").
// IGSERVE_WIDE_ROWS overrides the choice, to measure it.
constexpr int64_t WIDE_ROWS = 14, WIDE_ROWS_AMX = EXPAND_ROWS + 1;
// Up to tile_rows() rows an int4bf16 linear runs its tiles (q4_tile_i8x2; above that, oneDNN). The
// tiles are read once for all rows and take as many dot-product instructions per weight as
// oneDNN's AVX-512 BF16 matmul, on a quarter of its bytes: without AMX they beat it and the float32
// kernels up to 32 rows and more (README, "Weight formats"); AMX's tile matmul overtakes them at
// about 9. IGSERVE_TILE_ROWS overrides it, to measure it.
constexpr int64_t TILE_ROWS = 32, TILE_ROWS_AMX = 9;

// A row threshold chosen by whether the CPU has AMX, unless the environment variable names one
// (at least `floor`).
int64_t rows_for_cpu(const char* env, int64_t amx, int64_t other, int64_t floor) {
  if (const char* v = std::getenv(env)) return std::max<int64_t>(floor, std::atoll(v));
  return __builtin_cpu_supports("amx-bf16") ? amx : other;
}
int64_t tile_rows() {
  static const int64_t rows = rows_for_cpu("IGSERVE_TILE_ROWS", TILE_ROWS_AMX, TILE_ROWS, 0);
  return rows;
}
int64_t wide_from() {
  static const int64_t rows = rows_for_cpu("IGSERVE_WIDE_ROWS", WIDE_ROWS_AMX, WIDE_ROWS, 1);
  return rows;
}

// One row, channels split across threads in blocks of 4: ROW_NC channels per tile call, then one
// at a time; tile(std::integral_constant<int, NC>, n) runs NC channels from n.
template <typename Tile>
void one_row(int64_t N, Tile&& tile) {
  at::parallel_for(0, (N + 3) / 4, 4, [&](int64_t begin, int64_t end) {
    int64_t n = begin * 4;
    const int64_t n1 = std::min(end * 4, N);
    for (; n + ROW_NC <= n1; n += ROW_NC) tile(std::integral_constant<int, ROW_NC>{}, n);
    for (; n < n1; ++n) tile(std::integral_constant<int, 1>{}, n);
  });
}

template <int NC, int RB, typename W>
inline void rows_tail(const W& w, const float* x, int64_t K, int64_t r, int64_t rest, int64_t n, float* y, int64_t N) {
  if constexpr (RB > 1) {
    if (rest == RB - 1) return tile<NC, RB - 1>(w, x, K, r, n, y, N);
    return rows_tail<NC, RB - 1>(w, x, K, r, rest, n, y, N);
  }
}

// Many rows: y[r0 .. r0+RB, n0 .. n0+NC] from weights already expanded to float32 (channel c of the
// tile at wb + c * K). Each x vector is loaded once for NC channels and each weight vector once for
// RB rows, so the FMAs, not the expansion or the loads, bound it. Per (row, channel) the products
// accumulate in the order tile() uses, so both give the same bits.
template <int NC, int RB, typename W>
inline void tile_expanded(const W& w, const float* __restrict wb, const float* __restrict x, int64_t K, int64_t r0,
                          int64_t n0, float* __restrict y, int64_t N) {
  __m256 acc[NC][RB];
  for (int c = 0; c < NC; ++c)
    for (int r = 0; r < RB; ++r) acc[c][r] = _mm256_setzero_ps();
  const float* xb = x + r0 * K;
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[NC];
    for (int c = 0; c < NC; ++c) wv[c] = _mm256_loadu_ps(wb + c * K + k);
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
      const __m256 xv = _mm256_loadu_ps(xb + r * K + k);
      for (int c = 0; c < NC; ++c) acc[c][r] = _mm256_fmadd_ps(wv[c], xv, acc[c][r]);
    }
  }
  for (int c = 0; c < NC; ++c)
    for (int r = 0; r < RB; ++r) y[(r0 + r) * N + n0 + c] = hsum(acc[c][r]) * w.scale(n0 + c);
}

constexpr int EXP_NC = 3, EXP_RB = 4, EXP_BLOCK = 12;  // tile; channels expanded at a time (L1/L2-resident)

template <int NC, int RB, typename W>
inline void expanded_rows(const W& w, const float* wb, const float* x, int64_t K, int64_t R, int64_t n0, float* y,
                          int64_t N) {
  int64_t r = 0;
  for (; r + RB <= R; r += RB) tile_expanded<NC, RB>(w, wb, x, K, r, n0, y, N);
  const int64_t rest = R - r;
  if (rest == 3) tile_expanded<NC, 3>(w, wb, x, K, r, n0, y, N);
  if (rest == 2) tile_expanded<NC, 2>(w, wb, x, K, r, n0, y, N);
  if (rest == 1) tile_expanded<NC, 1>(w, wb, x, K, r, n0, y, N);
}

// Channels [n0, n1) for R > EXPAND_ROWS rows: EXP_BLOCK channels at a time are expanded once into
// a float32 buffer, then every row runs against it.
template <typename W>
void channels_expanded(const W& w, const float* x, int64_t R, int64_t K, float* y, int64_t N, int64_t n0,
                       int64_t n1) {
  std::vector<float> buf(EXP_BLOCK * K);
  for (int64_t b = n0; b < n1; b += EXP_BLOCK) {
    const int64_t nb = std::min<int64_t>(EXP_BLOCK, n1 - b);
    for (int64_t c = 0; c < nb; ++c) {
      const auto ch = w.channel(b + c);
      for (int64_t g = 0; g < K / GROUP; ++g) {
        __m256 wv[4];
        ch.expand(g, wv);
        for (int i = 0; i < 4; ++i) _mm256_storeu_ps(buf.data() + c * K + g * GROUP + 8 * i, wv[i]);
      }
    }
    int64_t c = 0;
    for (; c + EXP_NC <= nb; c += EXP_NC) expanded_rows<EXP_NC, EXP_RB>(w, buf.data() + c * K, x, K, R, b + c, y, N);
    for (; c < nb; ++c) expanded_rows<1, EXP_RB>(w, buf.data() + c * K, x, K, R, b + c, y, N);
  }
}

// Channels [n0, n1) for all R rows: the expanded path from EXPAND_ROWS + 1 rows, else tiles of
// MULTI_NC channels x MULTI_RB rows, then the remaining rows; a single row takes SINGLE_NC
// channels per pass.
template <typename W>
void channels(const W& w, const float* x, int64_t R, int64_t K, float* y, int64_t N, int64_t n0, int64_t n1) {
  int64_t n = n0;
  if (R > EXPAND_ROWS) return channels_expanded(w, x, R, K, y, N, n0, n1);
  if (R == 1) {
    for (; n + SINGLE_NC <= n1; n += SINGLE_NC) tile<SINGLE_NC, 1>(w, x, K, 0, n, y, N);
    for (; n < n1; ++n) tile<1, 1>(w, x, K, 0, n, y, N);
    return;
  }
  for (; n + MULTI_NC <= n1; n += MULTI_NC) {
    int64_t r = 0;
    for (; r + MULTI_RB <= R; r += MULTI_RB) tile<MULTI_NC, MULTI_RB>(w, x, K, r, n, y, N);
    if (r < R) rows_tail<MULTI_NC, MULTI_RB>(w, x, K, r, R - r, n, y, N);
  }
  for (; n < n1; ++n)
    for (int64_t r = 0; r < R; ++r) tile<1, 1>(w, x, K, r, n, y, N);
}

void check_x(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) == K,
              "x must be a contiguous float32 [R, ", K, "] tensor");
  TORCH_CHECK(K % GROUP == 0, "in_features must be a multiple of 32");
}

// Channels [0, N) split across threads in blocks of 4 (whole tiles).
template <typename W>
void run(const W& w, const float* x, int64_t R, int64_t K, float* y, int64_t N) {
  const int64_t blocks = (N + 3) / 4;
  at::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
    channels(w, x, R, K, y, N, begin * 4, std::min(end * 4, N));
  });
}

// x [R, K] bf16 @ W^T for a bf16 W: oneDNN's matmul on a weight reordered once into its blocked
// layout (mkldnn::_reorder_linear_weight, as torch.compile's CPU freezing does); plain at::linear
// for an unreordered W, which re-lays the weight out on every call (slower than int4 at 16 rows).
at::Tensor wide_linear(const at::Tensor& x, const at::Tensor& w) {
  if (!w.is_mkldnn()) return at::linear(x, w);
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, w, c10::IValue(), std::string("none"), c10::List<std::optional<at::Scalar>>(),
                          c10::IValue()};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// x @ wide^T in bf16 for calls of wide_from() rows and more on a linear that has a bf16 copy; else none.
std::optional<at::Tensor> wide_or_none(const at::Tensor& x, const std::optional<at::Tensor>& wide, int64_t N,
                                       int64_t K) {
  if (!wide || !wide->defined() || x.size(0) < wide_from()) return std::nullopt;
  TORCH_CHECK(wide->scalar_type() == at::kBFloat16 && wide->size(0) == N && wide->size(1) == K,
              "wide must be the bfloat16 weight [N, K]");
  return wide_linear(x.to(at::kBFloat16), *wide).to(at::kFloat);
}

// Whether a call of x's rows runs int4bf16's tiles (given, up to tile_rows() rows, AVX-512 VNNI).
bool on_tiles(const std::optional<at::Tensor>& tiles, const at::Tensor& x) {
  return tiles && tiles->defined() && x.size(0) <= tile_rows() && has_vnni();
}

}  // namespace

namespace igserve {

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& dm, bool q8,
                     const std::optional<at::Tensor>& wide, const std::optional<at::Tensor>& tiles_) {
  const int64_t N = qs.size(0), K = qs.size(1) * 2;
  check_x(x, K);
  const bool row_tiles = !q8 && on_tiles(tiles_, x);
  if (!row_tiles)
    if (auto y = wide_or_none(x, wide, N, K)) return *y;
  TORCH_CHECK(qs.scalar_type() == at::kByte && qs.is_contiguous(), "qs must be contiguous uint8 [N, K/2]");
  TORCH_CHECK(dm.scalar_type() == at::kInt && dm.is_contiguous() && dm.numel() == N * (K / GROUP),
              "dm must be contiguous int32 [N, K/32] (fp16 d, m pairs)");
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  const Q4 w{qs.data_ptr<uint8_t>(), reinterpret_cast<const uint32_t*>(dm.data_ptr<int32_t>()), K / GROUP};
  const int64_t R = x.size(0);
  float* yp = y.data_ptr<float>();
  const uint8_t* tp = nullptr;  // the tiles, where given
  if (tiles_ && tiles_->defined()) {
    TORCH_CHECK(tiles_->scalar_type() == at::kByte && tiles_->is_contiguous() && N % TILE_CH == 0 &&
                    tiles_->numel() == N / TILE_CH * w.G * TILE_BYTES,
                "tiles must be contiguous uint8 [N/16, K/32, 320]");
    tp = tiles_->data_ptr<uint8_t>();
  }
  // int4bf16's few rows: two-digit int8 dot products on the tiles where the CPU has VNNI
  if (row_tiles) {
    const I8x2Rows xd = i8x2_rows(x.data_ptr<float>(), R, K);
    at::parallel_for(0, N / TILE_CH, 2, [&](int64_t b, int64_t e) { q4_tiles_i8x2(tp, xd, R, b, e, yp, N); });
  } else if (!q8 && R == 1) {
    const float* xp = x.data_ptr<float>();
    std::vector<float> xsum(K / GROUP);
    for (int64_t g = 0; g < K / GROUP; ++g) {
      __m256 v = _mm256_loadu_ps(xp + g * GROUP);
      for (int i = 1; i < 4; ++i) v = _mm256_add_ps(v, _mm256_loadu_ps(xp + g * GROUP + 8 * i));
      xsum[g] = hsum(v);
    }
    Q4 wr = w;
    wr.xsum = xsum.data();
    one_row(N, [&](auto nc, int64_t n) { tile_q4_row<decltype(nc)::value>(wr, xp, n, yp); });
  } else if (!q8) {
    run(w, x.data_ptr<float>(), R, K, yp, N);
  } else if (R == 1 && tp && has_vnni()) {
    const Q8Rows xq = q8_rows(x.data_ptr<float>(), 1, K, false);
    at::parallel_for(0, N / TILE_CH, 4, [&](int64_t b, int64_t e) { q8_tile_row(tp, xq, b, e, yp); });
  } else if (R == 1) {
    const Q8Rows xq = q8_rows(x.data_ptr<float>(), 1, K, false);
    one_row(N, [&](auto nc, int64_t n) { tile_q8<decltype(nc)::value>(w, xq, n, yp); });
  } else {
    const Q8Rows xq = q8_rows(x.data_ptr<float>(), R, K, true);
    run(w, xq.x.data(), R, K, yp, N);
  }
  return y;
}

at::Tensor i8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                     const std::optional<at::Tensor>& wide, const std::optional<at::Tensor>& tiles) {
  const int64_t N = q.size(0), K = q.size(1);
  check_x(x, K);
  const bool row_tiles = on_tiles(tiles, x);
  if (!row_tiles)
    if (auto y = wide_or_none(x, wide, N, K)) return *y;
  TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous(), "q must be contiguous int8 [N, K]");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == N,
              "scales must be contiguous float32 [N]");
  const int64_t R = x.size(0);
  at::Tensor y = at::empty({R, N}, x.options());
  if (row_tiles) {  // int4bf16's lm_head: few rows on the VNNI tiles
    TORCH_CHECK(tiles->scalar_type() == at::kByte && tiles->is_contiguous() && N % TILE_CH == 0 &&
                    tiles->numel() == N * K,
                "tiles must be contiguous uint8 [N/16, K/32, 512]");
    const I8x2Rows xd = i8x2_rows(x.data_ptr<float>(), R, K);
    const uint8_t* tp = tiles->data_ptr<uint8_t>();
    const float* sp = scales.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    at::parallel_for(0, N / TILE_CH, 2, [&](int64_t b, int64_t e) { i8_tiles_i8x2(tp, xd, sp, R, b, e, yp, N); });
    return y;
  }
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const I8 w{qp, sp, K};
  run(w, xp, R, K, yp, N);
  return y;
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& wide) {
  const int64_t N = w.size(0), K = w.size(1);
  check_x(x, K);
  if (auto y = wide_or_none(x, wide, N, K)) return *y;
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.is_contiguous() && w.dim() == 2, "w must be contiguous bfloat16 [N, K]");
  const int64_t R = x.size(0);
  at::Tensor y = at::empty({R, N}, x.options());
  const BF16 wb{reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), K};
  run(wb, x.data_ptr<float>(), R, K, y.data_ptr<float>(), N);
  return y;
}

at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& w) {
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 2, "w must be a float32 [N, K] weight");
  // from EXPAND_ROWS + 1 rows each weight is read often enough that BLAS's blocking wins
  if (x.dim() != 2 || x.size(0) > EXPAND_ROWS || x.size(1) != K || K % GROUP || x.scalar_type() != at::kFloat ||
      !x.is_contiguous() || !w.is_contiguous())
    return at::linear(x, w);
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  run(F32{w.data_ptr<float>(), K}, x.data_ptr<float>(), x.size(0), K, y.data_ptr<float>(), N);
  return y;
}

}  // namespace igserve

int64_t wide_rows() { return wide_from(); }
int64_t bf16_tile_rows() { return tile_rows(); }
bool vnni_tiles() { return has_vnni(); }

TORCH_LIBRARY(igserve, lib) {
  lib.def("q4_linear(Tensor x, Tensor qs, Tensor dm, bool q8=False, Tensor? wide=None, Tensor? tiles=None) -> Tensor");
  lib.def("wide_rows() -> int", wide_rows);
  lib.def("tile_rows() -> int", bf16_tile_rows);
  lib.def("vnni_tiles() -> bool", vnni_tiles);
  lib.def("i8_linear(Tensor x, Tensor q, Tensor scales, Tensor? wide=None, Tensor? tiles=None) -> Tensor");
  lib.def("bf16_linear(Tensor x, Tensor w, Tensor? wide=None) -> Tensor");
  lib.def("f32_linear(Tensor x, Tensor w) -> Tensor");
}

TORCH_LIBRARY_IMPL(igserve, CPU, lib) {
  lib.impl("q4_linear", igserve::q4_linear);
  lib.impl("i8_linear", igserve::i8_linear);
  lib.impl("bf16_linear", igserve::bf16_linear);
  lib.impl("f32_linear", igserve::f32_linear);
}

// A weight reordered for oneDNN (int4bf16's, bf16's) is an MkldnnCPU tensor, which routes the call here.
TORCH_LIBRARY_IMPL(igserve, MkldnnCPU, lib) {
  lib.impl("q4_linear", igserve::q4_linear);
  lib.impl("i8_linear", igserve::i8_linear);
  lib.impl("bf16_linear", igserve::bf16_linear);
}
