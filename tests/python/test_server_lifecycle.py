"""Request lifecycle edges of `kvstack serve` (issue 22): a client that goes
away while its request is queued, prefilling or decoding (streaming or not)
frees the request's blocks at once; SIGTERM with streams in flight ends each
stream with finish_reason and [DONE] within the grace period, or with an
error event and [DONE] after it, and refuses new requests with 503.
"""
import json
import random
import re
import signal
import socket
import threading
import time

import pytest
import requests

from test_server import ServerProcess, openai

FREE_BOUND = 1.0  # seconds from the client's close to the blocks being back


@pytest.fixture(scope="module")
def server():
    # One sequence at a time, 16-token prefill chunks: a long prompt prefills
    # over many steps, and a second request waits in the queue.
    s = ServerProcess("--kv-cache-tokens", "4096", "--max-seqs", "1", "--max-batch-tokens", "16",
                      admin_key="adm")
    yield s
    assert s.stop() == 0, "".join(s.stderr_lines[-20:])


def words(n, seed):
    rng = random.Random(seed)
    vocab = ["river", "stone", "cloud", "lamp", "garden", "window", "copper", "engine", "violet",
             "harbor", "meadow", "signal", "orbit", "candle", "forest", "marble"]
    return " ".join(rng.choice(vocab) for _ in range(n))


def open_request(s, body):
    """Sends a completion request on a raw socket and returns the socket (response unread)."""
    data = json.dumps(body).encode()
    c = socket.create_connection(("127.0.0.1", s.port), timeout=30)
    c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return c


def steps(s):
    text = s.get("/metrics").text
    return int(float(re.search(r"^kvstack:engine_steps_total\{[^}]*\} (\S+)", text, re.M)[1]))


def wait_for(s, cond, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = s.kv_stats()
        if cond(st):
            return st
        time.sleep(0.01)
    raise AssertionError(f"condition not reached: {s.kv_stats()}")


def close_and_check_freed(s, c, failed_before):
    c.close()
    t0 = time.monotonic()
    st = wait_for(s, lambda st: st["pool"]["blocks_used"] == 0 and st["scheduler"]["running"] == 0
                  and st["scheduler"]["waiting"] == 0, timeout=10)
    took = time.monotonic() - t0
    print(f"blocks freed {took * 1000:.0f} ms after the disconnect")
    assert took < FREE_BOUND, f"blocks freed {took:.2f} s after the disconnect"
    assert st["scheduler"]["requests_failed"] > failed_before  # cancelled, not run to the end
    p = st["pool"]
    assert p["references"] == 0 and p["blocks_free"] + p["blocks_cached"] == p["blocks_total"]
    return took


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_while_queued_and_while_decoding(server, stream):
    failed = server.kv_stats()["scheduler"]["requests_failed"]
    blocker = open_request(server, {"prompt": words(8, 1), "max_tokens": 3000,
                                    "ignore_eos": True, "stream": stream})
    wait_for(server, lambda st: st["scheduler"]["running"] == 1)
    queued = open_request(server, {"prompt": words(8, 2), "max_tokens": 50, "stream": stream})
    wait_for(server, lambda st: st["scheduler"]["waiting"] == 1)
    queued.close()  # queued: dropped from the queue
    wait_for(server, lambda st: st["scheduler"]["waiting"] == 0, timeout=FREE_BOUND)
    # The blocker is decoding by now (its prompt is 8 words): drop it too.
    wait_for(server, lambda st: st["scheduler"]["running"] == 1
             and st["pool"]["tokens_committed"] > 32)
    close_and_check_freed(server, blocker, failed + 1)


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_while_prefilling(server, stream):
    failed = server.kv_stats()["scheduler"]["requests_failed"]
    prompt = words(1200, 3 + stream)  # ~1200 tokens: about 75 prefill steps of 16
    c = open_request(server, {"prompt": prompt, "max_tokens": 20, "stream": stream})
    st = wait_for(server, lambda st: 64 <= st["pool"]["tokens_committed"] <= 600)
    n0 = steps(server)
    close_and_check_freed(server, c, failed)
    # The prefill stopped: far fewer steps ran than the ~40 the prompt had left.
    print(f"{steps(server) - n0} steps ran after the disconnect")
    assert steps(server) - n0 < 20, (n0, steps(server), st["pool"])


def read_stream(resp):
    """The data lines of an SSE response, decoded (until [DONE] or the end)."""
    out = []
    for line in resp.iter_lines():
        if line.startswith(b"data: "):
            payload = line[6:].decode()
            out.append(payload if payload == "[DONE]" else json.loads(payload))
            if payload == "[DONE]":
                break
    return out


def test_sigterm_drains_streams():
    grace = 6.0
    s = ServerProcess("--kv-cache-tokens", "8192", "--max-seqs", "4", "--shutdown-grace",
                      str(grace))
    results, errors = {}, []

    def stream(name, max_tokens):
        try:
            body = {"prompt": words(6, name), "max_tokens": max_tokens, "ignore_eos": True,
                    "stream": True}
            with requests.post(s.base + "/v1/completions", json=body, stream=True,
                               timeout=60) as r:
                events = read_stream(r)
            results[name] = (events, time.monotonic())
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"{name}: {e!r}")

    def openai_stream():
        try:
            c = s.client()
            chunks = list(c.completions.create(model="kvstack", prompt="Once upon a time",
                                               max_tokens=24, stream=True))
            results["openai"] = (chunks, time.monotonic())
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"openai: {e!r}")

    threads = [threading.Thread(target=stream, args=("short", 24)),
               threading.Thread(target=stream, args=("long", 4000)),
               threading.Thread(target=openai_stream)]
    for t in threads:
        t.start()
    try:
        wait_for(s, lambda st: st["scheduler"]["running"] == 3 and
                 st["pool"]["tokens_committed"] > 40, timeout=60)
    finally:
        t_sig = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    r = requests.post(s.base + "/v1/completions", json={"prompt": "x", "max_tokens": 1},
                      timeout=30)
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
    for t in threads:
        t.join(60)
    rc = s.stop(timeout=30)
    assert not errors, errors
    assert rc == 0
    # Finished within the grace period: finish_reason, then [DONE].
    events, t_end = results["short"]
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    assert t_end - t_sig < grace
    chunks, t_end = results["openai"]
    assert chunks[-1].choices[0].finish_reason == "length" and t_end - t_sig < grace
    # Cut at the end of the grace period: an error event, then [DONE].
    events, t_end = results["long"]
    assert events[-1] == "[DONE]" and "error" in events[-2], events[-3:]
    assert events[-2]["error"]["type"] == "service_unavailable"
    assert grace - 0.5 <= t_end - t_sig < grace + 5
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-2])
