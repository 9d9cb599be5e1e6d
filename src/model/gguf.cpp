#include "model/gguf.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>
#include <numeric>
#include <utility>

namespace kvstack {

static_assert(std::endian::native == std::endian::little,
              "the GGUF reader maps little-endian files directly");

namespace {

constexpr uint32_t kGgufMagic = 0x46554747;  // "GGUF" read as a little-endian u32
constexpr uint64_t kDefaultAlignment = 32;
constexpr uint32_t kMaxDims = 4;
// Arrays of arrays deeper than this are rejected (real files use depth 1).
constexpr int kMaxArrayDepth = 8;
// Total metadata values (scalars plus array elements, at every depth) a file
// may hold. Each costs sizeof(GgufValue) (~100 bytes) in memory, so this caps
// what a corrupt count over a large file can make us allocate at ~800 MB; the
// largest real vocabularies (tokens, scores, types, merges) need ~1.5 million.
constexpr uint64_t kMaxMetadataValues = uint64_t{1} << 23;
// Longest key / tensor name (the GGUF spec limits keys to 65535 bytes) and
// longest string value (chat templates, embedded tokenizer JSON: megabytes).
constexpr uint64_t kMaxNameBytes = 65535;
constexpr uint64_t kMaxStringValueBytes = uint64_t{256} << 20;
// Containers are reserved at most this far ahead of what was actually parsed,
// so a count alone never drives a large allocation.
constexpr uint64_t kMaxReserve = 4096;

// Smallest encodings, used to reject counts that cannot fit in what is left
// of the file before anything is allocated.
constexpr uint64_t kMinKvBytes = 8 + 4 + 1;                  // empty key, type, u8 value
constexpr uint64_t kMinTensorInfoBytes = 8 + 4 + 8 + 4 + 8;  // empty name, 1 dim

const char* value_type_name(GgufType t) {
  switch (t) {
    case GgufType::kU8:
      return "u8";
    case GgufType::kI8:
      return "i8";
    case GgufType::kU16:
      return "u16";
    case GgufType::kI16:
      return "i16";
    case GgufType::kU32:
      return "u32";
    case GgufType::kI32:
      return "i32";
    case GgufType::kF32:
      return "f32";
    case GgufType::kBool:
      return "bool";
    case GgufType::kString:
      return "string";
    case GgufType::kArray:
      return "array";
    case GgufType::kU64:
      return "u64";
    case GgufType::kI64:
      return "i64";
    case GgufType::kF64:
      return "f64";
  }
  return "invalid";
}

bool is_valid_value_type(uint32_t t) {
  return t <= static_cast<uint32_t>(GgufType::kF64);
}

// Encoded size of a scalar value type; 0 for string/array (variable).
uint64_t scalar_size(GgufType t) {
  switch (t) {
    case GgufType::kU8:
    case GgufType::kI8:
    case GgufType::kBool:
      return 1;
    case GgufType::kU16:
    case GgufType::kI16:
      return 2;
    case GgufType::kU32:
    case GgufType::kI32:
    case GgufType::kF32:
      return 4;
    case GgufType::kU64:
    case GgufType::kI64:
    case GgufType::kF64:
      return 8;
    case GgufType::kString:
    case GgufType::kArray:
      return 0;
  }
  return 0;
}

// Smallest possible encoding of one array element of type t.
uint64_t min_elem_size(GgufType t) {
  if (t == GgufType::kString) return 8;     // length only
  if (t == GgufType::kArray) return 4 + 8;  // element type + count
  return scalar_size(t);
}

bool is_integer_type(GgufType t) {
  switch (t) {
    case GgufType::kU8:
    case GgufType::kI8:
    case GgufType::kU16:
    case GgufType::kI16:
    case GgufType::kU32:
    case GgufType::kI32:
    case GgufType::kU64:
    case GgufType::kI64:
      return true;
    default:
      return false;
  }
}

bool is_signed_type(GgufType t) {
  return t == GgufType::kI8 || t == GgufType::kI16 || t == GgufType::kI32 || t == GgufType::kI64;
}

bool is_float_type(GgufType t) {
  return t == GgufType::kF32 || t == GgufType::kF64;
}

// A name from the file, made safe and short enough to quote in a message.
std::string quoted(std::string_view s) {
  constexpr size_t kMaxShown = 80;
  std::string out = "'";
  for (size_t i = 0; i < s.size() && i < kMaxShown; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c < 0x7f && c != '\'' && c != '\\') {
      out += static_cast<char>(c);
    } else {
      static const char kHex[] = "0123456789abcdef";
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    }
  }
  if (s.size() > kMaxShown) out += "...";
  out += "'";
  return out;
}

// Bounds-checked little-endian cursor over the file image. Every read checks
// the remaining length first; a failed read leaves an error naming the file,
// what was being read and the byte offset.
class Reader {
 public:
  Reader(const uint8_t* data, size_t size, const std::string& name)
      : data_(data), size_(size), name_(name) {}

  size_t pos() const { return pos_; }
  uint64_t remaining() const { return size_ - pos_; }
  const std::string& name() const { return name_; }

  Error error(const std::string& what) const { return error_at(pos_, what); }
  Error error_at(uint64_t offset, const std::string& what) const {
    return make_error(Errc::kCorruptFile,
                      name_ + ": " + what + " (at byte offset " + std::to_string(offset) + ")");
  }

  Status read_raw(void* dst, size_t n, const char* what) {
    if (n > remaining()) {
      return error("truncated file: " + std::string(what) + " needs " + std::to_string(n) +
                   " bytes, only " + std::to_string(remaining()) + " left");
    }
    if (n > 0) std::memcpy(dst, data_ + pos_, n);
    pos_ += n;
    return {};
  }
  template <class T>
  Status read(T* dst, const char* what) {
    return read_raw(dst, sizeof(T), what);
  }

  Status read_string(std::string* out, const char* what, uint64_t max_len) {
    const size_t at = pos_;
    uint64_t len = 0;
    KV_TRY_STATUS(read(&len, what));
    if (len > max_len) {
      return error_at(at, std::string(what) + " length " + std::to_string(len) +
                              " exceeds the limit of " + std::to_string(max_len) + " bytes");
    }
    if (len > remaining()) {
      return error_at(at, std::string(what) + " length " + std::to_string(len) + " exceeds the " +
                              std::to_string(remaining()) + " bytes left in the file");
    }
    out->assign(reinterpret_cast<const char*>(data_ + pos_), static_cast<size_t>(len));
    pos_ += static_cast<size_t>(len);
    return {};
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
  const std::string& name_;
};

// Parses metadata values, counting them against kMaxMetadataValues.
class ValueParser {
 public:
  explicit ValueParser(Reader& r) : r_(r) {}

  Status parse(GgufType type, GgufValue* out, int depth, const std::string& key) {
    if (++n_values_ > kMaxMetadataValues) return too_many(key);
    out->type = type;
    const size_t at = r_.pos();
    switch (type) {
      case GgufType::kU8:
        return read_unsigned<uint8_t>(out, key);
      case GgufType::kU16:
        return read_unsigned<uint16_t>(out, key);
      case GgufType::kU32:
        return read_unsigned<uint32_t>(out, key);
      case GgufType::kU64:
        return read_unsigned<uint64_t>(out, key);
      case GgufType::kI8:
        return read_signed<int8_t>(out, key);
      case GgufType::kI16:
        return read_signed<int16_t>(out, key);
      case GgufType::kI32:
        return read_signed<int32_t>(out, key);
      case GgufType::kI64:
        return read_signed<int64_t>(out, key);
      case GgufType::kBool: {
        uint8_t b = 0;
        KV_TRY_STATUS(r_.read(&b, "bool value"));
        out->u = b != 0 ? 1 : 0;
        out->i = static_cast<int64_t>(out->u);
        return {};
      }
      case GgufType::kF32: {
        float v = 0;
        KV_TRY_STATUS(r_.read(&v, "f32 value"));
        out->f = v;
        return {};
      }
      case GgufType::kF64: {
        double v = 0;
        KV_TRY_STATUS(r_.read(&v, "f64 value"));
        out->f = v;
        return {};
      }
      case GgufType::kString:
        return r_.read_string(&out->str, "string value", kMaxStringValueBytes);
      case GgufType::kArray:
        return parse_array(out, depth, key, at);
    }
    return r_.error_at(at, "key " + quoted(key) + ": invalid value type");
  }

 private:
  template <class T>
  Status read_unsigned(GgufValue* out, const std::string& key) {
    T v = 0;
    KV_TRY_STATUS(r_.read(&v, "integer value"));
    out->u = v;
    out->i = static_cast<int64_t>(out->u);
    out->f = static_cast<double>(v);
    return {};
  }
  template <class T>
  Status read_signed(GgufValue* out, const std::string& key) {
    T v = 0;
    KV_TRY_STATUS(r_.read(&v, "integer value"));
    out->i = static_cast<int64_t>(v);  // NOLINT(bugprone-signed-char-misuse): sign-extend
    out->u = static_cast<uint64_t>(out->i);
    out->f = static_cast<double>(v);
    return {};
  }

  Status parse_array(GgufValue* out, int depth, const std::string& key, size_t at) {
    if (depth >= kMaxArrayDepth) {
      return r_.error_at(at, "key " + quoted(key) + ": arrays nested deeper than " +
                                 std::to_string(kMaxArrayDepth) + " levels");
    }
    uint32_t elem_type = 0;
    KV_TRY_STATUS(r_.read(&elem_type, "array element type"));
    if (!is_valid_value_type(elem_type)) {
      return r_.error_at(at, "key " + quoted(key) + ": unknown array element type id " +
                                 std::to_string(elem_type));
    }
    out->elem_type = static_cast<GgufType>(elem_type);
    uint64_t count = 0;
    KV_TRY_STATUS(r_.read(&count, "array length"));
    const uint64_t min_size = min_elem_size(out->elem_type);
    if (count > r_.remaining() / min_size) {
      return r_.error_at(at, "key " + quoted(key) + ": array of " + std::to_string(count) + " " +
                                 value_type_name(out->elem_type) + " elements cannot fit in the " +
                                 std::to_string(r_.remaining()) + " bytes left in the file");
    }
    if (count > kMaxMetadataValues - std::min(n_values_, kMaxMetadataValues)) {
      return too_many(key);
    }
    out->array.reserve(static_cast<size_t>(std::min(count, kMaxReserve)));
    for (uint64_t k = 0; k < count; ++k) {
      KV_TRY_STATUS(parse(out->elem_type, &out->array.emplace_back(), depth + 1, key));
    }
    return {};
  }

  Error too_many(const std::string& key) const {
    return r_.error("key " + quoted(key) + ": more than " + std::to_string(kMaxMetadataValues) +
                    " metadata values in the file");
  }

  Reader& r_;
  uint64_t n_values_ = 0;
};

bool checked_mul(uint64_t a, uint64_t b, uint64_t* out) {
  return !__builtin_mul_overflow(a, b, out);
}
bool checked_add(uint64_t a, uint64_t b, uint64_t* out) {
  return !__builtin_add_overflow(a, b, out);
}

}  // namespace

int64_t GgufTensor::n_elements() const {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  return n;
}

Result<GgufFile> GgufFile::open(const std::string& path, LoadMode mode) {
  Result<MappedFile> map = MappedFile::open(path, mode);
  if (!map) return map.error();
  Result<GgufFile> file = parse(map->data(), map->size(), path);
  if (!file) return file.error();
  // Moving the mapping keeps its address, so tensor pointers stay valid.
  file->map_ = std::move(*map);
  return file;
}

Result<GgufFile> GgufFile::parse(const uint8_t* data, size_t size, const std::string& name) {
  GgufFile f;
  f.path_ = name;
  f.base_ = data;
  f.size_ = size;
  Reader r(data, size, f.path_);

  // Header.
  uint32_t magic = 0;
  if (size < 4) {
    return r.error("not a GGUF file: " + std::to_string(size) + " bytes is too small");
  }
  KV_TRY_STATUS(r.read(&magic, "magic"));
  if (magic != kGgufMagic) {
    return r.error_at(0, "not a GGUF file: bad magic (expected \"GGUF\")");
  }
  KV_TRY_STATUS(r.read(&f.version_, "version"));
  if (f.version_ != 2 && f.version_ != 3) {
    const std::string v = std::to_string(f.version_);
    if (f.version_ == 1) {
      return make_error(Errc::kUnsupported,
                        f.path_ + ": GGUF version 1 is not supported (only versions 2 and 3)");
    }
    if (f.version_ == 0x02000000u || f.version_ == 0x03000000u) {
      return make_error(
          Errc::kUnsupported,
          f.path_ + ": big-endian GGUF files are not supported (version field " + v + ")");
    }
    if (f.version_ > 3 && f.version_ < 256) {
      return make_error(Errc::kUnsupported, f.path_ + ": GGUF version " + v +
                                                " is not supported (only versions 2 and 3)");
    }
    return r.error_at(4, "unsupported GGUF version " + v + " (expected 2 or 3)");
  }
  uint64_t n_tensors = 0;
  uint64_t n_kv = 0;
  KV_TRY_STATUS(r.read(&n_tensors, "tensor count"));
  KV_TRY_STATUS(r.read(&n_kv, "metadata key/value count"));
  if (n_kv > r.remaining() / kMinKvBytes) {
    return r.error_at(16, "metadata key/value count " + std::to_string(n_kv) +
                              " cannot fit in the " + std::to_string(r.remaining()) +
                              " bytes left in the file");
  }
  if (n_tensors > r.remaining() / kMinTensorInfoBytes) {
    return r.error_at(8, "tensor count " + std::to_string(n_tensors) + " cannot fit in the " +
                             std::to_string(r.remaining()) + " bytes left in the file");
  }

  // Metadata.
  ValueParser values(r);
  f.kv_.reserve(static_cast<size_t>(std::min(n_kv, kMaxReserve)));
  for (uint64_t k = 0; k < n_kv; ++k) {
    const size_t at = r.pos();
    std::string key;
    KV_TRY_STATUS(r.read_string(&key, "metadata key", kMaxNameBytes));
    if (f.kv_index_.count(key) != 0) return r.error_at(at, "duplicate metadata key " + quoted(key));
    uint32_t type = 0;
    KV_TRY_STATUS(r.read(&type, "metadata value type"));
    if (!is_valid_value_type(type)) {
      return r.error_at(at,
                        "key " + quoted(key) + ": unknown value type id " + std::to_string(type));
    }
    GgufValue value;
    KV_TRY_STATUS(values.parse(static_cast<GgufType>(type), &value, 0, key));
    f.kv_index_.emplace(key, f.kv_.size());
    f.kv_.emplace_back(std::move(key), std::move(value));
  }

  if (const GgufValue* a = f.find("general.alignment")) {
    if (!is_integer_type(a->type) || (is_signed_type(a->type) && a->i <= 0) || a->u == 0 ||
        !std::has_single_bit(a->u)) {
      const std::string shown =
          is_integer_type(a->type)
              ? (is_signed_type(a->type) ? std::to_string(a->i) : std::to_string(a->u))
              : std::string("of type ") + value_type_name(a->type);
      return make_error(Errc::kCorruptFile, f.path_ + ": general.alignment " + shown +
                                                " is not a nonzero power of two");
    }
    f.alignment_ = a->u;
  } else {
    f.alignment_ = kDefaultAlignment;
  }

  // Tensor infos.
  f.tensors_.reserve(static_cast<size_t>(std::min(n_tensors, kMaxReserve)));
  for (uint64_t t = 0; t < n_tensors; ++t) {
    const size_t at = r.pos();
    GgufTensor ti;
    KV_TRY_STATUS(r.read_string(&ti.name, "tensor name", kMaxNameBytes));
    const std::string where = "tensor " + quoted(ti.name);
    if (f.tensor_index_.count(ti.name) != 0) return r.error_at(at, "duplicate " + where);
    uint32_t n_dims = 0;
    KV_TRY_STATUS(r.read(&n_dims, "tensor n_dims"));
    if (n_dims == 0 || n_dims > kMaxDims) {
      return r.error_at(at, where + ": n_dims " + std::to_string(n_dims) + " is not in 1.." +
                                std::to_string(kMaxDims));
    }
    uint64_t n_elements = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      uint64_t ne = 0;
      KV_TRY_STATUS(r.read(&ne, "tensor dimension"));
      if (ne == 0 || ne > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return r.error_at(
            at, where + ": dimension " + std::to_string(d) + " has size " + std::to_string(ne));
      }
      if (!checked_mul(n_elements, ne, &n_elements) ||
          n_elements > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return r.error_at(at, where + ": element count overflows");
      }
      ti.dims.push_back(static_cast<int64_t>(ne));
    }
    uint32_t type_id = 0;
    KV_TRY_STATUS(r.read(&type_id, "tensor type"));
    const GgmlTypeTraits* traits = ggml_type_traits(type_id);
    if (traits == nullptr) {
      if (const char* removed = ggml_removed_type_name(type_id)) {
        return make_error(Errc::kUnsupported,
                          f.path_ + ": " + where + " has type " + removed + " (id " +
                              std::to_string(type_id) +
                              "), which GGML has removed; it is not supported (at byte offset " +
                              std::to_string(at) + ")");
      }
      return r.error_at(at, where + ": unknown type id " + std::to_string(type_id));
    }
    ti.type = static_cast<GgmlType>(type_id);
    const auto ne0 = static_cast<uint64_t>(ti.dims[0]);
    if (ne0 % static_cast<uint64_t>(traits->block_elems) != 0) {
      return r.error_at(at, where + ": row length " + std::to_string(ne0) +
                                " is not a multiple of the " + traits->name + " block size " +
                                std::to_string(traits->block_elems));
    }
    // ne0 * block_bytes / block_elems <= ne0 * 8 and n_rows * row < 2^63 * 8:
    // still checked, since a u64 product can overflow.
    const uint64_t row_bytes = ne0 / static_cast<uint64_t>(traits->block_elems) *
                               static_cast<uint64_t>(traits->block_bytes);
    if (!checked_mul(row_bytes, n_elements / ne0, &ti.n_bytes)) {
      return r.error_at(at, where + ": byte size overflows");
    }
    KV_TRY_STATUS(r.read(&ti.offset, "tensor offset"));
    if (ti.offset % f.alignment_ != 0) {
      return r.error_at(at, where + ": data offset " + std::to_string(ti.offset) +
                                " is not a multiple of the alignment " +
                                std::to_string(f.alignment_));
    }
    f.tensor_index_.emplace(ti.name, f.tensors_.size());
    f.tensors_.push_back(std::move(ti));
  }

  // Data section: starts at the next multiple of the alignment.
  const uint64_t info_end = r.pos();
  const uint64_t rem = info_end % f.alignment_;
  uint64_t data_start = info_end;
  if (rem != 0 && !checked_add(info_end, f.alignment_ - rem, &data_start)) {
    return r.error("data section start overflows");
  }
  for (GgufTensor& ti : f.tensors_) {
    uint64_t start = 0;
    uint64_t end = 0;
    if (!checked_add(data_start, ti.offset, &start) || !checked_add(start, ti.n_bytes, &end) ||
        end > size) {
      return make_error(Errc::kCorruptFile,
                        f.path_ + ": tensor " + quoted(ti.name) + ": data [" +
                            std::to_string(ti.offset) + ", +" + std::to_string(ti.n_bytes) +
                            ") from data section start " + std::to_string(data_start) +
                            " runs past the end of the file (" + std::to_string(size) + " bytes)");
    }
    ti.data = data + start;
  }

  // Overlap: sort by offset, each tensor must end before the next begins.
  std::vector<size_t> order(f.tensors_.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return f.tensors_[a].offset < f.tensors_[b].offset; });
  for (size_t k = 1; k < order.size(); ++k) {
    const GgufTensor& prev = f.tensors_[order[k - 1]];
    const GgufTensor& cur = f.tensors_[order[k]];
    if (prev.offset + prev.n_bytes > cur.offset) {
      return make_error(Errc::kCorruptFile,
                        f.path_ + ": tensors " + quoted(prev.name) + " (data offset " +
                            std::to_string(prev.offset) + ", " + std::to_string(prev.n_bytes) +
                            " bytes) and " + quoted(cur.name) + " (data offset " +
                            std::to_string(cur.offset) + ") overlap");
    }
  }
  return f;
}

const GgufValue* GgufFile::find(std::string_view key) const {
  auto it = kv_index_.find(std::string(key));
  return it == kv_index_.end() ? nullptr : &kv_[it->second].second;
}

const GgufTensor* GgufFile::find_tensor(std::string_view name) const {
  auto it = tensor_index_.find(std::string(name));
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

namespace {

Error missing_key(const std::string& path, std::string_view key) {
  return make_error(Errc::kNotFound, path + ": metadata key " + quoted(key) + " not found");
}

Error wrong_type(const std::string& path, std::string_view key, const GgufValue& v,
                 const char* expected) {
  std::string actual = value_type_name(v.type);
  if (v.type == GgufType::kArray) actual += std::string(" of ") + value_type_name(v.elem_type);
  return make_error(Errc::kCorruptFile, path + ": metadata key " + quoted(key) + " has type " +
                                            actual + ", expected " + expected);
}

Error out_of_range(const std::string& path, std::string_view key, const GgufValue& v,
                   const char* expected) {
  const std::string shown = is_signed_type(v.type) ? std::to_string(v.i) : std::to_string(v.u);
  return make_error(Errc::kCorruptFile, path + ": metadata key " + quoted(key) + " value " + shown +
                                            " does not fit in " + expected);
}

bool to_i64(const GgufValue& v, int64_t* out) {
  if (!is_integer_type(v.type)) return false;
  if (!is_signed_type(v.type) && v.u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return false;
  }
  *out = is_signed_type(v.type) ? v.i : static_cast<int64_t>(v.u);
  return true;
}

bool to_f64(const GgufValue& v, double* out) {
  if (is_float_type(v.type)) {
    *out = v.f;
  } else if (is_signed_type(v.type)) {
    *out = static_cast<double>(v.i);
  } else if (is_integer_type(v.type)) {
    *out = static_cast<double>(v.u);
  } else {
    return false;
  }
  return true;
}

}  // namespace

Result<std::string> GgufFile::get_string(std::string_view key) const {
  const GgufValue* v = find(key);
  if (v == nullptr) return missing_key(path_, key);
  if (v->type != GgufType::kString) return wrong_type(path_, key, *v, "string");
  return v->str;
}

Result<uint64_t> GgufFile::get_u64(std::string_view key) const {
  const GgufValue* v = find(key);
  if (v == nullptr) return missing_key(path_, key);
  if (!is_integer_type(v->type)) return wrong_type(path_, key, *v, "an integer");
  if (is_signed_type(v->type) && v->i < 0) return out_of_range(path_, key, *v, "u64");
  return v->u;
}

Result<int64_t> GgufFile::get_i64(std::string_view key) const {
  const GgufValue* v = find(key);
  if (v == nullptr) return missing_key(path_, key);
  if (!is_integer_type(v->type)) return wrong_type(path_, key, *v, "an integer");
  int64_t out = 0;
  if (!to_i64(*v, &out)) return out_of_range(path_, key, *v, "i64");
  return out;
}

Result<double> GgufFile::get_f64(std::string_view key) const {
  const GgufValue* v = find(key);
  if (v == nullptr) return missing_key(path_, key);
  double out = 0;
  if (!to_f64(*v, &out)) return wrong_type(path_, key, *v, "a number");
  return out;
}

Result<bool> GgufFile::get_bool(std::string_view key) const {
  const GgufValue* v = find(key);
  if (v == nullptr) return missing_key(path_, key);
  if (v->type != GgufType::kBool) return wrong_type(path_, key, *v, "bool");
  return v->u != 0;
}

Result<std::vector<std::string>> GgufFile::get_string_array(std::string_view key) const {
  const GgufValue* v = find(key);
  if (v == nullptr) return missing_key(path_, key);
  if (v->type != GgufType::kArray || v->elem_type != GgufType::kString) {
    return wrong_type(path_, key, *v, "array of string");
  }
  std::vector<std::string> out;
  out.reserve(v->array.size());
  for (const GgufValue& e : v->array) out.push_back(e.str);
  return out;
}

Result<std::vector<int64_t>> GgufFile::get_int_array(std::string_view key) const {
  const GgufValue* v = find(key);
  if (v == nullptr) return missing_key(path_, key);
  if (v->type != GgufType::kArray || !is_integer_type(v->elem_type)) {
    return wrong_type(path_, key, *v, "array of integers");
  }
  std::vector<int64_t> out(v->array.size());
  for (size_t k = 0; k < out.size(); ++k) {
    if (!to_i64(v->array[k], &out[k])) {
      return make_error(Errc::kCorruptFile,
                        path_ + ": metadata key " + quoted(key) + " element " + std::to_string(k) +
                            " value " + std::to_string(v->array[k].u) + " does not fit in i64");
    }
  }
  return out;
}

Result<std::vector<double>> GgufFile::get_float_array(std::string_view key) const {
  const GgufValue* v = find(key);
  if (v == nullptr) return missing_key(path_, key);
  if (v->type != GgufType::kArray ||
      !(is_integer_type(v->elem_type) || is_float_type(v->elem_type))) {
    return wrong_type(path_, key, *v, "array of numbers");
  }
  std::vector<double> out(v->array.size());
  for (size_t k = 0; k < out.size(); ++k) (void)to_f64(v->array[k], &out[k]);
  return out;
}

}  // namespace kvstack
