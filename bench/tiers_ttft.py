"""TTFT of one prompt served by recompute, a pool hit, a host-tier hit, a disk-tier hit
and a disk hit after a restart (docs/benchmarks.md, Storage tiers).
Usage: KVSTACK_BIN=build/src/cli/kvstack .venv/bin/python bench/tiers_ttft.py N_WORDS
"""
import sys, time, random, pathlib, tempfile, shutil
sys.path.insert(0, "tests/python")
from conftest import MODEL
from test_server import ServerProcess
import requests

def words(n, seed):
    rng = random.Random(seed)
    vocab = ["river", "stone", "cloud", "lamp", "garden", "window", "copper", "engine", "violet",
             "harbor", "meadow", "signal", "orbit", "candle", "forest", "marble"]
    return " ".join(rng.choice(vocab) for _ in range(n))

n = int(sys.argv[1])
A, B = words(n, 1), words(n, 2)
def ttft(s, p):
    t0 = time.perf_counter()
    r = requests.post(s.base + "/v1/completions", json={"prompt": p, "max_tokens": 1, "temperature": 0}).json()
    return time.perf_counter() - t0, r["usage"]["prompt_tokens"], r["usage"]["prompt_tokens_details"]["cached_tokens"]
pool = ["--kv-cache-tokens", str(int(n * 1.6)), "--max-seqs", "1"]
d = tempfile.mkdtemp()
rows = []
s = ServerProcess(*pool, "--kv-host-mem", "1GiB")
rows.append(("recompute (cold)",) + ttft(s, A))
rows.append(("pool hit",) + ttft(s, A))
ttft(s, B)
rows.append(("host hit",) + ttft(s, A))
s.stop()
disk = ["--kv-disk", d, "--kv-disk-size", "2GiB"]
s = ServerProcess(*pool, *disk)
ttft(s, A); ttft(s, B)
rows.append(("disk hit",) + ttft(s, A))
s.stop()
s = ServerProcess(*pool, *disk)
rows.append(("disk hit after restart",) + ttft(s, A))
s.stop()
shutil.rmtree(d)
for r in rows:
    print(f"| {r[0]} | {r[2]} | {r[3]} | {r[1]*1000:.0f} ms |")
