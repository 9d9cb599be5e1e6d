#include "core/ggml_types.h"

#include <array>

#include "core/check.h"

namespace kvstack {
namespace {

// Indexed by on-disk type id. Entries with name == nullptr are ids GGML never
// assigned or has removed (see kRemovedTypeNames). Block sizes are facts of
// the GGML format; `supported` marks what dequant.cpp implements.
constexpr int kMaxTypeId = 41;

constexpr std::array<GgmlTypeTraits, kMaxTypeId + 1> kTraits = {{
    /* 0 */ {"F32", 1, 4, true},
    /* 1 */ {"F16", 1, 2, true},
    /* 2 */ {"Q4_0", kQK, sizeof(BlockQ4_0), true},
    /* 3 */ {"Q4_1", kQK, sizeof(BlockQ4_1), true},
    /* 4 */ {nullptr, 0, 0, false},  // Q4_2, removed
    /* 5 */ {nullptr, 0, 0, false},  // Q4_3, removed
    /* 6 */ {"Q5_0", kQK, sizeof(BlockQ5_0), true},
    /* 7 */ {"Q5_1", kQK, sizeof(BlockQ5_1), true},
    /* 8 */ {"Q8_0", kQK, sizeof(BlockQ8_0), true},
    /* 9 */ {"Q8_1", kQK, sizeof(BlockQ8_1), true},
    /* 10 */ {"Q2_K", kQK_K, sizeof(BlockQ2_K), true},
    /* 11 */ {"Q3_K", kQK_K, sizeof(BlockQ3_K), true},
    /* 12 */ {"Q4_K", kQK_K, sizeof(BlockQ4_K), true},
    /* 13 */ {"Q5_K", kQK_K, sizeof(BlockQ5_K), true},
    /* 14 */ {"Q6_K", kQK_K, sizeof(BlockQ6_K), true},
    /* 15 */ {"Q8_K", kQK_K, sizeof(BlockQ8_K), true},
    /* 16 */ {"IQ2_XXS", kQK_K, 66, false},
    /* 17 */ {"IQ2_XS", kQK_K, 74, false},
    /* 18 */ {"IQ3_XXS", kQK_K, 98, false},
    /* 19 */ {"IQ1_S", kQK_K, 50, false},
    /* 20 */ {"IQ4_NL", kQK, 18, false},
    /* 21 */ {"IQ3_S", kQK_K, 110, false},
    /* 22 */ {"IQ2_S", kQK_K, 82, false},
    /* 23 */ {"IQ4_XS", kQK_K, 136, false},
    /* 24 */ {"I8", 1, 1, true},
    /* 25 */ {"I16", 1, 2, true},
    /* 26 */ {"I32", 1, 4, true},
    /* 27 */ {"I64", 1, 8, true},
    /* 28 */ {"F64", 1, 8, true},
    /* 29 */ {"IQ1_M", kQK_K, 56, false},
    /* 30 */ {"BF16", 1, 2, true},
    /* 31 */ {nullptr, 0, 0, false},  // Q4_0_4_4, removed
    /* 32 */ {nullptr, 0, 0, false},  // Q4_0_4_8, removed
    /* 33 */ {nullptr, 0, 0, false},  // Q4_0_8_8, removed
    /* 34 */ {"TQ1_0", kQK_K, 54, false},
    /* 35 */ {"TQ2_0", kQK_K, 66, false},
    /* 36 */ {nullptr, 0, 0, false},  // IQ4_NL_4_4, removed
    /* 37 */ {nullptr, 0, 0, false},  // IQ4_NL_4_8, removed
    /* 38 */ {nullptr, 0, 0, false},  // IQ4_NL_8_8, removed
    /* 39 */ {"MXFP4", kQK, 17, false},
    /* 40 */ {"NVFP4", 64, 36, false},
    /* 41 */ {"Q1_0", 128, 18, false},
}};

}  // namespace

const GgmlTypeTraits* ggml_type_traits(uint32_t type_id) {
  if (type_id > static_cast<uint32_t>(kMaxTypeId)) return nullptr;
  const GgmlTypeTraits& t = kTraits[type_id];
  return t.name != nullptr ? &t : nullptr;
}

const char* ggml_removed_type_name(uint32_t type_id) {
  switch (type_id) {
    case 4:
      return "Q4_2";
    case 5:
      return "Q4_3";
    case 31:
      return "Q4_0_4_4";
    case 32:
      return "Q4_0_4_8";
    case 33:
      return "Q4_0_8_8";
    case 36:
      return "IQ4_NL_4_4";
    case 37:
      return "IQ4_NL_4_8";
    case 38:
      return "IQ4_NL_8_8";
    default:
      return nullptr;
  }
}

const char* ggml_type_name(GgmlType type) {
  const GgmlTypeTraits* t = ggml_type_traits(static_cast<uint32_t>(type));
  return t != nullptr ? t->name : "unknown";
}

size_t ggml_row_bytes(GgmlType type, int64_t n) {
  const GgmlTypeTraits* t = ggml_type_traits(static_cast<uint32_t>(type));
  KV_CHECK(t != nullptr, "ggml_row_bytes: unknown type");
  KV_CHECK(n >= 0 && n % t->block_elems == 0, "ggml_row_bytes: n not a multiple of the block size");
  return static_cast<size_t>(n / t->block_elems) * t->block_bytes;
}

}  // namespace kvstack
