#!/usr/bin/env python3
"""Side-by-side speed of kvstack and llama.cpp (llama-cpp-python) on one GGUF.

Four scenarios, each measured on both engines with the same thread count, an
f16 KV cache, batches of up to 512 tokens and random prompt tokens drawn with
a fixed seed:

  decode@128    tokens/s of single-token steps after a 128-token context
  decode@4K     the same after a 4096-token context
  prefill512    tokens/s of a 512-token prompt on an empty cache
  prefill512@4K the same on top of 4096 cached tokens

Every repetition runs each scenario once per engine, alternating which engine
goes first, so slow phases of a shared machine hit both; the table shows the
median of each engine, the ratio of the medians kvstack / llama.cpp (higher
is better for kvstack) and "paired", the median of the per-repetition ratios
(each pairs the two engines' runs of one phase of the machine, so it is the
steadier figure when the machine drifts between repetitions). kvstack runs as a fresh `kvstack bench --json --reps 1` process per
measurement; llama.cpp runs in this process (model loaded once, cache cleared
before each measurement; decode is timed over single-token evals).

This is a benchmark program, not a test: it asserts nothing about the ratios.

  bench/compare_llamacpp.py --threads 2 --reps 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class Scenario:
    name: str
    kind: str  # "decode" or "prefill"
    ctx_fill: int  # tokens in the cache before the measured part
    prompt: int  # prompt tokens (prefill: measured; decode: part of the context)
    gen: int  # decode steps timed (decode only)


def scenarios(n_gen: int) -> list[Scenario]:
    return [
        Scenario("decode@128", "decode", 0, 128, n_gen),
        Scenario("decode@4K", "decode", 4096 - 128, 128, n_gen),
        Scenario("prefill512", "prefill", 0, 512, 0),
        Scenario("prefill512@4K", "prefill", 4096, 512, 0),
    ]


def find_kvstack(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    if os.environ.get("KVSTACK_BIN"):
        return Path(os.environ["KVSTACK_BIN"])
    build = Path(os.environ.get("KVSTACK_BUILD_DIR", ROOT / "build"))
    return build / "src" / "cli" / "kvstack"


def run_kvstack(binary: Path, model: Path, sc: Scenario, threads: int, seed: int) -> float:
    """Tokens/s of one kvstack measurement (one process, one repetition)."""
    cmd = [
        str(binary), "bench", "--json", "-m", str(model), "--threads", str(threads),
        "--kv-dtype", "f16", "--prefill-chunk", "512", "--reps", "1", "--seed", str(seed),
        "--ctx-fill", str(sc.ctx_fill), "--prompt-tokens", str(sc.prompt),
        # kvstack's decode rate counts gen - 1 steps (the first token comes
        # from the prefill), so ask for one more.
        "--gen", str(sc.gen + 1 if sc.kind == "decode" else 1),
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    rec = json.loads(out.strip().splitlines()[-1])
    return float(rec["decode_tok_s" if sc.kind == "decode" else "prefill_tok_s"])


class LlamaRunner:
    """llama.cpp through llama-cpp-python, model loaded once."""

    def __init__(self, model: Path, threads: int, n_ctx: int, flash_attn: bool):
        import llama_cpp  # noqa: PLC0415 (optional dependency, imported on use)
        import numpy as np  # noqa: PLC0415

        self._lc = llama_cpp
        self._np = np
        self.llm = llama_cpp.Llama(
            model_path=str(model), n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads,
            n_threads_batch=threads, type_k=llama_cpp.GGML_TYPE_F16,
            type_v=llama_cpp.GGML_TYPE_F16, flash_attn=flash_attn, logits_all=False,
            verbose=False)
        self.n_vocab = self.llm.n_vocab()

    def _tokens(self, n: int, rng) -> list[int]:
        return [int(t) for t in rng.integers(0, self.n_vocab, size=n)]

    def _argmax_last(self) -> int:
        ptr = self._lc.llama_get_logits_ith(self.llm.ctx, -1)
        return int(self._np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).argmax())

    def measure(self, sc: Scenario, seed: int) -> float:
        rng = self._np.random.default_rng(seed)
        fill = self._tokens(sc.ctx_fill, rng)
        prompt = self._tokens(sc.prompt, rng)
        self.llm.reset()
        self.llm._ctx.kv_cache_clear()  # noqa: SLF001 (no public equivalent)
        if fill:
            self.llm.eval(fill)
        if sc.kind == "prefill":
            t0 = time.perf_counter()
            self.llm.eval(prompt)
            return sc.prompt / (time.perf_counter() - t0)
        self.llm.eval(prompt)
        nxt = self._argmax_last()
        t0 = time.perf_counter()
        for _ in range(sc.gen):
            self.llm.eval([nxt])
            nxt = self._argmax_last()
        return sc.gen / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(
        description="Compare kvstack and llama.cpp decode/prefill speed on the same GGUF "
        "(medians over alternating repetitions).")
    ap.add_argument("--model", default=os.environ.get("KVSTACK_MODEL", str(DEFAULT_MODEL)),
                    help="GGUF model (default: $KVSTACK_MODEL or the SmolLM2-135M Q4_1 model)")
    ap.add_argument("--kvstack", default=None,
                    help="kvstack executable (default: $KVSTACK_BIN, else "
                    "$KVSTACK_BUILD_DIR/src/cli/kvstack, else build/src/cli/kvstack)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="threads for both engines (default: all cores)")
    ap.add_argument("--reps", type=int, default=5, help="repetitions per scenario (default 5)")
    ap.add_argument("--gen", type=int, default=64, help="decode steps timed (default 64)")
    ap.add_argument("--seed", type=int, default=1, help="seed of the random tokens (default 1)")
    ap.add_argument("--only", default=None,
                    help="comma-separated scenario names to run (default: all four)")
    ap.add_argument("--llama-flash-attn", action="store_true",
                    help="enable llama.cpp's flash attention (default off, its default)")
    ap.add_argument("--json", action="store_true",
                    help="print one JSON object (per-scenario samples, medians, ratio)")
    args = ap.parse_args()
    if args.threads < 1 or args.reps < 1 or args.gen < 1:
        ap.error("--threads, --reps and --gen must be positive")

    binary = find_kvstack(args.kvstack)
    if not binary.is_file():
        ap.error(f"kvstack executable not found at {binary} (use --kvstack or KVSTACK_BIN)")
    model = Path(args.model)
    if not model.is_file():
        ap.error(f"model not found: {model}")
    todo = scenarios(args.gen)
    if args.only:
        names = set(args.only.split(","))
        unknown = names - {s.name for s in todo}
        if unknown:
            ap.error(f"unknown scenario(s) {sorted(unknown)}; have {[s.name for s in todo]}")
        todo = [s for s in todo if s.name in names]

    n_ctx = max(s.ctx_fill + s.prompt + s.gen for s in todo) + 16
    llama = LlamaRunner(model, args.threads, n_ctx, args.llama_flash_attn)

    samples = {s.name: {"kvstack": [], "llama.cpp": []} for s in todo}
    for rep in range(args.reps):
        for i, sc in enumerate(todo):
            order = ["kvstack", "llama.cpp"] if (rep + i) % 2 == 0 else ["llama.cpp", "kvstack"]
            for engine in order:
                seed = args.seed + rep
                if engine == "kvstack":
                    v = run_kvstack(binary, model, sc, args.threads, seed)
                else:
                    v = llama.measure(sc, seed)
                samples[sc.name][engine].append(v)
            if not args.json:
                print(f"rep {rep + 1}/{args.reps} {sc.name:14s} kvstack "
                      f"{samples[sc.name]['kvstack'][-1]:8.1f}  llama.cpp "
                      f"{samples[sc.name]['llama.cpp'][-1]:8.1f} tok/s", file=sys.stderr)

    result = {"model": str(model), "threads": args.threads, "reps": args.reps,
              "kv_dtype": "f16", "n_batch": 512, "llama_flash_attn": args.llama_flash_attn,
              "scenarios": {}}
    for sc in todo:
        k = statistics.median(samples[sc.name]["kvstack"])
        l = statistics.median(samples[sc.name]["llama.cpp"])
        # Per-repetition ratios pair the two engines' runs of one phase of
        # the machine; their median is robust to the machine drifting
        # between repetitions, which the ratio of medians is not.
        paired = statistics.median(a / b for a, b in zip(samples[sc.name]["kvstack"],
                                                         samples[sc.name]["llama.cpp"]))
        result["scenarios"][sc.name] = {
            "kvstack_tok_s": round(k, 2), "llamacpp_tok_s": round(l, 2),
            "ratio": round(k / l, 3), "paired_ratio": round(paired, 3), "kvstack_samples": [round(x, 2) for x in
                                                          samples[sc.name]["kvstack"]],
            "llamacpp_samples": [round(x, 2) for x in samples[sc.name]["llama.cpp"]]}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"model {model.name}, {args.threads} threads, f16 KV, n_batch 512, "
          f"medians of {args.reps} alternating reps")
    print(f"{'scenario':15s} {'kvstack tok/s':>14s} {'llama.cpp tok/s':>16s} {'ratio':>7s} "
          f"{'paired':>7s}")
    for name, r in result["scenarios"].items():
        print(f"{name:15s} {r['kvstack_tok_s']:14.1f} {r['llamacpp_tok_s']:16.1f} "
              f"{r['ratio']:7.2f} {r['paired_ratio']:7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
