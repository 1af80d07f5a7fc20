"""A request body read with a size bound: the HTTP servers' shared guard (the retrieval server,
``ragen_jax.serve``).

The bound holds whether the body declares its size (``Content-Length``: refused before a byte is
read) or streams it (chunked: refused as soon as the running count passes it).
"""
from __future__ import annotations


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
