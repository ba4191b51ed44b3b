"""The API documentation pages, ``/docs`` (Swagger UI) and ``/redoc`` (ReDoc), with their files
served by the control plane itself: the pages work where no CDN can be reached.

The files are those the fastapi-offline package ships (the ``server`` extra), served at
``/docs/assets/<name>``; only the files listed in ``ASSETS`` are, and nothing is read from the
request's path. The gate (hyperpod_sim/api/gate.py) lets these pages and files through without
credentials, as it does the document they show.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from fastapi import FastAPI, HTTPException
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse, Response

ASSETS_PATH = "/docs/assets"
ASSETS = {
    "swagger-ui-bundle.js": "text/javascript; charset=utf-8",
    "swagger-ui.css": "text/css; charset=utf-8",
    "redoc.standalone.js": "text/javascript; charset=utf-8",
    "favicon.png": "image/png",
}
_HEADERS = {"Cache-Control": "public, max-age=86400", "X-Content-Type-Options": "nosniff"}


@cache
def _read(name: str) -> bytes:
    return (resources.files("fastapi_offline") / "static" / name).read_bytes()


def install(app: FastAPI) -> None:
    """Serve ``/docs``, its OAuth2 redirect page, ``/redoc`` and their files on ``app`` (built with
    ``docs_url=None, redoc_url=None``, so that FastAPI's CDN pages are not)."""
    openapi_url = app.openapi_url or "/openapi.json"
    redirect_url = app.swagger_ui_oauth2_redirect_url or "/docs/oauth2-redirect"
    favicon = f"{ASSETS_PATH}/favicon.png"

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=openapi_url,
            title=f"{app.title} - Swagger UI",
            swagger_js_url=f"{ASSETS_PATH}/swagger-ui-bundle.js",
            swagger_css_url=f"{ASSETS_PATH}/swagger-ui.css",
            swagger_favicon_url=favicon,
            oauth2_redirect_url=redirect_url,
            # No badge fetched from validator.swagger.io: the document is checked by our tests.
            swagger_ui_parameters={"validatorUrl": None, "persistAuthorization": True},
        )

    @app.get(redirect_url, include_in_schema=False)
    async def swagger_ui_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @app.get("/redoc", include_in_schema=False)
    async def redoc() -> HTMLResponse:
        return get_redoc_html(
            openapi_url=openapi_url,
            title=f"{app.title} - ReDoc",
            redoc_js_url=f"{ASSETS_PATH}/redoc.standalone.js",
            redoc_favicon_url=favicon,
            with_google_fonts=False,
        )

    @app.get(ASSETS_PATH + "/{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        media_type = ASSETS.get(name)
        if media_type is None:
            raise HTTPException(status_code=404)
        return Response(_read(name), media_type=media_type, headers=_HEADERS)
