"""The aggregator service's log, signed: its events (`events`) and its run records
(retained on `runs/<id>`), and their checks (docs/protocol.md section 11, *Events and run
records*).

An aggregator with a signing key (keys.signing_key) signs every event with kind "event"
and every run record with kind "run_record" (transport/signing.py's envelope, its own
Signer): the envelope's hash covers the whole document, so an event cannot be altered into
another one (a `round_closed` into a `run_finished`), and its kind keeps an event from
passing for a record, a reply or an announcement, and the other way round. The envelope
binds the federation, and the run: an event's `run` (or "" for an event of no run), a
record's `id`. Neither expires: an event is a log line, and a record is retained to be read
later. What a replay can still do is bounded by the reader:

- an event: `edgefl ctl watch` refuses one signed before it began listening (`not_before`):
  events are not retained, so a genuine one reaches a watch only as it happens, and an old
  one (say an earlier run's `run_finished`) is a replay. Its clock and the aggregator's may
  differ: watch takes the aggregator's time from the signed status reply it starts from
  (less REPLAY_MARGIN_S, the reply's way back and what was in flight), else its own less
  MAX_SKEW_S;
- a record: a replay of an older genuine record of the same run shows an older state of it
  (queued, running, fewer rounds). A run's records only move on to an end that is never
  left, so a replayed one never ends a watch in a way the run did not end; `ctl status` and
  `ctl runs`, signed replies valid 60 s, are the current state. A record of an earlier run
  of the same id (the service's state wiped, the id given again) is told apart by its
  `created`, which the reader takes from those replies (check_record).

A reader holding the aggregator's public key (roles.trust.aggregator_verifier) checks each
with check_event / check_record: SignatureError naming the topic and the cause, and, for
an unsigned one, that an aggregator without keys.signing_key or older than signed events
does not sign them.
"""
from __future__ import annotations

import json
import math
from typing import Mapping

from ..io import jsonable
from ..transport.signing import MAX_SKEW_S, SignatureError

__all__ = ["EVENT_KIND", "RECORD_KIND", "REPLAY_MARGIN_S", "signed_event", "signed_record",
           "check_event", "check_record", "events_not_before"]

EVENT_KIND = "event"
RECORD_KIND = "run_record"
# how long before the aggregator signed the status reply a watch starts from an event may
# have been signed and still be one the watch subscribed in time for: the request's way
# there and back, and what the broker had in flight
REPLAY_MARGIN_S = 10.0
_UNSIGNED = (" (an aggregator without keys.signing_key, or one older than signed events "
             "and run records, does not sign them)")


def _as_sent(doc: Mapping) -> dict:
    # signed as a reader will parse it: NumPy values as numbers, NaN as null, tuples as lists
    return json.loads(json.dumps(jsonable(dict(doc)), separators=(",", ":")))


def signed_event(doc: Mapping, signer) -> dict:
    """The event document `doc` as published: signed (kind "event", its run) by the
    aggregator's transport.signing.Signer, or as it is when `signer` is None."""
    doc = _as_sent(doc)
    if signer is None:
        return doc
    return signer.sign_doc(doc, EVENT_KIND, str(doc.get("run") or ""), 0)


def signed_record(record: Mapping, signer) -> dict:
    """The public run record `record` as published on runs/<id>: signed (kind
    "run_record", its id), or as it is when `signer` is None."""
    record = _as_sent(record)
    if signer is None:
        return record
    return signer.sign_doc(record, RECORD_KIND, str(record["id"]), 0)


def _refused(exc: SignatureError, doc: Mapping) -> SignatureError:
    return SignatureError(f"{exc}{_UNSIGNED if doc.get('sig') is None else ''}")


def check_event(doc: Mapping, verifier, topic: str, not_before: float | None = None) -> dict:
    """The envelope of event `doc` (received on `topic`) when the aggregator's key signed
    it as an event of its run for this federation, and, with `not_before` (a Unix time by
    the aggregator's clock: when the reader began listening, less what it does not know of
    the clocks' offset), signed no earlier; SignatureError otherwise."""
    where = f"event on {topic}"
    try:
        env = verifier.verify_doc(doc, kind=EVENT_KIND, where=where,
                                  run=str(doc.get("run") or ""))
        if not_before is not None and env["at"] < not_before:
            raise SignatureError(f"{where}: signed {not_before - env['at']:.0f} s before this "
                                 "watch began listening (less the clocks' allowance): events "
                                 "are not retained, so it is a replay")
    except SignatureError as exc:
        raise _refused(exc, doc) from None
    return env


def events_not_before(began: float, status_reply: Mapping | None) -> float:
    """The earliest signing time (aggregator's clock) of an event a reader that subscribed
    at `began` (its own clock) can take: the verified status reply's `at` (the aggregator's
    clock, signed with the reply) less REPLAY_MARGIN_S, else `began` less MAX_SKEW_S (the
    clocks' offset unknown)."""
    at = (status_reply or {}).get("at")
    if isinstance(at, (int, float)) and not isinstance(at, bool) and math.isfinite(at):
        return float(at) - REPLAY_MARGIN_S
    return began - MAX_SKEW_S


def check_record(doc: Mapping, verifier, topic: str, run_id: str, *,
                 created: float | None = None, not_before: float | None = None,
                 since: str = "created") -> dict:
    """The envelope of the run record `doc` received on `topic` (runs/<run_id>) when the
    aggregator's key signed it as the record of run `run_id` for this federation, and of
    the run of that id the reader follows; SignatureError otherwise.

    An id names one run only while the service's state lasts: after a state directory is
    wiped, an id can be given again, and the earlier run's records, signed with the same
    key for the same id, still verify. What tells the two apart is the record's `created`
    (the service's clock when it queued the run): with `created` (from a signed reply of
    the service) it must be that one; else, with `not_before` (events_not_before), its
    field `since` must be no earlier: "created" for a run the service did not know when the
    reader began listening (it is queued after), "started" for one the reader learnt of
    from its signed run_started or run_resumed event (a record without it, queued, is not
    taken). `started` stays the first start when the service tries a run again, and
    `resumed` says when it last did: with "started", that time is the record's when it has
    one (which event the run's aggregator sends, run_started or run_resumed, depends on its
    checkpoint, not on the service's tries)."""
    where = f"run record on {topic}"
    try:
        env = verifier.verify_doc(doc, kind=RECORD_KIND, where=where, run=run_id)
        if doc.get("id") != run_id:
            raise SignatureError(f"{where}: the record of run {str(doc.get('id'))[:40]!r}, "
                                 f"not of {run_id!r}")
        made = doc.get("created")
        if created is not None and made != created:
            raise SignatureError(f"{where}: the record of an earlier run of the id {run_id!r} "
                                 f"(queued at {_time(made)}, this one at {_time(created)}): "
                                 "a replay")
        when = doc.get(since)
        if since == "started" and "resumed" in doc:
            since, when = "resumed", doc.get("resumed")
        if created is None and not_before is not None and not (
                _is_time(when) and when >= not_before):
            raise SignatureError(f"{where}: the record of an earlier run of the id {run_id!r} "
                                 f"({since} {_time(when)}, before this reader began "
                                 "listening): a replay")
    except SignatureError as exc:
        raise _refused(exc, doc) from None
    return env


def _is_time(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and \
        math.isfinite(value)


def _time(value) -> str:
    return f"{value:.3f}" if _is_time(value) else repr(value)[:40]
