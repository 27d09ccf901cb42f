"""The HTTP server under attack, measured: ``interp serve``'s ``run`` in a child process (eager
backend, ``interp:tiny``, an API key), attacked over loopback as a hostile client would.

Reports: the attacks tried (requests and raw connections, by class) and the 5xx seen (target 0);
the p99 latency of a fixed capture while idle and while 100 slow connections are held open
(slowloris: partial headers trickled, reopened when the server cuts them; target within 2x of
idle); the server process's RSS growth over 1,000 mixed requests; the fuzz's case count.

    .venv/bin/python bench/server_attack.py [--fuzz 3000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import Any

import httpx
import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.server.test_server_attacks import CASES  # noqa: E402  (the attack table of the tests)
from tests.server.test_server_fuzz import _body, _mutate, _raw  # noqa: E402

KEY = "bench-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
FIXED = {"text": "The capital of France is", "points": ["resid_post.1", "logits"]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(port: int) -> subprocess.Popen[bytes]:
    code = (
        "from interp_engine.server import run, ServerLimits\n"
        f"run('interp:tiny', backend='eager', port={port}, api_key={KEY!r}, saes={{'res': 'interp:tiny-sae'}})\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the server did not come up")


class Tally:
    def __init__(self) -> None:
        self.tried: Counter[str] = Counter()
        self.statuses: Counter[int] = Counter()
        self.server_errors: list[str] = []

    def note(self, kind: str, status: int, detail: str = "") -> None:
        self.tried[kind] += 1
        self.statuses[status] += 1
        if status >= 500 and not (kind in ("connection flood", "slow headers") and status == 503):
            self.server_errors.append(f"{kind}: {status} {detail[:200]}")


def raw_status(data: bytes) -> int:
    try:
        return int(data.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return 0  # closed without an answer


def read_all(sock: socket.socket, timeout: float) -> bytes:
    sock.settimeout(timeout)
    out = []
    try:
        while chunk := sock.recv(65536):
            out.append(chunk)
    except (TimeoutError, OSError):
        pass
    return b"".join(out)


def attacks(url: str, port: int, tally: Tally, n_fuzz: int) -> None:
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as client:
        for name, path, body, _, _ in CASES:  # every input that gave a 500 before
            for _ in range(5):
                if isinstance(body, dict):
                    r = client.post(path, json=body)
                else:
                    r = client.post(path, content=body, headers={"content-type": "application/json"})
                tally.note("known 500s", r.status_code, f"{name} {r.text}")
        rng = random.Random(1)
        paths = ["/v1/capture", "/v1/capture_generation", "/v1/attention", "/v1/generate"]
        paths += ["/v1/decode_residuals", "/v1/tokenize", "/v1/completions", "/v1/chat/completions"]
        for i in range(n_fuzz):
            path = paths[i % len(paths)]
            body = _body(path, rng)
            for _ in range(rng.choice([0, 1, 1, 2, 3])):
                body = _mutate(body, rng)
            r = client.post(path, content=_raw(body, rng), headers={"content-type": "application/json"})
            tally.note("fuzzed bodies", r.status_code, r.text)
        big = "word " * 2_000_000  # 10 MB of text
        for path, body in (("/v1/capture", {"text": big, "points": ["embed"]}), ("/v1/tokenize", {"text": big})):
            for _ in range(5):
                r = client.post(path, json=body)
                tally.note("10 MB texts", r.status_code, r.text)
        for _ in range(200):
            r = client.post("/v1/capture", json=FIXED, headers={"Authorization": "Bearer wrong"})
            tally.note("bad keys", r.status_code)
            r = client.get("/v1/model", headers={"Host": "rebind.attacker.example"})
            tally.note("untrusted hosts", r.status_code)
        for _ in range(20):
            with client.stream("POST", "/v1/completions", json={"prompt": "Hi", "max_tokens": 40, "stream": True}) as r:
                next(r.iter_lines())  # leave mid-stream
                tally.note("streams left mid-way", r.status_code)
    # raw connections: partial headers, partial bodies, a flood beyond the connection cap
    socks = []
    for _ in range(200):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"POST /v1/capture HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty")
        socks.append(("slow headers", s))
    head = (
        f"POST /v1/capture HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
        "Content-Type: application/json\r\nContent-Length: 15000000\r\n\r\n"
    ).encode()
    for _ in range(20):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(head + b'{"text": "' + b"a" * 1_000_000)
        socks.append(("partial 15 MB bodies", s))
    flood = []
    for _ in range(600):
        try:
            flood.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        except OSError:
            tally.note("connection flood", 0)
    results: dict[int, bytes] = {}

    def drain(i: int, s: socket.socket, timeout: float) -> None:
        results[i] = read_all(s, timeout)

    threads = [threading.Thread(target=drain, args=(i, s, 45)) for i, (_, s) in enumerate(socks)]
    threads += [threading.Thread(target=drain, args=(1000 + i, s, 45)) for i, s in enumerate(flood)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, (kind, s) in enumerate(socks):
        tally.note(kind, raw_status(results[i]))
        s.close()
    for i, s in enumerate(flood):
        tally.note("connection flood", raw_status(results[1000 + i]))
        s.close()


def p99(samples: list[float]) -> float:
    return statistics.quantiles(samples, n=100)[98]


def latency(url: str, n: int) -> list[float]:
    out = []
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as client:
        client.post("/v1/capture", json=FIXED)
        for _ in range(n):
            start = time.perf_counter()
            r = client.post("/v1/capture", json=FIXED)
            out.append(time.perf_counter() - start)
            assert r.status_code == 200
    return out


def with_slow_connections(port: int, n: int, work: Any) -> Any:
    """``work()`` while ``n`` slowloris connections are held (each reopened when cut)."""
    stop = threading.Event()

    def loris() -> None:
        while not stop.is_set():
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
                s.sendall(b"GET /v1/health HTTP/1.1\r\n")
                while not stop.is_set():
                    s.sendall(b"X-a: b\r\n")
                    stop.wait(0.5)
            except OSError:
                stop.wait(0.1)

    threads = [threading.Thread(target=loris, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    try:
        return work()
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=10)


def memory(url: str, pid: int) -> tuple[float, float]:
    process = psutil.Process(pid)
    steer = {"writes": [{"address": "resid_post.0", "vector": [0.1] * 128, "scale": 0.5}]}
    bodies: list[tuple[str, Any]] = [
        ("/v1/capture", FIXED),
        ("/v1/capture", {**FIXED, "steering": steer}),
        ("/v1/generate", {"text": "Hi", "max_tokens": 4, "n_logprobs": 2}),
        ("/v1/tokenize", {"text": "The capital of France is"}),
        ("/v1/capture", {"text": "Hi", "points": ["resid_post.99"]}),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 3, "temperature": 0}),
        ("/v1/decode_residuals", {"activations": [[0.5] * 128], "top_k": 3}),
        ("/v1/capture", {"text": "Hi", "points": ["features:res:top8"]}),
    ]
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as client:
        for i in range(200):
            client.post(bodies[i % len(bodies)][0], json=bodies[i % len(bodies)][1])
        rss = process.memory_info().rss
        start = time.monotonic()
        for i in range(1000):
            r = client.post(bodies[i % len(bodies)][0], json=bodies[i % len(bodies)][1])
            assert r.status_code < 500, r.text
        return (process.memory_info().rss - rss) / 2**20, time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fuzz", type=int, default=3000, help="fuzzed bodies to send (default 3000)")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(port)
    try:
        idle = latency(url, 300)
        slow = with_slow_connections(port, 100, lambda: latency(url, 300))
        growth, mem_s = memory(url, proc.pid)
        tally = Tally()
        start = time.monotonic()
        attacks(url, port, tally, args.fuzz)
        attack_s = time.monotonic() - start
        after_attacks, _ = memory(url, proc.pid)
        alive = httpx.get(f"{url}/v1/health", timeout=5).status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    figures = {
        "attacks_tried": sum(tally.tried.values()),
        "attacks_by_class": dict(tally.tried),
        "statuses": {str(k): v for k, v in sorted(tally.statuses.items())},
        "5xx_seen": len(tally.server_errors),
        "5xx_examples": tally.server_errors[:5],
        "attack_seconds": round(attack_s, 1),
        "capture_p99_idle_ms": round(p99(idle) * 1000, 2),
        "capture_p99_100_slow_connections_ms": round(p99(slow) * 1000, 2),
        "capture_median_idle_ms": round(statistics.median(idle) * 1000, 2),
        "capture_median_100_slow_connections_ms": round(statistics.median(slow) * 1000, 2),
        "rss_growth_1000_mixed_requests_mib": round(growth, 1),
        "mixed_requests_seconds": round(mem_s, 1),
        "rss_growth_1000_mixed_requests_after_the_attacks_mib": round(after_attacks, 1),
        "fuzz_cases": args.fuzz,
        "server_alive_after": alive,
    }
    print(json.dumps(figures, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
