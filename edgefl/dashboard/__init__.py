"""`edgefl dashboard`: a read-only web page of one federation, live (docs/dashboard.md).

    with Dashboard("mqtt://gw:1883", "lab", username="operator",
                   password_file="op.pw") as dashboard:     # 127.0.0.1:8765 by default
        print(dashboard.url)
        stop.wait()

    view.py      FleetView: the fleet (retained status topics), the runs (retained run
                 records, and the events where no record exists), per-round curves and the
                 event stream, folded from the messages; every change is handed to the
                 listeners (the open pages) as one small document
    app.py       Dashboard: the page and its broker feed as one object (the CLI's)
    server.py    DashboardServer: a stdlib ThreadingHTTPServer serving the page, its assets
                 (static/, packaged in the wheel), a JSON snapshot and the Server-Sent Events
                 stream; GET only. BrokerFeed: the subscriptions and the receive loop.

The dashboard never publishes: it subscribes to `status/+`, `runs/+` and `events` of the
federation (docs/protocol.md), which the broker's ACL lets the operator account read.
"""
from .app import DEFAULT_PORT, Dashboard
from .server import BrokerFeed, DashboardServer, is_loopback
from .view import FleetView

__all__ = ["BrokerFeed", "Dashboard", "DashboardServer", "DEFAULT_PORT", "FleetView",
           "is_loopback"]
