"""The app's last word on errors (hyperpod_sim/api/app.py): what no route turned into an AWS error
itself still answers in the AWS shape, over real HTTP. A database that is unavailable (SQLAlchemy's
``OperationalError``) is 503 ServiceUnavailable, to be retried; anything else 500 InternalFailure,
without a traceback. Under ``/agent/`` the agent protocol's shape. The routes that raise are the
test's own, added to a real app: a bug in a route is what the handlers are for."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy.exc import OperationalError

from hyperpod_sim.api.app import create_app
from tests.conftest import ServerThread, free_port, make_settings

LOCKED = OperationalError("UPDATE clusters SET ...", {}, Exception("database is locked"))


@pytest.fixture
def url(tmp_path: Path) -> Iterator[str]:
    app = create_app(make_settings(f"sqlite:///{tmp_path / 'cp.db'}", tmp_path / "data"))

    async def database_down() -> None:
        raise LOCKED

    def bug() -> None:  # a plain function: FastAPI runs it in its thread pool, as the routes' work
        raise RuntimeError("secret detail: /etc/hyperpod-sim/key")

    app.add_api_route("/test-only/database-down", database_down)
    app.add_api_route("/test-only/bug", bug)
    app.add_api_route("/agent/v1/test-only/bug", bug)
    port = free_port()
    with ServerThread(app, port):
        yield f"http://127.0.0.1:{port}"


def test_an_unavailable_database_is_503_service_unavailable(url: str) -> None:
    response = httpx.get(f"{url}/test-only/database-down", timeout=10)
    assert response.status_code == 503
    assert response.json() == {
        "__type": "ServiceUnavailable",
        "message": "The service's database is unavailable; retry the request later.",
    }
    assert response.headers["x-amzn-ErrorType"] == "ServiceUnavailable"
    assert response.headers["content-type"] == "application/json"


def test_a_bug_is_500_internal_failure_without_its_detail(url: str) -> None:
    response = httpx.get(f"{url}/test-only/bug", timeout=10)
    assert response.status_code == 500
    assert response.json() == {
        "__type": "InternalFailure",
        "message": "An internal error occurred; the request was not applied.",
    }
    assert response.headers["x-amzn-ErrorType"] == "InternalFailure"
    assert "secret" not in response.text
    assert "Traceback" not in response.text


def test_under_agent_the_agent_protocols_shape(url: str) -> None:
    response = httpx.get(f"{url}/agent/v1/test-only/bug", timeout=10)
    assert response.status_code == 500
    assert response.json() == {
        "error": "InternalFailure",
        "message": "An internal error occurred; the request was not applied.",
    }
