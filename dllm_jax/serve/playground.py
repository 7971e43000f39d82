"""The playground page: ``GET /`` serves ``static/index.html``, ``/static/*`` its script and style.

The page is plain HTML, CSS and JavaScript (no build step, nothing fetched from elsewhere) and
talks to the server only through the public streaming API with the ``dllm.canvas`` extension.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).with_name("static")


def add_playground(app: FastAPI) -> None:
    """Adds ``GET /`` (the page) and ``/static`` (its files) to ``app``; neither needs an API key."""

    def playground() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html")

    app.add_api_route("/", playground, methods=["GET"], include_in_schema=False)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
