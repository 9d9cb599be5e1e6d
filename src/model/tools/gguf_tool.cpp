// kvstack_gguf_tool: developer and test helper for the GGUF reader.
//
//   kvstack_gguf_tool list FILE                       metadata and tensor table
//   kvstack_gguf_tool dequant FILE TENSOR OUT.npy     tensor as f32 .npy (numpy shape order)
//   kvstack_gguf_tool dump FILE                       every tensor, in file order, as raw
//                                                     little-endian f32 on stdout
//   kvstack_gguf_tool write-samples DIR               tiny valid GGUF files (fuzz seeds)
//
// Exit status: 0 ok, 1 error (message on stderr), 2 usage.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/ggml_types.h"
#include "core/half.h"
#include "model/dequant.h"
#include "model/gguf.h"
#include "model/tools/gguf_builder.h"

namespace {

using kvstack::GgufFile;
using kvstack::GgufType;
using kvstack::GgufValue;

int usage() {
  std::fprintf(stderr,
               "usage: kvstack_gguf_tool list FILE\n"
               "       kvstack_gguf_tool dequant FILE TENSOR OUT.npy\n"
               "       kvstack_gguf_tool dump FILE\n"
               "       kvstack_gguf_tool write-samples DIR\n");
  return 2;
}

int fail(const kvstack::Error& e) {
  std::fprintf(stderr, "error [%s]: %s\n", kvstack::errc_name(e.code), e.message.c_str());
  return 1;
}

std::string show_value(const GgufValue& v, int depth = 0) {
  switch (v.type) {
    case GgufType::kString: {
      std::string s = "\"";
      s.append(v.str, 0, 60);
      s += v.str.size() > 60 ? "...\"" : "\"";
      return s;
    }
    case GgufType::kBool:
      return v.u != 0 ? "true" : "false";
    case GgufType::kF32:
    case GgufType::kF64:
      return std::to_string(v.f);
    case GgufType::kI8:
    case GgufType::kI16:
    case GgufType::kI32:
    case GgufType::kI64:
      return std::to_string(v.i);
    case GgufType::kArray: {
      std::string s = "[";
      s += std::to_string(v.array.size());
      s += "]{";
      for (size_t k = 0; k < v.array.size() && k < 4; ++k) {
        if (k > 0) s += ", ";
        s += show_value(v.array[k], depth + 1);
      }
      if (v.array.size() > 4) s += ", ...";
      return s + "}";
    }
    default:
      return std::to_string(v.u);
  }
}

int cmd_list(const std::string& path) {
  auto f = GgufFile::open(path);
  if (!f) return fail(f.error());
  std::printf("version %u  alignment %llu  kv %zu  tensors %zu\n", f->version(),
              static_cast<unsigned long long>(f->alignment()), f->metadata().size(),
              f->tensors().size());
  for (const auto& [key, value] : f->metadata()) {
    std::printf("kv %s = %s\n", key.c_str(), show_value(value).c_str());
  }
  for (const auto& t : f->tensors()) {
    std::string dims;
    for (int64_t d : t.dims) {
      if (!dims.empty()) dims += ',';
      dims += std::to_string(d);
    }
    std::printf("tensor %s %s [%s] offset %llu bytes %llu\n", t.name.c_str(),
                kvstack::ggml_type_name(t.type), dims.c_str(),
                static_cast<unsigned long long>(t.offset),
                static_cast<unsigned long long>(t.n_bytes));
  }
  return 0;
}

// .npy v1.0, little-endian f32, C order; shape is dims reversed (outermost first).
bool write_npy(const std::string& path, const std::vector<int64_t>& dims, const float* data,
               size_t n) {
  std::string shape = "(";
  for (auto it = dims.rbegin(); it != dims.rend(); ++it) shape += std::to_string(*it) + ", ";
  if (dims.size() > 1) shape.resize(shape.size() - 1);  // "(a, b)", but "(a,)" for 1-D
  shape += ")";
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': " + shape + ", }";
  const size_t unpadded = 10 + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header += '\n';
  std::ofstream out(path, std::ios::binary);
  if (!out) return false;
  out.write("\x93NUMPY\x01\x00", 8);
  const auto hlen = static_cast<uint16_t>(header.size());
  const char len_bytes[2] = {static_cast<char>(hlen & 0xff), static_cast<char>(hlen >> 8)};
  out.write(len_bytes, 2);
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(n * sizeof(float)));
  return static_cast<bool>(out);
}

int cmd_dequant(const std::string& path, const std::string& name, const std::string& out_path) {
  auto f = GgufFile::open(path);
  if (!f) return fail(f.error());
  const kvstack::GgufTensor* t = f->find_tensor(name);
  if (t == nullptr) {
    return fail(
        kvstack::make_error(kvstack::Errc::kNotFound, path + ": no tensor named '" + name + "'"));
  }
  std::vector<float> out(static_cast<size_t>(t->n_elements()));
  kvstack::Status s = kvstack::dequantize_tensor(*t, out.data());
  if (!s) return fail(s.error());
  if (!write_npy(out_path, t->dims, out.data(), out.size())) {
    return fail(kvstack::make_error(kvstack::Errc::kIo, out_path + ": cannot write"));
  }
  return 0;
}

int cmd_dump(const std::string& path) {
  auto f = GgufFile::open(path);
  if (!f) return fail(f.error());
  std::vector<float> out;
  for (const auto& t : f->tensors()) {
    out.resize(static_cast<size_t>(t.n_elements()));
    kvstack::Status s = kvstack::dequantize_tensor(t, out.data());
    if (!s) return fail(s.error());
    if (std::fwrite(out.data(), sizeof(float), out.size(), stdout) != out.size()) {
      return fail(kvstack::make_error(kvstack::Errc::kIo, "stdout: write failed"));
    }
  }
  return std::fflush(stdout) == 0 ? 0 : 1;
}

// A few tiny, valid files covering every value type, nested arrays, both
// versions, a non-default alignment and several tensor types.
int cmd_write_samples(const std::string& dir) {
  using namespace kvstack::testing;
  std::vector<std::pair<std::string, Bytes>> files;
  {
    GgufBuilder b;
    b.add_string("general.architecture", "llama");
    b.add_scalar<uint8_t>("t.u8", kVU8, 200);
    b.add_scalar<int8_t>("t.i8", kVI8, -100);
    b.add_scalar<uint16_t>("t.u16", kVU16, 60000);
    b.add_scalar<int16_t>("t.i16", kVI16, -30000);
    b.add_u32("t.u32", 4000000000u);
    b.add_scalar<int32_t>("t.i32", kVI32, -2000000000);
    b.add_scalar<uint64_t>("t.u64", kVU64, 1ull << 40);
    b.add_scalar<int64_t>("t.i64", kVI64, -(1ll << 40));
    b.add_scalar<float>("t.f32", kVF32, 1.5f);
    b.add_scalar<double>("t.f64", kVF64, -2.25);
    b.add_scalar<uint8_t>("t.bool", kVBool, 1);
    b.add_kv("t.strings", kVArray, string_array_value({"a", "bc", ""}));
    b.add_kv("t.ints", kVArray, scalar_array_value<int32_t>(kVI32, {1, -2, 3}));
    Bytes inner;
    const Bytes a1 = scalar_array_value<float>(kVF32, {0.5f, 1.0f});
    const Bytes a2 = string_array_value({"x"});
    put_bytes(inner, a1.data(), a1.size());
    put_bytes(inner, a2.data(), a2.size());
    b.add_kv("t.nested", kVArray, array_value(kVArray, 2, inner));
    Bytes f32(16 * 4, 0);
    for (int k = 0; k < 16; ++k) {
      const float v = static_cast<float>(k) - 3.5f;
      std::memcpy(f32.data() + 4 * k, &v, 4);
    }
    b.add_tensor("w.f32", {4, 4}, 0, f32);
    files.emplace_back("all_types.gguf", b.build());
  }
  {
    GgufBuilder b;
    b.alignment = 64;
    b.add_u32("general.alignment", 64);
    Bytes q4(2 * sizeof(kvstack::BlockQ4_0));
    Bytes q8(sizeof(kvstack::BlockQ8_0));
    for (size_t k = 0; k < q4.size(); ++k) q4[k] = static_cast<uint8_t>(k * 37 + 1);
    for (size_t k = 0; k < q8.size(); ++k) q8[k] = static_cast<uint8_t>(k * 11 + 5);
    const uint16_t one = kvstack::f32_to_f16(0.25f);
    std::memcpy(q4.data(), &one, 2);
    std::memcpy(q4.data() + sizeof(kvstack::BlockQ4_0), &one, 2);
    std::memcpy(q8.data(), &one, 2);
    b.add_tensor("w.q4_0", {32, 2}, 2, q4);
    b.add_tensor("w.q8_0", {32}, 8, q8);
    files.emplace_back("aligned64.gguf", b.build());
  }
  {
    GgufBuilder b;
    b.version = 2;
    b.add_string("general.name", "v2");
    Bytes q4k(sizeof(kvstack::BlockQ4_K), 0x5a);
    Bytes q6k(sizeof(kvstack::BlockQ6_K), 0xa5);
    Bytes f16(8 * 2);
    for (int k = 0; k < 8; ++k) {
      const uint16_t h = kvstack::f32_to_f16(static_cast<float>(k) * 0.5f);
      std::memcpy(f16.data() + 2 * k, &h, 2);
    }
    b.add_tensor("w.q4_k", {256}, 12, q4k);
    b.add_tensor("w.q6_k", {256}, 14, q6k);
    b.add_tensor("w.f16", {2, 2, 2}, 1, f16);
    files.emplace_back("v2_kquants.gguf", b.build());
  }
  files.emplace_back("empty.gguf", GgufBuilder{}.build());

  for (const auto& [name, bytes] : files) {
    const std::string path = (std::filesystem::path(dir) / name).string();
    std::ofstream out(path, std::ios::binary);
    out.write(reinterpret_cast<const char*>(bytes.data()),
              static_cast<std::streamsize>(bytes.size()));
    if (!out) return fail(kvstack::make_error(kvstack::Errc::kIo, path + ": cannot write"));
    // Every sample must itself be valid.
    auto f = GgufFile::parse(bytes.data(), bytes.size(), path);
    if (!f) return fail(f.error());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return usage();
  const std::string cmd = argv[1];
  if (cmd == "list" && argc == 3) return cmd_list(argv[2]);
  if (cmd == "dequant" && argc == 5) return cmd_dequant(argv[2], argv[3], argv[4]);
  if (cmd == "dump" && argc == 3) return cmd_dump(argv[2]);
  if (cmd == "write-samples" && argc == 3) return cmd_write_samples(argv[2]);
  return usage();
}
