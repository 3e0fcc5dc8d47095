"""`edgefl fleet up / status / down`: a fleet on one machine (edgefl.fleet): an
access-controlled broker, the aggregator service and N client services as background
processes, with the files a real deployment uses."""
from __future__ import annotations

import argparse
import sys

from .command import Command, seconds

FLEET_ACTIONS = ("up", "status", "down")


def _fleet_arguments(parser: argparse.ArgumentParser) -> None:
    from ..fleet import DEFAULT_CLIENTS, DEFAULT_DIR, DEFAULT_FEDERATION

    parser.add_argument("action", choices=FLEET_ACTIONS,
                        help="up: write the files and start the fleet (or start the fleet "
                             "DIR holds again); status: its processes and nodes; down: stop "
                             "it with SIGTERM, keeping every file")
    parser.add_argument("--dir", default=DEFAULT_DIR, metavar="DIR",
                        help=f"the fleet's directory (default ./{DEFAULT_DIR})")
    parser.add_argument("--clients", type=int, metavar="N",
                        help=f"up: number of client services (default {DEFAULT_CLIENTS})")
    parser.add_argument("--federation", metavar="ID",
                        help=f"up: the federation id (default {DEFAULT_FEDERATION})")
    parser.add_argument("--timeout", type=seconds, metavar="SECONDS",
                        help="up: longest wait for every node to be online (default 180); "
                             "down: for each process to stop after SIGTERM (default 30)")
    # The dashboard (`edgefl dashboard`) joins here: a --dashboard flag that passes
    # edgefl.fleet.FleetService("dashboard", [..."dashboard", "--config", aggregator.yaml,
    # "--username", "operator", "--password-file", ...]) to up(extra_services=...); `down`
    # and `status` then treat it as every other process of the fleet.


def _fleet(args: argparse.Namespace) -> int:
    from .. import fleet as fleet_module
    from ..service.status import format_fleet

    if args.action != "up" and (args.clients is not None or args.federation is not None):
        raise ValueError(f"fleet {args.action}: --clients and --federation are for `up`")
    try:
        if args.action == "up":
            options = {} if args.timeout is None else {"ready_timeout": args.timeout}
            fleet = fleet_module.up(args.dir, args.clients, args.federation,
                                    say=lambda text: print(text, flush=True), **options)
            kind = ("mosquitto, accounts bound to client ids" if fleet.broker == "mosquitto"
                    else "embedded, no access control")
            print(f"fleet up: broker ({kind}) on {fleet.url}, aggregator and "
                  f"{len(fleet.clients)} clients ({', '.join(fleet.clients)}) online in "
                  f"federation {fleet.federation}; files in {fleet.directory}, logs in "
                  f"{fleet.path('logs')}")
            print("next:", fleet.ctl_command("start", fleet.path("digits.yaml")), flush=True)
            print(f"stop it: {fleet_module.fleet_command('down', args.dir)}", flush=True)
            return 0
        if args.action == "down":
            options = {} if args.timeout is None else {"timeout": args.timeout}
            stopped = fleet_module.down(args.dir, say=lambda text: print(text, flush=True),
                                        **options)
            if not stopped:
                print(f"fleet down: nothing is running in {args.dir}")
            else:
                print(f"fleet down: stopped {', '.join(stopped)}; files kept in {args.dir} "
                      f"(`{fleet_module.fleet_command('up', args.dir)}` starts the same "
                      f"fleet again)")
            return 0
        fleet, alive, statuses = fleet_module.fleet_status(args.dir)
    except fleet_module.FleetError as exc:
        print(f"edgefl fleet {args.action}: error: {exc}", file=sys.stderr)
        return 1
    print(f"fleet in {fleet.directory}: federation {fleet.federation}, {fleet.broker} broker "
          f"on {fleet.url}")
    width = max(len(n) for n in alive) if alive else 7
    print(f"{'process':<{width}}  {'pid':>7}  state")
    for name, is_alive in alive.items():
        print(f"{name:<{width}}  {fleet.processes[name]['pid']:>7}  "
              f"{'running' if is_alive else 'stopped'}")
    if statuses is None:
        print("the broker is not running: no node statuses")
    else:
        print(format_fleet([statuses[n] for n in sorted(statuses)]))
    return 0 if alive and all(alive.values()) else 1


FLEET = Command(
    "fleet",
    "a fleet on one machine: `up` starts an access-controlled broker, the aggregator and N "
    "clients as background processes with their files in --dir; `status`; `down`",
    _fleet_arguments, _fleet)
