"""Shared fixtures for the Python reference tests (run by CTest via pytest)."""
import os
import pathlib
import subprocess

import pytest

SOURCE_DIR = pathlib.Path(os.environ.get("KVSTACK_SOURCE_DIR", pathlib.Path(__file__).resolve().parents[2]))
BUILD_DIR = pathlib.Path(os.environ.get("KVSTACK_BUILD_DIR", SOURCE_DIR / "build"))
KVSTACK_BIN = os.environ.get("KVSTACK_BIN", str(BUILD_DIR / "src" / "cli" / "kvstack"))
MODEL = os.environ.get("KVSTACK_MODEL", str(SOURCE_DIR / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
THREADS = int(os.environ.get("KVSTACK_TEST_THREADS", "2"))


def run_kvstack(*args, input=None, check=True, timeout=600):
    """Runs the kvstack CLI; returns the CompletedProcess (text mode)."""
    cmd = [KVSTACK_BIN, *map(str, args)]
    proc = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr}")
    return proc


@pytest.fixture(scope="session")
def llama_ref():
    """llama.cpp (llama-cpp-python) on the same GGUF, all logits kept."""
    import llama_cpp

    return llama_cpp.Llama(model_path=MODEL, n_ctx=2048, n_batch=512, logits_all=True,
                           n_threads=THREADS, n_threads_batch=THREADS, verbose=False)
