#include "cli/proc_stats.h"

#include "core/proc_stats.h"

namespace kvstack::cli {

int64_t rss_bytes() {
  return process_rss_bytes();
}

}  // namespace kvstack::cli
