"""Request validation, response serialization and JSON Schema, driven by botocore's model.

botocore ships the SageMaker service model (``sagemaker/<version>/service-2.json``); it is the
single source of truth for every shape here. Nothing in this module copies a shape by hand, so a
botocore upgrade that changes a constraint changes our behaviour with it (and
``tests/test_shapes.py`` walks the model to prove every constraint is enforced).

* :func:`validate_input` checks a decoded JSON 1.1 request body against an operation's input
  shape, collects every constraint violation in AWS's phrasing and raises one
  ``ValidationException``; wrong JSON types raise ``SerializationException`` at once.
* :func:`serialize_output` turns a handler's result into the wire shape of the operation's output
  (datetimes to epoch seconds, ``None`` dropped) and refuses keys the model does not know.
* :func:`shape_to_json_schema` / :func:`operation_schemas` render shapes as JSON Schema
  (OpenAPI 3.1 dialect) with structures collected as components.

botocore ships no type stubs, so its objects are typed ``Any`` here.
"""

from __future__ import annotations

import functools
import html
import re
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import botocore.session
from botocore.model import NoShapeFoundError, OperationNotFoundError

from hyperpod_sim.api.patterns import pattern_matches
from hyperpod_sim.contracts import simulator_api as extensions
from hyperpod_sim.domain.errors import (
    SerializationException,
    UnknownOperationException,
    echo,
    validation_error,
)

__all__ = [
    "camel",
    "collect_input",
    "description",
    "operation_schemas",
    "render",
    "serialize_output",
    "service_model",
    "shape_to_json_schema",
    "validate_input",
]

_ROOT = "input"
"""How the top of a request is named in messages where AWS would name a member path."""

_DESCRIPTION_LIMIT = 300


# --------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def service_model() -> Any:
    """botocore's SageMaker service model (loaded once per process)."""
    return botocore.session.get_session().get_service_model("sagemaker")


def _operation_model(operation: str, model: Any = None) -> Any:
    try:
        return (model or service_model()).operation_model(operation)
    except OperationNotFoundError:
        raise UnknownOperationException(f"Operation {operation} is not supported.") from None


def camel(name: str) -> str:
    """AWS's member naming in messages: the first character lowercased, the rest unchanged."""
    return name[:1].lower() + name[1:]


def _child(path: str, name: str) -> str:
    return f"{path}.{camel(name)}" if path else camel(name)


def _where(path: str) -> str:
    return path or _ROOT


# --------------------------------------------------------------------------------------------
# Input validation
# --------------------------------------------------------------------------------------------


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _mismatch(path: str, expected: str, value: object) -> SerializationException:
    return SerializationException(
        f"Unexpected value type for '{_where(path)}': expected {expected}, got {_json_type(value)}"
    )


def render(value: object) -> str:
    """A value as a message echoes it: strings as they are, other values as Python shows them,
    either cut to 200 characters with an ellipsis ("...") so that a multi-megabyte value is never
    echoed whole."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return echo(value if isinstance(value, str) else repr(value))


_render = render


def _violation(value: object, path: str, constraint: str) -> str:
    return f"Value '{_render(value)}' at '{_where(path)}' failed to satisfy constraint: Member {constraint}"


def _parse_timestamp(value: object, path: str) -> datetime:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return datetime.fromtimestamp(value, tz=UTC)
        except (OverflowError, OSError, ValueError):
            raise SerializationException(
                f"Invalid timestamp for '{_where(path)}': {value!r} is out of range"
            ) from None
    if isinstance(value, str):
        try:
            parsed = datetime.fromisoformat(value)
        except ValueError:
            raise SerializationException(
                f"Invalid timestamp for '{_where(path)}': '{value}' is neither epoch seconds "
                "nor an ISO-8601 date-time"
            ) from None
        if parsed.tzinfo is None:
            return parsed.replace(tzinfo=UTC)
        return parsed.astimezone(UTC)
    raise _mismatch(path, "timestamp", value)


class _Validator:
    """One walk over a request; collects constraint messages in model order, depth first."""

    def __init__(self) -> None:
        self.errors: list[str] = []

    def value(self, shape: Any, value: object, path: str) -> object:
        kind = shape.type_name
        if kind == "structure":
            return self.structure(shape, value, path)
        if kind == "list":
            return self.sequence(shape, value, path)
        if kind == "map":
            return self.mapping(shape, value, path)
        if kind == "string":
            if not isinstance(value, str):
                raise _mismatch(path, "string", value)
            self.string(shape, value, path)
            return value
        if kind in ("integer", "long"):
            if isinstance(value, bool) or not isinstance(value, int):
                raise _mismatch(path, kind, value)
            self.bounds(shape, value, path)
            return value
        if kind in ("float", "double"):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise _mismatch(path, kind, value)
            self.bounds(shape, value, path)
            return value
        if kind == "boolean":
            if not isinstance(value, bool):
                raise _mismatch(path, "boolean", value)
            return value
        if kind == "timestamp":
            return _parse_timestamp(value, path)
        if kind == "blob":
            if not isinstance(value, str):
                raise _mismatch(path, "blob (base64 string)", value)
            return value
        return value

    def structure(
        self, shape: Any, value: object, path: str, located: Mapping[str, object] | None = None
    ) -> dict[str, Any]:
        """A structure's members. With ``located`` (a REST request's path parameters, by member
        name), members with a ``location`` are taken from it and the others from ``value`` (the
        body), which may not carry located ones."""
        if not isinstance(value, dict):
            raise _mismatch(path, "structure", value)
        members: Mapping[str, Any] = shape.members
        required = set(shape.required_members)
        in_body = [name for name, member in members.items() if located is None or not _located(member)]
        out: dict[str, Any] = {}
        for name, member in members.items():
            source = located if located is not None and _located(member) else value
            item = source.get(name)
            if item is None:  # an explicit JSON null is an absent member
                if name in required:
                    self.errors.append(
                        f"Value null at '{_child(path, name)}' failed to satisfy constraint: "
                        "Member must not be null"
                    )
                continue
            out[name] = self.value(member, item, _child(path, name))
        for key in value:
            if key not in in_body:
                allowed = ", ".join(in_body) or "none"
                self.errors.append(
                    f"Unknown member '{key}' at '{_where(path)}': allowed members are {allowed}"
                )
        return out

    def size(self, shape: Any, value: list[Any] | dict[str, Any], path: str) -> None:
        low, high = shape.metadata.get("min"), shape.metadata.get("max")
        if low is not None and len(value) < low:
            self.errors.append(_violation(value, path, f"must have length greater than or equal to {low}"))
        if high is not None and len(value) > high:
            self.errors.append(_violation(value, path, f"must have length less than or equal to {high}"))

    def sequence(self, shape: Any, value: object, path: str) -> list[Any]:
        if not isinstance(value, list):
            raise _mismatch(path, "list", value)
        self.size(shape, value, path)
        out: list[Any] = []
        for index, item in enumerate(value, start=1):
            item_path = f"{path}.{index}.member"
            if item is None:
                raise _mismatch(item_path, shape.member.type_name, item)
            out.append(self.value(shape.member, item, item_path))
        return out

    def mapping(self, shape: Any, value: object, path: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise _mismatch(path, "map", value)
        self.size(shape, value, path)
        out: dict[str, Any] = {}
        for key, item in value.items():
            # A key's violations are reported at the map itself.
            self.value(shape.key, key, path)
            item_path = f"{path}.{key}"
            if item is None:
                raise _mismatch(item_path, shape.value.type_name, item)
            out[key] = self.value(shape.value, item, item_path)
        return out

    def string(self, shape: Any, value: str, path: str) -> None:
        metadata = shape.metadata
        low, high = metadata.get("min"), metadata.get("max")
        too_long = False
        if low is not None and len(value) < low:
            self.errors.append(_violation(value, path, f"must have length greater than or equal to {low}"))
        if high is not None and len(value) > high:
            too_long = True
            self.errors.append(_violation(value, path, f"must have length less than or equal to {high}"))
        pattern = metadata.get("pattern")
        # Past the maximum length the pattern is not tried (nor reported): a multi-megabyte value
        # would cost the matcher memory and time for an answer that is already a refusal.
        if pattern is not None and not too_long and not pattern_matches(pattern, value):
            self.errors.append(_violation(value, path, f"must satisfy regular expression pattern: {pattern}"))
        enum = shape.enum
        if enum and value not in enum:
            self.errors.append(
                _violation(
                    value,
                    path,
                    "must satisfy enum value set: [" + ", ".join(enum) + "]",
                )
            )

    def bounds(self, shape: Any, value: float, path: str) -> None:
        low, high = shape.metadata.get("min"), shape.metadata.get("max")
        if low is not None and value < low:
            self.errors.append(_violation(value, path, f"must have value greater than or equal to {low}"))
        if high is not None and value > high:
            self.errors.append(_violation(value, path, f"must have value less than or equal to {high}"))


def _located(member: Any) -> bool:
    return "location" in member.serialization


def collect_input(
    shape: Any, params: object, *, located: Mapping[str, object] | None = None
) -> tuple[dict[str, Any], list[str]]:
    """Check ``params`` against the input structure ``shape`` (of any botocore service model):
    the checked copy and every constraint message, in model order; raises nothing for those.
    A value of the wrong JSON type raises ``SerializationException`` at once, as does a body
    that is not a JSON object. ``located``: see ``_Validator.structure``."""
    if not isinstance(params, dict):
        raise _mismatch("", "structure", params)
    validator = _Validator()
    result = validator.structure(shape, params, "", located)
    return result, validator.errors


def validate_input(
    operation: str, params: object, *, model: Any = None, located: Mapping[str, object] | None = None
) -> dict[str, Any]:
    """Check ``params`` (a decoded JSON body) against ``operation``'s input shape in ``model``
    (botocore's SageMaker model unless given).

    Returns a copy of the params with timestamps as aware UTC datetimes and JSON nulls dropped;
    everything else is unchanged. Every constraint violation is collected (in model member
    order, depth first; unknown members after the known ones of their structure) into one
    ``ValidationException``. A value of the wrong JSON type raises ``SerializationException``
    at once, as does a body that is not a JSON object.
    """
    shape = _operation_model(operation, model).input_shape
    if not isinstance(params, dict):
        raise _mismatch("", "structure", params)
    if shape is None:
        if params:
            raise validation_error(
                [f"Unknown member '{key}' at '{_ROOT}': allowed members are none" for key in params]
            )
        return {}
    result, errors = collect_input(shape, params, located=located)
    if errors:
        raise validation_error(errors)
    return result


# --------------------------------------------------------------------------------------------
# Output serialization
# --------------------------------------------------------------------------------------------


# hyperpod-sim's own members, added to AWS output structures (botocore ignores members its model
# lacks; raw JSON and REST clients see them). Their shapes are the extensions model's
# (hyperpod_sim/contracts/simulator_api.json); documented in the README and the OpenAPI schema.
EXTENSION_MEMBERS: dict[str, frozenset[str]] = {
    "ClusterNodeDetails": frozenset({"AgentStatus"}),
    "ClusterNodeSummary": frozenset({"AgentStatus"}),
}


def _inline(schema: Any, components: dict[str, dict[str, Any]]) -> Any:
    """``schema`` with every ``$ref`` into ``components`` replaced by what it names."""
    if isinstance(schema, dict):
        ref = schema.get("$ref")
        if isinstance(ref, str) and len(schema) == 1:
            return _inline(components[ref.rsplit("/", 1)[1]], components)
        return {key: _inline(value, components) for key, value in schema.items()}
    if isinstance(schema, list):
        return [_inline(item, components) for item in schema]
    return schema


@functools.lru_cache(maxsize=1)
def extension_schemas() -> dict[str, dict[str, Any]]:
    """JSON Schemas of the extension members, by member name (components of the OpenAPI
    document), self-contained: rendered from their shapes in the extensions model."""
    rendered: dict[str, dict[str, Any]] = {}
    for names in EXTENSION_MEMBERS.values():
        for name in names:
            components: dict[str, dict[str, Any]] = {}
            shape_to_json_schema(extensions.service_model().shape_for(name), components)
            rendered[name] = _inline(components[name], components)
    return rendered


def _plain(value: Any) -> Any:
    """An extension member's value as JSON: datetimes as epoch seconds, None dropped."""
    if isinstance(value, datetime):
        return (value if value.tzinfo is not None else value.replace(tzinfo=UTC)).timestamp()
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items() if item is not None}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def _serialize(shape: Any, value: Any, where: str) -> Any:
    kind = shape.type_name
    if kind == "structure":
        if not isinstance(value, Mapping):
            raise ValueError(f"{where}: expected a mapping for {shape.name}, got {value!r}")
        members: Mapping[str, Any] = shape.members
        out: dict[str, Any] = {}
        for key, item in value.items():
            if item is None:
                continue
            if key not in members and key in EXTENSION_MEMBERS.get(shape.name, ()):
                out[key] = _plain(item)
                continue
            if key not in members:
                raise ValueError(f"{where}: '{key}' is not a member of {shape.name}")
            out[key] = _serialize(members[key], item, f"{where}.{key}")
        return out
    if kind == "list":
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{where}: expected a list for {shape.name}, got {value!r}")
        return [_serialize(shape.member, item, f"{where}[{i}]") for i, item in enumerate(value)]
    if kind == "map":
        if not isinstance(value, Mapping):
            raise ValueError(f"{where}: expected a mapping for {shape.name}, got {value!r}")
        return {
            key: _serialize(shape.value, item, f"{where}[{key!r}]")
            for key, item in value.items()
            if item is not None
        }
    if kind == "timestamp" and isinstance(value, datetime):
        aware = value if value.tzinfo is not None else value.replace(tzinfo=UTC)
        return aware.timestamp()
    return value


def serialize_output(operation: str, data: Mapping[str, Any]) -> dict[str, Any]:
    """Render a handler's result in the wire shape of ``operation``'s output.

    Datetimes of timestamp shapes become epoch seconds (naive ones are taken as UTC), keys whose
    value is ``None`` are dropped, and nested structures, lists and maps are walked. A key the
    output shape does not define raises ``ValueError``: that is our bug, not the caller's.
    """
    try:
        shape = service_model().operation_model(operation).output_shape
    except OperationNotFoundError:
        raise ValueError(f"unknown operation {operation}") from None
    if shape is None:
        extra = [key for key, item in data.items() if item is not None]
        if extra:
            raise ValueError(f"{operation} has no output, got keys {extra}")
        return {}
    result: dict[str, Any] = _serialize(shape, data, operation)
    return result


# --------------------------------------------------------------------------------------------
# JSON Schema
# --------------------------------------------------------------------------------------------

_TAG = re.compile(r"<[^>]+>")
_SPACE = re.compile(r"\s+")


def description(documentation: str, limit: int | None = _DESCRIPTION_LIMIT) -> str:
    """A model's documentation (HTML) as plain text, cut at ``limit`` characters (None: whole)."""
    text = _SPACE.sub(" ", html.unescape(_TAG.sub(" ", documentation or ""))).strip()
    if limit is not None and len(text) > limit:
        cut = text[: limit - 3]
        if " " in cut:
            cut = cut.rsplit(" ", 1)[0]
        text = cut.rstrip(" ,;:") + "..."
    return text


_description = description


def _ref(name: str) -> str:
    return f"#/components/schemas/{name}"


def _structure_component(shape: Any, components: dict[str, dict[str, Any]]) -> None:
    name = shape.name
    components[name] = {}  # placeholder first: recursive shapes find it and stop
    try:
        own_documentation = service_model().shape_for(name).documentation
    except NoShapeFoundError:  # not a SageMaker shape: use what the given shape carries
        own_documentation = shape.documentation
    properties: dict[str, Any] = {}
    for member_name, member in shape.members.items():
        properties[member_name] = shape_to_json_schema(member, components)
    for member_name in sorted(EXTENSION_MEMBERS.get(name, ())):
        components.setdefault(member_name, extension_schemas()[member_name])
        properties[member_name] = {"$ref": _ref(member_name)}
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if shape.required_members:
        schema["required"] = list(shape.required_members)
    schema["additionalProperties"] = False
    description = _description(own_documentation)
    if description:
        schema["description"] = description
    components[name] = schema


def shape_to_json_schema(shape: Any, components: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """JSON Schema (OpenAPI 3.1 dialect) for a botocore shape.

    Structures are emitted once into ``components`` under their shape name and referenced as
    ``{"$ref": "#/components/schemas/<Name>"}``, which keeps recursive shapes finite.
    """
    kind = shape.type_name
    metadata = shape.metadata
    description = _description(shape.documentation)
    schema: dict[str, Any]
    if kind == "structure":
        if shape.name not in components:
            _structure_component(shape, components)
        schema = {"$ref": _ref(shape.name)}
        if description == components[shape.name].get("description"):
            description = ""  # only a member's own wording is worth repeating beside a $ref
    elif kind == "string":
        schema = {"type": "string"}
        if shape.enum:
            schema["enum"] = list(shape.enum)
        if "min" in metadata:
            schema["minLength"] = metadata["min"]
        if "max" in metadata:
            schema["maxLength"] = metadata["max"]
        if "pattern" in metadata:
            schema["pattern"] = f"^(?:{metadata['pattern']})$"
    elif kind in ("integer", "long", "float", "double"):
        schema = {"type": "integer" if kind in ("integer", "long") else "number"}
        if "min" in metadata:
            schema["minimum"] = metadata["min"]
        if "max" in metadata:
            schema["maximum"] = metadata["max"]
    elif kind == "boolean":
        schema = {"type": "boolean"}
    elif kind == "timestamp":
        schema = {"type": "number"}
        description = f"{description} (epoch seconds)" if description else "epoch seconds"
    elif kind == "blob":
        schema = {"type": "string", "contentEncoding": "base64"}
    elif kind == "list":
        schema = {
            "type": "array",
            "items": shape_to_json_schema(shape.member, components),
        }
        if "min" in metadata:
            schema["minItems"] = metadata["min"]
        if "max" in metadata:
            schema["maxItems"] = metadata["max"]
    elif kind == "map":
        schema = {
            "type": "object",
            "additionalProperties": shape_to_json_schema(shape.value, components),
        }
        keys = shape_to_json_schema(shape.key, components)
        keys.pop("description", None)
        keys.pop("type", None)
        if keys:
            schema["propertyNames"] = keys
        if "min" in metadata:
            schema["minProperties"] = metadata["min"]
        if "max" in metadata:
            schema["maxProperties"] = metadata["max"]
    else:
        schema = {}
    if description:
        schema["description"] = description
    return schema


def operation_schemas(
    operation: str, components: dict[str, dict[str, Any]] | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(input schema, output schema) of an operation.

    With ``components`` given, the schemas are ``$ref``\\s into it and it is filled with every
    structure reached (what an OpenAPI document wants). Without it, each schema is a
    self-contained document: the ``$ref`` plus a ``components.schemas`` section it resolves in.
    """
    model = _operation_model(operation)
    schemas: list[dict[str, Any]] = []
    for shape in (model.input_shape, model.output_shape):
        target = components if components is not None else {}
        if shape is None:
            schema: dict[str, Any] = {"type": "object", "additionalProperties": False}
        else:
            schema = shape_to_json_schema(shape, target)
        if components is None and target:
            schema = {**schema, "components": {"schemas": target}}
        schemas.append(schema)
    return schemas[0], schemas[1]
