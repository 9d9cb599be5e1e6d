"""kvstack's forward pass against llama.cpp (llama-cpp-python) on the same GGUF.

The yardstick is llama.cpp against itself. SmolLM2-135M in Q4_1 amplifies
float rounding strongly: llama.cpp with flash attention on versus off (both
valid settings of the same engine on the same file) already disagrees by up
to ~2.5 logits at some positions (logits span about +-30), and its top-1 token
differs at ~5% of positions of a 1K-token text. So "identical top-1 at every
position" cannot hold between any two correct implementations here; what the
tests require instead, for five prompts (short, ~1K tokens, multilingual,
code, chat):
  * per-position logits: kvstack's mean abs error against llama.cpp (default
    settings) is at most 1.25x, and its max abs error at most 1.5x, llama.cpp's
    own flash-on/off disagreement on the same prompt; every top-1 difference
    is a near-tie: llama.cpp's top-2 gap there is smaller than twice llama.cpp's
    own flash-on/off disagreement at that position (if every logit may move by
    e, two logits closer than 2e may swap);
  * greedy continuations of 64 tokens identical, a divergence accepted only at
    a step where llama.cpp's top-2 gap is below NEAR_TIE (reported);
  * perplexity of the GPL-3 text at ctx 512 within 0.5% of the perplexity
    computed from llama.cpp's logits on the same windows.
Both engines use an f16 KV cache (llama.cpp's default, kvstack's default) and
token ids from llama.cpp's tokenizer, so only the forward pass is compared.
"""
import json
import pathlib

import numpy as np
import pytest

from conftest import THREADS, run_kvstack
from llama_parity import (check_greedy, check_logits, kvstack_logits, llama_greedy,
                          llama_logits)

GPL = pathlib.Path("/usr/share/common-licenses/GPL-3")

# For greedy continuations (where no second llama.cpp run is at hand), a
# top-2 gap below this (in logits) is a near-tie: llama.cpp's own flash on/off
# disagreement moves individual logits by up to ~2.5 on these prompts, so two
# candidates closer than 1.0 can swap order in either engine.
NEAR_TIE = 1.0

CHAT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nWhat is the boiling point of water at sea level, and why "
        "does it change at altitude?<|im_end|>\n<|im_start|>assistant\n")
CODE = '''def fibonacci(n: int) -> list[int]:
    """Return the first n Fibonacci numbers."""
    seq = [0, 1]
    while len(seq) < n:
        seq.append(seq[-1] + seq[-2])
    return seq[:n]


if __name__ == "__main__":
    for i, value in enumerate(fibonacci(20)):
        print(f"{i:3d} {value:>8}")
'''
MULTI = ("Le chat dort sur le canapé pendant que la pluie tombe. Der schnelle braune Fuchs springt "
         "über den faulen Hund. 今天天气很好，我们去公园散步吧。東京は日本の首都です。"
         "Москва — столица России. القاهرة هي عاصمة مصر. ¿Dónde está la biblioteca?")


def prompts(llama_ref):
    gpl = GPL.read_text(encoding="utf-8")
    long_ids = llama_ref.tokenize(gpl.encode(), add_bos=False, special=False)[:1024]
    texts = {
        "short": "The capital of France is",
        "multilingual": MULTI,
        "code": CODE,
        "chat": CHAT,
    }
    out = {k: llama_ref.tokenize(v.encode(), add_bos=False, special=True) for k, v in texts.items()}
    out["long_1k"] = long_ids
    return out


@pytest.fixture(scope="module")
def llama_alt():
    """llama.cpp with flash attention: the same engine, another valid setting."""
    import llama_cpp

    from conftest import MODEL
    return llama_cpp.Llama(model_path=MODEL, n_ctx=2048, n_batch=512, logits_all=True,
                           n_threads=THREADS, n_threads_batch=THREADS, verbose=False,
                           flash_attn=True)


@pytest.fixture(scope="module")
def prompt_ids(llama_ref):
    return prompts(llama_ref)


@pytest.mark.parametrize("name", ["short", "long_1k", "multilingual", "code", "chat"])
def test_logits_match(llama_ref, llama_alt, prompt_ids, name):
    ids = prompt_ids[name]
    ref = llama_logits(llama_ref, ids)
    alt = llama_logits(llama_alt, ids)
    got = kvstack_logits(ids)
    check_logits(name, ids, ref, alt, got)


@pytest.mark.parametrize("name", ["short", "long_1k", "multilingual", "code", "chat"])
def test_greedy_continuation(llama_ref, prompt_ids, name):
    ids = prompt_ids[name]
    n = 64
    ref, gaps = llama_greedy(llama_ref, ids, n)
    proc = run_kvstack("run", "--tokens", ",".join(map(str, ids)), "-n", n, "--temp", 0,
                       "--ignore-eos", "--json", "--threads", THREADS)
    got = json.loads(proc.stdout)["tokens"]
    check_greedy(name, ref, gaps, got, n, NEAR_TIE)


def test_perplexity_gpl3(llama_ref):
    ctx = 512
    ids = llama_ref.tokenize(GPL.read_text(encoding="utf-8").encode(), add_bos=False, special=False)
    nll, count = 0.0, 0
    for start in range(0, len(ids) - ctx + 1, ctx):
        window = ids[start:start + ctx]
        logits = llama_logits(llama_ref, window).astype(np.float64)
        logz = np.log(np.exp(logits - logits.max(axis=1, keepdims=True)).sum(axis=1)) + logits.max(axis=1)
        lp = logits[np.arange(ctx - 1), window[1:]] - logz[:-1]
        nll -= lp.sum()
        count += ctx - 1
    ref_ppl = float(np.exp(nll / count))
    proc = run_kvstack("perplexity", "-f", GPL, "--ctx", ctx, "--json", "--threads", THREADS)
    got = json.loads(proc.stdout)
    assert got["n_scored"] == count
    rel = abs(got["perplexity"] - ref_ppl) / ref_ppl
    print(f"\nGPL-3 ctx {ctx}: kvstack ppl {got['perplexity']:.4f}, llama.cpp ppl {ref_ppl:.4f}, "
          f"relative difference {rel:.3%}")
    assert rel < 0.005
