"""`Dashboard`: the page and its broker feed as one object, for the CLI and for anything
that wants a dashboard beside a fleet it runs (a fleet on one machine, a test).

    with Dashboard("mqtt://127.0.0.1:1883", "lab", port=0, username="operator",
                   password_file="op.pw") as dashboard:
        print(dashboard.url)          # http://127.0.0.1:<port>/
        stop.wait()

start() binds the page's port first (an error naming the port when it is taken), then
connects to the broker (an error naming host:port when it cannot be reached); either way
nothing is left open when it fails.
"""
from __future__ import annotations

import os
import threading

from ..transport.mqtt import MqttTransport, parse_broker_url
from ..transport.topics import Topics
from .server import BrokerFeed, DashboardServer
from .view import FleetView

__all__ = ["Dashboard", "DEFAULT_PORT"]

DEFAULT_PORT = 8765


class Dashboard:
    """The dashboard of `federation` on the broker at `broker_url`, served on host:port.
    `transport_options`: MqttTransport's (username, password_file, ca_file, cert_file,
    key_file, ...)."""

    def __init__(self, broker_url: str, federation: str, *, host: str = "127.0.0.1",
                 port: int = DEFAULT_PORT, **transport_options):
        self.address = parse_broker_url(broker_url)     # ValueError naming a bad URL now
        self.broker_url = broker_url
        self.view = FleetView(Topics(federation), broker=str(self.address))
        self.host, self.port_asked = host, port
        self.transport_options = transport_options
        self.server: DashboardServer | None = None
        self.transport: MqttTransport | None = None
        self._stop = threading.Event()
        self._feed_thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return self.server.url if self.server is not None else ""

    @property
    def port(self) -> int | None:
        return self.server.port if self.server is not None else None

    def start(self) -> "Dashboard":
        self.server = DashboardServer(self.view, self.host, self.port_asked)
        try:
            client_id = f"edgefl-dashboard-{os.getpid()}-{os.urandom(3).hex()}"
            # a clean session: the page shows what is retained and what happens from now on
            self.transport = MqttTransport(self.broker_url, client_id, clean_session=True,
                                           **self.transport_options)
            self.transport.connect()
            feed = BrokerFeed(self.view, self.transport)
            feed.subscribe()
        except BaseException:
            self.close()
            raise
        self._feed_thread = threading.Thread(target=feed.run, args=(self._stop,),
                                             name="edgefl-dashboard-feed", daemon=True)
        self._feed_thread.start()
        self.server.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._feed_thread is not None:
            self._feed_thread.join(5)
        if self.server is not None:
            self.server.close()
        if self.transport is not None:
            self.transport.close(timeout=2.0, announce_offline=False)
            self.transport = None

    def __enter__(self) -> "Dashboard":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
