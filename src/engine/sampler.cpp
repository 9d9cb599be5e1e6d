#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <limits>
#include <random>

#include "ops/elementwise.h"

namespace kvstack {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

Error param_error(const char* what, double value) {
  char buf[256];
  std::snprintf(buf, sizeof(buf), "sampling: %s (got %g)", what, value);
  return make_error(Errc::kInvalidArgument, buf);
}

uint64_t splitmix64(uint64_t& x) {
  uint64_t z = (x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

inline uint64_t rotl(uint64_t x, int k) {
  return (x << k) | (x >> (64 - k));
}

// Strict order "a ranks before b": higher logit, then lower token id.
struct RanksBefore {
  const float* w;
  bool operator()(int32_t a, int32_t b) const { return w[a] > w[b] || (w[a] == w[b] && a < b); }
};

}  // namespace

Status validate(const SamplingParams& p) {
  if (!std::isfinite(p.temperature) || p.temperature < 0.0f) {
    return param_error("temperature must be finite and >= 0 (0 = greedy)", p.temperature);
  }
  if (p.top_k < 0) return param_error("top_k must be >= 0 (0 = off)", p.top_k);
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) {
    return param_error("top_p must be in (0, 1] (1 = off)", p.top_p);
  }
  if (!(p.min_p >= 0.0f && p.min_p <= 1.0f)) {
    return param_error("min_p must be in [0, 1] (0 = off)", p.min_p);
  }
  if (!std::isfinite(p.repetition_penalty) || p.repetition_penalty <= 0.0f) {
    return param_error("repetition_penalty must be finite and > 0 (1 = off)", p.repetition_penalty);
  }
  if (!(p.frequency_penalty >= -2.0f && p.frequency_penalty <= 2.0f)) {
    return param_error("frequency_penalty must be in [-2, 2] (0 = off)", p.frequency_penalty);
  }
  if (!(p.presence_penalty >= -2.0f && p.presence_penalty <= 2.0f)) {
    return param_error("presence_penalty must be in [-2, 2] (0 = off)", p.presence_penalty);
  }
  if (p.penalty_last_n < -1) {
    return param_error("penalty_last_n must be >= -1 (-1 = whole history, 0 = no penalties)",
                       p.penalty_last_n);
  }
  return {};
}

Result<Sampler> Sampler::create(const SamplingParams& params) {
  Status s = validate(params);
  if (!s.ok()) return s.error();
  return Sampler(params);
}

Sampler::Sampler(const SamplingParams& params) : params_(params) {
  KV_CHECK(validate(params).ok(), "Sampler: invalid SamplingParams (call validate() first)");
  if (params.has_seed) {
    seed_ = params.seed;
  } else {
    std::random_device rd;
    seed_ = (uint64_t{rd()} << 32) ^ rd();
  }
  uint64_t x = seed_;
  for (uint64_t& s : rng_) s = splitmix64(x);
}

uint64_t Sampler::next_u64() {
  const uint64_t result = rotl(rng_[1] * 5, 7) * 9;
  const uint64_t t = rng_[1] << 17;
  rng_[2] ^= rng_[0];
  rng_[3] ^= rng_[1];
  rng_[1] ^= rng_[2];
  rng_[0] ^= rng_[3];
  rng_[2] ^= t;
  rng_[3] = rotl(rng_[3], 45);
  return result;
}

void Sampler::accept(int32_t token) {
  KV_CHECK(token >= 0, "Sampler::accept: negative token id");
  ++n_history_;
  if (params_.penalty_last_n == 0) return;
  ++counts_[token];
  if (params_.penalty_last_n < 0) return;
  window_.push_back(token);
  if (window_.size() > static_cast<size_t>(params_.penalty_last_n)) {
    const int32_t old = window_.front();
    window_.pop_front();
    auto it = counts_.find(old);
    if (--it->second == 0) counts_.erase(it);
  }
}

void Sampler::clear_history() {
  window_.clear();
  counts_.clear();
  n_history_ = 0;
}

void Sampler::apply_penalties(const float* logits, int n_vocab, float* out) const {
  std::copy(logits, logits + n_vocab, out);
  const float rep = params_.repetition_penalty;
  const float freq = params_.frequency_penalty;
  const float pres = params_.presence_penalty;
  if (rep == 1.0f && freq == 0.0f && pres == 0.0f) return;
  for (const auto& [token, count] : counts_) {
    if (token >= n_vocab) continue;
    float& l = out[token];
    l = l > 0.0f ? l / rep : l * rep;
    l -= static_cast<float>(count) * freq + pres;
  }
}

int32_t Sampler::prepare(const float* logits, int n_vocab) {
  KV_CHECK(n_vocab > 0, "Sampler::sample: n_vocab must be > 0");
  constexpr float kInf = std::numeric_limits<float>::infinity();
  work_.resize(static_cast<size_t>(n_vocab));
  bool bad = false;  // NaN or +inf anywhere
  for (int i = 0; i < n_vocab; ++i) bad |= !(logits[i] < kInf);
  if (bad) {
    for (int i = 0; i < n_vocab; ++i) {
      if (!(logits[i] < kInf)) {
        std::fprintf(stderr, "kvstack: sampler: logit of token %d is %f\n", i, logits[i]);
        break;
      }
    }
    KV_CHECK(false, "Sampler::sample: logits contain NaN or +inf");
  }
  apply_penalties(logits, n_vocab, work_.data());
  const float* w = work_.data();
  // The first largest (lowest id on ties); no NaN here (checked above).
  const auto best = static_cast<int32_t>(argmax(w, n_vocab));
  KV_CHECK(w[best] > kNegInf, "Sampler::sample: every logit is -inf");
  return best;
}

void Sampler::build_candidates(int n_vocab, int32_t argmax) {
  const float* w = work_.data();
  const float m = w[argmax];
  cand_.clear();
  prob_.clear();
  if (params_.temperature == 0.0f) {
    cand_.push_back(argmax);
    prob_.push_back(1.0f);
    return;
  }
  const RanksBefore ranks{w};
  // Invariant: cand_[0, n_sorted) are the n_sorted best candidates, in rank order.
  size_t n_sorted = 0;

  // 2. top-k in one pass with a size-k heap whose front is the worst kept
  // token: O(n + k log k log(n/k)) for typical logits, and no full sort.
  const auto k = static_cast<size_t>(params_.top_k);
  if (k > 0 && k < static_cast<size_t>(n_vocab)) {
    for (int32_t i = 0; i < n_vocab; ++i) {
      if (!(w[i] > kNegInf)) continue;
      if (cand_.size() < k) {
        cand_.push_back(i);
        std::push_heap(cand_.begin(), cand_.end(), ranks);
      } else if (w[i] > w[cand_.front()]) {  // ties keep the lower id, seen first
        std::pop_heap(cand_.begin(), cand_.end(), ranks);
        cand_.back() = i;
        std::push_heap(cand_.begin(), cand_.end(), ranks);
      }
    }
    std::sort_heap(cand_.begin(), cand_.end(), ranks);
    n_sorted = cand_.size();
  } else {
    for (int32_t i = 0; i < n_vocab; ++i) {
      if (w[i] > kNegInf) cand_.push_back(i);
    }
  }

  // 3. top-p at temperature 1. The ranked prefix is grown geometrically, so
  // a peaked distribution sorts only its head, not the whole vocabulary.
  // exp_[t] = exp(w[t] - m) for every candidate t, kept for step 5 when T = 1.
  const bool have_exp = params_.top_p < 1.0f;
  if (have_exp) {
    exp_.resize(work_.size());
    double z = 0.0;
    for (int32_t c : cand_) z += exp_[c] = std::exp(w[c] - m);
    const double target = static_cast<double>(params_.top_p) * z;
    double cum = 0.0;
    size_t n_keep = 0;
    while (n_keep < cand_.size()) {
      if (n_keep == n_sorted) {
        const size_t next = std::min(cand_.size(), std::max<size_t>(64, 2 * n_sorted));
        const auto first = cand_.begin() + static_cast<std::ptrdiff_t>(n_sorted);
        const auto mid = cand_.begin() + static_cast<std::ptrdiff_t>(next);
        if (next < cand_.size()) std::nth_element(first, mid, cand_.end(), ranks);
        std::sort(first, mid, ranks);
        n_sorted = next;
      }
      cum += exp_[cand_[n_keep]];
      ++n_keep;
      if (cum >= target) break;
    }
    cand_.resize(n_keep);
  }

  // 4. min-p: p_i >= min_p * p_max  <=>  logit_i - logit_max >= log(min_p). Keeps order.
  if (params_.min_p > 0.0f) {
    const float log_min_p = std::log(params_.min_p);
    std::erase_if(cand_, [&](int32_t c) { return w[c] - m < log_min_p; });
  }

  // 5. temperature over the survivors (the argmax always survives, so sum >= 1).
  prob_.resize(cand_.size());
  double sum = 0.0;
  if (have_exp && params_.temperature == 1.0f) {
    for (size_t i = 0; i < cand_.size(); ++i) sum += prob_[i] = exp_[cand_[i]];
  } else {
    const float inv_t = 1.0f / params_.temperature;
    for (size_t i = 0; i < cand_.size(); ++i) sum += prob_[i] = std::exp((w[cand_[i]] - m) * inv_t);
  }
  const auto inv_sum = static_cast<float>(1.0 / sum);
  for (float& p : prob_) p *= inv_sum;
}

int32_t Sampler::draw() {
  KV_DCHECK(!cand_.empty(), "Sampler::draw: no candidates");
  if (cand_.size() == 1) return cand_[0];
  // Uniform in [0, 1) from the top 53 bits; inverse CDF in the candidate order.
  const double u = static_cast<double>(next_u64() >> 11) * 0x1.0p-53;
  double total = 0.0;
  for (float p : prob_) total += p;
  const double target = u * total;
  double cum = 0.0;
  size_t last_positive = 0;
  for (size_t i = 0; i < cand_.size(); ++i) {
    if (prob_[i] <= 0.0f) continue;
    cum += prob_[i];
    last_positive = i;
    if (target < cum) return cand_[i];
  }
  return cand_[last_positive];  // rounding: target landed at the very top
}

int32_t Sampler::sample(const float* logits, int n_vocab) {
  const int32_t argmax = prepare(logits, n_vocab);
  if (params_.temperature == 0.0f) return argmax;
  build_candidates(n_vocab, argmax);
  return draw();
}

SampledToken Sampler::sample_with_logprobs(const float* logits, int n_vocab, int n_top) {
  SampledToken out;
  const int32_t argmax = prepare(logits, n_vocab);
  if (params_.temperature == 0.0f) {
    out.token = argmax;
  } else {
    build_candidates(n_vocab, argmax);
    out.token = draw();
  }
  const float* w = work_.data();
  const double m = w[argmax];
  const double inv_t =
      params_.temperature == 0.0f ? 1.0 : 1.0 / static_cast<double>(params_.temperature);
  double z = 0.0;
  cand_.clear();  // reused as scratch: every finite token
  for (int32_t i = 0; i < n_vocab; ++i) {
    if (w[i] > kNegInf) {
      z += std::exp((w[i] - m) * inv_t);
      cand_.push_back(i);
    }
  }
  const double log_z = std::log(z);
  auto logprob = [&](int32_t t) {
    return w[t] == kNegInf ? kNegInf : static_cast<float>((w[t] - m) * inv_t - log_z);
  };
  out.logprob = logprob(out.token);
  const size_t n = std::min(cand_.size(), static_cast<size_t>(std::max(n_top, 0)));
  if (n > 0) {
    const RanksBefore ranks{w};
    std::partial_sort(cand_.begin(), cand_.begin() + static_cast<std::ptrdiff_t>(n), cand_.end(),
                      ranks);
    out.top.reserve(n);
    for (size_t i = 0; i < n; ++i) out.top.push_back({cand_[i], logprob(cand_[i])});
  }
  return out;
}

std::vector<TokenProb> Sampler::distribution(const float* logits, int n_vocab) {
  const int32_t argmax = prepare(logits, n_vocab);
  build_candidates(n_vocab, argmax);
  std::vector<TokenProb> out(cand_.size());
  for (size_t i = 0; i < cand_.size(); ++i) out[i] = {cand_[i], prob_[i]};
  return out;
}

// ---------------------------------------------------------------------------

Result<StopMatcher> StopMatcher::create(std::vector<std::string> stops) {
  for (size_t i = 0; i < stops.size(); ++i) {
    if (stops[i].empty()) {
      return make_error(Errc::kInvalidArgument,
                        "stop strings: entry " + std::to_string(i) + " is empty");
    }
  }
  return StopMatcher(std::move(stops));
}

std::string StopMatcher::release(size_t n) {
  std::string out = held_.substr(0, n);
  held_.erase(0, n);
  emitted_ += out;
  return out;
}

std::string StopMatcher::push(std::string_view piece) {
  if (stopped()) return {};
  held_.append(piece);

  // Any stop occurrence starts inside held_: everything emitted was checked
  // not to begin a stop string. The first occurrence of a stop is also its
  // first completion; the stop that completes first wins (on the same byte,
  // the longer one, which starts earlier).
  size_t best_pos = std::string::npos;
  size_t best_end = std::string::npos;
  for (size_t i = 0; i < stops_.size(); ++i) {
    const size_t pos = held_.find(stops_[i]);
    if (pos == std::string::npos) continue;
    const size_t end = pos + stops_[i].size();
    if (end < best_end || (end == best_end && pos < best_pos)) {
      best_pos = pos;
      best_end = end;
      stop_index_ = static_cast<int>(i);
    }
  }
  if (best_pos != std::string::npos) {
    std::string out = release(best_pos);
    held_.clear();
    return out;
  }

  // Hold back the longest suffix that is a proper prefix of a stop string.
  size_t n_hold = 0;
  for (const std::string& s : stops_) {
    for (size_t len = std::min(s.size() - 1, held_.size()); len > n_hold; --len) {
      if (held_.compare(held_.size() - len, len, s, 0, len) == 0) {
        n_hold = len;
        break;
      }
    }
  }
  size_t n_emit = held_.size() - n_hold;
  // Hold back a trailing incomplete UTF-8 sequence too.
  for (size_t back = 1; back <= 4 && back <= n_emit; ++back) {
    const auto byte = static_cast<unsigned char>(held_[n_emit - back]);
    if ((byte & 0xc0) == 0x80) continue;  // continuation byte: keep looking for the lead
    const size_t len = byte >= 0xf0 ? 4 : byte >= 0xe0 ? 3 : byte >= 0xc0 ? 2 : 1;
    if (len > back) n_emit -= back;
    break;
  }
  return release(n_emit);
}

std::string StopMatcher::flush() {
  if (stopped()) return {};
  return release(held_.size());
}

}  // namespace kvstack
