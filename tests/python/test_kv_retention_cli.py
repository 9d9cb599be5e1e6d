"""--kv-retention end to end on the default model (SmolLM2-135M).

`kvstack run`: a StreamingLLM sequence compacts while it decodes, its
resident tokens stay within sinks + window + slack while the logical length
grows, the freed blocks return (fewer blocks allocated and fewer pool bytes
resident than the exact run of the same length), and the compaction totals
reach --kv-stats. A window covering the whole sequence gives the exact
run's tokens. H2O compacts every layer while decoding and stays within
budget + window + slack; a covering budget gives the exact tokens. Bad
policies are CLI errors naming the fault.

`kvstack serve`: the request field "kv_retention" (object or text form) and
the deployment default; bad values get a 400 naming kv_retention; the
totals reach /v1/kv/stats and /metrics, and every block is free afterwards.
"""
import json
import os
import subprocess

import pytest
import requests

from conftest import KVSTACK_BIN as BIN, MODEL, THREADS

PROMPT = "The history of the city begins with a small village by the river. " * 2


def need_model():
    if not os.path.exists(BIN) or not os.path.exists(MODEL):
        pytest.skip("kvstack binary or model missing")


def run_json(*extra, n=200, prompt=PROMPT):
    cmd = [BIN, "run", "-m", MODEL, "-p", prompt, "-n", str(n), "--temp", "0", "--ignore-eos",
           "--threads", str(THREADS), "--json", "--kv-stats", *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


@pytest.fixture(scope="module")
def runs():
    need_model()
    exact, _ = run_json("--no-prefix-cache")
    sllm, err = run_json("--no-prefix-cache", "--kv-retention", "streamingllm:sinks=4,window=48")
    wide, _ = run_json("--no-prefix-cache", "--kv-retention", "streamingllm:sinks=4,window=4096")
    return exact, sllm, err, wide


def test_streaming_compacts_and_frees_blocks(runs):
    exact, sllm, _, _ = runs
    n_logical = sllm["prompt_tokens"] + sllm["completion_tokens"] - 1
    r = sllm["kv_stats"]["retention"]
    g = sllm["kv_stats"]["groups"][0]
    assert r["compactions"] > 0 and r["blocks_freed"] > 0 and r["bytes_moved"] > 0
    # Resident: sinks + the window's last 47 + up to slack - 1 (block 16) more.
    assert g["tokens_resident"] <= 4 + 47 + 15
    assert r["tokens_dropped"] == n_logical - g["tokens_resident"]
    ge = exact["kv_stats"]["groups"][0]
    assert ge["tokens_resident"] == n_logical
    assert g["allocated_bytes"] * 3 < ge["allocated_bytes"]


def test_window_covering_sequence_is_exact(runs):
    exact, _, _, wide = runs
    assert wide["tokens"] == exact["tokens"]
    assert wide["kv_stats"]["retention"]["compactions"] == 0


def test_snapkv_compacts_the_prompt_once():
    need_model()
    res, _ = run_json("--no-prefix-cache", "--kv-retention", "snapkv:budget=24,window=8,gqa=mean",
                      n=20, prompt=PROMPT * 12)
    r = res["kv_stats"]["retention"]
    groups = res["kv_stats"]["groups"]
    n_logical = res["prompt_tokens"] + res["completion_tokens"] - 1
    # One KV group per layer; one compaction each at the first decode step;
    # every decoded token stays.
    assert len(groups) == 30
    assert r["compactions"] == 30 and r["tokens_dropped"] > 0 and r["blocks_freed"] > 0
    assert sum(n_logical - g["tokens_resident"] for g in groups) == r["tokens_dropped"]
    for g in groups:
        # mean: at most budget per KV head (3 heads) + the window + decoded tokens.
        assert 24 + 8 + res["completion_tokens"] - 1 <= g["tokens_resident"]
        assert g["tokens_resident"] <= 3 * 24 + 8 + res["completion_tokens"] - 1


def test_pyramidkv_keeps_less_in_deeper_layers():
    need_model()
    res, _ = run_json("--no-prefix-cache", "--kv-retention", "pyramidkv:budget=24,window=8,beta=4",
                      n=4, prompt=PROMPT * 12)
    groups = res["kv_stats"]["groups"]
    r = res["kv_stats"]["retention"]
    assert len(groups) == 30, "one KV group per layer under pyramidkv"
    assert r["compactions"] == 30 and r["blocks_freed"] > 0
    # Budgets fall from 2 * 24 - 6 = 42 (layer 0) to 6 (layer 29).
    assert groups[0]["tokens_resident"] > groups[-1]["tokens_resident"]
    assert groups[-1]["tokens_resident"] >= 6 + 8


def test_h2o_compacts_while_decoding_and_a_covering_budget_is_exact(runs):
    exact = runs[0]
    res, _ = run_json("--no-prefix-cache", "--kv-retention", "h2o:budget=24,window=24")
    r = res["kv_stats"]["retention"]
    groups = res["kv_stats"]["groups"]
    n_logical = res["prompt_tokens"] + res["completion_tokens"] - 1
    # One KV group per layer; each compacts while decoding and stays within
    # budget + window + slack (the block size, 16).
    assert len(groups) == 30
    assert r["compactions"] >= 30 and r["blocks_freed"] > 0 and r["bytes_moved"] > 0
    for g in groups:
        assert g["tokens_resident"] <= 24 + 24 + 16
    assert sum(n_logical - g["tokens_resident"] for g in groups) == r["tokens_dropped"]
    wide, _ = run_json("--no-prefix-cache", "--kv-retention", "h2o:budget=4096,window=64")
    assert wide["tokens"] == exact["tokens"]
    assert wide["kv_stats"]["retention"]["compactions"] == 0


def test_topk_reads_fewer_blocks_and_covering_k_is_exact(runs):
    exact = runs[0]
    res, _ = run_json("--no-prefix-cache", "--kv-retention", "topk:k=3")
    r = res["kv_stats"]["retention"]
    g = res["kv_stats"]["groups"][0]
    n_logical = res["prompt_tokens"] + res["completion_tokens"] - 1
    # Nothing dropped: the full history stays; decode queries read 3 blocks
    # per layer of the up to ceil(n / 16) there are.
    assert r["compactions"] == 0 and g["tokens_resident"] == n_logical
    assert 0 < r["topk_blocks_read"] < r["topk_blocks_total"]
    assert r["topk_blocks_read"] <= 3 * 30 * res["completion_tokens"]
    wide, _ = run_json("--no-prefix-cache", "--kv-retention", "topk:k=1000")
    assert wide["tokens"] == exact["tokens"]
    wr = wide["kv_stats"]["retention"]
    assert wr["topk_blocks_read"] == wr["topk_blocks_total"] > 0


def test_streaming_generates_past_a_pool_the_exact_run_does_not_fit():
    """A 256-token pool: `-n 600` does not fit the exact cache (a clear CLI
    error before anything runs), but StreamingLLM keeps sinks + window +
    slack and generates all 600 tokens, the prefix cache on (its published
    prompt blocks are copied as the first compaction moves them)."""
    need_model()
    cmd = [BIN, "run", "-m", MODEL, "-p", PROMPT, "-n", "600", "--temp", "0", "--ignore-eos",
           "--threads", str(THREADS), "--json", "--kv-cache-tokens", "256"]
    exact = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert exact.returncode != 0 and "the KV pool has room for 256 tokens" in exact.stderr, \
        exact.stderr
    sllm = subprocess.run(cmd + ["--kv-retention", "streamingllm:sinks=4,window=60"],
                          capture_output=True, text=True, timeout=300)
    assert sllm.returncode == 0, sllm.stderr
    assert json.loads(sllm.stdout.strip().splitlines()[-1])["completion_tokens"] == 600


@pytest.mark.parametrize("spec,msg", [
    ("topk:k=0", "k=0 must be in [1,"),
    ("topk", "topk takes k=N"),
    ("topk:k=4,sink=x", "parameter sink='x' is not an integer"),
    ("h2o:budget=8", "h2o needs budget=N (heavy hitters) and window=N"),
    ("h2o:budget=8,window=8,kernel=3", "unknown h2o parameter 'kernel'"),
    ("lru:budget=3", "unknown policy 'lru'"),
    ("snapkv:window=8", "snapkv needs budget=N"),
    ("snapkv:budget=8,kernel=2", "kernel=2 must be odd"),
    ("pyramidkv:budget=8,beta=0", "beta=0 must be >= 1"),
    ("streamingllm:sinks=4", "needs window=N"),
    ("streamingllm:window=-2", "window=-2 must be >= 1"),
    ("streamingllm:window=8,foo=1", "unknown streamingllm parameter 'foo'"),
])
def test_bad_policy_is_a_cli_error(spec, msg):
    need_model()
    out = subprocess.run([BIN, "run", "-m", MODEL, "-p", "hi", "-n", "1", "--kv-retention", spec],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "--kv-retention" in out.stderr and msg in out.stderr, out.stderr


def test_unsupported_format_is_a_cli_error():
    need_model()
    out = subprocess.run([BIN, "run", "-m", MODEL, "-p", "hi", "-n", "1", "--kv-dtype", "fp8",
                          "--kv-retention", "streamingllm:window=8"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "fp8 cannot move single tokens" in out.stderr


def test_server_request_field_default_stats_and_metrics():
    need_model()
    from test_server import ServerProcess

    srv = ServerProcess("--kv-retention", "streamingllm:sinks=4,window=40")
    try:
        body = {"prompt": PROMPT, "max_tokens": 120, "temperature": 0, "ignore_eos": True}
        # Deployment default (no field): compacts.
        r = requests.post(srv.base + "/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        st = srv.wait_idle()
        dropped_default = st["pool"]["retention"]["tokens_dropped"]
        assert dropped_default > 0 and st["pool"]["retention"]["blocks_freed"] > 0
        # "none" per request: exact, nothing more dropped.
        r = requests.post(srv.base + "/v1/completions",
                          json={**body, "kv_retention": {"policy": "none"}}, timeout=300)
        assert r.status_code == 200, r.text
        assert srv.wait_idle()["pool"]["retention"]["tokens_dropped"] == dropped_default
        # A narrower window per request (object and text forms) drops more.
        for field in ({"policy": "streamingllm", "sinks": 2, "window": 16, "slack": 4},
                      "streamingllm:sinks=2,window=16",
                      {"policy": "snapkv", "budget": 16, "window": 8, "gqa": "mean"},
                      {"policy": "h2o", "budget": 16, "window": 16, "obs": 8},
                      {"policy": "topk", "k": 2},
                      {"policy": "topk", "k": 4, "sink": 1, "recent": 2}):
            r = requests.post(srv.base + "/v1/chat/completions",
                              json={"messages": [{"role": "user", "content": PROMPT}],
                                    "max_tokens": 60, "temperature": 0, "kv_retention": field},
                              timeout=300)
            assert r.status_code == 200, r.text
        st = srv.wait_idle()
        assert st["pool"]["retention"]["tokens_dropped"] > dropped_default
        assert st["pool"]["blocks_used"] == 0
        for bad, msg in [({"policy": "lru"}, "unknown policy 'lru'"),
                         ({"policy": "h2o", "budget": 8}, "h2o needs budget=N"),
                         ({"policy": "streamingllm", "window": 0}, "window=0 must be >= 1"),
                         ({"policy": "streamingllm", "window": "8"}, "must be an integer"),
                         ({"policy": "snapkv", "budget": 8, "gqa": 1}, "must be a string"),
                         ({"policy": "snapkv", "budget": 8, "gqa": "max"}, "must be union or mean"),
                         ({"window": 8}, "needs a string 'policy'"),
                         (5, "must be an object or a string")]:
            r = requests.post(srv.base + "/v1/completions",
                              json={**body, "max_tokens": 2, "kv_retention": bad}, timeout=60)
            assert r.status_code == 400, (bad, r.text)
            err = r.json()["error"]
            assert err["param"] == "kv_retention" and msg in err["message"], err
        metrics = srv.get("/metrics").text
        line = [l for l in metrics.splitlines()
                if l.startswith("kvstack:kv_retention_tokens_dropped_total")]
        assert line and float(line[0].split()[-1]) == st["pool"]["retention"]["tokens_dropped"]
        assert "kvstack:kv_retention_blocks_freed_total" in metrics
        assert "kvstack:kv_retention_bytes_moved_total" in metrics
    finally:
        srv.stop()


def test_streaming_sequences_share_a_small_pool_without_preemption():
    """Four ~560-token sequences in a 1,024-token pool: exact ones must be
    preempted (and recomputed); StreamingLLM ones stay within their window's
    blocks, are admitted by that bound and all run to the end together."""
    need_model()
    import concurrent.futures as cf
    from test_server import ServerProcess

    def serve(*extra):
        srv = ServerProcess("--kv-cache-tokens", "1024", "--max-seqs", "4", *extra)
        try:
            body = {"prompt": PROMPT * 10, "max_tokens": 300, "temperature": 0,
                    "ignore_eos": True}
            with cf.ThreadPoolExecutor(4) as ex:
                rs = list(ex.map(lambda _: requests.post(srv.base + "/v1/completions", json=body,
                                                         timeout=600), range(4)))
            assert [r.status_code for r in rs] == [200] * 4, [r.text for r in rs]
            assert all(r.json()["usage"]["completion_tokens"] == 300 for r in rs)
            metrics = srv.get("/metrics").text
            value = lambda name: float(next(l for l in metrics.splitlines()
                                            if l.startswith(name)).split()[-1])
            assert srv.wait_idle()["pool"]["blocks_used"] == 0
            return value("kvstack:num_preemptions_total"), value(
                "kvstack:kv_retention_blocks_freed_total")
        finally:
            srv.stop()

    exact_preempted, _ = serve()
    sllm_preempted, freed = serve("--kv-retention", "streamingllm:sinks=4,window=64")
    assert exact_preempted > 0
    assert sllm_preempted == 0 and freed > 0
