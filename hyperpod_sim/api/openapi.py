"""The OpenAPI document of the control plane: FastAPI's, with the botocore-derived schemas of the
routed operations (hyperpod_sim/api/rest.py, extension_routes.py), the AWS JSON entry, the security
schemes, and what hyperpod_sim/api/openapi_doc.py adds to every operation (the error answers, the
examples)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from hyperpod_sim.api import openapi_doc, shapes
from hyperpod_sim.api import simulator_routes as extension_routes
from hyperpod_sim.api.deps import AMZ_JSON
from hyperpod_sim.api.gate import AGENT_PREFIX, OPEN_PATHS
from hyperpod_sim.api.registry import OPERATIONS
from hyperpod_sim.api.rest import ROUTES


def _aws_json_entry_doc() -> dict[str, Any]:
    """OpenAPI entry for ``POST /``, which hyperpod_sim/api/awsjson.py serves in front of the routes."""
    return {
        "tags": ["aws"],
        "summary": "AWS JSON 1.1 entry point (boto3, AWS CLI, sagemaker-core)",
        "description": (
            "The SageMaker wire protocol. The operation is named by the `X-Amz-Target` header, "
            "the body is the operation's input as JSON, timestamps are epoch seconds. With "
            "credentials configured (HPSIM_AUTH__CREDENTIALS) every call must be SigV4-signed with "
            "one of them (UnrecognizedClientException, InvalidSignatureException, "
            "IncompleteSignature, MissingAuthenticationToken otherwise); without, signatures are "
            "not checked. Operations: "
            + ", ".join(f"`{name}`" for name in sorted(OPERATIONS))
            + ". Errors: HTTP 400 (500/503 for service faults) with "
            '`{"__type": "<Code>", "message": "..."}`, which botocore raises as the modelled '
            "exception."
        ),
        "operationId": "AwsJson",
        "parameters": [
            {
                "name": "X-Amz-Target",
                "in": "header",
                "required": True,
                "schema": {"type": "string", "example": "SageMaker.DescribeCluster"},
                "description": "`SageMaker.<Operation>`",
            }
        ],
        "requestBody": {
            "required": True,
            "content": {
                "application/x-amz-json-1.1": {
                    "schema": {"type": "object"},
                    "example": {"ClusterName": "demo"},
                }
            },
        },
        "responses": {
            "200": {
                "description": "The operation's output as JSON",
                "content": {
                    AMZ_JSON: {
                        "schema": {"type": "object"},
                        "example": {"Clusters": [], "NextToken": None},
                    }
                },
            },
            "400": {
                "description": 'AWS error: `{"__type": "<Code>", "message": "..."}`',
                "content": {
                    AMZ_JSON: {
                        "schema": {"$ref": f"#/components/schemas/{openapi_doc.AWS_ERROR}"},
                        "example": {
                            "__type": "ResourceNotFound",
                            "message": "Cluster 'demo' does not exist.",
                        },
                    }
                },
            },
        },
    }


def install_openapi(app: FastAPI) -> None:
    """Add the botocore-derived schemas of every routed operation to the OpenAPI document."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(
            title=app.title,
            version=app.version,
            summary=app.summary,
            description=app.description,
            routes=app.routes,
        )
        components: dict[str, dict[str, Any]] = {}
        for route in ROUTES:
            operation = shapes.service_model().operation_model(route.operation)
            for shape in (operation.input_shape, operation.output_shape):
                if shape is not None:
                    shapes.shape_to_json_schema(shape, components)
        components.update(extension_routes.COMPONENTS)
        # The routes' own models (pydantic) must not share a name with a model's structure: one
        # would silently replace the other, and its answers break the schema documented for them.
        own = schema.setdefault("components", {}).setdefault("schemas", {})
        clashes = sorted(set(own) & set(components))
        if clashes:
            raise RuntimeError(f"OpenAPI schema names used twice: {', '.join(clashes)}")
        own.update(components)
        # The browser's way in (api/gate.py): Swagger UI's Authorize button sends the bearer token.
        schema["components"]["securitySchemes"] = {
            "bearer": {
                "type": "http",
                "scheme": "bearer",
                "description": "hpsim1.<access key id>.<mac>: `hyperpod-sim auth-token` prints it "
                "(docs/security.md). SigV4 (boto3, the AWS CLI) is accepted as well.",
            }
        }
        schema["security"] = [{"bearer": []}]
        for path, operations in schema["paths"].items():
            if path in OPEN_PATHS or path.startswith(AGENT_PREFIX):  # outside the access keys
                for operation in operations.values():
                    operation["security"] = []
        schema["paths"]["/"] = {"post": _aws_json_entry_doc()}
        openapi_doc.finish(schema)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
