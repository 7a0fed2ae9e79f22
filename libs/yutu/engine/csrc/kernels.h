// The native CPU kernels of yutu.engine.native: what each source file defines, bound in bindings.cpp.
#pragma once

#include <torch/extension.h>

#include <algorithm>

// Gemma 2's cap on attention scores, in place: s[j] = cap * tanh(s[j] / cap) for j < n (cap > 0).
// tanh as Eigen computes it for float (generic_fast_tanh_float): the argument clamped to +-7.9053,
// then a 13/6 rational polynomial -- multiplies, adds and one divide, so the loop vectorizes where
// std::tanh is a call a score (5x the uncapped prefill kernel's time); within 3.5e-7 of tanh
// (float32, measured over -12..12). tests/engine/test_engine_native.py holds the capped kernels to
// the attention written out with torch.tanh.
inline void softcap_scores(float* s, int64_t n, float cap) {
  const float inv = 1.f / cap, bound = 7.90531110763549805f;
  for (int64_t j = 0; j < n; ++j) {
    const float x = std::min(std::max(s[j] * inv, -bound), bound), x2 = x * x;
    float p = -2.76076847742355e-16f;
    p = p * x2 + 2.00018790482477e-13f;
    p = p * x2 + -8.60467152213735e-11f;
    p = p * x2 + 5.12229709037114e-08f;
    p = p * x2 + 1.48572235717979e-05f;
    p = p * x2 + 6.37261928875436e-04f;
    p = p * x2 + 4.89352455891786e-03f;
    float q = 1.19825839466702e-06f;
    q = q * x2 + 1.18534705686654e-04f;
    q = q * x2 + 2.26843463243900e-03f;
    q = q * x2 + 4.89352518554385e-03f;
    s[j] = cap * (x * p / q);
  }
}

// decode_attention.cpp: the dense decode cache's attention (softcap > 0: scores capped, Gemma 2).
at::Tensor dense_decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& first, const at::Tensor& last, double scale,
                                  double softcap);

// prefill_attention.cpp: causal attention of a prompt chunk (the last n of m key positions).
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                             double softcap, int64_t window);
// Whether this build multiplies bfloat16 pairs (AVX512-BF16) for bfloat16 prefill attention.
bool prefill_bf16_pairs();

// kv_copy.cpp: a step's keys and values into the paged cache; paged positions into dense slots.
void write_kv_(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
               const at::Tensor& blocks, const at::Tensor& offsets);
void fill_slots_(at::Tensor& k_buf, at::Tensor& v_buf, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& slots, const at::Tensor& positions, const at::Tensor& blocks,
                 const at::Tensor& offsets);
void fill_whole_(at::Tensor& k_buf, at::Tensor& v_buf, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 int64_t slot, int64_t length, const at::Tensor& blocks);

// layer_ops.cpp: a decoder layer's elementwise steps, with the model's torch code's roundings.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
void add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps);
void rotary_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor silu_mul(const at::Tensor& gate_up);

// sampling.cpp: each (R, V) float32 logits row's first maximum, its value, (log_sum) the log of
// sum(exp(x - max)), so that a token's log-probability is (x - max) - log_sum, and whether it is finite.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> greedy_rows(const at::Tensor& logits, bool log_sum);
// In place: listed rows of (R, V) float32 scores get their repetition, frequency and presence
// penalties from their tokens (yutu/engine/sampler.py's adjust_logits is the reference).
void adjust_rows_(at::Tensor& scores, const at::Tensor& rows, const at::Tensor& tokens, const at::Tensor& offsets,
                  const at::Tensor& prompts, const at::Tensor& penalties);
// In place: listed rows of (R, V) float32 scores keep only the tokens of their (P, ceil(V / 32))
// int32 bitmask rows: the others go to float32's lowest (yutu/engine/structured.py's mask_rows_).
void mask_rows_(at::Tensor& scores, const at::Tensor& rows, const at::Tensor& bitmask);

// threads.cpp: bind each thread of torch's intra-op team to its own CPU of the caller's (true),
// or give them all the caller's CPUs back (false); false when there is nothing to spread over.
bool spread_threads(bool on);
