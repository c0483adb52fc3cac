"""Fixtures shared by the unit and the integration tests.

* ``http_server``: ``with http_server(Handler) as url:`` serves ``Handler`` (a
  ``BaseHTTPRequestHandler``) on a free loopback port from a thread; ``url`` is
  ``http://127.0.0.1:<port>``. Shut down and joined on leaving.
* ``closed_port``: ``closed_port()`` is a loopback port nothing listens on (it was free a
  moment ago), for an endpoint that refuses connections.
"""

from __future__ import annotations

import contextlib
import http.server
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import pytest

HttpServer = Callable[[type[http.server.BaseHTTPRequestHandler]], AbstractContextManager[str]]


@contextlib.contextmanager
def _serve(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[str]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def http_server() -> HttpServer:
    return _serve


@pytest.fixture(scope="session")
def closed_port() -> Callable[[], int]:
    return _closed_port
