"""HTTP connections that cannot stall the server: a cap on open connections and a deadline for
a request's headers.

uvicorn hands a request to the app only once its headers are complete, and has no deadline for
them: a client that sends part of its headers and stalls holds its connection open forever, and
enough of them exhaust the file descriptors. `guarded_protocol` is uvicorn's httptools protocol
(the C parser: the event loop's CPU per streamed chunk is 14% under the pure-Python h11
protocol's, and the commit-to-chunk p99 of 32 streams 7-15% lower, on the CPU benchmark
scripts/serve_chunk_latency.py; BENCHMARKS.md) with both limits: a connection beyond
`max_connections` is answered 503 and closed at once, and one whose request headers are not complete `header_timeout` seconds after its first byte (or after
it opened) is answered 408 and closed. (A stalled body is the middleware's: dllm_jax.serve.middleware;
an idle keep-alive connection is uvicorn's timeout_keep_alive.)
"""

from __future__ import annotations

import asyncio
import json

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


def raw_error(status: int, reason: str, message: str, code: str) -> bytes:
    """A complete HTTP/1.1 response in the API's error shape, written before any request exists."""
    body = json.dumps(
        {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
    ).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode("latin-1") + body


def guarded_protocol(*, max_connections: int, header_timeout: float) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol class with the two limits (pass it as uvicorn.Config(http=...))."""

    class GuardedProtocol(HttpToolsProtocol):
        _header_deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                message = f"this server holds at most {max_connections} connections; retry later"
                transport.write(raw_error(503, "Service Unavailable", message, "too_many_connections"))
                transport.close()
                return
            self._await_headers()

        def data_received(self, data: bytes) -> None:
            if self._between_requests():
                self._await_headers()  # a keep-alive connection's next request
            super().data_received(data)
            if not self._between_requests():
                self._stop_waiting()

        def connection_lost(self, exc) -> None:
            self._stop_waiting()
            super().connection_lost(exc)

        def _between_requests(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _await_headers(self) -> None:
            if self._header_deadline is None:
                self._header_deadline = self.loop.call_later(header_timeout, self._headers_late)

        def _stop_waiting(self) -> None:
            if self._header_deadline is not None:
                self._header_deadline.cancel()
                self._header_deadline = None

        def _headers_late(self) -> None:
            self._header_deadline = None
            if self._between_requests() and not self.transport.is_closing():
                message = f"the request headers were not received within {header_timeout:g} s"
                self.transport.write(raw_error(408, "Request Timeout", message, "header_timeout"))
                self.transport.close()

    return GuardedProtocol
