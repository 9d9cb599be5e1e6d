"""Hostile clients against `kvstack serve` (issue 22).

One server with short deadlines (--request-timeout 3, at most 8 requests served
at once per client address). Hostile traffic comes from 127.0.0.2 (a loopback
address of its own, so the per-client limits apply to it), the well-behaved
client from 127.0.0.1. Throughout, the well-behaved client must get /health
and a short completion within a bound; every hostile request gets the right
4xx or is dropped; at the end the pool holds no block (free + used + cached =
total, used = 0, no reference) and the RSS is back near its baseline.
"""
import concurrent.futures as cf
import gzip
import json
import re
import socket
import subprocess
import threading
import time

import pytest
import requests
import requests.adapters

from conftest import KVSTACK_BIN
from test_server import ServerProcess

HOSTILE = "127.0.0.2"
PROXY = "127.0.0.3"  # --trusted-proxy: a router's address, exempt from the per-client caps
HEAD_TIMEOUT = 3.0
PER_CLIENT = 8
HEALTH_BOUND = 2.0      # seconds for /health under attack
COMPLETION_BOUND = 10.0  # seconds for a 2-token completion under attack (shared 2-core machine)


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--kv-cache-tokens", "2048", "--max-seqs", "4", "--request-timeout",
                      str(HEAD_TIMEOUT), "--max-conns-per-client", str(PER_CLIENT),
                      "--trusted-proxy", PROXY, admin_key="adm")
    probe(s)  # warm up before the baseline
    s.rss0 = rss_kib(s)
    yield s
    assert s.stop() == 0, "".join(s.stderr_lines[-20:])


def rss_kib(s):
    with open(f"/proc/{s.proc.pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read())[1])


def probe(s):
    """One well-behaved round: /health and a 2-token completion; returns their latencies."""
    t0 = time.monotonic()
    r = requests.get(s.base + "/health", timeout=30)
    t1 = time.monotonic()
    assert r.status_code == 200, r.text
    r = requests.post(s.base + "/v1/completions", timeout=60,
                      json={"model": "kvstack", "prompt": "Hello", "max_tokens": 2})
    t2 = time.monotonic()
    assert r.status_code == 200, r.text
    return t1 - t0, t2 - t1


class Prober:
    """Probes the server from a thread while an attack runs; checks the bounds at the end."""

    def __init__(self, s):
        self.s, self.worst, self.n, self.errors = s, [0.0, 0.0], 0, []
        self.stop_ev = threading.Event()
        self.t = threading.Thread(target=self.loop, daemon=True)

    def loop(self):
        while not self.stop_ev.is_set():
            try:
                h, c = probe(self.s)
                self.worst = [max(self.worst[0], h), max(self.worst[1], c)]
                self.n += 1
            except Exception as e:  # noqa: BLE001 - reported below
                self.errors.append(repr(e))
            self.stop_ev.wait(0.2)

    def __enter__(self):
        self.t.start()
        return self

    def __exit__(self, *exc):
        self.stop_ev.set()
        self.t.join(90)
        assert not self.errors, self.errors[:3]
        assert self.n >= 1
        assert self.worst[0] < HEALTH_BOUND and self.worst[1] < COMPLETION_BOUND, self.worst


class HostileAdapter(requests.adapters.HTTPAdapter):
    """requests from the hostile address."""

    def init_poolmanager(self, *args, **kwargs):
        kwargs["source_address"] = (HOSTILE, 0)
        super().init_poolmanager(*args, **kwargs)


def hostile_session():
    sess = requests.Session()
    sess.mount("http://", HostileAdapter())
    return sess


def hostile_socket(s, timeout=10.0, source=HOSTILE):
    c = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    c.settimeout(timeout)
    c.bind((source, 0))
    c.connect(("127.0.0.1", s.port))
    return c


def read_status(c, timeout=10.0):
    """The status of the response on c, or None when the server dropped the connection."""
    c.settimeout(timeout)
    data = b""
    try:
        while b"\r\n" not in data:
            chunk = c.recv(4096)
            if not chunk:
                break
            data += chunk
    except (ConnectionResetError, socket.timeout, BrokenPipeError):
        pass
    m = re.match(rb"HTTP/1\.[01] (\d{3})", data)
    return int(m[1]) if m else None


def closed_by_server(c, timeout):
    """True when the server closes c (EOF or reset) within timeout seconds."""
    c.settimeout(timeout)
    try:
        while True:
            if not c.recv(4096):
                return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def raw(s, head, body=b"", timeout=10.0):
    c = hostile_socket(s, timeout)
    try:
        c.sendall(head + body)
        return read_status(c, timeout)
    finally:
        c.close()


def metric(s, name, reason=None):
    text = requests.get(s.base + "/metrics", timeout=30).text
    label = rf',reason="{reason}"' if reason else ""
    m = re.search("^" + re.escape(name) + r"\{[^}]*" + re.escape(label) + r"\} (\S+)", text, re.M)
    return float(m[1])


def test_slow_headers_and_idle_connections_do_not_starve_others(server):
    n_before = metric(server, "kvstack:http_connections_dropped_total", "head_timeout")
    conns = [hostile_socket(server) for _ in range(300)]
    for c in conns[:150]:
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # slowloris; the rest idle
    t0 = time.monotonic()
    with Prober(server):
        # One header line per second on the slow half, for longer than the head deadline.
        while time.monotonic() - t0 < HEAD_TIMEOUT + 1.5:
            for c in conns[:150]:
                try:
                    c.sendall(b"X-Slow: 1\r\n")
                except OSError:
                    pass
            time.sleep(1.0)
    # Every hostile connection was closed by the server by now (head deadline or eviction).
    assert all(closed_by_server(c, 3.0) for c in conns)
    for c in conns:
        c.close()
    dropped = (metric(server, "kvstack:http_connections_dropped_total", "head_timeout") - n_before
               + metric(server, "kvstack:http_connections_dropped_total", "evicted"))
    assert dropped >= 300


def test_slow_bodies_are_cut_at_the_deadline_and_limited_per_client(server):
    conns = []
    for _ in range(PER_CLIENT + 12):
        c = hostile_socket(server)
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{")
        conns.append(c)
    t0 = time.monotonic()
    with Prober(server):
        time.sleep(0.5)  # refusals are immediate; the admitted ones wait for their bodies
        codes = [read_status(c, timeout=0.02) for c in conns]
        # Beyond the per-client limit: 429 at once.
        assert codes.count(429) == 12, codes
        slow = [c for c, code in zip(conns, codes) if code is None]
        assert len(slow) == PER_CLIENT
        while time.monotonic() - t0 < HEAD_TIMEOUT + 1.0:
            for c in slow:
                try:
                    c.sendall(b" ")
                except OSError:
                    pass
            time.sleep(0.5)
        # Past the request deadline the body read failed: a 400 or a dropped connection.
        for c in slow:
            assert read_status(c, timeout=3.0) in (400, 408, None)
    for c in conns:
        c.close()
    assert metric(server, "kvstack:http_connections_dropped_total", "client_limit") >= 12


def test_trusted_proxy_skips_the_per_client_limit(server):
    """A router's connections (--trusted-proxy) are not refused past --max-conns-per-client."""
    refused0 = metric(server, "kvstack:http_connections_dropped_total", "client_limit")
    # All admitted (waiting for their bodies), none refused with 429.
    codes = slow_body_burst(server, PER_CLIENT + 4, PROXY)
    assert codes == [None] * (PER_CLIENT + 4), codes
    assert metric(server, "kvstack:http_connections_dropped_total", "client_limit") == refused0
    # The same burst from an untrusted address is still capped.
    codes = slow_body_burst(server, PER_CLIENT + 2, HOSTILE)
    assert codes.count(429) == 2, codes


def slow_body_burst(server, n, source):
    """Opens n requests from `source` whose bodies never come; their statuses after 0.5 s."""
    conns = []
    for _ in range(n):
        c = hostile_socket(server, source=source)
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{")
        conns.append(c)
    time.sleep(0.5)
    codes = [read_status(c, timeout=0.02) for c in conns]
    for c in conns:
        c.close()
    return codes


def test_trusted_proxy_must_be_an_address():
    r = subprocess.run([KVSTACK_BIN, "serve", "--trusted-proxy", "router.local"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode != 0
    assert "--trusted-proxy: 'router.local' is not a numeric IPv4 or IPv6 address" in r.stderr


def test_oversize_and_compressed_bodies(server):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
    with Prober(server):
        # A chunked body past 8 MiB: the server stops reading it (413 or a reset) early.
        c = hostile_socket(server)
        c.sendall(head + b"Transfer-Encoding: chunked\r\n\r\n")
        piece = b"x" * 65536
        sent, t0 = 0, time.monotonic()
        try:
            while sent < 50 << 20:
                c.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
                sent += len(piece)
        except OSError:
            pass
        status = read_status(c, timeout=5)
        c.close()
        assert status in (413, None), status
        assert sent < 24 << 20, sent  # 8 MiB read, then socket buffers at most
        assert time.monotonic() - t0 < 20
        # A compressed body is refused from its head, before any byte of it.
        bomb = gzip.compress(b"0" * (20 << 20))
        c = hostile_socket(server)
        c.sendall(head + b"Content-Encoding: gzip\r\nContent-Length: %d\r\n\r\n" % len(bomb))
        assert read_status(c) == 415
        c.close()
        # Neither a length nor chunking: 411, not read to the end of the stream.
        c = hostile_socket(server)
        c.sendall(head + b"\r\n" + b'{"prompt": "x"}')
        assert read_status(c) == 411
        c.close()
        # A declared length past the limit: 413 before the body.
        c = hostile_socket(server)
        c.sendall(head + b"Content-Length: 50000000\r\n\r\n")
        assert read_status(c) == 413
        c.close()


@pytest.mark.parametrize("framing,status", [
    (b"Content-Length: 15\r\nTransfer-Encoding: chunked\r\n", 400),
    (b"Transfer-Encoding: chunked\r\nContent-Length: 15\r\n", 400),
    (b"Content-Length: 15\r\nContent-Length: 15\r\n", 400),
    (b"Content-Length: -1\r\n", 400),
    (b"Content-Length: 0x0f\r\n", 400),
    (b"Content-Length : 15\r\n", 400),
    (b"Transfer-Encoding: gzip\r\n", 501),
    (b"Transfer-Encoding: chunked, chunked\r\n", 501),
    (b"X-A: 1\r\n folded\r\nContent-Length: 15\r\n", 400),
    (b"X-A: 1\nContent-Length: 15\r\n", 400),
])
def test_malformed_and_conflicting_framing(server, framing, status):
    t0 = time.monotonic()
    got = raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + framing + b"\r\n",
              b'{"prompt": "x"}')
    assert got == status
    assert time.monotonic() - t0 < 2  # answered from the head, no wait for a body


@pytest.mark.parametrize("body", [
    b'{"prompt": "x", "temperature": 1e400}',
    b'{"prompt": "x", "max_tokens": 1e999}',
    b'{"prompt": "x", "max_tokens": 1}\x00garbage',
    b'{"prompt": "x", "max_tokens": 1} {"prompt": "y"}',
    b'{"prompt": "x", "max_tokens": 1}garbage',
])
def test_huge_numbers_and_trailing_bytes(server, body):
    r = requests.post(server.base + "/v1/completions", data=body,
                      headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_range_is_ignored(server):
    plain = requests.get(server.base + "/metrics", timeout=30)
    ranged = requests.get(server.base + "/metrics", timeout=30,
                          headers={"Range": "bytes=" + ",".join(["0-"] * 200)})
    assert ranged.status_code == 200
    assert "multipart" not in ranged.headers.get("Content-Type", "")
    assert len(ranged.content) < 2 * len(plain.content)
    r = requests.post(server.base + "/v1/completions", timeout=30, headers={"Range": "bytes=0-1"},
                      json={"prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 200 and r.json()["choices"]


def test_thousands_of_salts_and_tenant_isolation(server):
    big = "s" * (4 << 20)
    r = requests.post(server.base + "/v1/completions", timeout=30,
                      json={"prompt": "Hi", "max_tokens": 1, "cache_salt": big})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
    long_prompt = "A prompt long enough to fill one whole KV block of sixteen tokens, at least."
    n_salts, n_with_blocks = 2000, 64
    sess = hostile_session()

    def one(i):
        # Most tenants publish no block (a short prompt); some fill one.
        r = sess.post(server.base + "/v1/completions", timeout=60,
                      json={"prompt": long_prompt if i < n_with_blocks else "Hi",
                            "max_tokens": 1, "cache_salt": f"tenant-{i}-" + "k" * 900})
        return r.status_code

    with Prober(server), cf.ThreadPoolExecutor(PER_CLIENT - 2) as ex:
        codes = list(ex.map(one, range(n_salts)))
    assert codes.count(200) == n_salts, {c: codes.count(c) for c in set(codes)}
    admin = server.kv_stats()
    pool = admin["pool"]
    # The admin list shows namespaces holding blocks only: bounded by the pool.
    assert len(admin["prefix_cache"]["namespaces"]) <= pool["blocks_total"]
    # Every salt made a namespace; those left with no block and no request
    # expired, so the live ones are bounded by the blocks too.
    pc = admin["prefix_cache"]
    assert pc["namespaces_live"] + pc["namespaces_expired"] >= n_salts, pc
    assert pc["namespaces_live"] <= n_with_blocks + 1, pc  # + the default
    assert 1 <= len(admin["prefix_cache"]["namespaces"]) <= n_with_blocks + 1  # + the default
    # A tenant sees its own namespace and no other, and no global counters.
    me = server.kv_stats(admin=False, cache_salt="tenant-1-" + "k" * 900)
    assert "namespaces" not in me["prefix_cache"] and "queries" not in me["prefix_cache"]
    own = me["prefix_cache"]["namespace"]
    assert own["queries"] == 1 and own["blocks"] >= 1, own
    assert own["name"].startswith("salt:sha256:")
    assert "tenant" not in json.dumps(admin)  # salts are never shown, only their hashes
    other = server.kv_stats(admin=False, cache_salt="never-used")
    assert other["prefix_cache"]["namespace"]["queries"] == 0


def test_no_block_leaks_and_rss_back_near_baseline(server):
    st = server.wait_idle(timeout=30)
    p = st["pool"]
    assert p["blocks_used"] == 0 and p["references"] == 0, p
    assert p["blocks_free"] + p["blocks_used"] + p["blocks_cached"] == p["blocks_total"], p
    assert st["scheduler"]["running"] == 0 and st["scheduler"]["waiting"] == 0
    probe(server)
    growth_mib = (rss_kib(server) - server.rss0) / 1024
    assert growth_mib < 48, f"RSS grew by {growth_mib:.1f} MiB"
