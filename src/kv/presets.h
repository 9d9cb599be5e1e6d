// Architecture presets for the capacity planner: public facts about
// well-known models (layer counts, heads, head dims, windows, MLA widths,
// parameter counts), each with the source it was taken from.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "core/result.h"
#include "kv/capacity.h"

namespace kvstack::capacity {

struct PresetInfo {
  std::string id;       // lower-case name accepted by find_preset(), e.g. "llama-3-8b"
  std::string summary;  // one line: attention kind and size
};

// Every preset, in a stable order.
std::vector<PresetInfo> list_presets();

// Looks a preset up by id (case-insensitive; '_' and '.' are accepted for '-'
// where unambiguous). Unknown names are an error listing the known ids.
Result<ModelArch> find_preset(std::string_view name);

}  // namespace kvstack::capacity
