"""The chat page: `GET /` serves static/index.html, `/static/...` its script and style sheet. A browser client of
this server's own /v1 API (models, streamed chat completions); nothing here touches the engine.

The page loads without the API key (it holds no data: it asks for the key and sends it as a bearer token with each
API call), and is not an API route (not counted in the request metrics, not waited for by a drain). Its
Content-Security-Policy lets it reach this server alone, and run no inline script: it works offline, and model
output that slipped into markup could not run."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from starlette.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).parent / "static"   # package data (pyproject.toml's package-data)

# data: and blob: for the previews of uploaded images and audio; everything else from this origin only
CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                           "img-src 'self' data: blob:; media-src 'self' data: blob:; base-uri 'none'; "
                           "form-action 'none'; frame-ancestors 'none'")


def add_chat_page(app: FastAPI) -> None:
    """Route `/` and mount `/static` on `app` (outside the OpenAPI schema: they are not API)."""

    async def page() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html",
                            headers={"Content-Security-Policy": CONTENT_SECURITY_POLICY, "Cache-Control": "no-cache"})

    app.add_api_route("/", page, methods=["GET"], include_in_schema=False)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
