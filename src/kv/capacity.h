// Capacity and cost planning for the KV cache (spec section 3, 7 and 10).
//
// Pure arithmetic: no I/O, no dependency on the model loader or the engine.
// Callers describe the architecture (ModelArch: one LayerSpec per layer), the
// KV storage format (KvFormat), the workload, the hardware and the costs; plan()
// returns every figure it can compute from what was given.
//
// Byte conventions: every byte count is an exact integer (uint64_t). A figure
// that is a rate per token of a grouped format (metadata shared by several
// tokens) is also given as a double, flagged inexact.
//
// Allocator model (must match the engine's block pool): one block holds P
// tokens of every layer, so block_bytes = sum over layers of the bytes of P
// tokens (each region padded to 64 bytes, as KvLayout does); a sequence of T tokens takes ceil(T/P)
// blocks; its block table costs 4 bytes per block id. Window layers cap their *payload* at the
// window; the engine pool does not implement window layers yet, so the allocator figure still
// reserves every layer in every block.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/result.h"

namespace kvstack::capacity {

// ---------------------------------------------------------------------------
// Architecture
// ---------------------------------------------------------------------------

enum class LayerKind : uint8_t {
  kFull,    // attends over every cached position; caches K [H_kv, d_k] and V [H_kv, d_v]
  kWindow,  // sliding window of `window` positions; caches K and V for the last `window`
  kMla,     // multi-head latent attention: caches c_t [d_c] plus the RoPE key [d_R]
};
const char* layer_kind_name(LayerKind kind);

struct LayerSpec {
  LayerKind kind = LayerKind::kFull;
  int64_t window = 0;        // kWindow only: positions kept, > 0
  int64_t n_q_heads = 0;     // H_q
  int64_t n_kv_heads = 0;    // H_kv (kFull/kWindow); MLA: unused for the cache
  int64_t head_dim_k = 0;    // d_k: per-head query/key width (MLA: nope + rope width, for FLOPs)
  int64_t head_dim_v = 0;    // d_v: per-head value width
  int64_t mla_latent = 0;    // d_c (kMla)
  int64_t mla_rope_dim = 0;  // d_R (kMla)
  // Cross-layer KV sharing (YOCO / Gemma 3n): >= 0 when this layer attends
  // over layer kv_source's K/V and stores none (0 bytes; its decode still
  // reads the source's K/V). REQUIRES an earlier storing layer of the same
  // kind, window and shape.
  int64_t kv_source = -1;
};

struct ModelArch {
  std::string name;
  std::vector<LayerSpec> layers;  // one entry per transformer layer, in order
  int64_t hidden = 0;             // embedding width
  int64_t ffn = 0;    // FFN width a token activates (MoE: experts used x width); 0 = unknown
  int64_t vocab = 0;  // 0 = unknown
  int64_t context_length = 0;    // trained context; 0 = unknown
  uint64_t n_params = 0;         // total parameters
  uint64_t n_active_params = 0;  // parameters a token touches (MoE); 0 = n_params
  // Exact weight bytes (e.g. summed GGUF tensor sizes). When absent, weights
  // are n_params in the planner's weight format.
  std::optional<uint64_t> weight_bytes;
  std::optional<uint64_t> active_weight_bytes;  // exact bytes a token reads (MoE); absent = derive
  std::string weight_format_name;               // what weight_bytes holds (e.g. "Q4_1 (GGUF)")
  std::string source;                           // where the facts come from
};

// A uniform model: `n_layers` identical full-attention layers.
ModelArch make_uniform_arch(std::string name, int64_t n_layers, int64_t n_q_heads,
                            int64_t n_kv_heads, int64_t head_dim, int64_t hidden,
                            uint64_t n_params);

// Checks counts are positive, H_q is a multiple of H_kv, windows are positive,
// MLA widths are set. The message names the field and the layer.
Status validate_arch(const ModelArch& arch);

// ---------------------------------------------------------------------------
// KV storage formats (one table; the engine's quantized-KV codecs use the same
// numbers). Bytes per element = w/8 + s/g (spec section 3).
// ---------------------------------------------------------------------------

enum class GroupAxis : uint8_t {
  kNone,       // no metadata (float formats)
  kHeadDim,    // groups of g elements along the head dimension of one token of one head
  kTokens,     // groups of g tokens along one channel of one head (KIVI keys)
  kBlockHead,  // one group per (KV block, head): g = block_size x head_dim elements
};

struct GroupSpec {
  GroupAxis axis = GroupAxis::kNone;
  int64_t group = 0;       // g: elements (kHeadDim) or tokens (kTokens); unused otherwise
  int64_t meta_bytes = 0;  // s: metadata bytes per group (scale, zero/min)
};

struct KvFormat {
  std::string name;             // "f16", "int4", "kivi2", ...
  int bits = 16;                // w: bits per stored element
  GroupSpec key;                // grouping of K (and of the MLA latent)
  GroupSpec value;              // grouping of V
  int64_t residual_tokens = 0;  // R: newest tokens per sequence per layer kept unquantized
  int residual_elem_bytes = 2;  // bytes per residual element (f16)
  std::string description;
  int value_bits = 0;  // V's w when it differs from K's (--kv-dtype-v); 0 = bits
};

// The formats the engine has (f32, f16, bf16) and the planned ones (fp8, int8,
// int4, kivi2, kivi4), with their default group and metadata parameters.
const std::vector<KvFormat>& kv_format_table();
Result<KvFormat> find_kv_format(std::string_view name);
// K in `key`'s format and V in `value`'s (--kv-dtype-k / --kv-dtype-v): K's
// bits and grouping from `key`, V's from `value`, the larger residual (the
// engine keeps K and V of a residual token together). Named "k/v".
KvFormat combine_kv_formats(const KvFormat& key, const KvFormat& value);

// KIVI residual model of the engine (block_table.h): blocks hold every token
// (a residual token's slots wait for its codes), and a sequence of T tokens
// keeps res(T) = T < R ? T : R + (T - R) % G tokens in f16 outside the pool,
// G = min(key group, P) (kivi_codec.h). 0 when the format has no residual.
int64_t residual_tokens_at(const KvFormat& f, int64_t tokens, int64_t block_size);

// Overrides group size g, metadata bytes s and residual R of a quantized
// format (any may be absent). Float formats reject overrides.
Result<KvFormat> customize_kv_format(KvFormat format, std::optional<int64_t> group,
                                     std::optional<int64_t> meta_bytes,
                                     std::optional<int64_t> residual);

// Bytes per element w/8 + s/g for keys and values of a layer with head width
// `head_dim` (kBlockHead uses g = block_size x head_dim).
double key_bytes_per_element(const KvFormat& f, int64_t head_dim, int64_t block_size);
double value_bytes_per_element(const KvFormat& f, int64_t head_dim, int64_t block_size);

// Weight formats for parameters-to-bytes: GGML-style blocks of `block`
// parameters taking `block_bytes` bytes.
struct WeightFormat {
  std::string name;
  int64_t block = 1;
  int64_t block_bytes = 2;
};
const std::vector<WeightFormat>& weight_format_table();
Result<WeightFormat> find_weight_format(std::string_view name);
uint64_t weight_bytes_for_params(uint64_t n_params, const WeightFormat& f);

// ---------------------------------------------------------------------------
// Per-layer and per-sequence byte counts
// ---------------------------------------------------------------------------

// Exact stored bytes of one layer for one sequence whose layer holds `tokens`
// positions (already capped by the caller for windows), all KV heads, K and V
// (or the MLA latent). block_size P is needed only by kBlockHead formats.
// With residual R: min(tokens, R) tokens in f16, the rest quantized.
uint64_t layer_sequence_bytes(const LayerSpec& layer, const KvFormat& f, int64_t tokens,
                              int64_t block_size);
// Tokens a layer keeps for a sequence of `seq_tokens` (window layers cap).
int64_t layer_kept_tokens(const LayerSpec& layer, int64_t seq_tokens);
// Amortised bytes per token of one layer (w/8 + s/g per element); `exact` is
// set false when metadata is shared across tokens.
double layer_bytes_per_token(const LayerSpec& layer, const KvFormat& f, int64_t block_size,
                             bool* exact);
// Region alignment of the engine's block layout (KvLayout::kAlign).
inline constexpr int64_t kRegionAlign = 64;
// Bytes of one block of P tokens: all layers, no window capping, no residual;
// every K, V (or latent) region and every metadata region padded to
// kRegionAlign, exactly as KvLayout lays a block out.
uint64_t block_bytes(const ModelArch& arch, const KvFormat& f, int64_t block_size);

// ---------------------------------------------------------------------------
// Inputs and results
// ---------------------------------------------------------------------------

struct Workload {
  std::vector<int64_t> seq_tokens;  // T_i for each sequence, each >= 1
  int64_t shared_prefix = 0;        // S tokens shared by every sequence (<= min T_i)
  int64_t block_size = 0;           // P; 0 = no paging figures
};

struct Hardware {
  uint64_t mem_budget = 0;            // bytes per device; 0 = not given
  double mem_bw = 0;                  // bytes/s; 0 = not given
  double link_bw = 0;                 // bytes/s of the fetch / transfer link; 0 = not given
  double link_latency_s = 0;          // one-way latency incl. queueing and mapping, seconds
  double recompute_tokens_per_s = 0;  // prefill rate (tokens/s); 0 = not given
  double compute_flops = 0;  // peak FLOP/s for a FLOP-based prefill estimate; 0 = not given
};

struct PlanInput {
  ModelArch arch;
  KvFormat kv_format;  // default f16
  Workload workload;
  int64_t tp = 1;                            // tensor-parallel degree
  WeightFormat weight_format{"bf16", 1, 2};  // used when arch.weight_bytes is absent
  std::optional<uint64_t> activation_bytes;  // override of the workspace estimate
  uint64_t overhead_bytes = 0;               // runtime overhead per device
  int64_t prefill_chunk = 512;               // tokens per prefill forward (workspace estimate)
  Hardware hw;
  std::optional<int64_t> prefix_tokens;  // fetch-vs-recompute prefix; default S or max T_i
  // Reference request length / batch for the budget searches (max batch uses
  // requests of ref_ctx tokens, max ctx uses ref_batch sequences).
  int64_t ref_ctx = 0;    // 0 = longest T_i
  int64_t ref_batch = 0;  // 0 = number of sequences
};

struct LayerGroupFigure {
  LayerKind kind = LayerKind::kFull;
  int64_t window = 0;
  int64_t n_layers = 0;
  double bytes_per_token = 0;  // per layer
  bool exact = true;
  uint64_t payload_bytes = 0;  // for the whole workload, all layers of this group
  bool shared = false;         // layers reading another layer's K/V (kv_source >= 0)
};

// One KV group of the engine's pool (kv_groups.h): layers of one retention
// class, g = gcd of the class sizes per group, the full group first. The
// figures are the state between steps after the workload ran (a window
// group then holds the blocks overlapping [max(0, T - w + 1), T)).
struct KvGroupFigure {
  int64_t window = 0;  // 0 = full attention
  int64_t n_layers = 0;
  uint64_t block_count = 0;      // blocks this group holds over the workload
  uint64_t payload_bytes = 0;    // min(T, w) tokens (window) or T (full), per sequence
  uint64_t resident_bytes = 0;   // tokens whose blocks are held x the group's bytes per token
  uint64_t allocated_bytes = 0;  // block_count x the pool's block bytes
};

struct PagingFigures {
  // Hybrid (window + full) models without sharing or residual: the engine's
  // KV groups; block_bytes is then the largest group block and block_count
  // the sum over groups. Empty otherwise (every block holds every layer).
  std::vector<KvGroupFigure> groups;
  int64_t block_size = 0;
  uint64_t block_bytes = 0;            // P tokens of every layer
  uint64_t block_count = 0;            // sum_i ceil(T_i / P) (with sharing: shared blocks once)
  uint64_t slots = 0;                  // block_count x P
  uint64_t tail_waste_tokens = 0;      // sum_i (P ceil(T_i/P) - T_i)
  uint64_t kv_allocated_bytes = 0;     // block_count x block_bytes (+ residual buffers)
  uint64_t residual_buffer_bytes = 0;  // per-sequence unquantized residual (R > 0 formats)
  uint64_t table_bytes = 0;            // 4 bytes per block id per sequence
  uint64_t allocator_total_bytes = 0;  // allocated + tables
  // Without prefix sharing (present figures equal these when S = 0).
  uint64_t block_count_unshared = 0;
  uint64_t kv_allocated_bytes_unshared = 0;
};

struct TpFigures {
  int64_t tp = 1;
  int64_t kv_heads_per_rank = 0;  // of the first non-MLA layer (0 for all-MLA models)
  int64_t replication = 1;        // copies of each KV head across ranks
  uint64_t kv_payload_bytes_per_rank = 0;
  uint64_t kv_allocated_bytes_per_rank = 0;  // when paging
  uint64_t kv_bytes_all_ranks = 0;           // sum over ranks of payload
  uint64_t naive_per_rank_bytes = 0;         // payload / tp (what ignoring replication predicts)
};

struct MemoryFigures {
  uint64_t weights_bytes = 0;         // per device (tp: ceil(weights / tp))
  uint64_t weights_bytes_total = 0;   // whole model
  uint64_t active_weights_bytes = 0;  // read per decode step (MoE: active experts), whole model
  uint64_t kv_bytes = 0;              // per device: allocator total when paging, else payload
  uint64_t activation_bytes = 0;      // workspace estimate or override
  bool activation_estimated = true;
  uint64_t overhead_bytes = 0;
  uint64_t total_bytes = 0;
};

struct DecodeFigures {
  uint64_t bytes_per_step = 0;          // active weights (per device) + KV payload (per device)
  double step_lower_bound_s = 0;        // bytes_per_step / mem_bw
  double tokens_per_s_upper_bound = 0;  // batch / step
};

struct AttentionIntensity {
  double flops_per_step = 0;   // decode attention (QK^T and PV) over the batch, all layers
  uint64_t kv_bytes_read = 0;  // KV payload read by the same step
  double flop_per_byte = 0;
};

struct FetchFigures {
  int64_t prefix_tokens = 0;
  uint64_t fetch_bytes = 0;
  double fetch_time_s = 0;  // latency + bytes / link_bw
  std::optional<double> recompute_time_s;
  std::optional<int64_t> break_even_tokens;  // smallest prefix where fetching is faster
  bool fetch_never_wins = false;             // recompute per token is cheaper than the link
};

struct TransferFigures {
  uint64_t bytes = 0;                    // KV payload of the workload
  double transfer_time_s = 0;            // latency + bytes / link_bw
  std::optional<double> prefill_time_s;  // compute of the whole prefill (if a rate is given)
  std::optional<double> pipelined_ready_time_s;   // per-layer streaming
  std::optional<double> sequential_ready_time_s;  // transfer after prefill
  uint64_t in_flight_bytes = 0;  // both sides hold the data while it moves: 2 x bytes
};

struct PlanResult {
  std::string model_name;
  std::string kv_format_name;
  int64_t n_layers = 0;
  int64_t n_sequences = 0;
  uint64_t total_tokens = 0;        // sum_i T_i
  double kv_bytes_per_element = 0;  // mean over K and V of the first layer (w/8 + s/g)
  double kv_bytes_per_token = 0;    // all layers, amortised
  bool kv_bytes_per_token_exact = true;
  uint64_t kv_bytes_per_token_int = 0;  // == kv_bytes_per_token when exact
  std::vector<LayerGroupFigure> layer_groups;
  uint64_t kv_payload_bytes = 0;  // with sharing when S > 0
  uint64_t kv_payload_bytes_unshared = 0;
  std::optional<PagingFigures> paging;
  std::optional<TpFigures> tp;
  MemoryFigures memory;
  std::optional<int64_t> crossover_tokens;      // smallest T with KV(T, 1 seq) >= weights
  std::optional<int64_t> max_batch_for_budget;  // requests of ref_ctx tokens
  std::optional<int64_t> max_ctx_for_budget;    // with ref_batch sequences
  int64_t ref_ctx = 0;
  int64_t ref_batch = 0;
  std::optional<DecodeFigures> decode;
  AttentionIntensity attention;
  std::optional<FetchFigures> fetch;
  std::optional<TransferFigures> transfer;
  std::vector<std::string> notes;  // assumptions worth telling the user
};

// Validates the input (names the field at fault) and computes every figure
// whose inputs were given.
Result<PlanResult> plan(const PlanInput& input);

// KV payload of a workload (exact; sharing and window caps applied).
uint64_t kv_payload_bytes(const ModelArch& arch, const KvFormat& f, const Workload& w);
// Per-device memory total for `seq_tokens` sequences (same options as `input`).
uint64_t total_bytes_for(const PlanInput& input, const std::vector<int64_t>& seq_tokens);
// Prefill compute time (seconds) of one sequence of `tokens` tokens from the
// rate or FLOP model in `hw`; nullopt when neither is given.
std::optional<double> recompute_time_s(const ModelArch& arch, const Hardware& hw, int64_t tokens);

// Architecture with the KV heads one tensor-parallel rank holds (replicated
// when H_kv < tp). Errors when heads do not divide.
Result<ModelArch> arch_per_rank(const ModelArch& arch, int64_t tp, int64_t* replication);

// ---------------------------------------------------------------------------
// Engine verification (`kvstack plan --verify`). run_plan_verify() is
// implemented by the engine layer (src/engine); it runs the real engine on a
// synthetic workload of exactly this shape and measures what the pool did.
// compare_verify() is pure and lives here.
// ---------------------------------------------------------------------------

struct VerifyRequest {
  std::string model_path;
  std::vector<int64_t> seq_tokens;  // T_i per sequence
  int64_t block_size = 16;
  std::string kv_dtype = "f16";  // a kv_format_table() name the engine supports
  std::string kv_dtype_k;        // K's / V's format when they differ ("" = kv_dtype)
  std::string kv_dtype_v;
  int64_t kv_residual = 128;  // KIVI residual R
};

struct VerifyReport {
  uint64_t payload_bytes = 0;    // sum over sequences and layers of cached K/V bytes
  uint64_t allocated_bytes = 0;  // blocks held by the workload x block bytes
  uint64_t block_count = 0;
  uint64_t block_bytes = 0;
  int64_t rss_growth_bytes = 0;  // process RSS after filling the pool minus before
  uint64_t pool_bytes = 0;       // bytes the pool reserved (for context)
  // KIVI: f16 residual rows the tables hold outside the pool; included in
  // payload_bytes and allocated_bytes above.
  uint64_t residual_bytes = 0;
  // Per KV group (BlockPoolGroupStats), in the pool's group order.
  struct Group {
    int64_t window = 0;
    uint64_t payload_bytes = 0;
    uint64_t resident_bytes = 0;  // resident tokens x the group's payload bytes per token
    uint64_t allocated_bytes = 0;
  };
  std::vector<Group> groups;
};

// Implemented in the engine layer; not linked until it exists (cmd_plan.cpp
// guards its call with KVSTACK_HAVE_PLAN_VERIFY).
Result<VerifyReport> run_plan_verify(const VerifyRequest& request);

struct VerifyRow {
  std::string name;  // "payload_bytes", ...
  double predicted = 0;
  double measured = 0;
  bool must_match = false;  // exact figures: a mismatch fails verification
  bool matches = true;
};
struct VerifyComparison {
  std::vector<VerifyRow> rows;
  bool ok = true;  // every must_match row matches
};
// Payload, allocated bytes and blocks must match exactly; RSS growth is
// reported against the allocated prediction without failing.
VerifyComparison compare_verify(const PlanResult& predicted, const VerifyReport& measured);

}  // namespace kvstack::capacity
