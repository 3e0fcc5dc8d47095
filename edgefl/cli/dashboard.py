"""`edgefl dashboard`: the live, read-only web page of one federation (docs/dashboard.md).

It takes the broker, the account and the federation as `edgefl ctl` does (a site file for
the broker URL, CA file and federation; the operator's account from the command line),
serves the page on 127.0.0.1 unless told otherwise, and runs until SIGINT/SIGTERM."""
from __future__ import annotations

import argparse
import sys

from .command import Command

def _dashboard_arguments(parser: argparse.ArgumentParser) -> None:
    from .ctl import add_operator_arguments

    add_operator_arguments(parser, "read the run records")
    parser.add_argument("--host", default="127.0.0.1", metavar="ADDRESS",
                        help="address the page is served on (default 127.0.0.1: this machine "
                             "only; from elsewhere use ssh -L). Any other address lets "
                             "everyone who reaches it read the fleet, with no login")
    # default None: the package's (edgefl.dashboard.DEFAULT_PORT, 8765), not imported here
    # so that `edgefl --help` stays quick
    parser.add_argument("--port", type=int, metavar="N",
                        help="TCP port of the page (default 8765; 0 picks a free one, "
                             "printed at start)")


def _dashboard(args: argparse.Namespace) -> int:
    from ..dashboard import Dashboard, is_loopback
    from ..service.signals import install_stop_handlers
    from .ctl import operator_settings

    if args.port is not None and not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port}: need 0..65535")
    url, options, federation = operator_settings(args, "the dashboard", "read the run records")
    port = {} if args.port is None else {"port": args.port}
    dashboard = Dashboard(url, federation, host=args.host, **port, **options)
    if not is_loopback(args.host):
        print(f"edgefl dashboard: warning: serving on {args.host}, not on this machine only: "
              f"anyone who can reach that address reads the fleet and its runs, with no "
              f"login and no TLS. The default 127.0.0.1 with ssh -L (docs/dashboard.md) keeps "
              f"it private", file=sys.stderr, flush=True)
    # the page's port is bound first: a taken port is reported without waiting for the
    # broker; an unreachable broker is reported naming host:port (both: OSError, one line)
    with dashboard:
        print(f"edgefl dashboard: {dashboard.url} (read-only), federation {federation!r} on "
              f"{dashboard.address}; Ctrl-C stops it", flush=True)
        with install_stop_handlers() as stop:
            while not stop.wait(1.0):        # a timeout: the handler runs between waits
                pass
    print("edgefl dashboard: stopped", flush=True)
    return 0


DASHBOARD = Command(
    "dashboard",
    "serve a live, read-only web page of the federation (fleet, runs, curves, events) on "
    "127.0.0.1",
    _dashboard_arguments, _dashboard)
