"""``hyperpod-sim job ...``: run a multi-node training job on a cluster's nodes and let it resume
by itself after a node is lost (docs/jobs.md).

``job run`` records the job (CreateJob) and starts its **supervisor**, ``hyperpod-sim job
supervise``, in a session of its own, as this user: closing the terminal does not end the job.
The supervisor asks the control plane for each attempt's nodes (StartJobAttempt), starts the
ranks on them with torchrun's environment and the node's session environment (so a lost node
ends its ranks, docs/nodes.md), writes their output to the job's log with a rank prefix, watches
the ranks and the nodes, stops every rank when one fails, and reports the end (EndJobAttempt),
which says whether the job starts again. On the namespaces node network each rank runs inside
its node's network namespace, as ``node exec`` does (cli/common.py ``on_node``). Without
``--detach``, ``job run`` follows the log and exits with the job's exit status; Ctrl+C asks the
job to stop.

Why the supervisor is not in the control plane: the control plane would then run commands that
any caller of its API hands it, as its own user (root, often). Here it runs none; the ranks are
the submitting user's processes, as with ``srun`` or ``torchrun``. The job's state is the control
plane's (a restart of serve loses nothing: the supervisor waits for it and carries on, and its
ranks run meanwhile), and a supervisor that dies fails its job and ends its ranks.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, TypeVar

from hyperpod_sim.cli.common import (
    NETNS_VARIABLE,
    CommandError,
    as_json,
    command_argv,
    epoch_time,
    exit_status,
    fields,
    on_node,
    table,
)

if TYPE_CHECKING:
    from hyperpod_sim.sdk.client import HyperPodClient

T = TypeVar("T")

POLL_S = 0.2  # how often the supervisor looks at its ranks
WATCH_S = 1.0  # how often it asks the control plane about its job and nodes
STOP_GRACE_S = 10.0  # SIGTERM to SIGKILL, for ranks being stopped
PATIENCE_S = float(os.environ.get("HPSIM_JOB_PATIENCE_S", "900"))  # a control plane away at most
ENDED = ("Succeeded", "Failed", "Stopped")
NODE_INTERFACE = "eth0"  # a node's interface on the namespaces network (infra/netns.py)


def default_log_dir() -> Path:
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(os.environ.get("HPSIM_JOB_LOG_DIR") or Path(state) / "hyperpod-sim" / "jobs")


# ---------------------------------------------------------------------- the supervisor


@dataclass
class Rank:
    rank: int
    node_id: str
    agent_url: str
    process: subprocess.Popen[bytes]
    reader: threading.Thread | None = None


@dataclass
class Supervisor:
    """Runs one job's attempts until the control plane says it has ended."""

    connect: Callable[[], HyperPodClient]
    cluster: str
    job: str
    out: IO[str] = field(default_factory=lambda: sys.stdout)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stopping: threading.Event = field(default_factory=threading.Event)

    def say(self, line: str) -> None:
        with self._lock:
            self.out.write(line if line.endswith("\n") else line + "\n")
            self.out.flush()

    def call(self, what: str, action: Callable[[HyperPodClient], T], *, waiting: str | None = None) -> T:
        """``action`` against the control plane, again while it cannot be reached (a restart of
        serve) and, with ``waiting``, while it answers ConflictException (not enough nodes)."""
        from hyperpod_sim.sdk.client import ClusterError

        deadline = time.monotonic() + PATIENCE_S
        told = False
        while True:
            try:
                with self.connect() as client:
                    return action(client)
            except ClusterError as exc:
                unreachable = exc.code in (
                    "EndpointConnectionError",
                    "ConnectTimeoutError",
                    "ReadTimeoutError",
                )
                unavailable = exc.status is not None and exc.status >= 500
                conflict = waiting is not None and exc.code == "ConflictException"
                if not (unreachable or unavailable or conflict) or time.monotonic() > deadline:
                    raise
                if not told:
                    self.say(
                        f"[job] {waiting if conflict else 'the control plane is unreachable'}: {exc.message}"
                    )
                    told = True
            time.sleep(1.0)

    def run(self) -> int:
        from hyperpod_sim.contracts.processes import start_time

        pid = os.getpid()
        started = start_time(pid) or 0
        signal.signal(signal.SIGTERM, lambda _n, _f: self._stopping.set())
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the terminal that started it may go
        while True:
            placed = self.call(
                "start",
                lambda c: c.start_job_attempt(self.cluster, self.job, pid=pid, start_time=started),
                waiting="waiting for nodes",
            )
            if placed["Attempt"] == 0:
                return self.final()
            end = self.attempt(placed)
            answer = self.call("end", functools.partial(self.report, int(placed["Attempt"]), end))
            job = answer["Job"]
            if not answer["Restart"]:
                why = f": {job['StatusMessage']}" if job.get("StatusMessage") else ""
                self.say(
                    f"[job] {job['JobName']} {job['Status'].lower()}{why}, exit status {job.get('ExitCode')}"
                )
                return int(job.get("ExitCode") or 0)
            self.say(f"[job] {job['StatusMessage']} (restart {job['Restarts']} of {job['MaxRestarts']})")

    def report(self, attempt: int, end: dict[str, Any], client: HyperPodClient) -> dict[str, Any]:
        return client.end_job_attempt(self.cluster, self.job, attempt, **end)

    def final(self) -> int:
        job = self.call("describe", lambda c: c.describe_job(self.cluster, self.job))
        self.say(f"[job] {job['JobName']} {job['Status'].lower()}")
        return int(job.get("ExitCode") or (0 if job["Status"] == "Succeeded" else 1))

    def attempt(self, placed: dict[str, Any]) -> dict[str, Any]:
        """Run one attempt to its end; how it ended (EndJobAttempt's members)."""
        job = self.call("describe", lambda c: c.describe_job(self.cluster, self.job))
        per_node = int(job["ProcessesPerNode"])
        nodes = placed["Nodes"]
        world = len(nodes) * per_node
        master = nodes[0]["Address"]
        try:
            # On the namespaces node network each rank runs inside its node's network namespace.
            commands = [
                on_node(job["Command"], node["Environment"], node["NodeId"], command="job run")
                for node in nodes
            ]
            port = free_port(master, nodes[0]["Environment"])
        except (CommandError, OSError) as exc:
            self.say(f"[job] the ranks cannot start: {getattr(exc, 'message', exc)}")
            return {"ExitCode": 126, "Cause": "RankExit", "Rank": 0}
        self.say(
            f"[job] attempt {placed['Attempt']}: {world} rank(s) on {', '.join(n['NodeId'] for n in nodes)} "
            f"(MASTER_ADDR={master}, MASTER_PORT={port})"
        )
        ranks: list[Rank] = []
        for group, node in enumerate(nodes):
            for local in range(per_node):
                rank = group * per_node + local
                env = {
                    **os.environ,
                    **node["Environment"],
                    "RANK": str(rank),
                    "WORLD_SIZE": str(world),
                    "LOCAL_RANK": str(local),
                    "LOCAL_WORLD_SIZE": str(per_node),
                    "GROUP_RANK": str(group),
                    "GROUP_WORLD_SIZE": str(len(nodes)),
                    "ROLE_RANK": str(rank),
                    "ROLE_WORLD_SIZE": str(world),
                    "MASTER_ADDR": master,
                    "MASTER_PORT": str(port),
                    "TORCHELASTIC_RESTART_COUNT": str(placed["Attempt"] - 1),
                    "HPSIM_JOB_ATTEMPT": str(placed["Attempt"]),
                }
                if NETNS_VARIABLE in node["Environment"]:
                    # gloo takes the address of this host's name, loopback inside a namespace (where
                    # the other nodes cannot reach it): the node's own interface instead.
                    env.setdefault("GLOO_SOCKET_IFNAME", NODE_INTERFACE)
                try:
                    process = subprocess.Popen(
                        commands[group],
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,  # its own group: stopped with everything it started
                    )
                except OSError as exc:
                    self.say(f"[job] rank {rank} could not start: {exc}")
                    self.stop(ranks)
                    return {
                        "ExitCode": 127 if isinstance(exc, FileNotFoundError) else 126,
                        "Cause": "RankExit",
                        "Rank": rank,
                    }
                entry = Rank(rank, node["NodeId"], node["Environment"].get("HPSIM_AGENT_URL", ""), process)
                entry.reader = threading.Thread(target=self.relay, args=(entry,), daemon=True)
                entry.reader.start()
                ranks.append(entry)
        return self.watch(ranks)

    def relay(self, rank: Rank) -> None:
        assert rank.process.stdout is not None
        for raw in rank.process.stdout:
            self.say(f"[rank {rank.rank}] {raw.decode(errors='replace').rstrip()}")

    def watch(self, ranks: list[Rank]) -> dict[str, Any]:
        last_watch = 0.0
        while True:
            if self._stopping.is_set():
                self.stop(ranks)
                return {"ExitCode": 143, "Cause": "Stopped"}
            codes = [r.process.poll() for r in ranks]
            if all(code == 0 for code in codes):
                self.drain(ranks)
                return {"ExitCode": 0, "Cause": "Succeeded"}
            failed = next((r for r, code in zip(ranks, codes, strict=True) if code not in (None, 0)), None)
            if failed is not None:
                code = exit_status(failed.process.returncode)
                self.stop(ranks)
                node = self.failed_node(ranks, patient=failed.process.returncode == -signal.SIGKILL)
                if node is not None:
                    return {"ExitCode": code, "Cause": "NodeFailure", "NodeId": node, "Rank": failed.rank}
                return {"ExitCode": code, "Cause": "RankExit", "Rank": failed.rank}
            now = time.monotonic()
            if now - last_watch >= WATCH_S:
                last_watch = now
                job = self.described()
                if job is not None:
                    if job.get("StopRequested"):
                        self.stop(ranks)
                        return {"ExitCode": 143, "Cause": "Stopped"}
                    bad = next(
                        (n for n, s in (job.get("NodeStatuses") or {}).items() if s != "Running"), None
                    )
                    if bad is not None:
                        self.say(f"[job] node {bad} is {job['NodeStatuses'][bad]}: stopping every rank")
                        self.stop(ranks)
                        return {"ExitCode": 137, "Cause": "NodeFailure", "NodeId": bad}
            time.sleep(POLL_S)

    def described(self) -> dict[str, Any] | None:
        from hyperpod_sim.sdk.client import ClusterError

        try:
            with self.connect() as client:
                return client.describe_job(self.cluster, self.job)
        except ClusterError:
            return None  # away for now (a restart of serve): the ranks run on

    def failed_node(self, ranks: list[Rank], *, patient: bool) -> str | None:
        """The node of the attempt that failed, if one did: a rank killed by SIGKILL is what a
        lost node does to its processes, and the loss may take a moment to be recorded."""
        deadline = time.monotonic() + (5.0 if patient else 0.0)
        while True:
            job = self.described()
            bad = next(
                (n for n, s in ((job or {}).get("NodeStatuses") or {}).items() if s != "Running"), None
            )
            if bad is not None or time.monotonic() >= deadline:
                return bad
            time.sleep(0.25)

    def stop(self, ranks: list[Rank]) -> None:
        """SIGTERM every rank's process group, SIGKILL after the grace period."""
        for rank in ranks:
            if rank.process.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(rank.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for rank in ranks:
            with contextlib.suppress(subprocess.TimeoutExpired):
                rank.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(rank.process.pid, signal.SIGKILL)
            rank.process.wait()
        self.drain(ranks)

    @staticmethod
    def drain(ranks: list[Rank]) -> None:
        for rank in ranks:
            if rank.reader is not None:
                rank.reader.join(timeout=5)


# The ranks' rendezvous port is chosen below the kernel's ephemeral range: a port the probe found
# free there cannot be handed, before rank 0 binds it, to a connection's source or another
# socket's bind(0) (a job's rank 0 once failed with EADDRINUSE that way). Where the range starts
# too low for that, any free port.
RENDEZVOUS_LOW_PORT = 10000
RENDEZVOUS_TRIES = 64


def rendezvous_candidates() -> list[int]:
    """Ports to try for the ranks' rendezvous, in order: random ones between RENDEZVOUS_LOW_PORT
    and the ephemeral range, then 0 (any free port)."""
    try:
        ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = RENDEZVOUS_LOW_PORT
    below = range(RENDEZVOUS_LOW_PORT, ephemeral)
    return [*random.sample(below, min(RENDEZVOUS_TRIES, len(below))), 0]


def free_port(address: str, environment: dict[str, str]) -> int:
    """A port free on ``address`` now (the rendezvous of the ranks), else one of 127.0.0.1.

    On the namespaces node network ``address`` is inside the first node's network namespace,
    where this host can neither bind nor see what is bound: the probe runs in that namespace."""
    candidates = rendezvous_candidates()
    if environment.get(NETNS_VARIABLE):
        probe = (
            "import socket\n"
            f"for port in {candidates!r}:\n"
            "    s = socket.socket()\n"
            "    try:\n"
            f"        s.bind(({address!r}, port))\n"
            "    except OSError:\n"
            "        continue\n"
            "    print(s.getsockname()[1])\n"
            "    break\n"
        )
        node = environment.get("HPSIM_NODE_ID", address)
        argv = on_node([sys.executable, "-c", probe], environment, node, command="job run")
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
        except subprocess.TimeoutExpired as exc:
            raise OSError(f"no free port on the node's address {address}: the probe hung") from exc
        if done.returncode != 0 or not done.stdout.strip().isdigit():
            raise OSError(f"no free port on the node's address {address}: {done.stderr.strip()}")
        return int(done.stdout)
    for host in (address, "127.0.0.1"):
        for candidate in candidates:
            with (
                contextlib.suppress(OSError),
                socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe_socket,
            ):
                probe_socket.bind((host, candidate))
                port: int = probe_socket.getsockname()[1]
                return port
    raise OSError("no free port for the ranks' rendezvous")


# ---------------------------------------------------------------------- commands


def _client_factory(args: argparse.Namespace) -> Callable[[], HyperPodClient]:
    from hyperpod_sim.cli.common import client_for

    return lambda: client_for(args)


def job_supervise(client: HyperPodClient, args: argparse.Namespace) -> int:
    return Supervisor(_client_factory(args), args.cluster, args.job).run()


def job_run(client: HyperPodClient, args: argparse.Namespace) -> int:
    argv = command_argv(args.argv, "hyperpod-sim job run --cluster C -- CMD [ARGS...]")
    log_dir = Path(args.log_dir) if args.log_dir else default_log_dir()
    log_dir.mkdir(parents=True, exist_ok=True)
    spec: dict[str, Any] = {
        "Command": argv,
        "AutoResume": args.auto_resume,
        "ProcessesPerNode": args.procs_per_node,
    }
    for member, value in (
        ("JobName", args.job_name),
        ("NodeCount", args.nodes),
        ("MaxRestarts", args.max_restarts),
    ):
        if value is not None:
            spec[member] = value
    created = client.create_job(args.cluster, **spec)
    job_id = created["JobId"]
    log_path = log_dir / f"{job_id}.log"
    supervise = [sys.executable, "-m", "hyperpod_sim", "job", "supervise", "--cluster", args.cluster, job_id]
    supervise += ["--endpoint-url", client.endpoint_url] + (
        ["--profile", args.profile] if args.profile else []
    )
    with open(log_path, "ab") as log:
        os.chmod(log_path, 0o600)
        subprocess.Popen(
            supervise, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    print(f"job {created['JobName']} ({job_id}) submitted; its output: {log_path}", file=sys.stderr)
    if args.detach:
        print(job_id)
        return 0
    return follow(client, args.cluster, job_id, log_path)


def follow(client: HyperPodClient, cluster: str, job_id: str, log_path: Path) -> int:
    """Print the job's log as it grows until the job has ended; its exit status. Ctrl+C asks the
    job to stop (a second one leaves it running)."""
    interrupted = 0
    position = 0
    status: dict[str, Any] = {}
    while True:
        try:
            position = _print_from(log_path, position)
            status = client.describe_job(cluster, job_id)
            if status["Status"] in ENDED:
                time.sleep(0.3)  # the supervisor's last lines
                _print_from(log_path, position)
                return int(status.get("ExitCode") or (0 if status["Status"] == "Succeeded" else 1))
            time.sleep(0.3)
        except KeyboardInterrupt:
            interrupted += 1
            if interrupted > 1:
                print(
                    f"\nleft job {job_id} running: hyperpod-sim job describe --cluster {cluster} {job_id}",
                    file=sys.stderr,
                )
                return 130
            print(f"\nstopping job {job_id} (Ctrl+C again to leave it running)", file=sys.stderr)
            client.stop_job(cluster, job_id)


def _print_from(path: Path, position: int) -> int:
    with contextlib.suppress(FileNotFoundError), open(path, "rb") as log:
        log.seek(position)
        chunk = log.read()
        if chunk:
            sys.stdout.write(chunk.decode(errors="replace"))
            sys.stdout.flush()
        return position + len(chunk)
    return position


def _attempts(job: dict[str, Any]) -> str:
    rows = [
        (
            a["Attempt"],
            a["Status"],
            ", ".join(a["Nodes"]),
            "" if a.get("ExitCode") is None else a["ExitCode"],
            a.get("Cause") or "",
            a.get("CauseNodeId") or ("" if a.get("CauseRank") is None else f"rank {a['CauseRank']}"),
        )
        for a in job["Attempts"]
    ]
    return table(["ATTEMPT", "STATUS", "NODES", "EXIT", "CAUSE", "BY"], rows)


def job_describe(client: HyperPodClient, args: argparse.Namespace) -> int:
    job = client.describe_job(args.cluster, args.job)
    if args.json:
        print(as_json(job))
        return 0
    print(
        fields(
            [
                ("Job", f"{job['JobName']} ({job['JobId']})"),
                ("Status", job["Status"]),
                ("Message", job.get("StatusMessage")),
                ("Command", " ".join(job["Command"])),
                ("Shape", f"{job.get('NodeCount') or 'every'} node(s) x {job['ProcessesPerNode']}"),
                (
                    "Auto-resume",
                    f"restarts {job['Restarts']} of {job['MaxRestarts']}" if job["AutoResume"] else "off",
                ),
                ("Exit status", job.get("ExitCode")),
                ("Submitted", epoch_time(job.get("CreatedAt"))),
                ("Ended", epoch_time(job.get("EndedAt"))),
                ("Log", job.get("LogPath")),
            ]
        )
    )
    if job["Attempts"]:
        print()
        print(_attempts(job))
    return 0


def job_list(client: HyperPodClient, args: argparse.Namespace) -> int:
    jobs = client.list_jobs(args.cluster)
    if args.json:
        print(as_json(jobs))
        return 0
    rows = [
        (
            j["JobName"],
            j["JobId"],
            j["Status"],
            len(j["Attempts"]),
            "" if j.get("ExitCode") is None else j["ExitCode"],
        )
        for j in jobs
    ]
    print(table(["NAME", "ID", "STATUS", "ATTEMPTS", "EXIT"], rows))
    return 0


def job_stop(client: HyperPodClient, args: argparse.Namespace) -> int:
    job = client.stop_job(args.cluster, args.job)
    print(
        f"job {job['JobName']} ({job['JobId']}): {job['Status']}"
        + (", stopping" if job["Status"] not in ENDED else "")
    )
    return 0


def add_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> argparse.ArgumentParser:
    """The ``job`` subcommand of ``hyperpod-sim``."""
    job = sub.add_parser(
        "job",
        help="run training jobs on a cluster's nodes, resumed after a node is lost",
        description="Multi-node jobs on a cluster of the local provisioner (docs/jobs.md).",
    )
    commands = job.add_subparsers(dest="job_command", required=True, metavar="COMMAND")
    run = commands.add_parser(
        "run",
        parents=[common],
        help="run a job and follow its output",
        description="Place the job on --nodes Running nodes (default: all) and start --procs-per-node "
        "processes of CMD on each, with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, "
        "LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR = the first node's address, MASTER_PORT) and the "
        "node's (HPSIM_NODE_ID, HPSIM_AGENT_URL, ...). Output comes back with a rank prefix; the exit "
        "status is the job's. With --auto-resume, a failed node or rank restarts the whole job (up "
        "to --max-restarts times) once it has its nodes Running again. The job runs on when this "
        "terminal closes; Ctrl+C stops it.",
    )
    run.add_argument("--cluster", required=True, help="the cluster")
    run.add_argument("--nodes", type=int, help="nodes to run on (default: every Running node)")
    run.add_argument("--procs-per-node", type=int, default=1, help="processes per node (default 1)")
    run.add_argument("--auto-resume", action="store_true", help="restart the job after a failure")
    run.add_argument("--max-restarts", type=int, help="restarts at most with --auto-resume (default 3)")
    run.add_argument("--name", dest="job_name", help="the job's name (default: its id)")
    run.add_argument("--detach", action="store_true", help="print the job's id and return at once")
    run.add_argument(
        "--log-dir",
        help="where the job's log goes (default $HPSIM_JOB_LOG_DIR, else ~/.local/state/hyperpod-sim/jobs)",
    )
    run.add_argument(
        "argv", nargs=argparse.REMAINDER, metavar="-- CMD [ARGS...]", help="the command of every rank"
    )
    run.set_defaults(
        action=job_run,
        flags={
            "ClusterName": "--cluster",
            "NodeCount": "--nodes",
            "ProcessesPerNode": "--procs-per-node",
            "MaxRestarts": "--max-restarts",
            "JobName": "--name",
        },
    )
    for name, action, text in (
        ("describe", job_describe, "a job: status, attempts, nodes, exit codes"),
        ("stop", job_stop, "stop a job (every rank)"),
    ):
        parser = commands.add_parser(name, parents=[common], help=text)
        parser.add_argument("--cluster", required=True, help="the cluster")
        parser.add_argument("job", help="the job's id or name")
        if name == "describe":
            parser.add_argument("--json", action="store_true", help="the DescribeJob answer as JSON")
        parser.set_defaults(action=action)
    listing = commands.add_parser("list", parents=[common], help="the cluster's jobs")
    listing.add_argument("--cluster", required=True, help="the cluster")
    listing.add_argument("--json", action="store_true", help="the jobs as JSON")
    listing.set_defaults(action=job_list)
    supervise = commands.add_parser("supervise", parents=[common], help=argparse.SUPPRESS)
    supervise.add_argument("--cluster", required=True)
    supervise.add_argument("job")
    supervise.set_defaults(action=job_supervise)
    return job
