"""API errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every failure a handler can meet becomes an APIError with a status code and a one-line
message; the handlers registered here turn validation errors, malformed JSON and anything
unexpected into the same shape, never with a stack trace or a file path.
"""

from __future__ import annotations

import json
import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("dllm_jax.serve")

# OpenAI's error types by status code
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "cancelled",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class APIError(Exception):
    """A request that fails with `status`; `message` is shown to the client as is (lone
    surrogates escaped); headers: extra response headers (a 429's Retry-After)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = printable(message)
        self.param = None if param is None else printable(param)
        self.code = code
        self.headers = dict(headers or {})

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}
        return JSONResponse(self.body(), status_code=self.status, headers={**headers, **self.headers})


def printable(text: str) -> str:
    """text with lone surrogates written as escapes (\\ud800): they cannot be encoded as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


# pydantic's names of union members and validator steps in an error location (never our fields)
_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "none", "dict", "list", "tuple", "bytes"})
_TAG = re.compile(r"^(function-\w+|constrained-\w+|tagged-union|lax-or-strict|json-or-python|.*\[.*\]|[A-Z]\w*)$")


def _location(loc: tuple) -> str:
    """pydantic's error location as a dotted field path (body.dllm.threshold -> dllm.threshold,
    body.prompt.list[int].0 -> prompt[0])."""
    path = ""
    for p in loc[1:] if loc[:1] == ("body",) else loc:
        if isinstance(p, int):
            path += f"[{p}]"
        elif p in _TYPE_NAMES or _TAG.match(str(p)):
            continue  # union member names, not fields
        else:
            path += f".{p}" if path else str(p)
    return path


def validation_error(exc: RequestValidationError) -> APIError:
    """The first validation problem, naming the field."""
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    if first.get("type") == "json_invalid":
        return APIError(
            400,
            f"the request body is not valid JSON ({first.get('ctx', {}).get('error', 'parse error')})",
            code="invalid_json",
        )
    field = _location(tuple(first.get("loc", ())))
    kind = first.get("type", "")
    msg = first.get("msg", "invalid value").removeprefix("Value error, ")
    if kind == "extra_forbidden":
        return APIError(400, f"unrecognized request argument: {field}", param=field, code="unknown_parameter")
    if kind == "missing":
        return APIError(400, f"missing required field: {field}", param=field, code="missing_required_parameter")
    if not field and kind == "value_error":
        # model validators: the message names the field itself
        return APIError(400, msg, code="invalid_value")
    if kind == "model_attributes_type" or kind == "dict_type":
        return APIError(
            400, f"{field or 'the request body'}: expected a JSON object", param=field or None, code="invalid_type"
        )
    return APIError(400, f"{field}: {msg}", param=field, code="invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    """Routes every exception of a request to an OpenAI-shaped JSON response."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return validation_error(exc).response()

    @app.exception_handler(json.JSONDecodeError)
    async def _bad_json(request: Request, exc: json.JSONDecodeError):
        return APIError(400, f"the request body is not valid JSON ({exc.msg})", code="invalid_json").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        known = {
            404: (f"no route {request.url.path}", "not_found"),
            405: (f"method {request.method} not allowed on {request.url.path}", "method_not_allowed"),
            400: (f"the request body cannot be read ({exc.detail})", "invalid_json"),
        }
        message, code = known.get(exc.status_code, (str(exc.detail), None))
        return APIError(exc.status_code, message, code=code).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unexpected error serving %s", request.url.path)
        return APIError(500, f"internal error ({type(exc).__name__})", code="internal_error").response()
