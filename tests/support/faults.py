"""A reverse proxy in front of a real S3 server that misbehaves on purpose: 503s, 500s, 403s,
truncated or corrupted bodies, dropped connections, requests held without an answer, bodies
sent a byte at a time."""

from __future__ import annotations

import http.client
import threading
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ERROR_XML = (
    '<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{msg}</Message>'
    "<RequestId>fault</RequestId></Error>"
)
STATUS = {
    "503": (503, "SlowDown", "Please reduce your request rate."),
    "500": (500, "InternalError", "We encountered an internal error."),
    "403": (403, "AccessDenied", "Access Denied"),
    "badkey": (
        403,
        "InvalidAccessKeyId",
        "The AWS Access Key Id you provided does not exist in our records.",
    ),
}


@dataclass
class Rule:
    """Apply ``action`` to the next ``times`` requests whose path contains ``match``."""

    match: str
    action: str  # 503 | 500 | 403 | badkey | truncate | corrupt | drop | hold | trickle | half
    times: int = 1_000_000
    method: str = "GET"
    hits: int = 0


@dataclass
class FaultProxy:
    """``hold`` answers nothing until :attr:`release` is set, then passes the request on;
    :attr:`held` records (method, path) of each request it held. ``trickle`` sends a body one
    byte every 50 ms until :attr:`release` is set, then the rest at once; ``half`` sends the first
    half of a body, then the rest once :attr:`release` is set."""

    upstream: str
    rules: list[Rule] = field(default_factory=list)
    tls: tuple[str, str] | None = None  # (certificate, key): serve https, as a TLS-terminating proxy

    def __post_init__(self) -> None:
        up = urllib.parse.urlparse(self.upstream)
        self._up = (up.hostname, up.port)
        self._lock = threading.Lock()
        self.release = threading.Event()
        self.held: list[tuple[str, str]] = []
        #: (method, path, headers with lower-case names) of every request, as it arrived.
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self._held_changed = threading.Condition(self._lock)
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _handle(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with proxy._lock:
                    proxy.requests.append(
                        (self.command, self.path, {k.lower(): v for k, v in self.headers.items()})
                    )
                action = proxy._match(self.command, urllib.parse.unquote(self.path))
                if action == "hold":
                    with proxy._held_changed:
                        proxy.held.append((self.command, self.path))
                        proxy._held_changed.notify_all()
                    proxy.release.wait()
                if action == "drop":
                    self.close_connection = True
                    self.connection.close()
                    return
                if action in STATUS:
                    status, code, msg = STATUS[action]
                    data = ERROR_XML.format(code=code, msg=msg).encode()
                    self.send_response(status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                    return
                conn = http.client.HTTPConnection(*proxy._up, timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                headers["Host"] = f"{proxy._up[0]}:{proxy._up[1]}"
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                conn.close()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in (
                        "transfer-encoding",
                        "connection",
                        "content-length",
                        "server",
                        "date",
                    ):
                        self.send_header(k, v)
                length = resp.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(data)))  # a HEAD's: the object's
                self.end_headers()
                if self.command == "HEAD":
                    return
                if action == "truncate" and len(data) > 1:
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                if action == "corrupt" and data:
                    data = bytes([data[0] ^ 0xFF]) + data[1:]
                if action == "half":  # the first half of the body, the rest once released
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    proxy.release.wait()
                    data = data[len(data) // 2 :]
                if action == "trickle":
                    sent = 0
                    while sent < len(data) - 1 and not proxy.release.wait(0.05):
                        self.wfile.write(data[sent : sent + 1])
                        self.wfile.flush()
                        sent += 1
                    data = data[sent:]
                self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        scheme = "http"
        if self.tls is not None:
            import ssl

            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(*self.tls)
            self.server.socket = ctx.wrap_socket(self.server.socket, server_side=True)
            scheme = "https"
        self.endpoint = f"{scheme}://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def _match(self, method: str, path: str) -> str:
        with self._lock:
            for r in self.rules:
                if r.hits < r.times and r.match in path and (r.method == "*" or r.method == method):
                    r.hits += 1
                    return r.action
        return ""

    def wait_held(self, match: str, count: int, timeout: float) -> bool:
        """Wait until ``count`` requests whose path contains ``match`` have been held."""
        with self._held_changed:
            return self._held_changed.wait_for(
                lambda: sum(match in path for _, path in self.held) >= count, timeout
            )

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
