"""Two levels: edge aggregators over bridged brokers (docs/scaling.md "Two levels").

A site (a building, a farm, a vehicle depot) runs its own Mosquitto, bridged to the central
broker by Mosquitto's bridge (broker/bridge-site.conf), and an edge aggregator beside it.
The site's boards talk only to the site broker; only one partial aggregate per site and
round crosses the bridge up, and one announcement and one model frame per round come down.

    centre = CentralAggregator(plan, transport, state_dir, settings, sites=sites)
    edge = EdgeAggregator(plan, site_transport, state_dir, settings, edge_id="site-a",
                          site=("client-0", "client-1", ...))

The centre (`CentralAggregator`) runs the round engine for every client of the federation,
as the flat aggregator does: selection, tasks, the announcement (on `round`, every task)
and the model (once, on `model`). Its uploaders are the edges, not the clients: an edge is
expected in a round when one of its site's clients may upload, and its upload is a partial
sum. The round closes as a flat round does (all edges in, quorum, the missing edges
offline, deadline) and `RoundEngine.sum_partials` adds the partial sums in sorted edge order
before `close_round_from_sum` takes the server step: the path of a DP round, so only the
strategies whose server step needs only the weighted sum (`Strategy.secure_sum`) run in two
levels, and `edge_refusal` says why the others cannot.

The edge (`EdgeAggregator`) reads the centre's announcement and model through the bridge
(the centre's topics under the local prefix `up_prefix`, default "central"), builds its
site's tasks from them exactly as a board does (`messages.task_from_announcement`), and runs
a local round for its site's tasked clients with the Aggregator's own machinery: its own
announcement and model frames on the site's topics (signed with its own key if it has one),
the same update checks and closing rules, a deadline before the centre's. It then turns each
update into its contribution (`rounds.client_contribution`), sums them (`sum_clear`, sorted
client order) and forwards the SumTotal as one update frame on the centre's
`update/<edge>` topic: buffers `sum0`, `sum1`, ... (the vector cut into model-sized parts),
num_samples the summed weight, steps the summed local steps, and the strategy scalars
{"edge": {"weight", "count", "scalars", "clients"}}.

Restarts: the frame is written atomically to `<state_dir>/partial.frame` before it is
published and journalled in `edge.jsonl`. Killed while collecting, the edge re-opens the
central round (still retained through the bridge) with a new announcement id; its clients
re-send the update they stored, each at most once into the new sum. Killed after forwarding,
it re-sends the stored frame, the same bytes and message id, whenever the centre announces
that round again; the centre keeps the first copy of an edge's upload (a duplicate). So no
client's update is lost or counted twice. Killed between storing the frame and journalling
it, it journals the stored round at its next start (marked recovered). The centre's own
checkpoint and journal are the flat aggregator's.
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
from typing import Mapping, Sequence

import numpy as np

from ..attacks import Attacked
from ..privacy import NO_HOOKS
from ..rounds import RoundPlan, UploadTotals, client_contribution, LOSS_SCALARS
from ..strategies import StrategyError, SumTotal, Update
from ..transport import wire
from ..transport.base import Message
from ..transport.signing import SignatureError
from ..transport.topics import TopicError, Topics, validate_id
from .aggregator import Aggregator, _OpenRound
from .messages import (MessageError, buffers_sha256, finished_announcement,
                       parse_announcement, parse_status, status_payload,
                       task_from_announcement, update_scalars)
from .state import (StateError, append_journal, atomic_write, read_journal, read_json,
                    tag_floats, untag_floats, write_json)

__all__ = ["CentralAggregator", "EdgeAggregator", "edge_refusal", "partial_update",
           "partial_total", "load_sites", "UP_PREFIX", "PARTIAL_FILE", "EDGE_JOURNAL",
           "CENTRE_SIGNED_FILE", "STATE_FILES"]

log = logging.getLogger("edgefl.roles.edge")

UP_PREFIX = "central"              # the local prefix the site bridge maps the centre under
PARTIAL_FILE = "partial.frame"     # the last partial aggregate the edge forwarded
EDGE_JOURNAL = "edge.jsonl"
CENTRE_SIGNED_FILE = "centre-signed.json"   # the newest centre announcement's signing time
# what an edge replaces atomically in its state directory (hold_state_dir removes what its
# writers killed mid-write left; the journal is appended to)
STATE_FILES = (PARTIAL_FILE, CENTRE_SIGNED_FILE)


def edge_refusal(strategy, *, robust=None, privacy=None, attack=None) -> str | None:
    """Why a run of `strategy` cannot run over edge aggregators, or None when it can.

    An edge forwards one weighted sum of its clients' contributions, so the centre's server
    step must need only that sum: the strategies with `secure_sum` (the notion secure
    aggregation uses). Robust aggregation ranks each update, which the sum hides; secure
    aggregation and DP are not carried over two levels in this version."""
    robust = getattr(strategy, "robust", None) if robust is None else robust
    if attack or isinstance(strategy, Attacked):   # first: the wrapper hides what it wraps
        return ("the attack simulation (attack:) tampers with individual updates, which "
                "the centre of a two-level run never sees; run it flat")
    if not getattr(strategy, "secure_sum", False):
        why = getattr(strategy, "secure_sum_refusal", "") or \
            "its server step reads each client's update, not only their weighted sum"
        return (f"strategy {strategy.name!r} cannot run over edge aggregators: {why}; an "
                f"edge forwards only the weighted sum of its clients' updates")
    if robust:
        rule = robust.get("rule", "mean") if isinstance(robust, Mapping) else robust
        return (f"strategy {strategy.name!r} with robust aggregation (rule {rule!r}) cannot "
                f"run over edge aggregators: it ranks or trims the individual updates, and "
                f"the centre sees only each edge's weighted sum; drop strategy.robust or the "
                f"edges")
    names = _privacy_in(privacy)
    if names:
        return (f"{' and '.join(names)} cannot run over edge aggregators in this version: "
                + "; ".join(f"{n}: {_PRIVACY_OVER_EDGES[n]}" for n in names)
                + "; run it flat (one aggregator)")
    return None


# why each privacy setting is refused over edges (edge_refusal)
_PRIVACY_OVER_EDGES = {
    "secure aggregation": "its masks cancel in one aggregator's sum, so each edge would see "
                          "its site's sum unmasked (a sum of fewer boards than the flat "
                          "run's) and forward it to the centre in the clear",
    "differential privacy": "its noise and its privacy accounting are calibrated to one "
                            "aggregator's sum of the clipped updates, not to an edge's sum "
                            "forwarded to another",
}


def _privacy_in(privacy) -> list:
    """The privacy settings named in `privacy`: a config's `privacy:` section
    (privacy.settings.Privacy), a sequence of names, or None."""
    if privacy is None:
        return []
    if isinstance(privacy, (list, tuple)):
        return list(privacy)
    return [name for name, on in (("secure aggregation", privacy.secure_aggregation),
                                  ("differential privacy", privacy.dp)) if on is not None]


def _plan_privacy(plan) -> list:
    """The privacy settings a RunPlan runs with (edge_refusal's names)."""
    return [name for name, on in (("secure aggregation", plan.secure is not None),
                                  ("differential privacy", plan.hooks is not NO_HOOKS)) if on]


def load_sites(path: str | os.PathLike) -> dict:
    """{edge id: (client node ids, ...)} from a sites file (YAML or JSON), e.g.

        site-a: [client-0, client-1]
        site-b: [client-2, client-3]

    ValueError naming the file and the entry that is wrong."""
    import yaml

    from ..config import load_yaml

    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as fh:
            doc = load_yaml(fh)
    except OSError as exc:
        raise ValueError(f"sites file {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:     # the decoder's own message names no file
        raise ValueError(f"sites file {path}: not UTF-8 text (byte "
                         f"0x{exc.object[exc.start]:02x} at offset {exc.start})") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"sites file {path}: not YAML: {exc}") from None
    if not isinstance(doc, dict) or not doc:
        raise ValueError(f"sites file {path}: need a mapping of edge id -> list of client "
                         f"ids, got {type(doc).__name__}")
    sites = {}
    for edge, nodes in doc.items():
        try:
            validate_id(str(edge), "edge id")
        except TopicError as exc:
            raise ValueError(f"sites file {path}: {exc}") from None
        if not isinstance(nodes, list) or not nodes \
                or not all(isinstance(n, str) for n in nodes):
            raise ValueError(f"sites file {path}: {edge}: need a non-empty list of client "
                             f"ids, got {nodes!r}")
        sites[str(edge)] = tuple(nodes)
    return sites


# ---------------------------------------------------------------------------------------
# the partial aggregate on the wire
# ---------------------------------------------------------------------------------------

def _parts(vector: np.ndarray, n_params: int) -> dict:
    if vector.size % n_params:
        raise StrategyError(f"partial sum of {vector.size} values is not a whole number of "
                            f"model-sized buffers ({n_params} values each)")
    return {f"sum{i}": vector[i * n_params:(i + 1) * n_params]
            for i in range(vector.size // n_params)}


def partial_update(total: SumTotal, n_params: int, clients: Sequence[str]) -> Update:
    """The Update an edge forwards for `total`, the sum of its clients' contributions."""
    steps = total.scalars.get(LOSS_SCALARS[1], 0.0)
    loss = total.scalars.get(LOSS_SCALARS[0], math.nan) / steps if steps > 0 else math.nan
    weight = total.weight
    if weight != int(weight):
        raise StrategyError(f"partial sum weight {weight} is not a whole number")
    edge = {"weight": int(weight), "count": int(total.count),
            "scalars": tag_floats(dict(total.scalars)), "clients": list(clients)}
    return Update(_parts(np.ascontiguousarray(total.vector, np.float32), n_params),
                  int(weight), loss, int(steps), {"edge": edge})


def partial_total(update: Update) -> SumTotal:
    """The SumTotal an edge's upload carries (partial_update's inverse). StrategyError
    naming what is missing when it is not a partial aggregate."""
    edge = update.scalars.get("edge")
    if not isinstance(edge, Mapping):
        raise StrategyError("not a partial aggregate: its strategy scalars have no 'edge' "
                            f"entry (got {sorted(update.scalars)})")
    names = [f"sum{i}" for i in range(len(update.buffers))]
    if sorted(update.buffers) != sorted(names):
        raise StrategyError(f"partial aggregate buffers {sorted(update.buffers)}: expected "
                            f"{names}")
    for key, kind in (("weight", int), ("count", int), ("scalars", Mapping)):
        if not isinstance(edge.get(key), kind) or isinstance(edge.get(key), bool):
            raise StrategyError(f"partial aggregate: edge.{key} = {edge.get(key)!r} must be "
                                f"{kind.__name__}")
    scalars = untag_floats(dict(edge["scalars"]))
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool)
               for v in scalars.values()):
        raise StrategyError(f"partial aggregate: edge.scalars {scalars} must be numbers")
    vector = np.concatenate([update.buffers[n] for n in names]) if len(names) > 1 \
        else update.buffers[names[0]]
    return SumTotal(vector, edge["weight"], scalars, edge["count"])


# ---------------------------------------------------------------------------------------
# the centre
# ---------------------------------------------------------------------------------------

class CentralAggregator(Aggregator):
    """The Aggregator of a two-level federation: its rounds are the flat aggregator's
    (checkpoint, journal, announcement, model, closing rules) with the edges as uploaders
    (module docstring). `sites`: {edge id: the node ids of its clients}; every client of the
    plan is in exactly one site."""

    def __init__(self, plan, transport, state_dir, settings, *, sites: Mapping, **kwargs):
        why = edge_refusal(plan.strategy, privacy=_plan_privacy(plan))
        if why is not None:
            raise StrategyError(why)
        super().__init__(plan, transport, state_dir, settings, **kwargs)
        self.sites = {validate_id(e, "edge id"): tuple(nodes) for e, nodes in sites.items()}
        self.site_of: dict = {}
        for edge, nodes in sorted(self.sites.items()):
            if edge in self.members:
                raise ValueError(f"edge id {edge!r} is also a client id")
            for node in nodes:
                if node not in self.members:
                    raise ValueError(f"site {edge!r}: {node!r} is not a client of this run")
                if node in self.site_of:
                    raise ValueError(f"client {node!r} is in two sites: "
                                     f"{self.site_of[node]!r} and {edge!r}")
                self.site_of[node] = edge
        missing = [n for n in plan.client_ids if n not in self.site_of]
        if missing:
            raise ValueError(f"clients {missing[:5]} are in no site ({len(missing)} of "
                             f"{len(plan.client_ids)})")
        self.senders = {e: i for i, e in enumerate(sorted(self.sites))}
        self.sender_kind = "edge"

    def _model_to_each(self, o) -> bool:
        return False                  # one model frame a round, once through each bridge

    def _announced_sha(self, node: str) -> str | None:
        """The model an edge's partial was computed from: the round's global model (edges
        relay no per-client models), checked against the partial's 'base' as a board's."""
        o = self.open
        if node not in o.uploaders:
            return None
        downlink = o.downlinks.get("global")
        return downlink.sha if downlink is not None else None

    def _upload_refusal(self, node: str) -> str | None:
        o = self.open
        if node in o.uploaders:
            return None
        return f"round {o.round}: edge {node!r} has no client that may upload this round"

    def _on_update(self, node: str, payload: bytes) -> None:
        """The base class's checks of the frame, then the partial aggregate's own against
        the edge's site (`_partial_refusal`): a refused one is not counted, the round does
        not wait for that edge again (its stored copy, re-sent, is a duplicate), and the
        other edges' partials close the round."""
        o = self.open
        before = node in o.received
        super()._on_update(node, payload)
        if before or node not in o.received:
            return
        why = self._partial_refusal(node, o.received[node])
        if why is not None:
            del o.received[node]
            o.train_s.pop(node, None)
            o.refused.add(node)
            self._reject(node, f"round {o.round}: {why}")

    def _partial_refusal(self, edge: str, update: Update) -> str | None:
        """Why `update`, `edge`'s upload in the open round, is not a partial aggregate of
        its site's clients for this round, or None. The sum itself (its vector and the
        strategy's scalars) is checked by the strategy when the round closes."""
        try:
            total = partial_total(update)
        except StrategyError as exc:
            return str(exc)
        o, doc = self.open, update.scalars["edge"]
        ids = self.plan.client_ids
        may = sorted(ids[c] for c in o.round_plan.uploaders if self.site_of[ids[c]] == edge)
        weight, count, clients = doc["weight"], doc["count"], doc.get("clients")
        if weight <= 0:
            return f"partial aggregate: edge.weight = {weight} must be > 0"
        if weight != update.num_samples:
            return (f"partial aggregate: edge.weight = {weight} is not the frame's "
                    f"num_samples ({update.num_samples})")
        if not 1 <= count <= len(may):
            return (f"partial aggregate: edge.count = {count}, but site {edge!r} has "
                    f"{len(may)} clients that may upload in round {o.round}"
                    if count > len(may) else
                    f"partial aggregate: edge.count = {count} must be >= 1")
        if getattr(self.plan.strategy, "weighting", None) == "uniform" and weight != count:
            return (f"partial aggregate: edge.weight = {weight} is not edge.count = {count} "
                    f"(weighting uniform: each client weighs 1)")
        if not isinstance(clients, list) or not all(isinstance(n, str) for n in clients):
            return f"partial aggregate: edge.clients = {clients!r} must be a list of client ids"
        if len(clients) != count:
            return (f"partial aggregate: edge.clients lists {len(clients)} client(s), "
                    f"edge.count = {count}")
        for i, node in enumerate(clients):
            if node in clients[:i]:
                return f"partial aggregate: edge.clients lists {node} twice"
            if self.site_of.get(node) != edge:
                return (f"partial aggregate: edge.clients names {node}, not a client of "
                        f"site {edge!r} ({', '.join(self.sites[edge])})")
            if node not in may:
                return (f"partial aggregate: edge.clients names {node}, which may not "
                        f"upload in round {o.round}")
        for name, value in sorted(total.scalars.items()):
            if name != LOSS_SCALARS[0] and not math.isfinite(value):
                # the loss is only reported; a client's own NaN loss is kept as in a flat run
                return f"partial aggregate: edge.scalars[{name!r}] = {value} is not finite"
        return None

    def _on_status(self, node: str, payload: bytes) -> None:
        super()._on_status(node, payload)
        o = self.open
        if o is None or node not in self.senders or not payload:
            return
        try:
            doc = parse_status(payload, node)
        except MessageError:
            return
        glob = o.downlinks.get("global")
        if doc.get("need_model") == o.round and glob is not None:
            now = time.monotonic()
            if now - o.last_resend.get(node, -math.inf) >= self.settings.resend_interval_s:
                o.last_resend[node] = now
                self._cleared.discard(glob.topic)
                self._publish_downlink(glob)
                o.counts["resends"] += 1
                log.info("round %d: model published again (edge %s asked)", o.round, node)

    def _run_round(self, r: int) -> bool:
        state, ids = self.ckpt.state, self.plan.client_ids
        round_plan = self.engine.open_round(r, state)
        self.open = o = _OpenRound(round_plan,
                                   {ids[c]: t for c, t in round_plan.tasks.items()},
                                   {self.site_of[ids[c]] for c in round_plan.uploaders})
        self._announce()
        closed_by = self._collect()
        if closed_by is None:
            log.info("round %d abandoned: stop requested; the checkpoint of round %d stands",
                     r, self.ckpt.round)
            return False
        partials = {}
        for edge, update in sorted(o.received.items()):
            try:
                partials[edge] = partial_total(update)
            except StrategyError as exc:
                self._reject(edge, f"round {r}: {exc}")
                o.refused.add(edge)
        if not partials:
            raise StrategyError(f"round {r}: closed by {closed_by} without a usable partial "
                                f"aggregate")
        def close():
            total = self.engine.sum_partials(partials, r)
            nbytes = sum(o.received[e].nbytes for e in partials)
            clients = sorted(n for e in partials
                             for n in o.received[e].scalars["edge"].get("clients", ()))
            return self.engine.close_round_from_sum(
                round_plan, total, UploadTotals.of_sum(total, nbytes), state,
                train_wall_s=max(o.train_s.values(), default=0.0),
                elapsed_before=self.ckpt.elapsed_s,
                extras=lambda: {"closed_by": closed_by, "updates": total.count,
                                "edges": sorted(partials),
                                "missing": sorted(o.uploaders - set(partials)),
                                "clients": clients, **o.counts})

        try:
            closed = close()
        except StrategyError as exc:
            self._drop_unusable(partials, r, state, exc)
            closed = close()
        self._commit(r, closed.state, closed.record)
        return True

    def _drop_unusable(self, partials: dict, r: int, state, exc: StrategyError) -> None:
        """The sum of `partials` failed with `exc` (a partial of another size or other
        scalars than the strategy's): each is tried alone, as the flat aggregator tries each
        update (`RoundEngine.aggregate`'s on_unusable), and the ones the strategy's server
        step cannot use are refused, naming the edge, and deleted from `partials`. None or
        all of them unusable: `exc` is raised again, naming the round."""
        bad = {}
        for edge in sorted(partials):
            try:
                self.plan.strategy.aggregate_sum(
                    r, self.engine.sum_partials({edge: partials[edge]}, r), state)
            except StrategyError as single:
                bad[edge] = single
        if not bad or len(bad) == len(partials):
            raise StrategyError(f"round {r}: the partial aggregates cannot be aggregated: "
                                f"{exc}") from exc
        for edge, why in bad.items():
            self._reject(edge, f"round {r}: the strategy cannot use its partial aggregate: "
                               f"{why}")
            del partials[edge]
            self.open.refused.add(edge)


# ---------------------------------------------------------------------------------------
# the edge
# ---------------------------------------------------------------------------------------

class _EdgeState:
    """What the Aggregator base reads as its checkpoint: the centre's run id and the last
    round this edge forwarded."""

    def __init__(self, run_id: str | None = None, round: int = 0):
        self.run_id, self.round = run_id, round
        self.elapsed_s, self.history = 0.0, []


class EdgeAggregator(Aggregator):
    """The aggregator of one site (module docstring): follows the centre's rounds through
    the bridge, serves the site's clients as an aggregator does, forwards one partial sum a
    round. `plan` is the run's RunPlan (the same config as the centre's: strategy, model,
    client ids); `site`: the node ids of this site's clients. `transport` connects to the
    site broker. `margin_s`: how long before the centre's deadline the local round closes
    (default a tenth of the time left, at most 5 s). `centre_keys`: a
    transport.signing.Verifier of the centre's announcements and model frames (its public
    key under "*"), or None: they are not checked. The edge signs what it publishes with
    its own key (settings.trust), as an aggregator does."""

    def __init__(self, plan, transport, state_dir, settings, *, edge_id: str,
                 site: Sequence[str], up_prefix: str = UP_PREFIX,
                 margin_s: float | None = None, centre_keys=None, **kwargs):
        why = edge_refusal(plan.strategy, privacy=_plan_privacy(plan))
        if why is not None:
            raise StrategyError(why)
        plan = _without_test(plan)
        super().__init__(plan, transport, state_dir,
                         _replace(settings, node_id=validate_id(edge_id, "edge id")), **kwargs)
        self.edge_id = edge_id
        unknown = [n for n in site if n not in self.members]
        if unknown:
            raise ValueError(f"edge {edge_id!r}: site clients {unknown[:5]} are not clients "
                             f"of this run")
        if not site:
            raise ValueError(f"edge {edge_id!r}: a site needs at least one client")
        self.senders = {n: self.members[n] for n in site}
        self.up = Topics(settings.federation, f"{up_prefix}/{settings.prefix}")
        self.margin_s = margin_s
        self.centre_keys = centre_keys
        self._centre_signed_at = -math.inf      # the newest centre announcement's signing time
        self.ckpt = _EdgeState()
        self.central: dict | None = None          # the centre's last announcement
        self.central_model: dict = {}             # message id -> (round, sender, buffers)
        self.superseded = False                   # a newer central announcement arrived
        self.down = wire.Reassembler(60.0, max_bytes=max(64 << 20,
                                                         8 * plan.model.n_params + (1 << 20)))
        self.resent_for: str | None = None        # central announce id we re-sent for
        self.forwarded = 0
        self.model_asked = -math.inf

    # ------------------------------------------------------------------ files
    @property
    def partial_path(self) -> str:
        return os.path.join(self.state_dir, PARTIAL_FILE)

    @property
    def edge_journal(self) -> str:
        return os.path.join(self.state_dir, EDGE_JOURNAL)

    @property
    def centre_signed_path(self) -> str:
        return os.path.join(self.state_dir, CENTRE_SIGNED_FILE)

    def _load_centre_signed_at(self) -> float:
        """The signing time of the newest centre announcement this edge took before it was
        (re)started, -inf when none; StateError naming the file when it cannot be read."""
        try:
            doc = read_json(self.centre_signed_path)
        except FileNotFoundError:
            return -math.inf
        at = doc.get("at") if isinstance(doc, dict) else None
        if isinstance(at, bool) or not isinstance(at, (int, float)) or not math.isfinite(at):
            raise StateError(f"{self.centre_signed_path}: 'at' = {str(at)[:40]!r} is not a "
                             f"signing time (seconds since the epoch); remove the file to "
                             f"take the centre's next announcement as the newest")
        return float(at)

    def _save_centre_signed_at(self, at: float, run: str) -> None:
        # on every newer announcement, not only a new run's as a board does: a board's
        # progress file refuses an earlier round after a restart, the edge's stored partial
        # names only the last round it forwarded, not those it closed with nothing to send
        try:
            write_json(self.centre_signed_path, {"at": at, "run": run})
        except OSError as exc:
            log.warning("edge %s: the signing time of the centre's announcement was not "
                        "stored (%s): after a restart, an older one replayed would be taken",
                        self.edge_id, exc)

    def _stored_partial(self) -> tuple | None:
        """(run, round, frame bytes, decoded frame) of the stored partial aggregate, or
        None."""
        try:
            with open(self.partial_path, "rb") as fh:
                data = fh.read()
        except FileNotFoundError:
            return None
        try:
            frame = wire.decode(data, wire.Expectation(self.table, kinds="update",
                                                       topic_sender=self.edge_id))
        except wire.FrameError as exc:
            raise StateError(f"{self.partial_path}: not this edge's partial aggregate: "
                             f"{exc.reason}; remove it to start over") from None
        return frame.scalars.get("run"), frame.round, data, frame

    def _journal_stored(self, run: str, r: int, frame) -> None:
        """A crash between storing the partial aggregate and journalling it leaves a round
        forwarded (or about to be: the restart re-sends it) that edge.jsonl does not list:
        append its line now, marked recovered, from the stored frame, so the journal lists
        every forwarded round once (as the aggregator's _reconcile_journal does)."""
        if any(rec.get("event") == "forwarded" and rec.get("run") == run
               and rec.get("round") == r for rec in read_journal(self.edge_journal)):
            return
        edge = (frame.scalars.get("strategy") or {}).get("edge") or {}
        append_journal(self.edge_journal, {
            "event": "forwarded", "run": run, "round": r, "clients": edge.get("clients"),
            "weight": edge.get("weight"), "recovered": True,
            "sum_sha256": buffers_sha256(frame.buffers), "at": time.time()})

    # ------------------------------------------------------------------ run
    def run(self):
        os.makedirs(self.state_dir, exist_ok=True)
        # before the first announcement: an older one replayed after a restart is refused
        self._centre_signed_at = self._load_centre_signed_at()
        stored = self._stored_partial()
        if stored is not None:
            self.ckpt = _EdgeState(stored[0], stored[1])
            self._journal_stored(stored[0], stored[1], stored[3])
        self._connect()
        t = self.transport
        for topic in (self.up.round(), self.up.model(), self.up.client_model(self.edge_id)):
            t.subscribe(topic, qos=1)
        log.info("edge %s: %d site clients, following the centre on %s", self.edge_id,
                 len(self.senders), self.up.base)
        if self.centre_keys is None:      # as a board without keys.aggregator says
            log.info("edge %s: signatures off: the centre's announcements and models are "
                     "taken unsigned (give --centre-key to require the centre's)", self.edge_id)
        finished = False
        try:
            while not self.stop.is_set():
                doc = self._wait_central()
                if doc is None:
                    break
                if doc.get("finished"):
                    self._finish_site(doc)
                    finished = True
                    break
                self._follow(doc)
        finally:
            self.open = None
            self._close()
        return finished

    def _wait_central(self) -> dict | None:
        """The centre's announcement to act on next: a round this edge has not forwarded
        (with its model here), a repeat of one it has (re-sent here), or the end."""
        while not self.stop.is_set():
            doc = self.central
            if doc is not None:
                if doc.get("finished"):
                    if doc["run"] == self.ckpt.run_id:
                        return doc
                    if self.resent_for != doc["announce"]:     # once per announcement
                        self.resent_for = doc["announce"]
                        log.info("edge %s: the centre's last run (%s) is finished; waiting "
                                 "for the next one", self.edge_id, doc["run"])
                    self._service(self.settings.poll_s)
                    continue
                if self.ckpt.run_id == doc["run"] and doc["round"] <= self.ckpt.round:
                    # looked at once per announcement: the file changes only when this
                    # edge forwards, and a model of megabytes is not decoded at every poll
                    if self.resent_for != doc["announce"]:
                        self.resent_for = doc["announce"]
                        stored = self._stored_partial()
                        if stored is not None and stored[:2] == (doc["run"], doc["round"]):
                            self._publish_partial(stored[2], doc["round"], resend=True)
                elif self._site_nodes(doc) and self._model_for(doc) is not None:
                    return doc
                elif self._site_nodes(doc) and time.monotonic() - self.model_asked > 5.0:
                    self.model_asked = time.monotonic()
                    self._ask_model(doc)
            self._service(self.settings.poll_s)
        return None

    def _site_nodes(self, doc) -> list:
        return sorted(n for n in doc["tasks"] if n in self.senders)

    def _model_for(self, doc) -> dict | None:
        """The buffers of the centre's model announced in `doc`, or None (not here yet)."""
        if doc.get("model_sha256") is None:
            return {}
        want = doc.get("model_frame")
        for mid, (r, sender, run, buffers) in list(self.central_model.items()):
            if r != doc["round"] or sender != doc["aggregator"] or run != doc["run"]:
                continue
            if (want is not None and int(want, 16) == mid) or \
                    buffers_sha256(buffers) == doc["model_sha256"]:
                return buffers
        return None

    def _ask_model(self, doc) -> None:
        self._publish_status_doc(need_model=doc["round"])

    def _publish_status_doc(self, **extra) -> None:
        payload = status_payload(self.edge_id, "edge", True, profile=self.settings.profile,
                                 last_round=self.ckpt.round, run=self.ckpt.run_id, **extra)
        try:
            self.transport.publish(self.topics.status(self.edge_id), payload, qos=1,
                                   retain=True)
        except Exception as exc:          # noqa: BLE001 -- a status is best effort
            log.debug("status not published: %s", exc)

    # ------------------------------------------------------------------ one round
    def _follow(self, doc) -> None:
        """Run the local round of the centre's round `doc` and forward its partial sum."""
        r, nodes = doc["round"], self._site_nodes(doc)
        if doc["strategy"]["name"] != self.plan.strategy.name \
                or doc["model"]["table"] != self.table.digest:
            raise StateError(f"edge {self.edge_id}: the centre runs {doc['strategy']['name']!r} "
                             f"with layer table {doc['model']['table'][:12]}, this edge's run "
                             f"config {self.plan.strategy.name!r} with "
                             f"{self.table.digest[:12]}: start it with the centre's config")
        # the edge weights and measures its clients' contributions with its own strategy:
        # a parameter that differs from the centre's (weighting: samples against uniform)
        # would make the centre's model another one than its config says, silently
        mine = json.loads(json.dumps(tag_floats(self.plan.strategy.hyperparameters())))
        theirs = doc["strategy"]["params"]
        if mine != theirs:
            keys = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
            raise StateError(f"edge {self.edge_id}: the centre runs {doc['strategy']['name']!r} "
                             f"with " + ", ".join(f"strategy.{k} = {theirs.get(k)!r}"
                                                  for k in keys)
                             + ", this edge's run config with " + ", ".join(
                                 f"strategy.{k} = {mine.get(k)!r}" for k in keys)
                             + ": start it with the centre's config")
        if self.ckpt.run_id != doc["run"]:
            log.info("edge %s: following run %s", self.edge_id, doc["run"])
            self.ckpt = _EdgeState(doc["run"], 0)
        buffers = self._model_for(doc)
        tasks, node_tasks = {}, {}
        for node in nodes:
            try:
                task = task_from_announcement(doc, node, buffers)
            except MessageError as exc:
                raise StateError(f"edge {self.edge_id}: the centre's round {r}: {exc}") \
                    from None
            if task.source != "global":
                raise StateError(f"edge {self.edge_id}: round {r} gives {node} a model of "
                                 f"its own (source {task.source!r}), which edges do not relay")
            tasks[doc["tasks"][node]["client"]] = task
            node_tasks[node] = task
        uploaders = frozenset(c for c, t in tasks.items() if t.upload)
        plan = RoundPlan(r, tuple(sorted(uploaders)), tasks, uploaders, time.perf_counter())
        self.open = o = _OpenRound(plan, node_tasks,
                                   {n for n, t in node_tasks.items() if t.upload})
        self.superseded = False
        self._announce(deadline=self._local_deadline(doc))
        closed_by = self._collect()
        if closed_by is None or closed_by == "superseded":
            if closed_by == "superseded":
                log.info("edge %s: round %d superseded by the centre's announcement of round "
                         "%d before it closed here (%d of %d updates in)", self.edge_id, r,
                         self.central["round"] if self.central else -1, len(o.received),
                         len(o.uploaders))
            self.open = None
            return
        if not o.received:
            log.info("edge %s: round %d closed (%s) with no update to forward", self.edge_id,
                     r, closed_by)
            self.ckpt.round = r
            self.open = None
            return
        contributions = {}
        for node, update in sorted(o.received.items()):
            c = self.members[node]
            try:
                contributions[c] = client_contribution(self.plan.strategy, tasks[c], update)
            except (StrategyError, ValueError) as exc:
                self._refuse_unusable(c, StrategyError(str(exc)))
        if not contributions:
            # each refused, named (_refuse_unusable): this round is done here, as one
            # closed without updates (following it again would announce it anew, and the
            # boards re-send the same updates, until the centre moved on)
            log.warning("edge %s: round %d closed (%s) with no usable update to forward",
                        self.edge_id, r, closed_by)
            self.ckpt.round = r
            self.open = None
            return
        total = self.engine.sum_clear(contributions, r)
        clients = [self.plan.client_ids[c] for c in sorted(contributions)]
        update = partial_update(total, self.plan.model.n_params, clients)
        # 'base': the centre's model this sum was computed from, as a board names its own
        # (a run id names one run only while the centre's state lasts)
        data = wire.encode("update", r, self.edge_id, update.buffers,
                           update_scalars(update, doc["run"],
                                          max(o.train_s.values(), default=0.0),
                                          base=doc.get("model_sha256")),
                           self.table, "none",
                           sign=self.signer.frame_signer(doc["run"]) if self.signer else None)
        atomic_write(self.partial_path, data)         # before it leaves: a restart re-sends it
        self.ckpt.round = r
        self.resent_for = doc["announce"]
        append_journal(self.edge_journal, {
            "event": "forwarded", "run": doc["run"], "round": r, "clients": clients,
            "weight": update.num_samples, "closed_by": closed_by,
            "missing": sorted(o.uploaders - set(o.received)),
            "sum_sha256": buffers_sha256(update.buffers), "at": time.time()})
        self._publish_partial(data, r)
        self.open = None

    def _publish_partial(self, data: bytes, r: int, resend: bool = False) -> None:
        for payload in wire.split(data, self.settings.max_payload):
            self.transport.publish(self.up.update(self.edge_id), payload, qos=1)
        self.forwarded += 1
        log.info("edge %s: round %d partial aggregate %s (%d bytes)", self.edge_id, r,
                 "re-sent" if resend else "forwarded", len(data))
        self._publish_status()

    def _finish_site(self, doc) -> None:
        if self.ckpt.run_id != doc["run"]:
            self.ckpt = _EdgeState(doc["run"], self.ckpt.round)
        fin = finished_announcement(run_id=doc["run"], aggregator=self.edge_id,
                                    rounds=doc["rounds"], model_sha256=doc["model_sha256"])
        if self.signer is not None:
            fin = self.signer.sign_doc(fin, "finished", doc["run"], doc["rounds"])
        self.transport.publish(self.topics.round(), json.dumps(fin).encode(), qos=1,
                               retain=True)
        for topic in sorted(self._retained):
            self.transport.clear_retained(topic)
        self.transport.flush(10.0)
        log.info("edge %s: run %s finished at the centre (model sha256 %s)", self.edge_id,
                 doc["run"], doc["model_sha256"])

    # ------------------------------------------------------------------ overrides
    def _strategy_record(self) -> dict:
        if self.central is not None and "strategy" in self.central:
            return untag_floats(dict(self.central["strategy"]))
        return super()._strategy_record()

    def _model_to_each(self, o) -> bool:
        tasked = sum(1 for t in o.node_tasks.values() if t.source == "global")
        return 0 < 4 * tasked <= len(self.senders)

    def _close_reason(self) -> str | None:
        if self.superseded:
            return "superseded"
        return super()._close_reason()

    def _handle(self, item) -> None:
        if isinstance(item, Message) and item.topic.startswith(self.up.base + "/"):
            try:
                kind, node = self.up.parse(item.topic)
            except TopicError as exc:
                self._reject(None, f"message from the centre on an unexpected topic: {exc}")
                return
            if kind == "round":
                self._on_central_round(item.payload)
            elif kind in ("model", "client_model"):
                self._on_central_model(kind, node, item.payload)
            return
        super()._handle(item)

    def _on_central_round(self, payload: bytes) -> None:
        if not payload:
            return
        try:
            doc = parse_announcement(payload)
        except MessageError as exc:
            log.warning("edge %s: ignored the centre's announcement: %s", self.edge_id, exc)
            return
        if self.centre_keys is not None and not self._signed_by_centre(doc):
            return
        old = self.central
        self.central = doc
        if old is None or doc["announce"] != old.get("announce"):
            self.model_asked = time.monotonic()     # its model is likely on its way
        o = self.open
        if o is not None and (doc.get("finished") or doc["run"] != self.ckpt.run_id
                              or doc["round"] != o.round):
            self.superseded = True
        elif o is not None and old is not None and doc["announce"] != old.get("announce"):
            # the centre announced the open round again (restarted, or paused and resumed):
            # keep collecting, within its new deadline
            o.deadline = self._local_deadline(doc)
            log.info("edge %s: the centre announced round %d again; it closes here in %.0f s",
                     self.edge_id, o.round, o.deadline - time.time())

    def _local_deadline(self, doc) -> float:
        """When the local round of the centre's announcement `doc` closes: `margin_s` before
        the centre's deadline (so the partial sum is in before it), at least a second from
        now, at most round_timeout_s."""
        now = time.time()
        left = doc["deadline"] - now
        margin = self.margin_s if self.margin_s is not None else min(5.0, max(0.0, left) / 10)
        return min(now + self.settings.round_timeout_s, max(now + 1.0, doc["deadline"] - margin))

    def _signed_by_centre(self, doc) -> bool:
        """Whether `doc` is the centre's, signed for this federation, its run and round, and
        not older than the newest one this edge followed (a replay)."""
        kind = "finished" if doc.get("finished") is True else "announce"
        try:
            env = self.centre_keys.verify_doc(doc, kind=kind, where="the centre's announcement",
                                              run=doc["run"], round=doc["round"],
                                              by=doc["aggregator"])
        except SignatureError as exc:
            self._reject(None, f"{exc}; ignored")
            return False
        if env["at"] < self._centre_signed_at:
            self._reject(None, f"the centre's announcement of run {doc['run']} round "
                               f"{doc['round']}: signed at {env['at']:.3f}, before the one "
                               f"this edge follows ({self._centre_signed_at:.3f}, kept in "
                               f"{self.centre_signed_path}): a replay; ignored")
            return False
        if env["at"] > self._centre_signed_at:
            self._centre_signed_at = env["at"]
            self._save_centre_signed_at(env["at"], doc["run"])
        return True

    def _on_central_model(self, kind: str, node, payload: bytes) -> None:
        if not payload:
            return
        if kind == "client_model" and node != self.edge_id:
            return
        expect = wire.Expectation(self.table, kinds=kind,
                                  **({"topic_recipient": node} if node else {}))
        try:
            frame = self.down.add(payload, expect)
        except wire.FrameError as exc:
            log.warning("edge %s: ignored a model frame from the centre: [%s] %s",
                        self.edge_id, exc.code, exc.reason)
            return
        if frame is None:
            return
        run = frame.scalars.get("run")
        if self.centre_keys is not None:
            try:
                run = self.centre_keys.verify_frame(
                    frame, where=f"the centre's {kind} frame of round {frame.round}",
                    by=frame.sender)["run"]
            except SignatureError as exc:
                self._reject(None, f"{exc}; ignored")
                return
        # keep the models of the last two rounds (a re-announcement may name either)
        self.central_model[frame.message_id] = (frame.round, frame.sender, run,
                                                dict(frame.buffers))
        newest = max(v[0] for v in self.central_model.values())
        for mid in [m for m, v in self.central_model.items() if v[0] < newest - 1]:
            del self.central_model[mid]


def _without_test(plan):
    """The plan without its test set: an edge evaluates nothing."""
    import dataclasses
    return dataclasses.replace(plan, test=None)


def _replace(settings, **changes):
    import dataclasses
    return dataclasses.replace(settings, **changes)

