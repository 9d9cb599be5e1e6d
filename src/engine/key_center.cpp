#include "engine/key_center.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "engine/forward.h"
#include "kv/block_pool.h"
#include "kv/block_table.h"
#include "kv/kv_write.h"
#include "kv/layout.h"

namespace kvstack {

std::string KeyCenter::key() const {
  // FNV-1a over the shape and the means as integer multiples of the step.
  uint64_t h = 1469598103934665603ULL;
  auto mix = [&h](int64_t v) {
    for (int b = 0; b < 8; ++b) {
      h ^= static_cast<uint64_t>(v >> (8 * b)) & 0xffU;
      h *= 1099511628211ULL;
    }
  };
  mix(n_layers);
  mix(kv_dim);
  for (float m : mean) mix(std::lround(m / kKeyCenterStep));
  char buf[80];
  std::snprintf(buf, sizeof buf, "kcenter;step=1/256;fnv=%016llx",
                static_cast<unsigned long long>(h));
  return buf;
}

std::string_view key_center_builtin_text() {
  static constexpr std::string_view kText =
      "The harbour town wakes slowly in winter. Before dawn the fishing boats leave one "
      "after another, their lamps swinging over the black water, and the gulls follow them "
      "out past the breakwater. By eight the bakery on the corner has sold most of its "
      "bread, and the people waiting for the first bus talk about the weather, the price of "
      "fuel, and whether the ferry will run if the wind keeps rising.\n"
      "Maria runs the small hardware shop near the square. She keeps a notebook of "
      "everything she sells, because the computer her nephew installed crashes whenever the "
      "power flickers. On a normal day she sells screws, paint, rope, a few light bulbs and "
      "sometimes a kettle. In the afternoon children come in to buy batteries for their "
      "toys, and she asks them about school.\n"
      "A river crosses the valley above the town. Engineers measured its flow for three "
      "years before they designed the new bridge: the peak in spring is nearly ten times "
      "the summer minimum, and the old stone arches had been damaged twice by floods. The "
      "new design uses a single steel span of eighty metres, anchored in rock on both "
      "banks, so that nothing stands in the water at all.\n"
      "In the library, a volunteer is teaching an evening class on how computers store "
      "numbers. An integer is a fixed number of bits; a floating point number keeps a sign, "
      "an exponent and a fraction, which is why adding a very small value to a very large "
      "one can change nothing. The students write short programs that sum a list forwards "
      "and backwards and compare the answers, and most of them are surprised that the two "
      "results differ.\n"
      "Questions people often ask the tourist office: How long does the walk to the "
      "lighthouse take? About forty minutes each way, longer if the path is muddy. Can we "
      "swim at the north beach? Only in summer, when the lifeguards are there. Where can we "
      "eat after ten at night? Almost nowhere, although the hotel kitchen will sometimes "
      "make a sandwich if you ask politely.\n"
      "The recipe for the soup the town is known for is simple. Fry an onion and two cloves "
      "of garlic in olive oil, add potatoes cut into cubes, cover them with fish stock and "
      "cook for twenty minutes. Then add whatever white fish the boats brought in, a "
      "handful of mussels, salt, pepper and a little saffron, and simmer for five more "
      "minutes. Serve it with bread that is at least a day old.\n"
      "At the council meeting last week, the members voted seven to two to repair the sea "
      "wall before building the new car park. The report they relied on estimated that a "
      "storm like the one of 1987 would now flood the lower streets to a depth of half a "
      "metre, and that the repairs would cost about one fifth of the damage such a flood "
      "would cause.\n";
  return kText;
}

Result<KeyCenter> calibrate_key_center(const Model& model, ThreadPool& threads,
                                       std::span<const int32_t> tokens, int64_t chunk) {
  const ModelConfig& c = model.config();
  const auto n = static_cast<int64_t>(tokens.size());
  if (n == 0) return make_error(Errc::kInvalidArgument, "key centering: no calibration tokens");
  if (n > c.n_ctx_train) {
    return make_error(Errc::kInvalidArgument,
                      "key centering: " + std::to_string(n) +
                          " calibration tokens are more than the model's context of " +
                          std::to_string(c.n_ctx_train));
  }
  if (chunk < 1) return make_error(Errc::kInvalidArgument, "key centering: chunk must be >= 1");
  auto layout = KvLayout::uniform(c.n_layers, c.n_kv_heads, c.head_dim, KvDtype::kF32, 16);
  if (!layout) return layout.error();
  auto pool = BlockPool::create(*layout, BlockPoolConfig{.n_tokens = n});
  if (!pool) return pool.error();
  KeyCenter kc;
  kc.n_layers = c.n_layers;
  kc.kv_dim = c.n_kv_heads * c.head_dim;
  kc.n_tokens = n;
  // Run the tokens with a plain forward, then average the keys the f32
  // cache holds: exactly the keys after RoPE.
  Forward fwd(model, threads);
  BlockTable table(**pool);
  for (int64_t b = 0; b < n; b += chunk) {
    const int64_t e = std::min(n, b + chunk);
    const StepSeq s{.table = &table,
                    .tokens = tokens.subspan(static_cast<size_t>(b), static_cast<size_t>(e - b)),
                    .logits = LogitsMode::kNone};
    KV_TRY_STATUS(fwd.step(std::span<const StepSeq>(&s, 1), nullptr));
  }
  std::vector<float> k(static_cast<size_t>(n) * kc.kv_dim), v(k.size());
  kc.mean.resize(static_cast<size_t>(kc.n_layers) * kc.kv_dim);
  for (int l = 0; l < kc.n_layers; ++l) {
    // A shared layer (cross-layer KV sharing) stores nothing: its source's keys.
    const int kl = model.config().kv_index(l);
    read_kv((*pool)->layer_view(kl), table.ids_for_layer(kl), 0, n, k.data(), v.data());
    for (int i = 0; i < kc.kv_dim; ++i) {
      double sum = 0.0;
      for (int64_t t = 0; t < n; ++t) sum += k[static_cast<size_t>(t) * kc.kv_dim + i];
      const double m = sum / static_cast<double>(n);
      kc.mean[static_cast<size_t>(l) * kc.kv_dim + i] =
          static_cast<float>(std::round(m / kKeyCenterStep)) * kKeyCenterStep;
    }
  }
  return kc;
}

}  // namespace kvstack
