"""The web playground at `/`: static files (no build step, nothing fetched from outside the server)
whose page talks to this server's own `/v1` API from the browser. The page itself is public; its API
calls carry the key the user enters."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from starlette.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).parent / "static"
# The page runs only its own scripts and styles and connects only to this server: a renderer bug could
# still not make model output load or run anything.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; base-uri 'none'; "
    "frame-ancestors 'none'"
)


def mount_playground(app: FastAPI) -> None:
    """Serve the page at `/` and its files under `/playground/`, outside the OpenAPI schema."""

    @app.get("/", include_in_schema=False)
    async def playground() -> FileResponse:
        return FileResponse(
            STATIC_DIR / "index.html", headers={"Content-Security-Policy": CONTENT_SECURITY_POLICY}
        )

    app.mount("/playground", StaticFiles(directory=STATIC_DIR), name="playground")
