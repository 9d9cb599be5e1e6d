// `kvstack logits`: float32 logits [n_tokens, n_vocab] for every position.
#include <cstdio>

#include "cli/args.h"
#include "cli/engine_options.h"
#include "cli/npy.h"
#include "cli/text_input.h"

namespace kvstack::cli {
namespace {

int run_logits(const std::vector<std::string>& argv) {
  auto specs = engine_options();
  specs.push_back({"prompt", 'p', "TEXT", "text to tokenize (special tokens parsed)"});
  specs.push_back({"tokens", 0, "IDS", "token ids instead of text: 1,2,3 or [1,2,3]"});
  specs.push_back({"out", 'o', "FILE.npy", "output file: float32 [n_tokens, n_vocab] (required)"});
  specs.push_back(help_option());
  auto args = Args::parse(argv, specs);
  if (!args) return fail("logits", args.error().message);
  if (args->flag("help")) {
    std::fputs(format_help("kvstack logits [-m MODEL] (-p TEXT | --tokens 1,2,3) --out FILE.npy",
                           "Run the prompt through the model with the paged KV cache (in prefill "
                           "chunks) and save the logits of every position as a NumPy array.",
                           specs)
                   .c_str(),
               stdout);
    return 0;
  }
  if (!args->has("out")) return fail("logits", "--out FILE.npy is required");
  auto engine = load_engine(*args);
  if (!engine) return fail("logits", engine.error().message);
  auto tokens = prompt_tokens(*args, **engine);
  if (!tokens) return fail("logits", tokens.error().message);
  if (tokens->empty()) return fail("logits", "the prompt has no tokens");
  BlockTable table = (*engine)->new_table();
  std::vector<float> logits;
  const Status st = (*engine)->prefill(table, *tokens, LogitsMode::kAll, &logits);
  if (!st.ok()) return fail("logits", st.error().message);
  const int64_t n_vocab = (*engine)->model().config().n_vocab;
  const Status w = write_npy_f32(*args->get("out"), logits.data(),
                                 {static_cast<int64_t>(tokens->size()), n_vocab});
  if (!w.ok()) return fail("logits", w.error().message);
  std::fprintf(stderr, "kvstack logits: wrote [%zu, %lld] float32 to %s\n", tokens->size(),
               static_cast<long long>(n_vocab), args->get("out")->c_str());
  return 0;
}

}  // namespace

KVSTACK_COMMAND(g_logits, "logits", "save every position's logits as a .npy file", run_logits);

}  // namespace kvstack::cli
