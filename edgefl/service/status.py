"""The fleet table `edgefl status` prints from the retained status topics.

Each node publishes a retained JSON object on `edgefl/<fed>/status/<node>` (its Last Will
sets `online` to false). The MQTT side collects them; this module only formats:

    {"node": "pi-07", "online": true, "version": "0.1.0", "profile": "rpi4",
     "last_round": 12, "role": "client"}

`role` is optional. A missing field prints as "-", so a node running an older edgefl that
does not send every field still gets its row. Nodes of an edgefl with signatures also send
"key" (the fingerprint of the key they sign with, absent when they sign nothing) and
"signatures" ("on": they check what they receive; "off"); when any node has a key or
checks, the table has the columns `key` and `checks`.

Every field is what a node chose to publish, and one board may be in hostile hands:
`edgefl.io.terminal_text` is the one way a node's text reaches the operator's terminal (this
table, `edgefl ctl` and `ctl watch`, the aggregator's log): control characters (escape sequences that retitle, clear or
recolour the terminal, a bell, a carriage return) and invisible format characters (a
right-to-left override) are printed as escapes, \x1b, \u202e, so the operator sees what was
sent and the terminal obeys none of it.
"""
from __future__ import annotations

import re

from ..io import terminal_text

__all__ = ["FLEET_COLUMNS", "format_fleet", "collect_statuses"]

FLEET_COLUMNS = ("node", "online", "version", "profile", "last round")


def _natural_key(node: str):
    # pi-2 before pi-10
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", node)]


_MAX_CELL = 64                  # characters of one cell of the table


def _cell(value) -> str:
    if value is None or value == "":
        return "-"
    # one line, escaped, and no cell wider than _MAX_CELL (a node sends what it likes)
    return terminal_text(str(value).replace("\t", " "), _MAX_CELL, one_line=True)


def _online(value) -> str:
    if value is True:
        return "yes"
    if value is False:
        return "no"
    return "?"


def format_fleet(statuses: list[dict]) -> str:
    """A table of nodes (online ones first, then by node name in natural order) and a summary
    line, e.g.

        node   online  version  profile  last round
        pi-2   yes     0.1.0    rpi4     12
        pi-10  no      0.1.0    rpi3     11
        2 nodes: 1 online, 1 offline
    """
    if not statuses:
        return "no nodes have published a status"
    for i, status in enumerate(statuses):
        if not isinstance(status, dict):
            raise TypeError(f"format_fleet: status {i} is {type(status).__name__}, not a dict")
    has_role = any(s.get("role") for s in statuses)
    # a fleet without keys keeps the table it always had
    has_keys = any(s.get("signatures") == "on" or s.get("key") for s in statuses)
    header = ("node",) + (("role",) if has_role else ()) + FLEET_COLUMNS[1:] \
        + (("key", "checks") if has_keys else ())
    rows = []
    for s in sorted(statuses, key=lambda s: (s.get("online") is not True,
                                            _natural_key(_cell(s.get("node"))))):
        row = [_cell(s.get("node"))]
        if has_role:
            row.append(_cell(s.get("role")))
        row += [_online(s.get("online")), _cell(s.get("version")), _cell(s.get("profile")),
                _cell(s.get("last_round"))]
        if has_keys:
            row += [_cell(s.get("key")), _cell(s.get("signatures"))]
        rows.append(row)
    widths = [max(len(r[i]) for r in [list(header)] + rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip()
             for r in [list(header)] + rows]
    online = sum(1 for s in statuses if s.get("online") is True)
    offline = sum(1 for s in statuses if s.get("online") is False)
    unknown = len(statuses) - online - offline
    plural = "s" if len(statuses) != 1 else ""
    summary = f"{len(statuses)} node{plural}: {online} online, {offline} offline"
    if unknown:
        summary += f", {unknown} unknown"
    return "\n".join(lines + [summary])


def collect_statuses(transport, federation: str, wait: float = 2.0, warn=None) -> dict:
    """{node: status} of every node of `federation` that has a retained status on the broker
    of `transport` (connected, not yet subscribed): what `edgefl status` and `edgefl fleet
    status` print. Retained messages come in a burst right after the subscription, so the
    collection ends 0.3 s after the last one (at most `wait` seconds). warn(text): told of a
    status that does not parse (skipped)."""
    import time

    from ..roles.messages import MessageError, parse_status
    from ..transport.base import Message
    from ..transport.topics import Topics

    topics = Topics(federation)
    statuses = {}
    transport.subscribe(topics.subscription("status"), qos=1)
    end = time.monotonic() + max(0.0, wait)
    quiet_until = time.monotonic() + min(0.5, wait)
    while time.monotonic() < min(end, quiet_until):
        item = transport.receive(timeout=max(0.0, min(end, quiet_until) - time.monotonic()))
        if not isinstance(item, Message) or not item.payload:
            continue
        quiet_until = time.monotonic() + 0.3      # retained ones come in a burst
        try:
            _, node = topics.parse(item.topic)
            statuses[node] = parse_status(item.payload, node)
        except (MessageError, ValueError) as exc:
            if warn is not None:
                warn(f"ignored {item.topic}: {exc}")
    return statuses
