#include "engine/generate.h"

#include <chrono>

#include "tokenizer/stream_decoder.h"

namespace kvstack {

const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::kLength:
      return "length";
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kEos:
      return "eos";
  }
  return "?";
}

namespace {

// The loop shared by both overloads. `seq` is null for a bare table.
Result<GenerateResult> generate_impl(Engine& engine, BlockTable& table, Sequence* seq,
                                     std::span<const int32_t> prompt,
                                     const GenerateOptions& options,
                                     const std::function<void(std::string_view)>& on_text) {
  using Clock = std::chrono::steady_clock;
  if (prompt.empty()) return make_error(Errc::kInvalidArgument, "the prompt has no tokens");
  if (options.max_tokens < 1) {
    return make_error(Errc::kInvalidArgument, "max tokens must be at least 1");
  }
  auto sampler = Sampler::create(options.sampling);
  if (!sampler) return sampler.error();
  auto stops = StopMatcher::create(options.stop);
  if (!stops) return stops.error();
  const Tokenizer& tok = engine.tokenizer();
  const int n_vocab = engine.model().config().n_vocab;
  StreamDecoder decoder(tok, options.render_special);
  auto emit = [&](const std::string& piece) {
    if (piece.empty()) return;
    const std::string out = stops->push(piece);
    if (!out.empty() && on_text) on_text(out);
  };

  GenerateResult res;
  const auto t0 = Clock::now();
  std::vector<float> logits;
  int64_t n_cached = 0;
  if (seq != nullptr && seq->length() == 0) n_cached = seq->adopt_cached_prefix(prompt);
  const std::span<const int32_t> fresh = prompt.subspan(static_cast<size_t>(n_cached));
  if (seq != nullptr) {
    KV_TRY_STATUS(engine.prefill(*seq, fresh, LogitsMode::kLast, &logits));
  } else {
    KV_TRY_STATUS(engine.prefill(table, fresh, LogitsMode::kLast, &logits));
  }
  res.stats.n_prompt = static_cast<int64_t>(fresh.size());
  res.stats.n_cached = n_cached;
  res.stats.prefill_s = std::chrono::duration<double>(Clock::now() - t0).count();
  for (int32_t t : prompt) sampler->accept(t);

  Clock::time_point t_first{};
  for (int64_t i = 0;; ++i) {
    const int32_t next = sampler->sample(logits.data(), n_vocab);
    sampler->accept(next);
    res.tokens.push_back(next);
    res.pending_token = next;
    res.stats.n_generated++;
    if (i == 0) {
      t_first = Clock::now();
      res.stats.ttft_s = std::chrono::duration<double>(t_first - t0).count();
    }
    const bool eog = tok.is_eog(next) && !options.ignore_eos;
    if (eog) {
      res.finish = FinishReason::kEos;
      break;
    }
    emit(decoder.push(next));
    if (stops->stopped()) {
      res.finish = FinishReason::kStop;
      break;
    }
    if (res.stats.n_generated >= options.max_tokens) {
      res.finish = FinishReason::kLength;
      break;
    }
    const StepSeq s{.table = &table, .tokens = std::span<const int32_t>(&next, 1)};
    if (Status st = engine.forward().step(std::span<const StepSeq>(&s, 1), &logits); !st.ok()) {
      table.rollback();
      return st.error();
    }
    if (seq != nullptr) seq->on_committed(s.tokens);
    res.pending_token = -1;
  }
  if (!stops->stopped()) {
    emit(decoder.flush());
    const std::string rest = stops->flush();
    if (!rest.empty() && on_text) on_text(rest);
  }
  res.text = stops->text();
  res.stats.decode_s = std::chrono::duration<double>(Clock::now() - t_first).count();
  return res;
}

}  // namespace

Result<GenerateResult> generate(Engine& engine, BlockTable& table, std::span<const int32_t> prompt,
                                const GenerateOptions& options,
                                const std::function<void(std::string_view)>& on_text) {
  return generate_impl(engine, table, nullptr, prompt, options, on_text);
}

Result<GenerateResult> generate(Engine& engine, Sequence& seq, std::span<const int32_t> prompt,
                                const GenerateOptions& options,
                                const std::function<void(std::string_view)>& on_text) {
  return generate_impl(engine, seq.table(), &seq, prompt, options, on_text);
}

}  // namespace kvstack
