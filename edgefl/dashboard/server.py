"""The dashboard's web server and its broker feed.

`DashboardServer` is a stdlib ThreadingHTTPServer with five GET routes:

    /               the page (static/index.html)
    /dashboard.js   its script, /dashboard.css its style (static/, packaged in the wheel)
    /state          the view's snapshot as JSON
    /events         Server-Sent Events: `snapshot` first, then one event per change
                    (node, node_gone, run, run_gone, point, event, broker), and a comment
                    line every KEEPALIVE_S so proxies and the browser see the stream alive

It is read-only: no route changes anything, and any method but GET and HEAD is refused
(405). Bound to a loopback address (the default), it also refuses requests whose Host
header names anything but a loopback name: a web page elsewhere that points its own host
name at 127.0.0.1 (DNS rebinding) cannot read the fleet through the visitor's browser.
Every response forbids framing and sniffing, and the page's Content-Security-Policy allows
its own script and style only. Each connection has its own thread; a request must arrive
whole, and each write of a page's stream be taken, within REQUEST_TIMEOUT_S, or the
connection ends (a slowloris holds no thread for long, and never delays other pages). A
page that falls behind by LISTENER_BACKLOG changes or LISTENER_BACKLOG_BYTES bytes
(dashboard/view.py) is dropped: its stream ends, and the browser reconnects to a snapshot.

`BrokerFeed` subscribes a connected Transport to the federation's status, run record and
event topics and folds every received item into the FleetView until stopped.
"""
from __future__ import annotations

import ipaddress
import logging
import queue
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources

from ..transport.base import CONNECTED, DISCONNECTED, ConnectionEvent, Transport
from ..transport.broker import listen_error
from .view import FleetView, page_json

__all__ = ["DashboardServer", "BrokerFeed", "is_loopback", "ASSETS", "KEEPALIVE_S",
           "REQUEST_TIMEOUT_S"]

log = logging.getLogger("edgefl.dashboard")

KEEPALIVE_S = 15.0
# a request must arrive whole, and a page take each write of its stream, within this: a
# peer that stops half-way (slowloris, a stalled browser) loses its connection and thread
REQUEST_TIMEOUT_S = 30.0
# path -> (file in static/, content type); nothing else is served
ASSETS = {"/": ("index.html", "text/html; charset=utf-8"),
          "/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
          "/dashboard.css": ("dashboard.css", "text/css; charset=utf-8")}
_LOOPBACK_NAMES = ("localhost",)
_SECURITY_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
                               "frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
}


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name) is this machine only: 127.0.0.0/8, ::1,
    localhost."""
    name = host.strip("[]").lower()
    if name in _LOOPBACK_NAMES or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _host_of(header: str) -> str:
    """The host part of a Host header (`[::1]:8765`, `localhost:8765`, `127.0.0.1`)."""
    header = header.strip()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def load_assets() -> dict[str, tuple[bytes, str]]:
    """The page's files from the installed package; an error naming the file when one is
    missing (a wheel built without its package data)."""
    folder = resources.files(__package__) / "static"
    out = {}
    for path, (name, content_type) in ASSETS.items():
        try:
            out[path] = ((folder / name).read_bytes(), content_type)
        except OSError as exc:
            raise FileNotFoundError(f"dashboard asset static/{name} is missing from the "
                                    f"installed edgefl package ({exc}); reinstall edgefl") \
                from None
    return out


class _Handler(BaseHTTPRequestHandler):
    server: "DashboardServer"
    protocol_version = "HTTP/1.1"
    server_version = "edgefl-dashboard"

    def setup(self) -> None:
        # the socket's timeout (StreamRequestHandler.setup applies self.timeout): reading a
        # request and writing to the page; a timed-out request ends its connection
        self.timeout = self.server.request_timeout
        super().setup()

    def log_message(self, fmt, *args) -> None:       # the access log, at debug level
        log.debug("%s %s", self.address_string(), fmt % args)

    def _head(self, status: int, content_type: str, length: int | None,
              extra: dict | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        if length is not None:
            self.send_header("Content-Length", str(length))
        self.send_header("Cache-Control", "no-store")
        for key, value in {**_SECURITY_HEADERS, **(extra or {})}.items():
            self.send_header(key, value)
        self.end_headers()

    def _send(self, status: int, body: bytes, content_type: str, extra=None) -> None:
        self._head(status, content_type, len(body), extra)
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, status: int, text: str, extra=None) -> None:
        self._send(status, (text + "\n").encode(), "text/plain; charset=utf-8", extra)

    def _host_allowed(self) -> bool:
        if not self.server.loopback_only:
            return True
        header = self.headers.get("Host")
        return header is not None and is_loopback(_host_of(header))

    def do_GET(self) -> None:
        if not self._host_allowed():
            self._error(421, f"this dashboard answers only to localhost, not Host "
                             f"{self.headers.get('Host')!r}")
            return
        path = self.path.split("?", 1)[0]
        if path in self.server.assets:
            body, content_type = self.server.assets[path]
            self._send(200, body, content_type)
        elif path == "/state":
            self._send(200, page_json(self.server.view.snapshot()), "application/json")
        elif path == "/events":
            self._stream()
        else:
            self._error(404, f"no such page: {path}")

    do_HEAD = do_GET

    def _refuse(self) -> None:
        self._error(405, "the dashboard is read-only: GET only", {"Allow": "GET, HEAD"})

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _refuse

    def _stream(self) -> None:
        if self.command == "HEAD":
            self._head(200, "text/event-stream", None)
            return
        self._head(200, "text/event-stream", None, {"X-Accel-Buffering": "no"})
        listener, snapshot = self.server.view.listen()
        try:
            # retry: how soon the browser reconnects after the stream ends
            self.wfile.write(b"retry: 2000\n" + _sse("snapshot", page_json(snapshot)))
            self.wfile.flush()
            idle = 0.0
            while not self.server.closing.is_set() and not listener.overflowed:
                try:
                    chunk = _sse(*listener.get(timeout=1.0))
                except queue.Empty:
                    idle += 1.0
                    if idle < KEEPALIVE_S:
                        continue
                    chunk = b": keepalive\n\n"
                idle = 0.0
                self.wfile.write(chunk)
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            pass                # the page was closed
        finally:
            self.server.view.unlisten(listener)
            self.close_connection = True


def _sse(kind: str, data: bytes) -> bytes:
    # one JSON line: data has no newline, so one `data:` field carries it
    return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"


class DashboardServer(ThreadingHTTPServer):
    """The page and its live feed for `view`, on host:port (port 0: a free one; `port`
    then says which). OSError naming the address when the port is taken or the host is
    not this machine's."""

    daemon_threads = True
    block_on_close = False

    def __init__(self, view: FleetView, host: str = "127.0.0.1", port: int = 8765,
                 request_timeout: float = REQUEST_TIMEOUT_S):
        self.view = view
        self.request_timeout = request_timeout
        self.assets = load_assets()
        self.closing = threading.Event()
        self.loopback_only = is_loopback(host)
        if ":" in host:
            self.address_family = socket.AF_INET6
        try:
            super().__init__((host, port), _Handler)
        except OSError as exc:
            raise listen_error(exc, host, port, "dashboard") from None
        self.thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self.server_address[1]

    @property
    def url(self) -> str:
        host = self.server_address[0]
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}/"

    def start(self) -> "DashboardServer":
        self.thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.2},
                                       name="edgefl-dashboard-http", daemon=True)
        self.thread.start()
        return self

    def close(self) -> None:
        """Stop serving; open streams end within a second."""
        self.closing.set()
        if self.thread is not None:
            self.shutdown()
            self.thread.join(5)
        self.server_close()

    def __enter__(self) -> "DashboardServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


class BrokerFeed:
    """The dashboard's subscriptions on a connected `transport` and its receive loop: the
    retained status and run record topics and the event stream of `view`'s federation."""

    def __init__(self, view: FleetView, transport: Transport):
        self.view, self.transport = view, transport
        topics = view.topics
        self.filters = (topics.subscription("status"), topics.subscription("runs"),
                        topics.events())

    def subscribe(self) -> None:
        for topic_filter in self.filters:
            self.transport.subscribe(topic_filter, qos=1)

    def run(self, stop) -> None:
        """Apply every received item to the view until `stop` (an Event) is set."""
        self.view.apply(_connected(self.transport))
        while not stop.is_set():
            item = self.transport.receive(timeout=0.5)
            if item is not None:
                self.view.apply(item)


def _connected(transport: Transport) -> ConnectionEvent:
    # the state at the start: the transport queues events only for later changes
    return ConnectionEvent(CONNECTED if transport.connected else DISCONNECTED, "subscribed")
