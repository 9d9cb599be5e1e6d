#include "cli/npy.h"

#include <cerrno>
#include <cstdio>
#include <cstring>

namespace kvstack::cli {

Status write_npy_f32(const std::string& path, const float* data,
                     const std::vector<int64_t>& shape) {
  std::string dims;
  int64_t n = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    dims += std::to_string(shape[i]);
    if (shape.size() == 1 || i + 1 < shape.size()) dims += ",";
    if (i + 1 < shape.size()) dims += " ";
    n *= shape[i];
  }
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (" + dims + "), }";
  // Magic (6) + version (2) + header length (2) + header, padded with spaces
  // and a final newline to a multiple of 64 bytes.
  const size_t total = 10 + header.size() + 1;
  header.append((64 - total % 64) % 64, ' ');
  header.push_back('\n');
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) {
    return make_error(Errc::kIo, path + ": cannot open for writing: " + std::strerror(errno));
  }
  const unsigned char magic[8] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0};
  const auto hlen = static_cast<uint16_t>(header.size());
  const unsigned char len[2] = {static_cast<unsigned char>(hlen & 0xff),
                                static_cast<unsigned char>(hlen >> 8)};
  bool ok = std::fwrite(magic, 1, 8, f) == 8 && std::fwrite(len, 1, 2, f) == 2 &&
            std::fwrite(header.data(), 1, header.size(), f) == header.size() &&
            std::fwrite(data, sizeof(float), static_cast<size_t>(n), f) == static_cast<size_t>(n);
  ok = (std::fclose(f) == 0) && ok;
  if (!ok) return make_error(Errc::kIo, path + ": write failed: " + std::strerror(errno));
  return {};
}

}  // namespace kvstack::cli
