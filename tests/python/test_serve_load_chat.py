"""bench/serve_load.py's multi-turn chat mode against a real kvstack server.

The chat load is the benchmark behind issue 17's "a continued conversation
prefills only its new turn" figures, so its counting is tested here: on a
fresh server with Gemma 3 (hybrid: window layers of 512 tokens, a system
prompt longer than the window), turn 1 prefills its whole prompt and every
later turn serves the earlier turns from the cache and prefills only the new
messages (plus at most one partial block of the history).
"""
import json
import os
import pathlib
import subprocess
import sys

import pytest

from conftest import KVSTACK_BIN, SOURCE_DIR

GEMMA = SOURCE_DIR / "models" / "gemma-3-270m-q4_k_m.gguf"
SMOL = SOURCE_DIR / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
sys.path.insert(0, str(SOURCE_DIR / "bench"))
import serve_load  # noqa: E402


def run_load(*args):
    cmd = [sys.executable, str(SOURCE_DIR / "bench" / "serve_load.py"), "--kvstack-bin",
           KVSTACK_BIN, *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.mark.skipif(not GEMMA.exists(), reason="Gemma 3 model not fetched (scripts/setup.sh model)")
def test_chat_turns_prefill_only_new_tokens():
    rows = run_load("--model", GEMMA, "--chat-turns", 3, "--concurrency", 1, "--requests", 1,
                    "--max-tokens", 8, "--ctx", 4096, "--threads", 2)
    by_turn = {r["turn"]: r for r in rows}
    assert set(by_turn) == {"1", "2", "3", "2+"}, rows
    first = by_turn["1"]
    assert first["prompt_tokens_mean"] > 600  # the system prompt outgrows the 512-token window
    assert first["prefill_tokens_mean"] == first["prompt_tokens_mean"] - first["cached_tokens_mean"]
    assert first["cached_tokens_mean"] < 32  # fresh server: nothing of the conversation cached
    prev_prompt = first["prompt_tokens_mean"]
    for turn in ("2", "3"):
        r = by_turn[turn]
        new_tokens = r["prompt_tokens_mean"] - prev_prompt
        assert new_tokens > 0
        # The history (earlier prompt + reply) comes from the cache, short of
        # at most one 16-token block and the reply's re-tokenised tail.
        assert r["cached_tokens_mean"] >= prev_prompt - 16, (turn, r)
        assert r["prefill_tokens_mean"] <= new_tokens + 16, (turn, r)
        assert r["prefill_tokens_mean"] == r["prompt_tokens_mean"] - r["cached_tokens_mean"]
        prev_prompt = r["prompt_tokens_mean"]
    assert by_turn["2+"]["requests"] == 2


def test_llama_server_gets_kvstack_template():
    if GEMMA.exists():
        assert serve_load.llama_template_args(str(GEMMA)) == ["--no-jinja", "--chat-template",
                                                               "gemma"]
    if SMOL.exists():  # carries its own ChatML template: llama-server reads it itself
        assert serve_load.llama_template_args(str(SMOL)) == []
