// A step's KV copies on CPU: its new keys and values into the paged cache, and positions of the
// paged cache into the dense decode cache's slots (yutu/engine/attention.py write_kv_cache,
// yutu/engine/decode_cache.py DenseStep.fill), a step's few new positions or a sequence's whole context.
//
// The reference is torch's indexed assignment, two per layer for each copy (keys, values): at a
// decode step each costs ~10 us of indexing machinery to move a few hundred bytes. Here each copy
// is one call moving rows of (kvh, hd) or hd elements with memcpy. Values are copied, not computed:
// the result is bit for bit the reference's.
//
// Layouts: a paged cache layer (num_blocks, block_size, kvh, hd) and a step's k, v (T, kvh, hd),
// each with a position's (kvh, hd) contiguous; dense buffers (slots, kvh, capacity, hd) with hd
// contiguous. Index tensors are int64 and contiguous.
#include "kernels.h"

#include <algorithm>
#include <cstring>
#include <initializer_list>
#include <utility>

namespace {

void check_index(const at::Tensor& index, int64_t n, const char* name) {
  TORCH_CHECK(index.scalar_type() == at::kLong && index.is_contiguous() && index.dim() == 1 && index.size(0) == n,
              name, " must be a contiguous int64 (", n, ",) tensor, got ", index.sizes());
}

// A (..., kvh, hd) tensor whose (kvh, hd) of one position are contiguous.
void check_positions(const at::Tensor& t, const at::Tensor& like, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on CPU");
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), name, " differs in dtype from the cache");
  TORCH_CHECK(t.size(-1) == like.size(-1) && t.size(-2) == like.size(-2) && t.stride(-1) == 1 &&
                  t.stride(-2) == t.size(-1),
              name, " must hold contiguous (", like.size(-2), ", ", like.size(-1), ") positions, got ",
              t.sizes(), " strides ", t.strides());
}

// Dense buffers (slots, kvh, capacity, hd) that take the positions of a paged cache layer's K and V.
void check_slots_and_cache(const at::Tensor& k_buf, const at::Tensor& v_buf, const at::Tensor& k_cache,
                           const at::Tensor& v_cache) {
  TORCH_CHECK(k_buf.dim() == 4 && v_buf.sizes() == k_buf.sizes() && k_cache.dim() == 4 &&
                  v_cache.sizes() == k_cache.sizes(),
              "buffers must be (slots, kvh, capacity, hd) and caches (num_blocks, block_size, kvh, hd)");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&k_cache, &v_cache})
    check_positions(*t, k_cache, "a cache");
  TORCH_CHECK(k_buf.size(1) == k_cache.size(2) && k_buf.size(3) == k_cache.size(3) && k_buf.stride(3) == 1 &&
                  v_buf.stride(3) == 1 && k_buf.scalar_type() == k_cache.scalar_type() &&
                  v_buf.scalar_type() == k_cache.scalar_type() && k_buf.device().is_cpu() && v_buf.device().is_cpu(),
              "buffers ", k_buf.sizes(), " do not match the cache ", k_cache.sizes());
}

}  // namespace

void write_kv_(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
               const at::Tensor& blocks, const at::Tensor& offsets) {
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && k.dim() == 3 && v.sizes() == k.sizes(),
              "caches must be (num_blocks, block_size, kvh, hd) and k, v (T, kvh, hd), got ", k_cache.sizes(), " ",
              k.sizes());
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&k_cache, &v_cache, &k, &v})
    check_positions(*t, k_cache, "every tensor");
  const int64_t tokens = k.size(0), num_blocks = k_cache.size(0), block_size = k_cache.size(1);
  check_index(blocks, tokens, "blocks");
  check_index(offsets, tokens, "offsets");
  const int64_t* b = blocks.data_ptr<int64_t>();
  const int64_t* o = offsets.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(0 <= b[t] && b[t] < num_blocks && 0 <= o[t] && o[t] < block_size, "token ", t, ": slot (", b[t],
                ", ", o[t], ") outside the cache's ", num_blocks, " blocks of ", block_size);
  const int64_t bytes = k.size(1) * k.size(2) * k.element_size();
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  const auto* kp = static_cast<const char*>(k.data_ptr());
  const auto* vp = static_cast<const char*>(v.data_ptr());
  const int64_t e = k.element_size();
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t at = (b[t] * k_cache.stride(0) + o[t] * k_cache.stride(1)) * e;
    const int64_t vat = (b[t] * v_cache.stride(0) + o[t] * v_cache.stride(1)) * e;
    std::memcpy(kc + at, kp + t * k.stride(0) * e, bytes);
    std::memcpy(vc + vat, vp + t * v.stride(0) * e, bytes);
  }
}

void fill_slots_(at::Tensor& k_buf, at::Tensor& v_buf, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& slots, const at::Tensor& positions, const at::Tensor& blocks,
                 const at::Tensor& offsets) {
  check_slots_and_cache(k_buf, v_buf, k_cache, v_cache);
  const int64_t n = slots.numel(), num_blocks = k_cache.size(0), block_size = k_cache.size(1);
  for (const auto& [index, name] : {std::pair{&slots, "slots"}, {&positions, "positions"}, {&blocks, "blocks"},
                                    {&offsets, "offsets"}})
    check_index(*index, n, name);
  const int64_t* s = slots.data_ptr<int64_t>();
  const int64_t* p = positions.data_ptr<int64_t>();
  const int64_t* b = blocks.data_ptr<int64_t>();
  const int64_t* o = offsets.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(0 <= s[i] && s[i] < k_buf.size(0) && 0 <= p[i] && p[i] < k_buf.size(2) && 0 <= b[i] &&
                    b[i] < num_blocks && 0 <= o[i] && o[i] < block_size,
                "copy ", i, ": slot ", s[i], " position ", p[i], " or cache slot (", b[i], ", ", o[i],
                ") out of range");
  const int64_t heads = k_buf.size(1), e = k_buf.element_size(), bytes = k_buf.size(3) * e;
  auto* kb = static_cast<char*>(k_buf.data_ptr());
  auto* vb = static_cast<char*>(v_buf.data_ptr());
  const auto* kc = static_cast<const char*>(k_cache.data_ptr());
  const auto* vc = static_cast<const char*>(v_cache.data_ptr());
  for (int64_t i = 0; i < n; ++i) {
    const int64_t from_k = (b[i] * k_cache.stride(0) + o[i] * k_cache.stride(1)) * e;
    const int64_t from_v = (b[i] * v_cache.stride(0) + o[i] * v_cache.stride(1)) * e;
    for (int64_t h = 0; h < heads; ++h) {
      std::memcpy(kb + (s[i] * k_buf.stride(0) + h * k_buf.stride(1) + p[i] * k_buf.stride(2)) * e,
                  kc + from_k + h * k_cache.stride(2) * e, bytes);
      std::memcpy(vb + (s[i] * v_buf.stride(0) + h * v_buf.stride(1) + p[i] * v_buf.stride(2)) * e,
                  vc + from_v + h * v_cache.stride(2) * e, bytes);
    }
  }
}

void fill_whole_(at::Tensor& k_buf, at::Tensor& v_buf, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 int64_t slot, int64_t length, const at::Tensor& blocks) {
  check_slots_and_cache(k_buf, v_buf, k_cache, v_cache);
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1), used = (length + block_size - 1) / block_size;
  TORCH_CHECK(0 <= slot && slot < k_buf.size(0) && 0 < length && length <= k_buf.size(2), "slot ", slot,
              " or length ", length, " outside the buffers ", k_buf.sizes());
  TORCH_CHECK(blocks.scalar_type() == at::kLong && blocks.is_contiguous() && blocks.dim() == 1 &&
                  blocks.size(0) >= used,
              "blocks must be a contiguous int64 tensor of at least ", used, " blocks, got ", blocks.sizes());
  const int64_t* b = blocks.data_ptr<int64_t>();
  for (int64_t j = 0; j < used; ++j)
    TORCH_CHECK(0 <= b[j] && b[j] < num_blocks, "block ", j, " (", b[j], ") outside the cache's ", num_blocks);
  const int64_t heads = k_buf.size(1), e = k_buf.element_size(), bytes = k_buf.size(3) * e;
  auto* kb = static_cast<char*>(k_buf.data_ptr()) + slot * k_buf.stride(0) * e;
  auto* vb = static_cast<char*>(v_buf.data_ptr()) + slot * v_buf.stride(0) * e;
  const auto* kc = static_cast<const char*>(k_cache.data_ptr());
  const auto* vc = static_cast<const char*>(v_cache.data_ptr());
  for (int64_t j = 0; j < used; ++j) {  // block by block: its positions' (kvh, hd) rows are read in order
    const int64_t n = std::min(block_size, length - j * block_size);
    for (int64_t t = 0; t < n; ++t) {
      const int64_t pos = j * block_size + t;
      const char* from_k = kc + (b[j] * k_cache.stride(0) + t * k_cache.stride(1)) * e;
      const char* from_v = vc + (b[j] * v_cache.stride(0) + t * v_cache.stride(1)) * e;
      for (int64_t h = 0; h < heads; ++h) {
        std::memcpy(kb + (h * k_buf.stride(1) + pos * k_buf.stride(2)) * e, from_k + h * k_cache.stride(2) * e, bytes);
        std::memcpy(vb + (h * v_buf.stride(1) + pos * v_buf.stride(2)) * e, from_v + h * v_cache.stride(2) * e, bytes);
      }
    }
  }
}
