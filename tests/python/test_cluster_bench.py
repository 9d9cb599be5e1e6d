"""Smoke test of bench/cluster.py (issue 21 item 5), so that the script cannot rot.

A tiny workload (6 requests, short prompts and outputs) through both modes:
one prefill + one decode worker behind vllm-router in PD mode and two
colocated `--role both` workers behind it in plain mode, on namespace hosts
(loopback when namespaces cannot be made). Checks that every request
finished, that the goodput the script reports is the count of requests
meeting both objectives in its own per-request figures, that the KV moved
(pulls, bytes) and no lease stayed open, and that the table is printed; plus
--help and a bad --pin.
"""
import json
import subprocess
import sys

import pytest

from conftest import KVSTACK_BIN, MODEL, SOURCE_DIR

SCRIPT = SOURCE_DIR / "bench" / "cluster.py"
ROUTER = SOURCE_DIR / ".venv" / "bin" / "vllm-router"
SLO_TTFT, SLO_TPOT = 2.0, 0.05


def run(*args, timeout=150):
    return subprocess.run([sys.executable, str(SCRIPT), "--bin", KVSTACK_BIN, "--model", MODEL,
                           *map(str, args)], capture_output=True, text=True, timeout=timeout)


def test_help_and_bad_pin():
    h = run("--help")
    assert h.returncode == 0 and "--prefill" in h.stdout and "goodput" in h.stdout.lower()
    bad = run("--prefill", "1", "--decode", "2", "--pin", "0", "1", "--router", sys.executable)
    assert bad.returncode != 0 and "3 workers need 3 cpu lists" in bad.stderr


def test_tiny_cluster_run(tmp_path):
    if not ROUTER.exists():
        pytest.skip("vllm-router is not installed in .venv (scripts/setup.sh)")
    out = tmp_path / "cluster.json"
    r = run("--requests", 6, "--classes", "40:6,30:10", "--concurrency", 3, "--pin", 0, 1,
            "--slo-ttft", SLO_TTFT, "--slo-tpot", SLO_TPOT, "--kv-mem", "48M", "--json", out)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "requests done" in r.stderr  # progress on stderr
    assert "| mode | workers: cores |" in r.stdout and "| PD 1P+1D |" in r.stdout
    data = json.loads(out.read_text())
    runs = {run["mode"]: run for run in data["runs"]}
    assert set(runs) == {"pd", "colocated"}
    for mode, run_ in runs.items():
        lat = run_["latency"]
        assert lat["n"] == 6 and lat["ok"] == 6, (mode, run_["failures"])
        reqs = run_["requests"]
        assert all(q["ok"] and q["tokens"] >= 2 for q in reqs)
        good = sum(q["ttft"] <= SLO_TTFT and q["tpot"] <= SLO_TPOT for q in reqs)
        assert lat["good"] == good, mode
        assert 0 < lat["ttft_p50"] <= lat["ttft_p90"] <= lat["ttft_p99"]
        assert lat["itl_p50"] <= lat["itl_p99"]
        assert run_["queue"] and all(v["samples"] > 0 for v in run_["queue"].values())
    assert [w["role"] for w in runs["colocated"]["workers"]] == ["both", "both"]
    assert [w["cores"] for w in runs["pd"]["workers"]] == [[0], [1]]
    tr = runs["pd"]["transfer"]
    # Every prompt is longer than one 16-token block: each request pulls.
    assert tr["pulls_ok"] == 6 and tr["pulls_failed"] == 0 and tr["bytes_pulled"] > 0
    assert tr["leases_completed"] == 6 and tr["leases_open"] == 0
    assert runs["colocated"]["transfer"] is None
