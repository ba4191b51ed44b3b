"""A tiny renderer of the Prometheus text exposition format (version 0.0.4), enough for the agent's
handful of unlabelled gauges and counters."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from hyperpod_sim.agents.state import AgentState
from hyperpod_sim.agents.tier import MemoryTier

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True, kw_only=True)
class Metric:
    name: str
    kind: Literal["gauge", "counter"]
    help: str
    value: float


def _format_value(value: float) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value)


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def render(metrics: Iterable[Metric]) -> str:
    lines: list[str] = []
    for metric in metrics:
        lines.append(f"# HELP {metric.name} {_escape_help(metric.help)}")
        lines.append(f"# TYPE {metric.name} {metric.kind}")
        lines.append(f"{metric.name} {_format_value(metric.value)}")
    return "\n".join(lines) + "\n"


def agent_metrics(state: AgentState) -> list[Metric]:
    counters = state.counters
    return [
        Metric(
            name="hpsim_agent_policy_generation",
            kind="gauge",
            help="Generation of the policy document in force on this node (0: none yet).",
            value=state.applied_generation,
        ),
        Metric(
            name="hpsim_agent_memory_budget_bytes",
            kind="gauge",
            help="Memory budget of the in-memory checkpoint tier, from the policy in force.",
            value=state.memory_budget_bytes,
        ),
        Metric(
            name="hpsim_agent_tiered_storage_enabled",
            kind="gauge",
            help="1 when the policy in force enables tiered storage.",
            value=int(state.tiered_storage_enabled),
        ),
        Metric(
            name="hpsim_agent_registered",
            kind="gauge",
            help="1 once the agent has registered with the control plane.",
            value=int(state.registered),
        ),
        Metric(
            name="hpsim_agent_heartbeat_interval_seconds",
            kind="gauge",
            help="Seconds between heartbeats: the control plane's answer, longer in a large cluster.",
            value=state.heartbeat_interval_s,
        ),
        Metric(
            name="hpsim_agent_heartbeats_total",
            kind="counter",
            help="Heartbeats the control plane answered.",
            value=counters.heartbeats_total,
        ),
        Metric(
            name="hpsim_agent_heartbeat_failures_total",
            kind="counter",
            help="Failed calls to the control plane (registration, heartbeat and policy pull).",
            value=counters.heartbeat_failures_total,
        ),
        Metric(
            name="hpsim_agent_policy_applies_total",
            kind="counter",
            help="Policy documents applied (a new generation in force).",
            value=counters.policy_applies_total,
        ),
        Metric(
            name="hpsim_agent_policy_pushes_total",
            kind="counter",
            help=(
                "Authorised policy pushes received (a repeated generation counts too; the "
                "agent's own, made once to find the pages a push writes, does not)."
            ),
            value=counters.policy_pushes_total,
        ),
    ]


def tier_metrics(tier: MemoryTier) -> list[Metric]:
    """The in-memory checkpoint tier: what it holds and how its copies fare."""
    store, counters = tier.store, tier.store.counters
    return [
        Metric(
            name="hpsim_tier_bytes_held",
            kind="gauge",
            help="Bytes held: shards (own and replicas), reservations in flight and spares.",
            value=store.in_use_bytes,
        ),
        Metric(
            name="hpsim_tier_budget_bytes",
            kind="gauge",
            help="Memory budget of the tier.",
            value=store.budget_bytes,
        ),
        Metric(
            name="hpsim_tier_shards",
            kind="gauge",
            help="Shards held (own and replicas).",
            value=store.shard_count,
        ),
        Metric(
            name="hpsim_tier_spare_bytes",
            kind="gauge",
            help="Bytes of spare files kept for ranks' next saves (counted in hpsim_tier_bytes_held).",
            value=store.spare_bytes,
        ),
        Metric(
            name="hpsim_tier_spares",
            kind="gauge",
            help="Spare files kept for ranks' next saves, allocated and faulted in.",
            value=len(store.spares()),
        ),
        Metric(
            name="hpsim_tier_evictions_total",
            kind="counter",
            help="Shards evicted (budget or retention).",
            value=counters.evictions_total,
        ),
        Metric(
            name="hpsim_tier_checksum_failures_total",
            kind="counter",
            help="Uploads refused and stored copies dropped for a checksum mismatch.",
            value=counters.checksum_failures_total,
        ),
        Metric(
            name="hpsim_tier_replications_total",
            kind="counter",
            help="Replicas sent to peers.",
            value=tier.counters.replications_total,
        ),
        Metric(
            name="hpsim_tier_replication_failures_total",
            kind="counter",
            help="Replicas that could not be sent.",
            value=tier.counters.replication_failures_total,
        ),
        Metric(
            name="hpsim_tier_replication_pending",
            kind="gauge",
            help="Shards stored here and not yet on every replica peer.",
            value=len(tier.counters.replication_pending),
        ),
        Metric(
            name="hpsim_tier_replication_lag_seconds",
            kind="gauge",
            help="Age of the oldest shard not yet on every replica peer (0: none).",
            value=tier.counters.replication_lag_s(tier.clock.wall()),
        ),
        Metric(
            name="hpsim_tier_remote_reads_total",
            kind="counter",
            help="Reads served from another agent's copy.",
            value=tier.counters.remote_reads_total,
        ),
        *_index_metrics(tier),
    ]


def _index_metrics(tier: MemoryTier) -> list[Metric]:
    """The namespace index (agents/homes.py): what it costs, and when it is passed over."""
    counters = tier.index.counters
    rows = [
        (
            "hpsim_tier_index_answers_total",
            "Indexes of a namespace sent to another agent or the control plane (someone's fan-out).",
            counters.index_answers_total,
        ),
        ("hpsim_tier_fan_outs_total", "Calls made to every other agent.", tier.cluster.fan_outs_total),
        ("hpsim_tier_catalog_answers_total", "Questions answered as a home.", counters.answers_total),
        (
            "hpsim_tier_catalog_rebuilds_total",
            "Views of a namespace built by asking every agent, as its home.",
            counters.rebuilds_total,
        ),
        (
            "hpsim_tier_catalog_reports_sent_total",
            "Reports of what this node holds sent to a home.",
            counters.reports_sent_total,
        ),
        (
            "hpsim_tier_catalog_report_failures_total",
            "Reports a home did not take (retried).",
            counters.report_failures_total,
        ),
        (
            "hpsim_tier_catalog_reports_received_total",
            "Reports received as a home.",
            counters.reports_received_total,
        ),
        (
            "hpsim_tier_catalog_fallbacks_total",
            "Questions no home answered: every agent was asked instead.",
            counters.fallbacks_total,
        ),
    ]
    return [Metric(name=name, kind="counter", help=text, value=value) for name, text, value in rows]


def s3_metrics(tier: MemoryTier) -> list[Metric]:
    """The S3 tier: what it persisted and how far behind it is."""
    s3, counters = tier.s3, tier.s3.counters
    rows: list[tuple[str, Literal["gauge", "counter"], str, float]] = [
        ("persisted_steps_total", "counter", "Steps committed on S3 by this agent.",
         counters.persisted_steps_total),
        ("uploaded_shards_total", "counter", "Shards uploaded by this agent.",
         counters.uploaded_shards_total),
        ("uploaded_bytes_total", "counter", "Bytes uploaded by this agent.", counters.uploaded_bytes_total),
        ("upload_retries_total", "counter", "Whole-upload retries (botocore retries each request too).",
         s3.upload_retries_total),
        ("failures_total", "counter", "Persists that failed (retried, or superseded by a newer step).",
         counters.failures_total),
        ("pending_steps", "gauge", "Due steps not on S3 yet.", len(counters.due)),
        ("lag_seconds", "gauge", "Age of the oldest due step not on S3 yet (0: none).",
         counters.lag_s(tier.clock.wall())),
        ("fallback_reads_total", "counter", "Shards served from S3 (no agent held a good copy).",
         counters.fallback_reads_total),
        ("retention_deleted_steps_total", "counter", "Committed steps deleted by S3 retention.",
         counters.retention_deleted_steps_total),
        ("abandoned_steps_deleted_total", "counter", "Uncommitted steps (uploads that died) deleted.",
         counters.abandoned_steps_deleted_total),
        ("drain_failures_total", "counter", "Steps a drain could not persist.",
         counters.drain_failures_total),
        ("injected_errors_total", "counter", "S3 requests failed by an injected fault (S3Errors, S3Outage).",
         s3.faults.injected_total),
    ]  # fmt: skip
    return [Metric(name=f"hpsim_s3_{n}", kind=k, help=h, value=v) for n, k, h, v in rows]
