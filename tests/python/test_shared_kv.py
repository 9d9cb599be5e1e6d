"""Cross-layer KV sharing (YOCO / Gemma 3n) end to end through the CLI.

The test copies SmolLM2-135M (30 llama layers) with one metadata key added,
llama.attention.shared_kv_layers = 10 (the key llama.cpp's gemma3n reads):
the last 10 layers then attend over layer 19's K/V and store nothing.
- `kvstack plan --verify` counts the 10 layers at 0 bytes and matches the
  engine's payload, allocated bytes, blocks and block bytes exactly;
- the engine's KV pool holds 20 layers x 768 B per token, not 30;
- the declaration changes the model (its logits differ from the original's)
  while the original file still runs unchanged; the float64 equivalence of
  the shared layers' attention is forward_shared_kv_test.cpp's job.
"""
import re

import numpy as np
import pytest

from conftest import SOURCE_DIR, run_kvstack

gguf = pytest.importorskip("gguf")
MODEL = SOURCE_DIR / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
if not MODEL.exists():
    pytest.skip(f"model not found: {MODEL}", allow_module_level=True)
SHARED = 10


@pytest.fixture(scope="module")
def shared_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("shared_kv") / "smollm2-shared-kv.gguf"
    r = gguf.GGUFReader(str(MODEL))
    w = gguf.GGUFWriter(str(path), "llama")
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = f.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_array(key, f.contents())
        elif vtype == gguf.GGUFValueType.STRING:
            w.add_string(key, f.contents())
        elif vtype == gguf.GGUFValueType.BOOL:
            w.add_bool(key, bool(f.contents()))
        else:
            w.add_key_value(key, f.contents(), vtype)
    w.add_uint32("llama.attention.shared_kv_layers", SHARED)
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_plan_verify_counts_shared_layers_exactly(shared_model):
    out = run_kvstack("plan", "-m", shared_model, "--lengths", "100,37,300", "--block-size", 16,
                      "--verify").stdout
    assert "20 x full layers                   768 B/token/layer" in out, out
    assert "10 x full layers, shared KV        0 B/token/layer" in out, out
    rows = {l.split()[0]: l.split()[1:] for l in out.splitlines()
            if l.strip().split(" ")[0] in ("payload_bytes", "allocated_bytes", "block_count",
                                            "block_bytes")}
    assert len(rows) == 4, out
    for name, (pred, meas, verdict) in rows.items():
        assert pred == meas and verdict == "match", (name, pred, meas)
    assert int(rows["payload_bytes"][0]) == (100 + 37 + 300) * 20 * 768


def test_pool_holds_only_the_storing_layers_and_the_model_changes(shared_model, tmp_path):
    sizes, logits = {}, {}
    for name, path in (("original", MODEL), ("shared", shared_model)):
        out = tmp_path / f"{name}.npy"
        err = run_kvstack("logits", "-m", path, "--tokens", "1,2,3,4,5,6,7,8", "--out", out,
                          "--kv-cache-tokens", 1024).stderr
        m = re.search(r"KV pool (\d+) blocks x (\d+) tokens \(f16, ([\d.]+) (KiB|MiB)\)", err)
        assert m, err
        size = float(m.group(3)) * (1024 if m.group(4) == "KiB" else 1024 * 1024)
        sizes[name] = size / (int(m.group(1)) * int(m.group(2)))
        logits[name] = np.load(out)
    assert sizes["original"] == 30 * 768
    assert sizes["shared"] == 20 * 768
    assert np.isfinite(logits["shared"]).all()
    assert np.abs(logits["shared"] - logits["original"]).max() > 0.1
