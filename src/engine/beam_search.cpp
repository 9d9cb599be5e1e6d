#include "engine/beam_search.h"

#include <algorithm>
#include <cmath>
#include <optional>

namespace kvstack {

namespace {

struct LiveBeam {
  Sequence seq;
  Beam beam;
  int32_t pending = -1;  // last chosen token, not yet written (spec section 2)
};

struct Candidate {
  double logprob = 0;
  int parent = 0;
  int32_t token = -1;  // -1: a finished beam carried over unchanged
};

// log-softmax of one logits row, float64.
std::vector<double> log_softmax(const float* logits, int n) {
  double mx = -INFINITY;
  for (int i = 0; i < n; ++i) mx = std::max(mx, static_cast<double>(logits[i]));
  double sum = 0;
  for (int i = 0; i < n; ++i) sum += std::exp(static_cast<double>(logits[i]) - mx);
  const double lse = mx + std::log(sum);
  std::vector<double> out(n);
  for (int i = 0; i < n; ++i) out[i] = static_cast<double>(logits[i]) - lse;
  return out;
}

// The k best (logprob desc, token asc) token ids of one row.
std::vector<int32_t> top_k(const std::vector<double>& lp, int k) {
  std::vector<int32_t> idx(lp.size());
  for (size_t i = 0; i < idx.size(); ++i) idx[i] = static_cast<int32_t>(i);
  k = std::min<int>(k, static_cast<int>(idx.size()));
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(),
                    [&](int32_t a, int32_t b) { return lp[a] != lp[b] ? lp[a] > lp[b] : a < b; });
  idx.resize(k);
  return idx;
}

bool better(const Candidate& a, const Candidate& b) {
  if (a.logprob != b.logprob) return a.logprob > b.logprob;
  if (a.parent != b.parent) return a.parent < b.parent;
  return a.token < b.token;
}

}  // namespace

Result<BeamSearchResult> beam_search(Engine& engine, std::span<const int32_t> prompt,
                                     const BeamSearchOptions& options) {
  if (prompt.empty()) return make_error(Errc::kInvalidArgument, "the prompt has no tokens");
  if (options.n_beams < 1) return make_error(Errc::kInvalidArgument, "--beams must be >= 1");
  if (options.max_tokens < 1) {
    return make_error(Errc::kInvalidArgument, "max tokens must be at least 1");
  }
  const int k = options.n_beams;
  const int n_vocab = engine.model().config().n_vocab;
  const int64_t p = engine.pool().block_size();
  BlockPool& pool = engine.pool();
  const BlockPoolStats st0 = pool.stats();
  const int64_t base_used = st0.n_blocks_used;
  BeamSearchResult res;

  // Prefill the prompt once.
  Sequence root = engine.new_sequence(options.cache_salt);
  std::vector<float> logits;
  res.n_prompt_cached = root.adopt_cached_prefix(prompt);
  KV_TRY_STATUS(engine.prefill(root, prompt.subspan(static_cast<size_t>(res.n_prompt_cached)),
                               LogitsMode::kLast, &logits));

  auto fork_of = [&](const Sequence& s) -> Result<Sequence> {
    if (options.share_kv) return s.fork();
    return s.clone_private();
  };
  auto track = [&](const std::vector<LiveBeam>& beams) {
    const int64_t used = pool.stats().n_blocks_used - base_used;
    int64_t independent = 0;
    for (const LiveBeam& b : beams) independent += (b.seq.length() + p - 1) / p;
    res.peak_blocks_used = std::max(res.peak_blocks_used, used);
    res.peak_blocks_independent = std::max(res.peak_blocks_independent, independent);
  };

  // Step 0: the K best first tokens, each a fork of the prompt.
  std::vector<LiveBeam> beams;
  {
    const std::vector<double> lp = log_softmax(logits.data(), n_vocab);
    for (int32_t t : top_k(lp, k)) {
      auto s = fork_of(root);
      if (!s) return s.error();
      LiveBeam b{std::move(*s), Beam{}, t};
      b.beam.tokens.push_back(t);
      b.beam.logprob = lp[t];
      b.beam.finished = engine.tokenizer().is_eog(t) && !options.ignore_eos;
      if (b.beam.finished) b.pending = -1;
      beams.push_back(std::move(b));
    }
    track(beams);
    root.release();
  }

  for (int64_t step = 1; step < options.max_tokens; ++step) {
    std::vector<StepSeq> batch;
    std::vector<int> rows;  // beam index of each batch row
    for (size_t i = 0; i < beams.size(); ++i) {
      if (beams[i].beam.finished) continue;
      batch.push_back(StepSeq{.table = &beams[i].seq.table(),
                              .tokens = std::span<const int32_t>(&beams[i].pending, 1),
                              .logits = LogitsMode::kLast});
      rows.push_back(static_cast<int>(i));
    }
    if (batch.empty()) break;
    if (Status s = engine.forward().step(batch, &logits); !s.ok()) {
      for (int i : rows) beams[i].seq.rollback();
      return s.error();
    }
    ++res.n_steps;
    for (int i : rows) beams[i].seq.on_committed(std::span<const int32_t>(&beams[i].pending, 1));
    track(beams);

    std::vector<Candidate> cands;
    for (size_t r = 0; r < rows.size(); ++r) {
      const std::vector<double> lp =
          log_softmax(logits.data() + static_cast<int64_t>(r) * n_vocab, n_vocab);
      for (int32_t t : top_k(lp, k)) {
        cands.push_back({beams[rows[r]].beam.logprob + lp[t], rows[r], t});
      }
    }
    for (size_t i = 0; i < beams.size(); ++i) {
      if (beams[i].beam.finished) cands.push_back({beams[i].beam.logprob, static_cast<int>(i), -1});
    }
    std::sort(cands.begin(), cands.end(), better);
    cands.resize(std::min<size_t>(cands.size(), static_cast<size_t>(k)));

    std::vector<int> uses(beams.size(), 0);
    for (const Candidate& c : cands) ++uses[c.parent];
    std::vector<LiveBeam> next;
    for (const Candidate& c : cands) {
      LiveBeam& parent = beams[c.parent];
      std::optional<LiveBeam> nb;
      if (--uses[c.parent] > 0) {
        auto s = fork_of(parent.seq);
        if (!s) return s.error();
        nb.emplace(LiveBeam{std::move(*s), parent.beam, parent.pending});
      } else {
        nb.emplace(std::move(parent));  // last user takes the parent's sequence
      }
      if (c.token >= 0) {
        nb->beam.tokens.push_back(c.token);
        nb->beam.logprob = c.logprob;
        nb->pending = c.token;
        nb->beam.finished = engine.tokenizer().is_eog(c.token) && !options.ignore_eos;
      }
      next.push_back(std::move(*nb));
    }
    beams = std::move(next);  // unselected parents release their blocks here
    track(beams);
  }

  res.n_cow_copies = pool.stats().n_cow_copies - st0.n_cow_copies;
  for (LiveBeam& b : beams) res.beams.push_back(std::move(b.beam));
  std::stable_sort(res.beams.begin(), res.beams.end(),
                   [](const Beam& a, const Beam& b) { return a.logprob > b.logprob; });
  return res;
}

}  // namespace kvstack
