"""kvstack's scalar dequantization vs the `gguf` package, bit for bit in f32.

(a) every tensor of the default model; (b) for every other supported type, a
GGUF file written with gguf.GGUFWriter holding random raw blocks (random bytes,
with the f16 scale fields set to finite random values so no NaN/Inf appear).
Both sides are dequantized (kvstack via `kvstack_gguf_tool dequant`, the
reference via gguf.quants.dequantize) and compared on their f32 bit patterns.

Env: KVSTACK_BUILD_DIR (tool at src/model/tools/kvstack_gguf_tool),
KVSTACK_MODEL (default model).
"""

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

import gguf
from gguf import GGMLQuantizationType as Q

from conftest import BUILD_DIR, MODEL as _MODEL

TOOL = BUILD_DIR / "src" / "model" / "tools" / "kvstack_gguf_tool"
MODEL = Path(_MODEL)

# Byte offsets of the f16 scale fields inside one block, per type.
F16_FIELDS = {
    Q.Q4_0: [0],
    Q.Q4_1: [0, 2],
    Q.Q5_0: [0],
    Q.Q5_1: [0, 2],
    Q.Q8_0: [0],
    Q.Q2_K: [80, 82],
    Q.Q3_K: [108],
    Q.Q4_K: [0, 2],
    Q.Q5_K: [0, 2],
    Q.Q6_K: [208],
}
PLAIN = [Q.F32, Q.F16, Q.BF16]


def run_tool(*args):
    if not TOOL.exists():
        pytest.fail(f"{TOOL} not built (set KVSTACK_BUILD_DIR or build kvstack_gguf_tool)")
    proc = subprocess.run([str(TOOL), *map(str, args)], capture_output=True, text=True)
    assert proc.returncode == 0, f"kvstack_gguf_tool {' '.join(map(str, args))}: {proc.stderr}"
    return proc.stdout


def assert_bits_equal(got, ref, what):
    ref = np.asarray(ref, dtype=np.float32)
    assert got.dtype == np.float32, what
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != reference {ref.shape}"
    got_nan, ref_nan = np.isnan(got), np.isnan(ref)
    assert np.array_equal(got_nan, ref_nan), f"{what}: NaN positions differ"
    diff = (got.view(np.uint32) != ref.view(np.uint32)) & ~ref_nan
    if diff.any():
        idx = np.argwhere(diff)[0]
        pytest.fail(
            f"{what}: {int(diff.sum())} of {diff.size} values differ; first at {tuple(idx)}: "
            f"got {got[tuple(idx)]!r} want {ref[tuple(idx)]!r}"
        )


def dequant_with_tool(path, name, tmp_path):
    out = tmp_path / "t.npy"
    run_tool("dequant", path, name, out)
    got = np.load(out)
    out.unlink()
    return got


def test_default_model_matches_gguf_py():
    if not MODEL.exists():
        pytest.fail(f"model {MODEL} missing (run `make model`)")
    reader = gguf.GGUFReader(str(MODEL))
    assert len(reader.tensors) > 0
    listing = run_tool("list", MODEL)
    assert listing.splitlines()[0].endswith(f"tensors {len(reader.tensors)}")
    # `dump` streams every tensor (file order, as GGUFReader lists them) as raw f32.
    proc = subprocess.Popen([str(TOOL), "dump", str(MODEL)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    seen_types = set()
    try:
        for t in reader.tensors:
            ref = gguf.quants.dequantize(t.data, t.tensor_type)
            n_bytes = ref.size * 4
            buf = proc.stdout.read(n_bytes)
            assert len(buf) == n_bytes, f"dump ended early at {t.name}: {proc.stderr.read()!r}"
            got = np.frombuffer(buf, dtype=np.float32).reshape(ref.shape)
            assert_bits_equal(got, ref, f"{MODEL.name}:{t.name} ({t.tensor_type.name})")
            seen_types.add(t.tensor_type)
        assert proc.stdout.read(1) == b"", "dump wrote more data than the tensors hold"
        assert proc.wait() == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    # The default model is Q4_1 with F32 norms and a Q8_0 embedding.
    assert {Q.Q4_1, Q.F32, Q.Q8_0} <= seen_types


def finite_f16_bits(rng, n):
    bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint32).astype(np.uint16)
    inf_nan = (bits & 0x7C00) == 0x7C00
    bits[inf_nan] &= np.uint16(0xFBFF)  # exponent 31 -> 30
    return bits


def random_raw(rng, qtype, shape):
    """Random raw bytes for a tensor of `shape` (numpy order, last = ne0)."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    n_rows = int(np.prod(shape[:-1]))
    n_blocks = n_rows * shape[-1] // block_size
    if qtype == Q.F16:
        raw = finite_f16_bits(rng, n_rows * shape[-1]).view(np.uint8)
    elif qtype == Q.BF16:
        bits = rng.integers(0, 1 << 16, size=n_rows * shape[-1], dtype=np.uint32).astype(np.uint16)
        bits[(bits & 0x7F80) == 0x7F80] &= np.uint16(0xBFFF)
        raw = bits.view(np.uint8)
    elif qtype == Q.F32:
        bits = rng.integers(0, 1 << 32, size=n_rows * shape[-1], dtype=np.uint64).astype(np.uint32)
        bits[(bits & 0x7F800000) == 0x7F800000] &= np.uint32(0xBFFFFFFF)
        raw = bits.view(np.uint8)
    else:
        blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint16).astype(np.uint8)
        for off in F16_FIELDS[qtype]:
            blocks[:, off : off + 2] = finite_f16_bits(rng, n_blocks).view(np.uint8).reshape(-1, 2)
        raw = blocks
    return np.ascontiguousarray(raw.reshape(*shape[:-1], shape[-1] // block_size * type_size))


def test_random_blocks_every_type_match_gguf_py(tmp_path):
    rng = np.random.default_rng(1234)
    path = tmp_path / "random.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    expected = {}
    for qtype in PLAIN + list(F16_FIELDS):
        block_size = gguf.GGML_QUANT_SIZES[qtype][0]
        ne0 = block_size * (3 if block_size > 1 else 96)
        for shape in [(5, ne0), (2, 3, ne0)]:
            name = f"{qtype.name}.{len(shape)}d"
            raw = random_raw(rng, qtype, shape)
            writer.add_tensor(name, raw, raw_dtype=qtype)
            expected[name] = (qtype, gguf.quants.dequantize(raw, qtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    # The reference must itself be free of NaN/Inf for the comparison to be strict.
    listing = run_tool("list", path)
    for name, (qtype, ref) in expected.items():
        assert f"tensor {name} {qtype.name} " in listing
        assert np.isfinite(ref).all(), name
        got = dequant_with_tool(path, name, tmp_path)
        assert_bits_equal(got, ref, f"{name} ({qtype.name})")
