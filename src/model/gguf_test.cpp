#include "model/gguf.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "model/tools/gguf_builder.h"

namespace kvstack {
namespace {

using testing::array_value;
using testing::Bytes;
using testing::GgufBuilder;
using testing::put;
using testing::scalar_array_value;
using testing::string_array_value;
using namespace testing;  // NOLINT: VType enumerators

constexpr char kName[] = "test.gguf";

Result<GgufFile> parse(const Bytes& b) {
  return GgufFile::parse(b.data(), b.size(), kName);
}

Bytes f32_bytes(const std::vector<float>& v) {
  Bytes b(v.size() * 4);
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

// One file with every value type, nested arrays and two tensors.
GgufBuilder all_types_builder() {
  GgufBuilder b;
  b.add_string("general.architecture", "llama");
  b.add_scalar<uint8_t>("v.u8", kVU8, 250);
  b.add_scalar<int8_t>("v.i8", kVI8, -7);
  b.add_scalar<uint16_t>("v.u16", kVU16, 65535);
  b.add_scalar<int16_t>("v.i16", kVI16, -32768);
  b.add_u32("v.u32", 4294967295u);
  b.add_scalar<int32_t>("v.i32", kVI32, -123456);
  b.add_scalar<uint64_t>("v.u64", kVU64, std::numeric_limits<uint64_t>::max());
  b.add_scalar<int64_t>("v.i64", kVI64, std::numeric_limits<int64_t>::min());
  b.add_scalar<float>("v.f32", kVF32, 0.375f);
  b.add_scalar<double>("v.f64", kVF64, -1e300);
  b.add_scalar<uint8_t>("v.bool", kVBool, 1);
  b.add_scalar<uint8_t>("v.bool_false", kVBool, 0);
  b.add_string("v.empty_string", "");
  b.add_kv("a.strings", kVArray, string_array_value({"hello", "", "w\xc3\xb6rld"}));
  b.add_kv("a.u8", kVArray, scalar_array_value<uint8_t>(kVU8, {1, 2, 255}));
  b.add_kv("a.i16", kVArray, scalar_array_value<int16_t>(kVI16, {-1, 300}));
  b.add_kv("a.u64", kVArray, scalar_array_value<uint64_t>(kVU64, {1ull << 63}));
  b.add_kv("a.f32", kVArray, scalar_array_value<float>(kVF32, {0.5f, -2.0f}));
  b.add_kv("a.f64", kVArray, scalar_array_value<double>(kVF64, {3.25}));
  b.add_kv("a.bool", kVArray, scalar_array_value<uint8_t>(kVBool, {1, 0}));
  b.add_kv("a.empty", kVArray, array_value(kVI32, 0, {}));
  // [[1, 2], [3]] as arrays of i32, and [[["deep"]]] three levels down.
  Bytes inner;
  const Bytes i1 = scalar_array_value<int32_t>(kVI32, {1, 2});
  const Bytes i2 = scalar_array_value<int32_t>(kVI32, {3});
  testing::put_bytes(inner, i1.data(), i1.size());
  testing::put_bytes(inner, i2.data(), i2.size());
  b.add_kv("a.nested", kVArray, array_value(kVArray, 2, inner));
  const Bytes deep = array_value(kVArray, 1, array_value(kVArray, 1, string_array_value({"deep"})));
  b.add_kv("a.deep", kVArray, deep);
  b.add_tensor("w.a", {4, 2}, 0, f32_bytes({1, 2, 3, 4, 5, 6, 7, 8}));
  b.add_tensor("w.b", {3}, 0, f32_bytes({-1, -2, -3}));
  return b;
}

TEST(Gguf, ParsesEveryValueType) {
  const Bytes img = all_types_builder().build();
  auto f = parse(img);
  ASSERT_TRUE(f.ok()) << f.error().message;
  EXPECT_EQ(f->version(), 3u);
  EXPECT_EQ(f->alignment(), 32u);
  EXPECT_EQ(f->path(), kName);
  ASSERT_EQ(f->metadata().size(), 24u);
  EXPECT_EQ(f->metadata()[0].first, "general.architecture");  // file order kept

  EXPECT_EQ(*f->get_string("general.architecture"), "llama");
  EXPECT_EQ(*f->get_u64("v.u8"), 250u);
  EXPECT_EQ(*f->get_i64("v.i8"), -7);
  EXPECT_EQ(*f->get_u64("v.u16"), 65535u);
  EXPECT_EQ(*f->get_i64("v.i16"), -32768);
  EXPECT_EQ(*f->get_u64("v.u32"), 4294967295u);
  EXPECT_EQ(*f->get_i64("v.i32"), -123456);
  EXPECT_EQ(*f->get_u64("v.u64"), std::numeric_limits<uint64_t>::max());
  EXPECT_EQ(*f->get_i64("v.i64"), std::numeric_limits<int64_t>::min());
  EXPECT_EQ(*f->get_f64("v.f32"), 0.375);
  EXPECT_EQ(*f->get_f64("v.f64"), -1e300);
  EXPECT_TRUE(*f->get_bool("v.bool"));
  EXPECT_FALSE(*f->get_bool("v.bool_false"));
  EXPECT_EQ(*f->get_string("v.empty_string"), "");

  EXPECT_EQ(*f->get_string_array("a.strings"),
            (std::vector<std::string>{"hello", "", "w\xc3\xb6rld"}));
  EXPECT_EQ(*f->get_int_array("a.u8"), (std::vector<int64_t>{1, 2, 255}));
  EXPECT_EQ(*f->get_int_array("a.i16"), (std::vector<int64_t>{-1, 300}));
  EXPECT_EQ(*f->get_float_array("a.f32"), (std::vector<double>{0.5, -2.0}));
  EXPECT_EQ(*f->get_float_array("a.f64"), (std::vector<double>{3.25}));
  EXPECT_EQ(*f->get_float_array("a.i16"), (std::vector<double>{-1.0, 300.0}));
  EXPECT_TRUE(f->get_int_array("a.empty")->empty());
  const GgufValue* bools = f->find("a.bool");
  ASSERT_NE(bools, nullptr);
  EXPECT_EQ(bools->elem_type, GgufType::kBool);
  ASSERT_EQ(bools->array.size(), 2u);
  EXPECT_EQ(bools->array[0].u, 1u);
  EXPECT_EQ(bools->array[1].u, 0u);
}

TEST(Gguf, NestedArrays) {
  const Bytes img = all_types_builder().build();
  auto f = parse(img);
  ASSERT_TRUE(f.ok()) << f.error().message;
  const GgufValue* v = f->find("a.nested");
  ASSERT_NE(v, nullptr);
  EXPECT_EQ(v->type, GgufType::kArray);
  EXPECT_EQ(v->elem_type, GgufType::kArray);
  ASSERT_EQ(v->array.size(), 2u);
  EXPECT_EQ(v->array[0].elem_type, GgufType::kI32);
  ASSERT_EQ(v->array[0].array.size(), 2u);
  EXPECT_EQ(v->array[0].array[1].i, 2);
  ASSERT_EQ(v->array[1].array.size(), 1u);
  EXPECT_EQ(v->array[1].array[0].i, 3);
  const GgufValue* d = f->find("a.deep");
  ASSERT_NE(d, nullptr);
  ASSERT_EQ(d->array.size(), 1u);
  ASSERT_EQ(d->array[0].array.size(), 1u);
  ASSERT_EQ(d->array[0].array[0].array.size(), 1u);
  EXPECT_EQ(d->array[0].array[0].array[0].str, "deep");
  // Typed getters do not flatten nested arrays.
  EXPECT_EQ(f->get_int_array("a.nested").error().code, Errc::kCorruptFile);
}

TEST(Gguf, GetterTypeRulesNameFileAndKey) {
  const Bytes img = all_types_builder().build();
  auto f = parse(img);
  ASSERT_TRUE(f.ok());
  auto missing = f->get_u64("no.such.key");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.error().code, Errc::kNotFound);
  EXPECT_NE(missing.error().message.find("test.gguf: "), std::string::npos);
  EXPECT_NE(missing.error().message.find("'no.such.key'"), std::string::npos);

  auto neg = f->get_u64("v.i8");  // -7 does not fit
  ASSERT_FALSE(neg.ok());
  EXPECT_EQ(neg.error().code, Errc::kCorruptFile);
  EXPECT_NE(neg.error().message.find("'v.i8' value -7 does not fit"), std::string::npos);

  auto big = f->get_i64("v.u64");  // 2^64-1 does not fit in i64
  ASSERT_FALSE(big.ok());
  EXPECT_NE(big.error().message.find("does not fit in i64"), std::string::npos);

  auto str_as_int = f->get_u64("general.architecture");
  ASSERT_FALSE(str_as_int.ok());
  EXPECT_EQ(str_as_int.error().code, Errc::kCorruptFile);
  EXPECT_EQ(str_as_int.error().message,
            "test.gguf: metadata key 'general.architecture' has type string, expected an integer");

  EXPECT_FALSE(f->get_u64("v.f32").ok());         // float is not an integer
  EXPECT_EQ(*f->get_f64("v.u32"), 4294967295.0);  // any numeric as f64
  EXPECT_FALSE(f->get_f64("v.bool").ok());
  EXPECT_FALSE(f->get_bool("v.u8").ok());
  EXPECT_FALSE(f->get_string("v.u8").ok());
  auto wrong_array = f->get_string_array("a.u8");
  ASSERT_FALSE(wrong_array.ok());
  EXPECT_NE(wrong_array.error().message.find("has type array of u8, expected array of string"),
            std::string::npos);
  EXPECT_FALSE(f->get_int_array("a.f32").ok());
  EXPECT_FALSE(f->get_float_array("a.strings").ok());
  EXPECT_FALSE(f->get_int_array("a.u64").ok());  // 2^63 does not fit in i64
}

TEST(Gguf, TensorsAreZeroCopyAndValidated) {
  const Bytes img = all_types_builder().build();
  auto f = parse(img);
  ASSERT_TRUE(f.ok()) << f.error().message;
  ASSERT_EQ(f->tensors().size(), 2u);
  const GgufTensor* a = f->find_tensor("w.a");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->dims, (std::vector<int64_t>{4, 2}));
  EXPECT_EQ(a->type, GgmlType::kF32);
  EXPECT_EQ(a->n_elements(), 8);
  EXPECT_EQ(a->n_bytes, 32u);
  EXPECT_EQ(a->offset, 0u);
  EXPECT_GE(a->data, img.data());
  EXPECT_EQ((a->data - img.data()) % 32, 0);  // data section aligned
  float v[8];
  std::memcpy(v, a->data, sizeof(v));
  EXPECT_EQ(v[0], 1.0f);
  EXPECT_EQ(v[7], 8.0f);
  const GgufTensor* b = f->find_tensor("w.b");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->offset, 32u);
  EXPECT_EQ(b->data, a->data + 32);
  EXPECT_EQ(b->data + b->n_bytes, img.data() + img.size());
  EXPECT_EQ(f->find_tensor("w.c"), nullptr);
}

TEST(Gguf, CustomAlignment) {
  for (uint32_t align : {1u, 8u, 64u, 4096u}) {
    GgufBuilder b;
    b.alignment = align;
    b.add_u32("general.alignment", align);
    b.add_tensor("x", {3}, 0, f32_bytes({1, 2, 3}));
    b.add_tensor("y", {1}, 0, f32_bytes({4}));
    const Bytes img = b.build();
    auto f = parse(img);
    ASSERT_TRUE(f.ok()) << align << ": " << f.error().message;
    EXPECT_EQ(f->alignment(), align);
    const GgufTensor* y = f->find_tensor("y");
    ASSERT_NE(y, nullptr);
    EXPECT_EQ(y->offset % align, 0u);
    EXPECT_EQ((f->find_tensor("x")->data - img.data()) % align, 0);
    float val;
    std::memcpy(&val, y->data, 4);
    EXPECT_EQ(val, 4.0f);
  }
}

TEST(Gguf, VersionTwoAndEmptyFileAccepted) {
  GgufBuilder b;
  b.version = 2;
  b.add_string("k", "v");
  auto f2 = parse(b.build());
  ASSERT_TRUE(f2.ok()) << f2.error().message;
  EXPECT_EQ(f2->version(), 2u);
  auto empty = parse(GgufBuilder{}.build());
  ASSERT_TRUE(empty.ok()) << empty.error().message;
  EXPECT_TRUE(empty->metadata().empty());
  EXPECT_TRUE(empty->tensors().empty());
}

TEST(Gguf, OpenMapsFileFromDisk) {
  const Bytes img = all_types_builder().build();
  char path[] = "/tmp/kvstack_gguf_test_XXXXXX";
  const int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(write(fd, img.data(), img.size()), static_cast<ssize_t>(img.size()));
  close(fd);
  {
    auto f = GgufFile::open(path);
    ASSERT_TRUE(f.ok()) << f.error().message;
    EXPECT_EQ(f->path(), path);
    EXPECT_EQ(f->file_size(), img.size());
    EXPECT_EQ(f->mapping().data(), f->file_data());
    const GgufTensor* a = f->find_tensor("w.a");
    ASSERT_NE(a, nullptr);
    EXPECT_GE(a->data, f->file_data());
    EXPECT_LE(a->data + a->n_bytes, f->file_data() + f->file_size());
    // Moving the file keeps tensor pointers valid (the mapping does not move).
    GgufFile moved = std::move(f).value();
    float v;
    std::memcpy(&v, moved.find_tensor("w.b")->data, 4);
    EXPECT_EQ(v, -1.0f);
  }
  // A corrupt file on disk: the message names the path.
  Bytes bad = img;
  bad[0] = 'X';
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(bad.data()), static_cast<std::streamsize>(bad.size()));
  auto f = GgufFile::open(path);
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.error().code, Errc::kCorruptFile);
  EXPECT_EQ(f.error().message.rfind(std::string(path) + ": ", 0), 0u);
  std::remove(path);
  auto gone = GgufFile::open(path);
  ASSERT_FALSE(gone.ok());
  EXPECT_EQ(gone.error().code, Errc::kIo);
}

// --- Hostile and corrupt files -------------------------------------------

struct Hostile {
  const char* name;
  std::function<Bytes()> make;
  Errc code;
  const char* fragment;  // must appear in the message
};

Bytes with(const std::function<void(GgufBuilder&)>& edit) {
  GgufBuilder b;
  b.add_string("general.architecture", "llama");
  edit(b);
  return b.build();
}

// Header, then one raw kv entry (key, type id, raw value bytes).
Bytes raw_kv(uint32_t type, const Bytes& value) {
  GgufBuilder b;
  b.add_kv("bad.key", type, value);
  return b.build();
}

Bytes nested(int depth) {
  Bytes v = scalar_array_value<uint8_t>(kVU8, {1});
  for (int d = 1; d < depth; ++d) v = array_value(kVArray, 1, v);
  return v;
}

std::vector<Hostile> hostile_cases() {
  const Bytes q4_block(18, 0);
  return {
      {"bad magic", [] { return with([](GgufBuilder& b) { b.magic = 0x46554746; }); },
       Errc::kCorruptFile, "bad magic"},
      {"too small",
       [] {
         return Bytes{'G', 'G'};
       },
       Errc::kCorruptFile, "too small"},
      {"version 1", [] { return with([](GgufBuilder& b) { b.version = 1; }); }, Errc::kUnsupported,
       "GGUF version 1 is not supported"},
      {"version 0", [] { return with([](GgufBuilder& b) { b.version = 0; }); }, Errc::kCorruptFile,
       "unsupported GGUF version 0"},
      {"big endian", [] { return with([](GgufBuilder& b) { b.version = 0x03000000; }); },
       Errc::kUnsupported, "big-endian"},
      {"huge kv count",
       [] { return with([](GgufBuilder& b) { b.kv_count_override = 1ull << 60; }); },
       Errc::kCorruptFile, "metadata key/value count 1152921504606846976 cannot fit"},
      {"huge tensor count",
       [] { return with([](GgufBuilder& b) { b.tensor_count_override = ~0ull; }); },
       Errc::kCorruptFile, "tensor count 18446744073709551615 cannot fit"},
      {"kv count one too many",
       [] { return with([](GgufBuilder& b) { b.kv_count_override = 2; }); }, Errc::kCorruptFile,
       "truncated file"},
      {"huge key length",
       [] {
         Bytes img = GgufBuilder{}.build();
         img[16] = 1;  // kv count 1
         put<uint64_t>(img, 1ull << 62);
         img.resize(img.size() + 20, 'k');
         return img;
       },
       Errc::kCorruptFile, "metadata key length 4611686018427387904 exceeds"},
      {"key over the 65535-byte limit",
       [] {
         GgufBuilder b;
         b.add_string(std::string(70000, 'k'), "v");
         return b.build();
       },
       Errc::kCorruptFile, "metadata key length 70000 exceeds the limit of 65535 bytes"},
      {"huge string value length",
       [] {
         Bytes v;
         put<uint64_t>(v, ~0ull);
         return raw_kv(kVString, v);
       },
       Errc::kCorruptFile, "string value length 18446744073709551615 exceeds"},
      {"huge array length", [] { return raw_kv(kVArray, array_value(kVU32, 1ull << 40, {})); },
       Errc::kCorruptFile, "key 'bad.key': array of 1099511627776 u32 elements cannot fit"},
      {"huge string array length",
       [] { return raw_kv(kVArray, array_value(kVString, 1ull << 61, Bytes(64, 0))); },
       Errc::kCorruptFile, "array of 2305843009213693952 string elements cannot fit"},
      {"unknown value type", [] { return raw_kv(13, Bytes(8, 0)); }, Errc::kCorruptFile,
       "key 'bad.key': unknown value type id 13"},
      {"unknown array element type", [] { return raw_kv(kVArray, array_value(99, 1, {0})); },
       Errc::kCorruptFile, "unknown array element type id 99"},
      {"arrays nested too deep", [] { return raw_kv(kVArray, nested(9)); }, Errc::kCorruptFile,
       "nested deeper than 8"},
      {"duplicate key",
       [] { return with([](GgufBuilder& b) { b.add_string("general.architecture", "x"); }); },
       Errc::kCorruptFile, "duplicate metadata key 'general.architecture'"},
      {"alignment zero",
       [] { return with([](GgufBuilder& b) { b.add_u32("general.alignment", 0); }); },
       Errc::kCorruptFile, "general.alignment 0 is not a nonzero power of two"},
      {"alignment not power of two",
       [] { return with([](GgufBuilder& b) { b.add_u32("general.alignment", 48); }); },
       Errc::kCorruptFile, "general.alignment 48 is not"},
      {"alignment wrong type",
       [] { return with([](GgufBuilder& b) { b.add_string("general.alignment", "32"); }); },
       Errc::kCorruptFile, "general.alignment of type string"},
      {"duplicate tensor name",
       [] {
         return with([](GgufBuilder& b) {
           b.add_tensor("w", {1}, 0, Bytes(4, 0));
           b.add_tensor("w", {1}, 0, Bytes(4, 0));
         });
       },
       Errc::kCorruptFile, "duplicate tensor 'w'"},
      {"n_dims 5",
       [] { return with([](GgufBuilder& b) {
              b.add_tensor("t5", {1, 1, 1, 1, 1}, 0, {});
            }); },
       Errc::kCorruptFile, "tensor 't5': n_dims 5 is not in 1..4"},
      {"n_dims 0", [] { return with([](GgufBuilder& b) { b.add_tensor("t0", {}, 0, {}); }); },
       Errc::kCorruptFile, "tensor 't0': n_dims 0"},
      {"zero-size dim",
       [] { return with([](GgufBuilder& b) {
              b.add_tensor("z", {4, 0}, 0, {});
            }); },
       Errc::kCorruptFile, "tensor 'z': dimension 1 has size 0"},
      {"element count overflow",
       [] {
         return with([](GgufBuilder& b) { b.add_tensor("big", {1ull << 32, 1ull << 32}, 0, {}); });
       },
       Errc::kCorruptFile, "tensor 'big': element count overflows"},
      {"byte size overflow",
       [] {
         return with([](GgufBuilder& b) { b.add_tensor("f64", {1ull << 31, 1ull << 31}, 28, {}); });
       },
       Errc::kCorruptFile, "tensor 'f64': byte size overflows"},
      {"unknown tensor type",
       [] { return with([](GgufBuilder& b) { b.add_tensor("u", {1}, 99, Bytes(4, 0)); }); },
       Errc::kCorruptFile, "tensor 'u': unknown type id 99"},
      {"removed tensor type",
       [] { return with([](GgufBuilder& b) { b.add_tensor("old", {32}, 4, Bytes(32, 0)); }); },
       Errc::kUnsupported, "tensor 'old' has type Q4_2 (id 4)"},
      {"row not a multiple of the block",
       [q4_block] { return with([&](GgufBuilder& b) { b.add_tensor("q", {33}, 2, q4_block); }); },
       Errc::kCorruptFile, "tensor 'q': row length 33 is not a multiple of the Q4_0 block size 32"},
      {"offset not aligned",
       [] { return with([](GgufBuilder& b) { b.add_tensor("m", {1}, 0, Bytes(4, 0), 16); }); },
       Errc::kCorruptFile, "tensor 'm': data offset 16 is not a multiple of the alignment 32"},
      {"data past end of file",
       [] {
         Bytes img = with([](GgufBuilder& b) { b.add_tensor("e", {8}, 0, Bytes(32, 0)); });
         img.resize(img.size() - 1);
         return img;
       },
       Errc::kCorruptFile, "tensor 'e': data [0, +32) from data section start"},
      {"huge offset",
       [] { return with([](GgufBuilder& b) { b.add_tensor("h", {1}, 0, {}, ~0ull - 31); }); },
       Errc::kCorruptFile, "runs past the end of the file"},
      {"overlapping tensors",
       [] {
         return with([](GgufBuilder& b) {
           b.add_tensor("first", {16}, 0, Bytes(64, 0), 0);
           b.add_tensor("second", {8}, 0, Bytes(32, 0), 32);
         });
       },
       Errc::kCorruptFile, "tensors 'first' (data offset 0, 64 bytes) and 'second'"},
      {"non-printable key quoted safely",
       [] {
         GgufBuilder b;
         b.add_string(std::string("k\x01\n", 3), "a");
         b.add_string(std::string("k\x01\n", 3), "b");
         return b.build();
       },
       Errc::kCorruptFile, "duplicate metadata key 'k\\x01\\x0a'"},
  };
}

// LoadMode::kCopy: the same bytes in a private, read-only anonymous copy
// (not the file's mapping), tensors pointing into it, surviving a move; a
// file of 8 MiB so that the kernel may back the copy with huge pages.
TEST(Gguf, OpenCopiesIntoReadOnlyAnonymousMemory) {
  Bytes img = all_types_builder().build();
  img.resize(size_t{8} << 20, 0x5a);  // padding after the data section is allowed
  char path[] = "/tmp/kvstack_gguf_copy_XXXXXX";
  const int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(write(fd, img.data(), img.size()), static_cast<ssize_t>(img.size()));
  close(fd);
  auto copy = GgufFile::open(path, LoadMode::kCopy);
  ASSERT_TRUE(copy.ok()) << copy.error().message;
  auto mapped = GgufFile::open(path, LoadMode::kMmap);
  ASSERT_TRUE(mapped.ok()) << mapped.error().message;
  unlink(path);
  EXPECT_EQ(copy->mapping().mode(), LoadMode::kCopy);
  EXPECT_EQ(mapped->mapping().mode(), LoadMode::kMmap);
  EXPECT_EQ(mapped->mapping().huge_page_bytes(), 0u);
  ASSERT_EQ(copy->file_size(), img.size());
  EXPECT_EQ(std::memcmp(copy->file_data(), img.data(), img.size()), 0);
  EXPECT_NE(copy->file_data(), mapped->file_data());
  // Read-only and anonymous: its /proc/self/maps line is "r--p" with no file.
  std::ifstream maps("/proc/self/maps");
  const auto begin = reinterpret_cast<uintptr_t>(copy->file_data());
  std::string line, perms;
  bool found = false;
  while (std::getline(maps, line)) {
    unsigned long lo = 0, hi = 0;
    char p[5] = {};
    unsigned long off = 0;
    char dev[16] = {};
    unsigned long inode = 1;
    if (std::sscanf(line.c_str(), "%lx-%lx %4s %lx %15s %lu", &lo, &hi, p, &off, dev, &inode) ==
            6 &&
        lo <= begin && begin < hi) {
      found = true;
      perms = p;
      EXPECT_EQ(inode, 0u) << line;
    }
  }
  ASSERT_TRUE(found);
  EXPECT_EQ(perms, "r--p");
  EXPECT_LE(copy->mapping().huge_page_bytes(), copy->file_size() + (size_t{2} << 20));
  std::printf("copy of %zu bytes: %zu bytes in huge pages\n", copy->file_size(),
              copy->mapping().huge_page_bytes());
  const GgufTensor* b = copy->find_tensor("w.b");
  ASSERT_NE(b, nullptr);
  EXPECT_GE(b->data, copy->file_data());
  GgufFile moved = std::move(copy).value();
  float v;
  std::memcpy(&v, moved.find_tensor("w.b")->data, 4);
  EXPECT_EQ(v, -1.0f);
  // A missing file names the path in either mode; an unknown mode is refused.
  auto missing = GgufFile::open("/nonexistent/model.gguf", LoadMode::kCopy);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.error().message.find("/nonexistent/model.gguf"), std::string::npos);
  EXPECT_FALSE(parse_load_mode("hugepages").ok());
  EXPECT_EQ(parse_load_mode("copy").value(), LoadMode::kCopy);
  EXPECT_EQ(parse_load_mode("mmap").value(), LoadMode::kMmap);
}

TEST(Gguf, HostileFilesGiveCleanErrors) {
  const auto cases = hostile_cases();
  ASSERT_GE(cases.size(), 15u);
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    const Bytes img = c.make();
    auto f = parse(img);
    ASSERT_FALSE(f.ok());
    EXPECT_EQ(f.error().code, c.code) << errc_name(f.error().code) << ": " << f.error().message;
    EXPECT_EQ(f.error().message.rfind("test.gguf: ", 0), 0u) << f.error().message;
    EXPECT_NE(f.error().message.find(c.fragment), std::string::npos)
        << "message: " << f.error().message << "\nwanted: " << c.fragment;
  }
}

TEST(Gguf, ErrorsSayWhere) {
  // A bad value deep in the file reports its byte offset.
  GgufBuilder b;
  b.add_string("first", "ok");
  const size_t at = b.build().size();
  b.add_kv("second", 42, {});
  auto f = parse(b.build());
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.error().message.find("(at byte offset " + std::to_string(at) + ")"),
            std::string::npos)
      << f.error().message;
}

TEST(Gguf, EveryTruncationIsACleanError) {
  GgufBuilder b = all_types_builder();
  b.add_tensor("w.q4", {32, 2}, 2, Bytes(36, 0x11));
  const Bytes img = b.build();
  ASSERT_TRUE(parse(img).ok());
  for (size_t n = 0; n < img.size(); ++n) {
    // Exact-size heap copy, so sanitizer builds catch any read past the end.
    const Bytes prefix(img.begin(), img.begin() + static_cast<std::ptrdiff_t>(n));
    auto f = GgufFile::parse(prefix.data(), prefix.size(), kName);
    ASSERT_FALSE(f.ok()) << "prefix of " << n << " bytes parsed";
    ASSERT_EQ(f.error().code, Errc::kCorruptFile) << n << ": " << f.error().message;
    ASSERT_EQ(f.error().message.rfind("test.gguf: ", 0), 0u) << f.error().message;
  }
}

TEST(Gguf, RandomMutationsNeverCrash) {
  GgufBuilder b = all_types_builder();
  b.add_tensor("w.q8", {32}, 8, Bytes(34, 0x22));
  const Bytes img = b.build();
  std::mt19937 rng(42);
  int n_ok = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    Bytes m = img;
    const int n_flips = 1 + static_cast<int>(rng() % 4);
    for (int k = 0; k < n_flips; ++k) {
      const size_t pos = rng() % m.size();
      switch (rng() % 3) {
        case 0:
          m[pos] ^= static_cast<uint8_t>(1u << (rng() % 8));
          break;
        case 1:
          m[pos] = static_cast<uint8_t>(rng());
          break;
        default:
          m[pos] = 0xff;
          break;
      }
    }
    auto f = parse(m);
    if (f.ok()) {
      ++n_ok;
      for (const auto& t : f->tensors()) {
        ASSERT_GE(t.data, m.data());
        ASSERT_LE(t.data + t.n_bytes, m.data() + m.size());
      }
    } else {
      ASSERT_EQ(f.error().message.rfind("test.gguf: ", 0), 0u) << f.error().message;
    }
  }
  EXPECT_GT(n_ok, 0);  // some flips only touch values or tensor data
}

}  // namespace
}  // namespace kvstack
