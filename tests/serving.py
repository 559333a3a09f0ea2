"""A qtk server in a thread on a free loopback port, for the server tests."""
from __future__ import annotations

import contextlib
import socket
import threading
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(engine, name: str, **app_args):
    """(url, engine) while `qtk serve`'s app over `engine` (an AsyncLLM) runs under uvicorn; the
    server stops and the engine shuts down on exit."""
    import uvicorn

    from qtk.entrypoints.openai.api_server import build_app

    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(build_app(engine, name, **app_args), host="127.0.0.1", port=port,
                                        log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not srv.started and time.time() < deadline:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", engine
    finally:
        srv.should_exit = True
        thread.join(timeout=10)
        engine.shutdown()
