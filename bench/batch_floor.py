#!/usr/bin/env python3
"""Issue 23's 16-sequence target against this machine's floor, side by side.

The target: a decode step of 16 sequences at context 512 takes at most 2x the
single-sequence step. Each round runs, one after another on the same cores:

  1. `kvstack bench --batch 16` (default model, int8 KV): the single and the
     16-sequence step as measured;
  2. `ops_bench` BM_BlockUpdate, BM_AmxTileBlock and BM_Avx512IssueRate: per
     16-row x 16-column x 32-element block, the float update alone (Q4_1,
     Q8_0), AMX tile products with and without it, and the vpdpbusd rate;
  3. `attention_bench` BM_CacheRead: the read rate of the 16 sequences' KV
     (97 MiB of int8 at context ~520) left in the caches; `ops_bench`
     BM_MemoryReadBandwidth: the DRAM read rate (both on --threads threads).

The floor of the 16-sequence step counts only what no kernel with the
formats' arithmetic can skip, each part at its best case and perfectly
split over the threads, nothing else (norms, RoPE, quantization, sampling,
thread hand-offs) counted:

  weights:   blocks x min(AMX tile product + update, 128 vpdpbusd + update)
             / threads (the VNNI sum is additive: both use the same two ports)
  attention: 97 MiB at the cached read rate

Both parts are lower bounds whatever the data's source. When the single step
itself runs no faster than its bytes (weights, one sequence's KV) read from
DRAM, its data comes from DRAM, and so does the 16-sequence step's: then the
weights and all 16 sequences' KV read at the DRAM rate bound it as well
(compute overlapped perfectly), and the floor is the larger of the two.

The round's verdict compares the floor with 2x the single step measured in
the same round. Prints a table per round and the medians; --json for one
object.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

# SmolLM2-135M (the default model): 30 layers of q 576x576, k and v 576x192,
# o 576x576, gate and up 576x1536, down 1536x576 (Q4_1), and the tied output
# 576x49152 (Q8_0). Blocks of 16 rows x 16 columns x 32 elements, 16 rows.
LAYER_MACS = 576 * 576 * 2 + 576 * 192 * 2 + 576 * 1536 * 3
Q41_BLOCKS = 30 * LAYER_MACS * 16 // 8192
Q80_BLOCKS = 576 * 49152 * 16 // 8192
VPDPBUSD_PER_BLOCK = 16 * 16 * 32 // 64  # 64 multiply-adds each
# Bytes each step reads: the weights (Q4_1: 20 bytes per 32, Q8_0: 34) and
# the KV of BM_CacheRead (97 MiB for 16 sequences).
WEIGHT_BYTES = 30 * LAYER_MACS // 32 * 20 + 576 * 49152 // 32 * 34
KV_BYTES_16 = 97 * 2**20


def run_json(cmd):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def gbench(binary, pattern):
    data = run_json([binary, f"--benchmark_filter={pattern}", "--benchmark_format=json"])
    return {b["name"]: b for b in data["benchmarks"] if "error_occurred" not in b}


def one_round(args):
    step = run_json([
        args.kvstack_bin, "bench", "-m", args.model, "--batch", "16", "--prompt-tokens", "512",
        "--gen", "16", "--reps", "4", "--threads", str(args.threads), "--kv-dtype", "int8", "--json"
    ])
    ops = gbench(args.ops_bench, "BM_BlockUpdate|BM_AmxTileBlock|BM_Avx512IssueRate/op:0|"
                 f"BM_MemoryReadBandwidth/{args.threads}/")
    attn = gbench(args.attention_bench, f"BM_CacheRead/mib:97/threads:{args.threads}/")
    if "BM_BlockUpdate/fmt:0" not in ops:
        sys.exit("batch_floor: BM_BlockUpdate did not run (the floor probes need AVX-512)")
    upd41 = ops["BM_BlockUpdate/fmt:0"]["block_ns"]
    upd80 = ops["BM_BlockUpdate/fmt:1"]["block_ns"]
    vnni_ns = VPDPBUSD_PER_BLOCK / ops["BM_Avx512IssueRate/op:0"]["instr/ns"]
    amx = ops.get("BM_AmxTileBlock/update:1")
    # The AMX probe runs the Q4_1 update; Q8_0's differs by upd80 - upd41.
    amx41 = amx["block_ns"] if amx else float("inf")
    amx80 = amx41 - upd41 + upd80
    per41 = min(amx41, vnni_ns + upd41)
    per80 = min(amx80, vnni_ns + upd80)
    weights_ms = (Q41_BLOCKS * per41 + Q80_BLOCKS * per80) / args.threads * 1e-6
    read = attn[f"BM_CacheRead/mib:97/threads:{args.threads}/manual_time"]
    attn_ms = read["pass_ms"]
    dram = ops[f"BM_MemoryReadBandwidth/{args.threads}/real_time"]["read_B/s"]
    dram_1_ms = (WEIGHT_BYTES + KV_BYTES_16 / 16) / dram * 1e3
    dram_16_ms = (WEIGHT_BYTES + KV_BYTES_16) / dram * 1e3
    from_dram = step["step_ms_1"] >= dram_1_ms
    floor = weights_ms + attn_ms
    if from_dram:
        floor = max(floor, dram_16_ms)
    return {
        "step_ms_1": step["step_ms_1"],
        "step_ms_16": step["step_ms_batch"],
        "ratio": step["step_ratio"],
        "allowed_ms": 2 * step["step_ms_1"],
        "update_ns_q4_1": upd41,
        "update_ns_q8_0": upd80,
        "vnni_ns": vnni_ns,
        "amx_ns": amx41 if amx else None,
        "weights_floor_ms": weights_ms,
        "attention_floor_ms": attn_ms,
        "dram_GB_s": dram * 1e-9,
        "dram_floor_ms_1": dram_1_ms,
        "dram_floor_ms_16": dram_16_ms,
        "from_dram": 1 if from_dram else 0,
        "floor_ms": floor,
        "floor_ratio": floor / step["step_ms_1"],
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kvstack-bin", default="build/src/cli/kvstack", help="the kvstack binary")
    p.add_argument("--ops-bench", default="build/src/ops/ops_bench",
                   help="the ops_bench binary (Google Benchmark; built by make build)")
    p.add_argument("--attention-bench", default="build/src/attention/attention_bench",
                   help="the attention_bench binary")
    p.add_argument("--model", default=os.environ.get(
        "KVSTACK_MODEL", "models/SmolLM2-135M-Instruct.Q4_1.gguf"),
                   help="the GGUF to bench (SmolLM2-135M Q4_1: the block counts are its shapes)")
    p.add_argument("--threads", type=int, default=2,
                   help="worker threads of the step and the read benches: 1 or 2 (default 2)")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds, each about 20 s; medians are reported (default 3)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args()
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.threads not in (1, 2):
        p.error("--threads must be 1 or 2 (the read benches' thread counts)")
    if "smollm2-135m" not in os.path.basename(args.model).lower() or "q4_1" not in args.model.lower():
        p.error(f"--model {args.model}: the floor's block counts are SmolLM2-135M Q4_1's shapes")
    for path in (args.kvstack_bin, args.ops_bench, args.attention_bench, args.model):
        if not os.path.exists(path):
            p.error(f"{path}: not found (make build builds the benches)")
    rounds = []
    for i in range(args.rounds):
        print(f"batch_floor: round {i + 1}/{args.rounds}...", file=sys.stderr, flush=True)
        rounds.append(one_round(args))
    med = {k: statistics.median(r[k] for r in rounds)
           for k in rounds[0] if rounds[0][k] is not None}
    if args.json:
        print(json.dumps({"rounds": rounds, "median": med}))
        return
    cols = [("step_ms_1", "1-seq step ms"), ("step_ms_16", "16-seq step ms"),
            ("allowed_ms", "2x 1-seq ms"), ("weights_floor_ms", "weights floor ms"),
            ("attention_floor_ms", "attention floor ms"), ("dram_floor_ms_1", "1-seq DRAM ms"),
            ("dram_floor_ms_16", "16-seq DRAM ms"), ("from_dram", "from DRAM"),
            ("floor_ms", "16-seq floor ms"), ("floor_ratio", "floor / 1-seq")]
    print("| round | " + " | ".join(c[1] for c in cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for i, r in enumerate(rounds + [med]):
        name = "median" if i == len(rounds) else str(i + 1)
        print(f"| {name} | " + " | ".join(f"{r[c[0]]:.2f}" for c in cols) + " |")
    amx = f"{med['amx_ns']:.1f}" if "amx_ns" in med else "n/a (no AMX-INT8)"
    print(f"per block (ns, one core): update Q4_1 {med['update_ns_q4_1']:.1f}, "
          f"Q8_0 {med['update_ns_q8_0']:.1f}; 128 vpdpbusd {med['vnni_ns']:.1f}; "
          f"AMX tile product + Q4_1 update {amx}")
    verdict = "beyond this machine" if med["floor_ms"] > med["allowed_ms"] else "not excluded"
    print(f"target (16-seq step <= 2x 1-seq): floor {med['floor_ms']:.2f} ms against "
          f"{med['allowed_ms']:.2f} ms allowed: {verdict}")


if __name__ == "__main__":
    main()
