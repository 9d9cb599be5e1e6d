#include "core/proc_stats.h"

#include <unistd.h>

#include <cstdio>

namespace kvstack {

int64_t process_rss_bytes() {
  // statm: sizes in pages; the second field is the resident set.
  FILE* f = std::fopen("/proc/self/statm", "r");
  if (f == nullptr) return 0;
  long long size_pages = 0;
  long long resident_pages = 0;
  const int n = std::fscanf(f, "%lld %lld", &size_pages, &resident_pages);
  std::fclose(f);
  const long page_bytes = sysconf(_SC_PAGESIZE);
  if (n != 2 || page_bytes <= 0) return 0;
  return static_cast<int64_t>(resident_pages) * page_bytes;
}

}  // namespace kvstack
