"""Clusters through boto3 on the simulated control plane: the error an operation answers (checked
against the service model) and a cluster brought InService."""

from __future__ import annotations

from typing import Any

import pytest
from botocore.exceptions import ClientError

from hyperpod_sim.api import shapes
from tests.conftest import ControlPlane, group

# Codes any operation may answer with, besides its modelled errors.
COMMON_CODES = {"ValidationException", "SerializationException", "UnknownOperationException"}


def error_of(call: Any, **kwargs: Any) -> tuple[str, str]:
    with pytest.raises(ClientError) as err:
        call(**kwargs)
    error = err.value.response["Error"]
    operation = err.value.operation_name
    modelled = {e.name for e in shapes.service_model().operation_model(operation).error_shapes}
    assert error["Code"] in modelled | COMMON_CODES, f"{operation} may not raise {error['Code']}"
    return error["Code"], error["Message"]


def in_service(cp: ControlPlane, sm: Any, name: str, *groups: dict[str, Any], **kwargs: Any) -> None:
    sm.create_cluster(ClusterName=name, InstanceGroups=list(groups) or [group()], **kwargs)
    cp.settle(sm, name)
