"""What every route needs: the services of the running app and the AWS error mapping."""

from __future__ import annotations

import json
import logging
import math
import uuid
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.responses import JSONResponse
from sqlalchemy.exc import OperationalError

from hyperpod_sim.domain.account.cluster_extensions import ExtensionService
from hyperpod_sim.domain.account.scheduler_configs import SchedulerConfigService
from hyperpod_sim.domain.checkpoints.listing import CheckpointCatalog
from hyperpod_sim.domain.clusters.service import ClusterService
from hyperpod_sim.domain.errors import (
    AccessDeniedException,
    AwsError,
    InternalFailure,
    SerializationException,
    ServiceUnavailable,
)
from hyperpod_sim.domain.faults import FaultService
from hyperpod_sim.domain.jobs import JobService
from hyperpod_sim.domain.node_operations.add import AddNodesService
from hyperpod_sim.domain.node_operations.health_checks import HealthCheckService
from hyperpod_sim.domain.node_operations.move import MoveNodesService
from hyperpod_sim.domain.node_operations.reboot_replace import NodeOperations
from hyperpod_sim.domain.node_operations.software_update import SoftwareUpdateService
from hyperpod_sim.domain.nodes.agents import AgentService
from hyperpod_sim.domain.nodes.attachments import AttachmentService
from hyperpod_sim.domain.nodes.sessions import NodeSessionService
from hyperpod_sim.domain.reconciler import Reconciler
from hyperpod_sim.models import Database
from hyperpod_sim.settings import Settings

log = logging.getLogger(__name__)

AMZ_JSON = "application/x-amz-json-1.1"

Params = dict[str, Any]  # an operation's validated input, AWS member names


@dataclass(frozen=True)
class Services:
    """Every service of one control plane, built once by ``api.app.build_services`` and shared by
    every request: the operation handlers take ``(services, params)``."""

    settings: Settings
    db: Database
    clusters: ClusterService
    agents: AgentService
    reconciler: Reconciler
    checkpoints: CheckpointCatalog
    faults: FaultService
    node_sessions: NodeSessionService
    jobs: JobService
    node_operations: NodeOperations
    software_updates: SoftwareUpdateService
    add_nodes: AddNodesService
    health_checks: HealthCheckService
    moves: MoveNodesService
    scheduler_configs: SchedulerConfigService
    cluster_extensions: ExtensionService
    attachments: AttachmentService


def get_services(request: Request) -> Services:
    services: Services = request.app.state.services
    return services


ServicesDep = Annotated[Services, Depends(get_services)]


def require_admin(request: Request) -> None:
    """Once admin credentials are configured, only they pass (hyperpod_sim/api/gate.py put the caller in the
    request's state); AccessDeniedException otherwise."""
    services: Services = request.app.state.services
    if not services.settings.auth.admin_credentials:
        return
    principal = getattr(request.state, "principal", None)
    if principal is None or not principal.admin:
        who = f"The access key {principal.access_key_id}" if principal is not None else "This caller"
        raise AccessDeniedException(
            f"{who} is not authorized to inject or clear faults: only the admin credentials "
            "(HPSIM_AUTH__ADMIN_CREDENTIALS) may."
        )


AdminDep = Depends(require_admin)


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        shown = text if len(text) <= 20 else text[:17] + "..."
        raise SerializationException(f"The number {shown} is out of range.")
    return value


def _no_constant(text: str) -> Any:
    raise SerializationException(f"{text} is not a JSON value.")


def parse_json(raw: bytes) -> Any:
    """A request body as JSON (``{}`` when empty). Finite numbers only; nesting was bounded by the
    gate (hyperpod_sim/api/gate.py) before this runs. SerializationException when it is not JSON."""
    if not raw.strip():
        return {}
    try:
        return json.loads(raw, parse_float=_finite, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise SerializationException("The request body is not valid JSON.") from exc


def as_aws_error(exc: Exception) -> AwsError:
    """Map anything a request can raise to an AWS-shaped error; never leak a traceback."""
    if isinstance(exc, AwsError):
        return exc
    if isinstance(exc, OperationalError):
        log.warning("database unavailable: %s", exc)
        return ServiceUnavailable("The service's database is unavailable; retry the request later.")
    log.exception("unexpected error", exc_info=exc)
    return internal_failure()


def internal_failure() -> InternalFailure:
    """What a caller sees of a bug: no traceback, no detail."""
    return InternalFailure("An internal error occurred; the request was not applied.")


def error_response(error: AwsError, status: int, media_type: str = AMZ_JSON) -> JSONResponse:
    return JSONResponse(
        error.to_body(),
        status_code=status,
        media_type=media_type,
        headers={"x-amzn-RequestId": str(uuid.uuid4()), "x-amzn-ErrorType": error.code},
    )
