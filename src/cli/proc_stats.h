// Process memory figures for the CLI's reports. The measurement itself is
// core's process_rss_bytes (core/proc_stats.h), shared with the engine.
#pragma once

#include <cstdint>

namespace kvstack::cli {

// Resident set size of this process in bytes (0 if unavailable).
int64_t rss_bytes();

}  // namespace kvstack::cli
