// Causal attention of one sequence's prompt chunk over its keys, on CPU (paged_attention's prefill
// spans, yutu/engine/attention.py).
//
// The chunk's n query rows sit at the last n of the m key positions (a cached prefix, then the
// chunk): row a attends keys 0 .. m-n+a, or with a sliding window W > 0 the last W of them,
// m-n+a-W+1 .. m-n+a (a tile's scores and weighted values start at its first row's first key). torch's SDPA is the reference (and what runs with kernel
// "torch"); its CPU flash kernel is written for wide heads, and at the small head dims of small
// models (32 here) spends most of its time outside the products. Here, per KV head and tile of
// kTile query positions (their G query heads together: 4 rows share every key and value read):
//   pass 1  scores[r, j] = scale * q[r] . k[j]   a register of keys at a time, keys transposed to float32
//   softmax over j <= the row's last key       exps in their own loop, which vectorizes
//                                              (scores first capped, c * tanh(score / c), with a
//                                              softcap c > 0: Gemma 2's, as transformers caps them)
//   pass 2  out[r] = sum_j p[r, j] v[j] / sum_j p[r, j]   in float32, rounded once to q's dtype
// Keys and values are converted to float32 once per call (transposed keys, padded to a register).
// A register is 16 floats with AVX-512, 8 without (the portable build: a 16-float vector type
// lowered to AVX2 pairs ran this kernel 12-18x slower, slower than SDPA).
// bfloat16 inputs on a CPU with AVX512-BF16 (compiled for it: -march=native) skip the conversion:
// both passes multiply bfloat16 pairs into float32 sums with vdpbf16ps (32 products a register,
// against 16 FMAs), keys and values packed as pairs of neighbours (two dims of a key in pass 1, two
// keys of a dim in pass 2) and the probabilities rounded to bfloat16 for pass 2 (as flash attention
// kernels round them for their second product). Pass 1 is as exact as the float32 path (a product
// of two bfloat16 is exact in float32); pass 2's weights carry bfloat16's rounding (2^-9 relative),
// below the output's own.
// A two-pass softmax, not an online one: a tile's scores (kTile * G rows of up to m floats) stay
// in the thread's cache, and no running maximum is rescaled per block of keys.
//
// Shapes: q (n, kvh * G, hd); k, v (m, kvh, hd) with m >= n; unit stride in hd.
// Returns (n, kvh * G, hd) in q's dtype.
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;  // floats in a vector register
#else
constexpr int64_t kLanes = 8;
#endif
constexpr int64_t kKeys = kLanes;  // keys per block of pass 1 (one register of float32)
constexpr int64_t kTile = 16;  // query positions per work item
constexpr int64_t kMaxHeadDim = 256;

inline int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

// A register of floats as one value (GCC's vector extension); a float times it is broadcast.
// Loads and stores through memcpy: no alignment assumed.
typedef float fvec __attribute__((vector_size(kLanes * 4)));
inline fvec loadv(const float* p) {
  fvec v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}
inline void storev(float* p, fvec v) { __builtin_memcpy(p, &v, sizeof v); }

// 32 bfloat16 (raw bits) as one value, and a pair of them (element 2i low, 2i + 1 high).
typedef int32_t i32x16 __attribute__((vector_size(64)));
inline i32x16 load32bf(const uint16_t* p) {
  i32x16 v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}
inline uint32_t pair_at(const uint16_t* p) {
  uint32_t v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

#if defined(__AVX512BF16__)
constexpr bool kBf16Dot = true;
static_assert(kLanes == 16, "AVX512-BF16 comes with AVX-512");
// acc[i] += a.lo * b[2i] + a.hi * b[2i + 1], the pair a broadcast (vdpbf16ps).
inline fvec dot_pairs(fvec acc, uint32_t a, i32x16 b) {
  return (fvec)_mm512_dpbf16_ps((__m512)acc, (__m512bh)_mm512_set1_epi32(static_cast<int>(a)), (__m512bh)b);
}
// 16 floats rounded to bfloat16 (to nearest even).
inline void round16(const float* src, uint16_t* dst) {
  const __m256bh r = _mm512_cvtneps_pbh((__m512)loadv(src));
  __builtin_memcpy(dst, &r, sizeof r);
}
#else
constexpr bool kBf16Dot = false;  // attend<..., true> is never instantiated: these never run
inline fvec dot_pairs(fvec acc, uint32_t, i32x16) { return acc; }
inline void round16(const float*, uint16_t*) {}
#endif

// HD: the head dim known at compile time, 0: hd at run time. Dot: T is bfloat16, HD a multiple of
// 16, and both passes run on bfloat16 pairs (vdpbf16ps; see the top of the file).
template <typename T, int64_t HD, bool Dot = false>
void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, float scale,
            float softcap, int64_t window) {
  static_assert(!Dot || (kBf16Dot && std::is_same_v<T, at::BFloat16> && HD > 0 && HD % 16 == 0));
  const int64_t n = q.size(0), heads = q.size(1), m = k.size(0), kvh = k.size(1);
  const int64_t groups = heads / kvh, hd = HD > 0 ? HD : q.size(2);
  const int64_t m_pad = round_up(m, kKeys), offset = m - n;  // row a's last key: offset + a
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t q0 = q.stride(0), q1 = q.stride(1), k0 = k.stride(0), k1 = k.stride(1);
  const int64_t v0 = v.stride(0), v1 = v.stride(1), o0 = out.stride(0), o1 = out.stride(1);

  // Keys transposed in blocks of kKeys, kt[h][j / kKeys][d][j % kKeys] (a block's hd x kKeys floats;
  // padded with zero keys to m_pad), values vf[h][j][d], float32. Dot: the same blocks of bfloat16
  // with a key's dims in pairs, kb[h][j / 16][d / 2][j % 16][d % 2], and values with neighbouring
  // keys in pairs, vb[h][j / 2][d][j % 2] (padded with a zero key to an even count).
  const int64_t m_even = round_up(m, 2);
  std::vector<float> kt(Dot ? 0 : kvh * hd * m_pad, 0.f), vf(Dot ? 0 : kvh * m * hd);
  std::vector<uint16_t> kb(Dot ? kvh * hd * m_pad : 0, 0), vb(Dot ? kvh * m_even * hd : 0, 0);
  at::parallel_for(0, kvh * m, 64, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / m, j = item % m;
      const T* kr = kp + j * k0 + h * k1;
      const T* vr = vp + j * v0 + h * v1;
      if constexpr (Dot) {
        uint16_t* kbj = kb.data() + h * hd * m_pad + (j / kKeys) * hd * kKeys + (j % kKeys) * 2;
        uint16_t* vbj = vb.data() + h * m_even * hd + (j / 2) * hd * 2 + j % 2;
        for (int64_t d = 0; d < hd; ++d) {
          kbj[(d / 2) * 2 * kKeys + d % 2] = kr[d].x;
          vbj[d * 2] = vr[d].x;
        }
      } else {
        float* ktj = kt.data() + h * hd * m_pad + (j / kKeys) * hd * kKeys + j % kKeys;
        float* vfr = vf.data() + (h * m + j) * hd;
        for (int64_t d = 0; d < hd; ++d) {
          ktj[d * kKeys] = static_cast<float>(kr[d]);
          vfr[d] = static_cast<float>(vr[d]);
        }
      }
    }
  });

  // Work items: (KV head, tile), tiles taken from both ends in turn, so that any contiguous run of
  // items (what a thread gets) mixes the short early tiles with the long late ones.
  const int64_t tiles = (n + kTile - 1) / kTile;
  at::parallel_for(0, kvh * tiles, 1, [&](int64_t begin, int64_t end) {
    const int64_t rows_max = kTile * groups;
    std::vector<float> qf(rows_max * hd), scores(rows_max * m_pad);
    std::vector<uint16_t> qb(Dot ? rows_max * hd : 0), pb(Dot ? rows_max * m_pad : 0);  // Dot: bfloat16
    std::vector<int64_t> keys(rows_max), firsts(rows_max);  // each row's keys: firsts[r] .. keys[r]-1
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / tiles, turn = item % tiles;
      const int64_t tile = turn % 2 == 0 ? turn / 2 : tiles - 1 - turn / 2;
      const int64_t a0 = tile * kTile, a1 = std::min(n, a0 + kTile);
      const int64_t rows = (a1 - a0) * groups;
      const int64_t span = offset + a1;  // keys any row of the tile sees
      const int64_t span_pad = round_up(span, kKeys);
      const float* kth = Dot ? nullptr : kt.data() + h * hd * m_pad;
      const float* vfh = Dot ? nullptr : vf.data() + h * m * hd;
      for (int64_t r = 0; r < rows; ++r) {  // row r: position a0 + r / G, query head h * G + r % G
        const T* qr = qp + (a0 + r / groups) * q0 + (h * groups + r % groups) * q1;
        if constexpr (Dot) {
          for (int64_t d = 0; d < hd; ++d) qb[r * hd + d] = qr[d].x;
        } else {
          for (int64_t d = 0; d < hd; ++d) qf[r * hd + d] = static_cast<float>(qr[d]) * scale;
        }
        keys[r] = offset + a0 + r / groups + 1;
        firsts[r] = window > 0 ? std::max<int64_t>(0, keys[r] - window) : 0;
      }
      const int64_t start = firsts[0] / kKeys * kKeys;  // the tile's first block of keys any row sees
      // Pass 1: scores, four rows at a time against kKeys keys (four accumulators in registers).
      for (int64_t r = 0; r < rows; r += 4) {
        const int64_t nr = std::min<int64_t>(4, rows - r);
        const float* q0r = qf.data() + r * hd;
        const float* q1r = qf.data() + (r + std::min<int64_t>(1, nr - 1)) * hd;
        const float* q2r = qf.data() + (r + std::min<int64_t>(2, nr - 1)) * hd;
        const float* q3r = qf.data() + (r + std::min<int64_t>(3, nr - 1)) * hd;
        float* s_rows[4];
        const uint16_t* qrow[4] = {};  // Dot: the rows in bfloat16
        for (int64_t i = 0; i < 4; ++i) {
          s_rows[i] = scores.data() + (r + std::min(i, nr - 1)) * m_pad;
          if constexpr (Dot) qrow[i] = qb.data() + (r + std::min(i, nr - 1)) * hd;
        }
        for (int64_t j = start; j < span_pad; j += kKeys) {
          fvec s0 = {}, s1 = {}, s2 = {}, s3 = {};
          if constexpr (Dot) {
            const uint16_t* kbb = kb.data() + h * hd * m_pad + j * hd;  // the block: hd / 2 pairs x 16
            for (int64_t d = 0; d < HD; d += 2) {
              const i32x16 kd = load32bf(kbb + d * kKeys);
              s0 = dot_pairs(s0, pair_at(qrow[0] + d), kd);
              s1 = dot_pairs(s1, pair_at(qrow[1] + d), kd);
              s2 = dot_pairs(s2, pair_at(qrow[2] + d), kd);
              s3 = dot_pairs(s3, pair_at(qrow[3] + d), kd);
            }
            s0 *= scale;
            s1 *= scale;
            s2 *= scale;
            s3 *= scale;
          } else {
            const float* kblock = kth + j * hd;  // the block's keys: hd rows of kKeys
            for (int64_t d = 0; d < hd; ++d) {
              const fvec kd = loadv(kblock + d * kKeys);
              s0 += q0r[d] * kd;
              s1 += q1r[d] * kd;
              s2 += q2r[d] * kd;
              s3 += q3r[d] * kd;
            }
          }
          storev(s_rows[3] + j, s3);  // duplicates of the last row (nr < 4) write the same values
          storev(s_rows[2] + j, s2);
          storev(s_rows[1] + j, s1);
          storev(s_rows[0] + j, s0);
        }
      }
      // Softmax of each row over its keys; the keys past them (up to the tile's span) weigh 0.
      std::vector<float> inv(rows);
      for (int64_t r = 0; r < rows; ++r) {
        float* sr = scores.data() + r * m_pad;
        const int64_t kr = keys[r], k0r = firsts[r];
        if (softcap > 0.f) softcap_scores(sr + k0r, kr - k0r, softcap);
        const float top = *std::max_element(sr + k0r, sr + kr);
        for (int64_t j = k0r; j < kr; ++j) sr[j] = std::exp(sr[j] - top);
        float sum = 0.f;
        for (int64_t j = k0r; j < kr; ++j) sum += sr[j];
        std::fill(sr, sr + k0r, 0.f);  // before the window (never computed past the tile's start)
        std::fill(sr + kr, sr + span_pad, 0.f);
        inv[r] = 1.f / sum;
        if constexpr (Dot) {
          for (int64_t j = 0; j < span_pad; j += kKeys) round16(sr + j, pb.data() + r * m_pad + j);
        }
      }
      // Pass 2: weighted values, four rows at a time sharing each value row.
      for (int64_t r = 0; r < rows; r += 4) {
        const int64_t nr = std::min<int64_t>(4, rows - r);
        int64_t last = 0;
        for (int64_t i = 0; i < nr; ++i) last = std::max(last, keys[r + i]);
        const int64_t first = firsts[r] / 2 * 2;  // the four rows' first key (even: Dot takes pairs)
        float o[4][HD > 0 ? HD : kMaxHeadDim] = {};
        const float* p[4];
        for (int64_t i = 0; i < 4; ++i) p[i] = scores.data() + (r + std::min(i, nr - 1)) * m_pad;
        if constexpr (Dot) {  // as below, two keys a product: pairs of weights, pairs of value rows
          constexpr int64_t kV = HD / kLanes;
          fvec a[4][kV] = {};
          const uint16_t* pw[4];
          for (int64_t i = 0; i < 4; ++i) pw[i] = pb.data() + (r + std::min(i, nr - 1)) * m_pad;
          const uint16_t* vbh = vb.data() + h * m_even * HD;
          for (int64_t j = first; j < last; j += 2) {  // a key past `last` weighs 0 (a zero key at m)
            const uint16_t* vj = vbh + j * HD;  // keys j, j + 1: HD pairs
            i32x16 vv[kV];
            for (int64_t c = 0; c < kV; ++c) vv[c] = load32bf(vj + 2 * kLanes * c);
            for (int64_t i = 0; i < 4; ++i) {
              const uint32_t w = pair_at(pw[i] + j);
              for (int64_t c = 0; c < kV; ++c) a[i][c] = dot_pairs(a[i][c], w, vv[c]);
            }
          }
          for (int64_t i = 0; i < 4; ++i)
            for (int64_t c = 0; c < kV; ++c) storev(o[i] + kLanes * c, a[i][c]);
        } else if constexpr (HD > 0 && HD % kLanes == 0) {  // the row sums in registers, kLanes of hd each
          constexpr int64_t kV = HD / kLanes;
          fvec a[4][kV] = {};
          for (int64_t j = first; j < last; ++j) {
            const float* vj = vfh + j * HD;
            fvec vv[kV];
            for (int64_t c = 0; c < kV; ++c) vv[c] = loadv(vj + kLanes * c);
            for (int64_t i = 0; i < 4; ++i) {
              const float w = p[i][j];
              for (int64_t c = 0; c < kV; ++c) a[i][c] += w * vv[c];
            }
          }
          for (int64_t i = 0; i < 4; ++i)
            for (int64_t c = 0; c < kV; ++c) storev(o[i] + kLanes * c, a[i][c]);
        } else {
          for (int64_t j = first; j < last; ++j) {
            const float* vj = vfh + j * hd;
            for (int64_t i = 0; i < 4; ++i) {
              const float w = p[i][j];
              for (int64_t d = 0; d < hd; ++d) o[i][d] += w * vj[d];
            }
          }
        }
        for (int64_t i = 0; i < nr; ++i) {
          const int64_t row = r + i;
          T* out_r = op + (a0 + row / groups) * o0 + (h * groups + row % groups) * o1;
          for (int64_t d = 0; d < hd; ++d) out_r[d] = static_cast<T>(o[i][d] * inv[row]);
        }
      }
    }
  });
}

// A head dim known at compile time: bfloat16 pairs where the CPU multiplies them (Dot).
template <typename T, int64_t HD>
void attend_hd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, float scale,
               float softcap, int64_t window) {
  if constexpr (kBf16Dot && std::is_same_v<T, at::BFloat16>) {
    attend<T, HD, true>(q, k, v, out, scale, softcap, window);
  } else {
    attend<T, HD>(q, k, v, out, scale, softcap, window);
  }
}

}  // namespace

bool prefill_bf16_pairs() { return kBf16Dot; }

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                             double softcap, int64_t window) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be 3-D (n, heads, hd), (m, kvh, hd)");
  TORCH_CHECK(k.sizes() == v.sizes(), "k and v differ in shape: ", k.sizes(), " ", v.sizes());
  TORCH_CHECK(q.size(2) == k.size(2), "q ", q.sizes(), " and k ", k.sizes(), " differ in head dim");
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, "query heads (", q.size(1),
              ") must be a multiple of KV heads (", k.size(1), ")");
  TORCH_CHECK(q.size(0) <= k.size(0), "more queries (", q.size(0), ") than keys (", k.size(0), ")");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(), "q, k, v differ in dtype");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "the head dim must have unit stride");
  TORCH_CHECK(q.size(2) <= kMaxHeadDim, "head dim must be at most ", kMaxHeadDim, ", got ", q.size(2));
  at::Tensor out = at::empty(q.sizes(), q.options());
  if (q.size(0) == 0) return out;
  TORCH_CHECK(softcap >= 0, "softcap must be >= 0 (0: none), got ", softcap);
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: none), got ", window);
  const float s = static_cast<float>(scale), c = static_cast<float>(softcap);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "prefill_attention", [&] {
    switch (q.size(2)) {
      case 32: attend_hd<scalar_t, 32>(q, k, v, out, s, c, window); break;
      case 64: attend_hd<scalar_t, 64>(q, k, v, out, s, c, window); break;
      case 128: attend_hd<scalar_t, 128>(q, k, v, out, s, c, window); break;
      default: attend<scalar_t, 0>(q, k, v, out, s, c, window);
    }
  });
  return out;
}
