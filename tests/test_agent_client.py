"""The control plane's client towards agents (domain/checkpoints/agent_client.py) against agents
that misbehave: real sockets on loopback, a server per agent that answers as the test says. Many
calls go out at once from one thread; what one agent does is that call's answer or error only."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from hyperpod_sim.domain.checkpoints.agent_client import (
    AgentConnection,
    AgentUnreachable,
    Answer,
    Call,
    KeptConnections,
    exchange,
)
from hyperpod_sim.domain.clock import Ids
from hyperpod_sim.models import Database
from tests.conftest import ManualClock, wait_for
from tests.service_fakes import FakeProvisioner, make_reconciler

Behaviour = Callable[[socket.socket, bytes], bool]  # answer one request; False: close the connection


class Agent:
    """A loopback server that reads each request whole and hands it to ``behaviour``."""

    def __init__(self, behaviour: Behaviour) -> None:
        self.behaviour = behaviour
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.connections = 0
        self.requests: list[bytes] = []
        self.open_now = 0
        self.most_open = 0
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._stopping = False

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.listener.getsockname()[1]}"

    def start(self) -> Agent:
        thread = threading.Thread(target=self._accept, daemon=True)
        thread.start()
        self._threads.append(thread)
        return self

    def stop(self) -> None:
        self._stopping = True
        self.listener.close()

    def _accept(self) -> None:
        while not self._stopping:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with self._lock:
                self.connections += 1
                self.open_now += 1
                self.most_open = max(self.most_open, self.open_now)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buffer = b""
        try:
            while True:
                while b"\r\n\r\n" not in buffer:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buffer += data
                head, _, rest = buffer.partition(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                while len(rest) < length:
                    rest += conn.recv(65536)
                request, buffer = head + b"\r\n\r\n" + rest[:length], rest[length:]
                with self._lock:
                    self.requests.append(request)
                if not self.behaviour(conn, request):
                    return
        finally:
            with self._lock:
                self.open_now -= 1
            conn.close()


def answer(conn: socket.socket, status: int, body: object, *, close: bool = False) -> None:
    payload = json.dumps(body).encode()
    head = f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
    if close:
        head += "Connection: close\r\n"
    conn.sendall(head.encode() + b"\r\n" + payload)


def echo(conn: socket.socket, request: bytes) -> bool:
    """200 with what the request was: its method, path, authorization and body."""
    head, _, body = request.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    answer(
        conn, 200, {"request": lines[0], "authorization": headers.get("authorization"), "body": body.decode()}
    )
    return True


@contextmanager
def agents(*behaviours: Behaviour) -> Iterator[list[Agent]]:
    with ExitStack() as stack:
        started = []
        for behaviour in behaviours:
            agent = Agent(behaviour).start()
            stack.callback(agent.stop)
            started.append(agent)
        yield started


def test_calls_to_many_agents_answer_in_order_each_with_its_own_token_and_body() -> None:
    with agents(*[echo] * 40) as fleet:
        connections = [
            AgentConnection(a.endpoint, token=f"token-{i}", timeout=10) for i, a in enumerate(fleet)
        ]
        calls = [
            Call(c, "PUT", f"/v1/policy?n={i}", json.dumps({"n": i}).encode())
            for i, c in enumerate(connections)
        ]
        results = exchange(calls, window=8)
    assert all(isinstance(r, Answer) and r.status == 200 for r in results)
    seen = [r.json() for r in results if isinstance(r, Answer)]
    assert [s["request"] for s in seen] == [f"PUT /v1/policy?n={i} HTTP/1.1" for i in range(40)]
    assert [s["authorization"] for s in seen] == [f"Bearer token-{i}" for i in range(40)]
    assert [json.loads(s["body"]) for s in seen] == [{"n": i} for i in range(40)]
    assert all(c.open for c in connections)  # kept: the agents answered keep-alive


def test_at_most_the_window_of_calls_is_under_way_at_once() -> None:
    gate = threading.Semaphore(0)
    lock = threading.Lock()
    under_way = [0, 0]  # now, most

    def slow(conn: socket.socket, request: bytes) -> bool:
        with lock:
            under_way[0] += 1
            under_way[1] = max(under_way[1], under_way[0])
        gate.acquire(timeout=0.05)  # every answer waits a little: calls overlap if they can
        with lock:
            under_way[0] -= 1
        return echo(conn, request)

    with agents(*[slow] * 24) as fleet:
        calls = [Call(AgentConnection(a.endpoint, token="t", timeout=10), "GET", "/") for a in fleet]
        results = exchange(calls, window=4)
    assert all(isinstance(r, Answer) for r in results)
    assert 1 < under_way[1] <= 4


def test_one_agent_that_misbehaves_costs_its_own_call_only() -> None:
    def garbage(conn: socket.socket, request: bytes) -> bool:
        conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        return False

    def hang_up(conn: socket.socket, request: bytes) -> bool:
        return False  # read the request, closed without an answer

    def silent(conn: socket.socket, request: bytes) -> bool:
        threading.Event().wait(5)
        return False

    closed_port = socket.create_server(("127.0.0.1", 0))
    refused = f"http://127.0.0.1:{closed_port.getsockname()[1]}"
    closed_port.close()
    with agents(echo, garbage, hang_up, silent, echo) as fleet:
        endpoints = [a.endpoint for a in fleet] + [refused]
        calls = [Call(AgentConnection(e, token="t", timeout=1.0), "GET", "/v1/health") for e in endpoints]
        results = exchange(calls, window=16)
    kinds = [type(r).__name__ if isinstance(r, Answer) else str(r).split(":")[0] for r in results]
    assert kinds == [
        "Answer",
        "not an HTTP answer",
        "RemoteDisconnected",
        "TimeoutError",
        "Answer",
        "ConnectionRefusedError",
    ]
    assert [c.connection.open for c in calls] == [True, False, False, False, True, False]


def test_a_kept_connection_the_agent_closed_while_idle_is_retried_once_on_a_new_one() -> None:
    answered = [0]

    def once_per_connection(conn: socket.socket, request: bytes) -> bool:
        answered[0] += 1
        echo(conn, request)
        return False  # the connection closes after each answer, as an agent's idle timeout would

    kept = KeptConnections(timeout=5)
    with agents(once_per_connection) as (agent,):
        for _ in range(3):
            connection = kept.take(agent.endpoint, "t")
            assert connection.call("GET", "/v1/health").status == 200
            kept.give_back(agent.endpoint, connection)
    assert answered[0] == 3
    assert agent.connections == 3  # each call after the first found its kept connection closed


def test_a_new_connection_closed_unanswered_is_not_retried() -> None:
    def hang_up(conn: socket.socket, request: bytes) -> bool:
        return False

    with agents(hang_up) as (agent,):
        connection = AgentConnection(agent.endpoint, token="t", timeout=5)
        with pytest.raises(AgentUnreachable, match="RemoteDisconnected"):
            connection.call("PUT", "/v1/policy", body={"generation": 2})
    assert len(agent.requests) == 1  # a push is not sent twice on a fresh connection


def test_an_answer_that_closes_the_connection_is_not_kept() -> None:
    def close_after(conn: socket.socket, request: bytes) -> bool:
        answer(conn, 200, {"applied_generation": 3}, close=True)
        return False

    with agents(close_after) as (agent,):
        connection = AgentConnection(agent.endpoint, token="t", timeout=5)
        assert connection.call("PUT", "/v1/policy", body={}).json() == {"applied_generation": 3}
        assert not connection.open


def test_an_agent_that_drips_its_answer_times_out_as_a_silent_one_would() -> None:
    stop = threading.Event()

    def drip(conn: socket.socket, request: bytes) -> bool:
        # A header line that never ends, a byte at a time, each well within the timeout.
        conn.sendall(b"HTTP/1.1 200 OK\r\nX-Slow: ")
        while not stop.wait(0.1):
            conn.sendall(b"a")
        return False

    try:
        with agents(drip, echo) as fleet:
            calls = [
                Call(AgentConnection(a.endpoint, token="t", timeout=1.0), "PUT", "/v1/policy") for a in fleet
            ]
            dripped, answered = exchange(calls)
    finally:
        stop.set()
    assert isinstance(answered, Answer)
    assert isinstance(dripped, AgentUnreachable)
    assert "TimeoutError" in str(dripped)


def test_the_pusher_greets_each_agent_once_and_holds_its_connection_until_the_node_leaves(
    tmp_path: Path,
) -> None:
    """The pusher's connections (domain/checkpoints/pushes.py, ``hold``): one greeting per agent,
    ``GET /health`` with the node's control-plane token, whose connection the node's pushes then
    use; closed when the node leaves, and all of a cluster's when the cluster is gone. An agent
    that cannot be greeted is tried again only after a backoff, not at every pass."""

    def hang_up(conn: socket.socket, request: bytes) -> bool:
        return False  # closed unanswered, as a cut-off node's agent does

    db = Database(f"sqlite:///{tmp_path / 'pushes.db'}")
    pusher = make_reconciler(
        db, ManualClock(), Ids(), FakeProvisioner(), push_timeout_s=5, push_workers=4
    ).pusher
    try:
        with agents(echo, echo, hang_up) as (first, second, cut_off):
            nodes = {(first.endpoint, "cp-1"), (second.endpoint, "cp-2"), (cut_off.endpoint, "cp-3")}
            nodes.add(("http://127.0.0.1:99999", "cp-4"))  # an endpoint it cannot even parse
            pusher.hold("c", nodes)
            pusher.hold("c", nodes)  # a later pass: nothing greeted twice, the cut-off one waits
            assert len(cut_off.requests) == 1
            for agent, token in ((first, "cp-1"), (second, "cp-2")):
                assert (agent.connections, len(agent.requests)) == (1, 1)
                request = agent.requests[0].decode()
                assert request.startswith("GET /health HTTP/1.1\r\n")
                assert f"Authorization: Bearer {token}\r\n" in request

            # A push to the first node goes over its greeting's connection.
            connection = pusher.connections.take(first.endpoint, "cp-1")
            assert connection.call("PUT", "/v1/policy", body={"generation": 2}).status == 200
            pusher.connections.give_back(first.endpoint, connection)
            assert (first.connections, len(first.requests)) == (1, 2)

            pusher.hold("c", {(first.endpoint, "cp-1")})  # the second node left
            wait_for(lambda: second.open_now == 0, timeout=10, what="the second node's connection closed")
            assert first.open_now == 1
            pusher.retain([])  # the cluster is gone
            wait_for(lambda: first.open_now == 0, timeout=10, what="the first node's connection closed")
    finally:
        pusher.close()
