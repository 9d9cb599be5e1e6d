"""TTFT of one prompt served by recompute, a pool hit, a host-tier hit, a disk-tier hit
(after a restart, and again in that process) and a Redis hit (a second instance, fresh,
and again in that process) (docs/benchmarks.md, Storage tiers).

Usage: KVSTACK_BIN=build/src/cli/kvstack .venv/bin/python bench/tiers_ttft.py N_WORDS [MODEL]

Two prompts A and B of N_WORDS one-token words; the pool (--kv-cache-tokens 1.6 N)
holds one, so B evicts A. Only two cold prefills per run:
  server 1 (--kv-host-mem, --kv-disk, --kv-redis): A cold (recompute), A x 3 (pool
           hits), B cold (A goes to the host tier), then A, B three times (each a host
           hit that evicts the other prompt to the host); stopped: pool and host are
           persisted to disk
  server 2 (--kv-disk, same directory): A (the first request after a restart), B,
           then A, B three times (disk hits: no host tier, the evicted prompt stays on
           disk)
  server 3 (--kv-redis, same private redis-server): A (a fresh instance's first
           request), B, then A, B three times (Redis hits)
Hit rows give the best and the median of the three A requests.
A private redis-server on a free port is started first and stopped at the end.
"""
import pathlib
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, "tests/python")
from conftest import MODEL  # noqa: E402
from test_server import ServerProcess  # noqa: E402
import requests  # noqa: E402


def words(n, seed):
    rng = random.Random(seed)
    vocab = ["river", "stone", "cloud", "lamp", "garden", "window", "copper", "engine", "violet",
             "harbor", "meadow", "signal", "orbit", "candle", "forest", "marble"]
    return " ".join(rng.choice(vocab) for _ in range(n))


def ttft(s, p):
    t0 = time.perf_counter()
    r = requests.post(s.base + "/v1/completions", timeout=1800,
                      json={"prompt": p, "max_tokens": 1, "temperature": 0}).json()
    u = r["usage"]
    return time.perf_counter() - t0, u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


n = int(sys.argv[1])
model = sys.argv[2] if len(sys.argv) > 2 else MODEL
A, B = words(n, 1), words(n, 2)
pool = ["-m", model, "--kv-cache-tokens", str(int(n * 1.6)), "--max-seqs", "1"]
d = tempfile.mkdtemp()
disk = ["--kv-disk", d, "--kv-disk-size", "8GiB"]
port = free_port()
redis = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                          "--appendonly", "no"], stdout=subprocess.DEVNULL)
url = ["--kv-redis", f"redis://127.0.0.1:{port}", "--kv-redis-timeout", "2000"]
rows = []
REP = 3  # hits measured REP times each (A and B alternate: each is a tier hit)


def hits(s, name):
    """REP tier hits of A, B in between (B evicts A); min and median of A."""
    t = []
    for _ in range(REP):
        t.append(ttft(s, A))
        ttft(s, B)
    rows.append((name, min(x[0] for x in t), sorted(x[0] for x in t)[REP // 2]) + t[0][1:])


try:
    time.sleep(0.5)
    s = ServerProcess(*pool, "--kv-host-mem", "8GiB", *disk, *url, timeout=600)
    c = ttft(s, A)
    rows.append(("recompute (cold)", c[0], c[0]) + c[1:])
    t = [ttft(s, A) for _ in range(REP)]
    rows.append(("pool hit", min(x[0] for x in t), sorted(x[0] for x in t)[REP // 2]) + t[0][1:])
    ttft(s, B)
    hits(s, "host hit")
    s.stop()
    s = ServerProcess(*pool, *disk, timeout=600)
    c = ttft(s, A)
    rows.append(("disk hit, first request after a restart", c[0], c[0]) + c[1:])
    ttft(s, B)
    hits(s, "disk hit")
    s.stop()
    s = ServerProcess(*pool, *url, timeout=600)
    c = ttft(s, A)
    rows.append(("Redis hit, first request of a fresh instance", c[0], c[0]) + c[1:])
    ttft(s, B)
    hits(s, "Redis hit")
    s.stop()
finally:
    redis.terminate()
    redis.wait(timeout=10)
    shutil.rmtree(d)
print(f"model {pathlib.Path(model).name}, {rows[0][3]} prompt tokens; hits: best / median of {REP}")
for r in rows:
    print(f"| {r[0]} | {r[1] * 1000:.0f} / {r[2] * 1000:.0f} ms | {r[4]} cached |")
