"""`kvstack run --kv-stats --json --kv-events FILE` on the default model: the
events file holds one stored event per published block (parents first,
chained by hash) and agrees with the printed statistics."""
import json
import os
import subprocess

import pytest

from conftest import KVSTACK_BIN as BIN, MODEL


@pytest.fixture(scope="module")
def run_output(tmp_path_factory):
    if not os.path.exists(BIN) or not os.path.exists(MODEL):
        pytest.skip("kvstack binary or model missing")
    events = tmp_path_factory.mktemp("kv") / "events.jsonl"
    cmd = [BIN, "run", "-m", MODEL, "-p", "The quick brown fox jumps over the lazy dog. " * 3,
           "-n", "6", "--temp", "0", "--block-size", "4", "--threads", "2", "--json",
           "--kv-stats", "--kv-events", str(events)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1]), events.read_text().splitlines()


def test_events_match_published_blocks(run_output):
    res, lines = run_output
    stats = res["kv_stats"]
    events = [json.loads(l) for l in lines]
    assert stats["enabled"] and stats["queries"] == 1
    assert stats["published"] > 0
    stored = [e for e in events if e["event"] == "stored"]
    assert len(stored) == stats["published"] == stats["nodes"]
    assert not [e for e in events if e["event"] == "removed"]
    seen = {"0" * 32}
    for e in stored:
        assert len(e["hash"]) == 32 and e["n_tokens"] == 4
        assert e["parent"] in seen, "a block's event precedes its parent's"
        seen.add(e["hash"])
    # One chain: prompt + generated tokens written, full blocks published.
    committed = res["prompt_tokens"] + res["completion_tokens"] - 1
    assert len(stored) == committed // 4


def test_kv_events_refused_without_prefix_cache(tmp_path):
    if not os.path.exists(BIN) or not os.path.exists(MODEL):
        pytest.skip("kvstack binary or model missing")
    out = subprocess.run([BIN, "run", "-m", MODEL, "-p", "hi", "-n", "1", "--no-prefix-cache",
                          "--kv-events", str(tmp_path / "e.jsonl")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "--kv-events needs the prefix cache" in out.stderr
