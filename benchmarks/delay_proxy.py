"""An HTTP proxy that delays every request by a fixed time: object-storage latency in front
of a local S3 endpoint (moto), for benchmarks. It counts requests by method.

    proxy = DelayProxy("http://127.0.0.1:5000", delay_s=0.02).start()
    ... endpoint_url=proxy.url ...
    proxy.stop()
"""

from __future__ import annotations

import http.client
import threading
import time
import urllib.parse
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class DelayProxy:
    """Forwards each request to ``target`` after ``delay_s`` (one connection per thread)."""

    def __init__(self, target: str, delay_s: float) -> None:
        self.target = urllib.parse.urlsplit(target)
        self.delay_s = delay_s
        self.requests: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._local = threading.local()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def _forward(self) -> None:
                proxy._count(self.command)
                time.sleep(proxy.delay_s)
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                status, reply_headers, data = proxy._send(self.command, self.path, body, headers)
                self.send_response(status)
                for name, value in reply_headers:
                    if name.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> DelayProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _count(self, method: str) -> None:
        with self._lock:
            self.requests[method] += 1

    def _send(
        self, method: str, path: str, body: bytes | None, headers: dict[str, str]
    ) -> tuple[int, list[tuple[str, str]], bytes]:
        connection = getattr(self._local, "connection", None)
        if connection is None:
            connection = http.client.HTTPConnection(self.target.hostname, self.target.port)
            self._local.connection = connection
        try:
            connection.request(method, path, body=body, headers=headers)
            response = connection.getresponse()
        except (http.client.HTTPException, OSError):
            connection.close()
            connection = http.client.HTTPConnection(self.target.hostname, self.target.port)
            self._local.connection = connection
            connection.request(method, path, body=body, headers=headers)
            response = connection.getresponse()
        data = response.read()
        return response.status, response.getheaders(), data
