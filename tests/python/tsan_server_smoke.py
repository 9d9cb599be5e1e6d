"""A short concurrent run of `kvstack serve` for the ThreadSanitizer build.

Run by scripts/test_tsan.sh (not collected by CTest's pytest runs: the name
has no test_ prefix): it drives every thread of the server at once -- HTTP
workers, the engine thread, the signal thread -- with a few concurrent
streaming and non-streaming requests, parallel sampling, a client that drops
mid-stream, malformed requests, a full queue (429), /metrics and /v1/kv/stats
polled while requests run, then SIGTERM. It fails when a request does not
end as expected, when blocks stay referenced, when the server does not exit
0, or when ThreadSanitizer printed a report (TSAN_OPTIONS=halt_on_error=1
also makes a race fatal).

Usage: tsan_server_smoke.py KVSTACK_BIN [MODEL]
"""
import concurrent.futures as cf
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import requests

MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1"


def start(binary, model, *extra):
    cmd = [binary, "serve", "-m", model, "--port", "0", "--threads", "2", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines, port = [], []
    ready = threading.Event()

    def pump():
        for line in proc.stderr:
            lines.append(line)
            m = re.search(r"ready on http://[\d.]+:(\d+)", line)
            if m:
                port.append(int(m.group(1)))
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    if not ready.wait(600) or not port:
        proc.kill()
        sys.exit("server did not start:\n" + "".join(lines[-40:]))
    return proc, f"http://127.0.0.1:{port[0]}", lines


def stream(base, body, drop_after=None):
    """Streams a completion; returns (n_data_events, finish_reason, text)."""
    body = dict(body, stream=True)
    n, finish, text = 0, None, ""
    with requests.post(base + "/v1/completions", json=body, stream=True, timeout=600) as r:
        if r.status_code != 200:
            return r.status_code, r.json()["error"]["type"], ""
        for line in r.iter_lines():
            if not line.startswith(b"data: "):
                continue
            n += 1
            if drop_after is not None and n >= drop_after:
                return n, "dropped", text  # closing the response drops the connection
            if line[6:] == b"[DONE]":
                break
            obj = json.loads(line[6:])
            if "error" in obj:
                return n, "error:" + obj["error"]["type"], text
            for ch in obj["choices"]:
                text += ch["text"]
                finish = ch["finish_reason"] or finish
    return n, finish, text


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def main():
    binary = sys.argv[1]
    model = sys.argv[2] if len(sys.argv) > 2 else os.environ.get(
        "KVSTACK_MODEL", "models/SmolLM2-135M-Instruct.Q4_1.gguf")
    proc, base, lines = start(binary, model, "--kv-cache-tokens", "1024", "--max-seqs", "4",
                              "--max-batch-tokens", "32", "--max-queue", "5")
    ok = False
    try:
        stop_polling = threading.Event()

        def poll():  # /metrics and /v1/kv/stats race the engine thread
            while not stop_polling.is_set():
                requests.get(base + "/metrics", timeout=120)
                requests.get(base + "/v1/kv/stats", timeout=120)
                time.sleep(0.05)

        poller = threading.Thread(target=poll)
        poller.start()
        bodies = [{"prompt": f"Story {i}: once upon a time", "max_tokens": 6, "seed": i,
                   "temperature": 0.8, "ignore_eos": True} for i in range(3)]
        with cf.ThreadPoolExecutor(8) as ex:
            streams = [ex.submit(stream, base, b) for b in bodies]
            drop = ex.submit(stream, base, {"prompt": "Count slowly:", "max_tokens": 300,
                                            "ignore_eos": True}, drop_after=2)
            plain = ex.submit(requests.post, base + "/v1/completions", timeout=600,
                              json={"prompt": "Hello", "max_tokens": 4, "n": 2, "seed": 1,
                                    "temperature": 1.0})
            bad = [ex.submit(requests.post, base + "/v1/completions", data=b, timeout=600,
                             headers={"Content-Type": "application/json"})
                   for b in (b"{not json", b'{"prompt": "x", "max_tokens": 0}',
                             b'{"prompt": [1, -3]}')]
            for f in streams:
                n, finish, _ = f.result()
                check(finish == "length", f"stream ended with {finish!r}")
            check(drop.result()[1] == "dropped", f"drop: {drop.result()}")
            r = plain.result()
            check(r.status_code == 200 and len(r.json()["choices"]) == 2, r.text[:300])
            for f in bad:
                r = f.result()
                check(r.status_code == 400, r.text[:300])
                check(r.json()["error"]["type"] == "invalid_request_error", r.text[:300])
        # Overload: more concurrent requests than running + queued slots.
        with cf.ThreadPoolExecutor(12) as ex:
            futs = [ex.submit(requests.post, base + "/v1/completions", timeout=600,
                              json={"prompt": f"Burst {i}", "max_tokens": 4, "ignore_eos": True})
                    for i in range(12)]
            codes = [f.result().status_code for f in futs]
        check(set(codes) <= {200, 429} and 429 in codes and 200 in codes, f"burst: {codes}")
        for f in futs:
            r = f.result()
            if r.status_code == 429:
                check(r.json()["error"]["type"] == "rate_limit_error", r.text[:300])
                check(r.headers.get("Retry-After") == "1", str(r.headers))
        stop_polling.set()
        poller.join()
        deadline = time.time() + 120
        while True:
            st = requests.get(base + "/v1/kv/stats", timeout=120).json()
            if st["pool"]["blocks_used"] == 0 and st["scheduler"]["running"] == 0:
                break
            check(time.time() < deadline, f"blocks still used: {st}")
            time.sleep(0.2)
        check(st["pool"]["references"] == 0, st)
        check(st["scheduler"]["requests_failed"] >= 1, st)  # the dropped client was cancelled
        ok = True
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(300)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        log = "".join(lines)
        if "ThreadSanitizer" in log or rc != 0:
            sys.stderr.write(log[-20000:])
            sys.exit(f"FAIL: server exit code {rc}, TSan report: {'ThreadSanitizer' in log}")
    if ok:
        print("tsan server smoke: OK")


if __name__ == "__main__":
    main()
