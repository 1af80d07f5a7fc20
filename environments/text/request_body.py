"""The HTTP servers' shared guards (the retrieval server, ``ragen_jax.serve``): a request body read
with a size bound, and a deadline on the request head.

The bound holds whether the body declares its size (``Content-Length``: refused before a byte is
read) or streams it (chunked: refused as soon as the running count passes it). The body's arrival
time is bounded by the caller (``asyncio.wait_for(read_body(...), timeout)`` -> 408).
"""
from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class BodyTooLarge(Exception):
    """A body over the server's limit: answer 413 with this message."""

    status = 413


async def read_body(request, max_bytes: int) -> bytes:
    """The body of a Starlette ``request``, or ``BodyTooLarge`` past ``max_bytes``."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise BodyTooLarge(f"the body ({declared} bytes) is over the server's limit of {max_bytes} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise BodyTooLarge(f"the body is over the server's limit of {max_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


class HeadTimeoutH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline on the request head: a connection that has not
    sent a complete request line and headers ``timeout_keep_alive`` seconds after it opened (or after
    its last response) is closed, however slowly it trickles bytes. uvicorn alone waits forever for a
    first request, and restarts its idle timer on every byte."""

    _head_timer: asyncio.TimerHandle | None = None

    def _cancel_head_timer(self):
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _arm_head_timer(self):
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def connection_made(self, transport):
        super().connection_made(transport)
        self._arm_head_timer()

    def data_received(self, data: bytes):
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the head is complete: the app's body timeout takes over
            self._cancel_head_timer()

    def on_response_complete(self):
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm_head_timer()

    def connection_lost(self, exc):
        self._cancel_head_timer()
        super().connection_lost(exc)
