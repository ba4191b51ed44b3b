"""An agent impostor on a loopback port: the ``/v1/cp`` protocol kept in a dict, fast-path
answers (a reservation, a shard's location) that name whatever file the test chooses, and a home
of the namespace index (``/v1/internal/catalog``, ``/v1/internal/holders``) that answers from the
reports it was sent (``reports``), whatever they claim.

What a process that took an agent's port (or a trainer's ``HPSIM_AGENT_URL``) would answer; real
HTTP, so the SDK is tested through its own client.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from hyperpod_sim.contracts.shards import checksum_of


class FakeAgent:
    """``reserve_path(size)``: the path a reservation answers (unset: refuse with 507).
    ``locate(namespace, rank, step)``: the path a shard's location answers and the bytes the
    answer's size and checksum are of (None: 404)."""

    def __init__(self) -> None:
        self.shards: dict[tuple[str, int, int], bytes] = {}
        self.namespaces: dict[str, dict[str, Any]] = {}
        self.reserve_path: Callable[[int], str] | None = None
        self.locate: Callable[[str, int, int], tuple[Path, bytes] | None] | None = None
        self.reserved: dict[str, tuple[str, int, int, str, int]] = {}  # token -> ns, rank, step, path, size
        self.aborted: list[str] = []
        self.committed: list[str] = []
        self.reads: list[tuple[str, int, int]] = []  # shards read over HTTP
        self.reports: dict[tuple[str, str], dict[str, Any]] = {}  # (namespace, node id) -> image
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> FakeAgent:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def answer(self, method: str, path: str, query: dict[str, list[str]], body: bytes) -> tuple[int, Any]:
        parts = [unquote(p) for p in path.strip("/").split("/")]
        match method, parts:
            case "GET", ["v1", "cp", "namespaces", ns]:
                return (200, self.namespaces[ns]) if ns in self.namespaces else (404, {"error": "NoSuch"})
            case "POST", ["v1", "cp", "namespaces", ns]:
                self.namespaces[ns] = {
                    "namespace": ns,
                    "num_ranks": int(query["num_ranks"][0]),
                    "steps_to_retain_per_rank": int(query["steps_retained"][0]),
                }
                return 201, self.namespaces[ns]
            case "GET", ["v1", "cp", "checkpoints", ns, "latest"]:
                ranks = self.namespaces[ns]["num_ranks"]
                steps = {s for (n, _, s) in self.shards if n == ns}
                complete = sorted(
                    (s for s in steps if all((ns, r, s) in self.shards for r in range(ranks))), reverse=True
                )
                if query.get("world_sizes") == ["true"]:  # the SDK's request: each step's world size
                    return 200, {"steps": complete, "world_sizes": dict.fromkeys(complete, ranks - 1)}
                return 200, complete
            case "POST", ["v1", "cp", "checkpoints", ns, rank, step]:
                self.shards[(ns, int(rank), int(step))] = body
                return 200, {"size": len(body)}
            case "GET", ["v1", "cp", "checkpoints", ns, rank, step]:
                self.reads.append((ns, int(rank), int(step)))
                data = self.shards.get((ns, int(rank), int(step)))
                if data is not None and query.get("checksum", [checksum_of(data)])[0] == checksum_of(data):
                    return 200, data
                return 404, {"error": "NoSuchShard"}
            case "POST", ["v1", "fast", "reserve", ns, rank, step]:
                size = int(query["size"][0])
                if self.reserve_path is None:
                    return 507, {"error": "InsufficientStorage"}
                token = f"t{len(self.reserved)}"
                where = self.reserve_path(size)
                self.reserved[token] = (ns, int(rank), int(step), where, size)
                return 200, {"token": token, "path": where, "buffer_id": "b0", "size": size}
            case "POST", ["v1", "fast", "commit", token]:
                ns, rank, step, where, size = self.reserved[token]
                self.committed.append(token)
                written = int(query.get("size", [str(size)])[0])
                self.shards[(ns, rank, step)] = Path(where).read_bytes()[:written]
                checksum = checksum_of(self.shards[(ns, rank, step)])
                return 200, {
                    "namespace": ns,
                    "rank": rank,
                    "step": step,
                    "size": written,
                    "checksum": checksum,
                }
            case "POST", ["v1", "fast", "abort", token]:
                self.aborted.append(token)
                return 200, {"aborted": True}
            case "GET", ["v1", "fast", "shards", ns, rank, step]:
                found = self.locate(ns, int(rank), int(step)) if self.locate is not None else None
                if found is None:
                    return 404, {"error": "ShardNotHere"}
                where, data = found
                return 200, {
                    "path": str(where),
                    "size": len(data),
                    "checksum": checksum_of(data),
                    "buffer_id": f"r{rank}",
                    "tier": "memory",
                    "lease": "l0",
                }
            case "POST", ["v1", "fast", "release", _]:
                return 200, {"released": True}
            case "PUT", ["v1", "internal", "catalog", ns]:
                report = json.loads(body)
                older = self.reports.get((ns, report["node_id"]))
                kept = older is None or older.get("seq", 0) < report.get("seq", 0)
                if kept:
                    self.reports[(ns, report["node_id"])] = report
                return 200, {"kept": kept}
            case "GET", ["v1", "internal", "catalog", ns]:
                num_ranks = int(query["num_ranks"][0])
                somewhere: dict[int, set[int]] = {}
                for (name, _), image in self.reports.items():
                    for held_step, listed in image["steps"].items() if name == ns else ():
                        somewhere.setdefault(int(held_step), set()).update(listed)
                whole = sorted((s for s, r in somewhere.items() if set(range(num_ranks)) <= r), reverse=True)
                return 200, {"steps": whole, "world_sizes": dict.fromkeys(whole, num_ranks - 1)}
            case "GET", ["v1", "internal", "holders", ns, step]:
                holders: dict[str, list[str]] = {"primary": [], "replica": []}
                for (name, node_id), image in self.reports.items():
                    for kind in holders if name == ns else ():
                        on_node = image.get(kind, {}).get(step, [])
                        if on_node and ("rank" not in query or int(query["rank"][0]) in on_node):
                            holders[kind].append(node_id)
                return 200, holders
        return 404, {"error": "NoSuchRoute"}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        agent = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _serve(self) -> None:
                url = urlsplit(self.path)
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status, answer = agent.answer(self.command, url.path, parse_qs(url.query), body)
                self.send_response(status)
                if isinstance(answer, bytes):
                    meta = json.dumps({"checksum": checksum_of(answer), "algorithm": "xxh3_128"})
                    self.send_header("Shard-Meta", meta)
                    self.send_header("X-Hpsim-Tier", "memory")
                    data = answer
                else:
                    self.send_header("Content-Type", "application/json")
                    data = json.dumps(answer).encode()
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = _serve  # noqa: N815

        return Handler
