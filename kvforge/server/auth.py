"""``--api-key``: every path but the open ones needs ``Authorization: Bearer KEY``.

A plain ASGI middleware (not Starlette's BaseHTTPMiddleware, which relays every message of a
request through its own task group): it looks at the headers once and passes ``receive`` and
``send`` through untouched, so handlers see the client's disconnect directly.
"""
from __future__ import annotations

import secrets

from starlette.types import ASGIApp, Receive, Scope, Send

from kvforge.server.errors import OpenAIError, error_response


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str, open_paths: set[str]) -> None:
        if not api_key:
            raise ValueError("api_key must be non-empty")
        self.app = app
        self.expected = b"Bearer " + api_key.encode("utf-8")
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            # constant time: the comparison does not tell how much of a guess was right
            if not secrets.compare_digest(given, self.expected):
                response = error_response(OpenAIError(
                    401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                    code="invalid_api_key"))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
