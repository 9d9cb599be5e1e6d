// Parsing and printing of sizes and rates with unit suffixes.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "core/result.h"

namespace kvstack {

// "512MiB", "2GiB", "1.5GB", "4096" (bytes), "8k" (=8000). Binary suffixes
// (KiB, MiB, GiB, TiB) are powers of 1024, decimal ones (kB/KB, MB, GB, TB)
// powers of 1000. Rejects negatives, empty strings, unknown suffixes, overflow.
Result<uint64_t> parse_bytes(std::string_view text);

// "25GiB/s", "1TB/s", "200Gbit/s", "100Mb/s" -> bytes per second.
Result<double> parse_rate(std::string_view text);

// "1.50 GiB" style with 2^k units, choosing the largest unit <= value.
std::string format_bytes(double bytes);

}  // namespace kvstack
