"""The control plane's FastAPI application: the AWS JSON 1.1 entry, the REST routes, the lifespan."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response

from api import rest
from api.deps import AMZ_JSON, Services, ServicesDep, as_aws_error, error_response
from api.operations import OPERATIONS, dispatch
from domain.clock import Clock, Ids, SystemClock
from domain.clusters import ClusterService, DomainConfig
from domain.errors import AwsError, SerializationException, UnknownOperationException
from domain.reconciler import Provisioner, Reconciler, SimulatedProvisioner
from hyperpod_sim.settings import Settings
from models import Database

TARGET_PREFIX = "SageMaker."


def build_services(
    settings: Settings,
    *,
    clock: Clock | None = None,
    ids: Ids | None = None,
    provisioner: Provisioner | None = None,
) -> Services:
    clock = clock or SystemClock()
    ids = ids or Ids()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    db = Database(settings.database_url())
    db.migrate()
    reconciler = Reconciler(
        db=db,
        clock=clock,
        ids=ids,
        provisioner=provisioner or SimulatedProvisioner(),
        node_ready_delay_s=settings.provisioning.node_ready_delay_s,
        interval_s=settings.reconciler.interval_s,
    )
    clusters = ClusterService(
        db=db,
        clock=clock,
        ids=ids,
        config=DomainConfig(
            account_id=settings.account_id,
            region=settings.region,
            max_instances_per_cluster=settings.limits.max_instances_per_cluster,
            max_clusters=settings.limits.max_clusters,
        ),
        on_change=reconciler.wake,
    )
    return Services(settings=settings, db=db, clusters=clusters, reconciler=reconciler)


def create_app(
    settings: Settings,
    *,
    clock: Clock | None = None,
    ids: Ids | None = None,
    provisioner: Provisioner | None = None,
) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        services = build_services(settings, clock=clock, ids=ids, provisioner=provisioner)
        app.state.services = services
        services.reconciler.start()
        try:
            yield
        finally:
            services.reconciler.stop()
            services.db.dispose()

    app = FastAPI(
        title="hyperpod-sim control plane",
        version="0.1.0",
        summary="A local SageMaker HyperPod control plane with managed tiered checkpointing.",
        description=(
            "Two transports over one domain layer:\n\n"
            "* **AWS JSON 1.1** at `POST /` with `X-Amz-Target: SageMaker.<Operation>`: point "
            "boto3, the AWS CLI or sagemaker-core at this service with an endpoint URL. "
            f"Operations: {', '.join(sorted(OPERATIONS))}.\n"
            "* **REST** routes under `/clusters` with the same member names and shapes as the AWS "
            "API.\n\n"
            'Errors have the AWS shape `{"__type": "<Code>", "message": "..."}` on both.'
        ),
        lifespan=lifespan,
    )

    @app.exception_handler(AwsError)
    async def _aws_error(request: Request, exc: AwsError) -> JSONResponse:
        return error_response(exc, rest.status_for(exc), media_type="application/json")

    @app.post(
        "/",
        summary="AWS JSON 1.1 entry point",
        description=(
            "The SageMaker wire protocol. The operation is named by the `X-Amz-Target` header "
            "(`SageMaker.CreateCluster`, ...), the body is the operation's input as JSON. SigV4 "
            "signatures are accepted and not checked."
        ),
        tags=["aws"],
        responses={400: {"description": 'AWS error: `{"__type": code, "message": text}`'}},
    )
    async def aws_json(request: Request, services: ServicesDep) -> Response:
        target = request.headers.get("x-amz-target", "")
        if not target.startswith(TARGET_PREFIX):
            return error_response(
                UnknownOperationException(
                    f"Missing or unknown X-Amz-Target '{target}'; expected 'SageMaker.<Operation>'."
                ),
                400,
            )
        operation = target[len(TARGET_PREFIX) :]
        raw = await request.body()
        try:
            body: object = json.loads(raw) if raw.strip() else {}
        except ValueError:
            return error_response(SerializationException("The request body is not valid JSON."), 400)
        try:
            result = await run_in_threadpool(dispatch, services.clusters, operation, body)
        except Exception as exc:  # every failure leaves in the AWS shape
            error = as_aws_error(exc)
            return error_response(error, error.status)
        return Response(
            json.dumps(result),
            media_type=AMZ_JSON,
            headers={"x-amzn-RequestId": str(uuid.uuid4())},
        )

    @app.get("/health", tags=["service"], summary="Liveness and database check")
    def health(services: ServicesDep) -> dict[str, str]:
        with services.db.read() as session:
            session.connection().exec_driver_sql("SELECT 1")
        return {"status": "ok"}

    app.include_router(rest.router)
    rest.install_openapi(app)
    return app
