// GGUF file reader: memory-mapped, zero-copy, validated once at open().
//
// After open() succeeds, every tensor's [data, data + n_bytes) lies inside the
// file, tensors do not overlap, dims are positive and their product does not
// overflow, and each type id is one GGML defines (its block size is known;
// dequantize_tensor may still say kUnsupported, e.g. for IQ formats; ids GGML
// removed, like Q4_2, are rejected as kUnsupported at open). Metadata
// accessors never read out of bounds. A bad file yields Errc::kCorruptFile
// (or kUnsupported) with a message naming the file and the problem.
//
// Limits (a corrupt count never drives a large allocation): keys and tensor
// names <= 65535 bytes, string values <= 256 MiB, arrays nested <= 8 deep,
// <= 8M metadata values in total, every count checked against the bytes left.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/ggml_types.h"
#include "core/mapped_file.h"
#include "core/result.h"

namespace kvstack {

enum class GgufType : uint32_t {
  kU8 = 0,
  kI8 = 1,
  kU16 = 2,
  kI16 = 3,
  kU32 = 4,
  kI32 = 5,
  kF32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kU64 = 10,
  kI64 = 11,
  kF64 = 12,
};

// One metadata value. Arrays may nest (array of arrays).
struct GgufValue {
  GgufType type = GgufType::kU8;
  // Scalars: integers (signed or unsigned, bool) widened into i / u, floats into f.
  // An integer fills both i and u (u is the two's complement of a negative i)
  // and f (as double); a bool fills i / u with 0 or 1. Prefer the typed
  // getters on GgufFile, which check that the value fits.
  int64_t i = 0;
  uint64_t u = 0;
  double f = 0;
  std::string str;                     // kString
  GgufType elem_type = GgufType::kU8;  // kArray: element type
  std::vector<GgufValue> array;        // kArray (arrays of strings / numbers / arrays)
};

struct GgufTensor {
  std::string name;
  std::vector<int64_t> dims;  // ne[0] is the innermost (contiguous) dimension
  GgmlType type = GgmlType::kF32;
  uint64_t offset = 0;            // relative to the data section
  const uint8_t* data = nullptr;  // points into the mapping
  uint64_t n_bytes = 0;
  int64_t n_elements() const;
};

class GgufFile {
 public:
  static Result<GgufFile> open(const std::string& path, LoadMode mode = LoadMode::kMmap);
  // Parses an in-memory image (used by the fuzzer and tests). The buffer
  // must outlive the returned object.
  static Result<GgufFile> parse(const uint8_t* data, size_t size, const std::string& name);

  const std::string& path() const { return path_; }
  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }
  const uint8_t* file_data() const { return base_; }
  size_t file_size() const { return size_; }
  const MappedFile& mapping() const { return map_; }
  MappedFile& mapping() { return map_; }

  // Metadata, in file order.
  const std::vector<std::pair<std::string, GgufValue>>& metadata() const { return kv_; }
  const GgufValue* find(std::string_view key) const;

  // Typed getters: error (kNotFound / kCorruptFile) naming file and key if
  // missing or of an incompatible type. Integer getters accept any integer
  // type whose value fits.
  Result<std::string> get_string(std::string_view key) const;
  Result<uint64_t> get_u64(std::string_view key) const;
  Result<int64_t> get_i64(std::string_view key) const;
  Result<double> get_f64(std::string_view key) const;  // any numeric type
  Result<bool> get_bool(std::string_view key) const;
  Result<std::vector<std::string>> get_string_array(std::string_view key) const;
  Result<std::vector<int64_t>> get_int_array(std::string_view key) const;
  Result<std::vector<double>> get_float_array(std::string_view key) const;

  const std::vector<GgufTensor>& tensors() const { return tensors_; }
  const GgufTensor* find_tensor(std::string_view name) const;

 private:
  std::string path_;
  MappedFile map_;
  const uint8_t* base_ = nullptr;
  size_t size_ = 0;
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  std::vector<std::pair<std::string, GgufValue>> kv_;
  std::unordered_map<std::string, size_t> kv_index_;
  std::vector<GgufTensor> tensors_;
  std::unordered_map<std::string, size_t> tensor_index_;
};

}  // namespace kvstack
