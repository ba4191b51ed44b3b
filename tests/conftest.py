"""Shared fixtures: a real control plane on a loopback port, on SQLite and on PostgreSQL.

Each test gets its own database: a fresh SQLite file, or a fresh PostgreSQL database created on
the server named by ``HPSIM_TEST_POSTGRES_URL`` (PostgreSQL tests are skipped without it).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import boto3
import httpx
import pytest
import uvicorn
from botocore.config import Config
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from hyperpod_sim.api.app import create_app
from hyperpod_sim.api.deps import Services
from hyperpod_sim.cli.jobs import rendezvous_candidates
from hyperpod_sim.models.groups import InstanceGroupSpec
from hyperpod_sim.serve.seaweedfs import free_embedded_port
from hyperpod_sim.settings import Settings

# Fixtures that some test modules share, by topic.
pytest_plugins = [
    "tests.plugins.clients",
    "tests.plugins.jobs",
    "tests.plugins.namespaces",
    "tests.plugins.s3",
]

POSTGRES_URL = os.environ.get("HPSIM_TEST_POSTGRES_URL")
ROLE = "arn:aws:iam::123456789012:role/HyperPodExecution"
EKS = {"Eks": {"ClusterArn": "arn:aws:eks:us-east-1:123456789012:cluster/my-eks"}}


def shm_root_for(path: Path) -> Path:
    """A test's own shared-memory root (removed after the test by ``_clean_shm``)."""
    return Path("/dev/shm") / f"hpsim-test-{hashlib.sha1(str(path).encode()).hexdigest()[:12]}"


@pytest.fixture(autouse=True)
def _clean_shm(tmp_path: Path) -> Iterator[None]:
    yield
    shutil.rmtree(shm_root_for(tmp_path), ignore_errors=True)


def free_port() -> int:
    """A port free on 127.0.0.1 now, below the kernel's ephemeral range where one is (as the ranks'
    rendezvous of `job run`, hyperpod_sim/cli/jobs.py): between this probe and the caller's bind,
    the kernel gives no port there to another bind(0) or to a connection's source port. (A port
    from bind(0) did go to one: a job's rank 0 failed with EADDRINUSE on its MASTER_PORT.)"""
    for candidate in rendezvous_candidates():
        with contextlib.suppress(OSError), socket.socket() as sock:
            sock.bind(("127.0.0.1", candidate))
            port: int = sock.getsockname()[1]
            return port
    raise OSError("no free port on 127.0.0.1")


_S3_PORTS: dict[Path, int] = {}


def embedded_s3_port(data_dir: Path) -> int:
    """The embedded S3 port of a data dir in this test run: the same for every serve on it (its
    S3 keeps its port across restarts, as serve's default does), free for each data dir (tests of
    several helpers may run on one machine at once)."""
    if data_dir not in _S3_PORTS:
        _S3_PORTS[data_dir] = free_embedded_port()
    return _S3_PORTS[data_dir]


def wait_for(
    predicate: Callable[[], Any],
    *,
    timeout: float = 30.0,
    what: str = "condition",
    explain: Callable[[], object] | None = None,
) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout`` seconds.
    ``explain``: what the failure should show of the state (a cluster's events, say)."""
    deadline = time.monotonic() + timeout
    delay = 0.01
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            told = f": {explain()!r}" if explain is not None else ""
            raise AssertionError(f"timed out after {timeout}s waiting for {what}{told}")
        time.sleep(delay)
        delay = min(delay * 2, 0.2)


def sagemaker_client(url: str, *, validate: bool = True) -> Any:
    """boto3's SageMaker client for a control plane at ``url``: test credentials, one attempt per
    call, botocore's parameter validation unless ``validate`` is False."""
    return boto3.client(
        "sagemaker",
        endpoint_url=url,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        config=Config(parameter_validation=validate, retries={"max_attempts": 1}),
    )


class ManualClock:
    """A clock the test moves; nothing in the service waits on wall time with it."""

    def __init__(self) -> None:
        self._now = datetime(2026, 1, 1, tzinfo=UTC)
        self._lock = threading.Lock()

    def now(self) -> datetime:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += timedelta(seconds=seconds)


@dataclass
class ControlPlane:
    url: str
    services: Services
    clock: ManualClock
    database_url: str

    def client(self, *, validate: bool = True) -> Any:
        return sagemaker_client(self.url, validate=validate)

    def advance(self, seconds: float) -> None:
        """Move time on and let the reconciler act on it."""
        self.clock.advance(seconds)
        self.services.reconciler.wake()

    def settle(self, sm: Any, name: str, status: str = "InService", *, timeout: float = 30) -> dict[str, Any]:
        """Let simulated time pass (a launch delay per poll) until the cluster reaches ``status``.

        Time moves on every poll, not once: nodes the reconciler launches after the first step
        get their own launch delay, and must see it pass too.
        """

        def check() -> dict[str, Any] | None:
            self.advance(60)
            description: dict[str, Any] = sm.describe_cluster(ClusterName=name)
            return description if description["ClusterStatus"] == status else None

        result: dict[str, Any] = wait_for(check, timeout=timeout, what=f"cluster {name} to be {status}")
        return result


class ServerThread:
    """uvicorn serving an app on a loopback port, in this process (real HTTP)."""

    def __init__(self, app: Any, port: int) -> None:
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        wait_for(lambda: self.server.started, timeout=30, what="server start")
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'cp.db'}"


@pytest.fixture
def postgres_url() -> Iterator[str]:
    if not POSTGRES_URL:
        pytest.skip("HPSIM_TEST_POSTGRES_URL is not set")
    name = f"hpsim_{uuid.uuid4().hex[:12]}"
    admin = create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield make_url(POSTGRES_URL).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest) -> str:
    url: str = request.getfixturevalue(f"{request.param}_url")
    return url


def make_settings(database_url: str, data_dir: Path, **overrides: Any) -> Settings:
    settings = Settings(data_dir=data_dir, **overrides)
    settings.database.url = database_url
    return settings


@pytest.fixture
def settings_overrides() -> dict[str, Any]:
    """Override in a test module to change the control plane's settings."""
    return {}


@pytest.fixture
def control_plane(
    database_url: str, tmp_path: Path, settings_overrides: dict[str, Any]
) -> Iterator[ControlPlane]:
    """A control plane with simulated nodes (no agent processes) that launch with a 60 s delay on
    a manual clock: clusters stay Creating/Updating until the test advances the clock
    (``cp.advance(60)``, ``cp.settle(...)``). For the AWS surface; agents have their own tests."""
    overrides = {"provisioning": {"mode": "simulated", "node_ready_delay_s": 60}, **settings_overrides}
    settings = make_settings(database_url, tmp_path / "data", **overrides)
    clock = ManualClock()
    app = create_app(settings, clock=clock)
    port = free_port()
    with ServerThread(app, port):
        yield ControlPlane(
            url=f"http://127.0.0.1:{port}",
            services=app.state.services,
            clock=clock,
            database_url=database_url,
        )


@pytest.fixture
def sm(control_plane: ControlPlane) -> Any:
    return control_plane.client()


@pytest.fixture
def raw_sm(control_plane: ControlPlane) -> Any:
    """A client that sends what it is given: botocore's own checks off, to reach our validation."""
    return control_plane.client(validate=False)


def group(
    name: str = "workers", count: int = 2, instance_type: str = "ml.p5.48xlarge", **extra: Any
) -> dict[str, Any]:
    return {
        "InstanceGroupName": name,
        "InstanceType": instance_type,
        "InstanceCount": count,
        "ExecutionRole": ROLE,
        **extra,
    }


def group_spec(
    name: str = "workers", count: int = 2, instance_type: str = "ml.p5.48xlarge", **extra: Any
) -> InstanceGroupSpec:
    """``group()`` as the API hands it to the domain: its typed value."""
    spec: InstanceGroupSpec = InstanceGroupSpec.from_wire(group(name, count, instance_type, **extra))
    return spec


def status_of(sm: Any, name: str) -> str:
    status: str = sm.describe_cluster(ClusterName=name)["ClusterStatus"]
    return status


def wait_status(sm: Any, name: str, status: str, *, timeout: float = 30) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        description: dict[str, Any] = sm.describe_cluster(ClusterName=name)
        return description if description["ClusterStatus"] == status else None

    result: dict[str, Any] = wait_for(check, timeout=timeout, what=f"cluster {name} to be {status}")
    return result


def wait_gone(sm: Any, name: str, *, timeout: float = 30) -> None:
    def gone() -> bool:
        try:
            sm.describe_cluster(ClusterName=name)
        except sm.exceptions.ResourceNotFound:
            return True
        return False

    wait_for(gone, timeout=timeout, what=f"cluster {name} to be deleted")


class ServerProcess:
    """``hyperpod-sim serve`` as a real process, for tests that kill and restart it."""

    def __init__(
        self,
        database_url: str,
        data_dir: Path,
        env: dict[str, str] | None = None,
        port: int | None = None,
        host: str | None = None,
    ) -> None:
        """``host``: serve's ``--host`` (default its own, 127.0.0.1); ``url`` is there."""
        self.database_url = database_url
        self.data_dir = data_dir
        self.env = {
            "HPSIM_SIMULATION__SHM_ROOT": str(shm_root_for(data_dir)),
            "HPSIM_S3__EMBEDDED_PORT": str(embedded_s3_port(data_dir)),
            **os.environ,
            **(env or {}),
        }
        self.port = port or free_port()
        self.host = host
        self.url = f"http://{host or '127.0.0.1'}:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None
        # Its output goes to a file, not a pipe nobody reads while it runs (a full pipe would
        # stop it); a failure shows the end of it (``log_tail``).
        self.log = data_dir / f"serve-{self.port}.log"

    def log_tail(self, size: int = 4000) -> str:
        try:
            return self.log.read_bytes()[-size:].decode(errors="replace")
        except OSError:
            return ""

    def start(self) -> ServerProcess:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "hyperpod_sim", "serve", "--port", str(self.port)]
        argv += ["--database-url", self.database_url, "--data-dir", str(self.data_dir)]
        if self.host is not None:
            argv += ["--host", self.host]
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                argv,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a process group of its own, as a terminal gives it
            )
        wait_for(self._healthy, timeout=60, what="control plane process to answer /health")
        return self

    def _healthy(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise AssertionError(f"control plane exited with {self.process.returncode}: {self.log_tail()}")
        try:
            return httpx.get(f"{self.url}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def kill(self) -> None:
        """SIGKILL: no shutdown hooks run, as in a crash."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()

    def client(self) -> Any:
        return sagemaker_client(self.url)


def kill_processes_under(path: Path) -> None:
    """Kill every process whose command line mentions ``path`` (agents a test started)."""
    marker = str(path).encode()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as handle:
                if marker not in handle.read():
                    continue
            os.kill(int(entry.name), 9)
        except (OSError, ProcessLookupError):
            continue


# The agents' network of tests that tell an agent started again by its new endpoint: on the shared
# network (127.0.0.1, a free port per agent) a restarted agent has a new one; on the default
# loopback network it keeps its node's address and port 9200 (tests/test_node_addresses.py).
SHARED_NETWORK: dict[str, Any] = {"provisioning": {"node_network": "shared"}}


@pytest.fixture
def agent_settings(request: pytest.FixtureRequest) -> dict[str, Any]:
    """Settings of the agent control plane: parametrize indirectly, or override in a module."""
    return dict(getattr(request, "param", {}))


# agent_plane's heartbeat timeout: short, so that the tests of failure detection see a node fail
# within seconds; a minute for the modules marked ``patient_heartbeats`` (tests about checkpoints,
# not detection), so that a slow moment of a loaded machine (CI's two cores) never shows them a
# node replaced that no fault hit (a round trip of tests/test_sdk_checkpoint.py once saw one).
HEARTBEAT_TIMEOUT_S = 3.0
PATIENT_HEARTBEAT_TIMEOUT_S = 60.0


@pytest.fixture
def agent_plane(
    database_url: str,
    tmp_path: Path,
    agent_settings: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> Iterator[ControlPlane]:
    """A control plane whose nodes are real agent processes on loopback ports (local provisioner),
    on the real clock, with short heartbeat intervals so failures show within seconds (a minute's
    heartbeat timeout under the ``patient_heartbeats`` mark, HEARTBEAT_TIMEOUT_S). Trainers
    started by the test (in this process or as children) learn the shared-memory root the SDK may
    map from ``HPSIM_SIMULATION__SHM_ROOT``, as on a node."""
    port = free_port()
    shm_root = shm_root_for(tmp_path)
    monkeypatch.setenv("HPSIM_SIMULATION__SHM_ROOT", str(shm_root))
    provisioning = {
        "mode": "local",
        "heartbeat_interval_s": 0.2,
        "heartbeat_timeout_s": (
            PATIENT_HEARTBEAT_TIMEOUT_S
            if request.node.get_closest_marker("patient_heartbeats")
            else HEARTBEAT_TIMEOUT_S
        ),
        "launch_timeout_s": 60.0,
        **agent_settings.get("provisioning", {}),
    }
    settings = make_settings(
        database_url,
        tmp_path / "data",
        port=port,
        provisioning=provisioning,
        reconciler={"interval_s": 0.2},
        simulation={"shm_root": shm_root, **agent_settings.get("simulation", {})},
        **{key: value for key, value in agent_settings.items() if key not in ("provisioning", "simulation")},
    )
    app = create_app(settings)
    try:
        with ServerThread(app, port):
            yield ControlPlane(
                url=f"http://127.0.0.1:{port}",
                services=app.state.services,
                clock=ManualClock(),  # unused: this control plane runs on the real clock
                database_url=database_url,
            )
    finally:
        kill_processes_under(tmp_path)
        shutil.rmtree(shm_root, ignore_errors=True)


def node_token(plane: ControlPlane, node_id: str) -> str:
    """A new node token for ``node_id``, made as registration makes one (domain/nodes/credentials.py),
    for a test that plays the node's agent at the control plane. The token the node's agent held
    stops working (its pushes from the control plane still do)."""
    from hyperpod_sim.domain.nodes import credentials
    from hyperpod_sim.models import Node

    with plane.services.db.write() as session:
        node = session.get(Node, node_id)
        assert node is not None, f"no node {node_id}"
        return credentials.issue_node_token(node)


def launch_secret(plane: ControlPlane, node_id: str) -> str:
    """Bind ``node_id`` to a new launch secret, as the local provisioner does for each agent process
    it starts (hyperpod_sim/domain/nodes/credentials.py): for a test that starts the node's agent by hand."""
    from hyperpod_sim.domain.nodes import credentials
    from hyperpod_sim.models import Node

    with plane.services.db.write() as session:
        node = session.get(Node, node_id)
        assert node is not None, f"no node {node_id}"
        return credentials.bind_launch_secret(node)
