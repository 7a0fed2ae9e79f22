// The Python module of the native kernels (yutu.engine.native loads it). Every call releases the GIL.
#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using py::arg;
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("dense_decode_attention", &dense_decode_attention,
        "decode attention over dense slots: (n, kvh, G, hd) queries against (n, kvh, span, hd) keys and "
        "values, keys first[i]..last[i]-1 of slot i; softcap > 0: each score capped, softcap * tanh(score / softcap)",
        arg("q"), arg("k"), arg("v"), arg("first"), arg("last"), arg("scale"), arg("softcap") = 0.0, nogil);
  m.def("prefill_attention", &prefill_attention,
        "causal attention of (n, heads, hd) queries, at the last n of the m positions of (m, kvh, hd) keys "
        "and values; softcap > 0: each score capped, softcap * tanh(score / softcap); window > 0: each row"
        " attends its last window keys",
        arg("q"), arg("k"), arg("v"), arg("scale"), arg("softcap") = 0.0, arg("window") = 0, nogil);
  m.def("prefill_bf16_pairs", &prefill_bf16_pairs,
        "whether bfloat16 prefill attention multiplies bfloat16 pairs (AVX512-BF16 in this build)");
  m.def("spread_threads", &spread_threads,
        "bind each thread of torch's intra-op team to its own CPU (true), or give them back the caller's "
        "CPUs (false)",
        arg("on"));
  m.def("write_kv_", &write_kv_, "in place: k_cache[blocks[t], offsets[t]] = k[t], and v alike", arg("k_cache"),
        arg("v_cache"), arg("k"), arg("v"), arg("blocks"), arg("offsets"), nogil);
  m.def("fill_slots_", &fill_slots_,
        "in place: k_buf[slots[i], :, positions[i]] = k_cache[blocks[i], offsets[i]], and v alike", arg("k_buf"),
        arg("v_buf"), arg("k_cache"), arg("v_cache"), arg("slots"), arg("positions"), arg("blocks"),
        arg("offsets"), nogil);
  m.def("fill_whole_", &fill_whole_,
        "in place: positions 0..length-1 of the sequence whose block table is blocks into slot slot of k_buf, "
        "v_buf (k_buf[slot, :, p] = k_cache[blocks[p // block_size], p % block_size]), and v alike",
        arg("k_buf"), arg("v_buf"), arg("k_cache"), arg("v_cache"), arg("slot"), arg("length"), arg("blocks"),
        nogil);
  m.def("rms_norm", &rms_norm, "RMSNorm of (T, H) rows into a new tensor", arg("x"), arg("weight"), arg("eps"),
        nogil);
  m.def("add_rms_norm_", &add_rms_norm_, "in place: residual += x, then x = RMSNorm(residual)", arg("x"),
        arg("residual"), arg("weight"), arg("eps"), nogil);
  m.def("rotary_", &rotary_, "in place: rotate (T, heads, hd) by (T, hd) cos/sin tables, half-split layout",
        arg("x"), arg("cos"), arg("sin"), nogil);
  m.def("greedy_rows", &greedy_rows,
        "each (R, V) float32 logits row's first maximum (R,) int64, its value (R,), with log_sum the log of "
        "sum(exp(x - max)) (R,) (else empty), and whether the row is finite (R,) bool (a row that is not: "
        "what a row of zeros gives)",
        arg("logits"), arg("log_sum"), nogil);
  m.def("adjust_rows_", &adjust_rows_,
        "in place: rows[i] of (R, V) float32 scores penalized from tokens[offsets[i]:offsets[i+1]] (the first "
        "prompts[i] its prompt's) with penalties[i] = (repetition, frequency, presence), then clamped finite",
        arg("scores"), arg("rows"), arg("tokens"), arg("offsets"), arg("prompts"), arg("penalties"), nogil);
  m.def("mask_rows_", &mask_rows_,
        "in place: rows[i] of (R, V) float32 scores keep the tokens whose bit is set in bitmask[i] (int32 words, "
        "token j at bit j % 32 of word j / 32), at least float32's lowest's successor; the others become lowest",
        arg("scores"), arg("rows"), arg("bitmask"), nogil);
  m.def("silu_mul", &silu_mul, "silu(gate) * up of (T, 2I) [ gate | up ] rows into a new (T, I) tensor",
        arg("gate_up"), nogil);
}
