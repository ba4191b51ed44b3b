"""Limits both ends of a call must agree on: what a sender may send is what a receiver accepts."""

from __future__ import annotations

import unicodedata

# A namespace name is one directory name on the agent's disk (hyperpod_sim/agents/store.py), in UTF-8 bytes.
MAX_NAME_BYTES = 255
# Ranks of a checkpoint namespace (the metadata shard included): the protocol's ceiling, which no
# setting raises (agents refuse more before asking the control plane).
MAX_RANKS = 1_000_000
# The control plane's default limit on a namespace's ranks (HPSIM_LIMITS__MAX_NAMESPACE_RANKS, at
# most MAX_RANKS): a world of 65,536 ranks and the library's metadata rank. Each listing of a
# namespace's complete steps walks every rank of it (issue 23: 1,000 namespaces of a million ranks
# made the checkpoint listing take 62 s).
DEFAULT_MAX_NAMESPACE_RANKS = 65_537
# The control plane's default limit on a cluster's checkpoint namespaces
# (HPSIM_LIMITS__MAX_NAMESPACES_PER_CLUSTER).
DEFAULT_MAX_NAMESPACES_PER_CLUSTER = 256
# Same-host fast-path entries one agent holds at once, each of reads (leases on a shard file) and of
# writes (reservations not yet committed) (HPSIM_AGENT_MAX_FAST_LEASES): past it a caller gets 429
# until some are released or expire, so a flood cannot grow the agent's memory without end.
DEFAULT_MAX_FAST_LEASES = 4096
# An agent's endpoint, http://HOST:PORT (the control plane's column size).
MAX_ENDPOINT = 256
# The message of an event an agent reports (POST /agent/v1/clusters/{cluster}/events).
MAX_EVENT_MESSAGE = 2048
# The heartbeat's ``s3`` member, as JSON: the control plane stores it with the node every time.
MAX_S3_STATUS_BYTES = 8 * 1024
# A node id where an agent keeps one (a replica's owner, in the shard's sidecar).
MAX_NODE_ID_CHARS = 128


def namespace_name_problem(name: str) -> str | None:
    """Why a new checkpoint namespace may not be called ``name``, or None if it may: a name holds
    no control character (Unicode category Cc: U+0000 to U+001F, U+007F to U+009F). Those cannot
    be carried by the S3 keys the namespace's steps are persisted under (S3's XML listings cannot
    hold them), nor by the job names the amzn-sagemaker-checkpointing library uses."""
    for index, char in enumerate(name):
        if unicodedata.category(char) == "Cc":
            return (
                f"the namespace name holds the control character U+{ord(char):04X} at index {index}: a "
                "namespace name may not contain control characters (U+0000 to U+001F, U+007F to "
                "U+009F), which S3 object keys cannot carry"
            )
    return None


def num_ranks_problem(num_ranks: int, *, most: int = MAX_RANKS) -> str | None:
    """Why a namespace may not have ``num_ranks`` ranks (AWS's ValidationException wording), or
    None: 1 to ``most`` (the control plane's setting; the agents check the ceiling, MAX_RANKS)."""
    if 1 <= num_ranks <= most:
        return None
    constraint = "greater than or equal to 1" if num_ranks < 1 else f"less than or equal to {most}"
    return (
        f"1 validation error detected: Value '{num_ranks}' at 'numRanks' failed to satisfy constraint: "
        f"Member must have value {constraint}"
    )
