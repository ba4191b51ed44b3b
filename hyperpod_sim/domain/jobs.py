"""Training jobs on a cluster's nodes: the record of each job and its attempts, where each attempt
runs, and whether a job that failed starts again (auto-resume).

The control plane does not run a job's ranks: its supervisor does (``hyperpod-sim job
supervise``, started by ``job run`` in a session of its own, as the user who submitted the job),
so no code handed to the control plane over HTTP ever runs as the control plane's user. What the
control plane decides is where and whether:

- **Where.** The first attempt runs on the first ``node_count`` Running nodes (in node order). A
  restart keeps each node of the previous attempt that still runs, in its place (its ranks keep
  their numbers); a lost node's place goes, with NodeRecovery Automatic, to its replacement (the
  node in its slot: the restart waits for it), else to a healthy spare of the cluster. Each node
  gets its session environment (domain/nodes/sessions.py: a lost node ends its ranks as it ends
  every process on it).
- **Whether.** An attempt ends when every rank exited 0 (the job Succeeded), when a rank exited
  otherwise or a node of it failed (the supervisor stops every rank), or when a stop was asked.
  A job with ``auto_resume`` starts again, up to ``max_restarts`` times, once it has its nodes
  Running again; otherwise it Failed with the failing rank's exit status.

Every start, end and restart is a cluster event naming the job (and the node that caused it).
The supervisor's pid is recorded: a job whose supervisor is gone is Failed (and its ranks, marked
with the job's id, ended) the next time the job is read.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum

from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload

from hyperpod_sim.domain import events, faults
from hyperpod_sim.domain.cluster_reads import get_cluster
from hyperpod_sim.domain.errors import ConflictException, ResourceNotFound, ValidationException
from hyperpod_sim.domain.events import Level
from hyperpod_sim.domain.lifecycle import NodeStatus
from hyperpod_sim.domain.provisioning import Provisioner
from hyperpod_sim.domain.service import DomainService
from hyperpod_sim.models import Cluster, Job, JobAttempt, Node

JOB_MARK = "HPSIM_JOB_ID"  # in every rank's environment: the job it belongs to


def _title(job: Job) -> str:
    """``Job NAME (ID)`` in events, ``Job ID`` for a job named by its id."""
    return f"Job {job.id}" if job.name == job.id else f"Job {job.name} ({job.id})"


def _slot(node: Node) -> str:
    return f"{node.group_name}/{node.slot}"


class JobStatus(StrEnum):
    PENDING = "Pending"  # waiting for its nodes (the first start, or a restart)
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    STOPPED = "Stopped"


ENDED = frozenset({JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED})


class EndCause(StrEnum):
    SUCCEEDED = "Succeeded"
    RANK_EXIT = "RankExit"
    NODE_FAILURE = "NodeFailure"
    STOPPED = "Stopped"


@dataclass(frozen=True)
class JobSpec:
    name: str | None
    command: list[str]
    node_count: int | None
    procs_per_node: int
    auto_resume: bool
    max_restarts: int


@dataclass(frozen=True)
class PlacedNode:
    node_id: str
    address: str
    environment: dict[str, str]


@dataclass(frozen=True)
class Placement:
    """An attempt just started: its number and its nodes, in group-rank order (attempt 0, no
    nodes: the job was stopped while it waited, and has ended)."""

    job: Job
    attempt: int
    nodes: list[PlacedNode]


@dataclass(frozen=True)
class AttemptEnd:
    exit_code: int
    cause: EndCause
    node_id: str | None = None
    rank: int | None = None


@dataclass(kw_only=True, eq=False)
class JobService(DomainService):
    provisioner: Provisioner
    # Whether a supervisor process still runs (pid, start time); infra/processes.py on this machine.
    supervisor_alive: Callable[[int, int], bool] = field(default=lambda pid, start: True)
    # End the ranks of a job whose supervisor is gone (infra/node_processes.py, by JOB_MARK).
    end_ranks: Callable[[str], list[int]] = field(default=lambda job_id: [])

    # ------------------------------------------------------------------ reads

    def _job(self, session: Session, cluster: Cluster, job: str, *, lock: bool = False) -> Job:
        query = (
            select(Job)
            .where(Job.cluster_id == cluster.id, (Job.id == job) | (Job.name == job))
            .options(selectinload(Job.attempts))
        )
        if lock:
            query = query.with_for_update()
        found = session.scalars(query).one_or_none()
        if found is None:
            raise ResourceNotFound(f"Job '{job}' does not exist in cluster '{cluster.name}'.")
        return found

    def list_jobs(self, *, name: str) -> tuple[Cluster, list[Job]]:
        self._end_orphans(name)
        with self.db.read() as session:
            cluster = get_cluster(session, name)
            jobs = session.scalars(
                select(Job)
                .where(Job.cluster_id == cluster.id)
                .options(selectinload(Job.attempts))
                .order_by(Job.created_at, Job.id)
            ).all()
            return cluster, list(jobs)

    def describe_job(self, *, name: str, job: str) -> tuple[Cluster, Job, dict[str, str]]:
        """The job, and the status of each node of its current attempt (the supervisor watches it)."""
        self._end_orphans(name)
        with self.db.read() as session:
            cluster = get_cluster(session, name, selectinload(Cluster.nodes))
            found = self._job(session, cluster, job)
            current = found.attempts[-1].nodes if found.attempts else []
            # A node with a NodeLoss in force is lost although it shows Running until the control
            # plane fails it (the heartbeat timeout): the supervisor must not wait for that.
            lost = faults.lost_nodes(cluster)
            statuses = {n.id: "Lost" if n.id in lost else n.status for n in cluster.nodes}
            return cluster, found, {node: statuses.get(node, "Gone") for node in current}

    def _end_orphans(self, name: str) -> None:
        """Fail the jobs of cluster ``name`` that have not ended but whose supervisor is gone."""
        with self.db.read() as session:
            cluster = get_cluster(session, name)
            live = session.scalars(
                select(Job).where(
                    Job.cluster_id == cluster.id, Job.status.in_([JobStatus.PENDING, JobStatus.RUNNING])
                )
            ).all()
            orphans = [
                j.id
                for j in live
                if j.supervisor_pid is not None
                and not self.supervisor_alive(j.supervisor_pid, j.supervisor_start_time or -1)
            ]
        for job_id in orphans:
            now = self.clock.now()
            with self.db.write() as session:
                cluster = get_cluster(session, name, lock=True)
                job = self._job(session, cluster, job_id, lock=True)
                if job.status in ENDED:
                    continue
                ended = self.end_ranks(job.id)
                self._close(job, JobStatus.FAILED, now=now, exit_code=None)
                job.status_message = f"its supervisor (pid {job.supervisor_pid}) exited"
                events.record(
                    session,
                    ids=self.ids,
                    now=now,
                    cluster=cluster,
                    level=Level.ERROR,
                    description=f"{_title(job)} failed: its supervisor "
                    f"(pid {job.supervisor_pid}) exited while the job ran; "
                    f"{len(ended)} rank process(es) ended.",
                )

    # ------------------------------------------------------------------ changes

    def create_job(self, *, name: str, spec: JobSpec, log_path: str | None) -> tuple[Cluster, Job]:
        if not self.provisioner.owns_agents:
            raise ValidationException(
                "Jobs run on the nodes of the local provisioner only (their ranks are processes on this "
                "machine): HPSIM_PROVISIONING__MODE=local."
            )
        if not spec.command:
            raise ValidationException("Command must name a program to run.")
        now = self.clock.now()
        job_id = "j-" + secrets.token_hex(8)
        with self.db.write() as session:
            cluster = get_cluster(session, name, lock=True)
            job_name = spec.name or job_id
            taken = session.scalars(
                select(Job.id).where(Job.cluster_id == cluster.id, Job.name == job_name)
            ).first()
            if taken is not None:
                raise ConflictException(f"Job '{job_name}' already exists in cluster '{cluster.name}'.")
            job = Job(
                id=job_id,
                cluster_id=cluster.id,
                name=job_name,
                command=list(spec.command),
                node_count=spec.node_count,
                procs_per_node=spec.procs_per_node,
                auto_resume=spec.auto_resume,
                max_restarts=spec.max_restarts,
                status=JobStatus.PENDING,
                restarts=0,
                stop_requested=False,
                log_path=log_path,
                created_at=now,
            )
            session.add(job)
            events.record(
                session,
                ids=self.ids,
                now=now,
                cluster=cluster,
                description=f"{_title(job)} submitted: {spec.node_count or 'every'} node(s), "
                f"{spec.procs_per_node} process(es) per node"
                + (f", auto-resume up to {spec.max_restarts} restart(s)" if spec.auto_resume else "")
                + ".",
            )
            session.flush()
            session.refresh(job, ["attempts"])
            return cluster, job

    def start_attempt(
        self, *, name: str, job: str, supervisor_pid: int, supervisor_start_time: int
    ) -> Placement:
        """Place the job's next attempt on its nodes; ConflictException while it does not have
        enough Running nodes (the supervisor asks again), or once it has ended."""
        now = self.clock.now()
        with self.db.write() as session:
            cluster = get_cluster(session, name, selectinload(Cluster.nodes), lock=True)
            found = self._job(session, cluster, job, lock=True)
            if found.status in ENDED:
                raise ConflictException(f"Job '{found.name}' has ended ({found.status}).")
            if found.attempts and found.attempts[-1].ended_at is None:
                raise ConflictException(f"Job '{found.name}' attempt {found.attempts[-1].number} is running.")
            if found.stop_requested:  # asked while it waited for its nodes: it ends here
                self._close(found, JobStatus.STOPPED, now=now, exit_code=None)
                events.record(
                    session, ids=self.ids, now=now, cluster=cluster,
                    description=f"{_title(found)} stopped before its next attempt.",
                )  # fmt: skip
                return Placement(job=found, attempt=0, nodes=[])
            found.supervisor_pid = supervisor_pid
            found.supervisor_start_time = supervisor_start_time
            lost = faults.lost_nodes(cluster)
            running = sorted(
                (
                    n
                    for n in cluster.nodes
                    if n.status == NodeStatus.RUNNING and n.endpoint and n.id not in lost
                ),
                key=lambda n: (n.group_name, n.slot, n.launch_time, n.id),
            )
            wanted = found.node_count or len(running)
            if wanted == 0 or len(running) < wanted:
                raise ConflictException(
                    f"Job '{found.name}' waits for {wanted or 'a'} Running node(s); "
                    f"the cluster has {len(running)}."
                )
            chosen = self._place(cluster, found, running, wanted)
            if chosen is None:
                raise ConflictException(
                    f"Job '{found.name}' waits for the replacement of its failed node "
                    "(NodeRecovery Automatic: a job resumes on the replacement)."
                )
            if found.node_count is None:
                found.node_count = wanted  # "every node" is fixed at the first start
            number = len(found.attempts) + 1
            found.attempts.append(
                JobAttempt(
                    number=number,
                    nodes=[n.id for n in chosen],
                    slots=[_slot(n) for n in chosen],
                    status=JobStatus.RUNNING,
                    started_at=now,
                )
            )
            found.status = JobStatus.RUNNING
            events.record(
                session,
                ids=self.ids,
                now=now,
                cluster=cluster,
                description=f"{_title(found)} attempt {number} started on {', '.join(n.id for n in chosen)}.",
            )
            placed = [
                PlacedNode(
                    node_id=n.id,
                    address=(env := self._environment(n, cluster, found))["HPSIM_NODE_ADDRESS"],
                    environment=env,
                )
                for n in chosen
            ]
            session.flush()
            return Placement(job=found, attempt=number, nodes=placed)

    @staticmethod
    def _place(cluster: Cluster, job: Job, running: list[Node], wanted: int) -> list[Node] | None:
        """The nodes of the job's next attempt, in group-rank order; None while a failed node's
        replacement is awaited. The first attempt takes the first ``wanted`` Running nodes. A
        restart keeps each node of the previous attempt that still runs, in its place; a node
        that does not is taken over, with NodeRecovery Automatic, by the Running node in its slot
        (its replacement), else by another Running node (a healthy spare)."""
        if not job.attempts:
            return running[:wanted]
        previous = job.attempts[-1]
        by_id = {n.id: n for n in running}
        by_slot = {_slot(n): n for n in running}
        taken = {n for n in previous.nodes if n in by_id}
        spares = [n for n in running if n.id not in taken]
        chosen: list[Node] = []
        for node_id, slot in zip(previous.nodes, previous.slots, strict=True):
            if node_id in by_id:
                chosen.append(by_id[node_id])
                continue
            if cluster.node_recovery == "Automatic":
                replacement = by_slot.get(slot)
                if replacement is None or replacement.id in taken:
                    return None
            else:
                if not spares:
                    return None
                replacement = spares[0]
            spares = [n for n in spares if n.id != replacement.id]
            taken.add(replacement.id)
            chosen.append(replacement)
        return chosen

    def _environment(self, node: Node, cluster: Cluster, job: Job) -> dict[str, str]:
        return {**self.provisioner.session_environment(cluster, node), JOB_MARK: job.id}

    def end_attempt(self, *, name: str, job: str, attempt: int, end: AttemptEnd) -> tuple[Job, bool]:
        """Record how attempt ``attempt`` ended; the job and whether it starts again."""
        now = self.clock.now()
        with self.db.write() as session:
            cluster = get_cluster(session, name, lock=True)
            found = self._job(session, cluster, job, lock=True)
            current = found.attempts[-1] if found.attempts else None
            if current is None or current.number != attempt:
                raise ValidationException(f"Job '{found.name}' has no attempt {attempt} running.")
            if current.ended_at is not None:  # told again (a retry after a lost answer)
                return found, found.status == JobStatus.PENDING
            current.ended_at = now
            current.exit_code = end.exit_code
            current.cause = end.cause
            current.cause_node = end.node_id
            current.cause_rank = end.rank
            label = f"{_title(found)} attempt {attempt}"
            if end.cause == EndCause.SUCCEEDED:
                current.status = JobStatus.SUCCEEDED
                self._close(found, JobStatus.SUCCEEDED, now=now, exit_code=0)
                found.status_message = None
                events.record(
                    session, ids=self.ids, now=now, cluster=cluster,
                    description=f"{label} succeeded: every rank exited 0.",
                )  # fmt: skip
                return found, False
            current.status = JobStatus.FAILED if end.cause != EndCause.STOPPED else JobStatus.STOPPED
            why = {
                EndCause.NODE_FAILURE: f"node {end.node_id} failed",
                EndCause.RANK_EXIT: f"rank {end.rank} exited with status {end.exit_code}",
                EndCause.STOPPED: "a stop was asked",
            }[end.cause]
            node = next((n for n in cluster.nodes if n.id == end.node_id), None) if end.node_id else None
            stopped_by_user = end.cause == EndCause.STOPPED or found.stop_requested
            restart = found.auto_resume and not stopped_by_user and found.restarts < found.max_restarts
            if restart:
                found.restarts += 1
                found.status = JobStatus.PENDING
                found.status_message = f"attempt {attempt} ended: {why}; restarting"
                description = (
                    f"{label} ended: {why}; every rank was stopped. Restarting it (restart {found.restarts} "
                    f"of {found.max_restarts}) once it has {found.node_count} Running node(s)."
                )
            else:
                status = JobStatus.STOPPED if stopped_by_user else JobStatus.FAILED
                self._close(found, status, now=now, exit_code=end.exit_code)
                found.status_message = why
                left = (
                    f"; no restart left (--max-restarts {found.max_restarts})"
                    if found.auto_resume and not stopped_by_user
                    else ""
                )
                description = (
                    f"{label} ended: {why}; the job {status.lower()} with exit status {end.exit_code}{left}."
                )
            event_node = node if node is not None and node.cluster_id == cluster.id else None
            events.record(
                session,
                ids=self.ids,
                now=now,
                cluster=cluster,
                node=event_node,
                level=Level.WARN if restart or stopped_by_user else Level.ERROR,
                description=description,
            )
            return found, restart

    def stop_job(self, *, name: str, job: str) -> Job:
        """Ask the job to stop: its supervisor stops every rank and ends the attempt."""
        now = self.clock.now()
        with self.db.write() as session:
            cluster = get_cluster(session, name, lock=True)
            found = self._job(session, cluster, job, lock=True)
            if found.status in ENDED:
                return found
            found.stop_requested = True
            events.record(
                session, ids=self.ids, now=now, cluster=cluster,
                description=f"{_title(found)}: a stop was asked.",
            )  # fmt: skip
            return found

    @staticmethod
    def _close(job: Job, status: JobStatus, *, now: datetime, exit_code: int | None) -> None:
        job.status = status
        job.exit_code = exit_code
        job.ended_at = now
