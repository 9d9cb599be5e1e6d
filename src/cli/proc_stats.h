// Process memory figures from /proc (Linux).
#pragma once

#include <cstdint>

namespace kvstack::cli {

// Resident set size of this process in bytes (0 if unavailable).
int64_t rss_bytes();

}  // namespace kvstack::cli
