"""The control plane's FastAPI application: the AWS JSON 1.1 entry, the REST routes, the lifespan."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import Scope

from hyperpod_sim.api import agent_routes, console_routes, docs_routes, openapi, rest
from hyperpod_sim.api import simulator_routes as extension_routes
from hyperpod_sim.api.auth import Authenticator
from hyperpod_sim.api.awsjson import AwsJsonEntry
from hyperpod_sim.api.deps import Services, as_aws_error, error_response, internal_failure
from hyperpod_sim.api.gate import RequestGate
from hyperpod_sim.api.registry import OPERATIONS
from hyperpod_sim.domain.account.cluster_extensions import ExtensionService
from hyperpod_sim.domain.account.scheduler_configs import SchedulerConfigService
from hyperpod_sim.domain.checkpoints.cluster_policy import S3Endpoint
from hyperpod_sim.domain.checkpoints.listing import CheckpointCatalog
from hyperpod_sim.domain.clock import Clock, Ids, SystemClock
from hyperpod_sim.domain.clusters.service import ClusterService, DomainConfig
from hyperpod_sim.domain.errors import (
    AwsError,
    SerializationException,
    ServiceUnavailable,
    UnknownOperationException,
    ValidationException,
)
from hyperpod_sim.domain.faults import FaultService
from hyperpod_sim.domain.jobs import JOB_MARK, JobService
from hyperpod_sim.domain.node_operations.add import AddNodesService
from hyperpod_sim.domain.node_operations.health_checks import HealthCheckService
from hyperpod_sim.domain.node_operations.move import MoveNodesService
from hyperpod_sim.domain.node_operations.reboot_replace import NodeOperations
from hyperpod_sim.domain.node_operations.software_update import SoftwareUpdateService
from hyperpod_sim.domain.nodes.agents import AgentConfig, AgentService
from hyperpod_sim.domain.nodes.attachments import AttachmentService
from hyperpod_sim.domain.nodes.node_set import NO_ADDRESSES, NodeAddresses
from hyperpod_sim.domain.nodes.sessions import NodeSessionService
from hyperpod_sim.domain.provisioning import Provisioner
from hyperpod_sim.domain.reconciler import Reconciler, ReconcilerConfig
from hyperpod_sim.infra.addresses import LoopbackAddresses
from hyperpod_sim.infra.local import make_provisioner
from hyperpod_sim.infra.netns import node_network
from hyperpod_sim.models import Database
from hyperpod_sim.models.db import Timeouts
from hyperpod_sim.settings import Settings

log = logging.getLogger(__name__)


def _make_data_dir(settings: Settings) -> None:
    """Owner only: the data dir holds the SQLite database, and the database the cluster tokens."""
    settings.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        settings.data_dir.chmod(0o700)
    except PermissionError:  # not ours (a mounted volume): its owner decides
        log.warning("cannot make the data dir %s owner-only (0700): it is not ours", settings.data_dir)


def _reconciler_config(settings: Settings, s3_endpoint: S3Endpoint) -> ReconcilerConfig:
    provisioning = settings.provisioning
    return ReconcilerConfig(
        interval_s=settings.reconciler.interval_s,
        node_ready_delay_s=provisioning.node_ready_delay_s,
        heartbeat_timeout_s=provisioning.heartbeat_timeout_s,
        heartbeat_interval_s=provisioning.heartbeat_interval_s,
        heartbeat_full_rate_nodes=provisioning.heartbeat_full_rate_nodes,
        launch_timeout_s=provisioning.launch_timeout_s,
        memory_scale=settings.simulation.memory_scale,
        s3_endpoint=s3_endpoint,
        push_workers=settings.reconciler.push_workers,
        push_timeout_s=settings.reconciler.push_timeout_s,
        push_backoff_s=settings.reconciler.push_backoff_s,
        push_backoff_max_s=settings.reconciler.push_backoff_max_s,
        restart_agents=provisioning.restart_agents,
        start_attempts=provisioning.start_attempts,
        replace_limit=provisioning.replace_limit,
        addresses=_node_addresses(settings),
    )


def _supervisor_alive(pid: int, started: int) -> bool:
    """Whether a job's supervisor (pid, kernel start time) still runs on this machine."""
    from hyperpod_sim.contracts.processes import start_time

    return start_time(pid) == started


def _end_job_ranks(job_id: str) -> list[int]:
    """End the processes of a job whose supervisor is gone (marked with its id)."""
    from hyperpod_sim.infra.node_processes import end_marked

    return end_marked([job_id], name=JOB_MARK)


def _node_addresses(settings: Settings) -> NodeAddresses:
    """Where new nodes' addresses come from: external agents bring theirs (the host they register
    from, domain/nodes/agents.py)."""
    provisioning = settings.provisioning
    if provisioning.mode == "external" or provisioning.node_network == "shared":
        return NO_ADDRESSES
    network = node_network(settings)
    return network if network is not None else LoopbackAddresses()


def _domain_config(settings: Settings) -> DomainConfig:
    token = settings.provisioning.bootstrap_token
    return DomainConfig(
        account_id=settings.account_id,
        region=settings.region,
        max_instances_per_cluster=settings.limits.max_instances_per_cluster,
        max_clusters=settings.limits.max_clusters,
        bootstrap_token=token.get_secret_value() if token else None,
    )


def build_services(
    settings: Settings,
    *,
    clock: Clock | None = None,
    ids: Ids | None = None,
    provisioner: Provisioner | None = None,
    agent_env: Mapping[str, str] | None = None,
) -> Services:
    """The domain services of one control plane. ``agent_env``: variables the local provisioner
    adds to every agent's environment (``serve`` passes the embedded S3 endpoint's credentials)."""
    clock = clock or SystemClock()
    ids = ids or Ids()
    _make_data_dir(settings)
    database = settings.database
    db = Database(
        settings.database_url(),
        timeouts=Timeouts(
            pool_s=database.pool_timeout_s,
            connect_s=database.connect_timeout_s,
            statement_s=database.statement_timeout_s,
        ),
    )
    db.migrate()
    provisioning = settings.provisioning
    if provisioner is None:
        provisioner = make_provisioner(
            provisioning.mode,
            command=provisioning.agent_command,
            control_plane_url=settings.control_plane_url(),
            data_dir=settings.data_dir.resolve(),
            shm_root=settings.simulation.shm_root,
            kill_grace_s=provisioning.kill_grace_s,
            agent_env=agent_env,
            network=node_network(settings) if provisioning.mode == "local" else None,
            merge_agent_pages=settings.simulation.merge_agent_pages,
        )
    # Read once: `serve` has put the embedded endpoint in the settings before this runs.
    s3_endpoint = S3Endpoint(url=settings.s3.endpoint_url, region=settings.s3.region)
    reconciler = Reconciler(
        db=db,
        clock=clock,
        ids=ids,
        provisioner=provisioner,
        config=_reconciler_config(settings, s3_endpoint),
    )
    agents = AgentService(
        db=db,
        clock=clock,
        ids=ids,
        config=AgentConfig(
            pacing=reconciler.pacing,
            memory_scale=settings.simulation.memory_scale,
            s3_endpoint=s3_endpoint,
            local_agents=provisioner.owns_agents,
            node_subnet=provisioning.node_subnet if node_network(settings) is not None else None,
            max_namespaces_per_cluster=settings.limits.max_namespaces_per_cluster,
            max_namespace_ranks=settings.limits.max_namespace_ranks,
        ),
        on_change=reconciler.wake,
    )
    config = _domain_config(settings)
    wake = reconciler.wake
    region, account_id, max_instances = config.region, config.account_id, config.max_instances_per_cluster
    return Services(
        settings=settings,
        db=db,
        clusters=ClusterService(db=db, clock=clock, ids=ids, config=config, on_change=wake),
        agents=agents,
        reconciler=reconciler,
        checkpoints=CheckpointCatalog(db=db),
        faults=FaultService(
            db=db,
            clock=clock,
            ids=ids,
            provisioner=provisioner,
            provisioning_mode=provisioning.mode,
            on_change=wake,
        ),
        node_sessions=NodeSessionService(
            db=db, clock=clock, ids=ids, provisioner=provisioner, provisioning_mode=provisioning.mode
        ),
        jobs=JobService(
            db=db,
            clock=clock,
            ids=ids,
            provisioner=provisioner,
            supervisor_alive=_supervisor_alive,
            end_ranks=_end_job_ranks,
        ),
        node_operations=NodeOperations(db=db, clock=clock, ids=ids, on_change=wake),
        software_updates=SoftwareUpdateService(db=db, clock=clock, ids=ids, on_change=wake),
        add_nodes=AddNodesService(
            db=db,
            clock=clock,
            ids=ids,
            region=region,
            max_instances=max_instances,
            addresses=_node_addresses(settings),
            on_change=wake,
        ),
        health_checks=HealthCheckService(db=db, clock=clock, ids=ids, on_change=wake),
        moves=MoveNodesService(db=db, clock=clock, ids=ids, max_instances=max_instances, on_change=wake),
        scheduler_configs=SchedulerConfigService(
            db=db, clock=clock, ids=ids, region=region, account_id=account_id
        ),
        cluster_extensions=ExtensionService(
            db=db, clock=clock, ids=ids, region=region, account_id=account_id
        ),
        attachments=AttachmentService(db=db, clock=clock),
    )


def _description() -> str:
    """The OpenAPI description: the two transports, the error shape, authentication."""
    return (
        "Two transports over one domain layer:\n\n"
        "* **AWS JSON 1.1** at `POST /` with `X-Amz-Target: SageMaker.<Operation>`: point "
        "boto3, the AWS CLI or sagemaker-core at this service with an endpoint URL. "
        f"Operations: {', '.join(sorted(OPERATIONS))}.\n"
        "* **REST** routes under `/clusters` with the same member names and shapes as the AWS "
        "API.\n\n"
        'Errors have the AWS shape `{"__type": "<Code>", "message": "..."}` on both.\n\n'
        "**Authentication** (when the service has credentials, `HPSIM_AUTH__CREDENTIALS`): every "
        "route but `/agent/v1/*`, `/health` and this documentation needs a SigV4 signature "
        "(boto3, the AWS CLI, `sdk.client.HyperPodClient`) or `Authorization: Bearer <token>` "
        "(`hyperpod-sim auth-token`; use *Authorize* above). Fault injection needs an admin "
        "credential once `HPSIM_AUTH__ADMIN_CREDENTIALS` is set. See docs/security.md."
    )


def _install_error_handlers(app: FastAPI) -> None:
    """Errors answer in the AWS shape, ``{"__type": ..., "message": ...}`` (the agent routes' bad
    bodies in the agent protocol's)."""

    @app.exception_handler(AwsError)
    async def _aws_error(request: Request, exc: AwsError) -> JSONResponse:
        return error_response(exc, rest.status_for(exc), media_type="application/json")

    @app.exception_handler(RequestValidationError)
    async def _bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in error['loc'])}: {error['msg']}" for error in exc.errors()
        )
        if request.url.path.startswith("/agent/"):
            return JSONResponse({"error": "InvalidRequest", "message": problems}, status_code=400)
        return error_response(ValidationException(problems), 400, media_type="application/json")

    @app.exception_handler(StarletteHTTPException)
    async def _no_route(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Paths and methods no route serves answer in the AWS shape too (the agent protocol's
        under /agent/); so does a body FastAPI cannot parse (400 SerializationException)."""
        headers: dict[str, str] = {}
        error: AwsError
        if exc.status_code == 405:
            headers["Allow"] = ", ".join(allowed_methods(app, request.scope))
            error = UnknownOperationException(
                f"Method {request.method} is not allowed on {request.url.path}."
            )
        elif exc.status_code == 404:
            error = UnknownOperationException(
                f"No route serves {request.method} {request.url.path}; see /docs."
            )
        elif exc.status_code == 400:
            error = SerializationException(str(exc.detail))
        else:
            error = UnknownOperationException(str(exc.detail))
        if request.url.path.startswith("/agent/"):
            code = {400: "InvalidRequest", 404: "NoRoute", 405: "MethodNotAllowed"}.get(exc.status_code)
            body = {"error": code or error.code, "message": error.message}
            return JSONResponse(body, status_code=exc.status_code, headers=headers)
        response = error_response(error, exc.status_code, media_type="application/json")
        response.headers.update(headers)
        return response

    # What a route did not turn into an AwsError itself. Its transaction was rolled back.
    @app.exception_handler(OperationalError)
    async def _database_unavailable(request: Request, exc: OperationalError) -> JSONResponse:
        """The database is down or locked: 503 ServiceUnavailable, the caller retries later."""
        return _unexpected_answer(request, as_aws_error(exc))

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        """Anything else: 500 InternalFailure, never a traceback. Starlette raises the exception
        again once this is answered, so the server logs it (not logged here a second time)."""
        return _unexpected_answer(request, internal_failure())


def _unexpected_answer(request: Request, error: AwsError) -> JSONResponse:
    """An error no route expected, in the shape of its path: the agent protocol's under /agent/."""
    if request.url.path.startswith("/agent/"):
        return JSONResponse({"error": error.code, "message": error.message}, status_code=error.status)
    return error_response(error, rest.status_for(error), media_type="application/json")


_METHODS = ("DELETE", "GET", "HEAD", "PATCH", "POST", "PUT")


def allowed_methods(app: FastAPI, scope: Scope) -> list[str]:
    """The methods some route serves on the request's path (the ``Allow`` of a 405): Starlette
    names only those of the first route that matches, and FastAPI's included routers none."""
    return [
        method
        for method in _METHODS
        if any(route.matches({**scope, "method": method})[0] is Match.FULL for route in app.router.routes)
    ]


def create_app(
    settings: Settings,
    *,
    clock: Clock | None = None,
    ids: Ids | None = None,
    provisioner: Provisioner | None = None,
    agent_env: Mapping[str, str] | None = None,
) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        services = build_services(
            settings, clock=clock, ids=ids, provisioner=provisioner, agent_env=agent_env
        )
        app.state.services = services
        services.reconciler.start()
        try:
            yield
        finally:
            services.reconciler.stop()
            services.checkpoints.close()
            services.db.dispose()

    app = FastAPI(
        title="hyperpod-sim control plane",
        version="0.1.0",
        summary="A local SageMaker HyperPod control plane with managed tiered checkpointing.",
        description=_description(),
        lifespan=lifespan,
        # Served with their files from this server (hyperpod_sim/api/docs_routes.py), not a CDN.
        docs_url=None,
        redoc_url=None,
    )

    _install_error_handlers(app)

    @app.get(
        "/health",
        operation_id="Health",
        tags=["service"],
        summary="Liveness and database check, from memory",
        description='200 with `{"status": "ok", "database": "answers"}` when the service runs and its '
        "database answers; 503 ServiceUnavailable (AWS error shape) saying why when it does not (a "
        "DatabaseOutage or DatabaseHang in force, a statement waiting past the pool timeout for its "
        "answer, or the last statement failed for the database). It sends nothing to the database "
        "and runs on the event loop, so it answers at once even while every database connection "
        "waits.",
    )
    async def health(request: Request) -> Any:
        services: Services = request.app.state.services
        why = services.db.answers()
        if why is not None:
            error = ServiceUnavailable(f"The service's database does not answer: {why}.")
            return error_response(error, 503, media_type="application/json")
        return {"status": "ok", "database": "answers"}

    app.include_router(rest.router)
    app.include_router(extension_routes.router)
    app.include_router(agent_routes.router)
    docs_routes.install(app)
    console_routes.install(app)
    app.add_middleware(AwsJsonEntry)
    app.add_middleware(agent_routes.HeartbeatEntry)
    # Outermost of our layers: nothing reaches a route (or the AWS JSON entry) without passing it.
    app.add_middleware(
        RequestGate,
        authenticator=Authenticator(settings.auth),
        max_body_bytes=settings.limits.max_body_bytes,
        max_json_depth=settings.limits.max_json_depth,
    )
    openapi.install_openapi(app)
    return app
