"""The contracts package: the node policy model, Shard-Meta, the S3 layout and the route paths,
without a process or a socket."""

from __future__ import annotations

import ast
import base64
import json
from pathlib import Path
from typing import cast

import pydantic
import pytest
import xxhash

from hyperpod_sim.agents.app import AgentApp
from hyperpod_sim.agents.state import AgentState
from hyperpod_sim.agents.tier import MemoryTier
from hyperpod_sim.agents.tierroutes import TierRoutes
from hyperpod_sim.contracts.agent_api import (
    AGENT_ROUTES,
    CP_LATEST_ROUTE,
    CP_SHARD_ROUTE,
    FAST_COMMIT_ROUTE,
    HEARTBEAT_ROUTE,
    POLICY_PATH,
    AgentApi,
    AgentRoute,
    Heartbeat,
    RouteTable,
    S3StatusProblem,
    agent_api_path,
    agent_path,
    agent_route,
)
from hyperpod_sim.contracts.agent_bodies import PersistRequest, S3TierStatus, ShardIndex
from hyperpod_sim.contracts.policy import NodePolicy, PolicyError, S3Policy, parse_policy
from hyperpod_sim.contracts.s3layout import (
    LAYOUT_RAY,
    CommitMarker,
    S3Target,
    ShardObject,
    library_steps,
    step_of_key,
    trainer_steps,
)
from hyperpod_sim.contracts.shards import (
    UNUSED_RANK,
    Checksum,
    ShardMetaError,
    checksum_of,
    parse_shard_meta,
    shard_meta,
    step_world_size,
)

SHA = "ab" * 32


def test_a_received_policy_echoes_exactly_what_came() -> None:
    doc = {
        "generation": 4,
        "node_id": "i-1",
        "replication": {"factor": 1, "peers": [{"node_id": "i-2"}]},
        "s3": {"base_uri": "s3://bucket/p", "persist_every_seconds": 60},
        "faults": {"s3": {"type": "S3Errors", "error_rate": 1, "until": 1.5}},
        "checkpoint_access": {"mode": "Token", "token_sha256": SHA},
        "from_a_newer_control_plane": {"x": 1},
    }
    policy = parse_policy(json.loads(json.dumps(doc)))
    assert policy.document() == doc
    assert (policy.peer_ids, policy.memory_budget_bytes, policy.tiered_storage.enabled) == (["i-2"], 0, False)
    assert policy.checkpoint_access.token_required
    with pytest.raises(pydantic.ValidationError):
        policy.generation = 5  # type: ignore[misc]


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ("{}", "a policy document must be a JSON object, got string"),
        ({"generation": 1.0}, "'generation' must be an integer >= 1, got 1.0"),
        (
            {"generation": 2, "tiered_storage": {"enabled": 1}},
            "'tiered_storage' must be an object with a boolean",
        ),
        ({"generation": 2, "replication": {"peers": [{}]}}, "'replication' must be an object {\"factor\""),
        (
            {"generation": 2, "s3": {"persist_every_steps": 1}},
            "'s3' must be an object with a string 'base_uri'",
        ),
        ({"generation": 2, "checkpoint_access": {"mode": "Token", "token_sha256": "x"}}, "64 hex digits"),
    ],
)
def test_a_document_that_is_not_a_policy_names_its_first_wrong_member(doc: object, message: str) -> None:
    with pytest.raises(PolicyError) as raised:
        parse_policy(doc)
    assert message in str(raised.value)


def test_shard_meta_round_trip_and_its_refusals() -> None:
    data = b"shard bytes"
    assert checksum_of(data) == base64.b64encode(xxhash.xxh3_128_digest(data)).decode()
    assert parse_shard_meta(shard_meta(checksum_of(data))) == checksum_of(data)
    pieces = Checksum()
    for piece in (data[:5], memoryview(data)[5:]):
        pieces.update(piece)
    assert pieces.text() == checksum_of(data)
    for header, error in [
        (None, "MissingShardMeta"),
        ("[1]", "InvalidShardMeta"),
        (json.dumps({"checksum": "AAAA"}), "InvalidShardMeta"),
        (json.dumps({"checksum": checksum_of(data), "algorithm": "crc32"}), "UnsupportedAlgorithm"),
    ]:
        with pytest.raises(ShardMetaError) as raised:
            parse_shard_meta(header)
        assert raised.value.error == error


def test_s3_layout_and_commit_marker() -> None:
    target = S3Target.from_policy(S3Policy(base_uri="s3://bucket/run/", persist_every_steps=10))
    assert target is not None
    assert (target.bucket, target.prefix, target.region, target.every_steps) == (
        "bucket",
        "run",
        "us-east-1",
        10,
    )
    assert target.shard_key("job", 1, 7, num_ranks=3) == "run/job/rank_1/step_7/checkpoint.pt"
    assert target.shard_key("job", 2, 7, num_ranks=3) == "run/job/rank_0/step_7/metadata.metadata"
    assert target.marker_key("job", 7) == "run/job/_committed/step_7.json"
    assert [step_of_key(target.marker_key("job", 7)), step_of_key("run/job/other")] == [7, None]
    with pytest.raises(ValueError, match="names no bucket"):
        S3Target.from_uri("s3:///prefix")

    shard = ShardObject(0, target.shard_key("job", 0, 7, num_ranks=3), 11, checksum_of(b"shard bytes"))
    marker = CommitMarker("job", 7, 3, 1.0, "i-1", (shard,))
    raw = json.dumps(marker.doc()).encode()
    assert json.loads(raw)["format"] == "hyperpod-sim/commit-marker"
    assert (CommitMarker.shard_of(raw, 0), CommitMarker.shard_of(raw, 1)) == (shard, None)


def test_steps_the_library_wrote_are_complete_as_its_reader_decides() -> None:
    """Every rank's checkpoint.pt and rank 0's metadata, in either of the library's layouts."""
    prefix = "run/job/"
    default = [f"{prefix}rank_{r}/step_{n}/checkpoint.pt" for n in (4, 5, 6) for r in (0, 1)]
    default += [f"{prefix}rank_0/step_{n}/metadata.metadata" for n in (5, 6)]  # step 4: no metadata
    default.remove(f"{prefix}rank_1/step_6/checkpoint.pt")  # step 6: a rank missing
    default += [f"{prefix}rank_0/step_7/metadata.metadata", f"{prefix}_committed/step_3.json"]
    assert library_steps(default, prefix, 2) == [5]
    assert library_steps(default, prefix, 3) == []
    # A world size unknown: the ranks present, 0..k-1 (step 6 reads as a world of one).
    assert library_steps(default, prefix, None) == [6, 5]
    ray = [f"{prefix}step_9/rank_{r}/checkpoint.pt" for r in (0, 1)] + [
        f"{prefix}step_9/rank_0/metadata.metadata"
    ]
    assert library_steps(ray, prefix, 2) == []
    assert library_steps(ray, prefix, 2, LAYOUT_RAY) == [9]
    assert trainer_steps(default + ray, prefix, 2) == {5: "Default", 9: "Ray"}
    target = S3Target.from_policy(S3Policy(base_uri="s3://b/run", persist_every_steps=1, layout=LAYOUT_RAY))
    assert target is not None
    assert target.shard_key("job", 1, 9, num_ranks=3) == "run/job/step_9/rank_1/checkpoint.pt"
    assert target.shard_key("job", 2, 9, num_ranks=3) == "run/job/step_9/rank_0/metadata.metadata"
    assert target.shard_key("job", 1, 9, 3, layout="Default") == "run/job/rank_1/step_9/checkpoint.pt"
    assert target.marker_key("job", 9) == "run/job/_committed/step_9.json"
    assert step_of_key(target.shard_key("job", 1, 9, num_ranks=3)) == 9


def test_route_paths_quote_each_segment() -> None:
    assert agent_api_path(HEARTBEAT_ROUTE, cluster="a/b", node_id="i-1") == (
        "/agent/v1/clusters/a%2Fb/nodes/i-1/heartbeat"
    )


def test_the_protocol_doc_shows_every_member_of_the_policy() -> None:
    """docs/agent-protocol.md's example policy is a valid one and has the model's members, no more."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "agent-protocol.md").read_text()
    example = text.split("## Policy document", 1)[1].split("```json", 1)[1].split("```", 1)[0]
    policy = parse_policy(json.loads(example))
    assert set(policy.document()) == set(NodePolicy.model_fields)
    assert NodePolicy(generation=1).document() == {"generation": 1}


# ------------------------------------------------------------------------------ the agent's own API

PACKAGE = Path(__file__).resolve().parent.parent / "hyperpod_sim"


def _route_literals(path: Path) -> list[tuple[int, str]]:
    """The string constants of a module (f-string parts included) that begin like an agent route."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("/v1/"):
            found.append((node.lineno, node.value))
    return found


def test_no_agent_route_is_spelled_outside_contracts() -> None:
    """Every caller of an agent fills in a template of contracts.agent_api: a route spelled by hand
    elsewhere is one the agent's route table may not serve."""
    spelled = [
        f"{path.relative_to(PACKAGE)}:{line}: {text!r}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.relative_to(PACKAGE).parts[0] not in ("contracts", "migrations")
        for line, text in _route_literals(path)
    ]
    assert spelled == []


def test_the_agent_serves_exactly_the_routes_of_the_contract() -> None:
    """The agent's route table is built from AGENT_ROUTES: one handler per row, none beside it."""
    app = AgentApp(state=AgentState(cluster="c"), tier=None)
    tier_routes = [route for route, _ in TierRoutes(cast(MemoryTier, None)).handlers()]
    admin = [r for r in AGENT_ROUTES if r.api is AgentApi.ADMIN]
    assert sorted(map(str, admin + tier_routes)) == sorted(map(str, AGENT_ROUTES))
    assert len(set(tier_routes)) == len(tier_routes)
    # Without a memory tier, the admin API only.
    assert app.routes.lookup("/v1/internal/reset") is None
    assert set(app.routes.lookup(POLICY_PATH).methods) == {"GET", "PUT"}  # type: ignore[union-attr]


def test_a_route_table_takes_only_routes_of_the_contract() -> None:
    with pytest.raises(ValueError, match=r"not a route of contracts\.agent_api"):
        RouteTable([(AgentRoute("GET", "/v1/internal/secret", AgentApi.INTERNAL), "handler")])
    with pytest.raises(KeyError):
        agent_route("PATCH", CP_SHARD_ROUTE)


def test_a_route_table_matches_templates_segment_by_segment() -> None:
    table = RouteTable((route, route) for route in AGENT_ROUTES)
    assert table.lookup("/v1/cp/checkpoints/a%2Fb/3/4/5") is None  # no template has as many segments
    latest = table.lookup("/v1/cp/checkpoints/a%2Fb/latest/")
    assert latest is not None
    assert (list(latest.methods), latest.parameters) == (["GET"], {"namespace": "a/b"})
    assert latest.methods["GET"] == agent_route("GET", CP_LATEST_ROUTE)
    shard = table.lookup(agent_path(CP_SHARD_ROUTE, namespace="job", rank=0, step=7))
    assert shard is not None
    assert (sorted(shard.methods), shard.parameters) == (
        ["DELETE", "GET", "POST"],
        {"namespace": "job", "rank": "0", "step": "7"},
    )
    # The fast path answers under /v1/cp too.
    for path in ("/v1/fast/commit/t-1", "/v1/cp/fast/commit/t-1"):
        commit = table.lookup(path)
        assert commit is not None
        assert (commit.methods["POST"], commit.parameters) == (
            agent_route("POST", FAST_COMMIT_ROUTE),
            {"token": "t-1"},
        )
    assert table.lookup("/v1/fast/namespaces/job") is None  # the library's routes do not
    assert table.lookup("/v1/internal") is None


def test_a_steps_world_size_is_its_lowest_rank_holding_the_unused_placeholder() -> None:
    # A namespace of 5 ranks (made by a 4-rank job): a 2-rank job's step holds it at ranks 2-3.
    assert step_world_size(5, [3, 2]) == 2
    assert step_world_size(5, []) == 4
    assert step_world_size(1, []) == 1
    shards = [
        {"rank": r, "key": f"k{r}", "size": 1, "checksum": checksum_of(UNUSED_RANK if r == 3 else b"x%d" % r)}
        for r in range(5)
    ]
    marker = json.dumps({"num_ranks": 5, "shards": shards}).encode()
    assert CommitMarker.world_size_of(marker) == 3


def test_agent_bodies_round_trip_in_their_wire_order() -> None:
    index = ShardIndex(
        node_id="i-1", steps={5: (0, 1)}, primary={5: (1,)}, replica={5: (0,)}, unused={5: (1,)}
    )
    wire = json.dumps(index.document())
    assert wire == (
        '{"node_id": "i-1", "steps": {"5": [0, 1]}, "primary": {"5": [1]}, "replica": {"5": [0]}, '
        '"unused": {"5": [1]}, "seq": 0}'
    )
    assert ShardIndex.parse(wire) == index
    request = PersistRequest(base_uri="s3://b/p", ranks=(0, 2), replicas=True, save=None)
    assert request.document() == {"base_uri": "s3://b/p", "ranks": [0, 2], "replicas": True, "save": None}
    with pytest.raises(pydantic.ValidationError):
        PersistRequest.parse('{"base_uri": "s3://b/p", "ranks": ["zero"]}')
    with pytest.raises(pydantic.ValidationError):
        index.node_id = "i-2"


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ([1], "s3 must be an object or null, got list."),
        ({"pending_steps": True}, "s3.pending_steps must be a non-negative integer, got True."),
        ({"lag_seconds": float("nan")}, "s3.lag_seconds must be a non-negative number, got nan."),
    ],
)
def test_a_heartbeat_s3_status_is_parsed_once_in_the_protocols_words(raw: object, message: str) -> None:
    assert Heartbeat.model_validate({"applied_generation": 1, "s3": raw}).s3 == S3StatusProblem(message)


def test_a_heartbeat_s3_status_keeps_what_came_and_drops_what_it_does_not_know() -> None:
    heartbeat = Heartbeat.model_validate(
        {"applied_generation": 1, "s3": {"lag_seconds": 3, "last_error": None, "from_the_future": 1}}
    )
    assert isinstance(heartbeat.s3, S3TierStatus)
    assert heartbeat.s3.document() == {"lag_seconds": 3, "last_error": None}
    sent = Heartbeat(applied_generation=2, s3=S3TierStatus(pending_steps=0, lag_seconds=0.5))
    assert sent.model_dump(mode="json", exclude_unset=True) == {
        "applied_generation": 2,
        "s3": {"pending_steps": 0, "lag_seconds": 0.5},
    }
