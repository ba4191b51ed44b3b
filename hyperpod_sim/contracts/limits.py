"""Limits both ends of a call must agree on: what a sender may send is what a receiver accepts."""

from __future__ import annotations

# A namespace name is one directory name on the agent's disk (hyperpod_sim/agents/store.py), in UTF-8 bytes.
MAX_NAME_BYTES = 255
# Ranks of a checkpoint namespace (the metadata shard included).
MAX_RANKS = 1_000_000
# An agent's endpoint, http://HOST:PORT (the control plane's column size).
MAX_ENDPOINT = 256
# The message of an event an agent reports (POST /agent/v1/clusters/{cluster}/events).
MAX_EVENT_MESSAGE = 2048
# The heartbeat's ``s3`` member, as JSON: the control plane stores it with the node every time.
MAX_S3_STATUS_BYTES = 8 * 1024
# A node id where an agent keeps one (a replica's owner, in the shard's sidecar).
MAX_NODE_ID_CHARS = 128
