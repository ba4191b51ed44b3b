"""``hyperpod-sim demo``: a training job rides out the loss of a node, end to end, in a minute.

It starts its own control plane (``hyperpod-sim serve`` on a free port: SQLite, local agents, the
embedded S3, all under a temporary directory), creates a 3-node tiered-storage cluster with
``NodeRecovery: Automatic``, and runs ``examples/train_tiered.py`` with 2 ranks: a checkpoint to
memory every 2 steps, to S3 every 8, as a job on the cluster (``hyperpod-sim job run
--auto-resume``: 2 ranks on 2 of its nodes). At ``--fail-at`` it injects ``NodeLoss`` on the node
of rank 1 (its agent killed, its shared memory wiped, rank 1 ended with it, as a machine's loss
ends its processes). The job stops every rank, the control plane replaces the node, and the job
starts again on the replacement by itself and resumes from the newest complete checkpoint. The
report says how long each part took from the injection (the job stopped, the node replaced, the
job restarted), which tier served the restore, how many steps were lost, how long the restore
took, and the cluster's events in order.

It needs the repository checkout (the example lives in ``examples/``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_tiered.py"
CLUSTER = "demo"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _say(text: str) -> None:
    print(f"[demo] {text}", flush=True)


def run(args: argparse.Namespace) -> int:
    if not EXAMPLE.exists():
        print(f"error: the demo needs {EXAMPLE} (run it from the repository checkout)", file=sys.stderr)
        return 1
    from hyperpod_sim.sdk.client import HyperPodClient

    workdir = Path(tempfile.mkdtemp(prefix="hpsim-demo-"))
    shm_root = Path(f"/dev/shm/hpsim-demo-{os.getpid()}")
    os.environ["HPSIM_SIMULATION__SHM_ROOT"] = str(shm_root)  # the trainers map only under it
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "HPSIM_SIMULATION__SHM_ROOT": str(shm_root),
        "HPSIM_PROVISIONING__HEARTBEAT_INTERVAL_S": "0.5",
        "HPSIM_PROVISIONING__HEARTBEAT_TIMEOUT_S": "3",
        "HPSIM_RECONCILER__INTERVAL_S": "0.5",
        # Its own data dir, so its own S3 ports too: a `make run` beside it keeps the defaults.
        "HPSIM_S3__EMBEDDED_PORT": os.environ.get("HPSIM_S3__EMBEDDED_PORT", "0"),
    }
    log = open(workdir / "serve.log", "wb")  # noqa: SIM115 - closed in finally
    serve = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hyperpod_sim",
            "serve",
            "--port",
            str(port),
            "--data-dir",
            str(workdir / "data"),
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        _wait_healthy(url, serve, workdir / "serve.log")
        _say(f"control plane on {url} (SQLite, local agents, embedded S3) in {workdir}")
        with HyperPodClient(url) as client:
            report = _scenario(args, client, url, workdir)
        _print_report(report)
        return 0
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            serve.wait(timeout=30)
        except subprocess.TimeoutExpired:
            serve.kill()
        log.close()
        _kill_agents(workdir)
        shutil.rmtree(shm_root, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


def _wait_healthy(url: str, serve: subprocess.Popen[bytes], log: Path) -> None:
    import httpx

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if serve.poll() is not None:
            said = log.read_text(errors="replace").strip().splitlines()[-5:]
            raise SystemExit(f"the control plane exited with {serve.returncode}: " + "\n".join(said))
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit("the control plane did not start within 60 s")


def _kill_agents(workdir: Path) -> None:
    """Agents whose command line names this demo's data directory (they outlive a killed serve)."""
    marker = str(workdir).encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker in (entry / "cmdline").read_bytes():
                os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            continue


def _train(
    args: argparse.Namespace, url: str, workdir: Path, report: Path, on_line: Any = None
) -> tuple[int, list[str]]:
    """The example as a job on the cluster (``job run --auto-resume``): 2 ranks on 2 of its 3
    nodes; what it printed, line by line (rank 0's and the supervisor's shown as they come)."""
    argv = [
        sys.executable, str(EXAMPLE), "--endpoint-url", url, "--cluster", CLUSTER, "--ranks", "2",
        "--nodes", "3", "--steps", str(args.steps), "--save-every", "2", "--s3-every", "8",
        "--report", str(report),
    ]  # fmt: skip
    env = {**os.environ, "HPSIM_JOB_LOG_DIR": str(workdir / "jobs")}
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env
    )
    lines: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip()
        lines.append(line)
        shown = line.removeprefix("[rank 0] ")
        # Rank 0 speaks for the job; its "resumed from" line is left out: the report gives the
        # restore, once.
        spoken = shown != line or line.startswith("[job]")
        if spoken and not shown.startswith(("resumed from", "Traceback", "  ")):
            print(f"  | {shown}", flush=True)
        if on_line is not None:
            on_line(shown if shown != line else "")
    return proc.wait(), lines


def _event_time(events: list[dict[str, Any]], prefix: str, *, contains: str = "") -> float | None:
    """When the first event starting with ``prefix`` (and holding ``contains``) was recorded."""
    for event in events:
        text = event.get("Description", "")
        if text.startswith(prefix) and contains in text:
            when = event["EventTime"]
            return float(when.timestamp() if hasattr(when, "timestamp") else when)
    return None


def _scenario(args: argparse.Namespace, client: Any, url: str, workdir: Path) -> dict[str, Any]:
    from hyperpod_sim.sdk.client import ClusterError

    _say(
        "a 2-rank job on a 3-node cluster, through `hyperpod-sim job run --auto-resume`; node loss "
        f"injected at the first step reported from step {args.fail_at} on"
    )
    victim: dict[str, str] = {}

    def inject(line: str) -> None:
        match = re.match(r"step\s+(\d+)", line)
        if victim or match is None or int(match.group(1)) < args.fail_at:
            return
        (job,) = client.list_jobs(CLUSTER)
        node = job["Attempts"][-1]["Nodes"][1]  # rank 1's node
        try:
            client.inject_fault(CLUSTER, Type="NodeLoss", InstanceId=node)
        except ClusterError as exc:
            _say(f"could not inject the fault: {exc}")
            return
        victim.update(node=node, step=match.group(1))
        _say(f"NodeLoss injected on {node} (rank 1's node) after step {match.group(1)}")

    report_path = workdir / "ranks"
    code, lines = _train(args, url, workdir, report_path, inject)
    if not victim:
        raise SystemExit(f"the job ended (exit {code}) before step {args.fail_at}: nothing was injected")
    if code != 0:
        raise SystemExit(f"the job failed with exit status {code}")
    (job,) = client.list_jobs(CLUSTER)
    if len(job["Attempts"]) != 2:
        raise SystemExit(f"the job ran {len(job['Attempts'])} attempt(s), not 2: {job['Attempts']}")
    first, second = job["Attempts"]
    summaries = [json.loads(Path(f"{report_path}.{r}").read_text()) for r in range(2)]
    resumed = summaries[0]["resumed"]
    restart = next(i for i, line in enumerate(lines) if line.startswith("[job] attempt 2"))
    last_step = max(
        int(m.group(1)) for line in lines[:restart] if (m := re.match(r"\[rank 0\] step\s+(\d+)", line))
    )
    events = list(reversed(client.events(CLUSTER)))
    injected = _event_time(events, "Fault", contains=f"NodeLoss on node {victim['node']}")
    ended = float(first["EndedAt"])
    replacement = second["Nodes"][1]
    running = _event_time(events, f"Node {replacement} is Running")
    started = float(second["StartedAt"])
    return {
        "victim": victim["node"],
        "replacement": replacement,
        "failed_at_step": int(victim["step"]),
        "last_step_trained": last_step,
        "resumed_step": resumed.get("step"),
        "steps_lost": last_step - int(resumed.get("step") or 0),
        "tiers": {f"rank {s['rank']}": s["resumed"].get("tiers") for s in summaries},
        # From the injection: the job stopped (detection), the replacement Running, the job
        # started again; then the restore (its slowest rank: the job resumes when it has loaded).
        "detected_seconds": ended - injected if injected is not None else None,
        "replaced_seconds": running - injected if running is not None and injected is not None else None,
        "restarted_seconds": started - injected if injected is not None else None,
        "restore_seconds": max(float(s["resumed"].get("seconds") or 0) for s in summaries),
        "events": events,
        "s3": client.checkpoints(CLUSTER),
    }


def served_by_table(tiers: dict[str, dict[str, str] | None]) -> str:
    """{'rank 0': {'0': 'memory', '1': 'replica'}, ...} as rows of readers, columns of shards."""
    from hyperpod_sim.cli.common import table

    shards = sorted({int(shard) for read in tiers.values() for shard in (read or {})})
    rows = [[reader, *((read or {}).get(str(shard)) for shard in shards)] for reader, read in tiers.items()]
    return table(["READER", *(f"SHARD OF RANK {shard}" for shard in shards)], rows)


def _seconds(value: float | None) -> str:
    return f"{value:.1f} s" if value is not None else "unknown"


def _print_report(report: dict[str, Any]) -> None:
    print("\n=== demo report ===", flush=True)
    print(f"node lost:        {report['victim']} (rank 1's node), after step {report['failed_at_step']}")
    print(f"job stopped:      {_seconds(report['detected_seconds'])} from the injection (every rank)")
    print(
        f"replaced in:      {_seconds(report['replaced_seconds'])} from the injection "
        f"({report['replacement']} Running)"
    )
    print(f"job restarted:    {_seconds(report['restarted_seconds'])} from the injection, on the replacement")
    print(f"last step run:    {report['last_step_trained']}")
    print(f"resumed from:     step {report['resumed_step']}  ({report['steps_lost']} steps lost)")
    print(f"restore took:     {report['restore_seconds']:.2f} s (the slower of the 2 ranks)")
    print("served by:        the tier each rank's restore read each shard from")
    for line in served_by_table(report["tiers"]).splitlines():
        print(f"  {line}")
    for namespace in report["s3"].get("Namespaces", []):
        on_s3 = [s["Step"] for s in namespace["Steps"] if s["S3"]]
        print(f"on S3:            {namespace['Namespace']}: steps {on_s3}")
    print("events:")
    for event in report["events"]:
        when = event["EventTime"]
        stamp = when.strftime("%H:%M:%S") if hasattr(when, "strftime") else str(when)
        print(f"  {stamp}  {event.get('Description', '')}")
    sys.stdout.flush()


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    demo = sub.add_parser(
        "demo",
        help="run the node-loss demo end to end",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument("--steps", type=int, default=24, help="training steps (default 24)")
    demo.add_argument(
        "--fail-at", type=int, default=13, help="inject the node loss after this step (default 13)"
    )
    demo.add_argument("--keep", action="store_true", help="keep the temporary directory (logs, database)")
    demo.set_defaults(func=run)
