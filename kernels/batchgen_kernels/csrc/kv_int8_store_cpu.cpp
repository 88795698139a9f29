// The int8 KV cache's store (engine.kv_cache_dtype: int8), which quantizes as it writes.
//
// Layout: K and V caches int8 [N, bs, Hkv, D] with one fp32 scale per (slot, kv head) beside each, [N, bs, Hkv]:
// x ~= q * scale, scale = absmax(x over D) / 127, q = round(x * (127 / absmax)) (ties to even, as torch.round; the
// reference, reference.quantize_kv, computes the same fp32 arithmetic, so stores are bit-identical). Read by
// paged_int8_cpu.cpp (decode), paged_prefill_cpu.cpp and amx/paged_prefill_amx.cpp (prefill).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

float element(const at::Tensor& t, int64_t i) {
  switch (t.scalar_type()) {
    case at::kFloat: return t.const_data_ptr<float>()[i];
    case at::kBFloat16: return static_cast<float>(t.const_data_ptr<c10::BFloat16>()[i]);
    default: return static_cast<float>(t.const_data_ptr<c10::Half>()[i]);
  }
}

// Quantize one row of `dim` values (from `src`'s element `offset` on) into `dst`, returning its scale.
float quantize_row(const at::Tensor& src, int64_t offset, int64_t dim, int8_t* dst, float* buffer) {
  float absmax = 0.0f;
  for (int64_t d = 0; d < dim; ++d) {
    buffer[d] = element(src, offset + d);
    absmax = std::max(absmax, std::fabs(buffer[d]));
  }
  const float inv = absmax > 0.0f ? 127.0f / absmax : 0.0f;
  for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<int8_t>(std::nearbyint(buffer[d] * inv));
  return absmax / 127.0f;
}

void store_kv_int8_(const at::Tensor& key, const at::Tensor& value, at::Tensor k_cache, at::Tensor v_cache,
                    at::Tensor k_scale, at::Tensor v_scale, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && key.is_contiguous() && value.is_contiguous(),
              "store_kv_int8: key and value must be contiguous [T, Hkv, D] of one shape");
  TORCH_CHECK(key.scalar_type() == value.scalar_type() &&
                  (key.scalar_type() == at::kFloat || key.scalar_type() == at::kBFloat16 ||
                   key.scalar_type() == at::kHalf),
              "store_kv_int8: key and value must be float32, bfloat16 or float16");
  TORCH_CHECK(k_cache.scalar_type() == at::kChar && v_cache.scalar_type() == at::kChar && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() && k_cache.dim() == 4,
              "store_kv_int8: the caches must be contiguous int8 [N, bs, Hkv, D]");
  TORCH_CHECK(k_scale.scalar_type() == at::kFloat && v_scale.scalar_type() == at::kFloat &&
                  k_scale.is_contiguous() && v_scale.is_contiguous() && k_scale.numel() * k_cache.size(3) ==
                  k_cache.numel() && v_scale.numel() == k_scale.numel(),
              "store_kv_int8: the scales must be contiguous float32 [N, bs, Hkv]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == key.size(0),
              "store_kv_int8: slot_mapping must be int64 [T]");
  const int64_t tokens = key.size(0), heads = key.size(1), dim = key.size(2);
  TORCH_CHECK(heads == k_cache.size(2) && dim == k_cache.size(3), "store_kv_int8: key's heads or dim differ");
  const int64_t slots = k_cache.size(0) * k_cache.size(1);
  const at::Tensor mapping = slot_mapping.contiguous();
  const int64_t* slot = mapping.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) TORCH_CHECK(slot[t] >= 0 && slot[t] < slots, "store_kv_int8: slot out of range");
  int8_t *kc = k_cache.data_ptr<int8_t>(), *vc = v_cache.data_ptr<int8_t>();
  float *ks = k_scale.data_ptr<float>(), *vs = v_scale.data_ptr<float>();
  at::parallel_for(0, tokens * heads, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(dim);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / heads, h = i % heads, row = slot[t] * heads + h;
      ks[row] = quantize_row(key, i * dim, dim, kc + row * dim, buffer.data());
      vs[row] = quantize_row(value, i * dim, dim, vc + row * dim, buffer.data());
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(batchgen, m) {
  m.def("store_kv_int8_(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor(c!) k_scale, "
        "Tensor(d!) v_scale, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(batchgen, CPU, m) { m.impl("store_kv_int8_", &store_kv_int8_); }
