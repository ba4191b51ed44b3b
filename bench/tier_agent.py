"""One agent over one keep-alive ``http.client`` connection: its ``/metrics`` (cheap enough to poll
every few milliseconds) and the in-memory protocol's namespace and save calls, for the tier
benchmarks (``memory_tier.py``, ``s3_tier.py``)."""

from __future__ import annotations

import base64
import http.client
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import quote, urlsplit

from bench.common import HOST, poll


@dataclass(frozen=True)
class Shard:
    """Bytes to save and their xxh3 checksum (computed once, untimed)."""

    body: bytes
    checksum: str

    @classmethod
    def of(cls, body: bytes) -> Shard:
        import xxhash

        return cls(body, base64.b64encode(xxhash.xxh3_128_digest(body)).decode())

    @property
    def meta(self) -> str:
        return json.dumps({"checksum": self.checksum, "algorithm": "xxh3_128"})


class AgentConnection:
    """``AgentConnection("http://127.0.0.1:PORT")``; ``close`` it. After a failed request the
    connection is closed and the next request reconnects."""

    def __init__(self, endpoint: str, timeout: float = 300.0) -> None:
        parts = urlsplit(endpoint)
        self.host, self.port = parts.hostname or HOST, parts.port or 80
        self.conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def call(
        self, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None
    ) -> bytes:
        """One request; the response body. RuntimeError unless it answers 2xx."""
        try:
            self.conn.request(method, path, body=body, headers=headers or {})
            resp = self.conn.getresponse()
            data = resp.read()
        except (http.client.HTTPException, ConnectionError):
            self.conn.close()  # the next call reconnects
            raise
        if not 200 <= resp.status < 300:
            raise RuntimeError(f"{method} {path}: HTTP {resp.status} {data[:300]!r}")
        return data

    def metrics(self) -> dict[str, float]:
        """``GET /metrics`` (tried twice: a keep-alive connection the agent closed is reopened)."""
        try:
            text = self.call("GET", "/metrics").decode()
        except (http.client.HTTPException, ConnectionError):
            text = self.call("GET", "/metrics").decode()
        values: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                values[name] = float(value)
        return values

    def value(self, name: str) -> float:
        return self.metrics()[name]

    def wait_metric(
        self, name: str, done: Callable[[float], bool], interval_s: float, deadline_s: float = 600.0
    ) -> float:
        """Poll ``/metrics`` every ``interval_s`` until ``done(value of name)``; perf_counter() of the
        answer that said so."""
        seen = float("nan")

        def check() -> float | None:
            nonlocal seen
            seen = self.metrics()[name]
            return time.perf_counter() if done(seen) else None

        return poll(
            check, deadline_s, interval_s, lambda: TimeoutError(f"{name} is {seen} after {deadline_s}s")
        )

    def create_namespace(self, name: str, num_ranks: int, steps_retained: int) -> None:
        query = f"num_ranks={num_ranks}&steps_retained={steps_retained}"
        self.call("POST", f"/v1/cp/namespaces/{quote(name, safe='')}?{query}")

    def delete_namespace(self, name: str) -> None:
        self.call("DELETE", f"/v1/cp/namespaces/{quote(name, safe='')}")

    def save(self, name: str, rank: int, step: int, shard: Shard) -> float:
        """Save one shard; seconds from sending the request to having read the answer."""
        headers = {"Shard-Meta": shard.meta, "Content-Type": "application/octet-stream"}
        path = f"/v1/cp/checkpoints/{quote(name, safe='')}/{rank}/{step}"
        start = time.perf_counter()
        self.call("POST", path, shard.body, headers)
        return time.perf_counter() - start

    def close(self) -> None:
        self.conn.close()
