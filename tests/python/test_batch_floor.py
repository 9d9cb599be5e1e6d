"""bench/batch_floor.py (issue 23): the 16-sequence step's floor from the
per-block probes and the cached KV read, beside the measured steps; one
round, so that the script and the probes it reads cannot rot."""
import json
import os
import subprocess
import sys

import pytest

from conftest import BUILD_DIR, KVSTACK_BIN, MODEL, SOURCE_DIR

OPS_BENCH = BUILD_DIR / "src" / "ops" / "ops_bench"
ATTN_BENCH = BUILD_DIR / "src" / "attention" / "attention_bench"


def run_floor(*extra):
    cmd = [sys.executable, str(SOURCE_DIR / "bench" / "batch_floor.py"), "--kvstack-bin",
           KVSTACK_BIN, "--ops-bench", str(OPS_BENCH), "--attention-bench", str(ATTN_BENCH),
           "--model", MODEL, *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=280)


def avx512():
    with open("/proc/cpuinfo") as f:
        return " avx512f " in f.read().replace("\n", " ")


@pytest.fixture(autouse=True)
def need_binaries():
    for p in (KVSTACK_BIN, OPS_BENCH, ATTN_BENCH, MODEL):
        if not os.path.exists(p):
            pytest.skip(f"{p} missing")


def test_one_round_floor_adds_up():
    p = run_floor("--rounds", "1", "--json")
    if not avx512():
        assert p.returncode != 0 and "AVX-512" in p.stderr
        pytest.skip("no AVX-512 F on this CPU: the floor probes refuse, as checked")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    r = out["rounds"][0]
    assert r["step_ms_1"] > 0 and r["step_ms_16"] > 0
    assert r["allowed_ms"] == pytest.approx(2 * r["step_ms_1"])
    cached = r["weights_floor_ms"] + r["attention_floor_ms"]
    # The DRAM bound applies when the single step is no faster than its
    # bytes (96.4 MB of weights, 1/16 of 97 MiB of KV) read from DRAM.
    weights_b, kv_b = 96436224, 97 * 2**20
    assert r["dram_floor_ms_1"] == pytest.approx((weights_b + kv_b / 16) / r["dram_GB_s"] * 1e-6)
    assert r["dram_floor_ms_16"] == pytest.approx((weights_b + kv_b) / r["dram_GB_s"] * 1e-6)
    assert r["from_dram"] == (1 if r["step_ms_1"] >= r["dram_floor_ms_1"] else 0)
    want_floor = max(cached, r["dram_floor_ms_16"]) if r["from_dram"] else cached
    assert r["floor_ms"] == pytest.approx(want_floor)
    assert r["floor_ratio"] == pytest.approx(r["floor_ms"] / r["step_ms_1"])
    # The weights floor: 207,360 Q4_1 and 55,296 Q8_0 blocks over 2 threads,
    # each at the cheaper of the VNNI bound and the AMX probe.
    per41 = r["vnni_ns"] + r["update_ns_q4_1"]
    per80 = r["vnni_ns"] + r["update_ns_q8_0"]
    if r["amx_ns"] is not None:
        per41 = min(per41, r["amx_ns"])
        per80 = min(per80, r["amx_ns"] - r["update_ns_q4_1"] + r["update_ns_q8_0"])
    want = (207360 * per41 + 55296 * per80) / 2 * 1e-6
    assert r["weights_floor_ms"] == pytest.approx(want, rel=1e-9)
    # A floor is below what the engine measures.
    assert r["floor_ms"] < r["step_ms_16"]
    assert 0 < r["update_ns_q8_0"] and 0 < r["update_ns_q4_1"] and 0 < r["vnni_ns"]


def test_bad_arguments_are_refused():
    p = run_floor("--rounds", "0")
    assert p.returncode != 0 and "--rounds" in p.stderr
    p = run_floor("--threads", "3")
    assert p.returncode != 0 and "--threads" in p.stderr
    p = subprocess.run([sys.executable, str(SOURCE_DIR / "bench" / "batch_floor.py"), "--model",
                        "other.gguf"], capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "SmolLM2" in p.stderr
