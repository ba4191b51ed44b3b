"""The control plane with credentials configured (finding 4 of issue 12, and the bootstrap token of
finding 3): every caller is checked, the way AWS checks it, and answered in AWS's words.

Attacks are made as an attacker would: boto3 and the AWS CLI with a wrong secret or an unknown key,
requests signed by hand for 1970, unsigned and tampered requests over raw HTTP.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import boto3
import botocore.auth
import httpx
import pytest
from botocore import UNSIGNED
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.config import Config
from botocore.credentials import Credentials
from botocore.exceptions import ClientError

from hyperpod_sim.sdk.auth import AccessKey, bearer_token
from hyperpod_sim.sdk.auth import SigV4Auth as SdkSigV4Auth
from hyperpod_sim.sdk.client import ClusterError, HyperPodClient
from tests.conftest import ControlPlane, group
from tests.helpers import aws_cli

pytestmark = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)

ROOT = Path(__file__).resolve().parent.parent.parent
USER, USER_SECRET = "AKIDUSEREXAMPLE", "user-secret-0123456789"
ADMIN, ADMIN_SECRET = "AKIDADMINEXAMPLE", "admin-secret-0123456789"

INVALID_TOKEN = "The security token included in the request is invalid."
BAD_SIGNATURE = (
    "The request signature we calculated does not match the signature you provided. Check your AWS "
    "Secret Access Key and signing method. Consult the service documentation for details."
)
MISSING = "The request must contain either a valid (registered) AWS access key ID or X.509 certificate."


@pytest.fixture
def settings_overrides() -> dict[str, Any]:
    return {"auth": {"credentials": {USER: USER_SECRET}, "admin_credentials": {ADMIN: ADMIN_SECRET}}}


def client(control_plane: ControlPlane, key: str, secret: str, **config: Any) -> Any:
    return boto3.client(
        "sagemaker",
        endpoint_url=control_plane.url,
        region_name="us-east-1",
        aws_access_key_id=key,
        aws_secret_access_key=secret,
        config=Config(retries={"max_attempts": 1}, **config),
    )


def refusal(call: Any, **kwargs: Any) -> tuple[int, str, str]:
    with pytest.raises(ClientError) as caught:
        call(**kwargs)
    response = caught.value.response
    return (
        response["ResponseMetadata"]["HTTPStatusCode"],
        response["Error"]["Code"],
        response["Error"]["Message"],
    )


def signed_request(
    url: str,
    target: str,
    body: dict[str, Any],
    *,
    key: str = USER,
    secret: str = USER_SECRET,
    at: datetime | None = None,
    monkeypatch: pytest.MonkeyPatch | None = None,
) -> AWSRequest:
    """An AWS JSON request signed by botocore for ``at`` (default: now)."""
    request = AWSRequest(
        method="POST",
        url=url + "/",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/x-amz-json-1.1", "X-Amz-Target": f"SageMaker.{target}"},
    )
    if at is not None:
        assert monkeypatch is not None
        monkeypatch.setattr(botocore.auth, "get_current_datetime", lambda: at)
    SigV4Auth(Credentials(key, secret), "sagemaker", "us-east-1").add_auth(request)
    return request


def send(request: AWSRequest, *, body: bytes | None = None) -> httpx.Response:
    prepared = request.prepare()
    return httpx.request(
        prepared.method,
        prepared.url,
        headers={k: v for k, v in prepared.headers.items() if k.lower() != "content-length"},
        content=prepared.body if body is None else body,
        timeout=30,
    )


# ---------------------------------------------------------------------- AWS JSON: boto3


def test_boto3_with_a_configured_key_is_served(control_plane: ControlPlane) -> None:
    sm = client(control_plane, USER, USER_SECRET)
    arn = sm.create_cluster(ClusterName="signed", InstanceGroups=[group()])["ClusterArn"]
    assert sm.describe_cluster(ClusterName="signed")["ClusterArn"] == arn
    admin = client(control_plane, ADMIN, ADMIN_SECRET)
    assert [c["ClusterName"] for c in admin.list_clusters()["ClusterSummaries"]] == ["signed"]


def test_boto3_with_a_wrong_secret_is_refused(control_plane: ControlPlane) -> None:
    sm = client(control_plane, USER, "not-the-secret")
    assert refusal(sm.create_cluster, ClusterName="forged", InstanceGroups=[group()]) == (
        400,
        "InvalidSignatureException",
        BAD_SIGNATURE,
    )
    ok = client(control_plane, USER, USER_SECRET)
    assert ok.list_clusters()["ClusterSummaries"] == []  # nothing was created


def test_boto3_with_an_unknown_key_is_refused(control_plane: ControlPlane) -> None:
    # The README's quick-start key: fine with auth off, unknown here.
    sm = client(control_plane, "x", "x")
    assert refusal(sm.list_clusters) == (400, "UnrecognizedClientException", INVALID_TOKEN)


def test_unsigned_boto3_is_refused(control_plane: ControlPlane) -> None:
    sm = client(control_plane, USER, USER_SECRET, signature_version=UNSIGNED)
    assert refusal(sm.list_clusters) == (403, "MissingAuthenticationToken", MISSING)


def test_a_1970_signature_has_expired(control_plane: ControlPlane, monkeypatch: pytest.MonkeyPatch) -> None:
    request = signed_request(
        control_plane.url, "ListClusters", {}, at=datetime(1970, 1, 1, tzinfo=UTC), monkeypatch=monkeypatch
    )
    response = send(request)
    assert response.status_code == 400
    assert response.headers["x-amzn-errortype"] == "InvalidSignatureException"
    doc = response.json()
    assert doc["__type"] == "InvalidSignatureException"
    match = re.fullmatch(
        r"Signature expired: 19700101T000000Z is now earlier than "
        r"(\d{8}T\d{6}Z) \((\d{8}T\d{6}Z) - 5 min\.\)",
        doc["message"],
    )
    assert match is not None, doc["message"]
    earliest, now = (datetime.strptime(t, "%Y%m%dT%H%M%SZ") for t in match.groups())
    assert now - earliest == timedelta(minutes=5)


def test_a_signature_from_the_future_is_not_yet_current(
    control_plane: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    later = datetime.now(UTC) + timedelta(hours=1)
    response = send(signed_request(control_plane.url, "ListClusters", {}, at=later, monkeypatch=monkeypatch))
    assert response.status_code == 400
    doc = response.json()
    stamp = later.strftime("%Y%m%dT%H%M%SZ")
    assert re.fullmatch(
        rf"Signature not yet current: {stamp} is still later than "
        r"\d{8}T\d{6}Z \(\d{8}T\d{6}Z \+ 5 min\.\)",
        doc["message"],
    ), doc
    assert doc["__type"] == "InvalidSignatureException"


def test_a_tampered_body_breaks_the_signature(control_plane: ControlPlane) -> None:
    request = signed_request(
        control_plane.url, "CreateCluster", {"ClusterName": "mine", "InstanceGroups": [group()]}
    )
    forged = json.dumps({"ClusterName": "theirs", "InstanceGroups": [group()]}).encode()
    response = send(request, body=forged)
    assert (response.status_code, response.json()) == (
        400,
        {"__type": "InvalidSignatureException", "message": BAD_SIGNATURE},
    )
    # The same request untouched is served: the signature itself was good.
    assert send(request).status_code == 200


def test_a_payload_hash_that_does_not_match_the_body_is_refused(control_plane: ControlPlane) -> None:
    body = json.dumps({}).encode()
    request = AWSRequest(
        method="POST",
        url=control_plane.url + "/",
        data=body,
        headers={
            "Content-Type": "application/x-amz-json-1.1",
            "X-Amz-Target": "SageMaker.ListClusters",
            "X-Amz-Content-SHA256": hashlib.sha256(b"something else").hexdigest(),
        },
    )
    SigV4Auth(Credentials(USER, USER_SECRET), "sagemaker", "us-east-1").add_auth(request)
    response = send(request)
    assert (response.status_code, response.json()) == (
        400,
        {
            "__type": "InvalidSignatureException",
            "message": "The provided 'x-amz-content-sha256' header does not match what was computed.",
        },
    )


class _SignsOnly(SigV4Auth):
    """botocore's signer, signing only ``names`` (and the date it adds): a lax client's signature."""

    def __init__(self, names: tuple[str, ...]) -> None:
        super().__init__(Credentials(USER, USER_SECRET), "sagemaker", "us-east-1")
        self.names = names

    def headers_to_sign(self, request: AWSRequest) -> Any:
        chosen = super().headers_to_sign(request)
        for name in list(chosen.keys()):
            if name.lower() not in (*self.names, "x-amz-date"):
                del chosen[name]
        return chosen


def lax_request(url: str, target: str, body: dict[str, Any], *, signs: tuple[str, ...]) -> AWSRequest:
    request = AWSRequest(
        method="POST",
        url=url + "/",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/x-amz-json-1.1", "X-Amz-Target": f"SageMaker.{target}"},
    )
    _SignsOnly(signs).add_auth(request)
    return request


def test_a_captured_request_resent_with_another_target_is_refused(control_plane: ControlPlane) -> None:
    """Issue 23 (c): a DescribeCluster whose signature left X-Amz-Target out, captured and resent
    at once with the target of DeleteCluster, deleted the cluster."""
    sm = client(control_plane, USER, USER_SECRET)
    sm.create_cluster(ClusterName="kept", InstanceGroups=[group()])
    control_plane.settle(sm, "kept")
    captured = lax_request(control_plane.url, "DescribeCluster", {"ClusterName": "kept"}, signs=("host",))
    captured.headers.replace_header("X-Amz-Target", "SageMaker.DeleteCluster")
    response = send(captured)
    assert (response.status_code, response.json()) == (
        400,
        {
            "__type": "IncompleteSignature",
            "message": "'Content-Type' must be a 'SignedHeader' in the AWS Authorization. "
            "'X-Amz-Target' must be a 'SignedHeader' in the AWS Authorization.",
        },
    )
    assert sm.describe_cluster(ClusterName="kept")["ClusterStatus"] == "InService"


@pytest.mark.parametrize(
    ("signs", "unsigned"),
    [(("host", "x-amz-target"), "Content-Type"), (("host", "content-type"), "X-Amz-Target")],
)
def test_a_call_that_does_not_sign_its_target_and_content_type_is_refused(
    control_plane: ControlPlane, signs: tuple[str, ...], unsigned: str
) -> None:
    client(control_plane, USER, USER_SECRET).create_cluster(ClusterName="seen", InstanceGroups=[group()])
    request = lax_request(control_plane.url, "DescribeCluster", {"ClusterName": "seen"}, signs=signs)
    assert f"SignedHeaders={';'.join(sorted((*signs, 'x-amz-date')))}," in request.headers["Authorization"]
    response = send(request)
    assert (response.status_code, response.json()) == (
        400,
        {
            "__type": "IncompleteSignature",
            "message": f"'{unsigned}' must be a 'SignedHeader' in the AWS Authorization.",
        },
    )
    # Signed whole, the same call is served.
    everything = lax_request(
        control_plane.url,
        "DescribeCluster",
        {"ClusterName": "seen"},
        signs=("host", "content-type", "x-amz-target"),
    )
    assert send(everything).status_code == 200


@pytest.mark.parametrize(
    ("authorization", "message"),
    [
        (
            f"AWS4-HMAC-SHA256 Credential={USER}/20261201/us-east-1/sagemaker/aws4_request",
            "Authorization header requires 'Signature' parameter. Authorization header requires "
            f"'SignedHeaders' parameter. Authorization=AWS4-HMAC-SHA256 Credential={USER}/20261201/"
            "us-east-1/sagemaker/aws4_request",
        ),
        (
            f"AWS4-HMAC-SHA256 Credential={USER}/us-east-1, SignedHeaders=host;x-amz-date, Signature=00",
            "Credential must have exactly 5 slash-delimited elements, e.g. keyid/date/region/service/term, "
            f"got '{USER}/us-east-1'",
        ),
        (
            "Basic dXNlcjpwYXNz",
            "Unsupported Authorization type 'Basic': sign the request with SigV4 (AWS4-HMAC-SHA256) "
            "or send a bearer token (Authorization: Bearer ...).",
        ),
    ],
)
def test_a_malformed_authorization_is_an_incomplete_signature(
    control_plane: ControlPlane, authorization: str, message: str
) -> None:
    response = httpx.post(
        control_plane.url + "/",
        content=b"{}",
        headers={
            "Content-Type": "application/x-amz-json-1.1",
            "X-Amz-Target": "SageMaker.ListClusters",
            "X-Amz-Date": datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ"),
            "Authorization": authorization,
        },
    )
    assert (response.status_code, response.json()) == (
        400,
        {"__type": "IncompleteSignature", "message": message},
    )


# ---------------------------------------------------------------------- AWS JSON: the AWS CLI


def aws(
    control_plane: ControlPlane, tmp_path: Path, key: str, secret: str, *args: str
) -> subprocess.CompletedProcess[str]:
    return aws_cli(control_plane.url, tmp_path, *args, key=key, secret=secret, max_attempts=1)


def test_the_aws_cli_signs_with_the_configured_key(control_plane: ControlPlane, tmp_path: Path) -> None:
    client(control_plane, USER, USER_SECRET).create_cluster(ClusterName="cli", InstanceGroups=[group()])
    result = aws(control_plane, tmp_path, USER, USER_SECRET, "list-clusters")
    assert result.returncode == 0, result.stderr
    assert [c["ClusterName"] for c in json.loads(result.stdout)["ClusterSummaries"]] == ["cli"]


@pytest.mark.parametrize(
    ("key", "secret", "code", "message"),
    [
        (USER, "wrong-secret", "InvalidSignatureException", BAD_SIGNATURE),
        ("AKIDNOBODY", "whatever", "UnrecognizedClientException", INVALID_TOKEN),
    ],
)
def test_the_aws_cli_with_wrong_credentials_gets_the_aws_error(
    control_plane: ControlPlane, tmp_path: Path, key: str, secret: str, code: str, message: str
) -> None:
    result = aws(control_plane, tmp_path, key, secret, "list-clusters")
    assert result.returncode != 0
    assert result.stdout == ""
    assert (
        result.stderr.strip()
        == f"An error occurred ({code}) when calling the ListClusters operation: {message}"
    )


# ---------------------------------------------------------------------- REST and the extensions


def test_rest_without_credentials_is_401_in_the_aws_shape(control_plane: ControlPlane) -> None:
    client(control_plane, USER, USER_SECRET).create_cluster(ClusterName="c", InstanceGroups=[group()])
    for method, path in [
        ("GET", "/clusters"),
        ("GET", "/clusters/c"),
        ("GET", "/clusters/c/nodes"),
        ("GET", "/clusters/c/checkpoint-policy"),
        ("PUT", "/clusters/c/checkpoint-policy"),
        ("GET", "/clusters/c/checkpoints"),
        ("GET", "/clusters/c/faults"),
        ("POST", "/faults"),
        ("DELETE", "/clusters/c"),
        ("GET", "/no/such/route"),  # not even which routes exist
    ]:
        response = httpx.request(
            method, control_plane.url + path, json={} if method in ("PUT", "POST") else None
        )
        assert response.status_code == 401, (method, path)
        assert response.json() == {"__type": "MissingAuthenticationToken", "message": MISSING}
        assert response.headers["www-authenticate"].startswith("Bearer")
    assert (
        client(control_plane, USER, USER_SECRET).describe_cluster(ClusterName="c")["ClusterStatus"]
        == "Creating"
    )


def test_rest_with_a_bearer_token_or_sigv4_is_served(control_plane: ControlPlane) -> None:
    client(control_plane, USER, USER_SECRET).create_cluster(ClusterName="c", InstanceGroups=[group()])
    token = bearer_token(USER, USER_SECRET)
    response = httpx.get(control_plane.url + "/clusters/c", headers={"Authorization": f"Bearer {token}"})
    assert response.status_code == 200
    assert response.json()["ClusterName"] == "c"
    with HyperPodClient(control_plane.url, access_key_id=USER, secret_access_key=USER_SECRET) as sdk:
        assert sdk.get_checkpoint_policy("c")["ClusterName"] == "c"  # REST, signed with SigV4
        assert len(sdk.list_nodes("c")) == 2
        assert sdk.describe_cluster("c")["ClusterName"] == "c"  # boto3, signed with SigV4
    with HyperPodClient(
        control_plane.url, access_key_id=USER, secret_access_key=USER_SECRET, bearer_token=token
    ) as sdk:
        assert sdk.list_faults("c") == []


def test_the_sdks_signer_signs_an_aws_json_calls_target(control_plane: ControlPlane) -> None:
    """The SDK's httpx signer is what scripts use beside boto3: an AWS JSON call it signs names
    the target and the content type among its signed headers, as the control plane requires."""
    client(control_plane, USER, USER_SECRET).create_cluster(ClusterName="c", InstanceGroups=[group()])
    response = httpx.post(
        control_plane.url + "/",
        content=json.dumps({"ClusterName": "c"}).encode(),
        headers={"Content-Type": "application/x-amz-json-1.1", "X-Amz-Target": "SageMaker.DescribeCluster"},
        auth=SdkSigV4Auth(AccessKey(USER, USER_SECRET), "us-east-1"),
    )
    assert response.status_code == 200, response.text
    assert response.json()["ClusterName"] == "c"


def test_rest_with_a_forged_bearer_token_is_refused(control_plane: ControlPlane) -> None:
    for token in [
        bearer_token(USER, "guessed-secret"),
        bearer_token("AKIDNOBODY", USER_SECRET),
        "hpsim1." + USER,
        "not-a-token",
    ]:
        response = httpx.get(control_plane.url + "/clusters", headers={"Authorization": f"Bearer {token}"})
        assert (response.status_code, response.json()) == (
            401,
            {"__type": "UnrecognizedClientException", "message": INVALID_TOKEN},
        ), token
    with HyperPodClient(control_plane.url, access_key_id=USER, secret_access_key="wrong") as sdk:
        with pytest.raises(ClusterError) as caught:
            sdk.list_nodes("c")
        assert (caught.value.status, caught.value.code, caught.value.message) == (
            401,
            "InvalidSignatureException",
            BAD_SIGNATURE,
        )


def test_the_bootstrap_token_is_shown_to_authenticated_callers_only(control_plane: ControlPlane) -> None:
    client(control_plane, USER, USER_SECRET).create_cluster(ClusterName="c", InstanceGroups=[group()])
    stolen = httpx.get(control_plane.url + "/clusters/c/agent-bootstrap")
    assert stolen.status_code == 401
    assert stolen.json() == {"__type": "MissingAuthenticationToken", "message": MISSING}
    shown = httpx.get(
        control_plane.url + "/clusters/c/agent-bootstrap",
        headers={"Authorization": f"Bearer {bearer_token(USER, USER_SECRET)}"},
    )
    assert shown.status_code == 200
    token = control_plane.services.clusters.agent_bootstrap(name="c").bootstrap_token
    assert shown.json()["BootstrapToken"] == token
    assert token not in stolen.text


def test_fault_injection_needs_an_admin_credential(control_plane: ControlPlane) -> None:
    user = HyperPodClient(control_plane.url, access_key_id=USER, secret_access_key=USER_SECRET)
    admin = HyperPodClient(control_plane.url, access_key_id=ADMIN, secret_access_key=ADMIN_SECRET)
    with user, admin:
        user.create_cluster(ClusterName="c", InstanceGroups=[group()])
        control_plane.settle(client(control_plane, USER, USER_SECRET), "c")
        denied = (
            "The access key AKIDUSEREXAMPLE is not authorized to inject or clear faults: only the admin "
            "credentials (HPSIM_AUTH__ADMIN_CREDENTIALS) may."
        )
        for attempt in (
            lambda: user.inject_control_plane_fault(Type="DatabaseOutage", DurationSeconds=3600),
            lambda: user.inject_fault("c", Type="S3Outage", DurationSeconds=60),
        ):
            with pytest.raises(ClusterError) as caught:
                attempt()
            assert (caught.value.status, caught.value.code, caught.value.message) == (
                403,
                "AccessDeniedException",
                denied,
            )
        assert user.list_control_plane_faults() == []  # nothing was injected
        assert user.list_faults("c") == []
        assert user.describe_cluster("c")["ClusterStatus"] == "InService"

        fault = admin.inject_fault("c", Type="S3Outage", DurationSeconds=60)
        assert [f["FaultId"] for f in user.list_faults("c")] == [fault["FaultId"]]  # reading is anyone's
        with pytest.raises(ClusterError) as caught:
            user.clear_fault("c", fault["FaultId"])
        assert caught.value.code == "AccessDeniedException"
        assert admin.clear_fault("c", fault["FaultId"])["FaultId"] == fault["FaultId"]


def test_health_docs_and_agent_routes_are_not_behind_the_credentials(control_plane: ControlPlane) -> None:
    assert httpx.get(control_plane.url + "/health").json() == {"status": "ok", "database": "answers"}
    assert httpx.get(control_plane.url + "/openapi.json").status_code == 200
    assert httpx.get(control_plane.url + "/docs").status_code == 200
    # Agents authenticate with cluster tokens, checked by the agent protocol itself.
    response = httpx.post(
        control_plane.url + "/agent/v1/clusters/c/register",
        json={"endpoint": "http://127.0.0.1:1"},
        headers={"Authorization": "Bearer not-a-cluster-token"},
    )
    assert response.status_code in (401, 403, 404)
    assert "error" in response.json()
    assert "__type" not in response.json()


# ---------------------------------------------------------------------- hyperpod-sim's commands


def hpsim(control_plane: ControlPlane, tmp_path: Path, key: str, secret: str, *args: str) -> Any:
    env = {
        **os.environ,
        "AWS_ACCESS_KEY_ID": key,
        "AWS_SECRET_ACCESS_KEY": secret,
        "AWS_CONFIG_FILE": str(tmp_path / "aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "aws-credentials"),
    }
    env.pop("AWS_PROFILE", None)
    return subprocess.run(
        [sys.executable, "-m", "hyperpod_sim", *args, "--endpoint-url", control_plane.url],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def test_the_cli_signs_with_the_boto3_chain(control_plane: ControlPlane, tmp_path: Path) -> None:
    client(control_plane, USER, USER_SECRET).create_cluster(ClusterName="shell", InstanceGroups=[group()])
    listed = hpsim(control_plane, tmp_path, USER, USER_SECRET, "cluster", "nodes", "shell")  # REST
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.count("\n") == 3  # a header and two nodes
    refused = hpsim(control_plane, tmp_path, USER, "wrong", "cluster", "list")  # boto3
    assert (refused.returncode, refused.stdout) == (1, "")
    assert refused.stderr == f"error: InvalidSignatureException: {BAD_SIGNATURE}\n"
    refused = hpsim(control_plane, tmp_path, ADMIN, "wrong", "fault", "list", "shell")  # REST
    assert refused.stderr == f"error: InvalidSignatureException: {BAD_SIGNATURE}\n"


def test_auth_token_prints_the_bearer_token_of_the_chains_key(database_url: str, tmp_path: Path) -> None:
    env = {
        **os.environ,
        "AWS_ACCESS_KEY_ID": USER,
        "AWS_SECRET_ACCESS_KEY": USER_SECRET,
        "AWS_CONFIG_FILE": str(tmp_path / "aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "aws-credentials"),
    }
    result = subprocess.run(
        [sys.executable, "-m", "hyperpod_sim", "auth-token"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert (result.returncode, result.stdout, result.stderr) == (
        0,
        bearer_token(USER, USER_SECRET) + "\n",
        "",
    )
