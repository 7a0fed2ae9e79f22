// A decoder layer's elementwise steps on CPU, each one pass over its rows (yutu/engine/model.py).
//
// The reference is the model's torch code (RMSNorm.reference, apply_rotary, the MLP's silu * up):
// at one decode token each of its ~30 small tensor operations per layer costs a dispatch and an
// allocation that outweigh the arithmetic, and at a long prompt's rows each reads and writes the
// whole activation again. These compute the same values with the same roundings: every step that
// torch rounds to the activations' dtype (bfloat16, float16) is rounded here too, in the same
// order, so results agree with the reference exactly but for the order of one sum of squares.
//
// Activations are 2-D (T, width) or 3-D (T, heads, hd) with unit stride in their last dimension.
#include "kernels.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>

namespace {

// Rows per task: enough work that a thread's start does not dominate (a decode's one row stays on
// the calling thread).
int64_t grain(int64_t width) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, width)); }

// Conversions that vectorize: c10's float -> bfloat16 branches on NaN, which keeps the loops
// scalar (measured 3-10x slower here). Same rounding: to nearest, ties to even; NaN stays NaN.
template <typename T>
inline float to_float(T x) {
  return static_cast<float>(x);
}
template <>
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
template <typename T>
inline T from_float(float x) {
  return static_cast<T>(x);
}
template <>
inline c10::BFloat16 from_float(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
  return c10::BFloat16(static_cast<uint16_t>(nan ? 0x7fc0u : rounded), c10::BFloat16::from_bits());
}
// Rounds to T as torch's ops on T do, back in float (identity for float).
template <typename T>
inline float round_to(float x) {
  return to_float(from_float<T>(x));
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu(), name, " must be on CPU");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, " must be 2-D with unit stride in its last dim, got ",
              x.sizes(), " strides ", x.strides());
}

// out = weight * round(x * rsqrt(mean(x^2) + eps)), x in float; RMSNorm.reference's roundings.
template <typename T>
inline void norm_row(const float* x, const T* weight, int64_t width, float eps, T* out) {
  float squares = 0.f;
  for (int64_t j = 0; j < width; ++j) squares += x[j] * x[j];
  const float inv = 1.f / std::sqrt(squares / static_cast<float>(width) + eps);
  for (int64_t j = 0; j < width; ++j)
    out[j] = from_float<T>(to_float(weight[j]) * round_to<T>(x[j] * inv));
}

void check_norm(const at::Tensor& x, const at::Tensor& weight) {
  check_rows(x, "x");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1),
              "weight must be a contiguous (", x.size(1), ",) tensor, got ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight and x differ in dtype");
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm(x, weight);
  const int64_t rows = x.size(0), width = x.size(1);
  at::Tensor out = at::empty({rows, width}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t xs = x.stride(0);
    at::parallel_for(0, rows, grain(width), [&](int64_t begin, int64_t end) {
      std::vector<float> row(width);
      for (int64_t i = begin; i < end; ++i) {
        for (int64_t j = 0; j < width; ++j) row[j] = to_float(xp[i * xs + j]);
        norm_row(row.data(), wp, width, static_cast<float>(eps), op + i * width);
      }
    });
  });
  return out;
}

void add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_norm(x, weight);
  check_rows(residual, "residual");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "residual ", residual.sizes(), " does not match x ", x.sizes());
  const int64_t rows = x.size(0), width = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm_", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    const int64_t xs = x.stride(0), rs = residual.stride(0);
    at::parallel_for(0, rows, grain(width), [&](int64_t begin, int64_t end) {
      std::vector<float> row(width);
      for (int64_t i = begin; i < end; ++i) {
        scalar_t* r = rp + i * rs;
        scalar_t* xi = xp + i * xs;
        for (int64_t j = 0; j < width; ++j) {  // residual + x, rounded as torch's add rounds it
          row[j] = round_to<scalar_t>(to_float(r[j]) + to_float(xi[j]));
          r[j] = from_float<scalar_t>(row[j]);
        }
        norm_row(row.data(), wp, width, static_cast<float>(eps), xi);
      }
    });
  });
}

// One (T, heads, hd) tensor rotated in place; HD: the head dim known at compile time (0: at run time).
template <typename T, int64_t HD>
void rotate(at::Tensor& x, const T* cp, const T* sp) {
  const int64_t rows = x.size(0), heads = x.size(1), hd = HD > 0 ? HD : x.size(2), half = hd / 2;
  T* xp = x.data_ptr<T>();
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  at::parallel_for(0, rows, grain(heads * hd), [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(2 * hd);  // one head's halves, rotated, before they are stored
    float* __restrict lo = buffer.data();
    float* __restrict hi = lo + half;
    for (int64_t t = begin; t < end; ++t) {
      const T* __restrict c = cp + t * hd;
      const T* __restrict s = sp + t * hd;
      for (int64_t h = 0; h < heads; ++h) {
        T* v = xp + t * s0 + h * s1;
        for (int64_t d = 0; d < half; ++d) {  // x * cos + cat(-x2, x1) * sin, each product rounded
          const float x1 = to_float(v[d]), x2 = to_float(v[d + half]);
          lo[d] = round_to<T>(x1 * to_float(c[d])) + round_to<T>(-x2 * to_float(s[d]));
          hi[d] = round_to<T>(x2 * to_float(c[d + half])) + round_to<T>(x1 * to_float(s[d + half]));
        }
        for (int64_t d = 0; d < half; ++d) {
          v[d] = from_float<T>(lo[d]);
          v[d + half] = from_float<T>(hi[d]);
        }
      }
    }
  });
}

void rotary_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1,
              "x must be a CPU (T, heads, hd) tensor with unit stride in hd, got ", x.sizes());
  const int64_t rows = x.size(0), hd = x.size(2);
  TORCH_CHECK(hd % 2 == 0, "the head dim must be even, got ", hd);
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->is_contiguous() && t->dim() == 2 && t->size(0) == rows && t->size(1) == hd &&
                    t->scalar_type() == x.scalar_type(),
                "cos and sin must be contiguous (", rows, ", ", hd, ") tensors in x's dtype, got ", t->sizes());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary_", [&] {
    const scalar_t* c = cos.data_ptr<scalar_t>();
    const scalar_t* s = sin.data_ptr<scalar_t>();
    switch (hd) {
      case 32: rotate<scalar_t, 32>(x, c, s); break;
      case 64: rotate<scalar_t, 64>(x, c, s); break;
      case 128: rotate<scalar_t, 128>(x, c, s); break;
      default: rotate<scalar_t, 0>(x, c, s);
    }
  });
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up's width must be even ([ gate | up ]), got ", gate_up.size(1));
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, width}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_mul", [&] {
    const scalar_t* gp = gate_up.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t gs = gate_up.stride(0);
    at::parallel_for(0, rows, grain(width), [&](int64_t begin, int64_t end) {
      std::vector<float> buffer(width);
      float* __restrict f = buffer.data();
      for (int64_t i = begin; i < end; ++i) {
        const scalar_t* g = gp + i * gs;
        const scalar_t* u = g + width;
        scalar_t* o = op + i * width;
        for (int64_t j = 0; j < width; ++j) f[j] = to_float(g[j]);
        for (int64_t j = 0; j < width; ++j) f[j] = f[j] / (1.f + std::exp(-f[j]));  // silu, in float
        for (int64_t j = 0; j < width; ++j) o[j] = from_float<scalar_t>(round_to<scalar_t>(f[j]) * to_float(u[j]));
      }
    });
  });
  return out;
}
