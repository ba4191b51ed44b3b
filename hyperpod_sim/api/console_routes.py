"""The web console: static files shipped in the package (hyperpod_sim/api/console/), served at ``/console``.

The page holds no data and no secret: it reads and changes the control plane only through the public
REST routes, with the caller's own credentials (a bearer token, docs/console.md), so the gate
(hyperpod_sim/api/gate.py) lets ``GET`` of these files and of the root page through without credentials as it
does ``/docs``, and checks every call the page then makes. Only the files listed in ``ASSETS`` are
served; nothing is read from the request's path.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from hyperpod_sim.api import overview

STATIC = Path(__file__).with_name("console")
ASSETS = {
    "app.js": "text/javascript; charset=utf-8",
    "api.js": "text/javascript; charset=utf-8",
    "views.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
ROOT_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>hyperpod-sim</title>
<meta name="viewport" content="width=device-width, initial-scale=1"></head>
<body style="font-family: system-ui, sans-serif; margin: 2rem">
<h1>hyperpod-sim control plane</h1>
<ul>
<li><a href="/console">Console</a>: clusters, nodes, the checkpoint map, events and faults, live</li>
<li><a href="/docs">API documentation</a> (OpenAPI: <a href="/openapi.json">/openapi.json</a>)</li>
<li>AWS JSON 1.1 at <code>POST /</code> (boto3, the AWS CLI)</li>
</ul></body></html>
"""

router = APIRouter(include_in_schema=False)


@cache
def _read(name: str) -> bytes:
    return (STATIC / name).read_bytes()


# The files change only with the package: a browser may keep them, but asks again each load.
_HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}


@router.get("/")
async def root() -> HTMLResponse:
    return HTMLResponse(ROOT_PAGE, headers=_HEADERS)


@router.get("/console")
async def console() -> Response:
    return Response(
        _read("index.html"),
        media_type="text/html; charset=utf-8",
        headers={**_HEADERS, "Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'"},
    )


@router.get("/console/")
async def console_slash() -> RedirectResponse:
    return RedirectResponse("/console")


def _asset_route(name: str, media_type: str) -> None:
    async def asset() -> Response:
        return Response(_read(name), media_type=media_type, headers=_HEADERS)

    router.add_api_route(f"/console/{name}", asset, methods=["GET"], name=f"console-{name}")


for _name, _media_type in ASSETS.items():
    _asset_route(_name, _media_type)


def install(app: FastAPI) -> None:
    """The console's pages and the REST routes it needs (hyperpod_sim/api/overview.py)."""
    app.include_router(router)
    app.include_router(overview.router)
