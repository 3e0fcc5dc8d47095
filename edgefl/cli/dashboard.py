"""`edgefl dashboard`: the live, read-only web page of one federation (docs/dashboard.md).

It takes the broker, the account and the federation as `edgefl ctl` does (a site file for
the broker URL, CA file and federation; the operator's account from the command line),
serves the page on 127.0.0.1 unless told otherwise, and runs until SIGINT/SIGTERM."""
from __future__ import annotations

import argparse
import sys

from .command import Command

DEFAULT_PORT = 8765


def _dashboard_arguments(parser: argparse.ArgumentParser) -> None:
    from .ctl import add_operator_arguments

    add_operator_arguments(parser, "read the run records")
    parser.add_argument("--host", default="127.0.0.1", metavar="ADDRESS",
                        help="address the page is served on (default 127.0.0.1: this machine "
                             "only; from elsewhere use ssh -L). Any other address lets "
                             "everyone who reaches it read the fleet, with no login")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, metavar="N",
                        help=f"TCP port of the page (default {DEFAULT_PORT}; 0 picks a free "
                             "one, printed at start)")


def _dashboard(args: argparse.Namespace) -> int:
    import os

    from ..dashboard import BrokerFeed, DashboardServer, FleetView, is_loopback
    from ..service.signals import install_stop_handlers
    from ..transport.mqtt import MqttTransport, parse_broker_url
    from ..transport.topics import Topics
    from .ctl import operator_settings

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port}: need 0..65535")
    url, options, federation = operator_settings(args, "the dashboard", "read the run records")
    address = parse_broker_url(url)
    view = FleetView(Topics(federation), broker=str(address))
    # the page first: a taken port is reported without waiting for the broker
    server = DashboardServer(view, args.host, args.port)
    transport = None
    try:
        if not is_loopback(args.host):
            print(f"edgefl dashboard: warning: serving on {args.host}, not on this machine "
                  f"only: anyone who can reach port {server.port} reads the fleet and its "
                  f"runs, with no login and no TLS. The default 127.0.0.1 with ssh -L "
                  f"(docs/dashboard.md) keeps it private", file=sys.stderr, flush=True)
        client_id = f"edgefl-dashboard-{os.getpid()}-{os.urandom(3).hex()}"
        # a clean session: the page shows what is retained and what happens from now on
        transport = MqttTransport(url, client_id, clean_session=True, **options)
        transport.connect()
        feed = BrokerFeed(view, transport)
        feed.subscribe()
        server.start()
        print(f"edgefl dashboard: {server.url} (read-only), federation {federation!r} on "
              f"{address}; Ctrl-C stops it", flush=True)
        with install_stop_handlers() as stop:
            feed.run(stop)
    finally:
        server.close()
        if transport is not None:
            transport.close(timeout=2.0, announce_offline=False)
    print("edgefl dashboard: stopped", flush=True)
    return 0


DASHBOARD = Command(
    "dashboard",
    "serve a live, read-only web page of the federation (fleet, runs, curves, events) on "
    "127.0.0.1",
    _dashboard_arguments, _dashboard)
