"""An ASGI app served by uvicorn on 127.0.0.1 in a background thread, for tests that talk HTTP."""
from __future__ import annotations

import contextlib
import socket
import threading
import time


def free_port() -> int:
    """A TCP port nothing listens on at the moment of asking."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(app):
    """``with serving(app) as base: ...`` -> ``"http://127.0.0.1:PORT"``; stopped on exit."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    assert server.started, "the test server did not start within 30 s"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
