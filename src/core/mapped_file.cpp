#include "core/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <utility>

namespace kvstack {

Result<LoadMode> parse_load_mode(const std::string& s) {
  if (s == "mmap") return LoadMode::kMmap;
  if (s == "copy") return LoadMode::kCopy;
  return make_error(Errc::kInvalidArgument,
                    "unknown load mode '" + s + "' (expected mmap or copy)");
}

namespace {

// The file's bytes in a fresh anonymous mapping advised MADV_HUGEPAGE, then
// made read-only; MAP_FAILED with errno set (the mapping removed) on error.
void* copy_to_anonymous(int fd, size_t size) {
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return p;
  ::madvise(p, size, MADV_HUGEPAGE);  // advisory: 4 KiB pages where refused
  size_t done = 0;
  while (done < size) {
    const ssize_t n =
        ::pread(fd, static_cast<char*>(p) + done, size - done, static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int e = n == 0 ? EIO : errno;  // 0: the file shrank while read
      ::munmap(p, size);
      errno = e;
      return MAP_FAILED;
    }
    done += static_cast<size_t>(n);
  }
  if (::mprotect(p, size, PROT_READ) != 0) {
    const int e = errno;
    ::munmap(p, size);
    errno = e;
    return MAP_FAILED;
  }
  return p;
}

}  // namespace

Result<MappedFile> MappedFile::open(const std::string& path, LoadMode mode) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return make_error(Errc::kIo, path + ": cannot open: " + std::strerror(errno));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    return make_error(Errc::kIo, path + ": cannot stat: " + std::strerror(e));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return make_error(Errc::kIo, path + ": not a regular file");
  }
  MappedFile f;
  f.path_ = path;
  f.size_ = static_cast<size_t>(st.st_size);
  f.dev_ = st.st_dev;
  f.ino_ = st.st_ino;
  f.mtime_ns_ = static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  f.mode_ = mode;
  if (f.size_ > 0) {
    void* p = mode == LoadMode::kCopy ? copy_to_anonymous(fd, f.size_)
                                      : ::mmap(nullptr, f.size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      const int e = errno;
      ::close(fd);
      return make_error(
          Errc::kIo,
          path + (mode == LoadMode::kCopy ? ": cannot read into memory: " : ": cannot mmap: ") +
              std::strerror(e));
    }
    f.data_ = static_cast<const uint8_t*>(p);
  }
  ::close(fd);
  return f;
}

MappedFile::~MappedFile() {
  reset();
}

MappedFile::MappedFile(MappedFile&& other) noexcept {
  *this = std::move(other);
}

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
  if (this != &other) {
    reset();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    path_ = std::move(other.path_);
    dev_ = other.dev_;
    ino_ = other.ino_;
    mtime_ns_ = other.mtime_ns_;
    mode_ = other.mode_;
  }
  return *this;
}

size_t MappedFile::huge_page_bytes() const {
  if (mode_ != LoadMode::kCopy || data_ == nullptr) return 0;
  std::FILE* smaps = std::fopen("/proc/self/smaps", "re");
  if (smaps == nullptr) return 0;
  const auto begin = reinterpret_cast<uintptr_t>(data_);
  const uintptr_t end = begin + size_;
  size_t total = 0;
  bool inside = false;
  char line[512];
  while (std::fgets(line, sizeof line, smaps) != nullptr) {
    unsigned long lo = 0, hi = 0, kb = 0;
    if (std::sscanf(line, "%lx-%lx ", &lo, &hi) == 2 &&
        std::strchr(line, '-') < std::strchr(line, ' ')) {
      inside = lo < end && hi > begin;  // a mapping's header line
    } else if (inside && std::sscanf(line, "AnonHugePages: %lu kB", &kb) == 1) {
      total += static_cast<size_t>(kb) * 1024;
    }
  }
  std::fclose(smaps);
  return total;
}

uint8_t* MappedFile::unseal() {
  if (mode_ != LoadMode::kCopy || data_ == nullptr) return nullptr;
  auto* p = const_cast<uint8_t*>(data_);  // our own anonymous copy (copy_to_anonymous)
  if (::mprotect(p, size_, PROT_READ | PROT_WRITE) != 0) return nullptr;
  return p;
}

void MappedFile::seal() {
  if (mode_ == LoadMode::kCopy && data_ != nullptr) {
    ::mprotect(const_cast<uint8_t*>(data_), size_, PROT_READ);
  }
}

void MappedFile::reset() {
  if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
  data_ = nullptr;
  size_ = 0;
}

}  // namespace kvstack
