"""Input limits of the control plane (findings 8 and 9 of issue 12, control-plane side): what used to
answer 500, or read 50 MB whole, or echo megabytes back, now answers a 4xx in the AWS shape, and the
service keeps answering. Every attack is raw HTTP, as an attacker would send it."""

from __future__ import annotations

import base64
import http.client
import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from hyperpod_sim.api.app import create_app
from hyperpod_sim.api.gate import json_depth
from hyperpod_sim.api.shapes import render
from tests.conftest import ControlPlane, ServerThread, free_port, group, make_settings

pytestmark = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)

LIMIT = 1024 * 1024  # the default HPSIM_LIMITS__MAX_BODY_BYTES
AMZ = {"Content-Type": "application/x-amz-json-1.1"}
INVALID_TOKEN = "Invalid NextToken: pass the NextToken of the previous page of the same request."
TOO_DEEP = {
    "__type": "SerializationException",
    "message": "The request body nests JSON deeper than 32 levels.",
}


def aws_json(url: str, operation: str, body: bytes) -> httpx.Response:
    return httpx.post(
        url + "/", content=body, headers={**AMZ, "X-Amz-Target": f"SageMaker.{operation}"}, timeout=60
    )


def still_serves(control_plane: ControlPlane, sm: Any) -> None:
    assert httpx.get(control_plane.url + "/health").json() == {"status": "ok", "database": "answers"}
    sm.create_cluster(ClusterName="after", InstanceGroups=[group()])
    assert [c["ClusterName"] for c in sm.list_clusters()["ClusterSummaries"]] == ["after"]


def connect(url: str) -> socket.socket:
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=30)
    return sock


def response_of(sock: socket.socket) -> tuple[int, dict[str, Any]]:
    answer = http.client.HTTPResponse(sock)
    answer.begin()
    status, body = answer.status, json.loads(answer.read())
    sock.close()
    return status, body


# ---------------------------------------------------------------------- the body limit


@pytest.mark.parametrize(("path", "target"), [("/", "CreateCluster"), ("/clusters", None)])
def test_a_50_mb_body_is_refused_before_it_is_read(
    control_plane: ControlPlane, sm: Any, path: str, target: str | None
) -> None:
    sock = connect(control_plane.url)
    head = f"POST {path} HTTP/1.1\r\nHost: cp\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {50 * 2**20}\r\n"
    if target:
        head += f"X-Amz-Target: SageMaker.{target}\r\n"
    # Only the head and the first 64 KiB go out: the answer comes without the other 49.9 MB.
    sock.sendall(head.encode() + b"\r\n" + b'{"ClusterName": "' + b"a" * 65536)
    assert response_of(sock) == (
        413,
        {
            "__type": "SerializationException",
            "message": f"The request body is {50 * 2**20} bytes, over the limit of {LIMIT} bytes "
            "(HPSIM_LIMITS__MAX_BODY_BYTES).",
        },
    )
    still_serves(control_plane, sm)


def test_a_chunked_body_is_cut_off_at_the_limit(control_plane: ControlPlane, sm: Any) -> None:
    sock = connect(control_plane.url)
    sock.sendall(
        b"POST / HTTP/1.1\r\nHost: cp\r\nX-Amz-Target: SageMaker.CreateCluster\r\n"
        b"Content-Type: application/x-amz-json-1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    # No Content-Length to refuse by: the server reads up to the limit and answers. The body is
    # never finished (no last chunk), so an answer at all shows it did not wait for the rest.
    chunk = b"%x\r\n%s\r\n" % (65536, b" " * 65536)
    sock.sendall(chunk * (LIMIT // 65536 + 1))
    assert response_of(sock) == (
        413,
        {
            "__type": "SerializationException",
            "message": f"The request body is over the limit of {LIMIT} bytes (HPSIM_LIMITS__MAX_BODY_BYTES).",
        },
    )
    still_serves(control_plane, sm)


def test_a_content_length_of_5000_digits_is_a_4xx(control_plane: ControlPlane, sm: Any) -> None:
    sock = connect(control_plane.url)
    sock.sendall(
        b"POST / HTTP/1.1\r\nHost: cp\r\nX-Amz-Target: SageMaker.ListClusters\r\nContent-Length: "
        + b"9" * 5000
        + b"\r\n\r\n{}"
    )
    answer = http.client.HTTPResponse(sock)
    answer.begin()
    assert 400 <= answer.status < 500
    sock.close()
    still_serves(control_plane, sm)


# ---------------------------------------------------------------------- JSON nesting


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize("depth", [33, 1000, 100_000])
def test_deep_json_on_the_aws_entry_is_a_serialization_error(
    control_plane: ControlPlane, sm: Any, depth: int
) -> None:
    body = b'{"ClusterName": "a", "Tags": ' + nested(depth) + b"}"
    response = aws_json(control_plane.url, "CreateCluster", body)
    assert (response.status_code, response.json()) == (400, TOO_DEEP)
    assert response.headers["x-amzn-errortype"] == "SerializationException"
    still_serves(control_plane, sm)


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/clusters"),
        ("PATCH", "/clusters/c"),
        ("POST", "/tags"),
        ("PUT", "/clusters/c/checkpoint-policy"),
        ("POST", "/clusters/c/faults"),
        ("POST", "/faults"),
        ("POST", "/clusters/c/nodes/batch-delete"),
    ],
)
def test_deep_json_on_every_rest_body_is_a_serialization_error(
    control_plane: ControlPlane, sm: Any, method: str, path: str
) -> None:
    response = httpx.request(method, control_plane.url + path, content=b'{"a": ' + nested(2000) + b"}")
    assert (response.status_code, response.json()) == (400, TOO_DEEP)
    still_serves(control_plane, sm)


def test_deep_json_to_the_agent_routes_answers_in_the_agent_protocol(
    control_plane: ControlPlane, sm: Any
) -> None:
    response = httpx.post(
        control_plane.url + "/agent/v1/clusters/c/register", content=b'{"endpoint": ' + nested(2000) + b"}"
    )
    assert (response.status_code, response.json()) == (
        400,
        {"error": "InvalidRequest", "message": "The request body nests JSON deeper than 32 levels."},
    )
    still_serves(control_plane, sm)


def test_brackets_inside_strings_do_not_count(raw_sm: Any) -> None:
    assert json_depth(b'{"a": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[\\"[[[[["}') == 1
    assert json_depth(b"[[[]], {}]") == 3
    assert json_depth(b'"[[[["') == 0
    with pytest.raises(raw_sm.exceptions.ClientError) as caught:
        raw_sm.create_cluster(ClusterName="[" * 60, InstanceGroups=[group()])
    assert caught.value.response["Error"]["Code"] == "ValidationException"


@pytest.mark.parametrize(
    ("number", "message"),
    [
        (b"1e400", "The number 1e400 is out of range."),
        (b"-1e400", "The number -1e400 is out of range."),
        (b"NaN", "NaN is not a JSON value."),
        (b"Infinity", "Infinity is not a JSON value."),
        (b"1" * 5000, "The request body is not valid JSON."),
    ],
)
def test_numbers_json_cannot_hold_are_serialization_errors(
    control_plane: ControlPlane, sm: Any, number: bytes, message: str
) -> None:
    response = aws_json(control_plane.url, "ListClusters", b'{"MaxResults": ' + number + b"}")
    assert (response.status_code, response.json()) == (
        400,
        {"__type": "SerializationException", "message": message},
    )
    still_serves(control_plane, sm)


# ---------------------------------------------------------------------- NextToken


def token(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode()


FORGED_TOKENS = [
    token(b'{"o": 1e400, "s": "clusters"}'),
    token(b'{"o": 100000000000000000000000000000, "s": "clusters"}'),
    token(b'{"o": true, "s": "clusters"}'),
    token(b'{"o": -1, "s": "clusters"}'),
    token(nested(3000)),
    token(b'"just a string"'),
    token(b"[1, 2]"),
    token(b"\xff\xfe"),
    "!!!not base64!!!",
]


@pytest.mark.parametrize("forged", FORGED_TOKENS)
def test_a_forged_next_token_is_a_validation_error(control_plane: ControlPlane, sm: Any, forged: str) -> None:
    response = aws_json(control_plane.url, "ListClusters", json.dumps({"NextToken": forged}).encode())
    assert (response.status_code, response.json()) == (
        400,
        {"__type": "ValidationException", "message": INVALID_TOKEN},
    )
    response = httpx.get(control_plane.url + "/clusters", params={"NextToken": forged})
    assert (response.status_code, response.json()) == (
        400,
        {"__type": "ValidationException", "message": INVALID_TOKEN},
    )
    still_serves(control_plane, sm)


# ---------------------------------------------------------------------- REST query integers


@pytest.mark.parametrize(
    ("query", "value"),
    [
        ("MaxResults=%C2%B2", "\u00b2"),  # superscript two: str.isdigit() says yes
        ("MaxResults=--5", "--5"),
        ("MaxResults=" + "5" * 5000, "5" * 5000),
        ("MaxResults=%D9%A3", "\u0663"),  # Arabic-Indic three
        ("MaxResults=%2B5", "+5"),
        ("MaxResults=1_0", "1_0"),
        ("MaxResults=%205", " 5"),
        ("MaxResults=1234567890123456789", "1234567890123456789"),
    ],
)
def test_a_query_integer_that_is_not_plain_digits_is_a_validation_error(
    control_plane: ControlPlane, sm: Any, query: str, value: str
) -> None:
    response = httpx.get(f"{control_plane.url}/clusters?{query}")
    assert (response.status_code, response.json()) == (
        400,
        {
            "__type": "ValidationException",
            "message": f"1 validation error detected: Value '{render(value)}' at 'maxResults' failed to "
            "satisfy constraint: Member must be an integer (ASCII digits, at most 18)",
        },
    )
    assert len(response.text) < 400  # 5,000 digits are not echoed back
    still_serves(control_plane, sm)


# ---------------------------------------------------------------------- huge values


@pytest.fixture
def roomy(database_url: str, tmp_path: Path) -> Iterator[str]:
    """A control plane whose body limit lets a 20 MB member through to validation."""
    settings = make_settings(
        database_url,
        tmp_path / "roomy",
        provisioning={"mode": "simulated"},
        limits={"max_body_bytes": 64 * 2**20},
    )
    port = free_port()
    with ServerThread(create_app(settings), port):
        yield f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("megabytes", [20, 50])
def test_a_huge_cluster_name_is_refused_without_matching_it(roomy: str, megabytes: int) -> None:
    name = "a" * (megabytes * 2**20)
    expected = {
        "__type": "ValidationException",
        "message": f"1 validation error detected: Value '{'a' * 197}...' at 'clusterName' failed to satisfy "
        "constraint: Member must have length less than or equal to 63",
    }
    body = json.dumps({"ClusterName": name, "InstanceGroups": [group()]}).encode()
    response = aws_json(roomy, "CreateCluster", body)
    assert (response.status_code, response.json()) == (400, expected)
    response = httpx.post(roomy + "/clusters", content=body, timeout=60)
    assert (response.status_code, response.json()) == (400, expected)
    response = httpx.get(roomy + "/clusters")
    assert (response.status_code, response.json()) == (200, {"ClusterSummaries": []})


def test_an_echoed_value_is_cut_with_an_ellipsis(raw_sm: Any) -> None:
    name = "b" * 5000
    with pytest.raises(raw_sm.exceptions.ClientError) as caught:
        raw_sm.describe_cluster(ClusterName=name)
    assert caught.value.response["Error"] == {
        "Code": "ValidationException",
        "Message": f"1 validation error detected: Value '{'b' * 197}...' at 'clusterName' failed to satisfy "
        "constraint: Member must have length less than or equal to 256",
    }


@pytest.mark.parametrize(
    ("method", "path", "member", "where", "constraint"),
    [
        (
            "PUT",
            "/clusters/c/checkpoint-policy",
            "AgentAccess",
            "agentAccess",
            "Member must satisfy enum value set: [Open, Token]",
        ),
        (
            "PUT",
            "/clusters/c/checkpoint-policy",
            "S3BaseUri",
            "s3BaseUri",
            "Member must have length less than or equal to 1024",
        ),
        (
            "POST",
            "/clusters/c/faults",
            "Type",
            "type",
            "Member must satisfy enum value set: "
            "[AgentCrash, NodeLoss, AgentHang, NetworkPartition, S3Latency, S3Errors, S3Outage, "
            "DeepHealthCheckFailure]",
        ),
    ],
)
def test_the_extensions_echo_values_cut_too(
    control_plane: ControlPlane, sm: Any, method: str, path: str, member: str, where: str, constraint: str
) -> None:
    sm.create_cluster(ClusterName="c", InstanceGroups=[group()])
    control_plane.settle(sm, "c")
    body: dict[str, Any] = {member: "z" * 500_000}
    if path == "/faults":
        body["Type"] = "DatabaseOutage"
    if member == "S3BaseUri":
        body["PersistEverySteps"] = 10
    response = httpx.request(method, control_plane.url + path, json=body)
    assert response.status_code == 400
    assert response.json() == {
        "__type": "ValidationException",
        "message": f"1 validation error detected: Value '{'z' * 197}...' at '{where}' failed to satisfy "
        f"constraint: {constraint}",
    }


@pytest.mark.parametrize(
    ("body", "headers", "status", "error"),
    [
        # Well-formed: answered by serve's heartbeat entry (agent_routes.HeartbeatEntry).
        (b'{"applied_generation": 1}', {}, 401, "MissingToken"),
        (b'{"applied_generation": 1}', {"Authorization": "Bearer forged"}, 404, "NodeNotFound"),
        # Anything else goes on to the route, which answers as it always has.
        (b'{"applied_generation": -1}', {}, 400, "InvalidRequest"),
        (b'{"applied_generation": "one"}', {}, 400, "InvalidRequest"),
        (b'{"applied_generation": 1', {}, 400, "InvalidRequest"),
        (b"", {}, 400, "InvalidRequest"),
        (b"[]", {}, 400, "InvalidRequest"),
        (b'{"applied_generation": 1}', {"Content-Type": "text/plain"}, 400, "InvalidRequest"),
    ],
)
def test_a_heartbeat_is_answered_in_the_agent_protocol_whatever_its_body(
    control_plane: ControlPlane,
    sm: Any,
    body: bytes,
    headers: dict[str, str],
    status: int,
    error: str,
) -> None:
    response = httpx.post(
        control_plane.url + "/agent/v1/clusters/nowhere/nodes/i-0123456789abcdef0/heartbeat",
        content=body,
        headers={"Content-Type": "application/json", **headers},
    )
    assert (response.status_code, response.json()["error"]) == (status, error), response.text
    still_serves(control_plane, sm)
