"""Cancel a request handler when its client hangs up.

A streamed response notices a hang-up itself (its next write fails, or Starlette's disconnect
listener ends it), but a non-streaming handler just awaits the engine: without this it would
run to max_tokens for nobody. Cancelling the handler runs its ``finally`` blocks, which abort
the engine requests (openai_api.py).
"""
from __future__ import annotations

import asyncio
from typing import Awaitable, TypeVar

from fastapi import Request
from fastapi.responses import Response

T = TypeVar("T")

# nginx's "client closed request": nobody reads it, but it is what the access log shows
CLIENT_CLOSED_REQUEST = 499


async def _until_disconnect(request: Request) -> None:
    # the body has been read by now, so the next message the server sends is the disconnect
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def cancel_on_disconnect(request: Request, handler: Awaitable[T]) -> T | Response:
    """``await handler``, unless the client disconnects first: then cancel it (waiting for its
    clean-up) and return a 499 response."""
    work = asyncio.ensure_future(handler)
    watcher = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not work.done():                 # the client left (or we are cancelled ourselves)
            work.cancel()
        watcher.cancel()
        await asyncio.gather(work, watcher, return_exceptions=True)
    if work.cancelled():
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return work.result()
