#!/usr/bin/env python3
"""Prefill/decode disaggregation against colocated serving, same cores (issue 21 item 5).

PD: N `kvstack serve --role prefill` and M `--role decode` workers, each on its
own network-namespace host (bench/netns.py) and pinned to its own cores with
taskset, behind `vllm-router --vllm-pd-disaggregation`. Colocated: one
`--role both` server on all of those cores (threads = cores). Both get the
same seeded workload from --concurrency streaming clients: a mix of long
prompts with short outputs and short prompts with long outputs. Per request:
TTFT (to the first streamed token, through the router in PD mode), the first
decode gap (first to second token), TPOT ((last - first) / (tokens - 1)) and
the ITL tail; goodput = requests meeting both --slo-ttft and --slo-tpot, per
second of the run. PD mode also reports the decode workers' bytes pulled and
pull time, and the prefill workers' leases.

  .venv/bin/python bench/pd_cluster.py --prefill 1 --decode 1 --cores 0,1 --requests 24
"""
import argparse
import json
import os
import pathlib
import random
import socket
import statistics
import subprocess
import sys
import threading
import time

import requests

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from netns import Hosts  # noqa: E402

ROOT = HERE.parent
VOCAB = ["river", "stone", "cloud", "market", "engine", "garden", "signal", "paper", "window",
         "forest", "copper", "lantern", "harbor", "violet", "summer", "ladder", "orbit"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_health(base, proc, what):
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if requests.get(base + "/health", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    raise SystemExit(f"{what} did not start")


def serve(args, host, role, cores, port=8000, extra=()):
    addr = host.addr if host else "127.0.0.1"
    cmd = ["taskset", "-c", ",".join(map(str, cores)), args.bin, "serve", "-m", args.model,
           "--host", addr, "--port", str(port), "--threads", str(len(cores)),
           "--kv-cache-mem", args.kv_mem, "--role", role, *extra]
    env = dict(os.environ, UCX_TLS=args.tls)
    p = (host.popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) if host
         else subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    base = f"http://{addr}:{port}"
    wait_health(base, p, f"{role} worker")
    return p, base


def workload(args):
    rng = random.Random(args.seed)
    reqs = []
    for i in range(args.requests):
        if i % 2 == 0:  # long prompt, short output
            n_words, out = args.long_prompt, args.short_output
        else:  # short prompt, long output
            n_words, out = args.short_prompt, args.long_output
        prompt = f"Request {i}: " + " ".join(rng.choice(VOCAB) for _ in range(n_words))
        reqs.append({"model": "kvstack", "prompt": prompt, "max_tokens": out, "temperature": 0,
                     "ignore_eos": True, "stream": True})
    return reqs


def drive(base, reqs, concurrency):
    results = [None] * len(reqs)
    nxt = [0]
    lock = threading.Lock()

    def client():
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= len(reqs):
                return
            t0 = time.time()
            stamps = []
            ok = True
            try:
                with requests.post(base + "/v1/completions", json=reqs[i], stream=True,
                                   timeout=600) as r:
                    ok = r.status_code == 200
                    for line in r.iter_lines():
                        if line.startswith(b"data: {"):
                            ev = json.loads(line[6:])
                            if "error" in ev:
                                ok = False
                            elif ev.get("choices") and ev["choices"][0].get("text"):
                                stamps.append(time.time())
            except requests.RequestException:
                ok = False
            results[i] = dict(ok=ok and len(stamps) > 0, t0=t0, stamps=stamps)

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    t_start = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.time() - t_start


def pct(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summarize(name, results, wall, args):
    ttft, gap, tpot, itl = [], [], [], []
    good = 0
    for r in results:
        if not r["ok"]:
            continue
        s = r["stamps"]
        t_first = s[0] - r["t0"]
        ttft.append(t_first)
        if len(s) > 1:
            gap.append(s[1] - s[0])
            tp = (s[-1] - s[0]) / (len(s) - 1)
            tpot.append(tp)
            itl += [b - a for a, b in zip(s, s[1:])]
        else:
            tp = 0.0
        if t_first <= args.slo_ttft and tp <= args.slo_tpot:
            good += 1
    n_ok = sum(1 for r in results if r["ok"])
    print(f"{name}: {n_ok}/{len(results)} ok in {wall:.1f} s; goodput {good} requests "
          f"({good / wall:.3f}/s) under TTFT <= {args.slo_ttft} s and TPOT <= {args.slo_tpot} s")
    print(f"  TTFT p50 {pct(ttft, .5) * 1e3:.0f} p90 {pct(ttft, .9) * 1e3:.0f} ms; first decode "
          f"gap p50 {pct(gap, .5) * 1e3:.0f} ms; TPOT p50 {pct(tpot, .5) * 1e3:.0f} p90 "
          f"{pct(tpot, .9) * 1e3:.0f} ms; ITL p99 {pct(itl, .99) * 1e3:.0f} ms", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=str(ROOT / "build" / "src" / "cli" / "kvstack"))
    ap.add_argument("--model", default=str(ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--router", default=str(ROOT / ".venv" / "bin" / "vllm-router"))
    ap.add_argument("--prefill", type=int, default=1)
    ap.add_argument("--decode", type=int, default=1)
    ap.add_argument("--cores", default="0,1", help="cores, one per worker in PD order (prefill first); all for colocated")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--long-prompt", type=int, default=600)
    ap.add_argument("--short-prompt", type=int, default=40)
    ap.add_argument("--long-output", type=int, default=96)
    ap.add_argument("--short-output", type=int, default=8)
    ap.add_argument("--slo-ttft", type=float, default=3.0)
    ap.add_argument("--slo-tpot", type=float, default=0.15)
    ap.add_argument("--kv-mem", default="192M")
    ap.add_argument("--tls", default="tcp")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--mode", choices=["both", "pd", "colo"], default="both")
    args = ap.parse_args()
    cores = [int(c) for c in args.cores.split(",")]
    n_workers = args.prefill + args.decode
    if len(cores) < n_workers:
        raise SystemExit(f"--cores: {n_workers} workers need {n_workers} cores")
    reqs = workload(args)

    if args.mode in ("both", "colo"):
        p, base = serve(args, None, "both", cores[:n_workers], port=free_port())
        try:
            drive(base, reqs[:2], 2)  # warm-up
            res, wall = drive(base, reqs, args.concurrency)
            summarize(f"colocated (1 server, cores {cores[:n_workers]})", res, wall, args)
        finally:
            p.terminate()
            p.wait(30)

    if args.mode in ("both", "pd"):
        with Hosts(n_workers) as hosts:
            procs, pre, dec = [], [], []
            router = None
            try:
                for i in range(args.prefill):
                    p, b = serve(args, hosts[i], "prefill", [cores[i]],
                                 extra=["--kv-transfer-host", hosts[i].addr])
                    procs.append(p)
                    pre.append(b)
                for j in range(args.decode):
                    h = hosts[args.prefill + j]
                    p, b = serve(args, h, "decode", [cores[args.prefill + j]])
                    procs.append(p)
                    dec.append(b)
                port = free_port()
                cmd = [args.router, "--vllm-pd-disaggregation", "--host", "127.0.0.1", "--port",
                       str(port), "--prometheus-port", str(free_port())]
                for b in pre:
                    cmd += ["--prefill", b]
                for b in dec:
                    cmd += ["--decode", b]
                router = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                rbase = f"http://127.0.0.1:{port}"
                wait_health(rbase, router, "vllm-router")
                drive(rbase, reqs[:2], 2)
                res, wall = drive(rbase, reqs, args.concurrency)
                summarize(f"PD ({args.prefill} prefill + {args.decode} decode, one core each)",
                          res, wall, args)
                moved = pulls = 0
                t_pull = 0.0
                for b in dec:
                    tr = requests.get(b + "/v1/kv/stats", timeout=30).json()["transfer"]
                    moved += tr["bytes_pulled"]
                    pulls += tr["pulls_ok"]
                    t_pull += tr["pull_seconds"]
                leases = [requests.get(b + "/v1/kv/stats", timeout=30).json()["transfer"] for b in pre]
                print(f"  bytes moved {moved / 2**20:.1f} MiB in {pulls} pulls, pull time "
                      f"{t_pull * 1e3:.0f} ms total ({t_pull / max(1, pulls) * 1e3:.1f} ms mean); leases "
                      f"completed {sum(l['leases_completed'] for l in leases)}, expired "
                      f"{sum(l['leases_expired'] for l in leases)}, cancelled "
                      f"{sum(l['leases_cancelled'] for l in leases)}")
            finally:
                if router:
                    router.terminate()
                for p in procs:
                    p.terminate()
                for p in procs:
                    try:
                        p.wait(30)
                    except subprocess.TimeoutExpired:
                        p.kill()


if __name__ == "__main__":
    main()
