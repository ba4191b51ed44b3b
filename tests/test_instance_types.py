"""The instance memory table: complete against botocore, no strays, and plausible numbers."""

from __future__ import annotations

import re
from collections import defaultdict
from itertools import pairwise

import botocore.session
import pytest

from hyperpod_sim.domain.instance_types import INSTANCE_MEMORY_GIB, instance_memory_bytes


def cluster_instance_types() -> set[str]:
    model = botocore.session.get_session().get_service_model("sagemaker")
    return set(model.shape_for("ClusterInstanceType").enum)


def size_rank(size: str) -> int:
    """Order of a size suffix, in the units of its vCPU count: medium < large < xlarge < 2xlarge."""
    if size == "medium":
        return 1
    if size == "large":
        return 2
    match = re.fullmatch(r"(\d*)xlarge", size)
    assert match is not None, f"unexpected size suffix {size!r}"
    return 4 * int(match.group(1) or 1)


def test_table_covers_every_botocore_cluster_instance_type() -> None:
    missing = sorted(cluster_instance_types() - INSTANCE_MEMORY_GIB.keys())
    assert not missing, (
        f"botocore's ClusterInstanceType has types with no memory size in domain/instance_types.py: {missing}"
    )


def test_table_has_no_type_outside_the_enum() -> None:
    extra = sorted(INSTANCE_MEMORY_GIB.keys() - cluster_instance_types())
    assert not extra, f"not in botocore's ClusterInstanceType: {extra}"


@pytest.mark.parametrize(
    ("instance_type", "gib"),
    [
        ("ml.p5.48xlarge", 2048),
        ("ml.p4d.24xlarge", 1152),
        ("ml.trn1.32xlarge", 512),
        ("ml.g5.xlarge", 16),
        ("ml.c5n.large", 5.25),
        ("ml.t3.medium", 4),
        ("ml.m5.large", 8),
    ],
)
def test_well_known_sizes(instance_type: str, gib: float) -> None:
    assert INSTANCE_MEMORY_GIB[instance_type] == gib


def test_every_size_is_positive() -> None:
    assert all(gib > 0 for gib in INSTANCE_MEMORY_GIB.values())


def test_memory_grows_with_size_within_a_family() -> None:
    families: defaultdict[str, list[tuple[int, str, float]]] = defaultdict(list)
    for instance_type, gib in INSTANCE_MEMORY_GIB.items():
        family, size = instance_type.rsplit(".", 1)
        families[family].append((size_rank(size), instance_type, gib))
    for family, members in families.items():
        members.sort()
        for (_, smaller, small_gib), (_, larger, large_gib) in pairwise(members):
            assert small_gib <= large_gib, (
                f"{family}: {larger} ({large_gib} GiB) has less memory than {smaller} ({small_gib} GiB)"
            )


def test_instance_memory_bytes() -> None:
    assert instance_memory_bytes("ml.p5.48xlarge") == 2048 * 2**30
    assert instance_memory_bytes("ml.c5n.large") == int(5.25 * 2**30)
    assert isinstance(instance_memory_bytes("ml.t3.medium"), int)


def test_unknown_instance_type_raises_key_error() -> None:
    with pytest.raises(KeyError, match=re.escape("ml.nope.xlarge")):
        instance_memory_bytes("ml.nope.xlarge")
