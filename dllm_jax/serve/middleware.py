"""ASGI middleware: the Bearer API key, the request body (size, time, JSON), response headers.

A POST body is read whole here (it is small JSON): over `max_body_bytes` it is a 413, not all
received within `body_timeout` seconds a 408, not UTF-8 or not JSON a 400 "invalid_json", and a
string holding a lone surrogate (JSON's "\\ud800", which no UTF-8 text can hold) a 400 naming
its field. The routes then parse a body that is known to be well formed. Every response gets
headers that keep a browser from sniffing types or framing the page, and the page a
Content-Security-Policy of its own files only.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dllm_jax.serve.errors import APIError
from dllm_jax.serve.playground import PLAYGROUND_PATHS

# paths served without an API key (the playground's files hold no data)
PUBLIC_PATHS = frozenset({"/health"}) | PLAYGROUND_PATHS

SECURITY_HEADERS = (
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
    (
        b"content-security-policy",
        b"default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
        b"frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    ),
)


def bearer_token_matches(header: str | None, api_key: str) -> bool:
    """True when the Authorization header is "Bearer <api_key>" (constant-time compare)."""
    if not header or not api_key:
        return False
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(token.strip().encode(), api_key.encode())


def first_invalid_string(value: Any) -> tuple[str, str] | None:
    """(field path, the string) of the first key or string in a parsed JSON value that holds a
    lone surrogate, or None. Iterative: any nesting depth json.loads accepts."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            if not _encodable(item):
                return path, item
        elif isinstance(item, dict):
            for key, child in reversed(list(item.items())):
                where = f"{path}.{key}" if path else key
                if not _encodable(key):
                    return where, key
                stack.append((where, child))
        elif isinstance(item, list):
            stack.extend((f"{path}[{i}]", child) for i, child in reversed(list(enumerate(item))))
    return None


def body_problem(body: bytes) -> APIError | None:
    """Why a request body is not well-formed JSON text, or None."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        return APIError(
            400,
            f"the request body is not valid UTF-8 (byte 0x{body[e.start]:02x} at offset {e.start})",
            code="invalid_json",
        )
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return APIError(400, f"the request body is not valid JSON ({e.msg} at offset {e.pos})", code="invalid_json")
    except RecursionError:
        return APIError(400, "the request body is nested too deeply", code="invalid_json")
    found = first_invalid_string(value)
    if found is not None:
        field, text = found
        surrogate = next(c for c in text if not _encodable(c))
        return APIError(
            400,
            f"{field or 'the request body'}: not valid Unicode text (a lone surrogate {surrogate!r}, which UTF-8 "
            "cannot hold)",
            param=field or None,
            code="invalid_value",
        )
    return None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class GuardMiddleware:
    """The API key (401) on every path but PUBLIC_PATHS, the body's size (413), time (408) and
    form (400), and the security headers."""

    def __init__(self, app: ASGIApp, *, max_body_bytes: int, api_key: str | None = None, body_timeout: float = 30.0):
        if api_key is not None and not api_key:
            raise ValueError("api_key: empty (None serves without a key)")
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.api_key = api_key
        self.body_timeout = body_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *SECURITY_HEADERS]}
            await send(message)

        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.api_key is not None and scope["path"] not in PUBLIC_PATHS:
            if not bearer_token_matches(headers.get("authorization"), self.api_key):
                message = (
                    "missing API key (send Authorization: Bearer KEY)"
                    if "authorization" not in headers
                    else "invalid API key"
                )
                await APIError(401, message, code="invalid_api_key").response()(scope, receive, send_with_headers)
                return
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await self._too_large().response()(scope, receive, send_with_headers)
            return
        try:
            body = await asyncio.wait_for(self._read_body(receive), self.body_timeout)
        except TimeoutError:
            error = APIError(
                408,
                f"the request body was not received within {self.body_timeout:g} s",
                code="body_timeout",
                headers={"Connection": "close"},
            )
            await error.response()(scope, receive, send_with_headers)
            return
        except APIError as error:
            await error.response()(scope, receive, send_with_headers)
            return
        if body is None:
            return  # the client left before sending its body
        if scope["method"] == "POST":
            problem = body_problem(body)
            if problem is not None:
                await problem.response()(scope, receive, send_with_headers)
                return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send_with_headers)

    async def _read_body(self, receive: Receive) -> bytes | None:
        """The whole body, so that a chunked upload cannot pass the limit (None: the client left)."""
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                raise self._too_large()
            more = message.get("more_body", False)
        return b"".join(chunks)

    def _too_large(self) -> APIError:
        return APIError(
            413,
            f"the request body is larger than this server's limit of {self.max_body_bytes} bytes",
            code="body_too_large",
        )
