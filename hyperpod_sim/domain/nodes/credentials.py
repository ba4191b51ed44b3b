"""Node credentials of the agent protocol (docs/agent-protocol.md, "Tokens").

- A **launch secret**: made by the local provisioner for each agent process it starts, handed to
  that process only (in its environment), kept here as a SHA-256 digest. It registers that node,
  once: the first heartbeat with the node token it got consumes it. A new launch revokes the node
  token of the node's earlier process (``bind_launch_secret``).
- A **node token**: answered by registration; the agent's credential for every call it makes to
  the control plane. Kept as a digest; it authenticates its own node only.
- A **control-plane token**: answered by registration; the control plane's credential for the
  pushes it makes to that agent (``PUT /v1/policy``). Kept as is: the control plane presents it.

Every registration makes a new node token and control-plane token, so the ones an earlier agent of
the node held stop working. The tokens are 256-bit random values: a digest of one identifies it, so
looking a node up by the digest of the token presented is safe (no timing leak of a secret).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from hyperpod_sim.models import Node


def new_secret() -> str:
    """A fresh random credential: 64 hex digits (256 bits)."""
    return secrets.token_hex(32)


def digest(secret: str) -> str:
    """What is stored of a secret: its SHA-256, in hex."""
    return hashlib.sha256(secret.encode()).hexdigest()


def matches(presented: str | None, stored_digest: str | None) -> bool:
    """Whether ``presented`` is the secret whose digest is stored (constant time)."""
    if not presented or not stored_digest:
        return False
    return hmac.compare_digest(digest(presented).encode(), stored_digest.encode())


def bind_launch_secret(node: Node) -> str:
    """Bind the node to a new launch secret, for the agent process about to be started; the
    secret, to hand to that process only.

    Whatever the node's earlier agent process held stops working: its launch secret and its node
    token. The token must: a call that process made before it died (a heartbeat in a loaded
    server's queue when an AgentCrash killed it) may be carried out after this launch has
    committed, and a heartbeat with a valid node token spends the outstanding launch secret, so the
    new agent's registration would be refused for good and its node failed for silence. The
    provisioner launches only when no agent of the node runs, so no live agent loses its token."""
    secret = new_secret()
    node.launch_secret_hash = digest(secret)
    node.token_hash = None
    return secret


def issue_node_token(node: Node) -> str:
    """A new node token for the node (the previous one stops working)."""
    node_token = new_secret()
    node.token_hash = digest(node_token)
    return node_token


def issue_tokens(node: Node) -> tuple[str, str]:
    """New node and control-plane tokens for the node, as registration answers them (the previous
    ones stop working): (node token, control-plane token)."""
    node_token = issue_node_token(node)
    node.push_token = new_secret()
    return node_token, node.push_token


def revoke(node: Node) -> None:
    """Every credential of the node stops working (a failed node that is replaced)."""
    node.launch_secret_hash = None
    node.token_hash = None
    node.push_token = None
