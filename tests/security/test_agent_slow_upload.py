"""Finding 7 of issue 12: the memory budget held hostage.

Uploads that announce a large Content-Length and then send a byte now and then kept their
reservation for as long as they liked (the read timeout counts only silence). A body now has an
overall deadline, base + length / minimum rate (``HPSIM_AGENT_UPLOAD_DEADLINE_BASE_S``,
``HPSIM_AGENT_UPLOAD_MIN_RATE_BYTES_PER_S``); after it the agent answers 408, closes the
connection and gives the reservation back, and real saves get the memory.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.conftest import ControlPlane, wait_for
from tests.tier import cluster, create_namespace, get, meta, metric, put, url

pytestmark = [
    pytest.mark.parametrize("database_url", ["sqlite"], indirect=True),
    pytest.mark.patient_heartbeats,
]


@pytest.fixture
def sm(agent_plane: ControlPlane) -> Any:
    return agent_plane.client()


def test_a_slow_upload_is_cut_at_its_deadline_and_its_memory_given_back(
    agent_plane: ControlPlane, sm: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The agents inherit these from the control plane's environment when they are launched:
    # a 180,000-byte body has 1 s + 180,000 / 1 MiB/s = about 1.2 s to arrive.
    monkeypatch.setenv("HPSIM_AGENT_UPLOAD_DEADLINE_BASE_S", "1")
    monkeypatch.setenv("HPSIM_AGENT_UPLOAD_MIN_RATE_BYTES_PER_S", str(1 << 20))
    # ml.t3.medium: a budget of 838,860 bytes.
    (a,) = (url(n) for n in cluster(sm, agent_plane, "hostage", 1, instance_type="ml.t3.medium"))
    assert create_namespace(a, "job", 1).status_code == 201
    good = os.urandom(100_000)
    assert put(a, "job", 0, 1, good).status_code == 200

    # What the shards hold: spares made for the next saves count in the budget too, and the
    # uploads below take them over (or drop them for room).
    def shards_held() -> float:
        return metric(a, "hpsim_tier_bytes_held") - metric(a, "hpsim_tier_spare_bytes")

    held = shards_held()

    # Four uploads announcing 180,000 bytes each (720,000 of the 838,860), a byte every 0.2 s.
    address = urlsplit(a)
    sockets = []
    for step in range(10, 14):
        sock = socket.create_connection((address.hostname, address.port), timeout=30)
        sock.sendall(
            f"POST /v1/cp/checkpoints/job/0/{step} HTTP/1.1\r\nHost: a\r\nContent-Length: 180000\r\n"
            f"Shard-Meta: {meta(b'x' * 180000)}\r\n\r\n".encode()
        )
        sock.setblocking(False)
        sockets.append(sock)
    answers = {sock: b"" for sock in sockets}
    closed: set[socket.socket] = set()
    give_up = time.monotonic() + 120  # far beyond any deadline: the test's own bound
    while len(closed) < len(sockets) and time.monotonic() < give_up:
        for sock in sockets:
            if sock in closed:
                continue
            try:
                chunk = sock.recv(65536)
            except BlockingIOError:
                chunk = None
            except ConnectionError:
                chunk = b""
            if chunk == b"":
                closed.add(sock)
                continue
            if chunk:
                answers[sock] += chunk
            with contextlib.suppress(BlockingIOError, ConnectionError):
                sock.send(b"x")
        time.sleep(0.2)
    for sock in sockets:
        sock.close()
    assert len(closed) == len(sockets), "the slow uploads were never cut"
    for answer in answers.values():
        assert answer.startswith(b"HTTP/1.1 408 "), answer[:300]
        assert b"did not arrive within its deadline" in answer

    # Their reservations were given back: a real save that needs most of the budget succeeds.
    wait_for(lambda: shards_held() == held, timeout=30, what="the memory given back")
    big = os.urandom(700_000)
    assert put(a, "job", 0, 2, big).status_code == 200
    assert get(a, "job", 0, 2).content == big
    assert get(a, "job", 0, 1).content == good
    for step in range(10, 14):
        assert get(a, "job", 0, step).status_code == 404
