#!/usr/bin/env python3
"""Perplexity cost of llama.cpp's own quantized KV caches, as a yardstick.

`kvstack kv-eval` measures what each kvstack KV format costs against an f32
cache. This script measures the same thing for llama.cpp (llama-cpp-python,
the version pinned in requirements.txt) on the same GGUF and text: perplexity
over non-overlapping windows of --ctx tokens with K and V stored as f32
(the baseline), f16, q8_0 and q4_0 (flash attention on, which llama.cpp
needs for a quantized V), and prints the relative change of each against the
f32 cache. Scoring is the same as `kvstack perplexity`: every window is
evaluated from an empty cache and every position after the first is scored.

This is a benchmark program, not a test: it asserts nothing.

  .venv/bin/python bench/llamacpp_kv_quality.py --ctx 512 --ctx 2048
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
# GGML type ids (ggml.h): the cache formats llama.cpp offers for K and V.
GGML_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 8}


def perplexity(llama, ids: list[int], ctx: int) -> tuple[float, int]:
    nll, count = 0.0, 0
    windows = range(0, len(ids) - ctx + 1, ctx)
    for i, start in enumerate(windows):
        window = ids[start:start + ctx]
        llama.reset()
        llama.eval(window)
        logits = np.array(llama.scores[:ctx], dtype=np.float64)
        mx = logits.max(axis=1, keepdims=True)
        logz = np.log(np.exp(logits - mx).sum(axis=1)) + mx[:, 0]
        nll -= (logits[np.arange(ctx - 1), window[1:]] - logz[:-1]).sum()
        count += ctx - 1
        print(f"\r  window {i + 1}/{len(windows)}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return float(np.exp(nll / count)), count


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("-f", "--file", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--ctx", type=int, action="append", help="window tokens (repeatable; default 512)")
    ap.add_argument("--formats", default="f32,f16,q8_0,q4_0",
                    help="K=V cache formats, or K/V pairs like q4_0/q8_0 (first is the baseline)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    a = ap.parse_args()
    ctxs = a.ctx or [512]
    formats = [f.strip() for f in a.formats.split(",") if f.strip()]
    for f in formats:
        for part in f.split("/"):
            if part not in GGML_TYPES:
                ap.error(f"unknown cache format '{part}' (choose from {', '.join(GGML_TYPES)})")
    if not Path(a.model).is_file():
        ap.error(f"model not found: {a.model}")
    if not Path(a.file).is_file():
        ap.error(f"text file not found: {a.file}")
    if any(c < 2 for c in ctxs):
        ap.error("--ctx must be at least 2")

    import llama_cpp

    text = Path(a.file).read_text(encoding="utf-8")
    results = []
    for ctx in ctxs:
        base = None
        for fmt in formats:
            k, v = (fmt.split("/") + [fmt])[:2]
            llama = llama_cpp.Llama(model_path=a.model, n_ctx=ctx, n_batch=min(ctx, 512),
                                    logits_all=True, n_threads=a.threads,
                                    n_threads_batch=a.threads, verbose=False, flash_attn=True,
                                    type_k=GGML_TYPES[k], type_v=GGML_TYPES[v])
            ids = llama.tokenize(text.encode(), add_bos=False, special=False)
            if len(ids) < ctx:
                sys.exit(f"llamacpp_kv_quality: {a.file} has {len(ids)} tokens, fewer than --ctx {ctx}")
            print(f"ctx {ctx}, K {k} V {v}:", file=sys.stderr)
            t0 = time.monotonic()
            ppl, n = perplexity(llama, ids, ctx)
            del llama
            base = ppl if base is None else base
            results.append({"ctx": ctx, "k": k, "v": v, "perplexity": ppl, "n_scored": n,
                            "rel_change": ppl / base - 1.0, "seconds": time.monotonic() - t0})
    if a.json:
        print(json.dumps({"model": a.model, "file": a.file, "baseline": formats[0],
                          "results": results}))
        return 0
    print(f"{'ctx':>5} {'K':>5} {'V':>5} {'perplexity':>11} {'vs ' + formats[0]:>9}")
    for r in results:
        print(f"{r['ctx']:>5} {r['k']:>5} {r['v']:>5} {r['perplexity']:>11.4f} "
              f"{100 * r['rel_change']:>+8.2f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
