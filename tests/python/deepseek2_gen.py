"""Tiny random-weight deepseek2 GGUF models (MLA attention, MoE FFN) for tests.

No small deepseek2 GGUF exists to download, so tests write their own: a few MB,
random weights, the tokenizer copied from another GGUF (SmolLM2's, so both
kvstack and llama.cpp can load the file), generated into a temp dir at test time.

Tensor names, shapes and metadata keys follow llama.cpp's deepseek2 loader
(src/models/deepseek2.cpp, load_arch_hparams / load_arch_tensors) and its
converter (conversion/deepseek.py). ggml shapes are written innermost first:
  attn_q           {n_embd, H * (nope + rope)}          (q_lora_rank = 0)
  attn_q_a         {n_embd, q_lora}, attn_q_a_norm {q_lora}, attn_q_b {q_lora, H * (nope + rope)}
  attn_kv_a_mqa    {n_embd, kv_lora + rope}             (latent c_t, then the shared RoPE key)
  attn_kv_a_norm   {kv_lora}
  attn_kv_b        {kv_lora, H * (nope + v)}            ("kv_b" layout: per head k_nope then v)
  attn_k_b         {nope, kv_lora, H}, attn_v_b {kv_lora, v, H}   ("split" layout, MLA keys set)
  attn_output      {H * v, n_embd}
  dense layers:    ffn_gate / ffn_up {n_embd, n_ff}, ffn_down {n_ff, n_embd}
  MoE layers:      ffn_gate_inp {n_embd, E}, ffn_{gate,up}_exps {n_embd, n_ff_exp, E},
                   ffn_down_exps {n_ff_exp, n_embd, E}, ffn_{gate,up}_shexp {n_embd, n_ff_exp * S},
                   ffn_down_shexp {n_ff_exp * S, n_embd}, optional exp_probs_b.bias {E}
The split layout is what llama.cpp's current converter writes (key_length =
kv_lora + rope, value_length = kv_lora, key_length_mla / value_length_mla the
per-head sizes); llama.cpp then runs the latent ("MQA") cache. The kv_b layout
(no *_mla keys, key_length = nope + rope, value_length = v) is the legacy one
llama.cpp still loads and runs as MHA.

Run as a script to write the variants: python deepseek2_gen.py OUT_DIR TOKENIZER_GGUF
(--bench: the benchmark model BENCH instead).
"""
import pathlib
import sys
from dataclasses import dataclass, field

import numpy as np
import gguf

QK = gguf.GGMLQuantizationType


@dataclass(frozen=True)
class Deepseek2Spec:
    name: str
    q_lora: int = 32          # 0: attn_q directly (no low-rank q path)
    split_kv_b: bool = False  # True: attn_k_b / attn_v_b; False: attn_kv_b
    n_embd: int = 64
    n_head: int = 4
    kv_lora: int = 32
    nope: int = 32
    rope: int = 16
    v_dim: int = 32
    n_layer: int = 3
    n_dense_lead: int = 1
    n_ff: int = 128
    n_expert: int = 8
    n_expert_used: int = 2
    n_expert_shared: int = 1
    n_ff_exp: int = 32
    gating: int = 1             # gguf.ExpertGatingFuncType: 1 softmax, 2 sigmoid
    weights_norm: bool = False  # renormalise the top-k weights to sum 1
    weights_scale: float = 1.0  # routed_scaling_factor
    probs_bias: bool = False    # exp_probs_b (selection-only bias, DeepSeek V3)
    yarn: bool = True           # YaRN rope scaling metadata
    yarn_factor: float = 4.0
    yarn_orig_ctx: int = 256
    yarn_mscale_all_dim: float = 0.707
    ctx: int = 1024
    rope_base: float = 10000.0
    weight_type: QK = QK.F32
    embd_type: QK = QK.Q8_0     # token_embd (tied output)
    shared_kv_layers: int = 0   # the last N layers read the last storing layer's KV
    seed: int = 0
    extra: dict = field(default_factory=dict)


# Every combination the tests cover: both q paths, both kv_b layouts, both gating
# functions, normalisation on/off, the selection bias, YaRN on/off.
VARIANTS = [
    Deepseek2Spec("qlora-kvb", q_lora=32, split_kv_b=False, seed=1),
    Deepseek2Spec("q-split", q_lora=0, split_kv_b=True, weights_norm=True, seed=2),
    Deepseek2Spec("qlora-split-sigmoid", q_lora=32, split_kv_b=True, gating=2, weights_norm=True,
                  weights_scale=2.5, probs_bias=True, n_expert_shared=2, seed=3),
    Deepseek2Spec("q-kvb-noyarn", q_lora=0, split_kv_b=False, yarn=False,
                  n_dense_lead=0, seed=4),
]

# A model sized so that decode attention matters (docs/benchmarks.md, "MLA"):
# DeepSeek-V2's attention widths (16 of its 128 heads, d_c 512, d_R 64, nope
# 128, v 128) on a small body (n_embd 512, 8 layers, small MoE), Q8_0 weights,
# 32K context, split kv_b (llama.cpp runs it through its latent MLA cache).
BENCH = Deepseek2Spec("bench", q_lora=0, split_kv_b=True, n_embd=512, n_head=16, kv_lora=512,
                      nope=128, rope=64, v_dim=128, n_layer=8, n_dense_lead=1, n_ff=1024,
                      n_expert=8, n_expert_used=2, n_expert_shared=1, n_ff_exp=256, yarn=False,
                      ctx=32768, weight_type=QK.Q8_0, seed=7)

# BENCH's attention (16 heads, the same latent and head widths) on one dense
# layer with a 512-wide FFN, so that filling a 16K context takes seconds, not
# minutes, while attention stays most of a 16K decode step (docs/benchmarks.md,
# "16K end to end").
BENCH_16K = Deepseek2Spec("bench16k", q_lora=0, split_kv_b=True, n_embd=512, n_head=16,
                          kv_lora=512, nope=128, rope=64, v_dim=128, n_layer=1, n_dense_lead=1,
                          n_ff=512, yarn=False, ctx=32768, weight_type=QK.Q8_0, seed=8)


def _copy_tokenizer(writer, tokenizer_gguf):
    r = gguf.GGUFReader(str(tokenizer_gguf))
    n_vocab = None
    for key, f in r.fields.items():
        if not key.startswith("tokenizer.") or key == "tokenizer.chat_template":
            continue
        vtype = f.types[0]
        value = f.contents()
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, value)
            if key == "tokenizer.ggml.tokens":
                n_vocab = len(value)
        elif vtype == gguf.GGUFValueType.STRING:
            writer.add_string(key, value)
        elif vtype == gguf.GGUFValueType.BOOL:
            writer.add_bool(key, bool(value))
        else:
            writer.add_key_value(key, value, vtype)
    assert n_vocab, f"{tokenizer_gguf} has no tokenizer.ggml.tokens"
    return n_vocab


def write_deepseek2(path, spec: Deepseek2Spec, tokenizer_gguf):
    """Writes one random deepseek2 GGUF to path; returns path."""
    rng = np.random.default_rng(spec.seed)
    w = gguf.GGUFWriter(str(path), "deepseek2")
    w.add_name(f"tiny-deepseek2-{spec.name}")
    n_vocab = _copy_tokenizer(w, tokenizer_gguf)
    H, d_qk = spec.n_head, spec.nope + spec.rope

    w.add_block_count(spec.n_layer)
    w.add_context_length(spec.ctx)
    w.add_embedding_length(spec.n_embd)
    w.add_feed_forward_length(spec.n_ff)
    w.add_head_count(H)
    w.add_head_count_kv(1 if spec.split_kv_b else H)
    w.add_rope_freq_base(spec.rope_base)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_leading_dense_block_count(spec.n_dense_lead)
    w.add_vocab_size(n_vocab)
    w.add_q_lora_rank(spec.q_lora)
    w.add_kv_lora_rank(spec.kv_lora)
    if spec.split_kv_b:
        w.add_key_length(spec.kv_lora + spec.rope)
        w.add_value_length(spec.kv_lora)
        w.add_key_length_mla(d_qk)
        w.add_value_length_mla(spec.v_dim)
    else:
        w.add_key_length(d_qk)
        w.add_value_length(spec.v_dim)
    w.add_expert_feed_forward_length(spec.n_ff_exp)
    w.add_expert_count(spec.n_expert)
    w.add_expert_used_count(spec.n_expert_used)
    w.add_expert_shared_count(spec.n_expert_shared)
    w.add_expert_weights_scale(spec.weights_scale)
    w.add_expert_weights_norm(spec.weights_norm)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType(spec.gating))
    w.add_rope_dimension_count(spec.rope)
    if spec.shared_kv_layers:
        # The key llama.cpp's gemma3n/gemma4 read; llama.cpp's deepseek2 does not.
        w.add_uint32("deepseek2.attention.shared_kv_layers", spec.shared_kv_layers)
    if spec.yarn:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(spec.yarn_factor)
        w.add_rope_scaling_orig_ctx_len(spec.yarn_orig_ctx)
        # as the converter writes it: 0.1 * mscale_all_dim
        w.add_rope_scaling_yarn_log_mul(0.1 * spec.yarn_mscale_all_dim)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if spec.weight_type == QK.Q8_0
                    else gguf.LlamaFileType.MOSTLY_F16)

    def mat(name, *shape, std=None, qtype=None):
        # shape in numpy order (outermost first): [..., n_out, n_in]
        n_in = shape[-1]
        scale = float(std) if std else 1.0 / float(np.sqrt(n_in))
        a = (rng.standard_normal(shape) * scale).astype(np.float32)
        qtype = spec.weight_type if qtype is None else qtype
        if qtype == QK.F32:
            w.add_tensor(name, a)
        elif qtype == QK.F16:
            w.add_tensor(name, a.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)

    def norm(name, n):
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    mat("token_embd.weight", n_vocab, spec.n_embd, std=0.5, qtype=spec.embd_type)
    norm("output_norm.weight", spec.n_embd)  # output.weight absent: tied embeddings
    for i in range(spec.n_layer):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight", spec.n_embd)
        if spec.q_lora > 0:
            mat(p + "attn_q_a.weight", spec.q_lora, spec.n_embd)
            norm(p + "attn_q_a_norm.weight", spec.q_lora)
            mat(p + "attn_q_b.weight", H * d_qk, spec.q_lora)
        else:
            mat(p + "attn_q.weight", H * d_qk, spec.n_embd)
        mat(p + "attn_kv_a_mqa.weight", spec.kv_lora + spec.rope, spec.n_embd)
        norm(p + "attn_kv_a_norm.weight", spec.kv_lora)
        # One f16 [H, nope + v, kv_lora] up-projection written in either layout,
        # so a spec and its twin with split_kv_b flipped are the same model.
        kv_b = (rng.standard_normal((H, spec.nope + spec.v_dim, spec.kv_lora)) /
                np.sqrt(spec.kv_lora)).astype(np.float16)
        if spec.split_kv_b:
            # numpy [H, kv_lora, nope] = ggml {nope, kv_lora, H}; [H, v, kv_lora] = {kv_lora, v, H}
            w.add_tensor(p + "attn_k_b.weight",
                         np.ascontiguousarray(kv_b[:, :spec.nope, :].transpose(0, 2, 1)))
            w.add_tensor(p + "attn_v_b.weight", np.ascontiguousarray(kv_b[:, spec.nope:, :]))
        else:
            w.add_tensor(p + "attn_kv_b.weight", kv_b.reshape(H * (spec.nope + spec.v_dim),
                                                              spec.kv_lora))
        mat(p + "attn_output.weight", spec.n_embd, H * spec.v_dim)
        norm(p + "ffn_norm.weight", spec.n_embd)
        if i < spec.n_dense_lead:
            mat(p + "ffn_gate.weight", spec.n_ff, spec.n_embd)
            mat(p + "ffn_up.weight", spec.n_ff, spec.n_embd)
            mat(p + "ffn_down.weight", spec.n_embd, spec.n_ff)
            continue
        E, F, S = spec.n_expert, spec.n_ff_exp, spec.n_expert_shared
        mat(p + "ffn_gate_inp.weight", E, spec.n_embd, qtype=QK.F32)
        if spec.probs_bias:
            w.add_tensor(p + "exp_probs_b.bias", (0.05 * rng.standard_normal(E)).astype(np.float32))
        mat(p + "ffn_gate_exps.weight", E, F, spec.n_embd)
        mat(p + "ffn_up_exps.weight", E, F, spec.n_embd)
        mat(p + "ffn_down_exps.weight", E, spec.n_embd, F)
        mat(p + "ffn_gate_shexp.weight", F * S, spec.n_embd)
        mat(p + "ffn_up_shexp.weight", F * S, spec.n_embd)
        mat(p + "ffn_down_shexp.weight", spec.n_embd, F * S)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def twin(spec: Deepseek2Spec) -> Deepseek2Spec:
    """The same model (same weights) in the other kv_b layout."""
    import dataclasses
    return dataclasses.replace(spec, name=spec.name + "-twin", split_kv_b=not spec.split_kv_b)


def write_all(out_dir, tokenizer_gguf, variants=VARIANTS):
    """Writes every variant into out_dir; returns {name: path}."""
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return {v.name: write_deepseek2(out_dir / f"tiny-deepseek2-{v.name}.gguf", v, tokenizer_gguf)
            for v in variants}


if __name__ == "__main__":
    args = sys.argv[1:]
    chosen = VARIANTS
    if "--bench" in args:
        chosen = [BENCH]
    if "--bench16k" in args:
        chosen = [BENCH_16K]
    args = [a for a in args if a not in ("--bench", "--bench16k")]
    if len(args) != 2:
        sys.exit("usage: deepseek2_gen.py [--bench|--bench16k] OUT_DIR TOKENIZER_GGUF\n"
                 "  --bench: write only the benchmark model (BENCH) instead of the test variants\n"
                 "  --bench16k: write only the one-layer 16K benchmark model (BENCH_16K)")
    for name, path in write_all(args[0], args[1], chosen).items():
        print(f"{name}: {path} ({path.stat().st_size / 1e6:.1f} MB)")
