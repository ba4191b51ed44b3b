"""The memory tier's parts on their own, without HTTP or agents: the catalog of complete steps, the
S3 retention plan, the persist loop's temporary/permanent split, the one backoff, and the fast
path's expiry driven by an injected clock (no test sleeps to wait for it)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable
from pathlib import Path

import pytest

from hyperpod_sim.agents import catalog
from hyperpod_sim.agents.fastpath import FastPath
from hyperpod_sim.agents.http.client import HttpError
from hyperpod_sim.agents.http.server import Request
from hyperpod_sim.agents.retry import Backoff
from hyperpod_sim.agents.s3.objects import S3Unavailable
from hyperpod_sim.agents.s3.tier import PersistFailed, is_temporary
from hyperpod_sim.agents.store import ShardInfo, ShardKey, ShardStore
from hyperpod_sim.agents.tiermodel import Namespace, TierError
from hyperpod_sim.contracts.agent_bodies import ShardIndex
from hyperpod_sim.contracts.shards import UNUSED_RANK_CHECKSUM
from tests.clocks import ManualClock
from tests.standin import Canned, standin

MiB = 1 << 20


def test_a_step_is_complete_when_every_rank_is_held_somewhere() -> None:
    here = {1: {0, 1}, 2: {0}, 3: {2}}
    peer = {2: [1, 2], 3: [0]}
    assert catalog.complete_steps(3, [here, peer]) == [2]
    assert catalog.complete_steps(2, [here, peer]) == [2, 1]
    assert catalog.complete_steps(3, []) == []
    assert catalog.merge([here, peer]) == {1: {0, 1}, 2: {0, 1, 2}, 3: {0, 2}}


def test_the_local_index_separates_own_shards_from_replicas(tmp_path: Path) -> None:
    def info(rank: int, step: int, replica_of: str | None, checksum: str = "") -> ShardInfo:
        return ShardInfo(ShardKey("job", rank, step), 1, checksum, replica_of, tmp_path / "x", 0.0)

    shards = [
        info(1, 5, None),
        info(0, 5, "node-b"),
        info(0, 4, None),
        info(2, 5, None, UNUSED_RANK_CHECKSUM),
    ]
    index = catalog.local_index(shards, "node-a")
    assert index.document() == {
        "node_id": "node-a",
        "steps": {"4": [0], "5": [0, 1, 2]},
        "primary": {"4": [0], "5": [1, 2]},
        "replica": {"5": [0]},
        "unused": {"5": [2]},  # step 5 was saved by a job of 2 ranks
        "seq": 0,  # the namespace index numbers the images it sends (agents/homes.py)
    }
    assert ShardIndex.parse(json.dumps(index.document())).steps == {4: (0,), 5: (0, 1, 2)}


def test_each_step_is_named_with_the_world_size_that_saved_it() -> None:
    # A namespace of 5 ranks: step 7 saved by 2 ranks (placeholders at 2 and 3, on two nodes),
    # step 6 by 4 (none).
    assert catalog.world_sizes(5, [7, 6], [{7: [3]}, {7: [2]}]) == {7: 2, 6: 4}


def test_retention_keeps_the_newest_committed_steps_and_drops_abandoned_uploads() -> None:
    doomed, abandoned = catalog.retention_plan([1, 3, 5, 7], [1, 2, 3, 5, 6, 7, 8], 2)
    assert doomed == {1, 3}
    # Below the newest committed step and never committed: an upload that died. Step 8 may still
    # be uploading (above the newest marker): kept.
    assert abandoned == {2, 6}
    assert catalog.retention_plan([4], [4], None) == (set(), set())
    assert catalog.retention_plan([], [1, 2], 1) == (set(), set())


@pytest.mark.parametrize(
    ("error", "temporary"),
    [
        (PersistFailed("ranks [1] could not be put"), True),
        (S3Unavailable("throttled"), True),
        (HttpError("ClientConnectorError: refused"), True),
        (TierError(503, "ControlPlaneUnavailable", "down"), True),
        (TierError(404, "NamespaceNotFound", "gone"), False),
        (KeyError("num_ranks"), False),
        (ValueError("an answer off the contract"), False),
    ],
)
def test_persist_failures_are_temporary_or_permanent(error: Exception, temporary: bool) -> None:
    assert is_temporary(error) is temporary


def test_backoff_without_jitter_doubles_up_to_its_cap() -> None:
    backoff = Backoff(initial_s=0.5, max_s=3.0, jitter=False)
    assert [backoff.next_delay() for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    backoff.reset()
    assert backoff.next_delay() == 0.5


def test_fast_path_gives_back_writes_and_leases_past_their_timeout(tmp_path: Path) -> None:
    async def scenario() -> None:
        manual = ManualClock()
        tasks: list[asyncio.Future[None]] = []

        def spawn(coroutine: Awaitable[None]) -> None:
            tasks.append(asyncio.ensure_future(coroutine))

        store = ShardStore(tmp_path / "shm", budget_bytes=4 * MiB)
        fast = FastPath(clock=manual.clock(), timeout_s=10.0, spawn=spawn)
        taken = store.reserve(ShardKey("job", 0, 1), MiB)
        assert fast.take_write(fast.open_write(taken, Namespace("job", 2, 1))) is not None
        expiring = store.reserve(ShardKey("job", 1, 1), MiB)
        token = fast.open_write(expiring, Namespace("job", 2, 1))
        released: list[str] = []
        lease = fast.lease(lambda: released.append("expired"))
        assert fast.release(fast.lease(lambda: released.append("released")))
        assert released == ["released"]
        assert store.in_use_bytes == 2 * MiB
        await asyncio.gather(*tasks)  # the sweep ends once nothing is left to expire
        assert manual.now > 110.0
        assert released == ["released", "expired"]
        assert fast.take_write(token) is None
        assert not fast.release(lease)
        assert store.in_use_bytes == MiB  # the expired write's room was given back
        taken.abort()

    asyncio.run(scenario())


def test_fast_path_leases_are_capped_until_some_end(tmp_path: Path) -> None:
    """Issue 23: a flood of locates never released held memory until their leases expired; now
    the agent holds at most ``max_entries`` and refuses more (429) until some end or expire."""

    async def scenario() -> None:
        manual = ManualClock()
        tasks: list[asyncio.Future[None]] = []

        def spawn(coroutine: Awaitable[None]) -> None:
            tasks.append(asyncio.ensure_future(coroutine))

        fast = FastPath(clock=manual.clock(), timeout_s=10.0, spawn=spawn, max_entries=3)
        unpinned: list[int] = []
        leases = []
        for n in range(3):
            fast.check_room(leases=True)
            leases.append(fast.lease(lambda n=n: unpinned.append(n)))
        with pytest.raises(TierError) as refused:
            fast.check_room(leases=True)
        assert (refused.value.status, refused.value.error) == (429, "ResourceLimitExceeded")
        assert refused.value.extra == {"limit": 3}
        fast.check_room(leases=False)  # open writes are counted apart
        assert fast.release(leases[0])
        fast.check_room(leases=True)
        await asyncio.gather(*tasks)  # the other two expire
        assert sorted(unpinned) == [0, 1, 2]
        for _ in range(3):
            fast.check_room(leases=True)
            fast.lease(lambda: None)
        with pytest.raises(TierError):
            fast.check_room(leases=True)
        for task in tasks:
            task.cancel()

    asyncio.run(scenario())


def image(node_id: str, seq: int, **held: dict[int, tuple[int, ...]]) -> ShardIndex:
    primary, replica = held.get("primary", {}), held.get("replica", {})
    steps = catalog.merge([primary, replica])
    return ShardIndex(
        node_id=node_id,
        steps={step: tuple(sorted(ranks)) for step, ranks in steps.items()},
        primary=primary,
        replica=replica,
        seq=seq,
    )


def test_a_homes_view_ignores_an_older_image_that_arrives_late() -> None:
    view = catalog.HomeView()
    members = frozenset({"a", "b"})
    assert view.offer(image("a", 2, primary={5: (0, 1)}), members)
    # Seq 1 (made before rank 1 of step 6 was stored, say) arrives after seq 2: ignored.
    assert not view.offer(image("a", 1, primary={4: (0, 1)}), members)
    assert not view.offer(image("a", 2, primary={}), members)  # the same image again changes nothing
    assert view.steps(2) == {5: 1}  # step -> world size (ranks less the metadata rank)
    assert view.offer(image("a", 3, primary={5: (0,)}), members)  # newer: rank 1 went (evicted, deleted)
    assert view.steps(2) == {}
    assert view.offer(image("b", 1, replica={5: (1,)}), members)
    assert view.steps(2) == {5: 1}  # step -> world size (ranks less the metadata rank)
    assert view.holders(5, 1) == ((), ("b",))
    assert view.holders(5) == (("a",), ("b",))
    assert view.holders(5, 0) == (("a",), ())
    # A node no longer a member: its image goes, and the step is incomplete again.
    view.retain({"a"})
    assert view.steps(2) == {}
    assert not view.offer(ShardIndex(node_id=None, steps={5: (1,)}, seq=9), members)  # nobody's image


def test_a_home_asks_only_for_the_images_it_lacks_or_got_under_another_member_set() -> None:
    view = catalog.HomeView()
    before = frozenset({"a", "b", "c"})
    now = frozenset({"a", "b", "c", "d"})
    assert view.offer(image("a", 1, primary={5: (0,)}), now)
    assert view.offer(image("b", 1, primary={5: (1,)}), before)
    # "c" and "d" never reported (they hold nothing, or their report went astray); "b" reported
    # while this home knew another member set, so a later report of its may have gone elsewhere.
    assert sorted(view.unknown(now)) == ["b", "c", "d"]
    # The set is compared by identity: an equal set that is another object is another set.
    assert sorted(view.unknown(frozenset(sorted(now)))) == ["a", "b", "c", "d"]
    assert view.offer(image("b", 2, primary={5: (1,)}), now)
    assert sorted(view.unknown(now)) == ["c", "d"]


def test_every_agent_computes_the_same_two_homes_and_a_leaving_node_moves_only_its_own() -> None:
    nodes = [f"i-{n:04d}" for n in range(64)]
    homes = {ns: catalog.homes(ns, nodes) for ns in (f"job-{k}" for k in range(200))}
    assert all(len(h) == 2 and h[0] != h[1] for h in homes.values())
    assert homes == {ns: catalog.homes(ns, reversed(nodes)) for ns in homes}  # order does not matter
    assert len({h[0] for h in homes.values()}) > 32  # spread over the members
    gone = nodes[7]
    after = {ns: catalog.homes(ns, [n for n in nodes if n != gone]) for ns in homes}
    for ns, before in homes.items():
        if gone not in before:
            assert after[ns] == before
        else:
            assert [h for h in before if h != gone] == [h for h in after[ns] if h in before]


def test_the_member_list_is_kept_two_heartbeat_intervals_and_a_new_policy_makes_it_stale() -> None:
    from hyperpod_sim.agents.cluster import MEMBERS_MAX_AGE_S, ClusterView
    from hyperpod_sim.agents.control_plane import ControlPlaneClient
    from hyperpod_sim.agents.state import AgentState

    asked: list[str] = []

    def answer(request: Request) -> Canned:
        asked.append(request.path)
        member = {"node_id": f"i-{len(asked)}", "instance_group": "g", "status": "Running"}
        return Canned(200, {"members": [{**member, "endpoint": "http://127.0.0.1:9"}]})

    async def scenario() -> list[dict[str, str]]:
        state = AgentState(cluster="x", node_id="i-0")
        async with (
            standin(answer) as base_url,
            ControlPlaneClient(base_url=base_url, cluster="x", timeout_s=1) as client,
        ):
            view = ClusterView(state=state, control_plane=client, peer_timeout_s=1)
            try:
                assert view.members_max_age_s == MEMBERS_MAX_AGE_S
                state.heartbeat_interval_s = 16.0  # a 1,024-node cluster's pace
                assert view.members_max_age_s == 32.0
                seen = [await view.recent_members(), await view.recent_members()]
                view.members_stale()  # a new policy generation
                seen.append(await view.recent_members())
                return seen
            finally:
                await view.aclose()

    first, cached, after_policy = asyncio.run(scenario())
    assert len(asked) == 2  # the list, then again only after the new policy
    assert first == cached == {"i-1": "http://127.0.0.1:9"}
    assert after_policy == {"i-2": "http://127.0.0.1:9"}
