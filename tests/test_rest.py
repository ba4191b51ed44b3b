"""The REST routes and the AWS JSON 1.1 entry over raw HTTP (httpx), on SQLite and on PostgreSQL.

REST answers with the same members and error bodies as the AWS API; only the statuses follow HTTP
where one fits better (404 for ResourceNotFound, 409 for ResourceInUse/ConflictException).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from hyperpod_sim.api.registry import OPERATIONS
from hyperpod_sim.api.rest import ROUTES
from tests.conftest import EKS, ControlPlane, group, wait_for
from tests.rest import describe, node_ids, settle, wire

AMZ_JSON = "application/x-amz-json-1.1"
NAME_PATTERN = "[a-zA-Z0-9](-*[a-zA-Z0-9])*"


def create_body(name: str, count: int = 2) -> dict[str, Any]:
    return {"ClusterName": name, "InstanceGroups": [group("workers", count)], "Orchestrator": EKS}


def create(http: httpx.Client, name: str, count: int = 2) -> str:
    response = http.post("/clusters", json=create_body(name, count))
    assert response.status_code == 200, response.text
    arn: str = response.json()["ClusterArn"]
    return arn


# ------------------------------------------------------------------------------------ REST routes


def test_create_and_describe_match_aws_api(control_plane: ControlPlane, http: httpx.Client, sm: Any) -> None:
    response = http.post("/clusters", json=create_body("demo"))
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    arn = response.json()["ClusterArn"]
    assert arn.startswith("arn:aws:sagemaker:us-east-1:123456789012:cluster/")
    assert list(response.json()) == ["ClusterArn"]

    rest = describe(http, "demo")
    assert rest["ClusterArn"] == arn
    assert rest["ClusterStatus"] == "Creating"
    # REST timestamps are epoch seconds, as on the AWS JSON wire.
    assert isinstance(rest["CreationTime"], float)
    assert rest == wire(sm.describe_cluster(ClusterName="demo"))

    settled = settle(control_plane, http, "demo")
    assert [(g["CurrentCount"], g["TargetCount"], g["Status"]) for g in settled["InstanceGroups"]] == [
        (2, 2, "InService")
    ]
    assert describe(http, "demo") == wire(sm.describe_cluster(ClusterName="demo"))


def test_patch_updates_cluster(control_plane: ControlPlane, http: httpx.Client, sm: Any) -> None:
    arn = create(http, "demo")
    settle(control_plane, http, "demo")
    response = http.patch(
        "/clusters/demo",
        json={
            "InstanceGroups": [group("workers", 3)],
            "TieredStorageConfig": {"Mode": "Enable", "InstanceMemoryAllocationPercentage": 40},
        },
    )
    assert response.status_code == 200, response.text
    assert response.json() == {"ClusterArn": arn}
    updated = describe(http, "demo")
    assert updated["ClusterStatus"] == "Updating"
    assert updated["TieredStorageConfig"] == {"Mode": "Enable", "InstanceMemoryAllocationPercentage": 40}
    assert updated["InstanceGroups"][0]["TargetCount"] == 3
    settled = settle(control_plane, http, "demo")
    workers = settled["InstanceGroups"][0]
    assert (workers["CurrentCount"], workers["TargetCount"]) == (3, 3)
    assert settled == wire(sm.describe_cluster(ClusterName="demo"))


def test_patch_while_creating_is_a_conflict(http: httpx.Client) -> None:
    create(http, "demo")
    response = http.patch("/clusters/demo", json={"InstanceGroups": [group("workers", 3)]})
    assert response.status_code == 409
    assert response.json() == {
        "__type": "ConflictException",
        "message": "Cluster 'demo' is Creating; UpdateCluster is accepted only while the cluster is "
        "InService.",
    }


def test_list_clusters_filters_and_pages(http: httpx.Client, sm: Any) -> None:
    arns = {name: create(http, name) for name in ("alpha-2", "beta", "alpha-1")}

    response = http.get("/clusters")
    assert response.status_code == 200
    everything = response.json()
    assert "NextToken" not in everything
    assert {s["ClusterName"] for s in everything["ClusterSummaries"]} == set(arns)
    assert everything == wire(sm.list_clusters())

    params: dict[str, Any] = {"NameContains": "alpha", "MaxResults": 1, "SortBy": "NAME"}
    first = http.get("/clusters", params=params)
    assert first.status_code == 200, first.text
    page1 = first.json()
    assert [s["ClusterName"] for s in page1["ClusterSummaries"]] == ["alpha-1"]
    assert page1["ClusterSummaries"][0]["ClusterArn"] == arns["alpha-1"]
    assert page1["ClusterSummaries"][0]["ClusterStatus"] == "Creating"
    assert page1["NextToken"]

    second = http.get("/clusters", params={**params, "NextToken": page1["NextToken"]})
    assert second.status_code == 200, second.text
    page2 = second.json()
    assert [s["ClusterName"] for s in page2["ClusterSummaries"]] == ["alpha-2"]
    assert "NextToken" not in page2

    descending = http.get("/clusters", params={"SortBy": "NAME", "SortOrder": "Descending"}).json()
    assert [s["ClusterName"] for s in descending["ClusterSummaries"]] == ["beta", "alpha-2", "alpha-1"]


def test_list_clusters_rejects_a_token_from_another_listing(http: httpx.Client) -> None:
    for name in ("alpha-1", "alpha-2"):
        create(http, name)
    token = http.get("/clusters", params={"MaxResults": 1}).json()["NextToken"]
    response = http.get("/clusters", params={"MaxResults": 1, "NameContains": "alpha", "NextToken": token})
    assert response.status_code == 400
    assert response.json() == {
        "__type": "ValidationException",
        "message": "Invalid NextToken: pass the NextToken of the previous page of the same request.",
    }


def test_nodes_routes(control_plane: ControlPlane, http: httpx.Client, sm: Any) -> None:
    create(http, "demo", count=3)
    settle(control_plane, http, "demo")

    response = http.get("/clusters/demo/nodes", params={"IncludeNodeLogicalIds": "true"})
    assert response.status_code == 200
    nodes = response.json()
    summaries = nodes["ClusterNodeSummaries"]
    assert len(summaries) == 3
    assert {n["InstanceStatus"]["Status"] for n in summaries} == {"Running"}
    assert all(n["NodeLogicalId"] for n in summaries)
    assert nodes == wire(sm.list_cluster_nodes(ClusterName="demo", IncludeNodeLogicalIds=True))

    paged = http.get("/clusters/demo/nodes", params={"MaxResults": 2}).json()
    assert len(paged["ClusterNodeSummaries"]) == 2
    rest = http.get("/clusters/demo/nodes", params={"MaxResults": 2, "NextToken": paged["NextToken"]}).json()
    assert len(rest["ClusterNodeSummaries"]) == 1
    assert "NextToken" not in rest
    paged_ids = [n["InstanceId"] for n in paged["ClusterNodeSummaries"] + rest["ClusterNodeSummaries"]]
    assert sorted(paged_ids) == sorted(n["InstanceId"] for n in summaries)
    # A page that ends the listing exactly says no more follow.
    whole = http.get("/clusters/demo/nodes", params={"MaxResults": 3}).json()
    assert len(whole["ClusterNodeSummaries"]) == 3
    assert "NextToken" not in whole

    node_id = summaries[0]["InstanceId"]
    response = http.get(f"/clusters/demo/nodes/{node_id}")
    assert response.status_code == 200
    details = response.json()["NodeDetails"]
    assert details["InstanceId"] == node_id
    assert details["InstanceGroupName"] == "workers"
    assert details["NodeLogicalId"] == summaries[0]["NodeLogicalId"]
    assert response.json() == wire(sm.describe_cluster_node(ClusterName="demo", NodeId=node_id))

    missing = http.get("/clusters/demo/nodes/i-0123456789abcdef0")
    assert missing.status_code == 404
    assert missing.json() == {
        "__type": "ResourceNotFound",
        "message": "Node 'i-0123456789abcdef0' does not exist in cluster 'demo'.",
    }
    no_cluster = http.get("/clusters/nope/nodes")
    assert no_cluster.status_code == 404
    assert no_cluster.json() == {"__type": "ResourceNotFound", "message": "Cluster 'nope' does not exist."}


def test_batch_delete_nodes(control_plane: ControlPlane, http: httpx.Client) -> None:
    create(http, "demo", count=3)
    settle(control_plane, http, "demo")
    victim = node_ids(http, "demo")[0]

    response = http.post(
        "/clusters/demo/nodes/batch-delete", json={"NodeIds": [victim, "i-0123456789abcdef0"]}
    )
    assert response.status_code == 200, response.text
    assert response.json() == {
        "Successful": [victim],
        "Failed": [
            {
                "Code": "NodeIdNotFound",
                "Message": "Node i-0123456789abcdef0 is not part of cluster 'demo'.",
                "NodeId": "i-0123456789abcdef0",
            }
        ],
    }
    control_plane.services.reconciler.wake()
    wait_for(lambda: victim not in node_ids(http, "demo"), what="the deleted node to go")
    assert len(node_ids(http, "demo")) == 2
    assert describe(http, "demo")["InstanceGroups"][0]["TargetCount"] == 2

    empty = http.post("/clusters/demo/nodes/batch-delete", json={})
    assert empty.status_code == 400
    assert empty.json() == {"__type": "ValidationException", "message": "Specify NodeIds or NodeLogicalIds."}


def test_tags_routes(http: httpx.Client, sm: Any) -> None:
    arn = create(http, "demo")

    added = http.post(
        "/tags",
        json={
            "ResourceArn": arn,
            "Tags": [{"Key": "team", "Value": "research"}, {"Key": "env", "Value": "dev"}],
        },
    )
    assert added.status_code == 200, added.text
    assert added.json() == {"Tags": [{"Key": "team", "Value": "research"}, {"Key": "env", "Value": "dev"}]}

    listed = http.get("/tags", params={"ResourceArn": arn})
    assert listed.status_code == 200
    assert listed.json() == {"Tags": [{"Key": "env", "Value": "dev"}, {"Key": "team", "Value": "research"}]}
    assert listed.json() == wire(sm.list_tags(ResourceArn=arn))

    deleted = http.post("/tags/delete", json={"ResourceArn": arn, "TagKeys": ["env"]})
    assert deleted.status_code == 200
    assert deleted.json() == {}
    assert http.get("/tags", params={"ResourceArn": arn}).json() == {
        "Tags": [{"Key": "team", "Value": "research"}]
    }

    missing_arn = http.get("/tags")
    assert missing_arn.status_code == 400
    assert missing_arn.json() == {
        "__type": "ValidationException",
        "message": "1 validation error detected: Value null at 'resourceArn' failed to satisfy constraint: "
        "Member must not be null",
    }


def test_delete_cluster(control_plane: ControlPlane, http: httpx.Client) -> None:
    arn = create(http, "demo")
    settle(control_plane, http, "demo")
    response = http.delete("/clusters/demo")
    assert response.status_code == 200
    assert response.json() == {"ClusterArn": arn}
    # The reconciler may already have removed it; until then it reads Deleting.
    after = http.get("/clusters/demo")
    assert after.status_code == 404 or after.json()["ClusterStatus"] == "Deleting", after.text
    wait_for(lambda: http.get("/clusters/demo").status_code == 404, what="cluster demo to be deleted")
    assert http.get("/clusters").json() == {"ClusterSummaries": []}
    again = http.delete("/clusters/demo")
    assert again.status_code == 404
    assert again.json() == {"__type": "ResourceNotFound", "message": "Cluster 'demo' does not exist."}


# ------------------------------------------------------------------------------------ REST errors


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/clusters/nope"), ("PATCH", "/clusters/nope"), ("DELETE", "/clusters/nope")],
)
def test_missing_cluster_is_404(http: httpx.Client, method: str, path: str) -> None:
    kwargs: dict[str, Any] = {"json": {"InstanceGroups": [group()]}} if method == "PATCH" else {}
    response = http.request(method, path, **kwargs)
    assert response.status_code == 404
    assert response.json() == {"__type": "ResourceNotFound", "message": "Cluster 'nope' does not exist."}
    assert response.headers["x-amzn-errortype"] == "ResourceNotFound"


def test_duplicate_create_is_409(http: httpx.Client) -> None:
    create(http, "demo")
    response = http.post("/clusters", json=create_body("demo"))
    assert response.status_code == 409
    assert response.json() == {
        "__type": "ResourceInUse",
        "message": "Cluster with name 'demo' already exists.",
    }


def test_invalid_name_is_400_with_aws_message(http: httpx.Client) -> None:
    response = http.post("/clusters", json=create_body("bad_name!"))
    assert response.status_code == 400
    assert response.json() == {
        "__type": "ValidationException",
        "message": "1 validation error detected: Value 'bad_name!' at 'clusterName' failed to satisfy "
        f"constraint: Member must satisfy regular expression pattern: {NAME_PATTERN}",
    }
    assert http.get("/clusters").json() == {"ClusterSummaries": []}


def test_too_long_name_reports_every_violation(http: httpx.Client) -> None:
    name = "a" * 64
    response = http.post("/clusters", json=create_body(name))
    assert response.status_code == 400
    assert response.json() == {
        "__type": "ValidationException",
        "message": f"1 validation error detected: Value '{name}' at 'clusterName' failed to satisfy "
        "constraint: Member must have length less than or equal to 63",
    }


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"{not json", "The request body is not valid JSON."),
        (b'["ClusterName"]', "The request body must be a JSON object."),
    ],
)
def test_non_json_body_is_serialization_error(http: httpx.Client, content: bytes, message: str) -> None:
    response = http.post("/clusters", content=content, headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json() == {"__type": "SerializationException", "message": message}


def test_query_parameter_of_wrong_type_is_400(http: httpx.Client) -> None:
    response = http.get("/clusters", params={"MaxResults": "abc"})
    assert response.status_code == 400
    # A query string is text: one that is not an integer is a constraint violation (REST only).
    assert response.json() == {
        "__type": "ValidationException",
        "message": "1 validation error detected: Value 'abc' at 'maxResults' failed to satisfy "
        "constraint: Member must be an integer (ASCII digits, at most 18)",
    }


def test_query_parameter_out_of_range_is_validation_error(http: httpx.Client) -> None:
    response = http.get("/clusters", params={"MaxResults": "0"})
    assert response.status_code == 400
    assert response.json() == {
        "__type": "ValidationException",
        "message": "1 validation error detected: Value '0' at 'maxResults' failed to satisfy constraint: "
        "Member must have value greater than or equal to 1",
    }


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [("GET", "/clusters/demo/nodes/i-0123456789abcdef0/extra", 404), ("PUT", "/clusters/demo", 405)],
)
def test_unrouted_requests_answer_in_the_aws_error_shape(
    http: httpx.Client, method: str, path: str, status: int
) -> None:
    response = http.request(method, path)
    assert response.status_code == status
    body = response.json()
    assert set(body) == {"__type", "message"}, body
    assert body["message"]


def test_unknown_query_parameter_is_rejected(http: httpx.Client) -> None:
    response = http.get("/clusters", params={"Colour": "blue"})
    assert response.status_code == 400
    body = response.json()
    assert body["__type"] == "ValidationException"
    assert body["message"].startswith(
        "1 validation error detected: Unknown member 'Colour' at 'input': allowed members are "
    )


# ------------------------------------------------------------------------------------ OpenAPI


def test_openapi_document(http: httpx.Client) -> None:
    response = http.get("/openapi.json")
    assert response.status_code == 200
    document = response.json()
    paths = document["paths"]

    for route in ROUTES:
        assert route.path in paths, route.path
        operation = paths[route.path].get(route.method.lower())
        assert operation is not None, f"{route.method} {route.path}"
        assert operation["operationId"] == route.operation
        assert route.operation in operation["description"]
        assert operation["summary"] == route.summary
    aws = paths["/"]["post"]
    assert aws["description"]
    assert all(f"`{name}`" in aws["description"] for name in OPERATIONS)
    assert [p["name"] for p in aws["parameters"]] == ["X-Amz-Target"]

    schemas = document["components"]["schemas"]
    name = schemas["CreateClusterRequest"]["properties"]["ClusterName"]
    assert name["type"] == "string"
    assert name["maxLength"] == 63
    assert name["pattern"] == f"^(?:{NAME_PATTERN})$"
    assert "ClusterName" in schemas["CreateClusterRequest"]["required"]

    create_op = paths["/clusters"]["post"]
    content = create_op["requestBody"]["content"]["application/json"]
    assert content["schema"] == {"$ref": "#/components/schemas/CreateClusterRequest"}
    assert content["example"]["ClusterName"] == "demo"
    assert content["example"]["InstanceGroups"][0]["InstanceCount"] == 4
    response_schema = create_op["responses"]["200"]["content"]["application/json"]["schema"]
    assert response_schema["$ref"] == "#/components/schemas/CreateClusterResponse"
    assert "CreateClusterResponse" in schemas

    # Every $ref in the document resolves.
    refs = set(_refs(document))
    assert refs
    assert {ref.rsplit("/", 1)[1] for ref in refs} <= set(schemas)

    # Query routes document their parameters, typed.
    list_params = {p["name"]: p for p in paths["/clusters"]["get"]["parameters"]}
    assert list_params["MaxResults"]["schema"]["type"] == "integer"
    assert list_params["MaxResults"]["in"] == "query"
    assert {"NameContains", "NextToken", "SortBy", "SortOrder"} <= set(list_params)


def test_every_openapi_operation_has_a_description(http: httpx.Client) -> None:
    paths = http.get("/openapi.json").json()["paths"]
    undescribed = [
        f"{method.upper()} {path}"
        for path, operations in paths.items()
        for method, operation in operations.items()
        if not operation.get("description")
    ]
    assert undescribed == []


def test_openapi_example_is_accepted_by_the_route(http: httpx.Client) -> None:
    """The documented CreateCluster example is a request the service takes."""
    document = http.get("/openapi.json").json()
    example = document["paths"]["/clusters"]["post"]["requestBody"]["content"]["application/json"]["example"]
    response = http.post("/clusters", json=example)
    assert response.status_code == 200, response.text
    assert describe(http, example["ClusterName"])["TieredStorageConfig"] == example["TieredStorageConfig"]


def _refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                yield value
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from _refs(item)


def test_docs_page(http: httpx.Client) -> None:
    response = http.get("/docs")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    assert "/openapi.json" in response.text


# ------------------------------------------------------------------------------------ AWS JSON entry


def test_unknown_operation(http: httpx.Client) -> None:
    response = http.post("/", headers={"X-Amz-Target": "SageMaker.NoSuchOperation"}, json={})
    assert response.status_code == 400
    assert response.headers["content-type"] == AMZ_JSON
    assert response.headers["x-amzn-errortype"] == "UnknownOperationException"
    assert response.json() == {
        "__type": "UnknownOperationException",
        "message": "Operation NoSuchOperation is not supported by hyperpod-sim. Supported operations: "
        + ", ".join(sorted(OPERATIONS))
        + ".",
    }


@pytest.mark.parametrize("headers", [{}, {"X-Amz-Target": "DescribeCluster"}])
def test_missing_or_malformed_target(http: httpx.Client, headers: dict[str, str]) -> None:
    response = http.post("/", headers=headers, json={"ClusterName": "demo"})
    assert response.status_code == 400
    assert response.headers["content-type"] == AMZ_JSON
    target = headers.get("X-Amz-Target", "")
    assert response.json() == {
        "__type": "UnknownOperationException",
        "message": f"Missing or unknown X-Amz-Target '{target}'; expected 'SageMaker.<Operation>'.",
    }


def test_aws_json_errors_and_content_type(http: httpx.Client) -> None:
    target = {"X-Amz-Target": "SageMaker.DescribeCluster", "Content-Type": AMZ_JSON}
    missing = http.post("/", headers=target, content=json.dumps({"ClusterName": "nope"}))
    # The AWS protocol keeps AWS's status: 400, not REST's 404.
    assert missing.status_code == 400
    assert missing.headers["content-type"] == AMZ_JSON
    assert missing.headers["x-amzn-requestid"]
    assert missing.json() == {"__type": "ResourceNotFound", "message": "Cluster 'nope' does not exist."}

    garbled = http.post("/", headers=target, content=b"{not json")
    assert garbled.status_code == 400
    assert garbled.json() == {
        "__type": "SerializationException",
        "message": "The request body is not valid JSON.",
    }


def test_aws_json_accepts_sigv4_signed_request(control_plane: ControlPlane, http: httpx.Client) -> None:
    create(http, "demo")
    body = json.dumps({"ClusterName": "demo"})
    request = AWSRequest(
        method="POST",
        url=f"{control_plane.url}/",
        data=body,
        headers={"X-Amz-Target": "SageMaker.DescribeCluster", "Content-Type": AMZ_JSON},
    )
    SigV4Auth(Credentials("AKIDEXAMPLE", "dummy-secret"), "sagemaker", "us-east-1").add_auth(request)
    headers = dict(request.headers.items())
    assert headers["Authorization"].startswith("AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/")
    response = http.post("/", headers=headers, content=body)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == AMZ_JSON
    assert response.json()["ClusterName"] == "demo"
    assert response.json() == describe(http, "demo")
