"""CLI-level tests of `kvstack plan`: JSON keys and values, the GGUF path
against the gguf package, the SVG chart, and bad-input errors."""
import json
import xml.etree.ElementTree as ET

import pytest

from conftest import MODEL, run_kvstack

REQUIRED_KEYS = [
    "kv_bytes_per_token", "kv_payload_bytes", "kv_allocated_bytes", "tail_waste_tokens",
    "block_count", "weights_bytes", "total_bytes", "max_batch_for_budget", "max_ctx_for_budget",
    "crossover_tokens", "decode_step_lower_bound_s", "fetch_time_s", "recompute_time_s",
    "transfer_time_s", "pipelined_ready_time_s",
]


def plan_json(*args):
    proc = run_kvstack("plan", "--json", *args)
    return json.loads(proc.stdout)


def test_json_has_every_key_when_inputs_given():
    out = plan_json("--preset", "llama-3-8b", "--batch", "8", "--ctx", "4097", "--block-size", "16",
                    "--mem", "80GiB", "--mem-bw", "3.35TB/s", "--link-bw", "200Gbit/s",
                    "--link-latency", "20us", "--recompute-rate", "10000")
    for key in REQUIRED_KEYS:
        assert key in out, key
    # Llama-3-8B f16: 2 x 8 KV heads x 128 x 2 B x 32 layers = 131072 B per token.
    assert out["kv_bytes_per_token"] == 131072
    assert out["kv_payload_bytes"] == 8 * 4097 * 131072
    # 4097 tokens = 256 blocks + 1 token: 257 blocks each, 15 tokens wasted each.
    assert out["block_count"] == 8 * 257
    assert out["tail_waste_tokens"] == 8 * 15
    assert out["kv_allocated_bytes"] == 8 * 257 * 16 * 131072
    for key in ["kv_payload_bytes", "kv_allocated_bytes", "weights_bytes", "total_bytes"]:
        assert isinstance(out[key], int), key
    # 200 Gbit/s = 25e9 B/s; transfer = 20 us + payload / 25e9.
    assert out["transfer_time_s"] == pytest.approx(20e-6 + out["kv_payload_bytes"] / 25e9)


def test_keys_absent_without_their_inputs():
    out = plan_json("--preset", "smollm2-135m", "--ctx", "100")
    for key in ["kv_allocated_bytes", "block_count", "max_batch_for_budget",
                "decode_step_lower_bound_s", "fetch_time_s", "transfer_time_s"]:
        assert key not in out, key
    assert out["kv_payload_bytes"] == 100 * 23040


def test_gguf_metadata_and_weights_match_gguf_package():
    gguf = pytest.importorskip("gguf")
    reader = gguf.GGUFReader(MODEL)

    def field(name):
        f = reader.fields[name]
        return int(f.parts[f.data[0]][0])

    n_layers = field("llama.block_count")
    n_heads = field("llama.attention.head_count")
    n_kv = field("llama.attention.head_count_kv")
    head_dim = field("llama.embedding_length") // n_heads
    weights = sum(int(t.n_bytes) for t in reader.tensors)
    out = plan_json("-m", MODEL, "--ctx", "33", "--batch", "2", "--block-size", "16")
    assert out["kv_bytes_per_token"] == 2 * n_layers * n_kv * head_dim * 2
    assert out["weights_bytes"] == weights
    assert out["block_count"] == 2 * 3
    assert out["tail_waste_tokens"] == 2 * 15


def test_svg_is_valid_xml_with_axes_and_budget(tmp_path):
    path = tmp_path / "plan.svg"
    run_kvstack("plan", "--preset", "llama-3-8b", "--ctx", "8192", "--batch", "4", "--mem", "24GiB",
                "--svg", path)
    root = ET.parse(path).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    texts = " ".join(t.text or "" for t in root.iter("{http://www.w3.org/2000/svg}text"))
    assert "context length (tokens" in texts and "(GiB)" in texts
    assert "weights" in texts and "KV f16" in texts and "KV int4" in texts and "budget" in texts
    assert len(list(root.iter("{http://www.w3.org/2000/svg}polyline"))) >= 5


def test_table_labels_units():
    out = run_kvstack("plan", "--preset", "gemma-3-27b", "--ctx", "4096", "--block-size", "16",
                      "--gb").stdout
    assert "52 x window(1024) layers" in out and "10 x full layers" in out
    assert " B (" in out and "GiB" in out and " GB)" in out


@pytest.mark.parametrize("args,needle", [
    (["--preset", "nope"], "unknown preset 'nope'"),
    (["--layers", "4", "--q-heads", "32", "--kv-heads", "5", "--head-dim", "64", "--params", "1B"],
     "not a multiple of KV heads"),
    (["--layers", "4", "--q-heads", "6", "--hidden", "100", "--params", "1B"], "not divisible"),
    (["--preset", "llama-3-8b", "--ctx", "0"], "--ctx"),
    (["--preset", "llama-3-8b", "--ctx", "-3"], "--ctx"),
    (["--preset", "llama-3-8b", "--mem", "-1GiB"], "--mem"),
    (["--preset", "llama-3-8b", "--mem", "0"], "--mem must be > 0"),
    (["--preset", "llama-3-8b", "--tp", "3"], "do not divide across tp=3"),
    (["--preset", "llama-3-8b", "--kv-dtype", "int3"], "unknown KV dtype 'int3'"),
    (["-m", "/nonexistent/model.gguf"], "/nonexistent/model.gguf"),
    (["--preset", "llama-3-8b", "--link-bw", "fast"], "--link-bw"),
])
def test_bad_input_is_a_clear_error(args, needle):
    proc = run_kvstack("plan", *args, check=False)
    assert proc.returncode == 2
    assert needle in proc.stderr
    assert "kvstack plan: error:" in proc.stderr


def test_unreadable_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOTGGUF" + b"\0" * 64)
    proc = run_kvstack("plan", "-m", bad, check=False)
    assert proc.returncode == 2
    assert str(bad) in proc.stderr


def test_plan_needs_neither_q_heads_nor_params_for_kv_bytes():
    args = ["plan", "--layers", 32, "--kv-heads", 8, "--head-dim", 128, "--kv-dtype", "bf16",
            "--ctx", 8192]
    table = run_kvstack(*args)
    assert "KV per token (all layers)          131072 B" in table.stdout, table.stdout
    assert "weights not given" in table.stdout and "query heads not given" in table.stdout
    out = json.loads(run_kvstack(*args, "--json").stdout)
    # 2 (K and V) x 8 heads x 128 x 2 B x 32 layers per token.
    assert out["kv_bytes_per_token"] == 131072
    assert out["kv_payload_bytes"] == 8192 * 131072
    for key in ["weights_bytes", "total_bytes", "crossover_tokens", "activation_bytes",
                "decode_attention_flops_per_step"]:
        assert key not in out, key
    # With --q-heads and --params the omitted figures come back.
    full = json.loads(run_kvstack(*args, "--q-heads", 32, "--params", "8B", "--json").stdout)
    assert full["kv_bytes_per_token"] == 131072 and "total_bytes" in full
    # A figure that needs the weights is an error naming what to give.
    r = run_kvstack(*args, "--mem", "80GiB", check=False)
    assert r.returncode != 0 and "--params or --weights" in r.stderr, r.stderr
