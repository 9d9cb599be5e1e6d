#!/usr/bin/env python3
"""Redis KV tier fetch against redis-benchmark on the same server.

Starts a private redis-server (no persistence) on a free loopback port,
then alternates, --rounds times:
  kvstack kv-tiers-bench --redis URL --redis-only   (promotion of a chain of
      --blocks blocks from Redis: pipelined EXISTS + GET stream + checks +
      copy into the pool; best of --repeat)
  redis-benchmark -t set,get -d VALUE -n 512 -c 1   (one client, the same
      value size: a kvstack block record), and the same with -P 16
and prints the best of each, in GB/s (1e9 bytes/s), the ratio, and the
median of the per-round ratios (robust to a busy machine). The
server is stopped at the end (also on failure).

Usage: bench/redis_tier_bench.py [--kvstack build/src/cli/kvstack] [--blocks 256]
                                 [--repeat 3] [--rounds 3]
"""
import argparse
import re
import shutil
import socket
import subprocess
import sys
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(port, timeout=5.0):
    end = time.time() + timeout
    while time.time() < end:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return True
        except OSError:
            time.sleep(0.02)
    return False


def kvstack_fetch(exe, url, blocks, repeat):
    out = subprocess.run([exe, "kv-tiers-bench", "--blocks", str(blocks), "--repeat", str(repeat),
                          "--redis", url, "--redis-only"], capture_output=True, text=True,
                         check=True).stdout
    fetch = float(re.search(r"redis fetch\s+([\d.]+) GB/s", out).group(1))
    value = int(re.search(r"redis value\s+(\d+) bytes", out).group(1))
    return fetch, value


def benchmark_get(port, value, pipeline):
    cmd = ["redis-benchmark", "-p", str(port), "-t", "set,get", "-d", str(value), "-n", "512",
           "-c", "1", "-q"]
    if pipeline > 1:
        cmd += ["-P", str(pipeline)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    rps = float(re.findall(r"GET: ([\d.]+) requests per second", out.replace("\r", "\n"))[-1])
    return rps * value / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvstack", default="build/src/cli/kvstack")
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    for exe in ("redis-server", "redis-benchmark"):
        if shutil.which(exe) is None:
            sys.exit(f"{exe} not installed (Debian redis-server / redis-tools)")
    port = free_port()
    server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                               "--save", "", "--appendonly", "no"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        if not wait_up(port):
            sys.exit("redis-server did not start")
        url = f"redis://127.0.0.1:{port}"
        ours, single, piped = [], [], []
        value = 0
        for r in range(a.rounds):
            f, value = kvstack_fetch(a.kvstack, url, a.blocks, a.repeat)
            ours.append(f)
            single.append(benchmark_get(port, value, 1))
            piped.append(benchmark_get(port, value, 16))
            subprocess.run(["redis-cli", "-p", str(port), "FLUSHALL"], capture_output=True)
            print(f"round {r + 1}: kvstack fetch {f:.2f} GB/s, redis-benchmark GET "
                  f"{single[-1]:.2f} GB/s (-P 16: {piped[-1]:.2f})", flush=True)
        best, b1, b16 = max(ours), max(single), max(piped)
        ratios = sorted(o / b for o, b in zip(ours, single))
        median_ratio = ratios[len(ratios) // 2]
        print(f"\nvalue {value} bytes, {a.blocks} blocks, best of {a.rounds} rounds\n")
        print("| path | GB/s | kvstack / this |")
        print("|---|---|---|")
        print(f"| kvstack fetch (pipelined EXISTS + GET stream + checks + copy) | {best:.2f} | |")
        print(f"| redis-benchmark GET, 1 client | {b1:.2f} | {best / b1:.0%} |")
        print(f"| redis-benchmark GET, 1 client, -P 16 | {b16:.2f} | {best / b16:.0%} |")
        print(f"\nmedian over rounds of kvstack / redis-benchmark (1 client) in the same round: "
              f"{median_ratio:.0%} (range {ratios[0]:.0%}-{ratios[-1]:.0%})")
    finally:
        server.terminate()
        server.wait(timeout=10)


if __name__ == "__main__":
    main()
