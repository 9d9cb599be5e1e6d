"""Hybrid prefix reuse on the real Gemma 3 file over `kvstack serve`
(window 512, every sixth layer full: one full KV group, five window groups).

- Two requests sharing a ~3,000-token prefix: the second reports at least
  prefix - P cached tokens (the full group's blocks and the window groups'
  checkpoint blocks cover [0, L) and [L - w, L)), and its greedy output equals
  the same prompt computed cold in the same server (a fresh cache salt: a
  namespace of its own, 0 cached tokens).
- A 3-turn chat (the same conversation resent with each reply appended)
  prefills only each turn's new tokens (usage.prompt_tokens_details.cached_tokens).

Honest comparison: prefill entries are cut at multiples of --prefill-chunk,
and a hit ends on a block boundary, so with --prefill-chunk equal to
--block-size the cache-on request runs exactly the entries the cold one runs
(the same float order). With longer entries the two differ in reduction order
only (a window tile's first key depends on where its entry starts; kvgroups'
finding), which can flip a greedy near-tie.
"""
import os

import pytest

from conftest import MODEL
from test_server import ServerProcess

P = 64  # block size and prefill chunk


@pytest.fixture(scope="module")
def server():
    if "gemma" not in os.path.basename(MODEL).lower() or not os.path.exists(MODEL):
        pytest.skip("needs the Gemma 3 model (KVSTACK_MODEL=models/gemma-3-270m-q4_k_m.gguf)")
    s = ServerProcess("--kv-cache-tokens", "16384", "--block-size", str(P), "--prefill-chunk",
                      str(P), "--max-seqs", "4", timeout=300)
    yield s
    assert s.stop() == 0, "".join(s.stderr_lines[-20:])


def model_id(server):
    return server.client().models.list().data[0].id


def shared_prefix(n_words=2300):
    facts = []
    i = 0
    while sum(len(f.split()) for f in facts) < n_words:
        facts.append(f"Bridge {i} crosses the river near market {i % 17} and tower {i % 5}.")
        i += 1
    return "Facts about the city. " + " ".join(facts) + "\n"


def test_shared_prefix_hit_matches_cold(server):
    c = server.client(timeout=600)
    m = model_id(server)
    prefix = shared_prefix()
    a = c.completions.create(model=m, prompt=prefix + "Question: where is bridge 3?\nAnswer:",
                             max_tokens=4, temperature=0)
    assert a.usage.prompt_tokens >= 3000, a.usage
    q = prefix + "Question: name two towers.\nAnswer:"
    hot = c.completions.create(model=m, prompt=q, max_tokens=16, temperature=0)
    cold = c.completions.create(model=m, prompt=q, max_tokens=16, temperature=0,
                                extra_body={"cache_salt": "cold-run"})
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert hot.usage.prompt_tokens == cold.usage.prompt_tokens
    # The shared part is at least 3,000 tokens; the hit covers it down to a
    # block boundary.
    assert hot.usage.prompt_tokens_details.cached_tokens >= 3000 - P, hot.usage
    print(f"shared prefix: first {a.usage.prompt_tokens} prompt tokens; second "
          f"{hot.usage.prompt_tokens} prompt, {hot.usage.prompt_tokens_details.cached_tokens} "
          f"cached; cold {cold.usage.prompt_tokens_details.cached_tokens} cached; "
          f"text {hot.choices[0].text!r}")
    assert hot.choices[0].text == cold.choices[0].text
    st = server.wait_idle()
    assert st["pool"]["blocks_used"] == 0
    groups = st["pool"]["groups"]
    assert len(groups) == 6 and groups[0]["window"] == 0
    assert all(g["window"] == 512 for g in groups[1:])


def test_three_turn_chat_prefills_only_new_tokens(server):
    c = server.client(timeout=600)
    m = model_id(server)
    messages = [{"role": "system", "content": shared_prefix(600)}]
    prev_prompt = 0
    for turn, question in enumerate(["Which bridge is near market 2?",
                                     "And which tower is next to it?",
                                     "Summarise both answers in one line."]):
        messages.append({"role": "user", "content": question})
        r = c.chat.completions.create(model=m, messages=messages, max_tokens=24, temperature=0)
        u = r.usage
        cached = u.prompt_tokens_details.cached_tokens
        prefilled = u.prompt_tokens - cached
        print(f"turn {turn + 1}: {u.prompt_tokens} prompt tokens, {cached} cached, "
              f"{prefilled} prefilled")
        if turn > 0:
            # Everything the previous prompt held came from the cache (down to
            # a block boundary); only the reply and the new turn are computed.
            assert cached >= prev_prompt - P, (turn, u)
            assert prefilled <= u.prompt_tokens - prev_prompt + P, (turn, u)
        prev_prompt = u.prompt_tokens
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
    assert server.wait_idle()["pool"]["blocks_used"] == 0
