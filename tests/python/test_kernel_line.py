"""The model-load line names the kernels that run, per weight and KV format.

`kvstack run` prints "kernels (matmul: <type> <path>, ...; attention: <kv>
<path>, ...)"; the matmul paths come from the ops dispatcher
(matmul_kernel_name), the attention paths from the attention dispatcher
(attention_kernel_name, one entry per K[/V] format). Checked against what
KVSTACK_ISA forces and what this CPU has (from /proc/cpuinfo), so the line
can never name a path the machine cannot run.
"""
import os
import pathlib
import re
import subprocess

import pytest

from conftest import KVSTACK_BIN, MODEL

LINE = re.compile(r"kernels \(matmul: (?P<matmul>[^;]+); attention: (?P<attn>[^)]+)\)")


def load_line(isa, *kv_args, attn_isa=None, panels=None):
    env = dict(os.environ)
    env.pop("KVSTACK_ISA", None)
    env.pop("KVSTACK_ATTN_ISA", None)
    env.pop("KVSTACK_WEIGHT_PANELS", None)
    if isa:
        env["KVSTACK_ISA"] = isa
    if attn_isa:
        env["KVSTACK_ATTN_ISA"] = attn_isa
    if panels is not None:
        env["KVSTACK_WEIGHT_PANELS"] = panels
    proc = subprocess.run([KVSTACK_BIN, "run", "-m", MODEL, "-p", "Hi", "-n", "1", "-t", "1",
                           *kv_args], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    m = LINE.search(proc.stderr)
    assert m, f"no kernels clause in the load line:\n{proc.stderr}"
    paths = dict(part.split(" ", 1) for part in m.group("matmul").split(", "))
    attn = dict(part.split(" ", 1) for part in m.group("attn").split(", "))
    return paths, attn


def cpu_flags():
    text = pathlib.Path("/proc/cpuinfo").read_text()
    return set(re.search(r"^flags\s*:(.*)$", text, re.M).group(1).split())


VNNI = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}


def expected_attention(kv, flags):
    """The path attention_kernel_name() must report for KV format kv
    ("int8", or "K/V") on SmolLM2 (head_dim 64) with no KVSTACK_ISA cap."""
    if not {"avx2", "fma", "f16c"} <= flags:
        return "scalar"
    prefill = "avx512" if "avx512f" in flags else "avx2"
    decode = "avx2"
    if VNNI <= flags and all(f in ("int8", "int4") for f in kv.split("/")):
        decode = "avx512-vnni"
    elif "avx512f" in flags and kv == "f16":
        decode = "avx512-f16"
    return decode if decode == prefill else f"{decode} decode + {prefill} prefill"


def test_forced_scalar_and_avx2():
    paths, attn = load_line("scalar")
    assert set(paths) == {"q4_1", "q8_0"}  # SmolLM2's matmul formats
    assert set(paths.values()) == {"scalar"} and attn == {"f16": "scalar"}
    if "avx2" in cpu_flags():
        paths, attn = load_line("avx2")
        assert set(paths.values()) == {"avx2"} and attn == {"f16": "avx2"}
        # KVSTACK_ISA=avx2 keeps every KV format on the AVX2 kernels.
        for kv in ("int8", "int4"):
            _, attn = load_line("avx2", "--kv-dtype", kv)
            assert attn == {kv: "avx2"}, kv


def test_default_names_only_paths_this_cpu_has():
    paths, attn = load_line(None)
    flags = cpu_flags()
    for fmt, path in paths.items():
        if VNNI <= flags:
            # --load-mode copy (the default) packs both formats into panels.
            assert path == "avx512-vnni-panels", (fmt, path)
        elif "avx2" in flags:
            assert path == "avx2", (fmt, path)
        else:
            assert path == "scalar", (fmt, path)
    assert attn == {"f16": expected_attention("f16", flags)}


def test_rows_layout_names_the_row_kernels():
    """mmap keeps GGUF's rows, and so does KVSTACK_WEIGHT_PANELS=0: the
    row-major kernels run and the line says so."""
    flags = cpu_flags()
    want = "avx512-vnni" if VNNI <= flags else ("avx2" if "avx2" in flags else "scalar")
    for paths in (load_line(None, "--load-mode", "mmap")[0], load_line(None, panels="0")[0]):
        assert paths == {"q4_1": want, "q8_0": want}, paths


@pytest.mark.parametrize("kv_args,kv", [
    (("--kv-dtype", "int8"), "int8"),
    (("--kv-dtype", "int4"), "int4"),
    (("--kv-dtype", "int8", "--kv-dtype-v", "f16"), "int8/f16"),
])
def test_quantized_kv_names_its_own_path(kv_args, kv):
    _, attn = load_line(None, *kv_args)
    assert attn == {kv: expected_attention(kv, cpu_flags())}


def test_attention_cap_leaves_matmuls_alone():
    """KVSTACK_ATTN_ISA caps the attention kernels only."""
    flags = cpu_flags()
    default_paths, _ = load_line(None, "--kv-dtype", "int8")
    paths, attn = load_line(None, "--kv-dtype", "int8", attn_isa="scalar")
    assert paths == default_paths and attn == {"int8": "scalar"}
    if {"avx2", "fma", "f16c"} <= flags:
        paths, attn = load_line(None, "--kv-dtype", "int8", attn_isa="avx2")
        assert paths == default_paths and attn == {"int8": "avx2"}
