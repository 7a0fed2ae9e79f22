// Each logits row's greedy token and log-normaliser on CPU (yutu/engine/sampler.py).
//
// torch's CPU argmax reduces a row at ~1 ns an element here and its logsumexp and log_softmax at
// ~0.6-1 (amax: ~0.06): on a decode step of 16 rows of the demo model's 2,560-token vocabulary the
// sampler took ~0.25 ms of a ~4 ms step, and 6-14 ms with a 128k vocabulary. Per row, in float32:
//   pass 1  top = max_j x[j]; token = the first j with x[j] == top (torch's argmax: the first maximum)
//   pass 2  log_sum = log(sum_j exp(x[j] - top))                      (only when asked)
// so token c's log-probability is (x[c] - top) - log_sum, what log_softmax computes, in its order.
// Both are plain loops the compiler vectorizes (-ffast-math; the exponentials are libmvec's). A
// pass before them says whether the row is finite, from its bits; a row that is not gets what a
// row of zeros would (token 0, top 0, log_sum log V): the sampler puts zeros in its place.
//
// Shapes: logits (R, V) float32, unit stride in V. Returns token (R,) int64, top (R,) float32,
// log_sum (R,) float32 (empty when not asked) and finite (R,) bool.
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t kBlock = 64;  // floats of a block whose maximum pass 1 keeps
constexpr uint32_t kExponent = 0x7f800000u;  // a float's exponent bits: all set for inf and NaN

// Whether x[0..n) is all finite, from the bits (integer maths: -ffast-math's assumption that no
// float is inf or NaN does not touch it): the largest exponent field is not all ones.
bool all_finite(const float* x, int64_t n) {
  uint32_t top = 0;
  for (int64_t j = 0; j < n; ++j) {
    uint32_t bits;
    std::memcpy(&bits, x + j, sizeof bits);
    top = std::max(top, bits & kExponent);
  }
  return top != kExponent;
}

// The first maximum of x[0..n): its index, and its value in *top. The blocks' maxima, then the
// first block that reaches the row's, scanned: each loop vectorizes, where tracking the index
// along with the maximum (one pass) does not, nor an early exit from a comparison of a register.
int64_t first_maximum(const float* x, int64_t n, std::vector<float>& block_max, float* top) {
  const int64_t blocks = n / kBlock;
  block_max.resize(blocks);
  for (int64_t b = 0; b < blocks; ++b) {
    const float* y = x + b * kBlock;
    float m = y[0];
    for (int64_t k = 1; k < kBlock; ++k) m = std::max(m, y[k]);
    block_max[b] = m;
  }
  float m = x[n - 1];  // the tail's maximum (what no block holds), then the blocks'
  for (int64_t j = blocks * kBlock; j < n; ++j) m = std::max(m, x[j]);
  for (int64_t b = 0; b < blocks; ++b) m = std::max(m, block_max[b]);
  int64_t b = 0;
  while (b < blocks && block_max[b] != m) ++b;  // no block before b holds m
  int64_t j = b * kBlock;
  while (x[j] != m) ++j;  // stops: m is one of x[j..n)
  *top = m;
  return j;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> greedy_rows(const at::Tensor& logits, bool log_sum) {
  TORCH_CHECK(logits.device().is_cpu(), "greedy_rows: logits must be on the CPU");
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "greedy_rows: logits must be (R, V) with V > 0");
  TORCH_CHECK(logits.scalar_type() == at::kFloat, "greedy_rows: logits must be float32");
  TORCH_CHECK(logits.stride(1) == 1, "greedy_rows: logits must have unit stride in V");
  const int64_t rows = logits.size(0), vocab = logits.size(1), stride = logits.stride(0);
  auto token = at::empty({rows}, logits.options().dtype(at::kLong));
  auto top = at::empty({rows}, logits.options());
  auto sums = at::empty({log_sum ? rows : 0}, logits.options());
  auto finite = at::empty({rows}, logits.options().dtype(at::kBool));
  const float* xp = logits.data_ptr<float>();
  int64_t* tp = token.data_ptr<int64_t>();
  float* mp = top.data_ptr<float>();
  float* sp = log_sum ? sums.data_ptr<float>() : nullptr;
  bool* fp = finite.data_ptr<bool>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> block_max;
    for (int64_t r = begin; r < end; ++r) {
      const float* x = xp + r * stride;
      fp[r] = all_finite(x, vocab);
      if (!fp[r]) {  // what a row of zeros gives, which the sampler puts in its place
        tp[r] = 0;
        mp[r] = 0.f;
        if (sp != nullptr) sp[r] = std::log(static_cast<float>(vocab));
        continue;
      }
      float m;
      tp[r] = first_maximum(x, vocab, block_max, &m);
      mp[r] = m;
      if (sp != nullptr) {
        float sum = 0.f;
        for (int64_t j = 0; j < vocab; ++j) sum += std::exp(x[j] - m);
        sp[r] = std::log(sum);
      }
    }
  });
  return {token, top, sums, finite};
}

// Logit penalties on CPU (yutu/engine/sampler.py's adjust_logits is the reference, and what runs
// on other devices). On torch's operations a penalized row costs ~15 small operations a step
// (~0.1 ms each row); here all the rows are one call. In place, for each listed row r = rows[i] of
// scores (R, V) float32, over its tokens tokens[offsets[i]:offsets[i+1]] (prompt, then output;
// the first prompts[i] are the prompt's), with (repetition, frequency, presence) = penalties[i]:
//   each distinct token seen:       x = x > 0 ? x / repetition : x * repetition  (unless it is 1)
//   each output token, each time:   x -= frequency
//   each distinct output token:     x -= presence
// Each step rounds to float32 as torch's float32 operations do (computed in double, which holds
// every intermediate: a double's rounding of a float32 +, -, * or / is that operation's float32
// result) and is clamped into float32's finite range as it goes, so that nothing is ever infinite
// (-ffast-math may assume so); where the reference meets an infinity, its final clamp ends at the
// same bound. The logit bias is added before, by the caller (one index_add_ for all the rows).
namespace {

constexpr double kFloatMax = 3.4028234663852886e38;

float rounded(double x) { return static_cast<float>(std::clamp(x, -kFloatMax, kFloatMax)); }

}  // namespace

void adjust_rows_(at::Tensor& scores, const at::Tensor& rows, const at::Tensor& tokens, const at::Tensor& offsets,
                  const at::Tensor& prompts, const at::Tensor& penalties) {
  TORCH_CHECK(scores.device().is_cpu() && scores.scalar_type() == at::kFloat && scores.dim() == 2,
              "adjust_rows_: scores must be (R, V) float32 on the CPU");
  TORCH_CHECK(scores.stride(1) == 1, "adjust_rows_: scores must have unit stride in V");
  const int64_t n = rows.numel();
  for (const at::Tensor* t : {&rows, &tokens, &offsets, &prompts}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 1 && t->is_contiguous(),
                "adjust_rows_: rows, tokens, offsets and prompts must be contiguous int64 vectors");
  }
  TORCH_CHECK(offsets.numel() == n + 1 && prompts.numel() == n, "adjust_rows_: offsets (P + 1,), prompts (P,)");
  TORCH_CHECK(penalties.scalar_type() == at::kDouble && penalties.is_contiguous() && penalties.dim() == 2 &&
                  penalties.size(0) == n && penalties.size(1) == 3,
              "adjust_rows_: penalties must be (P, 3) float64: repetition, frequency, presence");
  const int64_t num_rows = scores.size(0), vocab = scores.size(1), stride = scores.stride(0);
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* tp = tokens.data_ptr<int64_t>();
  const int64_t* op = offsets.data_ptr<int64_t>();
  const int64_t* pp = prompts.data_ptr<int64_t>();
  const double* kp = penalties.data_ptr<double>();
  TORCH_CHECK(op[0] == 0 && op[n] == tokens.numel(), "adjust_rows_: offsets must run from 0 to tokens' length");
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(0 <= rp[i] && rp[i] < num_rows, "adjust_rows_: row ", rp[i], " outside the scores' ", num_rows);
    TORCH_CHECK(op[i] <= op[i + 1] && 0 <= pp[i] && pp[i] <= op[i + 1] - op[i],
                "adjust_rows_: offsets must not decrease and a prompt must lie within its row's tokens");
  }
  for (int64_t j = 0; j < tokens.numel(); ++j) {
    TORCH_CHECK(0 <= tp[j] && tp[j] < vocab, "adjust_rows_: token ", tp[j], " outside the vocabulary of ", vocab);
  }
  float* sp = scores.data_ptr<float>();
  std::vector<uint8_t> seen(vocab, 0);  // marks of the distinct tokens of one pass, cleared after it
  for (int64_t i = 0; i < n; ++i) {
    float* x = sp + rp[i] * stride;
    const int64_t* first = tp + op[i];
    const int64_t* last = tp + op[i + 1];
    const int64_t* output = first + pp[i];
    const float repetition = static_cast<float>(kp[3 * i]);
    const float frequency = static_cast<float>(kp[3 * i + 1]);
    const float presence = static_cast<float>(kp[3 * i + 2]);
    if (repetition != 1.f) {
      for (const int64_t* t = first; t < last; ++t) {
        if (seen[*t]) continue;
        seen[*t] = 1;
        const double v = x[*t];
        x[*t] = rounded(v > 0 ? v / repetition : v * repetition);
      }
      for (const int64_t* t = first; t < last; ++t) seen[*t] = 0;
    }
    if (frequency != 0.f) {
      for (const int64_t* t = output; t < last; ++t) x[*t] = rounded(static_cast<double>(x[*t]) - frequency);
    }
    if (presence != 0.f) {
      for (const int64_t* t = output; t < last; ++t) {
        if (seen[*t]) continue;
        seen[*t] = 1;
        x[*t] = rounded(static_cast<double>(x[*t]) - presence);
      }
      for (const int64_t* t = output; t < last; ++t) seen[*t] = 0;
    }
  }
}

// A grammar's mask on CPU (yutu/engine/structured.py's mask_rows_ is the reference, and what runs
// on other devices). On torch's operations unpacking the bits costs ~15 passes over (R, V): 16 rows
// of a 128k vocabulary took ~15 ms a step. In place, for each listed row r = rows[i] of scores
// (R, V) float32, with bitmask[i] one bit per token (token j at bit j % 32 of word j / 32):
//   allowed     x = max(x, floor)      (floor: the float32 just above lowest)
//   not allowed x = lowest
// so an allowed token always beats a disallowed one and the row stays finite. A word of all ones
// or all zeros is one clamp or one fill over its 32 tokens.
void mask_rows_(at::Tensor& scores, const at::Tensor& rows, const at::Tensor& bitmask) {
  TORCH_CHECK(scores.device().is_cpu() && scores.scalar_type() == at::kFloat && scores.dim() == 2,
              "mask_rows_: scores must be (R, V) float32 on the CPU");
  TORCH_CHECK(scores.stride(1) == 1, "mask_rows_: scores must have unit stride in V");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous(),
              "mask_rows_: rows must be a contiguous int64 vector");
  const int64_t n = rows.numel(), num_rows = scores.size(0), vocab = scores.size(1), stride = scores.stride(0);
  const int64_t words = (vocab + 31) / 32;
  TORCH_CHECK(bitmask.scalar_type() == at::kInt && bitmask.is_contiguous() && bitmask.dim() == 2 &&
                  bitmask.size(0) == n && bitmask.size(1) == words,
              "mask_rows_: bitmask must be (P, ceil(V / 32)) int32, contiguous, one row per listed row");
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(0 <= rp[i] && rp[i] < num_rows, "mask_rows_: row ", rp[i], " outside the scores' ", num_rows);
  }
  const float lowest = std::numeric_limits<float>::lowest();
  const float floor = std::nextafter(lowest, 0.f);
  const uint32_t* bp = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  float* sp = scores.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    float* x = sp + rp[i] * stride;
    const uint32_t* bits = bp + i * words;
    for (int64_t w = 0; w < words; ++w) {
      float* chunk = x + 32 * w;
      const int64_t count = std::min<int64_t>(32, vocab - 32 * w);
      const uint32_t word = bits[w];
      if (word == 0) {
        std::fill(chunk, chunk + count, lowest);
      } else if (word == ~0u) {
        for (int64_t j = 0; j < count; ++j) chunk[j] = std::max(chunk[j], floor);
      } else {
        for (int64_t j = 0; j < count; ++j) chunk[j] = (word >> j) & 1u ? std::max(chunk[j], floor) : lowest;
      }
    }
  }
}
