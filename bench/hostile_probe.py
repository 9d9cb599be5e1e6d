"""Hostile-client probe of a `kvstack serve` binary (issue 22's measurements).

  .venv/bin/python bench/hostile_probe.py --bin build/src/cli/kvstack [--json]

Starts the server on the default model (port 0, --kv-cache-tokens 2048), then
one attack at a time, each from 127.0.0.2 while a well-behaved client on
127.0.0.1 probes /health: slowloris (400 connections opened at 100/s, one
header line every 2 s, held 12 s), a 50 MB chunked body, a gzip body of 100 KB inflating to
100 MB, Range: bytes=0-,... on /metrics, Content-Length: -1, and a
non-streaming request whose client leaves after 1 s (blocks still in use 1 s
later); and, as the cost of one request per connection, the mean latency of
300 /health and 30 one-token completions from a keep-alive client. Prints
one line per attack (or one JSON object).
"""
import argparse
import gzip
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time

import requests

HOSTILE = "127.0.0.2"
MODEL = os.environ.get("KVSTACK_MODEL", "models/SmolLM2-135M-Instruct.Q4_1.gguf")


def start(binary):
    p = subprocess.Popen([binary, "serve", "-m", MODEL, "--port", "0", "--threads", "2",
                          "--kv-cache-tokens", "2048"], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    for line in p.stderr:
        m = re.search(r"ready on http://[\d.]+:(\d+)", line)
        if m:
            threading.Thread(target=lambda: [None for _ in p.stderr], daemon=True).start()
            return p, int(m[1])
    raise RuntimeError("server did not start")


def cpu_s(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read())[1]) / 1024


def sock(port, timeout=30):
    c = socket.socket()
    c.settimeout(timeout)
    c.bind((HOSTILE, 0))
    c.connect(("127.0.0.1", port))
    return c


def status_of(c, timeout=60):
    c.settimeout(timeout)
    data = b""
    try:
        while b"\r\n" not in data:
            chunk = c.recv(4096)
            if not chunk:
                break
            data += chunk
    except OSError:
        pass
    m = re.match(rb"HTTP/1\.[01] (\d{3})", data)
    return int(m[1]) if m else None


def health_worst(port, stop):
    worst, fails = 0.0, 0
    while not stop.is_set():
        t = time.monotonic()
        try:
            requests.get(f"http://127.0.0.1:{port}/health", timeout=15)
        except requests.RequestException:
            fails += 1
        worst = max(worst, time.monotonic() - t)
        stop.wait(0.25)
    return worst, fails


def with_prober(port, fn):
    stop, out = threading.Event(), {}
    t = threading.Thread(target=lambda: out.update(r=health_worst(port, stop)))
    t.start()
    try:
        res = fn()
    finally:
        stop.set()
        t.join()
    res["health_worst_s"], res["health_failures"] = round(out["r"][0], 3), out["r"][1]
    return res


def slowloris(port, pid):
    conns = []
    for _ in range(400):
        try:
            c = sock(port, timeout=2)
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            conns.append(c)
        except OSError:
            pass
        time.sleep(0.01)  # 100/s: within httplib's accept backlog of 5
    t0 = time.monotonic()

    def hold():
        while time.monotonic() - t0 < 12:
            for c in conns:
                try:
                    c.sendall(b"X-Slow: 1\r\n")
                except OSError:
                    pass
            time.sleep(2)
        open_left = 0
        for c in conns:
            c.setblocking(False)
            try:
                open_left += 0 if c.recv(1) == b"" else 1
            except BlockingIOError:
                open_left += 1
            except OSError:
                pass
            c.close()
        return {"connections": len(conns), "still_open_after_12s": open_left}

    return with_prober(port, hold)


def chunked_50mb(port, pid):
    def run():
        c = sock(port, timeout=60)
        c0, t0 = cpu_s(pid), time.monotonic()
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n")
        piece, sent = b'{"prompt": "' + b"a" * 65000 + b'", ', 0
        try:
            while sent < 50 << 20:
                c.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
                sent += len(piece)
            c.sendall(b"0\r\n\r\n")
        except OSError:
            pass
        st = status_of(c, timeout=120)
        c.close()
        return {"status": st, "bytes_sent": sent, "wall_s": round(time.monotonic() - t0, 2),
                "server_cpu_s": round(cpu_s(pid) - c0, 2)}

    return with_prober(port, run)


def gzip_bomb(port, pid):
    def run():
        bomb = gzip.compress(b" " * (100 << 20), 9)
        r0, c0, t0 = rss_mib(pid), cpu_s(pid), time.monotonic()
        c = sock(port, timeout=120)
        try:
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                      b"\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n" % len(bomb) + bomb)
        except OSError:
            pass
        st = status_of(c, timeout=120)
        c.close()
        return {"status": st, "compressed_bytes": len(bomb),
                "wall_s": round(time.monotonic() - t0, 2),
                "server_cpu_s": round(cpu_s(pid) - c0, 2),
                "rss_delta_mib": round(rss_mib(pid) - r0, 1)}

    return with_prober(port, run)


def range_abuse(port, pid):
    base = f"http://127.0.0.1:{port}/metrics"
    plain = len(requests.get(base, timeout=30).content)
    r = requests.get(base, timeout=30, headers={"Range": "bytes=" + ",".join(["0-"] * 100)})
    return {"status": r.status_code, "plain_bytes": plain, "ranged_bytes": len(r.content)}


def negative_length(port, pid):
    c = sock(port)
    t0 = time.monotonic()
    c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n")
    st = status_of(c)
    c.close()
    return {"status": st, "wall_s": round(time.monotonic() - t0, 2)}


def nonstream_disconnect(port, pid):
    body = json.dumps({"prompt": "Tell me a story.", "max_tokens": 1500, "ignore_eos": True})
    c = sock(port)
    c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body.encode()))
    time.sleep(1.0)
    c.close()
    time.sleep(1.0)
    st = requests.get(f"http://127.0.0.1:{port}/v1/kv/stats", timeout=30).json()
    return {"blocks_used_1s_after_close": st["pool"]["blocks_used"],
            "running": st["scheduler"]["running"]}


def sequential_latency(port, pid):
    """The cost of one request per connection: a keep-alive client, one request at a time."""
    sess = requests.Session()
    base = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    for _ in range(300):
        sess.get(base + "/health", timeout=30)
    t1 = time.monotonic()
    for _ in range(30):
        sess.post(base + "/v1/completions", timeout=60,
                  json={"prompt": "Hello", "max_tokens": 1, "temperature": 0})
    t2 = time.monotonic()
    return {"health_ms": round((t1 - t0) / 300 * 1000, 3),
            "completion_1tok_ms": round((t2 - t1) / 30 * 1000, 2)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--only", help="run this attack alone")
    args = ap.parse_args()
    out = {}
    for name, fn in [("slowloris", slowloris), ("chunked_50mb", chunked_50mb),
                     ("gzip_bomb", gzip_bomb), ("range", range_abuse),
                     ("content_length_-1", negative_length),
                     ("nonstream_disconnect", nonstream_disconnect),
                     ("sequential_latency", sequential_latency)]:
        if args.only and name != args.only:
            continue
        p, port = start(args.bin)  # a fresh server per attack
        try:
            out[name] = fn(port, p.pid)
        except Exception as e:  # noqa: BLE001 - reported as the result
            out[name] = {"error": repr(e)}
        p.send_signal(signal.SIGKILL)
        p.wait()
        if not args.json:
            print(f"{name:22s} {out[name]}", flush=True)
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
