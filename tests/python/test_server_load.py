"""Bounded load test of `kvstack serve` (loopback only, stops by itself).

64 concurrent streaming clients with mixed prompt lengths and shared
prefixes against a pool deliberately too small to hold them all at once:
every request completes or gets a clear error, preemptions happen and are
counted, the server stays up, and afterwards no block is referenced.
"""
import concurrent.futures as cf
import json
import random
import re

import requests

from test_server import ServerProcess

SHARED = ["You are a terse assistant. Answer in one short sentence. " * 3,
          "Context: the quick brown fox jumps over the lazy dog. " * 2, ""]


def one_client(base, i):
    rng = random.Random(i)
    prompt = rng.choice(SHARED) + f"Question {i}: " + " ".join(
        rng.choice(["why", "sky", "blue", "tree", "river", "stone", "light"])
        for _ in range(rng.randint(2, 30)))
    body = {"prompt": prompt, "max_tokens": rng.randint(6, 20), "stream": True,
            "temperature": 0.8, "seed": i, "ignore_eos": True}
    try:
        with requests.post(base + "/v1/completions", json=body, stream=True, timeout=240) as r:
            if r.status_code != 200:
                err = r.json()["error"]
                assert err["message"] and err["type"], r.text
                return ("error", r.status_code)
            n_text, finish = 0, None
            for line in r.iter_lines():
                if not line.startswith(b"data: "):
                    continue
                data = line[6:]
                if data == b"[DONE]":
                    break
                obj = json.loads(data)
                assert "error" not in obj, obj
                for ch in obj["choices"]:
                    n_text += len(ch["text"])
                    finish = ch["finish_reason"] or finish
            assert finish == "length", finish  # ignore_eos: runs to max_tokens
            return ("ok", n_text)
    except requests.RequestException as e:  # a transport error is a failure
        return ("transport", str(e))


def test_64_streaming_clients_on_a_small_pool():
    # 24 blocks x 16 tokens: 64 clients of 15-90 tokens each need ~5x that.
    s = ServerProcess("--kv-cache-tokens", "384", "--max-seqs", "16", "--max-batch-tokens",
                      "128", "--reserve-output", "0", "--max-queue", "128")
    try:
        with cf.ThreadPoolExecutor(64) as ex:
            results = list(ex.map(lambda i: one_client(s.base, i), range(64)))
        kinds = [r[0] for r in results]
        assert "transport" not in kinds, results
        assert kinds.count("ok") >= 48, results  # errors must be rare and explicit
        assert s.proc.poll() is None, "server crashed"
        st = s.wait_idle(timeout=20)
        pool = st["pool"]
        assert pool["blocks_used"] == 0 and pool["references"] == 0, st
        assert pool["tables"] == 0
        assert pool["blocks_free"] + pool["blocks_cached"] == pool["blocks_total"]
        assert st["scheduler"]["preemptions"] > 0, st
        metrics = s.get("/metrics").text
        pre = float(re.search(r"^kvstack:num_preemptions_total\{[^}]*\} (\S+)", metrics, re.M)[1])
        assert pre == st["scheduler"]["preemptions"]
    finally:
        assert s.stop() == 0, "".join(s.stderr_lines[-20:])
