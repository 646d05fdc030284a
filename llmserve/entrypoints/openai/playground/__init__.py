"""The web playground at `/`: static files (no build step, nothing fetched from outside the server)
whose page talks to this server's own `/v1` API from the browser. The page itself is public; its API
calls carry the key the user enters."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import FileResponse, Response
from starlette.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).parent / "static"
# The page runs only its own scripts and styles and connects only to this server: a renderer bug could
# still not make model output load or run anything.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; base-uri 'none'; "
    "frame-ancestors 'none'"
)
# Every playground file: its policy, no content-type sniffing (a text file never runs as a script), and
# no Referer to other sites.
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


class _PlaygroundFiles(StaticFiles):
    def file_response(self, *args: Any, **kwargs: Any) -> Response:
        response = super().file_response(*args, **kwargs)
        response.headers.update(SECURITY_HEADERS)
        return response


def mount_playground(app: FastAPI) -> None:
    """Serve the page at `/` and its files under `/playground/`, outside the OpenAPI schema."""

    @app.get("/", include_in_schema=False)
    async def playground() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", headers=SECURITY_HEADERS)

    app.mount("/playground", _PlaygroundFiles(directory=STATIC_DIR), name="playground")
