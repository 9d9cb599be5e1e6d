// A whole file, read-only, in memory (RAII): memory-mapped (zero-copy), or
// copied into anonymous memory backed by transparent huge pages.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "core/result.h"

namespace kvstack {

// How a file gets into memory.
//   kMmap: a private read-only mapping of the file (its page cache pages, 4
//     KiB each); nothing is read until touched, and processes share them.
//   kCopy: read once into an anonymous mapping advised MADV_HUGEPAGE and
//     made read-only: 2 MiB pages where the kernel grants them (fewer TLB
//     misses when a decode step streams the weights: Gemma 3 270M at 4K
//     context decodes 7-20% faster on the session-21 Intel host,
//     docs/benchmarks.md), at the cost of a private copy (the resident set
//     counts the file's size as anonymous memory).
enum class LoadMode { kMmap, kCopy };

// "mmap" or "copy" (--load-mode); anything else is kInvalidArgument.
Result<LoadMode> parse_load_mode(const std::string& s);

class MappedFile {
 public:
  static Result<MappedFile> open(const std::string& path, LoadMode mode = LoadMode::kMmap);
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
  LoadMode mode() const { return mode_; }
  // Bytes of the copy in huge pages (AnonHugePages of its range, from
  // /proc/self/smaps); 0 for kMmap or where the kernel granted none.
  size_t huge_page_bytes() const;
  // kCopy only: makes the whole copy writable and returns it, for rewrites
  // in place while a model loads (weights packed for the kernels); seal()
  // makes it read-only again. nullptr for kMmap (the file's page cache is not
  // this process's to rewrite) or an empty file, or when mprotect fails.
  uint8_t* unseal();
  void seal();

 private:
  void reset();
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
  std::string path_;
  uint64_t dev_ = 0;
  uint64_t ino_ = 0;
  int64_t mtime_ns_ = 0;
  LoadMode mode_ = LoadMode::kMmap;
};

}  // namespace kvstack
