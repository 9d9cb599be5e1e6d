#!/usr/bin/env python3
"""How many long requests a `kvstack serve` pool runs at once (issue 18).

Starts `kvstack serve` with the given pool and --kv-retention, sends N
concurrent /v1/completions requests of the same prompt file (no prefix
cache, so every request prefills its own copy), samples
kvstack:num_requests_running from /metrics every 0.5 s and prints the most
requests running at once, then stops the server (the requests are cut off:
only admission is measured).

  bench/retention_admission.py --kvstack build/src/cli/kvstack \
      --prompt-file /usr/share/common-licenses/GPL-3 --requests 5 --max-tokens 512 \
      --kv-cache-mem 240MiB --kv-retention h2o:budget=512,window=512 --seconds 240
"""
import argparse
import json
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def running(base):
    # /metrics waits for the engine thread (a 512-token prefill step takes seconds).
    try:
        text = get(base + "/metrics", timeout=120)
    except OSError:
        return -1
    m = re.search(r"^kvstack:num_requests_running(?:\{[^}]*\})? ([0-9.e+]+)$", text, re.M)
    return int(float(m.group(1))) if m else -1


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kvstack", required=True)
    ap.add_argument("--prompt-file", required=True)
    ap.add_argument("--requests", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--kv-cache-mem", default="240MiB")
    ap.add_argument("--kv-retention", default="none")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=240, help="stop sampling after this long")
    a = ap.parse_args()

    text = open(a.prompt_file, encoding="utf-8", errors="replace").read()
    port = free_port()
    cmd = [a.kvstack, "serve", "--port", str(port), "-t", str(a.threads),
           "--kv-cache-mem", a.kv_cache_mem, "--kv-retention", a.kv_retention,
           "--no-prefix-cache", "--reserve-output", "-1", "--max-seqs", "16",
           "--max-batch-tokens", "528"]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                get(base + "/health", timeout=1)
                break
            except OSError:
                if server.poll() is not None:
                    sys.exit("serve exited: " + server.stderr.read())
                time.sleep(0.2)
        body = json.dumps({"prompt": text, "max_tokens": a.max_tokens, "temperature": 0,
                           "ignore_eos": True}).encode()

        def send():
            req = urllib.request.Request(base + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            try:
                urllib.request.urlopen(req, timeout=a.seconds + 60).read()
            except OSError:
                pass  # cut off when the server stops

        for _ in range(a.requests):
            threading.Thread(target=send, daemon=True).start()
        peak, t0, trace = 0, time.time(), []
        while time.time() - t0 < a.seconds:
            n = running(base)
            if n != (trace[-1][1] if trace else None):
                trace.append((round(time.time() - t0, 1), n))
            peak = max(peak, n)
            if peak >= a.requests:
                break
            time.sleep(0.5)
        stats = json.loads(get(base + "/v1/kv/stats", timeout=120))
        print(json.dumps({"kv_retention": a.kv_retention, "kv_cache_mem": a.kv_cache_mem,
                          "requests": a.requests, "max_running": peak,
                          "seconds": round(time.time() - t0, 1),
                          "running_trace": trace,
                          "retention": stats.get("retention")}))
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    main()
