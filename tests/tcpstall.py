"""A TCP proxy for tests that can stall: connections are accepted and nothing answers.

In front of PostgreSQL it plays a network stall, a failover or a lock storm as the control plane
sees one (the ``DatabaseOutage`` fault refuses at once instead): while ``stalled``, new
connections are accepted but not passed on, and bytes on open ones are read and held; when the
stall ends, everything held goes on, late, as TCP's retransmissions would deliver it. A side that
closes its connection closes the other side's at once.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
from types import TracebackType


class StallingProxy:
    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._flowing = threading.Event()
        self._flowing.set()
        self._closed = threading.Event()
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.accepted = 0
        self._thread = threading.Thread(target=self._accept, name="tcpstall", daemon=True)
        self._thread.start()

    # -- control

    @property
    def stalled(self) -> bool:
        return not self._flowing.is_set()

    def stall(self) -> None:
        """From now on nothing passes, either way, and new connections wait."""
        self._flowing.clear()

    def resume(self) -> None:
        """What was held goes on; new connections are passed on again."""
        self._flowing.set()

    def close(self) -> None:
        self._closed.set()
        self._flowing.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            for sock in list(self._sockets):
                _close(sock)
        self._thread.join(timeout=5)

    def __enter__(self) -> StallingProxy:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- the proxy

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self._connect, args=(client,), daemon=True).start()

    def _connect(self, client: socket.socket) -> None:
        self._track(client)
        self._flowing.wait()  # accepted, but not passed on during a stall
        try:
            server = socket.create_connection(self.upstream, timeout=10)
        except OSError:
            _close(client)
            return
        server.settimeout(None)
        self._track(server)
        threading.Thread(target=self._pump, args=(client, server), daemon=True).start()
        self._pump(server, client)

    def _pump(self, source: socket.socket, target: socket.socket) -> None:
        try:
            while not self._closed.is_set():
                readable, _, _ = select.select([source], [], [], 0.2)
                if not readable:
                    continue
                data = source.recv(65536)
                if not data:
                    break
                self._flowing.wait()  # held during a stall
                target.sendall(data)
        except (OSError, ValueError):  # closed meanwhile (by the other pump, or close())
            pass
        finally:
            _close(source)
            _close(target)

    def _track(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.add(sock)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()
