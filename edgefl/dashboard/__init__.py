"""`edgefl dashboard`: a read-only web page of one federation, live (docs/dashboard.md).

    view = FleetView(Topics("lab"))               # what the page shows, folded from MQTT
    with DashboardServer(view, "127.0.0.1", 8765) as server:   # the page and its SSE feed
        feed = BrokerFeed(view, transport)        # subscribes, applies every message
        feed.run(stop)

    view.py      FleetView: the fleet (retained status topics), the runs (retained run
                 records, and the events where no record exists), per-round curves and the
                 event stream, folded from the messages; every change is handed to the
                 listeners (the open pages) as one small document
    server.py    DashboardServer: a stdlib ThreadingHTTPServer serving the page, its assets
                 (static/, packaged in the wheel), a JSON snapshot and the Server-Sent Events
                 stream; GET only. BrokerFeed: the subscriptions and the receive loop.

The dashboard never publishes: it subscribes to `status/+`, `runs/+` and `events` of the
federation (docs/protocol.md), which the broker's ACL lets the operator account read.
"""
from .server import BrokerFeed, DashboardServer, is_loopback
from .view import FleetView

__all__ = ["BrokerFeed", "DashboardServer", "FleetView", "is_loopback"]
