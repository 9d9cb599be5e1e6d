// Memory figures of the running process, from /proc (Linux).
#pragma once

#include <cstdint>

namespace kvstack {

// Resident set size of this process in bytes; 0 where /proc/self/statm
// cannot be read (not Linux, /proc not mounted).
int64_t process_rss_bytes();

}  // namespace kvstack
