// Test-only GGUF image writer: builds valid or deliberately hostile GGUF
// images in memory. Used by gguf_test.cpp, dequant_test.cpp and by
// `kvstack_gguf_tool write-samples` (fuzzer seed corpus). Not for production
// files: it writes exactly what it is told, including invalid layouts.
#pragma once

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace kvstack::testing {

using Bytes = std::vector<uint8_t>;

// Little-endian encoders, appending to `out`.
inline void put_bytes(Bytes& out, const void* p, size_t n) {
  // resize + memcpy rather than insert(): GCC 12 emits false
  // -Wstringop-overflow warnings for small inserts.
  if (n == 0) return;
  const size_t at = out.size();
  out.resize(at + n);
  std::memcpy(out.data() + at, p, n);
}
template <class T>
void put(Bytes& out, T v) {
  put_bytes(out, &v, sizeof(T));
}
inline void put_str(Bytes& out, std::string_view s) {
  put<uint64_t>(out, s.size());
  put_bytes(out, s.data(), s.size());
}

// GGUF metadata value type ids (as GgufType; repeated here so the builder has
// no dependency on the reader it tests).
enum VType : uint32_t {
  kVU8 = 0,
  kVI8 = 1,
  kVU16 = 2,
  kVI16 = 3,
  kVU32 = 4,
  kVI32 = 5,
  kVF32 = 6,
  kVBool = 7,
  kVString = 8,
  kVArray = 9,
  kVU64 = 10,
  kVI64 = 11,
  kVF64 = 12,
};

// Encoded array value body: element type, count, then `elems` (already
// encoded elements). Use as the value of add_kv(key, kVArray, ...).
inline Bytes array_value(uint32_t elem_type, uint64_t count, const Bytes& elems) {
  Bytes out;
  put<uint32_t>(out, elem_type);
  put<uint64_t>(out, count);
  put_bytes(out, elems.data(), elems.size());
  return out;
}
inline Bytes string_array_value(const std::vector<std::string>& items) {
  Bytes elems;
  for (const auto& s : items) put_str(elems, s);
  return array_value(kVString, items.size(), elems);
}
template <class T>
Bytes scalar_array_value(uint32_t elem_type, const std::vector<T>& items) {
  Bytes elems;
  for (T v : items) put<T>(elems, v);
  return array_value(elem_type, items.size(), elems);
}

struct GgufBuilder {
  struct Tensor {
    std::string name;
    std::vector<uint64_t> dims;  // ne[0] first
    uint32_t type = 0;
    Bytes data;                      // written at the tensor's offset
    std::optional<uint64_t> offset;  // default: next aligned position
  };

  uint32_t magic = 0x46554747;  // "GGUF"
  uint32_t version = 3;
  // Layout alignment for offsets and the data section. Does not add the
  // general.alignment key; call add_u32("general.alignment", a) for that.
  uint64_t alignment = 32;
  std::optional<uint64_t> tensor_count_override;
  std::optional<uint64_t> kv_count_override;
  std::vector<Bytes> kvs;  // encoded key + type + value
  std::vector<Tensor> tensors;

  GgufBuilder& add_kv(std::string_view key, uint32_t type, const Bytes& value) {
    Bytes kv;
    put_str(kv, key);
    put<uint32_t>(kv, type);
    put_bytes(kv, value.data(), value.size());
    kvs.push_back(std::move(kv));
    return *this;
  }
  template <class T>
  GgufBuilder& add_scalar(std::string_view key, uint32_t type, T v) {
    Bytes b;
    put<T>(b, v);
    return add_kv(key, type, b);
  }
  GgufBuilder& add_u32(std::string_view key, uint32_t v) { return add_scalar(key, kVU32, v); }
  GgufBuilder& add_string(std::string_view key, std::string_view s) {
    Bytes b;
    put_str(b, s);
    return add_kv(key, kVString, b);
  }
  GgufBuilder& add_tensor(std::string name, std::vector<uint64_t> dims, uint32_t type, Bytes data,
                          std::optional<uint64_t> offset = std::nullopt) {
    tensors.push_back({std::move(name), std::move(dims), type, std::move(data), offset});
    return *this;
  }

  uint64_t align_up(uint64_t x) const { return (x + alignment - 1) / alignment * alignment; }

  // Offsets the tensors get (explicit ones, else packed in order, aligned).
  std::vector<uint64_t> offsets() const {
    std::vector<uint64_t> out;
    uint64_t next = 0;
    for (const auto& t : tensors) {
      const uint64_t off = t.offset.value_or(align_up(next));
      out.push_back(off);
      next = off + t.data.size();
    }
    return out;
  }

  Bytes build() const {
    Bytes out;
    put<uint32_t>(out, magic);
    put<uint32_t>(out, version);
    put<uint64_t>(out, tensor_count_override.value_or(tensors.size()));
    put<uint64_t>(out, kv_count_override.value_or(kvs.size()));
    for (const auto& kv : kvs) put_bytes(out, kv.data(), kv.size());
    const std::vector<uint64_t> offs = offsets();
    for (size_t k = 0; k < tensors.size(); ++k) {
      const Tensor& t = tensors[k];
      put_str(out, t.name);
      put<uint32_t>(out, static_cast<uint32_t>(t.dims.size()));
      for (uint64_t d : t.dims) put<uint64_t>(out, d);
      put<uint32_t>(out, t.type);
      put<uint64_t>(out, offs[k]);
    }
    if (tensors.empty()) return out;
    const uint64_t data_start = align_up(out.size());
    out.resize(data_start, 0);
    for (size_t k = 0; k < tensors.size(); ++k) {
      const uint64_t at = data_start + offs[k];
      if (out.size() < at + tensors[k].data.size()) out.resize(at + tensors[k].data.size(), 0);
      if (!tensors[k].data.empty()) {
        std::memcpy(out.data() + at, tensors[k].data.data(), tensors[k].data.size());
      }
    }
    return out;
  }
};

}  // namespace kvstack::testing
