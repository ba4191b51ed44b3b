"""/docs and /redoc work offline: the pages name no URL outside the control plane, and the files they
load are served by it (without credentials, like the document they show)."""

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest

from hyperpod_sim.api.docs_routes import ASSETS
from tests.conftest import ControlPlane

pytestmark = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)

# Whatever a page names: src/href attributes and url(...)s, and any absolute URL in its text.
_REFERENCES = re.compile(r"""(?:src|href)\s*=\s*["']([^"']+)["']|url\(\s*["']?([^"')]+)|(\w+://[^\s"'<>]+)""")


@pytest.fixture
def settings_overrides() -> dict[str, Any]:
    return {"auth": {"credentials": {"AKIDDOCS": "docs-secret"}}}


def _references(page: str) -> list[str]:
    return [next(group for group in match if group) for match in _REFERENCES.findall(page)]


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_the_page_names_nothing_outside_the_server(control_plane: ControlPlane, page: str) -> None:
    response = httpx.get(control_plane.url + page)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    references = _references(response.text)
    assert "/openapi.json" in response.text
    assert references, "the page loads no script?"
    external = [ref for ref in references if not ref.startswith("/")]
    assert external == []
    for reference in references:
        loaded = httpx.get(control_plane.url + reference)
        assert loaded.status_code == 200, reference
        assert loaded.content


def test_every_asset_is_served_with_its_type(control_plane: ControlPlane) -> None:
    for name, media_type in ASSETS.items():
        response = httpx.get(f"{control_plane.url}/docs/assets/{name}")
        assert response.status_code == 200, name
        assert response.headers["content-type"] == media_type
        assert len(response.content) > 100
    assert httpx.get(f"{control_plane.url}/docs/assets/..%2Fcore.py").status_code == 404
    assert httpx.get(f"{control_plane.url}/docs/assets/core.py").status_code == 404


def test_the_oauth2_redirect_page_is_served(control_plane: ControlPlane) -> None:
    response = httpx.get(control_plane.url + "/docs/oauth2-redirect")
    assert response.status_code == 200
    assert [ref for ref in _references(response.text) if not ref.startswith("/")] == []
