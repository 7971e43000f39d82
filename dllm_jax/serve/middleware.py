"""ASGI middleware: the request body size limit and the Bearer API key."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dllm_jax.serve.errors import APIError
from dllm_jax.serve.playground import PLAYGROUND_PATHS

# paths served without an API key (the playground's files hold no data)
PUBLIC_PATHS = frozenset({"/health"}) | PLAYGROUND_PATHS


def bearer_token_matches(header: str | None, api_key: str) -> bool:
    """True when the Authorization header is "Bearer <api_key>" (constant-time compare)."""
    if not header:
        return False
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(token.strip().encode(), api_key.encode())


class GuardMiddleware:
    """Rejects bodies over `max_body_bytes` (413) and, with an api_key, requests without the
    right Bearer token (401) on every path but PUBLIC_PATHS."""

    def __init__(self, app: ASGIApp, *, max_body_bytes: int, api_key: str | None = None):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.api_key is not None and scope["path"] not in PUBLIC_PATHS:
            if not bearer_token_matches(headers.get("authorization"), self.api_key):
                message = (
                    "missing API key (send Authorization: Bearer KEY)"
                    if "authorization" not in headers
                    else "invalid API key"
                )
                await APIError(401, message, code="invalid_api_key").response()(scope, receive, send)
                return
        limit = self.max_body_bytes
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await self._too_large(scope, receive, send)
            return
        # the body is read here (it is small JSON) so that a chunked upload cannot pass the limit
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                break  # the client left before sending its body
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                await self._too_large(scope, receive, send)
                return
            more = message.get("more_body", False)
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = APIError(
            413,
            f"the request body is larger than this server's limit of {self.max_body_bytes} bytes",
            code="body_too_large",
        )
        await error.response()(scope, receive, send)
