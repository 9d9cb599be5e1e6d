"""`kvstack run --layer-windows` on the default model: the model runs as a
hybrid sliding-window one (KV groups), the window groups keep only the blocks
their window can see (--kv-stats per group; allocated bytes far below the
full-attention run), and a bad window list is refused with a message naming
the flag."""
import json
import os

import pytest

from conftest import MODEL, THREADS, run_kvstack

PROMPT = " ".join(["river bridge market tower museum garden street palace"] * 60)  # ~480 tokens


def run(*extra):
    if not os.path.exists(MODEL):
        pytest.skip("default model missing")
    out = run_kvstack("run", "-m", MODEL, "-p", PROMPT, "-n", "8", "--temp", "0", "--ignore-eos",
                      "--threads", THREADS, "--json", "--kv-stats", "--no-prefix-cache", *extra,
                      timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_window_groups_hold_only_their_window():
    full = run()
    hybrid = run("--layer-windows", "32,32,32,32,32,0")
    groups = hybrid["kv_stats"]["groups"]
    assert len(full["kv_stats"]["groups"]) == 1
    assert len(groups) == 6
    n_tokens = groups[0]["tokens_resident"]
    assert groups[0]["window"] == 0 and groups[0]["blocks_used"] == -(-n_tokens // 16)
    for g in groups[1:]:
        assert g["window"] == 32
        # Blocks a query at the end can see, plus the last step's: (32 - 1 + 1) / 16 + 1.
        assert g["blocks_used"] <= 3
        assert g["tokens_resident"] <= 48
    # One full group of 5 layers instead of 30 full layers: about 1/6 the bytes.
    assert hybrid["kv_allocated_bytes"] * 4 < full["kv_allocated_bytes"]


def test_bad_window_list_is_refused():
    if not os.path.exists(MODEL):
        pytest.skip("default model missing")
    out = run_kvstack("run", "-m", MODEL, "-p", "hi", "-n", "1", "--layer-windows", "32,x",
                      check=False)
    assert out.returncode != 0
    assert "--layer-windows" in out.stderr and "'x'" in out.stderr
