"""An HTTP proxy in front of an S3 endpoint that injects faults, for tests of the S3 tier.

Real HTTP on a loopback port: the agents talk to it as to any S3 endpoint. Each request is first
shown to ``proxy.fault`` (a function of the method and path, changeable at any time) which answers
what to do with it: pass it on, answer 503 SlowDown (a throttle), answer 500, hold it until
``release()`` (an upload that hangs), or drop the connection.
"""

from __future__ import annotations

import http.client
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Literal
from urllib.parse import urlsplit

Fault = Literal["pass", "throttle", "error", "hold", "drop"]
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade"}


class FaultyS3Proxy:
    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        self._upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.fault: Callable[[str, str], Fault] = lambda method, path: "pass"
        self.requests: list[tuple[str, str, Fault]] = []
        self._lock = threading.Lock()
        self._released = threading.Event()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                fault = proxy.fault(self.command, self.path)
                with proxy._lock:
                    proxy.requests.append((self.command, self.path, fault))
                if fault == "hold":
                    proxy._released.wait()
                    fault = "drop"
                if fault == "drop":
                    self.close_connection = True
                    self.connection.close()
                    return
                if fault in ("throttle", "error"):
                    status, code = (503, "SlowDown") if fault == "throttle" else (500, "InternalError")
                    payload = (
                        f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                        f"<Message>injected by the test proxy</Message></Error>"
                    ).encode()
                    self.send_response(status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                upstream = http.client.HTTPConnection(*proxy._upstream, timeout=60)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                    upstream.request(self.command, self.path, body=body, headers=headers)
                    answer = upstream.getresponse()
                    data = answer.read()
                finally:
                    upstream.close()
                self.send_response(answer.status)
                head = self.command == "HEAD"
                for key, value in answer.getheaders():
                    if key.lower() not in _HOP_BY_HOP and (head or key.lower() != "content-length"):
                        self.send_header(key, value)
                if not head:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if not head:
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle  # noqa: N815

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FaultyS3Proxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
        self._server.shutdown()
        self._server.server_close()

    def release(self) -> None:
        """Let held requests go on (they are dropped: the client sees a broken connection)."""
        self._released.set()

    def count(self, fault: Fault) -> int:
        with self._lock:
            return sum(1 for _, _, f in self.requests if f == fault)
