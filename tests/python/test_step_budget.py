"""The serving step budget (issue 23 item 3, docs/architecture.md "Step
budget"): by default `kvstack serve` plans each step for every sequence's
decode row plus one 64-token prefill chunk (max-seqs + 63 tokens), and an
explicit --max-batch-tokens still wins. The ready line names the budget."""
import re

import pytest

from test_server import ServerProcess


def tokens_per_step(server):
    line = next(l for l in server.stderr_lines if "ready on" in l)
    return tuple(int(x) for x in re.search(r"max (\d+) sequences, (\d+) tokens/step", line).groups())


@pytest.mark.parametrize("extra, want", [
    ((), (16, 16 + 63)),
    (("--max-seqs", "5"), (5, 5 + 63)),
    (("--max-seqs", "64"), (64, 64 + 63)),
    (("--max-seqs", "5", "--max-batch-tokens", "40"), (5, 40)),
])
def test_default_step_budget_follows_max_seqs(extra, want):
    s = ServerProcess("--kv-cache-tokens", "1024", *extra)
    try:
        assert tokens_per_step(s) == want
        # A prompt longer than one chunk is still served (several steps).
        r = s.client().completions.create(model="kvstack", prompt="word " * 150, max_tokens=3,
                                          temperature=0)
        assert r.usage.prompt_tokens > 64 and r.usage.completion_tokens == 3
    finally:
        assert s.stop() == 0, "".join(s.stderr_lines[-20:])
