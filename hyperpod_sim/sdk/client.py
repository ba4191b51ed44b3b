"""A Python client for the hyperpod-sim control plane (docs/sdk.md).

The AWS operations go through boto3's own ``sagemaker`` client pointed at the service, so their
shapes and validation are botocore's (no second copy here); hyperpod-sim's extensions (checkpoint
policy, node agent status, checkpoint listings, faults) are plain HTTP on its REST routes. Whichever way a
call went, a refusal comes out as one exception, ClusterError, with the AWS error code. Waiters
poll with backoff and fail with the cluster's ``FailureMessage``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import quote

import httpx

TERMINAL_FAILURE = {"Failed", "RollingBack"}


class ClusterError(Exception):
    """A call refused (``code`` is the AWS error code, e.g. ``ResourceNotFound``, and ``status``
    the HTTP status), a control plane that could not be reached (``EndpointConnectionError``), or a
    wait that ended in failure (``code`` the cluster's status) or timed out (WaitTimeout).

    Every helper of HyperPodClient raises this, whether it went through boto3 or REST; the
    botocore exception, where there was one, is the ``__cause__``. ``str()`` is ``"<code>: <message>"``.
    """

    def __init__(self, message: str, *, code: str | None = None, status: int | None = None) -> None:
        super().__init__(f"{code}: {message}" if code else message)
        self.message = message
        self.code = code
        self.status = status


class WaitTimeout(ClusterError):
    """A wait that ran out of time (``code`` ``WaitTimeout``)."""


@contextmanager
def _aws_errors() -> Iterator[None]:
    """botocore's exceptions as ClusterError: refusals with the AWS code, client-side ones
    (parameter validation, no connection) with the botocore exception's name."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        yield
    except ClientError as exc:
        error = exc.response.get("Error", {})
        raise ClusterError(
            error.get("Message") or str(exc),
            code=error.get("Code") or None,
            status=exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode"),
        ) from exc
    except BotoCoreError as exc:
        raise ClusterError(str(exc), code=type(exc).__name__) from exc


class HyperPodClient:
    """``HyperPodClient("http://127.0.0.1:8080")``: the AWS operations as ``client.sagemaker``
    (a boto3 client) plus helpers, waiters and the extensions."""

    def __init__(
        self,
        endpoint_url: str = "http://127.0.0.1:8080",
        *,
        region: str = "us-east-1",
        timeout_s: float = 30.0,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        profile: str | None = None,
        bearer_token: str | None = None,
    ) -> None:
        """Credentials (docs/security.md): ``access_key_id`` and ``secret_access_key`` if given,
        else the usual boto3 chain (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``
        or ``profile``, the shared files). Both the AWS operations (boto3) and the REST extensions
        are signed with them (SigV4). With none found, a placeholder key signs: enough for a
        control plane with auth off. ``bearer_token`` instead sends that token on the REST calls
        (the AWS operations still need a key to sign)."""
        import boto3
        from botocore.config import Config

        from hyperpod_sim.sdk.auth import AccessKey, BearerAuth, SigV4Auth, resolve_access_key

        self.endpoint_url = endpoint_url.rstrip("/")
        key = resolve_access_key(
            access_key_id=access_key_id, secret_access_key=secret_access_key, profile=profile
        ) or AccessKey("hpsim", "hpsim")
        self.access_key_id = key.access_key_id
        self.sagemaker = boto3.client(
            "sagemaker",
            endpoint_url=self.endpoint_url,
            region_name=region,
            aws_access_key_id=key.access_key_id,
            aws_secret_access_key=key.secret_access_key,
            aws_session_token=key.session_token,
            config=Config(
                retries={"max_attempts": 3, "mode": "standard"},
                connect_timeout=timeout_s,
                read_timeout=timeout_s,
            ),
        )
        auth: httpx.Auth = BearerAuth(bearer_token) if bearer_token else SigV4Auth(key, region)
        # Idle connections are dropped after 2 s, before the server's own keep-alive timeout
        # (uvicorn's 5 s, httpx's default expiry too): a request sent on a connection the server is
        # closing at that moment fails with "Server disconnected without sending a response".
        self._http = httpx.Client(
            base_url=self.endpoint_url,
            timeout=timeout_s,
            trust_env=False,
            auth=auth,
            limits=httpx.Limits(keepalive_expiry=2.0),
        )

    def close(self) -> None:
        self._http.close()
        self.sagemaker.close()

    def __enter__(self) -> HyperPodClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ REST

    def _rest(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TimeoutException as exc:
            # botocore's names for the same failures, so both transports report them alike.
            raise ClusterError(
                f"{method} {self.endpoint_url}{path} timed out: {exc}",
                code="ConnectTimeoutError" if isinstance(exc, httpx.ConnectTimeout) else "ReadTimeoutError",
            ) from exc
        except httpx.HTTPError as exc:
            raise ClusterError(
                f"Could not connect to the endpoint URL: {self.endpoint_url}{path} ({exc})",
                code="EndpointConnectionError",
            ) from exc
        if response.status_code >= 400:
            code: str | None = None
            message = response.text or response.reason_phrase
            try:
                doc = response.json()
            except ValueError:
                doc = None
            if isinstance(doc, dict):
                code = str(doc.get("__type") or doc.get("error") or "").rsplit("#", 1)[-1] or None
                message = str(doc.get("message") or doc.get("Message") or message)
            raise ClusterError(
                message, code=code or f"HTTP{response.status_code}", status=response.status_code
            )
        return response.json() if response.content else None

    # ------------------------------------------------------------------ clusters

    def create_cluster(self, **request: Any) -> str:
        """CreateCluster with the AWS request members; the cluster's ARN."""
        with _aws_errors():
            return str(self.sagemaker.create_cluster(**request)["ClusterArn"])

    def update_cluster(self, **request: Any) -> str:
        """UpdateCluster with the AWS request members; the cluster's ARN."""
        with _aws_errors():
            return str(self.sagemaker.update_cluster(**request)["ClusterArn"])

    def describe_cluster(self, name: str) -> dict[str, Any]:
        with _aws_errors():
            answer: dict[str, Any] = self.sagemaker.describe_cluster(ClusterName=name)
        answer.pop("ResponseMetadata", None)
        return answer

    def list_clusters(self) -> list[dict[str, Any]]:
        summaries: list[dict[str, Any]] = []
        with _aws_errors():
            for page in self.sagemaker.get_paginator("list_clusters").paginate():
                summaries.extend(page["ClusterSummaries"])
        return summaries

    def delete_cluster(self, name: str) -> str:
        with _aws_errors():
            return str(self.sagemaker.delete_cluster(ClusterName=name)["ClusterArn"])

    def list_nodes(self, name: str) -> list[dict[str, Any]]:
        """Every node, with hyperpod-sim's ``AgentStatus`` (REST: boto3 drops members it does not know)."""
        nodes: list[dict[str, Any]] = []
        token: str | None = None
        while True:
            params = {"NextToken": token} if token else {}
            page = self._rest("GET", f"/clusters/{quote(name, safe='')}/nodes", params=params)
            nodes.extend(page["ClusterNodeSummaries"])
            token = page.get("NextToken")
            if not token:
                return nodes

    def describe_node(self, name: str, node_id: str) -> dict[str, Any]:
        doc = self._rest("GET", f"/clusters/{quote(name, safe='')}/nodes/{quote(node_id, safe='')}")
        details: dict[str, Any] = doc["NodeDetails"]
        return details

    def agent_urls(self, name: str) -> list[str]:
        """The agent endpoints of the cluster's running nodes, in node order."""
        return [
            n["AgentStatus"]["Endpoint"]
            for n in self.list_nodes(name)
            if n["InstanceStatus"]["Status"] == "Running" and (n.get("AgentStatus") or {}).get("Endpoint")
        ]

    def events(self, name: str) -> list[dict[str, Any]]:
        """The cluster's events, newest first."""
        events: list[dict[str, Any]] = []
        with _aws_errors():
            for page in self.sagemaker.get_paginator("list_cluster_events").paginate(ClusterName=name):
                events.extend(page["Events"])
        return events

    # ------------------------------------------------------------------ checkpoint policy (extension)

    def get_checkpoint_policy(self, name: str) -> dict[str, Any]:
        policy: dict[str, Any] = self._rest("GET", f"/clusters/{quote(name, safe='')}/checkpoint-policy")
        return policy

    def put_checkpoint_policy(self, name: str, **policy: Any) -> dict[str, Any]:
        """Replace the policy (S3BaseUri, PersistEverySteps, PersistEverySeconds, S3Retention,
        InMemoryRetention, ReplicationFactor, AgentAccess); the cluster is Updating until every agent
        has it."""
        answer: dict[str, Any] = self._rest(
            "PUT", f"/clusters/{quote(name, safe='')}/checkpoint-policy", json=policy
        )
        return answer

    def checkpoint_token(self, name: str) -> str:
        """The cluster's checkpoint token: what trainers send to its agents (``HPSIM_CHECKPOINT_TOKEN``)
        when its checkpoint policy's ``AgentAccess`` is ``Token``."""
        answer: dict[str, Any] = self._rest("GET", f"/clusters/{quote(name, safe='')}/checkpoint-token")
        return str(answer["CheckpointToken"])

    # ------------------------------------------------------------------ checkpoints (extension)

    def checkpoints(self, name: str) -> dict[str, Any]:
        """Where the cluster's checkpoints are: ``{"ClusterName", "Namespaces": [{"Namespace",
        "NumRanks", "StepsRetained", "Steps": [{"Step", "Memory": {rank: node}, "Replica": {rank:
        [nodes]}, "S3", "Complete"}]}], "Unreachable": [node ids]}``, steps newest first."""
        listing: dict[str, Any] = self._rest("GET", f"/clusters/{quote(name, safe='')}/checkpoints")
        return listing

    # ------------------------------------------------------------------ faults (extension)

    def inject_fault(self, name: str, **spec: Any) -> dict[str, Any]:
        """Inject a fault: ``Type`` (AgentCrash, NodeLoss, AgentHang, NetworkPartition, S3Latency, S3Errors,
        S3Outage) and its members (``InstanceId``, ``DurationSeconds``, ``LatencyMs``,
        ``ErrorRate``, ``ErrorKind``). The fault's record: ``FaultId``, ``Type``, the members given,
        ``InjectedAt``, ``EndsAt`` (with a duration) and ``PolicyGeneration``."""
        fault: dict[str, Any] = self._rest("POST", f"/clusters/{quote(name, safe='')}/faults", json=spec)
        return fault

    def start_node_session(self, name: str, node_id: str) -> dict[str, Any]:
        """The environment of a command to run on node ``node_id`` (``hyperpod-sim node exec``):
        ``ClusterName``, ``NodeId``, ``Address`` and ``Environment`` (variables to add to the
        command's). The node's end ends what runs with it (a NodeLoss, its deletion)."""
        path = f"/clusters/{quote(name, safe='')}/nodes/{quote(node_id, safe='')}/sessions"
        opened: dict[str, Any] = self._rest("POST", path)
        return opened

    def _job_path(self, name: str, job: str | None = None) -> str:
        path = f"/clusters/{quote(name, safe='')}/jobs"
        return path if job is None else f"{path}/{quote(job, safe='')}"

    def create_job(self, name: str, **spec: Any) -> dict[str, Any]:
        """Record a job (``Command``, ``JobName``, ``NodeCount``, ``ProcessesPerNode``,
        ``AutoResume``, ``MaxRestarts``, ``LogPath``); its description. ``hyperpod-sim job run``
        starts its supervisor, which runs it."""
        job: dict[str, Any] = self._rest("POST", self._job_path(name), json=spec)["Job"]
        return job

    def start_job_attempt(self, name: str, job: str, *, pid: int, start_time: int) -> dict[str, Any]:
        """Place the job's next attempt (its supervisor's call): ``Attempt`` and ``Nodes``."""
        body = {"SupervisorPid": pid, "SupervisorStartTime": start_time}
        placed: dict[str, Any] = self._rest("POST", f"{self._job_path(name, job)}/attempts", json=body)
        return placed

    def end_job_attempt(self, name: str, job: str, attempt: int, **end: Any) -> dict[str, Any]:
        """Report how an attempt ended (``ExitCode``, ``Cause``, ``NodeId``, ``Rank``): the job and
        ``Restart``."""
        answer: dict[str, Any] = self._rest(
            "POST", f"{self._job_path(name, job)}/attempts/{attempt}/end", json=end
        )
        return answer

    def stop_job(self, name: str, job: str) -> dict[str, Any]:
        stopped: dict[str, Any] = self._rest("POST", f"{self._job_path(name, job)}/stop")["Job"]
        return stopped

    def describe_job(self, name: str, job: str) -> dict[str, Any]:
        found: dict[str, Any] = self._rest("GET", self._job_path(name, job))["Job"]
        return found

    def list_jobs(self, name: str) -> list[dict[str, Any]]:
        jobs: list[dict[str, Any]] = self._rest("GET", self._job_path(name))["Jobs"]
        return jobs

    def list_faults(self, name: str) -> list[dict[str, Any]]:
        """The faults in force, oldest first."""
        faults: list[dict[str, Any]] = self._rest("GET", f"/clusters/{quote(name, safe='')}/faults")["Faults"]
        return faults

    def clear_fault(self, name: str, fault_id: str) -> dict[str, Any]:
        """End an S3 fault, an AgentHang or a NetworkPartition now; the fault's record with ``ClearedAt``."""
        fault: dict[str, Any] = self._rest(
            "DELETE", f"/clusters/{quote(name, safe='')}/faults/{quote(fault_id, safe='')}"
        )
        return fault

    def inject_control_plane_fault(self, **spec: Any) -> dict[str, Any]:
        """Make the control plane's database unreachable (``Type="DatabaseOutage"``: every request
        to it fails at once) or silent (``Type="DatabaseHang"``: connections accepted, nothing
        answers), for ``DurationSeconds`` (1..3600). Meanwhile the other calls of this client raise
        ClusterError with code ServiceUnavailable (during a hang, those whose database answer does
        not come within the control plane's statement timeout plus 2 s; shorter waits end late but
        answered). The fault's record, without a cluster."""
        fault: dict[str, Any] = self._rest("POST", "/faults", json=spec)
        return fault

    def list_control_plane_faults(self) -> list[dict[str, Any]]:
        """The control plane's faults in force (the DatabaseOutage or DatabaseHang, if any)."""
        faults: list[dict[str, Any]] = self._rest("GET", "/faults")["Faults"]
        return faults

    def clear_control_plane_fault(self, fault_id: str) -> dict[str, Any]:
        """End the DatabaseOutage or DatabaseHang now; its record with ``ClearedAt``."""
        fault: dict[str, Any] = self._rest("DELETE", f"/faults/{quote(fault_id, safe='')}")
        return fault

    # ------------------------------------------------------------------ waiters

    def wait_for_status(
        self,
        name: str,
        wanted: str | set[str],
        *,
        timeout: float = 600.0,
        on_poll: Callable[[dict[str, Any]], None] | None = None,
    ) -> dict[str, Any]:
        """Poll DescribeCluster (0.2 s doubling to 5 s) until the status is one of ``wanted``;
        ClusterError (``code`` the status) with the FailureMessage if it fails, WaitTimeout after
        ``timeout`` s. ``on_poll`` sees every DescribeCluster answer."""
        targets = {wanted} if isinstance(wanted, str) else set(wanted)
        for cluster in self._polls(name, timeout, waiting_for=" or ".join(sorted(targets))):
            if on_poll is not None:
                on_poll(cluster)
            status = cluster["ClusterStatus"]
            if status in targets:
                return cluster
            if status in TERMINAL_FAILURE - targets:
                raise ClusterError(
                    f"cluster {name} is {status}: {cluster.get('FailureMessage') or 'no failure message'}",
                    code=status,
                )
        raise AssertionError("unreachable")

    def wait_until_in_service(self, name: str, *, timeout: float = 600.0, **kwargs: Any) -> dict[str, Any]:
        return self.wait_for_status(name, "InService", timeout=timeout, **kwargs)

    def wait_until_deleted(
        self,
        name: str,
        *,
        timeout: float = 600.0,
        on_poll: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        """Poll until DescribeCluster answers ResourceNotFound; WaitTimeout after ``timeout`` s.
        A cluster left Failed (not being deleted) fails the wait with its FailureMessage."""
        try:
            for cluster in self._polls(name, timeout, waiting_for="deleted"):
                if on_poll is not None:
                    on_poll(cluster)
                if cluster["ClusterStatus"] == "Failed":
                    raise ClusterError(
                        f"cluster {name} is Failed, not Deleting: "
                        f"{cluster.get('FailureMessage') or 'no failure message'}",
                        code="Failed",
                    )
        except ClusterError as exc:
            if exc.code == "ResourceNotFound":
                return
            raise

    def _polls(self, name: str, timeout: float, *, waiting_for: str) -> Iterator[dict[str, Any]]:
        """DescribeCluster answers, 0.2 s doubling to 5 s apart, until ``timeout`` s have passed."""
        deadline = time.monotonic() + timeout
        delay = 0.2
        while True:
            cluster = self.describe_cluster(name)
            yield cluster
            left = deadline - time.monotonic()
            if left <= 0:
                raise WaitTimeout(
                    f"cluster {name} is still {cluster['ClusterStatus']} after {timeout:g} s "
                    f"(waiting for it to be {waiting_for})",
                    code="WaitTimeout",
                )
            time.sleep(min(delay, left))
            delay = min(delay * 2, 5.0)
