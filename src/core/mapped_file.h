// Read-only memory map of a whole file (RAII). Zero-copy tensor access for
// GGUF models.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "core/result.h"

namespace kvstack {

class MappedFile {
 public:
  static Result<MappedFile> open(const std::string& path);
  MappedFile() = default;
  ~MappedFile();
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }
  // Device and inode, for caching digests by file identity.
  uint64_t device() const { return dev_; }
  uint64_t inode() const { return ino_; }
  int64_t mtime_ns() const { return mtime_ns_; }

 private:
  void reset();
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
  std::string path_;
  uint64_t dev_ = 0;
  uint64_t ino_ = 0;
  int64_t mtime_ns_ = 0;
};

}  // namespace kvstack
