"""The agent's client of the control plane's ``/agent/v1`` API.

Each call returns a :class:`Reply` instead of raising: the body on success, else a :class:`Failure`
kind that tells the caller whether trying again can help (see ``docs/agent-protocol.md``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from types import TracebackType
from typing import Any
from urllib.parse import quote

from hyperpod_sim.agents.http.client import Answer, HttpClient, HttpError
from hyperpod_sim.contracts.agent_api import (
    AGENT_API_PREFIX,
    AGENT_KEEPALIVE_S,
    HEARTBEAT_ROUTE,
    NODE_POLICY_ROUTE,
    REGISTER_ROUTE,
    Heartbeat,
    Registration,
    agent_api_path,
)
from hyperpod_sim.contracts.agent_bodies import S3TierStatus
from hyperpod_sim.contracts.partition import Partition


class Failure(enum.Enum):
    TEMPORARY = "temporary"  # connect error, timeout, 5xx, 429: retry with backoff
    UNAUTHORIZED = "unauthorized"  # 401/403: our token is refused; retrying quickly cannot help
    NOT_FOUND = "not_found"  # 404: unknown cluster or node (on heartbeat: the node was deleted)
    PERMANENT = "permanent"  # any other refusal, or an answer that is not the contract's


@dataclass(frozen=True, kw_only=True)
class Reply:
    body: dict[str, Any] | None = None
    failure: Failure | None = None
    status: int | None = None
    message: str = ""
    retry_after_s: float | None = None  # a 503's or 429's Retry-After: the least wait asked

    @property
    def ok(self) -> bool:
        return self.failure is None


def _retry_after(response: Answer) -> float | None:
    """A busy control plane's ``Retry-After`` in seconds (whole seconds, at most an hour), if any."""
    value = response.headers.get("retry-after", "")
    if response.status_code not in (429, 503) or not value.isascii() or not value.isdigit():
        return None
    return min(float(value), 3600.0)


def _classify(status: int) -> Failure:
    if status in (401, 403):
        return Failure.UNAUTHORIZED
    if status == 404:
        return Failure.NOT_FOUND
    if status >= 500 or status in (408, 429):
        return Failure.TEMPORARY
    return Failure.PERMANENT


def _error_text(response: Answer) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:200]
    if isinstance(body, dict):
        return " ".join(str(body[key]) for key in ("error", "message", "__type", "detail") if key in body)
    return str(body)[:200]


class ControlPlaneClient:
    def __init__(
        self,
        *,
        base_url: str,
        cluster: str,
        timeout_s: float,
        partition: Partition | None = None,
    ) -> None:
        # The agent's one TLS context, no proxies from the environment (the control plane is
        # addressed directly), and its connection kept between heartbeats.
        self._client = HttpClient(
            base_url=base_url,
            timeout=timeout_s,
            keepalive_s=AGENT_KEEPALIVE_S,
            before_call=self._check_partition,
        )
        self._partition = partition
        self._cluster = cluster
        self._prefix = f"{AGENT_API_PREFIX}/clusters/{quote(cluster, safe='')}"

    def _check_partition(self) -> None:
        """Behind a NetworkPartition (hyperpod_sim/contracts/partition.py) no call leaves this node."""
        if self._partition is not None and self._partition.active():
            raise HttpError(
                f"network partition (fault {self._partition.fault_id}): the control plane is unreachable"
            )

    async def __aenter__(self) -> ControlPlaneClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._client.aclose()

    async def register(
        self,
        *,
        token: str,
        node_id: str | None,
        endpoint: str,
        pid: int,
        instance_type: str | None,
        memory_bytes: int,
    ) -> Reply:
        body = Registration(
            node_id=node_id,
            endpoint=endpoint,
            pid=pid,
            instance_type=instance_type,
            memory_bytes=memory_bytes,
        )
        path = agent_api_path(REGISTER_ROUTE, cluster=self._cluster)
        return await self._call("POST", path, token=token, json_body=body.model_dump(mode="json"))

    async def heartbeat(
        self,
        *,
        token: str,
        node_id: str,
        applied_generation: int,
        endpoint: str,
        pid: int,
        s3_status: S3TierStatus | None = None,
    ) -> Reply:
        """``s3_status``: the S3 tier's status (docs/agent-protocol.md), sent as ``s3`` when given;
        a heartbeat without it tells the control plane the node has no S3 tier."""
        s3 = {"s3": s3_status} if s3_status is not None else {}
        body = Heartbeat(applied_generation=applied_generation, endpoint=endpoint, pid=pid, **s3)
        path = agent_api_path(HEARTBEAT_ROUTE, cluster=self._cluster, node_id=node_id)
        return await self._call(
            "POST", path, token=token, json_body=body.model_dump(mode="json", exclude_unset=True)
        )

    async def fetch_policy(self, *, token: str, node_id: str) -> Reply:
        path = agent_api_path(NODE_POLICY_ROUTE, cluster=self._cluster, node_id=node_id)
        return await self._call("GET", path, token=token, json_body=None)

    async def request(self, method: str, suffix: str, *, token: str | None, json_body: Any = None) -> Answer:
        """Any call under this cluster's ``/agent/v1/clusters/{cluster}`` prefix, answered as it
        comes (the in-memory tier reads 201/404/409 itself); HttpError when no answer came."""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return await self._client.request(method, f"{self._prefix}{suffix}", headers=headers, json=json_body)

    async def _call(self, method: str, path: str, *, token: str, json_body: Any) -> Reply:
        headers = {"Authorization": f"Bearer {token}"}
        try:
            response = await self._client.request(method, path, headers=headers, json=json_body)
        except HttpError as exc:  # refused, broken off, timed out
            return Reply(failure=Failure.TEMPORARY, message=str(exc))
        if response.status_code != 200:
            return Reply(
                failure=_classify(response.status_code),
                status=response.status_code,
                message=_error_text(response),
                retry_after_s=_retry_after(response),
            )
        try:
            body = response.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return Reply(failure=Failure.PERMANENT, status=200, message="the answer is not a JSON object")
        return Reply(body=body, status=200)
