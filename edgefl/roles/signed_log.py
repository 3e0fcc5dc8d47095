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

- an event: `edgefl ctl watch` refuses one signed more than MAX_SKEW_S before it began
  listening (`since`): events are not retained, so a genuine one reaches a watch only as it
  happens, and an old one (say an earlier run's `run_finished`, of a run id used again
  after the service's state directory was deleted) is a replay;
- a record: a replay of an older genuine record of the same run shows an older state of it
  (queued, running, fewer rounds). A run's records only move on to an end that is never
  left, so a replayed one never ends a watch in a way the run did not end; `ctl status` and
  `ctl runs`, signed replies valid 60 s, are the current state.

A reader holding the aggregator's public key (roles.trust.aggregator_verifier) checks each
with check_event / check_record: SignatureError naming the topic and the cause, and, for
an unsigned one, that an aggregator without keys.signing_key or older than signed events
does not sign them.
"""
from __future__ import annotations

import json
from typing import Mapping

from ..io import jsonable
from ..transport.signing import MAX_SKEW_S, SignatureError

__all__ = ["EVENT_KIND", "RECORD_KIND", "signed_event", "signed_record", "check_event",
           "check_record"]

EVENT_KIND = "event"
RECORD_KIND = "run_record"
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


def check_event(doc: Mapping, verifier, topic: str, since: float | None = None) -> dict:
    """The envelope of event `doc` (received on `topic`) when the aggregator's key signed
    it as an event of its run for this federation, and, with `since` (the Unix time the
    reader began listening), no earlier than MAX_SKEW_S before it; SignatureError
    otherwise."""
    where = f"event on {topic}"
    try:
        env = verifier.verify_doc(doc, kind=EVENT_KIND, where=where,
                                  run=str(doc.get("run") or ""))
        if since is not None and env["at"] < since - MAX_SKEW_S:
            raise SignatureError(f"{where}: signed {since - env['at']:.0f} s before this "
                                 "watch began: events are not retained, so it is a replay")
    except SignatureError as exc:
        raise _refused(exc, doc) from None
    return env


def check_record(doc: Mapping, verifier, topic: str, run_id: str) -> dict:
    """The envelope of the run record `doc` received on `topic` (runs/<run_id>) when the
    aggregator's key signed it as the record of run `run_id` for this federation;
    SignatureError otherwise."""
    where = f"run record on {topic}"
    try:
        env = verifier.verify_doc(doc, kind=RECORD_KIND, where=where, run=run_id)
        if doc.get("id") != run_id:
            raise SignatureError(f"{where}: the record of run {str(doc.get('id'))[:40]!r}, "
                                 f"not of {run_id!r}")
    except SignatureError as exc:
        raise _refused(exc, doc) from None
    return env
