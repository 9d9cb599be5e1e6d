// libFuzzer target for GgufFile::parse. Any input must yield either a valid
// file or an error; never a crash, an out-of-bounds read (ASan) or undefined
// behaviour (UBSan). Accepted files are exercised further: every getter on
// every key, and dequantization of small tensors (reads every data byte).
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "model/dequant.h"
#include "model/gguf.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // Copy into an exact-size heap buffer so ASan flags any read past the end.
  std::vector<uint8_t> buf(data, data + size);
  auto f = kvstack::GgufFile::parse(buf.data(), buf.size(), "fuzz.gguf");
  if (!f) {
    // Every failure carries a message naming the file.
    if (f.error().message.rfind("fuzz.gguf: ", 0) != 0) __builtin_trap();
    return 0;
  }
  for (const auto& [key, value] : f->metadata()) {
    (void)f->get_string(key);
    (void)f->get_u64(key);
    (void)f->get_i64(key);
    (void)f->get_f64(key);
    (void)f->get_bool(key);
    (void)f->get_string_array(key);
    (void)f->get_int_array(key);
    (void)f->get_float_array(key);
    if (f->find(key) != &value) __builtin_trap();
  }
  std::vector<float> out;
  for (const auto& t : f->tensors()) {
    if (f->find_tensor(t.name) != &t) __builtin_trap();
    if (t.data < buf.data() || t.data + t.n_bytes > buf.data() + buf.size()) __builtin_trap();
    if (t.n_elements() > (int64_t{1} << 20)) continue;
    out.resize(static_cast<size_t>(t.n_elements()));
    (void)kvstack::dequantize_tensor(t, out.data());
  }
  return 0;
}
