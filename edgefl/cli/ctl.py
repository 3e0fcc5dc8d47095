"""`edgefl ctl`: the operator's client of the aggregator's control topic: one command and its
reply, or `watch`, which follows the events topic until the run ends."""
from __future__ import annotations

import argparse
import os
import sys

from .command import Command, UsageError, seconds, whole


# ---------------------------------------------------------------------------------------
# edgefl ctl: a thin client of the control topics (docs/orchestration.md)
# ---------------------------------------------------------------------------------------

CTL_ACTIONS = ("start", "pause", "resume", "stop", "export", "status", "runs", "prune",
               "watch")


def add_tls_arguments(parser: argparse.ArgumentParser, default: str = "") -> None:
    """--cert-file, --key-file and --ca-file of an operator's tool (`ctl`, `dashboard`,
    `status`); `default`: what they default to, for the help ("the site file's")."""
    also = f"; default: {default}" if default else ""
    parser.add_argument("--cert-file", metavar="FILE",
                        help="TLS client certificate of the operator (brokers that take the "
                             f"certificate's CN as the username), with --key-file{also}")
    parser.add_argument("--key-file", metavar="FILE", help="private key of --cert-file")
    parser.add_argument("--ca-file", metavar="FILE",
                        help=f"CA bundle of the broker (TLS, mqtts://){also}")


def add_operator_arguments(parser: argparse.ArgumentParser, what: str) -> None:
    """The options of a tool of the operator's account (`ctl`, `dashboard`): the site file
    (its broker URL, CA file and federation), the broker, the account and TLS files.
    `what`: what only the operator may, in the help ("publish commands")."""
    from ..service.layered import add_service_config_arguments

    add_service_config_arguments(parser)
    parser.add_argument("--role", choices=["aggregator", "client"], default="aggregator",
                        help="whose site file --config is (its broker URL, CA file and "
                             "federation are used, never its account; default aggregator)")
    parser.add_argument("--broker", metavar="URL",
                        help="mqtt://host[:port], mqtts://... or host:port (default: the "
                             "site file's, else mqtt://localhost:1883)")
    parser.add_argument("--username", metavar="USER",
                        help=f"MQTT user: the operator's account (the broker's ACL lets only "
                             f"the operator {what}); never taken from --config, "
                             "whose account is the node's own")
    parser.add_argument("--password-file", metavar="FILE",
                        help="file whose first line is the MQTT password of --username")
    add_tls_arguments(parser)
    parser.add_argument("--federation", metavar="ID",
                        help="federation id (default: the site file's node.federation, else "
                             "'default')")


def _ctl_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=CTL_ACTIONS,
                        help="start CONFIG: queue a run; pause / resume / stop / export: the "
                             "active run (or --run ID); status; runs; prune [--keep N] "
                             "[--dry-run]: the service removes its older ended runs' files "
                             "(while it runs; exit 1 when a file could not be removed); "
                             "watch: follow the events until the run ends (Ctrl-C to leave), "
                             "or say how --run ID ended if it has; exit 0 finished, 1 failed "
                             "or unknown, 3 stopped or cancelled")
    parser.add_argument("run_config", nargs="?", metavar="CONFIG",
                        help="with start: the run config (YAML file or built-in name)")
    add_operator_arguments(parser, "publish commands")
    parser.add_argument("--operator-key", metavar="FILE",
                        help="sign the command with this Ed25519 private key (edgefl keys "
                             "gen); default: the aggregator site file's keys.operator_key. "
                             "Needed when the aggregator sets keys.operators")
    parser.add_argument("--aggregator-key", action="append", metavar="FILE",
                        help="refuse every reply not signed by this aggregator public key "
                             "(the .pub of its keys.signing_key; repeat for two during a key "
                             "change-over); default: the site file's keys.aggregator. `watch` "
                             "then also refuses events and run records not signed by it")
    parser.add_argument("--mqtt", choices=["5", "3.1.1"], default="5",
                        help="protocol: 5 (default) sends the reply address as response topic "
                             "+ correlation data, 3.1.1 in the payload (reply_to, request_id)")
    parser.add_argument("--run", dest="run_id", metavar="ID",
                        help="the run a command is for (start: the new run's id)")
    parser.add_argument("--clients", metavar="ID,ID,...",
                        help="start: the client ids, in the order of the partition")
    parser.add_argument("--deadline", type=float, metavar="SECONDS",
                        help="start: round deadline of this run")
    parser.add_argument("--quorum", type=float, metavar="FRACTION",
                        help="start: round quorum of this run")
    parser.add_argument("--min-updates", type=int, metavar="N",
                        help="start: fewest updates a round of this run is aggregated with")
    parser.add_argument("--keep", type=whole, metavar="N",
                        help="prune: keep the files of the N most recently ended runs (0: "
                             "none); default: the service's retention.keep_runs")
    parser.add_argument("--dry-run", action="store_true",
                        help="prune: say what would be removed and remove nothing")
    parser.add_argument("--timeout", type=seconds, default=10.0, metavar="SECONDS",
                        help="how long to wait for a reply (default 10)")
    parser.add_argument("--json", action="store_true",
                        help="print the reply (watch: each event) as JSON")


def operator_settings(args: argparse.Namespace, tool: str,
                      why: str) -> tuple[str, dict, str]:
    """(broker URL, MqttTransport options, federation) of a tool of the operator's account
    (add_operator_arguments). A site file (--config) gives the broker URL, its CA file and
    the federation, never its account: that is the node's own login (the aggregator's, a
    board's), which the broker's ACL does not let do what the operator does (`why`, e.g.
    "publish commands"; `tool` names the command, "ctl"). The account is the command
    line's (--username / --password-file, or --cert-file / --key-file); with a site file
    that names an account and none given, ValueError before connecting, saying so."""
    from ..service.layered import default, load_service_config

    config = None
    if args.site is not None or args.overrides or args.profile is not None:
        config = load_service_config(args.role, args.site, profile=args.profile,
                                     overrides=args.overrides)
    broker = config.section("broker") if config is not None else {}
    own = [f"{k} {broker[k]}" for k in ("username", "cert_file") if broker.get(k)]
    if own and not (args.username or args.cert_file):
        raise ValueError(
            f"the {args.role}'s site file {args.site or '(default)'} logs in as its own "
            f"account ({', '.join(own)}), and the broker's ACL lets only the operator account "
            f"{why} (broker/acl), so {tool} does not use it: give the operator's "
            f"credentials with --username operator --password-file FILE (or --cert-file / "
            f"--key-file); the site file still gives the broker URL, CA file and federation")
    url = args.broker or broker.get("url") or default("broker.url")
    options = {"ca_file": args.ca_file or broker.get("ca_file"), "cert_file": args.cert_file,
               "key_file": args.key_file, "username": args.username,
               "password_file": args.password_file}
    federation = args.federation or (config["node.federation"] if config
                                     else default("node.federation"))
    # the key ctl signs commands with (--operator-key, else the site file's), and the keys
    # it checks replies with (--aggregator-key, else the site file's keys.aggregator)
    site = config.get if config is not None else (lambda key: None)
    args.signing_key = getattr(args, "operator_key", None) or site("keys.operator_key")
    option = getattr(args, "aggregator_key", None)
    own_pub = f"{site('keys.signing_key')}.pub" if args.role == "aggregator" and \
        site("keys.signing_key") else None
    if option:
        args.reply_keys = (option, "--aggregator-key")
    elif site("keys.aggregator") or not own_pub or not os.path.exists(own_pub):
        args.reply_keys = (site("keys.aggregator"), "keys.aggregator")
        if own_pub and not site("keys.aggregator"):
            # the aggregator signs its replies, and nothing here can check them: say so
            print(f"edgefl {tool}: warning: {own_pub} is not there and the site file sets no "
                  "keys.aggregator: the aggregator's replies and events are not checked "
                  "(give --aggregator-key FILE)", file=sys.stderr)
    else:
        # on the aggregator's host its own site file names its private key (0600, the
        # service's): the public key `edgefl keys gen` wrote beside it checks the replies
        args.reply_keys = ([own_pub], "keys.signing_key's .pub")
    return url, {k: v for k, v in options.items() if v}, federation


def _ctl_connect(args: argparse.Namespace):
    """The connection of `edgefl ctl` (operator_settings says where and as whom)."""
    from ..roles.trust import aggregator_verifier
    from ..transport.requester import RequesterTransport
    from ..transport.topics import Topics

    url, options, federation = operator_settings(args, "ctl", "publish commands")
    # read before connecting: a bad key file is one line naming it, not a refused reply
    args.reply_verifier = aggregator_verifier(federation, *args.reply_keys)
    name = f"ctl-{os.getpid()}-{os.urandom(3).hex()}"
    transport = RequesterTransport(url, f"edgefl-{name}", clean_session=True,
                                   protocol=args.mqtt, **options)
    transport.connect()
    return transport, Topics(federation), name


def _ctl_command(args: argparse.Namespace) -> dict:
    doc: dict = {"cmd": args.action}
    if args.action == "start":
        from ..errors import ConfigError
        from ..runconfig import load_run_config
        from ..runs.outputs import absolute_dataset_paths as _absolute_paths

        if args.run_config is None:
            raise ValueError("ctl start: name the run config (a YAML file or built-in name)")
        config = load_run_config(args.run_config)      # errors name the file and key here
        body = config.to_dict()
        body["dataset"] = _absolute_paths(config.dataset, config.path)
        if config.init_typo() is not None:     # `init: unifrom`: not sent as a path
            raise ConfigError(f"{config.path or args.run_config}: model.init: "
                              f"{config.init_typo()}")
        if config.init_file() is not None:
            # a warm start's checkpoint, named as the aggregator must find it: an absolute
            # path, resolved here as `edgefl simulate` would (the file is read there)
            body["model"]["init"] = config.init_file()
        doc["config"] = body
        if args.clients:
            doc["clients"] = [c.strip() for c in args.clients.split(",")]
        from ..service.layered import check_setting

        # checked here as the aggregator will check them (its site file's round.*): a bad
        # value is one line now, not a refusal from the service after a round trip
        rounds = {k: check_setting(f"round.{k}", v, f"--{k.replace('_', '-')}")
                  for k, v in (("deadline", args.deadline), ("quorum", args.quorum),
                               ("min_updates", args.min_updates)) if v is not None}
        if rounds:
            doc["round"] = rounds
    elif args.run_config is not None:
        raise ValueError(f"ctl {args.action}: takes no CONFIG (got {args.run_config!r})")
    if args.action == "prune":
        if args.run_id is not None:
            raise UsageError("ctl prune: takes no --run (it removes the files of the ended "
                             "runs beyond the --keep N most recently ended)")
        if args.keep is not None:
            doc["keep"] = args.keep
        doc["dry_run"] = args.dry_run
    else:
        # refused, not ignored: `ctl stop --dry-run` must not stop the run
        for given, option in ((args.keep is not None, "--keep"), (args.dry_run, "--dry-run")):
            if given:
                raise UsageError(f"ctl {args.action}: {option} is for prune only")
    if args.run_id is not None and args.action in ("status", "runs"):
        # refused, not dropped: the answer would be about other runs than the one asked
        raise UsageError(
            "ctl status: takes no --run (it reports the service and its active run; "
            "`edgefl ctl runs` lists every run with its state)" if args.action == "status"
            else "ctl runs: takes no --run (it lists every run the service knows, with its "
                 "state; `edgefl ctl watch --run ID` tells how one ended)")
    if args.run_id is not None and args.action not in ("watch", "prune"):
        doc["run"] = args.run_id
    return doc


def _operator_signer(args: argparse.Namespace, topics):
    """The operator's Signer when a key is given (--operator-key, keys.operator_key)."""
    if not getattr(args, "signing_key", None):
        return None
    from ..transport.signing import Signer

    return Signer.from_file(args.signing_key, args.username or "operator", topics.federation)


def _ctl(args: argparse.Namespace) -> int:
    import json

    from ..roles.control import CommandRefused, ControlClient, ReplyRefused
    from ..io import terminal_text

    doc = _ctl_command(args) if args.action != "watch" else None
    transport, topics, name = _ctl_connect(args)
    try:
        if args.action == "watch":
            return _ctl_watch(args, transport, topics, name)
        client = ControlClient(transport, topics, name, mqtt5=args.mqtt == "5",
                               signer=_operator_signer(args, topics),
                               verifier=args.reply_verifier)
        try:
            reply = client.request(doc, timeout=args.timeout)
        except CommandRefused as exc:
            print(f"edgefl ctl: {exc}; log in as the operator (--username, --password-file)",
                  file=sys.stderr)
            return 1
        except (TimeoutError, ReplyRefused) as exc:
            print(terminal_text(f"edgefl ctl: {exc}"), file=sys.stderr)
            return 1
    finally:
        transport.close(timeout=2.0, announce_offline=False)
    if args.json:
        print(json.dumps(reply, indent=1))
    elif not reply.get("ok"):
        print(terminal_text(f"edgefl ctl {args.action}: refused: {reply.get('error')}"),
              file=sys.stderr)
    elif args.action == "prune":
        from .prune import prune_lines

        out, err = prune_lines(reply.get("result") or {}, "edgefl ctl prune")
        print(terminal_text("\n".join(out)))
        if err:
            print(terminal_text("\n".join(err)), file=sys.stderr)
    else:
        print(terminal_text(_ctl_text(args.action, reply.get("result") or {})))
    if args.action == "prune" and reply.get("ok"):
        from .prune import prune_status

        return prune_status(reply.get("result") or {})     # 1: a file could not be removed
    return 0 if reply.get("ok") else 1


def _ctl_text(action: str, result: dict) -> str:
    """One reply in words (what `edgefl ctl` prints without --json)."""
    if action == "runs":
        rows = result.get("runs", [])
        if not rows:
            return "no runs"
        # rounds: 9 wide, "1000/1000" fits; accuracy: the final one, else (an active run)
        # the latest evaluated round's
        lines = [f"{'run':<24} {'state':<10} {'rounds':>9} {'accuracy':>9}"]
        for r in rows:
            acc = r.get("final_accuracy")
            if acc is None:
                acc = r.get("test_accuracy")
            done = f"{r.get('rounds_done', '-')}/{r.get('rounds') or '?'}"
            lines.append(f"{r['id']:<24} {r['state']:<10} {done:>9} "
                         f"{f'{acc:.4f}' if acc is not None else '-':>9}")
        return "\n".join(lines)
    if action == "status":
        active = result.get("active")
        queue = ", ".join(result.get("queue") or []) or "empty"
        if not active:
            return f"{result.get('node')}: no active run; queue: {queue}"
        acc = active.get("test_accuracy")
        online = active.get("clients_online") or []
        round_text = (f"round {active['round']} of {active.get('rounds')} open, "
                      f"{active.get('updates')}/{active.get('uploaders')} updates"
                      if active.get("round") else
                      f"{active.get('rounds_done', 0)} of {active.get('rounds')} rounds done")
        return (f"run {active['run']}: {active['state']}, {round_text}; test accuracy "
                f"{f'{acc:.4f}' if acc is not None else '-'}; {len(online)} client(s) online"
                f"{': ' + ', '.join(online) if online else ''}; queue: {queue}")
    if action == "pause":
        return f"run {result.get('run')}: state {result.get('state')}, {_paused_where(result)}"
    fields = ", ".join(f"{k} {v}" for k, v in result.items() if k != "run")
    return f"run {result.get('run')}: {fields}"


def _paused_where(doc: dict) -> str:
    """Where a pause holds a run (a pause reply or a run_paused event): in its open round,
    or between rounds."""
    if doc.get("round") is not None:
        return f"round {doc['round']} open (it closes after resume)"
    done = doc.get("rounds_done")
    if not done:
        return "before its first round opens"
    return f"between rounds: {done} round(s) done, the next opens after resume"


# `ctl watch`'s exit status by how the watched run ended (docs/orchestration.md)
WATCH_EXIT = {"finished": 0, "failed": 1, "stopped": 3, "cancelled": 3}
WATCH_ENDS = {"run_finished": "finished", "run_stopped": "stopped",
              "run_cancelled": "cancelled"}


def _ctl_watch(args, transport, topics, name) -> int:
    """Follow the events topic: rounds, accuracy, clients online, until the run ends. With
    the aggregator's key, the status and runs replies watch starts from are checked (a
    refused one ends it, status 1), and so is every event and run record it follows
    (roles/signed_log.py): one that does not verify is skipped with a line on stderr naming
    the topic and the cause, and never acted on; when only unsigned ones have come for
    --timeout seconds (an aggregator that does not sign them) and no signed status reply
    said the aggregator signs, watch ends, status 1. A run that has ended before watch
    began sends no more events: its outcome, from the service's run records (the `runs`
    reply, else the run's retained record on runs/<id>), is printed at once. After the end's event, watch waits (up to --timeout seconds) for the run's
    record to say it has ended: the service closes a run after its last event, and a
    script's next `start` must find it closed, not still ahead in the queue. Exit status:
    WATCH_EXIT of the run's end (0 finished, 1 failed, 3 stopped or cancelled); 1 for a
    --run ID the service does not know and that is not started within --timeout
    seconds."""
    import json
    import time

    from ..roles.control import CommandRefused, ControlClient, ReplyRefused
    from ..roles.messages import MessageError, json_object
    from ..roles.signed_log import check_event, check_record, events_not_before
    from ..io import terminal_text
    from ..transport.base import Message
    from ..transport.signing import SignatureError

    transport.subscribe(topics.events(), qos=1)
    verifier, began = args.reply_verifier, time.time()
    not_before = events_not_before(began, None)   # until a verified status reply says more
    # with the key: when the first unsigned event or record was refused, until a signed one
    # verifies (then the aggregator is known to sign, and an unsigned one is only skipped)
    unsigned_since: float | None = None
    signs = False

    def verified(check, doc, *where) -> bool:
        nonlocal unsigned_since, signs
        if verifier is None:
            return True
        try:
            check(doc, verifier, *where)
        except SignatureError as exc:
            print(terminal_text(f"edgefl ctl watch: {exc}; refused, skipped"),
                  file=sys.stderr, flush=True)
            if doc.get("sig") is None and not signs and unsigned_since is None:
                unsigned_since = time.monotonic()
            return False
        signs, unsigned_since = True, None
        return True

    watched = args.run_id
    # the watched run's `created`, from a signed reply: an id names one run only while the
    # service's state lasts, and an earlier run's signed records of the same id are refused
    # by it (signed_log.check_record); None: the run is queued after watch began listening
    created: float | None = None
    since = "created"         # else the record's field that follows watch's start
    # a --run ID the service does not know: an error, unless the run is started within
    # --timeout seconds (a script may start watch first, so as to see the whole run)
    unknown: tuple | None = None           # (the error's text, when it is given)
    # the clients online: from the status reply (the active run's aggregator knows them),
    # then kept up to date by client_joined / client_left
    online: set = set()
    control = ControlClient(transport, topics, name, mqtt5=args.mqtt == "5",
                            signer=_operator_signer(args, topics),
                            verifier=args.reply_verifier)
    try:
        status = control.request({"cmd": "status"}, timeout=args.timeout)
        if verifier is not None:          # the reply verified: its time is the aggregator's
            not_before = events_not_before(began, status)
            # and the aggregator signs: it signs its events with the key it signs replies
            # with, so an unsigned event is a forgery to skip, never a sign that it signs
            # none (which would end the watch after --timeout)
            signs = True
        if status.get("ok"):
            result = status.get("result") or {}
            active = result.get("active")
            watched = watched or (active or {}).get("run")
            if active and active.get("run") == watched:
                online.update(active.get("clients_online") or [])
                created = active.get("created")
            elif watched is not None:
                # not the active run: ended (a short run is over before a script's next
                # command, and no event of it will come), queued, or unknown here
                records = _run_records(control, args.timeout)
                record = records.get(watched)
                created = (record or {}).get("created")
                if record is None:
                    text = (f"no run {watched!r} on aggregator {result.get('node')} of "
                            f"federation {topics.federation!r} (its runs: "
                            f"{', '.join(records) or 'none'}; `edgefl ctl runs` lists them)")
                    print(f"edgefl ctl watch: {text}; waiting {args.timeout:g} s for it to "
                          f"be started", file=sys.stderr, flush=True)
                    unknown = (text, time.monotonic() + args.timeout)
                elif record.get("state") in WATCH_EXIT:
                    return _report_ended(record, args.json, "before watch began")
            if not args.json:
                print(terminal_text(_ctl_text("status", result)), flush=True)
    except (TimeoutError, CommandRefused) as exc:
        print(f"edgefl ctl watch: {exc} (watching the events anyway)", file=sys.stderr)
    except ReplyRefused as exc:
        # not the aggregator's answer: nothing it says is printed or acted on
        print(terminal_text(f"edgefl ctl watch: {exc}"), file=sys.stderr)
        return 1
    # The run's retained record comes on subscribing, and again when the service closes it:
    # an end the requests above did not see (the service did not answer, or the run ended
    # while they waited: a request passes over the events that arrive meanwhile) ends the
    # watch all the same, without asking the service again.
    record_topic = topics.run_record(watched) if watched is not None else None
    if record_topic is not None:
        transport.subscribe(record_topic, qos=1)
    ended: tuple | None = None             # (exit status, time.monotonic() to give up waiting)
    try:
        while True:
            if unknown is not None and time.monotonic() > unknown[1]:
                print(f"edgefl ctl watch: {unknown[0]}; none was started within "
                      f"{args.timeout:g} s", file=sys.stderr)
                return 1
            if ended is not None and time.monotonic() > ended[1]:
                return ended[0]                 # its record never said so: the event decides
            if unsigned_since is not None and time.monotonic() > unsigned_since + args.timeout:
                print(f"edgefl ctl watch: the events on {topics.events()} are unsigned, and "
                      f"no signed event or run record within {args.timeout:g} s: the "
                      "aggregator does not sign them (no keys.signing_key, or older than "
                      "signed events); without the aggregator's key watch takes them "
                      "unchecked", file=sys.stderr)
                return 1
            item = transport.receive(timeout=0.5)
            if not isinstance(item, Message):
                continue
            if item.topic == record_topic:
                try:
                    record = json_object(item.payload, "run record")
                except MessageError:
                    record = None       # cleared (empty) or unreadable: not a state change
                if isinstance(record, dict) and item.payload and not verified(
                        lambda *a: check_record(*a, created=created, not_before=not_before,
                                                since=since),
                        record, item.topic, watched):
                    continue
                if isinstance(record, dict) and item.payload:
                    unknown = None              # the run exists (queued, at least)
                if isinstance(record, dict) and record.get("state") in WATCH_EXIT:
                    if ended is not None:       # the end's event is printed; now it is closed
                        return ended[0]
                    return _report_ended(record, args.json, "(its record; the end's event "
                                                            "came before watch was listening)")
                continue
            if item.topic != topics.events():
                continue
            try:       # read as every message is: a deep or odd one is skipped, not fatal
                event = json_object(item.payload, "event")
            except MessageError:
                continue
            if not verified(check_event, event, item.topic, not_before):
                continue
            run = event.get("run")
            if watched is None and event.get("event") in ("run_started", "run_resumed"):
                watched = run
                # learnt of from this event, signed after watch began: its record says
                # it started (or was last tried again) no earlier; one that does not is an
                # earlier run's of the id
                since = "started"
                record_topic = topics.run_record(watched)
                transport.subscribe(record_topic, qos=1)
            if watched is not None and run not in (None, watched):
                continue
            if run is not None:
                unknown = None                  # the run exists: it was just started
            kind = event.get("event")
            if kind == "client_joined":
                online.add(event.get("client"))
            elif kind == "client_left":
                online.discard(event.get("client"))
            if args.json:
                print(json.dumps(event), flush=True)
            else:
                print(terminal_text(_event_text(event, online)), flush=True)
            if ended is not None:
                continue
            if kind in WATCH_ENDS:
                ended = (WATCH_EXIT[WATCH_ENDS[kind]], time.monotonic() + args.timeout)
            elif kind == "error" and run == watched and run is not None:
                ended = (WATCH_EXIT["failed"], time.monotonic() + args.timeout)
            if ended is not None and record_topic is None:
                return ended[0]                 # no run id, no record to wait for
    except KeyboardInterrupt:
        return 0


def _report_ended(record: dict, as_json: bool, when: str) -> int:
    """Print how a run ended that watch did not see end (its public record: state, rounds,
    accuracy, where its outputs are, or why it failed); returns watch's exit status."""
    import json

    from ..io import terminal_text

    state = record.get("state")
    where = record.get("out_dir") or record.get("run_dir")
    print(json.dumps(record) if as_json else terminal_text(
          f"run {record.get('id')}: {state} {when}, "
          f"{record.get('rounds_done', 0)}/{record.get('rounds') or '?'} rounds"
          + (f", final accuracy {record['final_accuracy']:.4f}"
             if record.get("final_accuracy") is not None else "")
          + (f"; {record['error']}" if record.get("error") else "")
          + (f"; outputs in {where}" if where and state in ("finished", "stopped") else "")),
          flush=True)
    return WATCH_EXIT.get(state, 1)


def _run_records(control, timeout: float) -> dict:
    """{run id: its public record} of every run the service knows (the `runs` reply)."""
    reply = control.request({"cmd": "runs"}, timeout=timeout)
    return {r.get("id"): r for r in (reply.get("result") or {}).get("runs") or []
            if isinstance(r, dict)}


def _event_text(event: dict, online: set) -> str:
    import time

    kind, run = event.get("event"), event.get("run")
    at = time.strftime("%H:%M:%S", time.localtime(event.get("at") or time.time()))
    if kind == "round_opened":
        left = (event.get("deadline") or 0) - (event.get("at") or 0)
        text = (f"round {event.get('round')} opened: {len(event.get('selected') or [])} "
                f"selected, deadline in {left:.0f} s")
    elif kind == "round_closed":
        acc = event.get("test_accuracy")
        text = (f"round {event.get('round')} closed ({event.get('closed_by')}): "
                f"{event.get('updates')} update(s), test accuracy "
                f"{f'{acc:.4f}' if acc is not None else '-'}"
                + (f", epsilon {event['dp_epsilon']:.4g} at delta {event.get('dp_delta'):g}"
                   if isinstance(event.get("dp_epsilon"), (int, float)) else ""))
    elif kind in ("client_joined", "client_left"):
        text = (f"{event.get('client')} {'online' if kind == 'client_joined' else 'offline'} "
                f"({len(online)} online)")
    elif kind == "run_paused":
        text = f"run_paused: {_paused_where(event)}"
    elif kind == "error":
        text = f"error: {event.get('error')}"
    else:
        # a run_finished's `stopped` (errors.stop_record) is told by its message
        extra = ", ".join(f"{k} {v['message'] if k == 'stopped' and isinstance(v, dict) else v}"
                          for k, v in event.items()
                          if k not in ("event", "run", "node", "at", "sig"))
        text = kind + (f": {extra}" if extra else "")
    return f"{at} {run or '-'} {text}"


CTL = Command(
    "ctl",
    "drive the aggregator service over MQTT: start CONFIG | pause | resume | stop | export | "
    "status | runs | prune | watch (the operator's account)",
    _ctl_arguments, _ctl)
