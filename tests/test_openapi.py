"""The OpenAPI document as a contract: valid, every parameter declared, every answer documented with
its schema and an example that the schema takes (the live checks are tests/test_openapi_fuzz.py)."""

from __future__ import annotations

import difflib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import regex
from openapi_schema_validator._regex import has_ecma_regex
from openapi_spec_validator.validation import OpenAPIV31SpecValidator

from hyperpod_sim.api import openapi_file
from hyperpod_sim.api.app import create_app
from tests.conftest import EKS, ControlPlane, group, make_settings

PINNED = Path(__file__).resolve().parent.parent / "docs" / "openapi.json"


@pytest.fixture(scope="module")
def document(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    data = tmp_path_factory.mktemp("openapi")
    app = create_app(make_settings(f"sqlite:///{data / 'cp.db'}", data / "data"))
    schema: dict[str, Any] = app.openapi()
    return schema


def operations(document: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for path, methods in document["paths"].items():
        for method, operation in methods.items():
            yield method.upper(), path, operation


def test_the_document_is_valid_openapi(document: dict[str, Any]) -> None:
    # OpenAPI 3.1's patterns are ECMA-262 (the tag patterns use \p{L}): check them with an ECMA engine.
    assert has_ecma_regex(), "openapi-schema-validator[ecma-regex] (regress) is not installed"
    errors = [error.message for error in OpenAPIV31SpecValidator(document).iter_errors()]
    assert errors == []


def test_every_operation_has_a_name_of_its_own(document: dict[str, Any]) -> None:
    """CamelCase like the AWS operations (what Swagger UI shows and client generators name)."""
    names = [operation["operationId"] for _, _, operation in operations(document)]
    assert len(names) == len(set(names))
    assert [name for name in names if not regex.fullmatch(r"(?:[A-Z][a-z0-9]*)+", name)] == []


def test_every_path_parameter_is_declared(document: dict[str, Any]) -> None:
    for method, path, operation in operations(document):
        declared = {p["name"] for p in operation.get("parameters", []) if p["in"] == "path"}
        assert declared == set(regex.findall(r"{([^}]+)}", path)), f"{method} {path}"


def test_no_operation_documents_fastapis_422(document: dict[str, Any]) -> None:
    """The app answers a body its model refuses 400 (ValidationException, or the agent protocol's
    InvalidRequest), so the document says 400, not FastAPI's default 422."""
    assert [(m, p) for m, p, operation in operations(document) if "422" in operation["responses"]] == []
    assert "HTTPValidationError" not in document["components"]["schemas"]


def test_every_error_answer_has_its_error_shape(document: dict[str, Any]) -> None:
    for method, path, operation in operations(document):
        expected = "AgentError" if path.startswith("/agent/") else "AwsError"
        shared = {"400", "413", "503"}
        assert shared <= set(operation["responses"]), f"{method} {path}"
        for status, response in operation["responses"].items():
            if int(status) < 400:
                continue
            for content in response["content"].values():
                assert content["schema"] == {"$ref": f"#/components/schemas/{expected}"}, (method, path)


def _validator(schema: dict[str, Any], document: dict[str, Any]) -> Any:
    """A JSON Schema 2020-12 validator resolving the document's ``$ref``s, with patterns applied
    by the ``regex`` module (Python's ``re`` has no ``\\p{L}``)."""

    def pattern(validator: Any, value: str, instance: Any, schema: Any) -> Iterator[Any]:
        if isinstance(instance, str) and regex.search(value, instance) is None:
            yield jsonschema.ValidationError(f"{instance!r} does not match {value!r}")

    cls = jsonschema.validators.extend(jsonschema.Draft202012Validator, {"pattern": pattern})
    return cls({**schema, "components": document["components"]})


def test_every_body_and_answer_has_an_example_its_schema_takes(document: dict[str, Any]) -> None:
    for method, path, operation in operations(document):
        bodies = {"request": operation.get("requestBody", {}), **operation["responses"]}
        for status, body in bodies.items():
            if status != "request" and status != "304":
                assert body.get("content"), f"{method} {path} {status}: no content"
            for content in body.get("content", {}).values():
                examples = (
                    [content["example"]]
                    if "example" in content
                    else [e["value"] for e in content.get("examples", {}).values()]
                )
                assert examples, f"{method} {path} {status}: no example"
                assert "schema" in content, f"{method} {path} {status}: no schema"
                for example in examples:
                    _assert_valid(content["schema"], example, document, f"{method} {path} {status}")
        for parameter in operation.get("parameters", []):
            if parameter["in"] == "path":
                where = f"{method} {path} {parameter['name']}"
                _assert_valid(parameter["schema"], parameter["example"], document, where)


def _assert_valid(schema: dict[str, Any], example: Any, document: dict[str, Any], where: str) -> None:
    error = jsonschema.exceptions.best_match(_validator(schema, document).iter_errors(example))
    assert error is None, f"{where}: {error.message} at {list(error.absolute_path)}"


def test_a_body_does_not_require_what_the_path_gives(document: dict[str, Any]) -> None:
    for path, method in (("/clusters/{name}/nodes/batch-delete", "post"), ("/clusters/{name}", "patch")):
        schema = document["paths"][path][method]["requestBody"]["content"]["application/json"]["schema"]
        assert "ClusterName" not in schema.get("required", [])
        assert "ClusterName" not in schema["properties"]


def test_the_agent_routes_document_their_answers(document: dict[str, Any]) -> None:
    for method, path, operation in operations(document):
        if path.startswith("/agent/"):
            ok = next(s for s in operation["responses"] if s.startswith("2"))
            schema = operation["responses"][ok]["content"]["application/json"]["schema"]
            assert schema.get("$ref") or schema.get("type") == "object", f"{method} {path}"


# ------------------------------------------------------------------------------------ live


@pytest.fixture
def http(control_plane: ControlPlane) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=control_plane.url, timeout=30) as client:
        yield client


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_the_served_document_is_the_pinned_one(http: httpx.Client) -> None:
    # docs/openapi.json is the contract a client generator or a reviewer reads: a change to the
    # wire shows in its diff. After a deliberate change: make openapi.
    response = http.get("/openapi.json")
    assert response.status_code == 200
    served = openapi_file.render(response.json())
    pinned = PINNED.read_text(encoding="utf-8")
    if served != pinned:
        diff = difflib.unified_diff(
            pinned.splitlines(), served.splitlines(), "docs/openapi.json", "served", lineterm="", n=2
        )
        pytest.fail(
            "the served OpenAPI document differs from docs/openapi.json (regenerate it with "
            "`make openapi` if the change is meant):\n" + "\n".join(list(diff)[:60])
        )


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_405_names_every_method_of_the_path(http: httpx.Client) -> None:
    response = http.put("/clusters/demo")
    assert response.status_code == 405
    assert response.headers["allow"] == "DELETE, GET, PATCH"
    assert response.json()["__type"] == "UnknownOperationException"


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_batch_delete_takes_the_cluster_from_the_path(http: httpx.Client) -> None:
    body = {"ClusterName": "fuzz", "InstanceGroups": [group("workers", 1)], "Orchestrator": EKS}
    assert http.post("/clusters", json=body).status_code == 200
    response = http.post("/clusters/fuzz/nodes/batch-delete", json={"NodeIds": ["i-0123456789abcdef0"]})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_an_extension_route_answers_a_bad_body_400(http: httpx.Client) -> None:
    response = http.put("/clusters/demo/checkpoint-policy", json={"S3Retention": "many"})
    assert response.status_code == 400
    assert response.json()["__type"] in ("SerializationException", "ValidationException")
