"""`kvstack plan --verify`: the planner's predictions against the real engine.

For several workload shapes, block sizes and every KV dtype the engine
supports, the engine runs the workload and payload bytes, allocated bytes,
block count and block bytes must match the prediction exactly (the command
exits non-zero otherwise).
"""
import os
import re

import pytest

from conftest import MODEL, SOURCE_DIR, run_kvstack

SHAPES = [
    ("--batch", 1, "--ctx", 1, "--block-size", 16),
    ("--batch", 3, "--ctx", 100, "--block-size", 16),
    ("--batch", 2, "--ctx", 33, "--block-size", 1),
    ("--batch", 4, "--ctx", 257, "--block-size", 64),
    ("--lengths", "17,1,256,300", "--block-size", 32),
    ("--batch", 1, "--ctx", 700, "--block-size", 256),
]


def parse_rows(stdout):
    rows = {}
    for line in stdout.splitlines():
        m = re.match(r"\s+(\w+)\s+(\d+)\s+(\d+)\s+(match|MISMATCH|\(informative\))", line)
        if m:
            rows[m.group(1)] = (int(m.group(2)), int(m.group(3)), m.group(4))
    return rows


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "_".join(map(str, s)))
def test_verify_matches(shape, dtype):
    proc = run_kvstack("plan", "-m", MODEL, "--verify", "--kv-dtype", dtype, *shape)
    rows = parse_rows(proc.stdout)
    for key in ("payload_bytes", "allocated_bytes", "block_count", "block_bytes"):
        assert key in rows, proc.stdout
        predicted, measured, verdict = rows[key]
        assert predicted == measured and verdict == "match", (key, rows[key])
    # The pool's resident growth is the allocated blocks' pages (informative,
    # page-granular): never below the payload, never above the pool mapping.
    assert rows["rss_growth_bytes"][1] >= rows["payload_bytes"][1]


def test_verify_rejects_format_the_engine_lacks():
    proc = run_kvstack("plan", "-m", MODEL, "--verify", "--kv-dtype", "int3", "--batch", 1,
                       "--ctx", 64, "--block-size", 16, check=False)
    assert proc.returncode != 0
    assert "int3" in proc.stderr


@pytest.mark.parametrize("dtype", ["fp8", "int8", "int4"])
@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[4]], ids=lambda s: "_".join(map(str, s)))
def test_verify_matches_quantized(shape, dtype):
    """Quantized formats count their metadata (fp8: per-block scales) exactly as the planner."""
    test_verify_matches(shape, dtype)


def check_exact(proc, keys=("payload_bytes", "allocated_bytes", "block_count", "block_bytes")):
    rows = parse_rows(proc.stdout)
    for key in keys:
        assert key in rows, proc.stdout
        predicted, measured, verdict = rows[key]
        assert predicted == measured and verdict == "match", (key, rows[key])
    return rows


@pytest.mark.parametrize("dtype", ["kivi2", "kivi4"])
@pytest.mark.parametrize("extra", [(), ("--kv-residual", 32)], ids=["R128", "R32"])
@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[4], SHAPES[5]],
                         ids=lambda s: "_".join(map(str, s)))
def test_verify_matches_kivi(shape, dtype, extra):
    """KIVI: blocks reserve every token's quantized slot; the newest R + (T - R) % G
    tokens are f16 rows outside the pool, counted in payload and allocation and
    checked on their own (residual_bytes)."""
    proc = run_kvstack("plan", "-m", MODEL, "--verify", "--kv-dtype", dtype, *extra, *shape)
    rows = check_exact(proc, ("payload_bytes", "allocated_bytes", "block_count", "block_bytes",
                              "residual_bytes"))
    assert rows["residual_bytes"][1] > 0


@pytest.mark.parametrize("k,v", [("kivi2", "int8"), ("int8", "f16"), ("f16", "kivi4")])
def test_verify_matches_split_k_v(k, v):
    proc = run_kvstack("plan", "-m", MODEL, "--verify", "--kv-dtype-k", k, "--kv-dtype-v", v,
                       *SHAPES[4])
    check_exact(proc)


GEMMA = os.environ.get("KVSTACK_GEMMA3_MODEL",
                       str(SOURCE_DIR / "models" / "gemma-3-270m-q4_k_m.gguf"))
GEMMA_SHAPES = [
    ("--batch", 1, "--ctx", 2048, "--block-size", 16),
    ("--lengths", "1,17,513,529,1300", "--block-size", 32),
    ("--batch", 2, "--ctx", 700, "--block-size", 64),
]


@pytest.mark.parametrize("dtype", ["f16", "int8"])
@pytest.mark.parametrize("shape", GEMMA_SHAPES, ids=lambda s: "_".join(map(str, s)))
def test_verify_matches_gemma3_per_group(shape, dtype):
    """Gemma 3 (window 512, every sixth layer full, from the file): the planner
    models the engine's KV groups (one full group, five window groups of 3
    layers, one block size) and matches payload, resident and allocated bytes
    of every group exactly, window groups counted between steps."""
    if not os.path.exists(GEMMA):
        pytest.skip(f"{GEMMA} missing")
    proc = run_kvstack("plan", "-m", GEMMA, "--verify", "--kv-dtype", dtype, *shape, timeout=300)
    rows = check_exact(proc)
    assert rows["group0_window"][:2] == (0, 0)
    for g in range(6):
        for key in ("window", "payload_bytes", "resident_bytes", "allocated_bytes"):
            predicted, measured, verdict = rows[f"group{g}_{key}"]
            assert predicted == measured and verdict == "match", (g, key, rows[f"group{g}_{key}"])
    for g in range(1, 6):
        assert rows[f"group{g}_window"][1] == 512
        # A window group holds far less than the full group once T > w.
        if "2048" in map(str, shape):
            assert rows[f"group{g}_allocated_bytes"][1] * 3 < rows["group0_allocated_bytes"][1]
    assert "group6_window" not in rows
