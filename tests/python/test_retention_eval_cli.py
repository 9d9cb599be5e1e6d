"""`kvstack retention-eval` on the default model, small budgets (seconds):
the full cache is the first row and agrees with itself exactly; every
policy row is scored on the same tokens, keeps fewer tokens and fewer KV
bytes than the full cache, and a budget covering the prompt gives the full
cache's scores; the passkey task runs for every row; bad arguments are
errors naming the option."""
import json
import os

import pytest

from conftest import KVSTACK_BIN, MODEL, run_kvstack

TEXT = "/usr/share/common-licenses/GPL-3"


@pytest.fixture(autouse=True)
def need_inputs():
    if not os.path.exists(KVSTACK_BIN) or not os.path.exists(MODEL):
        pytest.skip("kvstack binary or model missing")
    if not os.path.exists(TEXT):
        pytest.skip(TEXT + " missing")


def test_rows_scores_memory_and_passkey():
    r = run_kvstack("retention-eval", "-m", MODEL, "-f", TEXT, "--ctx", 160, "--score", 8,
                    "--gen", 4, "--policies", "streamingllm,snapkv,h2o", "--budgets", "25%,4096",
                    "--passkey-lengths", 200, "--passkey-depths", "0.5", "-t", 2, "--json")
    rows = [json.loads(l) for l in r.stdout.splitlines() if l.startswith("{")]
    assert [(x["policy"], x["budget"]) for x in rows] == [
        ("full", "-"), ("streamingllm", "25%"), ("streamingllm", "4096"), ("snapkv", "25%"),
        ("snapkv", "4096"), ("h2o", "25%"), ("h2o", "4096")]
    full = rows[0]
    assert full["ppl_rel_change"] == 0 and full["kld_mean"] == 0
    assert full["top1_agreement"] == 1 and full["greedy_agreement"] == 1
    assert full["tokens_resident_per_layer"] == 160 + 8
    assert all(x["n_scored"] == 7 and x["ppl_full"] == full["ppl_full"] for x in rows)
    assert all(len(x["passkey"]) == 1 and x["passkey"][0]["length"] == 200 for x in rows)
    for x in rows[1:]:
        if x["budget"] == "25%":
            # 40 prompt tokens kept (+ slack up to the block size, SnapKV's
            # union over KV heads) of 160, plus the scored tokens.
            assert x["tokens_resident_per_layer"] < full["tokens_resident_per_layer"] - 40, x
            assert x["kv_resident_bytes"] < full["kv_resident_bytes"], x
            assert x["kld_mean"] > 0, x
        else:
            # A budget covering the prompt keeps everything: the full scores.
            assert x["tokens_resident_per_layer"] == full["tokens_resident_per_layer"], x
            assert abs(x["ppl"] / full["ppl"] - 1) < 1e-9 and x["kld_mean"] < 1e-9, x
            assert x["greedy_agreement"] == 1
    assert rows[5]["config"] == "h2o:budget=20,window=20,obs=32"
    assert rows[1]["config"] == "streamingllm:sinks=4,window=36"


def test_help_and_bad_arguments():
    r = run_kvstack("retention-eval", "--help")
    assert "passkey" in r.stdout and "--budgets" in r.stdout
    for extra, msg in [(["--budgets", "10x"], "--budgets: '10x'"),
                       (["--budgets", "120%"], "120% > 100%"),
                       (["--policies", "lru"], "unknown policy 'lru'"),
                       (["--passkey-depths", "2"], "--passkey-depths: '2'"),
                       (["--kv-retention", "h2o:budget=8,window=8"], "--kv-retention is not used")]:
        r = run_kvstack("retention-eval", "-m", MODEL, "-f", TEXT, *extra, check=False)
        assert r.returncode != 0 and msg in r.stderr, (extra, r.stderr)
