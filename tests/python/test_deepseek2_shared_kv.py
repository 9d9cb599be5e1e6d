"""Cross-layer KV sharing on deepseek2 (MLA) against a float64 reference.

A generated deepseek2 (deepseek2_gen.py: 5 dense layers, no MoE, no YaRN, f32
weights and f32 token embedding, the split attn_k_b / attn_v_b layout)
declares deepseek2.attention.shared_kv_layers = 2: layers 3 and 4 compute only
their own q and attend over layer 2's cache, i.e. over layer 2's latent
[c ; k_R] up-projected by layer 2's W_kv_b (exactly layer 2's K/V, which is
what the expanded cache stores for it). The reference below is numpy float64
from the file's tensors, written from that definition and the deepseek2
formulas (RMSNorm, NORM-mode RoPE on the decoupled dims, softmax scale
1/sqrt(qk_nope + qk_rope), SwiGLU, tied output). kvstack's logits for every
position, with the latent cache (prefill chunks absorbed and expanded, block
sizes 1-64, chunks of 1 = decode rows) and with the expanded cache, must match
it; the same weights without the declaration give a different model
(reference and engine), and the latent pool holds 3 layers per token, not 5.
llama.cpp's deepseek2 has no shared-KV layers, so it is no oracle here.

Env: KVSTACK_BIN; the tokenizer is copied from models/SmolLM2-135M-Instruct.Q4_1.gguf.
"""
import dataclasses
import json

import numpy as np
import pytest

from conftest import SOURCE_DIR, THREADS, run_kvstack
from deepseek2_gen import QK, Deepseek2Spec, write_deepseek2
from llama_parity import kvstack_logits

gguf = pytest.importorskip("gguf")
TOKENIZER = SOURCE_DIR / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
if not TOKENIZER.exists():
    pytest.skip(f"tokenizer source not found: {TOKENIZER}", allow_module_level=True)

SPEC = Deepseek2Spec("dense-shared", q_lora=0, split_kv_b=True, n_layer=5, n_dense_lead=5,
                     yarn=False, embd_type=QK.F32, shared_kv_layers=2, seed=11)
N_TOK = 70


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("deepseek2_shared")
    return (write_deepseek2(d / "shared.gguf", SPEC, TOKENIZER),
            write_deepseek2(d / "unshared.gguf", dataclasses.replace(SPEC, shared_kv_layers=0),
                            TOKENIZER))


def tensors(path):
    r = gguf.GGUFReader(str(path))
    out = {}
    for t in r.tensors:
        a = np.array(t.data)
        if t.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            raise AssertionError(f"{t.name}: unexpected type {t.tensor_type}")
        out[t.name] = a.astype(np.float64)
    return out


def rms(x, w, eps=1e-6):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, pos, base):
    """NORM-mode RoPE over the last dim: adjacent pairs (x[2i], x[2i+1])."""
    n = x.shape[-1]
    theta = pos[:, None] * base ** (-np.arange(0, n, 2) / n)  # [T, n/2]
    shape = (len(pos),) + (1,) * (x.ndim - 2) + (n // 2,)
    c, s = np.cos(theta).reshape(shape), np.sin(theta).reshape(shape)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * c - x1 * s
    out[..., 1::2] = x0 * s + x1 * c
    return out


def reference_logits(path, spec, ids):
    """float64 logits [T, vocab] of the whole sequence (causal)."""
    w = tensors(path)
    H, nope, dr, r, vd = spec.n_head, spec.nope, spec.rope, spec.kv_lora, spec.v_dim
    T = len(ids)
    pos = np.arange(T, dtype=np.float64)
    scale = 1.0 / np.sqrt(nope + dr)
    mask = np.triu(np.full((T, T), -np.inf), 1)
    first_shared = spec.n_layer - spec.shared_kv_layers
    kv = {}  # layer -> (k [T, H, nope + dr], v [T, H, vd]) of the storing layers
    x = w["token_embd.weight"][ids]
    for i in range(spec.n_layer):
        p = f"blk.{i}."
        h = rms(x, w[p + "attn_norm.weight"])
        q = (h @ w[p + "attn_q.weight"].T).reshape(T, H, nope + dr)
        q = np.concatenate([q[..., :nope], rope(q[..., nope:], pos, spec.rope_base)], axis=-1)
        if i < first_shared:
            kva = h @ w[p + "attn_kv_a_mqa.weight"].T
            c = rms(kva[:, :r], w[p + "attn_kv_a_norm.weight"])
            k_r = rope(kva[:, r:], pos, spec.rope_base)
            kb = w[p + "attn_k_b.weight"]  # [H, r, nope]: k_nope = kb^T c
            vb = w[p + "attn_v_b.weight"]  # [H, v, r]
            k_nope = np.einsum("hrn,tr->thn", kb, c)
            v = np.einsum("hvr,tr->thv", vb, c)
            k = np.concatenate([k_nope, np.broadcast_to(k_r[:, None, :], (T, H, dr))], axis=-1)
            kv[i] = (k, v)
        k, v = kv[min(i, first_shared - 1)]  # a shared layer: the last storing layer's K/V
        s = np.einsum("thd,shd->hts", q, k) * scale + mask
        pr = np.exp(s - s.max(axis=-1, keepdims=True))
        pr /= pr.sum(axis=-1, keepdims=True)
        o = np.einsum("hts,shv->thv", pr, v).reshape(T, H * vd)
        x = x + o @ w[p + "attn_output.weight"].T
        h = rms(x, w[p + "ffn_norm.weight"])
        g, u = h @ w[p + "ffn_gate.weight"].T, h @ w[p + "ffn_up.weight"].T
        x = x + (g / (1.0 + np.exp(-g)) * u) @ w[p + "ffn_down.weight"].T
    return rms(x, w["output_norm.weight"]) @ w["token_embd.weight"].T


@pytest.fixture(scope="module")
def ids():
    return [int(t) for t in np.random.default_rng(5).integers(100, 40000, N_TOK)]


def test_shared_layers_match_float64_reference(models, ids, monkeypatch):
    shared, unshared = models
    ref = reference_logits(shared, SPEC, ids)
    ref_unshared = reference_logits(unshared, dataclasses.replace(SPEC, shared_kv_layers=0), ids)
    tol = 1e-5 * np.abs(ref).max()
    # The declaration changes the model: far more than the tolerance.
    assert np.abs(ref - ref_unshared).max() > 100 * tol
    runs = [("expanded", None, 16, 512), ("latent", "absorbed", 16, 512)]
    runs += [("latent", form, bs, chunk) for form in ("absorbed", "expanded")
             for bs, chunk in ((1, 7), (4, 1), (16, 64), (64, 70))]
    for mode, form, bs, chunk in runs:
        if form == "expanded" and chunk == 1:
            continue  # one-row chunks run absorbed in every form
        monkeypatch.setenv("KVSTACK_MLA_PREFILL", form or "auto")
        got = kvstack_logits(ids, "-m", shared, "--kv-dtype", "f32", "--kv-mla", mode,
                             "--block-size", bs, "--prefill-chunk", chunk)
        err = np.abs(got - ref).max()
        print(f"\n{mode} cache ({form} prefill), block {bs}, chunk {chunk}: "
              f"max abs vs float64 {err:.2e} (tol {tol:.2e})")
        assert err < tol, (mode, form, bs, chunk, err)
    # The unshared file through the same engine matches its own reference.
    got = kvstack_logits(ids, "-m", unshared, "--kv-dtype", "f32", "--kv-mla", "latent")
    assert np.abs(got - ref_unshared).max() < tol


def test_shared_layers_store_nothing(models):
    shared, unshared = models
    sizes = {}
    for name, path in (("shared", shared), ("unshared", unshared)):
        proc = run_kvstack("bench", "-m", path, "--prompt-tokens", 8, "--gen", 2, "--reps", 1,
                           "--kv-dtype", "f16", "--kv-mla", "latent", "--json",
                           "--threads", THREADS)
        sizes[name] = json.loads(proc.stdout)["kv_bytes_per_token"]
    # N (d_c + d_R) b: 3 storing layers of 32 + 16 f16 elements, against 5.
    assert sizes == {"shared": 3 * 48 * 2, "unshared": 5 * 48 * 2}, sizes


def test_plan_verify_counts_shared_mla_layers(models):
    """The planner reads the declaration: 3 latent layers at (32 + 16) x 2 B,
    the 2 shared ones at 0, and --verify matches the engine exactly."""
    out = run_kvstack("plan", "-m", models[0], "--lengths", "100,37", "--block-size", 16,
                      "--verify").stdout
    assert "3 x mla layers                     96 B/token/layer" in out, out
    assert "2 x mla layers, shared KV          0 B/token/layer" in out, out
    rows = {l.split()[0]: l.split()[1:] for l in out.splitlines()
            if l.strip().split(" ")[0] in ("payload_bytes", "allocated_bytes", "block_count",
                                           "block_bytes")}
    assert len(rows) == 4, out
    for name, (predicted, measured, verdict) in rows.items():
        assert verdict == "match" and predicted == measured, (name, predicted, measured)
    assert rows["payload_bytes"][0] == str(137 * 3 * 48 * 2)
