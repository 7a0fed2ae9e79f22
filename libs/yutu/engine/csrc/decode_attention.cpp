// Decode attention over the dense decode cache (yutu/engine/decode_cache.py) on CPU.
//
// The dense path's one call per layer: every slot has one query token whose G query heads per KV
// head attend that head's keys `first .. last-1`. torch's SDPA computes the same (the reference,
// DenseStep.attend with kernel "torch"), but its CPU flash kernel spends most of a decode's time
// converting bfloat16 in small tiles (measured in loadtests/bench_engine.py). Here each (slot, KV
// head) is two passes over its keys, in float32, with the result rounded to the cache's dtype once:
//   scores[g, j] = scale * q[g] . k[j];   p = softmax_j(scores[g]);   out[g] = sum_j p[g, j] v[j]
// With a softcap c > 0 (Gemma 2) each score is capped first, as transformers' eager attention caps
// it: c * tanh(score / c).
// Keys are read once per pass for all G query heads; a slot's keys are contiguous, so the reads
// stream (the paged layout, one 4 KiB block of a layer per page, measured 2.4-3.5x slower).
//
// Shapes: q (n, kvh, G, hd); k, v (n, kvh, span, hd), unit stride in hd (views of the slot buffers);
// first, last (n,) int64. Returns (n, kvh, G, hd) in q's dtype.
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kMaxHeadDim = 512;

// a . b over hd floats: a plain loop, which -ffast-math lets the compiler vectorize (reassociated).
inline float dot(const float* a, const float* b, int64_t hd) {
  float sum = 0.f;
  for (int64_t d = 0; d < hd; ++d) sum += a[d] * b[d];
  return sum;
}

template <typename T, int64_t HD>  // HD: the head dim known at compile time, 0: hd at run time
void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const int64_t* first,
            const int64_t* last, at::Tensor& out, float scale, float softcap) {
  const int64_t n = q.size(0), kvh = q.size(1), groups = q.size(2);
  const int64_t hd = HD > 0 ? HD : q.size(3);
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t q0 = q.stride(0), q1 = q.stride(1), q2 = q.stride(2);
  const int64_t k0 = k.stride(0), k1 = k.stride(1), k2 = k.stride(2);
  const int64_t v0 = v.stride(0), v1 = v.stride(1), v2 = v.stride(2);
  const int64_t o0 = out.stride(0), o1 = out.stride(1), o2 = out.stride(2);
  at::parallel_for(0, n * kvh, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(groups * hd), acc(groups * hd), scores, inv(groups);
    alignas(64) float row[HD > 0 ? HD : kMaxHeadDim];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t slot = item / kvh, head = item % kvh;
      const int64_t keys = last[slot] - first[slot];
      const T* q_head = qp + slot * q0 + head * q1;
      const T* k_row = kp + slot * k0 + head * k1 + first[slot] * k2;
      const T* v_row = vp + slot * v0 + head * v1 + first[slot] * v2;
      for (int64_t g = 0; g < groups; ++g)
        for (int64_t d = 0; d < hd; ++d) qf[g * hd + d] = static_cast<float>(q_head[g * q2 + d]) * scale;
      // Pass 1: scores, and their softmax per query head.
      scores.resize(groups * keys);
      float* sp = scores.data();
      const float* qfp = qf.data();
      for (int64_t j = 0; j < keys; ++j, k_row += k2) {
        for (int64_t d = 0; d < hd; ++d) row[d] = static_cast<float>(k_row[d]);
        for (int64_t g = 0; g < groups; ++g) sp[g * keys + j] = dot(qfp + g * hd, row, hd);
      }
      for (int64_t g = 0; g < groups; ++g) {
        float* s = sp + g * keys;
        if (softcap > 0.f) softcap_scores(s, keys, softcap);
        const float top = *std::max_element(s, s + keys);
        float sum = 0.f;
        for (int64_t j = 0; j < keys; ++j) sum += (s[j] = std::exp(s[j] - top));
        inv[g] = 1.f / sum;
      }
      // Pass 2: the weighted sum of values.
      std::fill(acc.begin(), acc.end(), 0.f);
      float* ap = acc.data();
      for (int64_t j = 0; j < keys; ++j, v_row += v2) {
        for (int64_t d = 0; d < hd; ++d) row[d] = static_cast<float>(v_row[d]);
        for (int64_t g = 0; g < groups; ++g) {
          const float w = sp[g * keys + j];
          float* a = ap + g * hd;
          for (int64_t d = 0; d < hd; ++d) a[d] += w * row[d];
        }
      }
      T* o_head = op + slot * o0 + head * o1;
      for (int64_t g = 0; g < groups; ++g)
        for (int64_t d = 0; d < hd; ++d) o_head[g * o2 + d] = static_cast<T>(ap[g * hd + d] * inv[g]);
    }
  });
}

}  // namespace

at::Tensor dense_decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& first, const at::Tensor& last, double scale,
                                  double softcap) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q, k, v must be 4-D (n, kvh, G|span, hd)");
  TORCH_CHECK(k.sizes() == v.sizes(), "k and v differ in shape: ", k.sizes(), " ", v.sizes());
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(1) == k.size(1) && q.size(3) == k.size(3),
              "q ", q.sizes(), " does not match k ", k.sizes());
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(), "q, k, v differ in dtype");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "the head dim must have unit stride");
  TORCH_CHECK(q.size(3) <= kMaxHeadDim, "head dim must be at most ", kMaxHeadDim, ", got ", q.size(3));
  const int64_t n = q.size(0), span = k.size(2);
  for (const at::Tensor* t : {&first, &last})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->dim() == 1 && t->size(0) == n,
                "first and last must be contiguous int64 (n,) tensors");
  const int64_t* f = first.data_ptr<int64_t>();
  const int64_t* l = last.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(0 <= f[i] && f[i] < l[i] && l[i] <= span, "slot ", i, ": keys ", f[i], "..", l[i],
                " must be a non-empty range within 0..", span);
  at::Tensor out = at::empty(q.sizes(), q.options());
  TORCH_CHECK(softcap >= 0, "softcap must be >= 0 (0: none), got ", softcap);
  const float s = static_cast<float>(scale), c = static_cast<float>(softcap);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "dense_decode_attention", [&] {
    switch (q.size(3)) {
      case 16: attend<scalar_t, 16>(q, k, v, f, l, out, s, c); break;
      case 32: attend<scalar_t, 32>(q, k, v, f, l, out, s, c); break;
      case 64: attend<scalar_t, 64>(q, k, v, f, l, out, s, c); break;
      case 128: attend<scalar_t, 128>(q, k, v, f, l, out, s, c); break;
      default: attend<scalar_t, 0>(q, k, v, f, l, out, s, c);
    }
  });
  return out;
}
