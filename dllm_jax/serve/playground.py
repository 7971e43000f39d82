"""The playground page: ``GET /`` serves ``static/index.html``; its script and style sit beside it.

The page is plain HTML, CSS and JavaScript (no build step, nothing fetched from elsewhere) and
talks to the server only through the public streaming API with the ``dllm.canvas`` extension.
Its files hold no data, so they are served without an API key (the page sends the key the
user types with its API calls).
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse

STATIC_DIR = Path(__file__).with_name("static")

# URL path -> (file in STATIC_DIR, media type); browsers ask for /favicon.ico unprompted
_FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/static/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/static/style.css": ("style.css", "text/css; charset=utf-8"),
    "/static/favicon.svg": ("favicon.svg", "image/svg+xml"),
    "/favicon.ico": ("favicon.svg", "image/svg+xml"),
}
PLAYGROUND_PATHS = frozenset(_FILES)


def add_playground(app: FastAPI) -> None:
    """Adds the page's GET routes (exactly PLAYGROUND_PATHS) to ``app``."""
    for path, (name, media_type) in _FILES.items():
        app.add_api_route(path, _serve_file(STATIC_DIR / name, media_type), methods=["GET"], include_in_schema=False)


def _serve_file(file: Path, media_type: str):
    def serve() -> FileResponse:
        return FileResponse(file, media_type=media_type)

    return serve
