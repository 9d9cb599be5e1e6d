#!/usr/bin/env python3
"""Loopback load generator for OpenAI-compatible servers: kvstack serve and
llama.cpp's llama-server side by side.

For each concurrency level, N streaming clients each send `--requests`
completions (fixed prompt mix with shared prefixes, ignore_eos so every
request generates exactly --max-tokens tokens) and the script reports
aggregate output tokens/s, TTFT and inter-token latency percentiles.

  bench/serve_load.py --kvstack-bin build/src/cli/kvstack \
      [--llama-server-bin /path/to/llama-server] [--concurrency 1,4,16]

A server is started on 127.0.0.1 and a free port, with the same model,
thread count and context, and stopped at the end. --url benchmarks an
already running server instead (repeatable: --url NAME=http://host:port).
"""
import argparse
import concurrent.futures as cf
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time

import requests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = "You are a helpful assistant. Answer briefly and precisely. " * 4


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(base, proc, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if requests.get(base + "/health", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise RuntimeError("server did not become ready")


def start(cmd, port):
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    wait_ready(base, proc)
    return proc, base


def stop(proc):
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def one_request(base, i, max_tokens):
    prompt = (SHARED if i % 2 == 0 else "") + f"Request {i}: describe item number {i} " * (1 + i % 5)
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    t0 = time.perf_counter()
    stamps = []
    with requests.post(base + "/v1/completions", json=body, stream=True, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if any(c.get("text") for c in obj.get("choices", [])):
                stamps.append(time.perf_counter())
    if not stamps:
        return None
    itl = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"ttft": stamps[0] - t0, "itl": itl, "e2e": stamps[-1] - t0, "n_chunks": len(stamps)}


def pct(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def bench(name, base, levels, n_requests, max_tokens):
    rows = []
    for c in levels:
        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(c) as ex:
            res = [r for r in ex.map(lambda i: one_request(base, i, max_tokens),
                                     range(c * n_requests)) if r]
        wall = time.perf_counter() - t0
        toks = len(res) * max_tokens
        itl = [x for r in res for x in r["itl"]]
        row = {"server": name, "concurrency": c, "requests": len(res),
               "output_tok_s": toks / wall,
               "ttft_p50_ms": 1e3 * pct([r["ttft"] for r in res], 0.5),
               "ttft_p99_ms": 1e3 * pct([r["ttft"] for r in res], 0.99),
               "itl_p50_ms": 1e3 * pct(itl, 0.5), "itl_p99_ms": 1e3 * pct(itl, 0.99),
               "e2e_mean_s": statistics.mean(r["e2e"] for r in res) if res else float("nan")}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=os.path.join(ROOT, "models",
                                                    "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--kvstack-bin", default=os.path.join(ROOT, "build", "src", "cli", "kvstack"))
    ap.add_argument("--llama-server-bin", default="", help="native llama-server executable")
    ap.add_argument("--url", action="append", default=[], help="NAME=URL of a running server")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--ctx", type=int, default=8192, help="KV tokens (both servers)")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--requests", type=int, default=2, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=64)
    a = ap.parse_args()
    levels = [int(x) for x in a.concurrency.split(",")]
    max_c = max(levels)
    targets = [tuple(u.split("=", 1)) for u in a.url]
    procs = []
    try:
        if not a.url and os.path.exists(a.kvstack_bin):
            port = free_port()
            procs.append(start([a.kvstack_bin, "serve", "-m", a.model, "--port", str(port),
                                "--threads", str(a.threads), "--kv-cache-tokens", str(a.ctx),
                                "--max-seqs", str(max_c)], port))
            targets.append(("kvstack", procs[-1][1]))
        if not a.url and a.llama_server_bin:
            port = free_port()
            procs.append(start([a.llama_server_bin, "-m", a.model, "--host", "127.0.0.1",
                                "--port", str(port), "-t", str(a.threads), "-c", str(a.ctx),
                                "-np", str(max_c), "-cb"], port))
            targets.append(("llama-server", procs[-1][1]))
        if not targets:
            sys.exit("nothing to benchmark: build kvstack or pass --url / --llama-server-bin")
        for name, base in targets:
            bench(name, base, levels, a.requests, a.max_tokens)
    finally:
        for p, _ in procs:
            stop(p)


if __name__ == "__main__":
    main()
