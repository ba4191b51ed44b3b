"""Findings 8 and 9 of issue 12, on the agents: 500s and dropped connections instead of 4xx, and
integers accepted under several spellings.

Every integer on an agent's wire (rank, step, size, limit, rank count, Content-Length) has one
spelling: ASCII digits, no sign, no ``_``, no whitespace, no leading zero, within int64. Names
that become file names fit in one (255 bytes encoded). A bad one is a 400 with a JSON error,
never a 500, a dropped connection or "Task exception was never retrieved" in the agent's log.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import httpx
import pytest

from tests.conftest import ControlPlane
from tests.tier import cluster, create_namespace, get, latest, meta, put, url

pytestmark = [
    pytest.mark.parametrize("database_url", ["sqlite"], indirect=True),
    pytest.mark.patient_heartbeats,
]

# Other spellings of 1 (or of 3, 7, 1000), and numbers no int64 holds.
BAD_INTEGERS = ["+1", " 1", "1 ", "1_000", "٣", "007", "-1", "1e3", "0x1", "", "9223372036854775808"]
HUGE = "1" + "0" * 240  # a step near 10^240


@pytest.fixture
def sm(agent_plane: ControlPlane) -> Any:
    return agent_plane.client()


def raw(agent: str, head: str) -> bytes:
    """Send a request head as written and read the answer until the agent closes."""
    address = urlsplit(agent)
    with socket.create_connection((address.hostname, address.port), timeout=30) as sock:
        sock.sendall(head.encode())  # UTF-8: "٣" goes as the bytes a client would send
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        return answer


def test_bad_integers_names_and_lengths_get_400(agent_plane: ControlPlane, sm: Any, tmp_path: Path) -> None:
    (a,) = (url(n) for n in cluster(sm, agent_plane, "strict", 1))
    assert create_namespace(a, "job", 1).status_code == 201
    good = os.urandom(100_000)
    assert put(a, "job", 0, 1, good).status_code == 200

    problems: list[str] = []

    def expect_400(response: httpx.Response, what: str) -> None:
        if response.status_code != 400 or "error" not in response.json():
            problems.append(f"{what}: {response.status_code} {response.text[:200]}")

    for bad in [*BAD_INTEGERS, HUGE]:
        spelled = quote(bad, safe="")
        for method in ("GET", "POST", "DELETE"):
            for rank, step in ((spelled, "1"), ("0", spelled)):
                if not bad and method == "POST":
                    continue  # an empty segment is another route
                kwargs: dict[str, Any] = (
                    {"content": good, "headers": {"Shard-Meta": meta(good)}} if method == "POST" else {}
                )
                response = httpx.request(method, f"{a}/v1/cp/checkpoints/job/{rank}/{step}", **kwargs)
                if bad:
                    expect_400(response, f"{method} rank {rank!r} step {step!r}")
        params = {"limit": bad}
        expect_400(httpx.get(f"{a}/v1/cp/checkpoints/job/latest", params=params), f"limit {bad!r}")
        expect_400(httpx.post(f"{a}/v1/fast/reserve/job/0/2", params={"size": bad}), f"size {bad!r}")
        expect_400(create_namespace_raw(a, "other", bad), f"num_ranks {bad!r}")

    # Names that map to directory names: at most 255 bytes once encoded.
    for name in ("n" * 256, "é" * 50, "." * 100):
        where = quote(name, safe="")
        expect_400(httpx.get(f"{a}/v1/cp/namespaces/{where}"), f"namespace of {len(name)}")
        expect_400(create_namespace_raw(a, name, "1"), f"create namespace of {len(name)}")
        expect_400(put(a, where, 0, 1, b"x"), f"save into namespace of {len(name)}")
        expect_400(httpx.get(f"{a}/v1/cp/checkpoints/{where}/latest"), f"latest of {len(name)}")
    # A Shard-Meta nested 5,000 deep.
    deep = "[" * 5000 + "]" * 5000
    expect_400(put(a, "job", 0, 2, b"x", **{"Shard-Meta": deep}), "deep Shard-Meta")
    assert problems == []

    # Content-Length in another spelling, or 5,000 digits long: a 400 answer, not a dropped connection.
    for length in ("9" * 5000, "+5", "1_0", "0x10", "5, 6", "٣"):
        head = f"POST /v1/cp/checkpoints/job/0/3 HTTP/1.1\r\nHost: a\r\nContent-Length: {length}\r\n\r\n"
        answer = raw(a, head)
        assert answer.startswith(b"HTTP/1.1 400 "), (length[:20], answer[:200])
        assert b"malformed Content-Length" in answer

    # The agent is up, holds what it held, and logged no dropped task or handler failure.
    assert httpx.get(f"{a}/health").json()["status"] == "ok"
    assert latest(a, "job") == [1]
    assert get(a, "job", 0, 1).content == good
    (log,) = tmp_path.rglob("agent.log")
    text = log.read_text(errors="replace")
    assert "Task exception was never retrieved" not in text
    assert "handler failed" not in text
    assert "Traceback" not in text


def create_namespace_raw(agent: str, name: str, num_ranks: str) -> httpx.Response:
    return httpx.post(f"{agent}/v1/cp/namespaces/{quote(name, safe='')}", params={"num_ranks": num_ranks})
