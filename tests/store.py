"""The shard store (agents/store.py) in a test: a shard read back verified."""

from __future__ import annotations

from hyperpod_sim.agents.store import ShardKey, ShardStore


def read(store: ShardStore, key: ShardKey) -> bytes:
    info, view = store.read_verified(key)
    with view:
        assert info.key == key
        return bytes(view)
