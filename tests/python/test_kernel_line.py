"""The model-load line names the kernels that run, per weight format.

`kvstack run` prints "kernels (matmul: <type> <path>, ...; attention <path>)";
the paths come from the ops dispatcher (matmul_kernel_name). Checked against
what KVSTACK_ISA forces and what this CPU has (from /proc/cpuinfo), so the
line can never name a path the machine cannot run.
"""
import os
import pathlib
import re
import subprocess

from conftest import KVSTACK_BIN, MODEL

LINE = re.compile(r"kernels \(matmul: (?P<matmul>[^;]+); attention (?P<attn>\w+)\)")


def load_line(isa):
    env = dict(os.environ)
    env.pop("KVSTACK_ISA", None)
    if isa:
        env["KVSTACK_ISA"] = isa
    proc = subprocess.run([KVSTACK_BIN, "run", "-m", MODEL, "-p", "Hi", "-n", "1", "-t", "1"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    m = LINE.search(proc.stderr)
    assert m, f"no kernels clause in the load line:\n{proc.stderr}"
    paths = dict(part.split(" ", 1) for part in m.group("matmul").split(", "))
    return paths, m.group("attn")


def cpu_flags():
    text = pathlib.Path("/proc/cpuinfo").read_text()
    return set(re.search(r"^flags\s*:(.*)$", text, re.M).group(1).split())


def test_forced_scalar_and_avx2():
    paths, attn = load_line("scalar")
    assert set(paths) == {"q4_1", "q8_0"}  # SmolLM2's matmul formats
    assert set(paths.values()) == {"scalar"} and attn == "scalar"
    if "avx2" in cpu_flags():
        paths, attn = load_line("avx2")
        assert set(paths.values()) == {"avx2"} and attn == "avx2"


def test_default_names_only_paths_this_cpu_has():
    paths, attn = load_line(None)
    flags = cpu_flags()
    vnni = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"} <= flags
    for fmt, path in paths.items():
        if vnni:
            assert path == "avx512-vnni", (fmt, path)
        elif "avx2" in flags:
            assert path == "avx2", (fmt, path)
        else:
            assert path == "scalar", (fmt, path)
    assert attn == ("avx2" if "avx2" in flags else "scalar")
