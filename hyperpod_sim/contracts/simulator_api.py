"""hyperpod-sim's own operations (the checkpoint policy, fault injection), declared once.

``simulator_api.json`` beside this module is a service model in botocore's format (the format of
botocore's ``sagemaker/*/service-2.json``): each operation with its REST route (``http``), input
and output structures, the errors it may raise and its documentation; each member with its type,
enum, ``min``/``max``, pattern and whether it is required. Everything about these operations on
the wire comes from it: the control plane's validation and OpenAPI schemas (api/simulator_api.py),
the CLI's choices and limits (hyperpod_sim/cli/faults.py, hyperpod_sim/cli/clusters.py).

A member with ``"location": "uri"`` is a path parameter of the route (``locationName`` names
it); the others travel in the JSON body. An input structure with a ``Type`` member may have a
shape per type, ``<Type><InputShape>`` (``AgentHangInjectFaultRequest``): the members that type
takes and requires (see :func:`variant`).

:func:`service_model` loads the model with botocore's model classes (imported on first use: the
CLI builds its parser for every subcommand and only reads names and limits, through
:func:`document`, which needs nothing but ``json``).
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

__all__ = [
    "DISCRIMINATOR",
    "SERVICE_NAME",
    "document",
    "enum",
    "limits",
    "members",
    "service_model",
    "variant",
]

SERVICE_NAME = "hyperpod-sim"
DISCRIMINATOR = "Type"
"""The member whose value selects an input's per-type shape."""


@functools.lru_cache(maxsize=1)
def document() -> dict[str, Any]:
    """The model as JSON (read once per process)."""
    # Beside this module (package data), read without importlib.resources: the CLI's parser is
    # built on every command, and that import alone costs more than reading the file.
    with open(os.path.join(os.path.dirname(__file__), "simulator_api.json"), encoding="utf-8") as file:
        loaded: dict[str, Any] = json.load(file)
    return loaded


@functools.lru_cache(maxsize=1)
def service_model() -> Any:
    """The model as botocore's ``ServiceModel`` (botocore ships no type stubs: ``Any``)."""
    from botocore.model import ServiceModel

    return ServiceModel(document(), service_name=SERVICE_NAME)


def _shape(name: str) -> dict[str, Any]:
    shape: dict[str, Any] = document()["shapes"][name]
    return shape


def enum(shape: str) -> tuple[str, ...]:
    """The values of a string shape's enum, in model order."""
    return tuple(_shape(shape)["enum"])


def members(shape: str, *, body_only: bool = True) -> tuple[str, ...]:
    """A structure's member names in model order; without its path parameters unless
    ``body_only`` is false."""
    found = _shape(shape)["members"].items()
    return tuple(name for name, ref in found if not (body_only and "location" in ref))


def required(shape: str) -> tuple[str, ...]:
    """A structure's required member names, in model order."""
    return tuple(_shape(shape).get("required", ()))


def limits(shape: str) -> tuple[int | float | None, int | float | None]:
    """A number shape's (min, max); None where unbounded."""
    declared = _shape(shape)
    return declared.get("min"), declared.get("max")


def variant(input_shape: Any, value: object) -> Any:
    """The per-type shape of ``input_shape`` for a ``Type`` of ``value`` (botocore shapes), or None
    when the input has no such shape (no ``Type`` member, or a value outside its enum)."""
    discriminator = input_shape.members.get(DISCRIMINATOR)
    if discriminator is None or not isinstance(value, str) or value not in (discriminator.enum or ()):
        return None
    name = f"{value}{input_shape.name}"
    if name not in document()["shapes"]:
        return None
    return service_model().shape_for(name)
