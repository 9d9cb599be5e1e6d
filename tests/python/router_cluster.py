"""Helpers for the router tests: kvstack workers and vllm-router on bench/netns.py hosts.

`Worker(host, *args)` starts `kvstack serve` on a test host (its own network
namespace, port 8000) and waits for /health; `Router(host, urls, policy)` starts
`.venv/bin/vllm-router` in plain mode in front of them and waits until it
answers. Both are context managers and stop their process (SIGTERM, then
SIGKILL) on exit. The hosts have no DNS: everything uses addresses.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import requests

from conftest import KVSTACK_BIN, MODEL, SOURCE_DIR, THREADS

sys.path.insert(0, str(SOURCE_DIR / "bench"))
from netns import Hosts  # noqa: E402,F401  (re-exported for the tests)

ROUTER_BIN = os.environ.get("KVSTACK_ROUTER_BIN", str(SOURCE_DIR / ".venv" / "bin" / "vllm-router"))


class _Proc:
    def __init__(self, host, cmd, log_name):
        self.host = host
        self.lines: list[str] = []
        self.proc = host.popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
        self.log_name = log_name

        def pump():
            for line in self.proc.stdout:
                self.lines.append(line)

        self._pump = threading.Thread(target=pump, daemon=True)
        self._pump.start()

    def log(self) -> str:
        return "".join(self.lines)

    def wait_http(self, url: str, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                if requests.get(url, timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{self.log_name} did not come up at {url}:\n{self.log()[-4000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            # ip netns exec replaces itself with the command, so this is the server.
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self._pump.join(timeout=5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


class Worker(_Proc):
    """`kvstack serve` on `host`:8000 with the default model."""

    PORT = 8000

    def __init__(self, host, *extra, threads: int = 1, timeout: float = 120):
        cmd = [KVSTACK_BIN, "serve", "-m", MODEL, "--host", host.addr, "--port", str(self.PORT),
               "--threads", str(min(threads, THREADS)), *map(str, extra)]
        super().__init__(host, cmd, f"kvstack serve on {host.addr}")
        self.url = f"http://{host.addr}:{self.PORT}"
        self.wait_http(self.url + "/health", timeout)

    def kv_stats(self) -> dict:
        return requests.get(self.url + "/v1/kv/stats", timeout=30).json()


class Router(_Proc):
    """vllm-router in plain mode on `host`:8100 in front of `urls`."""

    PORT = 8100

    def __init__(self, host, urls, policy: str, *extra, timeout: float = 60):
        cmd = [ROUTER_BIN, "--host", host.addr, "--port", str(self.PORT), "--policy", policy,
               "--worker-urls", *urls, "--prometheus-host", host.addr, "--prometheus-port",
               str(self.PORT + 1), "--log-level", "info", *map(str, extra)]
        super().__init__(host, cmd, f"vllm-router ({policy}) on {host.addr}")
        self.url = f"http://{host.addr}:{self.PORT}"
        self.wait_http(self.url + "/health", timeout)


def post(base: str, path: str, body: dict, timeout: float = 120) -> dict:
    r = requests.post(base + path, json=body, timeout=timeout)
    assert r.status_code == 200, f"POST {base}{path} -> {r.status_code}: {r.text[:500]}"
    return r.json()


def stream_text(base: str, path: str, body: dict, timeout: float = 120) -> str:
    """The concatenated text of an SSE completion/chat stream (must end with [DONE])."""
    import json

    text, done = [], False
    with requests.post(base + path, json={**body, "stream": True}, stream=True,
                       timeout=timeout) as r:
        assert r.status_code == 200, f"POST {base}{path} (stream) -> {r.status_code}: {r.text[:500]}"
        for raw in r.iter_lines():
            line = raw.decode()
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            for ch in chunk.get("choices", []):
                text.append(ch.get("text") or (ch.get("delta") or {}).get("content") or "")
    assert done, "stream ended without [DONE]"
    return "".join(text)
