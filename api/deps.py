"""What every route needs: the services of the running app and the AWS error mapping."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from fastapi.responses import JSONResponse
from sqlalchemy.exc import OperationalError

from domain.agents import AgentService
from domain.checkpoints import CheckpointCatalog
from domain.clusters import ClusterService
from domain.errors import AwsError, InternalFailure, ServiceUnavailable
from domain.faults import FaultService
from domain.reconciler import Reconciler
from hyperpod_sim.settings import Settings
from models import Database

log = logging.getLogger(__name__)

AMZ_JSON = "application/x-amz-json-1.1"


@dataclass
class Services:
    settings: Settings
    db: Database
    clusters: ClusterService
    agents: AgentService
    reconciler: Reconciler
    checkpoints: CheckpointCatalog
    faults: FaultService


def get_services(request: Request) -> Services:
    services: Services = request.app.state.services
    return services


ServicesDep = Annotated[Services, Depends(get_services)]


def as_aws_error(exc: Exception) -> AwsError:
    """Map anything a request can raise to an AWS-shaped error; never leak a traceback."""
    if isinstance(exc, AwsError):
        return exc
    if isinstance(exc, OperationalError):
        log.warning("database unavailable: %s", exc)
        return ServiceUnavailable("The service's database is unavailable; retry the request later.")
    log.exception("unexpected error", exc_info=exc)
    return InternalFailure("An internal error occurred; the request was not applied.")


def error_response(error: AwsError, status: int, media_type: str = AMZ_JSON) -> JSONResponse:
    return JSONResponse(
        error.to_body(),
        status_code=status,
        media_type=media_type,
        headers={"x-amzn-RequestId": str(uuid.uuid4()), "x-amzn-ErrorType": error.code},
    )
