"""Unit tests for hyperpod_sim/api/shapes.py: validation, serialization and JSON Schema from botocore's model.

Besides hand-written cases for every rule, this file walks botocore's input shapes of the
HyperPod operations and, for every constraint found there, builds a valid request, breaks that
one constraint and checks that ``validate_input`` reports it (the drift cross-check). A botocore
upgrade that adds a constraint adds a case; one that adds a pattern-constrained string shape
fails ``test_every_pattern_shape_has_a_sample`` until a known-good sample is added below.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
import regex

from hyperpod_sim.api.patterns import java_to_python_pattern
from hyperpod_sim.api.shapes import (
    _Validator,
    camel,
    operation_schemas,
    render,
    serialize_output,
    service_model,
    shape_to_json_schema,
    validate_input,
)
from hyperpod_sim.domain.errors import (
    SerializationException,
    UnknownOperationException,
    ValidationException,
)

OPERATIONS = (
    "CreateCluster",
    "UpdateCluster",
    "DescribeCluster",
    "ListClusters",
    "DeleteCluster",
    "ListClusterNodes",
    "DescribeClusterNode",
    "BatchDeleteClusterNodes",
    "AddTags",
    "ListTags",
    "DeleteTags",
    "ListClusterEvents",
    "DescribeClusterEvent",
    "DescribeClusterOperation",
    "ListClusterOperations",
    "CreateClusterSchedulerConfig",
    "DescribeClusterSchedulerConfig",
    "ListClusterSchedulerConfigs",
    "UpdateClusterSchedulerConfig",
    "DeleteClusterSchedulerConfig",
    "CreateClusterExtension",
    "DescribeClusterExtension",
    "ListClusterExtensions",
    "UpdateClusterExtension",
    "DeleteClusterExtension",
    "ListClusterExtensionVersions",
    "AttachClusterNodeVolume",
    "DetachClusterNodeVolume",
    "AttachClusterNodeNetworkInterface",
)

ROLE = "arn:aws:iam::123456789012:role/hp"
EKS = "arn:aws:eks:us-east-1:123456789012:cluster/my-eks"
CLUSTER_PATTERN = "[a-zA-Z0-9](-*[a-zA-Z0-9])*"


def message_of(operation: str, params: object) -> str:
    with pytest.raises(ValidationException) as caught:
        validate_input(operation, params)
    return caught.value.message


def serialization_message(operation: str, params: object) -> str:
    with pytest.raises(SerializationException) as caught:
        validate_input(operation, params)
    return caught.value.message


def group(**extra: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "InstanceGroupName": "workers",
        "InstanceType": "ml.p5.48xlarge",
        "InstanceCount": 2,
        "ExecutionRole": ROLE,
    }
    spec.update(extra)
    return spec


# --------------------------------------------------------------------------------------------
# Rule by rule, whole messages
# --------------------------------------------------------------------------------------------


def test_camel_lowers_only_the_first_character() -> None:
    assert camel("ClusterName") == "clusterName"
    assert camel("VpcConfig") == "vpcConfig"
    assert camel("EbsVolumeConfig") == "ebsVolumeConfig"
    assert camel("FSxLustreConfig") == "fSxLustreConfig"
    assert camel("") == ""


def test_service_model_is_cached() -> None:
    assert service_model() is service_model()
    assert service_model().service_name == "sagemaker"


def test_pattern_violation_message() -> None:
    assert message_of("CreateCluster", {"ClusterName": "bad name"}) == (
        "1 validation error detected: Value 'bad name' at 'clusterName' failed to satisfy "
        f"constraint: Member must satisfy regular expression pattern: {CLUSTER_PATTERN}"
    )


def test_pattern_is_a_full_match_not_a_search() -> None:
    # "abc-" has a matching prefix; AWS applies the whole pattern to the whole value.
    assert message_of("CreateCluster", {"ClusterName": "abc-"}) == (
        "1 validation error detected: Value 'abc-' at 'clusterName' failed to satisfy "
        f"constraint: Member must satisfy regular expression pattern: {CLUSTER_PATTERN}"
    )


def test_missing_required_member() -> None:
    assert message_of("CreateCluster", {}) == (
        "1 validation error detected: Value null at 'clusterName' failed to satisfy "
        "constraint: Member must not be null"
    )


def test_explicit_null_counts_as_missing() -> None:
    assert message_of("CreateCluster", {"ClusterName": None}) == (
        "1 validation error detected: Value null at 'clusterName' failed to satisfy "
        "constraint: Member must not be null"
    )


def test_optional_null_is_dropped() -> None:
    assert validate_input("CreateCluster", {"ClusterName": "a", "NodeRecovery": None}) == {"ClusterName": "a"}


def test_string_too_long() -> None:
    name = "x" * 64
    assert message_of("CreateCluster", {"ClusterName": name}) == (
        f"1 validation error detected: Value '{name}' at 'clusterName' failed to satisfy "
        "constraint: Member must have length less than or equal to 63"
    )


def test_string_too_short_reports_length_and_pattern() -> None:
    assert message_of("DescribeClusterNode", {"ClusterName": "c", "NodeId": ""}) == (
        "2 validation errors detected: "
        "Value '' at 'nodeId' failed to satisfy constraint: "
        "Member must have length greater than or equal to 1; "
        "Value '' at 'nodeId' failed to satisfy constraint: "
        "Member must satisfy regular expression pattern: i-[a-f0-9]{8}(?:[a-f0-9]{9})?"
    )


def test_length_counts_code_points() -> None:
    arn = "arn:aws:sagemaker:us-east-1:123456789012:cluster/abcdefghijkl"
    ok = {"ResourceArn": arn, "Tags": [{"Key": "é" * 128, "Value": "中" * 256}]}
    assert validate_input("AddTags", ok) == ok
    too_long = {"ResourceArn": arn, "Tags": [{"Key": "é" * 129, "Value": "v"}]}
    assert message_of("AddTags", too_long) == (
        f"1 validation error detected: Value '{'é' * 129}' at 'tags.1.member.key' failed to "
        "satisfy constraint: Member must have length less than or equal to 128"
    )


def test_unicode_tag_keys_pass_the_p_l_pattern() -> None:
    params = {
        "ResourceArn": "arn:aws:sagemaker:us-east-1:123456789012:cluster/abcdefghijkl",
        "Tags": [
            {"Key": "équipe", "Value": "données"},
            {"Key": "チーム", "Value": "機械 学習"},
            {"Key": "kostenstelle_42:a/b=c+d-e@f", "Value": ""},
        ],
    }
    assert validate_input("AddTags", params) == params


def test_tag_key_outside_the_pattern() -> None:
    params = {
        "ResourceArn": "arn:aws:sagemaker:us-east-1:123456789012:cluster/abcdefghijkl",
        "TagKeys": ["ok", "not!ok"],
    }
    assert message_of("DeleteTags", params) == (
        "1 validation error detected: Value 'not!ok' at 'tagKeys.2.member' failed to satisfy "
        "constraint: Member must satisfy regular expression pattern: "
        "([\\p{L}\\p{Z}\\p{N}_.:/=+\\-@]*)"
    )


def test_enum_violation() -> None:
    assert message_of("CreateCluster", {"ClusterName": "a", "NodeRecovery": "Foo"}) == (
        "1 validation error detected: Value 'Foo' at 'nodeRecovery' failed to satisfy "
        "constraint: Member must satisfy enum value set: [Automatic, None]"
    )


def test_integer_below_minimum() -> None:
    params = {"ClusterName": "a", "InstanceGroups": [group(ThreadsPerCore=0)]}
    assert message_of("CreateCluster", params) == (
        "1 validation error detected: Value '0' at 'instanceGroups.1.member.threadsPerCore' "
        "failed to satisfy constraint: Member must have value greater than or equal to 1"
    )


def test_integer_above_maximum() -> None:
    params = {"ClusterName": "a", "InstanceGroups": [group(), group(ThreadsPerCore=3)]}
    assert message_of("CreateCluster", params) == (
        "1 validation error detected: Value '3' at 'instanceGroups.2.member.threadsPerCore' "
        "failed to satisfy constraint: Member must have value less than or equal to 2"
    )


def test_empty_list_below_minimum() -> None:
    assert message_of("CreateCluster", {"ClusterName": "a", "InstanceGroups": []}) == (
        "1 validation error detected: Value '[]' at 'instanceGroups' failed to satisfy "
        "constraint: Member must have length greater than or equal to 1"
    )


def test_list_above_maximum_renders_a_truncated_value() -> None:
    params = {"ClusterName": "a", "InstanceGroups": [group() for _ in range(101)]}
    message = message_of("CreateCluster", params)
    match = re.fullmatch(
        r"1 validation error detected: Value '(.*)' at 'instanceGroups' failed to satisfy "
        r"constraint: Member must have length less than or equal to 100",
        message,
    )
    assert match is not None, message
    assert match.group(1).startswith("[{'InstanceGroupName': 'workers'")
    assert len(match.group(1)) <= 200


def test_list_elements_are_validated() -> None:
    params = {
        "ClusterName": "c",
        "NodeIds": ["i-0123456789abcdef0", "i-zz"],
    }
    assert message_of("BatchDeleteClusterNodes", params) == (
        "1 validation error detected: Value 'i-zz' at 'nodeIds.2.member' failed to satisfy "
        "constraint: Member must satisfy regular expression pattern: "
        "i-[a-f0-9]{8}(?:[a-f0-9]{9})?"
    )


def test_map_key_and_value_paths() -> None:
    labels = {"": "v", "team": "bad value!"}
    params = {"ClusterName": "a", "InstanceGroups": [group(KubernetesConfig={"Labels": labels})]}
    where = "instanceGroups.1.member.kubernetesConfig.labels"
    key_pattern = (
        "([a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
        "[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
    )
    assert message_of("CreateCluster", params) == (
        "3 validation errors detected: "
        f"Value '' at '{where}' failed to satisfy constraint: "
        "Member must have length greater than or equal to 1; "
        f"Value '' at '{where}' failed to satisfy constraint: "
        f"Member must satisfy regular expression pattern: {key_pattern}; "
        f"Value 'bad value!' at '{where}.team' failed to satisfy constraint: "
        "Member must satisfy regular expression pattern: (([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?"
    )


def test_map_size_limit() -> None:
    labels = {f"k{i}": "v" for i in range(51)}
    params = {"ClusterName": "a", "InstanceGroups": [group(KubernetesConfig={"Labels": labels})]}
    message = message_of("CreateCluster", params)
    assert message.startswith("1 validation error detected: Value '{'k0': 'v'")
    assert message.endswith(
        "' at 'instanceGroups.1.member.kubernetesConfig.labels' failed to satisfy constraint: "
        "Member must have length less than or equal to 50"
    )


def test_two_errors_follow_model_member_order() -> None:
    # Params list NodeRecovery first; the model lists ClusterName first, and so does AWS.
    params = {"NodeRecovery": "Sometimes", "ClusterName": "bad name"}
    assert message_of("CreateCluster", params) == (
        "2 validation errors detected: "
        "Value 'bad name' at 'clusterName' failed to satisfy constraint: "
        f"Member must satisfy regular expression pattern: {CLUSTER_PATTERN}; "
        "Value 'Sometimes' at 'nodeRecovery' failed to satisfy constraint: "
        "Member must satisfy enum value set: [Automatic, None]"
    )


def test_errors_are_depth_first() -> None:
    params = {
        "VpcConfig": {"SecurityGroupIds": [], "Subnets": ["subnet-1"]},
        "InstanceGroups": [group(InstanceCount=-1)],
    }
    assert message_of("CreateCluster", params) == (
        "3 validation errors detected: "
        "Value null at 'clusterName' failed to satisfy constraint: Member must not be null; "
        "Value '-1' at 'instanceGroups.1.member.instanceCount' failed to satisfy constraint: "
        "Member must have value greater than or equal to 0; "
        "Value '[]' at 'vpcConfig.securityGroupIds' failed to satisfy constraint: "
        "Member must have length greater than or equal to 1"
    )


def test_unknown_member_at_the_top() -> None:
    assert message_of("DeleteCluster", {"ClusterName": "a", "Force": True}) == (
        "1 validation error detected: Unknown member 'Force' at 'input': allowed members are ClusterName"
    )


def test_unknown_member_in_a_nested_structure() -> None:
    params = {"ClusterName": "a", "InstanceGroups": [group(Colour="blue")]}
    members = ", ".join(service_model().shape_for("ClusterInstanceGroupSpecification").members)
    assert message_of("CreateCluster", params) == (
        "1 validation error detected: Unknown member 'Colour' at 'instanceGroups.1.member': "
        f"allowed members are {members}"
    )
    assert members.startswith("InstanceCount, MinInstanceCount, InstanceGroupName")


def test_unknown_member_comes_after_known_ones() -> None:
    assert message_of("DeleteCluster", {"Extra": 1}) == (
        "2 validation errors detected: "
        "Value null at 'clusterName' failed to satisfy constraint: Member must not be null; "
        "Unknown member 'Extra' at 'input': allowed members are ClusterName"
    )


@pytest.mark.parametrize(
    ("params", "message"),
    [
        pytest.param(
            {"ClusterName": "a", "InstanceGroups": [group(InstanceCount="1")]},
            "Unexpected value type for 'instanceGroups.1.member.instanceCount': expected integer, got string",
            id="string-for-integer",
        ),
        pytest.param(
            {"ClusterName": "a", "InstanceGroups": [group(InstanceCount=True)]},
            "Unexpected value type for 'instanceGroups.1.member.instanceCount': "
            "expected integer, got boolean",
            id="bool-for-integer",
        ),
        pytest.param(
            {"ClusterName": "a", "InstanceGroups": [group(InstanceCount=3.0)]},
            "Unexpected value type for 'instanceGroups.1.member.instanceCount': expected integer, got number",
            id="float-for-integer",
        ),
        pytest.param(
            {"ClusterName": 7},
            "Unexpected value type for 'clusterName': expected string, got integer",
            id="integer-for-string",
        ),
        pytest.param(
            {"ClusterName": "a", "VpcConfig": "vpc-1"},
            "Unexpected value type for 'vpcConfig': expected structure, got string",
            id="string-for-structure",
        ),
        pytest.param(
            {"ClusterName": "a", "InstanceGroups": {"InstanceCount": 1}},
            "Unexpected value type for 'instanceGroups': expected list, got object",
            id="object-for-list",
        ),
        pytest.param(
            {"ClusterName": "a", "InstanceGroups": [None]},
            "Unexpected value type for 'instanceGroups.1.member': expected structure, got null",
            id="null-list-element",
        ),
        pytest.param(
            {"ClusterName": "a", "InstanceGroups": [group(KubernetesConfig={"Labels": []})]},
            "Unexpected value type for 'instanceGroups.1.member.kubernetesConfig.labels': "
            "expected map, got array",
            id="array-for-map",
        ),
        pytest.param(
            {
                "ClusterName": "a",
                "InstanceGroups": [
                    group(InstanceStorageConfigs=[{"EbsVolumeConfig": {"RootVolume": "yes"}}])
                ],
            },
            "Unexpected value type for "
            "'instanceGroups.1.member.instanceStorageConfigs.1.member.ebsVolumeConfig"
            ".rootVolume': expected boolean, got string",
            id="string-for-boolean",
        ),
    ],
)
def test_type_mismatch_is_a_serialization_error(params: dict[str, Any], message: str) -> None:
    assert serialization_message("CreateCluster", params) == message


def test_type_mismatch_is_raised_before_collected_errors_are_reported() -> None:
    params = {"ClusterName": "bad name", "VpcConfig": 3}
    assert serialization_message("CreateCluster", params) == (
        "Unexpected value type for 'vpcConfig': expected structure, got integer"
    )


@pytest.mark.parametrize("body", [[], "x", 1, None, True])
def test_body_must_be_an_object(body: object) -> None:
    message = serialization_message("ListClusters", body)
    assert message.startswith("Unexpected value type for 'input': expected structure, got ")


def test_float_shapes_accept_numbers_but_not_booleans() -> None:
    shape = service_model().shape_for("NumberOfCpuCores")
    assert shape.type_name in ("float", "double")
    validator = _Validator()
    assert validator.value(shape, 2, "cores") == 2
    assert validator.value(shape, 2.5, "cores") == 2.5
    assert validator.errors == []
    with pytest.raises(SerializationException):
        validator.value(shape, True, "cores")
    with pytest.raises(SerializationException):
        validator.value(shape, "2", "cores")


def test_unknown_operation() -> None:
    with pytest.raises(UnknownOperationException):
        validate_input("LaunchRockets", {})


# --------------------------------------------------------------------------------------------
# Timestamps and pass-through
# --------------------------------------------------------------------------------------------


def test_epoch_timestamp_becomes_an_aware_datetime() -> None:
    result = validate_input("ListClusters", {"CreationTimeAfter": 1700000000, "MaxResults": 5})
    assert result == {
        "CreationTimeAfter": datetime(2023, 11, 14, 22, 13, 20, tzinfo=UTC),
        "MaxResults": 5,
    }
    assert result["CreationTimeAfter"].utcoffset() == timedelta(0)


def test_fractional_epoch_and_iso_timestamps() -> None:
    result = validate_input(
        "ListClusterNodes",
        {
            "ClusterName": "c",
            "CreationTimeAfter": 1700000000.5,
            "CreationTimeBefore": "2024-01-02T03:04:05+02:00",
        },
    )
    assert result["CreationTimeAfter"] == datetime(2023, 11, 14, 22, 13, 20, 500000, tzinfo=UTC)
    before = result["CreationTimeBefore"]
    assert before == datetime(2024, 1, 2, 1, 4, 5, tzinfo=UTC)
    assert before.tzinfo == UTC


def test_iso_timestamp_with_z_and_without_zone() -> None:
    result = validate_input(
        "ListClusters",
        {"CreationTimeAfter": "2024-01-01T00:00:00Z", "CreationTimeBefore": "2024-01-01T00:00:00"},
    )
    assert result["CreationTimeAfter"] == datetime(2024, 1, 1, tzinfo=UTC)
    assert result["CreationTimeBefore"] == datetime(2024, 1, 1, tzinfo=UTC)


@pytest.mark.parametrize("value", ["yesterday", True, [1], {"s": 1}])
def test_bad_timestamp_is_a_serialization_error(value: object) -> None:
    message = serialization_message("ListClusters", {"CreationTimeAfter": value})
    assert "'creationTimeAfter'" in message


def full_create_cluster_request() -> dict[str, Any]:
    return {
        "ClusterName": "ml-cluster-1",
        "InstanceGroups": [
            {
                "InstanceGroupName": "gpu-workers",
                "InstanceType": "ml.p5.48xlarge",
                "InstanceCount": 4,
                "ExecutionRole": ROLE,
                "LifeCycleConfig": {"SourceS3Uri": "s3://bucket/lc", "OnCreate": "on_create.sh"},
                "ThreadsPerCore": 1,
                "InstanceStorageConfigs": [{"EbsVolumeConfig": {"VolumeSizeInGB": 500}}],
                "OnStartDeepHealthChecks": ["InstanceStress", "InstanceConnectivity"],
            },
            {
                "InstanceGroupName": "controller",
                "InstanceType": "ml.m5.xlarge",
                "InstanceCount": 1,
                "ExecutionRole": ROLE,
                "LifeCycleConfig": {"SourceS3Uri": "s3://bucket/lc", "OnCreate": "on_create.sh"},
            },
        ],
        "VpcConfig": {
            "SecurityGroupIds": ["sg-0123456789abcdef0"],
            "Subnets": ["subnet-0123456789abcdef0", "subnet-0fedcba9876543210"],
        },
        "Orchestrator": {"Eks": {"ClusterArn": EKS}},
        "TieredStorageConfig": {"Mode": "Enable", "InstanceMemoryAllocationPercentage": 20},
        "NodeRecovery": "Automatic",
        "Tags": [{"Key": "team", "Value": "ml"}, {"Key": "cost-center", "Value": "42"}],
    }


def test_full_create_cluster_request_passes_unchanged() -> None:
    params = full_create_cluster_request()
    pristine = copy.deepcopy(params)
    result = validate_input("CreateCluster", params)
    assert result == pristine
    assert params == pristine  # the input is not mutated
    assert result is not params


def test_java_regex_semantics() -> None:
    # Java's \d is ASCII: Arabic-Indic digits are not an account id.
    role = "arn:aws:iam::" + "\u0663" * 12 + ":role/hp"
    params = {"ClusterName": "a", "InstanceGroups": [group(ExecutionRole=role)]}
    assert "Member must satisfy regular expression pattern" in message_of("CreateCluster", params)
    # Java's "." stops at every line terminator, not only "\n".
    assert "at 'nextToken'" in message_of("ListClusters", {"NextToken": "a\rb"})
    assert validate_input("ListClusters", {"NextToken": "a b"}) == {"NextToken": "a b"}


def test_java_to_python_pattern() -> None:
    assert java_to_python_pattern("\\d{12}") == "[0-9]{12}"
    assert java_to_python_pattern("[\\d.]") == "[0-9.]"
    assert java_to_python_pattern("[\\S\\s]+") == "[\\S\\s]+"
    assert java_to_python_pattern("\\.x.") == "\\.x[^\\n\\r\\u0085\\u2028\\u2029]"
    assert java_to_python_pattern("[\\p{L}_]*") == "[\\p{L}_]*"
    assert java_to_python_pattern("[]a]") == "[\\]a]"
    # Java writes supplementary characters as UTF-16 surrogate pairs.
    assert java_to_python_pattern("[\\uD800\\uDC00-\\uDBFF\\uDFFF]") == ("[\\U00010000-\\U0010FFFF]")
    # Every pattern in the model compiles after translation.
    model = service_model()
    for name in model.shape_names:
        pattern = model.shape_for(name).metadata.get("pattern")
        if pattern is not None:
            regex.compile(java_to_python_pattern(pattern))


# --------------------------------------------------------------------------------------------
# serialize_output
# --------------------------------------------------------------------------------------------


def test_serialize_output_converts_datetimes_and_drops_none() -> None:
    created = datetime(2024, 1, 1, tzinfo=UTC)
    data = {
        "ClusterArn": "arn:aws:sagemaker:us-east-1:123456789012:cluster/abcdefghijkl",
        "ClusterName": "c",
        "ClusterStatus": "InService",
        "CreationTime": created,
        "FailureMessage": None,
        "InstanceGroups": [
            {"InstanceGroupName": "g", "CurrentCount": 1, "ExecutionRole": ROLE, "Status": None}
        ],
        "VpcConfig": {"SecurityGroupIds": ["sg-1"], "Subnets": ["subnet-1"]},
    }
    pristine = copy.deepcopy(data)
    assert serialize_output("DescribeCluster", data) == {
        "ClusterArn": "arn:aws:sagemaker:us-east-1:123456789012:cluster/abcdefghijkl",
        "ClusterName": "c",
        "ClusterStatus": "InService",
        "CreationTime": 1704067200.0,
        "InstanceGroups": [{"InstanceGroupName": "g", "CurrentCount": 1, "ExecutionRole": ROLE}],
        "VpcConfig": {"SecurityGroupIds": ["sg-1"], "Subnets": ["subnet-1"]},
    }
    assert data == pristine


def test_serialize_output_walks_lists_of_structures() -> None:
    offset = timezone(timedelta(hours=2))
    data = {
        "ClusterSummaries": [
            {"ClusterName": "a", "CreationTime": datetime(2024, 1, 1, 2, tzinfo=offset)},
            {"ClusterName": "b", "CreationTime": datetime(2024, 1, 1)},  # naive: taken as UTC
        ],
        "NextToken": None,
    }
    result = serialize_output("ListClusters", data)
    assert result == {
        "ClusterSummaries": [
            {"ClusterName": "a", "CreationTime": 1704067200.0},
            {"ClusterName": "b", "CreationTime": 1704067200.0},
        ]
    }
    assert isinstance(result["ClusterSummaries"][0]["CreationTime"], float)


def test_serialize_output_leaves_numbers_in_timestamps_alone() -> None:
    assert serialize_output("DescribeCluster", {"CreationTime": 1.5}) == {"CreationTime": 1.5}


def test_serialize_output_rejects_unknown_keys() -> None:
    with pytest.raises(ValueError, match="'Colour' is not a member of DescribeClusterResponse"):
        serialize_output("DescribeCluster", {"ClusterName": "c", "Colour": "blue"})
    with pytest.raises(ValueError, match="'Colour' is not a member of ClusterInstanceGroupDetails"):
        serialize_output("DescribeCluster", {"InstanceGroups": [{"Colour": "blue"}]})


def test_serialize_output_of_an_empty_output() -> None:
    assert serialize_output("DeleteTags", {}) == {}
    with pytest.raises(ValueError, match="'Anything' is not a member of DeleteTagsOutput"):
        serialize_output("DeleteTags", {"Anything": 1})


# --------------------------------------------------------------------------------------------
# JSON Schema
# --------------------------------------------------------------------------------------------


def test_structure_schema_and_constraints() -> None:
    components: dict[str, dict[str, Any]] = {}
    request, response = operation_schemas("CreateCluster", components)
    assert request == {"$ref": "#/components/schemas/CreateClusterRequest"}
    assert response == {"$ref": "#/components/schemas/CreateClusterResponse"}

    top = components["CreateClusterRequest"]
    assert top["type"] == "object"
    assert top["required"] == ["ClusterName"]
    assert top["additionalProperties"] is False
    assert list(top["properties"]) == list(service_model().shape_for("CreateClusterRequest").members)
    name = top["properties"]["ClusterName"]
    assert name["type"] == "string"
    assert (name["minLength"], name["maxLength"]) == (1, 63)
    assert name["pattern"] == f"^(?:{CLUSTER_PATTERN})$"
    assert name["description"] == "The name for the new SageMaker HyperPod cluster."
    assert top["properties"]["NodeRecovery"]["enum"] == ["Automatic", "None"]
    groups = top["properties"]["InstanceGroups"]
    assert groups["type"] == "array"
    assert (groups["minItems"], groups["maxItems"]) == (1, 100)
    assert groups["items"]["$ref"] == "#/components/schemas/ClusterInstanceGroupSpecification"

    spec = components["ClusterInstanceGroupSpecification"]
    threads = spec["properties"]["ThreadsPerCore"]
    assert (threads["type"], threads["minimum"], threads["maximum"]) == ("integer", 1, 2)
    labels = components["ClusterKubernetesConfig"]["properties"]["Labels"]
    assert labels["type"] == "object"
    assert (labels["minProperties"], labels["maxProperties"]) == (0, 50)
    assert labels["additionalProperties"]["type"] == "string"
    assert labels["propertyNames"]["maxLength"] == 317
    patch_date = components["ClusterPatchSchedule"]["properties"]["NextPatchDate"]
    assert patch_date["type"] == "number"
    assert "epoch seconds" in patch_date["description"]


def test_descriptions_are_plain_and_short() -> None:
    components: dict[str, dict[str, Any]] = {}
    operation_schemas("CreateCluster", components)
    operation_schemas("DescribeCluster", components)
    seen = 0

    def walk(node: object) -> None:
        nonlocal seen
        if isinstance(node, dict):
            text = node.get("description")
            if isinstance(text, str):
                seen += 1
                assert "<" not in text or ">" not in text, text
                assert len(text) <= 300, text
                assert text == text.strip()
                assert "  " not in text
            for child in node.values():
                walk(child)
        elif isinstance(node, list):
            for child in node:
                walk(child)

    walk(components)
    assert seen > 50


def test_recursive_shapes_terminate() -> None:
    shape = service_model().shape_for("SearchExpression")
    components: dict[str, dict[str, Any]] = {}
    assert shape_to_json_schema(shape, components) == {"$ref": "#/components/schemas/SearchExpression"}
    sub = components["SearchExpression"]["properties"]["SubExpressions"]
    assert sub["items"]["$ref"] == "#/components/schemas/SearchExpression"


def test_self_contained_schemas_validate_requests() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    request, response = operation_schemas("DescribeCluster")
    assert request["$ref"] == "#/components/schemas/DescribeClusterRequest"
    assert "DescribeClusterRequest" in request["components"]["schemas"]
    assert "DescribeClusterResponse" in response["components"]["schemas"]
    validator = jsonschema.Draft202012Validator(request)
    assert validator.is_valid({"ClusterName": "my-cluster"})
    assert not validator.is_valid({"ClusterName": "bad name"})
    assert not validator.is_valid({})
    assert not validator.is_valid({"ClusterName": "a", "Extra": 1})


# --------------------------------------------------------------------------------------------
# The drift cross-check: every constraint in the model's input trees is enforced
# --------------------------------------------------------------------------------------------

# Known-good values for every pattern-constrained string shape in the operations' inputs.
SAMPLES: dict[str, str] = {
    "AlarmName": "gpu-utilization-alarm",
    "ClusterArn": "arn:aws:sagemaker:us-east-1:123456789012:cluster/abcdefghijkl",
    "ClusterAccountingDatabaseEndpoint": "slurm-db.cluster-abc.us-east-1.rds.amazonaws.com",
    "ClusterAccountingDatabaseName": "slurm_acct_db",
    "ClusterAccountingDatabaseSecretArn": (
        "arn:aws:secretsmanager:us-east-1:123456789012:secret:slurm-db-AbCdEf"
    ),
    "ClusterDnsName": "fs-0123456789abcdef0.fsx.us-east-1.amazonaws.com",
    "ClusterFsxMountPath": "/fsx",
    "ClusterInstanceGroupName": "gpu-workers",
    "ClusterKubernetesLabelKey": "example.com/team",
    "ClusterKubernetesLabelValue": "ml",
    "ClusterKubernetesTaintKey": "nvidia.com/gpu",
    "ClusterKubernetesTaintValue": "present",
    "ClusterLifeCycleConfigFileName": "on_create.sh",
    "ClusterMountName": "fsx1",
    "ClusterName": "ml-cluster-1",
    "ClusterNameOrArn": "ml-cluster-1",
    "ClusterNodeId": "i-0123456789abcdef0",
    "ClusterNodeLogicalId": "node-logical-1",
    "ClusterSchedulerConfigId": "abcdefghijkl",
    "ClusterSchedulerPriorityClassName": "training",
    "ClusterNetworkInterfaceId": "eni-0123456789abcdef0",
    "ClusterOperationId": "0123abcd-4567-89ab-cdef-0123456789ab",
    "ClusterPartitionName": "dev",
    "EksClusterArn": EKS,
    "EntityDescription": "the cluster policy",
    "EntityName": "policy-1",
    "CreateClusterExtensionRequestClientTokenString": "token-1",
    "ExtensionArn": (
        "arn:aws:sagemaker:us-east-1:123456789012:extension/sagemaker-observability/abcdefghijkl/abc123"
    ),
    "ExtensionName": "sagemaker-observability",
    "ExtensionVersion": "1.0.0",
    "UpdateClusterExtensionRequestClientTokenString": "token-2",
    "EventId": "0123abcd-4567-89ab-cdef-0123456789ab",
    "ImageId": "ami-0123456789abcdef0",
    "ImageReleaseVersion": "2025.1.0",
    "KmsKeyId": "arn:aws:kms:us-east-1:123456789012:key/abcd-1234",
    "NameContains": "ml-cluster",
    "NextToken": "opaque-token-1",
    "ResourceArn": "arn:aws:sagemaker:us-east-1:123456789012:cluster/abcdefghijkl",
    "RoleArn": ROLE,
    "S3Uri": "s3://bucket/lc",
    "SecurityGroupId": "sg-0123456789abcdef0",
    "SubnetId": "subnet-0123456789abcdef0",
    "TagKey": "team",
    "TagValue": "ml",
    "VolumeId": "vol-0123456789abcdef0",
    "TrainingPlanArn": "arn:aws:sagemaker:us-east-1:123456789012:training-plan/my-plan",
}

# Patterns no string of an allowed length can violate: [\S\s]+ accepts anything non-empty.
UNVIOLATABLE_PATTERNS = {"ClusterLifeCycleConfigFileName"}

# Strings tried, padded to the minimum length, to break a pattern without breaking a length.
PATTERN_BREAKERS = ("!", " ", "\n", "#", "a b", "A", "0")

MAX_DEPTH = 10
BAD_ENUM = "NotAnAllowedValue"


@dataclass(frozen=True)
class Step:
    kind: str  # "member", "item", "key", "value"
    name: str = ""


@dataclass(frozen=True)
class Case:
    operation: str
    steps: tuple[Step, ...]
    path: str
    kind: str  # required, min, max, pattern, enum, key-min, key-max, key-pattern
    shape: Any  # the shape whose constraint is broken

    @property
    def id(self) -> str:
        return f"{self.operation}:{self.path}:{self.kind}"


def input_shape(operation: str) -> Any:
    return service_model().operation_model(operation).input_shape


def walk_shapes(operation: str) -> tuple[list[Case], list[Any], list[str]]:
    """Every constraint of an operation's input tree, the string shapes seen, and cut-offs."""
    cases: list[Case] = []
    strings: list[Any] = []
    cut: list[str] = []

    def scalar(shape: Any, steps: tuple[Step, ...], path: str, prefix: str) -> None:
        meta = shape.metadata
        if shape.type_name == "string":
            strings.append(shape)
            if meta.get("min"):
                cases.append(Case(operation, steps, path, prefix + "min", shape))
            if "max" in meta:
                cases.append(Case(operation, steps, path, prefix + "max", shape))
            if "pattern" in meta:
                cases.append(Case(operation, steps, path, prefix + "pattern", shape))
            if shape.enum:
                cases.append(Case(operation, steps, path, prefix + "enum", shape))
        elif shape.type_name in ("integer", "long", "float", "double"):
            for bound in ("min", "max"):
                if bound in meta:
                    cases.append(Case(operation, steps, path, bound, shape))

    def walk(shape: Any, steps: tuple[Step, ...], path: str, stack: tuple[str, ...]) -> None:
        if len(steps) > MAX_DEPTH:
            cut.append(path)
            return
        kind = shape.type_name
        if kind == "structure":
            if shape.name in stack:
                return  # recursion: this shape's constraints are covered above
            for name, member in shape.members.items():
                child = f"{path}.{camel(name)}" if path else camel(name)
                member_steps = (*steps, Step("member", name))
                if name in shape.required_members:
                    cases.append(Case(operation, member_steps, child, "required", member))
                walk(member, member_steps, child, (*stack, shape.name))
        elif kind in ("list", "map"):
            if shape.metadata.get("min"):
                cases.append(Case(operation, steps, path, "min", shape))
            if "max" in shape.metadata:
                cases.append(Case(operation, steps, path, "max", shape))
            if kind == "list":
                walk(shape.member, (*steps, Step("item")), f"{path}.1.member", stack)
            else:
                scalar(shape.key, (*steps, Step("key")), path, "key-")
                key = sample_string(shape.key)
                walk(shape.value, (*steps, Step("value", key)), f"{path}.{key}", stack)
        else:
            scalar(shape, steps, path, "")

    walk(input_shape(operation), (), "", ())
    return cases, strings, cut


def sample_string(shape: Any) -> str:
    if shape.enum:
        return str(shape.enum[0])
    if "pattern" in shape.metadata:
        return SAMPLES.get(str(shape.name), f"<no sample for {shape.name}>")
    low: int = shape.metadata.get("min") or 1
    high: int = shape.metadata.get("max", low)
    return "a" * min(low, high)


def sample_keys(shape: Any, count: int) -> list[str]:
    first = sample_string(shape)
    return [first] + [f"{first}{i}" for i in range(1, count)]


def minimal(shape: Any) -> Any:
    """The smallest valid value of a shape: required members only, one-element collections."""
    kind = shape.type_name
    meta = shape.metadata
    if kind == "structure":
        return {name: minimal(shape.members[name]) for name in shape.required_members}
    if kind == "list":
        return [minimal(shape.member) for _ in range(max(meta.get("min", 0), 1))]
    if kind == "map":
        keys = sample_keys(shape.key, max(meta.get("min", 0), 1))
        return {key: minimal(shape.value) for key in keys}
    if kind == "string":
        return sample_string(shape)
    if kind in ("integer", "long", "float", "double"):
        if "min" in meta:
            return meta["min"]
        return min(1, meta.get("max", 1))
    if kind == "boolean":
        return True
    if kind == "timestamp":
        return 1700000000
    if kind == "blob":
        return "AAAA"
    raise AssertionError(f"no minimal value for {shape.name} ({kind})")


def materialize(case: Case) -> tuple[dict[str, Any], Any, Any]:
    """A valid request reaching the case's spot, and (holder, key) with holder[key] the spot.

    Optional members on the way are filled in with their minimal values. For a map-key case
    the spot is the map itself.
    """
    shape = input_shape(case.operation)
    request: dict[str, Any] = minimal(shape)
    holder: Any = None
    key: Any = None
    node: Any = request
    steps = case.steps[:-1] if case.kind.startswith("key-") else case.steps
    for step in steps:
        if step.kind == "member":
            shape = shape.members[step.name]
            if step.name not in node:
                node[step.name] = minimal(shape)
            holder, key = node, step.name
        elif step.kind == "item":
            shape = shape.member
            holder, key = node, 0
        else:  # map value
            shape = shape.value
            holder, key = node, step.name
            assert step.name in node
        node = holder[key]
    return request, holder, key


def pattern_breaker(shape: Any) -> str | None:
    pattern = shape.metadata["pattern"]
    low = shape.metadata.get("min") or 0
    high = shape.metadata.get("max")
    for candidate in PATTERN_BREAKERS:
        value = candidate * max(1, -(-low // len(candidate)))
        if high is not None and len(value) > high:
            continue
        if regex.fullmatch(pattern, value) is None:
            return value
    return None


def expected_violation(case: Case) -> tuple[Any, str]:
    """(bad value, expected message fragment) for breaking a case's constraint."""
    shape = case.shape
    meta = shape.metadata
    at = f"at '{case.path}' failed to satisfy constraint: Member"
    kind = case.kind.removeprefix("key-")
    if shape.type_name in ("list", "map"):
        if kind == "min":
            count = meta["min"] - 1
            phrase = f"must have length greater than or equal to {meta['min']}"
        else:
            count = meta["max"] + 1
            phrase = f"must have length less than or equal to {meta['max']}"
        if shape.type_name == "list":
            bad: Any = [minimal(shape.member) for _ in range(count)]
        else:
            bad = {key: minimal(shape.value) for key in sample_keys(shape.key, count)}
        return bad, f"{at} {phrase}"
    if shape.type_name == "string":
        if kind == "min":
            bad = "a" * (meta["min"] - 1)
            phrase = f"must have length greater than or equal to {meta['min']}"
        elif kind == "max":
            bad = "a" * (meta["max"] + 1)
            phrase = f"must have length less than or equal to {meta['max']}"
        elif kind == "pattern":
            bad = pattern_breaker(shape)
            if bad is None:
                pytest.fail(
                    f"no value in PATTERN_BREAKERS breaks {shape.name}'s pattern "
                    f"{meta['pattern']!r}: add one, or list the shape in UNVIOLATABLE_PATTERNS"
                )
            assert regex.fullmatch(meta["pattern"], bad) is None
            phrase = f"must satisfy regular expression pattern: {meta['pattern']}"
        else:
            assert BAD_ENUM not in shape.enum
            bad = BAD_ENUM
            phrase = "must satisfy enum value set: [" + ", ".join(shape.enum) + "]"
        # Values over 200 characters are echoed cut, with an ellipsis (api.shapes.render).
        return bad, f"Value '{render(bad)}' {at} {phrase}"
    if kind == "min":
        bad = meta["min"] - 1
        phrase = f"must have value greater than or equal to {meta['min']}"
    else:
        bad = meta["max"] + 1
        phrase = f"must have value less than or equal to {meta['max']}"
    return bad, f"Value '{bad}' {at} {phrase}"


def collect() -> tuple[list[Case], dict[str, Any], list[str]]:
    cases: list[Case] = []
    strings: dict[str, Any] = {}
    cut: list[str] = []
    for operation in OPERATIONS:
        found, seen, truncated = walk_shapes(operation)
        cases.extend(found)
        strings.update({shape.name: shape for shape in seen})
        cut.extend(f"{operation}:{path}" for path in truncated)
    return cases, strings, cut


CASES, STRING_SHAPES, CUT_OFF = collect()
PATTERN_SHAPES = {n: s for n, s in STRING_SHAPES.items() if "pattern" in s.metadata}
DRIFT_CASES = [
    case for case in CASES if not (case.kind.endswith("pattern") and case.shape.name in UNVIOLATABLE_PATTERNS)
]


def test_every_pattern_shape_has_a_sample() -> None:
    missing = sorted(set(PATTERN_SHAPES) - set(SAMPLES))
    assert not missing, (
        "botocore's model has pattern-constrained string shapes with no known-good sample "
        f"in SAMPLES: {missing}"
    )
    stale = sorted(set(SAMPLES) - set(PATTERN_SHAPES))
    assert not stale, f"SAMPLES has shapes no longer in these inputs: {stale}"


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_sample_satisfies_its_shape(name: str) -> None:
    shape = PATTERN_SHAPES.get(name)
    if shape is None:
        pytest.fail(f"{name} is not a pattern shape of these inputs any more")
    value = SAMPLES[name]
    meta = shape.metadata
    assert regex.fullmatch(meta["pattern"], value), (name, meta["pattern"], value)
    assert meta.get("min", 0) <= len(value) <= meta.get("max", len(value))


def test_unviolatable_patterns_really_are() -> None:
    for name in UNVIOLATABLE_PATTERNS:
        shape = PATTERN_SHAPES[name]
        assert pattern_breaker(shape) is None, name


def test_walk_was_not_cut_short() -> None:
    assert not CUT_OFF, f"input trees deeper than {MAX_DEPTH} steps were not checked: {CUT_OFF}"


def test_the_walk_found_the_constraints_it_should() -> None:
    ids = {case.id for case in CASES}
    assert len(ids) == len(CASES)
    for expected in (
        "CreateCluster:clusterName:required",
        "CreateCluster:clusterName:pattern",
        "CreateCluster:instanceGroups:min",
        "CreateCluster:instanceGroups.1.member.instanceCount:max",
        "CreateCluster:instanceGroups.1.member.kubernetesConfig.labels:key-pattern",
        "CreateCluster:instanceGroups.1.member.kubernetesConfig.labels.example.com/team:max",
        "CreateCluster:instanceGroups.1.member.scheduledUpdateConfig.deploymentConfig"
        ".rollingUpdatePolicy.maximumBatchSize.type:enum",
        "CreateCluster:tags.1.member.key:pattern",
        "UpdateCluster:instanceGroupsToDelete.1.member:pattern",
        "ListClusters:maxResults:min",
        "ListTags:maxResults:min",
        "DescribeClusterEvent:eventId:required",
        "BatchDeleteClusterNodes:nodeIds:max",
    ):
        assert expected in ids, expected
    assert len(CASES) > 300


@pytest.mark.parametrize("operation", OPERATIONS)
def test_minimal_request_passes(operation: str) -> None:
    request = minimal(input_shape(operation))
    validate_input(operation, copy.deepcopy(request))


@pytest.mark.parametrize("case", DRIFT_CASES, ids=[case.id for case in DRIFT_CASES])
def test_every_model_constraint_is_enforced(case: Case) -> None:
    request, holder, key = materialize(case)
    validate_input(case.operation, copy.deepcopy(request))  # valid before the one change

    if case.kind == "required":
        del holder[key]
        fragment = f"Value null at '{case.path}' failed to satisfy constraint: "
        fragment += "Member must not be null"
    else:
        bad, fragment = expected_violation(case)
        if case.kind.startswith("key-"):
            value = next(iter(holder[key].values()))
            holder[key] = {bad: value}
        else:
            holder[key] = bad

    message = message_of(case.operation, request)
    assert fragment in message
    # Nothing but the broken spot is reported (unknown-member messages would not say "at '"
    # followed by the path then "' failed").
    paths = set(re.findall(r" at '([^']*)' failed to satisfy constraint", message))
    assert paths == {case.path}, message
