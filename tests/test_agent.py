"""The node agent (``hyperpod-sim agent``) as real processes, over real HTTP on loopback.

The agent's peer here is a stand-in control plane: the ``/agent/v1`` routes of
``docs/agent-protocol.md`` kept in memory (nodes, pending slots, one policy generation), recording
what it receives. It is the contract's other side, small enough to read at a glance, so that these
tests pin the agent's behaviour without the real control plane.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from hyperpod_sim.agents.control_plane import ControlPlaneClient
from hyperpod_sim.agents.http.server import Request
from hyperpod_sim.agents.loop import AgentLoop, Backoff, Identity, LoopOutcome
from hyperpod_sim.agents.metrics import Metric, render
from hyperpod_sim.agents.state import AgentState, ApplyStatus
from tests.conftest import free_port, shm_root_for, wait_for
from tests.standin import DROP, Canned, Drop, standin

CLUSTER = "demo"
CLUSTER_TOKEN = "cluster-secret-0123"  # between agents
BOOTSTRAP_TOKEN = "bootstrap-secret-4567"
LAUNCH_SECRET = "launch-secret-89ab"  # what the local provisioner hands an agent with --node-id
NODE_TOKEN = "node-secret-cdef"  # the agent's credential at the control plane
CONTROL_PLANE_TOKEN = "control-plane-secret-0246"  # the control plane's at the agent
NODE = "i-0123456789abcdef0"
MIB = 1024 * 1024
ROUTE = re.compile(
    r"^/agent/v1/clusters/(?P<cluster>[^/]+)/"
    r"(?:(?P<register>register)|nodes/(?P<node>[^/]+)/(?P<action>heartbeat|policy))$"
)


def policy(generation: int, node_id: str) -> dict[str, Any]:
    return {
        "generation": generation,
        "cluster_name": CLUSTER,
        "cluster_id": "abcdefghijkl",
        "node_id": node_id,
        "instance_group": "workers",
        "instance_type": "ml.p5.48xlarge",
        "tiered_storage": {"enabled": True, "memory_percentage": 20},
        "memory_budget_bytes": generation * MIB,
        "in_memory_retention": 3,
        "replication": {"factor": 1, "peers": []},
        "s3": None,
    }


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    authorization: str | None
    body: Any


class StandIn:
    """The control plane's side of the agent protocol, in memory, on a loopback port."""

    def __init__(self, *, port: int | None = None, nodes: tuple[str, ...] = (NODE,)) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.lock = threading.Lock()
        self.generation = 1
        self.nodes: set[str] = set(nodes)  # node ids known to the cluster
        self.pending: list[str] = []  # node slots for external agents
        self.seen: list[Seen] = []
        self._server: ThreadingHTTPServer | None = None

    def calls(self, kind: str) -> list[Seen]:
        with self.lock:
            return [call for call in self.seen if call.path.endswith(kind)]

    def handle(self, method: str, path: str, authorization: str | None, body: Any) -> tuple[int, Any]:
        with self.lock:
            self.seen.append(Seen(method, path, authorization, body))
            match = ROUTE.match(path)
            if match is None or match["cluster"] != CLUSTER:
                return 404, {"error": "NotFound", "message": f"no cluster or route {path}"}
            scheme, _, token = (authorization or "").partition(" ")
            if scheme != "Bearer" or not token:
                return 401, {"error": "Unauthorized", "message": "missing token"}
            if match["register"] and method == "POST":
                node_id = body.get("node_id")
                if token != (LAUNCH_SECRET if node_id else BOOTSTRAP_TOKEN):
                    return 403, {"error": "Forbidden", "message": "wrong token"}
                if node_id is None:
                    if not self.pending:
                        return 409, {"error": "Conflict", "message": "no pending node slot left"}
                    node_id = self.pending.pop(0)
                    self.nodes.add(node_id)
                if node_id not in self.nodes:
                    return 404, {"error": "NotFound", "message": f"no node {node_id}"}
                return 200, {
                    "node_id": node_id,
                    "node_token": NODE_TOKEN,
                    "control_plane_token": CONTROL_PLANE_TOKEN,
                    "cluster_token": CLUSTER_TOKEN,
                    "heartbeat_interval_s": 0.1,
                    "policy": policy(self.generation, node_id),
                }
            if token != NODE_TOKEN:
                return 403, {"error": "Forbidden", "message": "wrong token"}
            if match["node"] not in self.nodes:
                return 404, {"error": "NotFound", "message": f"no node {match['node']}"}
            if match["action"] == "heartbeat" and method == "POST":
                return 200, {"desired_generation": self.generation}
            if match["action"] == "policy" and method == "GET":
                return 200, policy(self.generation, match["node"])
            return 405, {"error": "MethodNotAllowed", "message": method}

    def start(self) -> StandIn:
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                self.dispatch()

            def do_POST(self) -> None:
                self.dispatch()

            def dispatch(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status, payload = stand_in.handle(
                    self.command, self.path, self.headers.get("Authorization"), json.loads(raw or b"null")
                )
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        ThreadingHTTPServer.allow_reuse_address = True
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


class Agent:
    """One ``hyperpod-sim agent`` process; its endpoint is read from the line it prints at start."""

    def __init__(self, process: subprocess.Popen[str], log_path: Path) -> None:
        self.process = process
        self.log_path = log_path
        assert process.stdout is not None
        line = process.stdout.readline()
        found = re.search(r" on (http://\S+) ", line)
        if found is None:
            process.kill()
            process.wait(timeout=30)
            raise AssertionError(f"the agent did not start: {line!r}\n{self.log()}")
        self.url = found[1]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def get(self, path: str) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", timeout=5)

    def put_policy(
        self,
        doc: Any,
        *,
        token: str | None = CONTROL_PLANE_TOKEN,
        raw: bytes | None = None,
        query: str = "",
    ) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        content = raw if raw is not None else json.dumps(doc).encode()
        return httpx.put(f"{self.url}/v1/policy{query}", content=content, headers=headers, timeout=5)

    def health(self) -> dict[str, Any]:
        body: dict[str, Any] = self.get("/health").json()
        return body

    def generation(self) -> int:
        generation: int = self.get("/v1/policy").json()["generation"]
        return generation

    def metric(self, name: str) -> float:
        text = self.get("/metrics").text
        found = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
        assert found is not None, f"{name} not in\n{text}"
        return float(found[1])

    def wait_exit(self, *, timeout: float = 15) -> int:
        wait_for(lambda: self.process.poll() is not None, timeout=timeout, what="the agent to exit")
        return self.process.returncode


StartAgent = Callable[..., Agent]


@pytest.fixture
def stand_in() -> Iterator[StandIn]:
    server = StandIn().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def start_agent(tmp_path: Path) -> Iterator[StartAgent]:
    started: list[Agent] = []

    def start(
        control_plane: str, *args: str, token: str = LAUNCH_SECRET, env: dict[str, str] | None = None
    ) -> Agent:
        clean = {key: value for key, value in os.environ.items() if not key.startswith("HPSIM_AGENT_")}
        environment = {
            **clean,
            "HPSIM_AGENT_REGISTER_BACKOFF_MAX_S": "0.3",
            "HPSIM_AGENT_PERMANENT_RETRY_S": "0.2",
            "HPSIM_AGENT_TOKEN": token,
            # Each agent's shared memory under the test's own root (removed after the test).
            "HPSIM_AGENT_SHM_DIR": str(shm_root_for(tmp_path) / f"agent-{len(started)}"),
            **(env or {}),
        }
        command = [sys.executable, "-m", "hyperpod_sim", "agent", "--control-plane", control_plane]
        command += ["--cluster", CLUSTER, "--port", "0", *args]
        log_path = tmp_path / f"agent-{len(started)}.log"
        with log_path.open("w") as log:
            process = subprocess.Popen(
                command, env=environment, cwd=tmp_path, stdout=subprocess.PIPE, stderr=log, text=True
            )
        try:
            agent = Agent(process, log_path)
        except BaseException:
            process.kill()
            process.wait(timeout=30)
            raise
        started.append(agent)
        return agent

    try:
        yield start
    finally:
        for agent in started:
            if agent.process.poll() is None:
                agent.process.kill()
            agent.process.wait(timeout=30)
            if agent.process.stdout is not None:
                agent.process.stdout.close()


def registered(agent: Agent) -> Callable[[], bool]:
    return lambda: bool(agent.health()["registered"])


def test_agent_listens_registers_and_applies_the_registration_policy(
    stand_in: StandIn, start_agent: StartAgent
) -> None:
    agent = start_agent(
        stand_in.url,
        "--node-id",
        NODE,
        "--instance-type",
        "ml.p5.48xlarge",
        env={"HPSIM_AGENT_NODE_ID": "i-from-the-environment"},  # the flag wins
    )
    wait_for(registered(agent), timeout=15, what="registration")

    [register] = stand_in.calls("/register")
    assert register.authorization == f"Bearer {LAUNCH_SECRET}"
    assert register.body["node_id"] == NODE
    assert register.body["pid"] == agent.process.pid
    assert register.body["instance_type"] == "ml.p5.48xlarge"
    assert register.body["endpoint"] == agent.url
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+", agent.url)
    assert int(agent.url.rsplit(":", 1)[1]) > 0
    assert isinstance(register.body["memory_bytes"], int)

    assert agent.get("/v1/policy").json() == policy(1, NODE)
    assert agent.health() == {
        "status": "ok",
        "node_id": NODE,
        "cluster": CLUSTER,
        "registered": True,
        "applied_generation": 1,
    }
    # Heartbeats follow, to the node's own route, with the applied generation and the endpoint.
    wait_for(lambda: stand_in.calls("/heartbeat"), timeout=15, what="a heartbeat")
    heartbeat = stand_in.calls("/heartbeat")[0]
    assert heartbeat.path == f"/agent/v1/clusters/{CLUSTER}/nodes/{NODE}/heartbeat"
    assert heartbeat.body == {"applied_generation": 1, "endpoint": agent.url, "pid": agent.process.pid}
    assert agent.metric("hpsim_agent_registered") == 1


def test_put_policy_applies_newer_generations_and_refuses_the_rest(
    stand_in: StandIn, start_agent: StartAgent
) -> None:
    agent = start_agent(stand_in.url, "--node-id", NODE)
    wait_for(registered(agent), timeout=15, what="registration")

    response = agent.put_policy(policy(2, NODE))
    assert (response.status_code, response.json()) == (200, {"applied_generation": 2})
    assert agent.get("/v1/policy").json() == policy(2, NODE)
    metrics = agent.get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert "# TYPE hpsim_agent_policy_generation gauge\nhpsim_agent_policy_generation 2\n" in metrics.text
    assert f"\nhpsim_agent_memory_budget_bytes {2 * MIB}\n" in metrics.text
    assert "\nhpsim_agent_tiered_storage_enabled 1\n" in metrics.text
    assert (
        "# TYPE hpsim_agent_policy_applies_total counter\nhpsim_agent_policy_applies_total 2\n"
        in metrics.text
    )

    same = agent.put_policy(policy(2, NODE))
    assert (same.status_code, same.json()) == (200, {"applied_generation": 2})

    older = agent.put_policy(policy(1, NODE))
    assert older.status_code == 409
    assert older.json()["error"] == "StaleGeneration"
    assert older.json()["applied_generation"] == 2

    missing = agent.put_policy(policy(3, NODE), token=None)
    assert missing.status_code == 401
    assert missing.json()["error"] == "MissingToken"
    assert "Bearer" in missing.json()["message"]
    malformed = httpx.put(
        f"{agent.url}/v1/policy", json=policy(3, NODE), headers={"Authorization": "Basic abc"}, timeout=5
    )
    assert malformed.status_code == 401
    wrong = agent.put_policy(policy(3, NODE), token="not-the-token")
    assert wrong.status_code == 403
    assert wrong.json()["error"] == "InvalidToken"
    assert set(wrong.json()) == {"error", "message"}
    # The cluster token, which every agent holds, pushes nothing: only the control plane does.
    peer = agent.put_policy(policy(3, NODE), token=CLUSTER_TOKEN)
    assert peer.status_code == 403
    assert "pushed by the control plane only" in peer.json()["message"]

    for bad, complaint in [
        ([1, 2], "must be a JSON object, got array"),
        ({"cluster_name": CLUSTER}, "'generation' must be an integer >= 1, got None"),
        ({"generation": "3"}, "'generation' must be an integer >= 1, got '3'"),
        ({"generation": 0}, "'generation' must be an integer >= 1, got 0"),
        ({"generation": 3, "memory_budget_bytes": -1}, "'memory_budget_bytes' must be an integer >= 0"),
        ({"generation": 3, "node_id": "i-another"}, "the policy is for node_id 'i-another'"),
    ]:
        response = agent.put_policy(bad)
        assert response.status_code == 400, bad
        assert response.json()["error"] == "InvalidPolicy"
        assert complaint in response.json()["message"]
    not_json = agent.put_policy(None, raw=b"{generation")
    assert not_json.status_code == 400
    assert "not JSON" in not_json.json()["message"]

    # Nothing refused changed the policy in force.
    assert agent.get("/v1/policy").json() == policy(2, NODE)
    assert agent.metric("hpsim_agent_policy_applies_total") == 2

    # A reset: the control plane re-syncs the agent to an older generation of its own.
    bad_reset = agent.put_policy(policy(1, NODE), query="?reset=yes")
    assert (bad_reset.status_code, bad_reset.json()["error"]) == (400, "InvalidRequest")
    assert agent.put_policy(policy(1, NODE), token=CLUSTER_TOKEN, query="?reset=true").status_code == 403
    reset = agent.put_policy(policy(1, NODE), query="?reset=true")
    assert (reset.status_code, reset.json()) == (200, {"applied_generation": 1})
    assert agent.get("/v1/policy").json() == policy(1, NODE)


def test_agent_pulls_the_policy_when_a_heartbeat_says_it_is_behind(
    stand_in: StandIn, start_agent: StartAgent
) -> None:
    agent = start_agent(stand_in.url, "--node-id", NODE, "--heartbeat-interval", "0.1")
    wait_for(registered(agent), timeout=15, what="registration")
    assert agent.generation() == 1
    assert stand_in.calls("/policy") == []  # not behind: no pull

    with stand_in.lock:
        stand_in.generation = 3
    wait_for(lambda: agent.generation() == 3, timeout=15, what="the agent to converge to generation 3")

    assert agent.get("/v1/policy").json() == policy(3, NODE)
    pulls = stand_in.calls("/policy")
    assert pulls
    assert {(pull.method, pull.authorization) for pull in pulls} == {("GET", f"Bearer {NODE_TOKEN}")}
    assert {call.authorization for call in stand_in.calls("/heartbeat")} == {f"Bearer {NODE_TOKEN}"}
    # The control plane then learns the generation applied.
    wait_for(
        lambda: any(call.body["applied_generation"] == 3 for call in stand_in.calls("/heartbeat")),
        timeout=15,
        what="a heartbeat reporting generation 3",
    )
    assert agent.metric("hpsim_agent_heartbeats_total") >= 1


def test_agent_retries_until_the_control_plane_comes_up(start_agent: StartAgent) -> None:
    port = free_port()  # nothing listens there yet
    agent = start_agent(f"http://127.0.0.1:{port}", "--node-id", NODE)

    wait_for(
        lambda: agent.metric("hpsim_agent_heartbeat_failures_total") >= 3,
        timeout=15,
        what="failed registrations to be counted",
    )
    assert agent.health()["registered"] is False
    assert agent.metric("hpsim_agent_registered") == 0
    assert agent.generation() == 0  # the admin API serves before registration

    stand_in = StandIn(port=port).start()
    try:
        wait_for(registered(agent), timeout=15, what="registration once the control plane is up")
        assert agent.generation() == 1
        assert agent.process.poll() is None
    finally:
        stand_in.stop()


def test_external_agent_registers_with_the_bootstrap_token(
    start_agent: StartAgent, stand_in: StandIn
) -> None:
    with stand_in.lock:
        stand_in.nodes.clear()  # no node slot yet: registration is refused with 409 and retried
    agent = start_agent(stand_in.url, token=BOOTSTRAP_TOKEN)  # the token from HPSIM_AGENT_TOKEN
    wait_for(lambda: len(stand_in.calls("/register")) >= 2, timeout=15, what="refused registrations")
    assert agent.health()["registered"] is False
    assert agent.health()["node_id"] is None

    early = agent.put_policy(policy(2, "i-0fedcba987654321"), token=BOOTSTRAP_TOKEN)
    assert early.status_code == 401
    assert early.json()["error"] == "NotRegistered"
    assert "not registered yet" in early.json()["message"]

    with stand_in.lock:
        stand_in.pending.append("i-0fedcba987654321")
    wait_for(registered(agent), timeout=15, what="registration into the pending slot")
    assert agent.health()["node_id"] == "i-0fedcba987654321"
    registers = stand_in.calls("/register")
    assert {call.authorization for call in registers} == {f"Bearer {BOOTSTRAP_TOKEN}"}
    assert {call.body["node_id"] for call in registers} == {None}
    assert agent.generation() == 1

    assert agent.put_policy(policy(2, "i-0fedcba987654321"), token=BOOTSTRAP_TOKEN).status_code == 403
    assert agent.put_policy(policy(2, "i-0fedcba987654321"), token=CLUSTER_TOKEN).status_code == 403
    accepted = agent.put_policy(policy(2, "i-0fedcba987654321"), token=CONTROL_PLANE_TOKEN)
    assert (accepted.status_code, accepted.json()) == (200, {"applied_generation": 2})

    wait_for(lambda: stand_in.calls("/heartbeat"), timeout=15, what="a heartbeat")
    heartbeat = stand_in.calls("/heartbeat")[0]
    assert heartbeat.path.endswith("/nodes/i-0fedcba987654321/heartbeat")
    assert heartbeat.authorization == f"Bearer {NODE_TOKEN}"


def test_agent_exits_0_when_its_node_is_deleted(stand_in: StandIn, start_agent: StartAgent) -> None:
    agent = start_agent(stand_in.url, "--node-id", NODE)
    wait_for(registered(agent), timeout=15, what="registration")
    with stand_in.lock:
        stand_in.nodes.discard(NODE)
    assert agent.wait_exit(timeout=15) == 0, agent.log()


@pytest.mark.parametrize("up", [True, False], ids=["registered", "control-plane-down"])
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_agent_exits_0_on_a_signal(
    stand_in: StandIn, start_agent: StartAgent, signum: signal.Signals, up: bool
) -> None:
    url = stand_in.url if up else f"http://127.0.0.1:{free_port()}"
    agent = start_agent(url, "--node-id", NODE)
    if up:
        wait_for(registered(agent), timeout=15, what="registration")
    else:
        wait_for(
            lambda: agent.metric("hpsim_agent_heartbeat_failures_total") >= 1, timeout=15, what="a failure"
        )
    agent.process.send_signal(signum)
    assert agent.wait_exit(timeout=15) == 0, agent.log()


# The pieces, in process.


def test_apply_policy_outcomes_and_listeners() -> None:
    seen: list[tuple[int | None, int]] = []
    state = AgentState(cluster=CLUSTER, node_id=NODE)
    state.listeners.append(lambda old, new: seen.append((old.generation if old else None, new.generation)))

    assert state.apply_policy(policy(2, NODE)).status is ApplyStatus.APPLIED
    assert state.apply_policy(policy(2, NODE)).status is ApplyStatus.UNCHANGED
    stale = state.apply_policy(policy(1, NODE))
    assert (stale.status, stale.applied_generation) == (ApplyStatus.STALE, 2)
    assert state.apply_policy({"generation": True}).status is ApplyStatus.INVALID
    assert state.apply_policy(policy(5, NODE)).applied_generation == 5
    assert seen == [(None, 2), (2, 5)]
    assert (state.memory_budget_bytes, state.counters.policy_applies_total) == (5 * MIB, 2)


def test_backoff_doubles_up_to_its_cap_and_resets() -> None:
    class Top(random.Random):
        def random(self) -> float:
            return 1.0  # no jitter

    backoff = Backoff(initial_s=0.1, max_s=1.0, rng=Top())
    assert [round(backoff.next_delay(), 3) for _ in range(6)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    backoff.reset()
    assert backoff.next_delay() == pytest.approx(0.1)


def test_metrics_render_help_type_and_value() -> None:
    text = render([Metric(name="x_total", kind="counter", help="a\nb", value=3)])
    assert text == "# HELP x_total a\\nb\n# TYPE x_total counter\nx_total 3\n"


def test_loop_backs_off_on_temporary_failures_and_retries_permanent_ones_slowly() -> None:
    """The loop's waits, on an injected sleep: no wall time passes."""
    answers: list[Canned | Drop] = [
        DROP,  # register: no answer (temporary)
        Canned(503, {"error": "Unavailable"}),  # temporary
        Canned(403, {"error": "Forbidden", "message": "wrong token"}),  # permanent
        Canned(200, {"node_id": NODE, "cluster_token": CLUSTER_TOKEN, "policy": policy(1, NODE)}),
        Canned(  # not the contract: no node token, no control-plane token (permanent)
            200,
            {
                "node_id": NODE,
                "cluster_token": CLUSTER_TOKEN,
                "node_token": NODE_TOKEN,
                "control_plane_token": CONTROL_PLANE_TOKEN,
                "policy": policy(1, NODE),
            },
        ),
        Canned(500, text="oops"),  # heartbeat: temporary
        Canned(200, {"desired_generation": 1}),
        Canned(404, {"error": "NotFound", "message": "no node"}),  # the node was deleted
    ]
    paths: list[str] = []
    slept: list[float] = []

    def answer(request: Request) -> Canned | Drop:
        paths.append(request.path.rsplit("/", 1)[1])
        return answers.pop(0)

    async def sleep(seconds: float) -> None:
        slept.append(round(seconds, 3))

    class Top(random.Random):
        def random(self) -> float:
            return 1.0  # no jitter

    state = AgentState(cluster=CLUSTER, node_id=NODE)

    async def scenario() -> LoopOutcome:
        async with (
            standin(answer) as base_url,
            ControlPlaneClient(base_url=base_url, cluster=CLUSTER, timeout_s=1) as client,
        ):
            loop = AgentLoop(
                state=state,
                client=client,
                identity=Identity(endpoint="http://127.0.0.1:1", pid=1, instance_type=None, memory_bytes=0),
                token=SecretStr(LAUNCH_SECRET),
                heartbeat_interval_s=1.0,
                adopt_control_plane_interval=True,
                backoff=Backoff(initial_s=0.1, max_s=2.0, rng=Top()),
                permanent_retry_s=5.0,
                sleep=sleep,
            )
            return await loop.run()

    assert asyncio.run(scenario()) is LoopOutcome.NODE_DELETED
    assert paths == ["register"] * 5 + ["heartbeat"] * 3
    # Backoff after the request no one answered and the 503, the slow retries after the 403 and the answer
    # without the node's tokens, then the heartbeat interval after the 500 (the backoff is shorter)
    # and after the 200.
    assert slept == [0.1, 0.2, 5.0, 5.0, 1.0, 1.0]
    assert (state.registered, state.applied_generation) == (True, 1)
    assert (state.counters.heartbeat_failures_total, state.counters.heartbeats_total) == (5, 1)
    assert state.node_token is not None
    assert state.node_token.get_secret_value() == NODE_TOKEN
