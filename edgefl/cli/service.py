"""The commands of a node's services and their setup: broker, config show, install-service,
and the services the systemd units run (aggregator, client, serve), plus the fleet's status."""
from __future__ import annotations

import argparse
import logging
import sys

from .command import Command, count, count_or_ids, seconds


# ---------------------------------------------------------------------------------------
# edgefl broker
# ---------------------------------------------------------------------------------------

def _broker_arguments(parser: argparse.ArgumentParser) -> None:
    from ..transport.broker import DEFAULT_MAX_PACKET_BYTES, KINDS

    parser.add_argument("--port", type=int, default=1883, metavar="N",
                        help="TCP port (default 1883; 0 picks a free one)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1; the embedded broker "
                             "is anonymous: use broker/mosquitto.conf for a network)")
    parser.add_argument("--kind", choices=KINDS, default="auto",
                        help="mosquitto (found on PATH), python (amqtt, pip install "
                             "'edgefl[broker]'), or auto: mosquitto when installed")
    parser.add_argument("--max-packet-bytes", type=count, default=DEFAULT_MAX_PACKET_BYTES,
                        metavar="N", help="largest MQTT packet accepted (default "
                                          f"{DEFAULT_MAX_PACKET_BYTES})")
    actions = parser.add_subparsers(dest="broker_action", metavar="ACTION")
    accounts = actions.add_parser(
        "accounts", help="generate a federation's broker accounts (one per connection, bound "
                         "to its client id), hashed passwords and access, for Mosquitto's "
                         "dynamic security plugin (docs/brokers.md)")
    accounts.add_argument("--federation", required=True, metavar="ID", help="federation id")
    accounts.add_argument("--clients", required=True, type=count_or_ids,
                          metavar="N|ID,ID,...",
                          help="the boards: a number N (client-1 ... client-N) or their ids")
    accounts.add_argument("--aggregator", default="aggregator", metavar="ID",
                          help="the aggregator's node id (default aggregator)")
    accounts.add_argument("--out", required=True, metavar="DIR",
                          help="writes DIR/broker/dynamic-security.json and "
                               "DIR/credentials/<account>.pw (refuses to replace them)")
    accounts.add_argument("--mechanism", choices=["dynsec", "passwd"], default="dynsec",
                          help="dynsec (default): the dynamic security plugin's state, every "
                               "node's account bound to its client id; passwd: a password "
                               "file and an ACL for a broker without the plugin, which bind "
                               "no client id")


def _broker_accounts(args: argparse.Namespace) -> int:
    import os

    from ..service.accounts import (ADMIN, federation_accounts, write_accounts,
                                    write_password_file_accounts)

    clients = args.clients.strip()
    if clients.isdigit():
        ids = [f"client-{i}" for i in range(1, int(clients) + 1)]
    else:
        ids = [c.strip() for c in clients.split(",") if c.strip()]
    fed = federation_accounts(args.federation, ids, aggregator=args.aggregator)
    credentials = os.path.join(args.out, "credentials")
    if args.mechanism == "passwd":
        written = write_password_file_accounts(fed, args.out)
        print(f"edgefl broker accounts: {len(fed.accounts) - 1} accounts of federation "
              f"{fed.federation} in {written['passwords']} (hashed by "
              f"{written['hashed_by']}) and {written['acl']}; passwords in {credentials}/; "
              "client ids are NOT bound to accounts (docs/brokers.md)")
    else:
        written = write_accounts(fed, args.out)
        print(f"edgefl broker accounts: {len(fed.accounts)} accounts of federation "
              f"{fed.federation} in {written['dynsec']} (the dynamic security plugin's "
              f"plugin_opt_config_file); passwords in {credentials}/")
    for a in fed.accounts:
        if args.mechanism == "passwd" and a.username == ADMIN:
            continue
        bound = f"client id {a.client_id}" if a.client_id and args.mechanism == "dynsec" \
            else "any client id"
        print(f"  {a.username:<20} {bound:<28} {a.purpose}")
    print("site files: broker.username and broker.password_file of each node (the "
          "aggregator's also broker.control_username / control_password_file: "
          f"{fed.aggregator}-ctl); see docs/brokers.md")
    return 0


def _broker(args: argparse.Namespace) -> int:
    from ..service.signals import install_stop_handlers
    from ..transport.broker import EmbeddedBroker

    if getattr(args, "broker_action", None) == "accounts":
        return _broker_accounts(args)

    with install_stop_handlers() as stop, \
            EmbeddedBroker(port=args.port, kind=args.kind, host=args.host,
                           max_packet_bytes=args.max_packet_bytes) as broker:
        print(f"edgefl broker: {broker.kind} listening on {broker.url} (max packet "
              f"{broker.max_packet_bytes} bytes); Ctrl-C or SIGTERM stops it", flush=True)
        while not stop.wait(1.0):
            if not broker.running:
                print(f"edgefl broker: the {broker.kind} broker exited: "
                      f"{broker.log_tail() or 'no output'}", file=sys.stderr)
                return 1
    print("edgefl broker: stopped", flush=True)
    return 0


BROKER = Command(
    "broker",
    "run the embedded MQTT broker (Mosquitto or amqtt) on this machine until SIGINT/SIGTERM",
    _broker_arguments, _broker)


# ---------------------------------------------------------------------------------------
# edgefl config show
# ---------------------------------------------------------------------------------------

def _config_arguments(parser: argparse.ArgumentParser) -> None:
    from ..service.layered import ROLES, add_service_config_arguments

    actions = parser.add_subparsers(dest="config_action", metavar="ACTION", required=True)
    show = actions.add_parser("show", help="print a service's resolved settings and where each "
                                           "came from (defaults, profile, site file, --set)")
    show.add_argument("--role", choices=ROLES, default="client",
                      help="the service whose settings to resolve (default: client)")
    add_service_config_arguments(show, aliases=("--site",))
    show.add_argument("--id", dest="node_id", metavar="ID",
                      help="with --role client: the site file `edgefl install-service` wrote "
                           "for client ID, /etc/edgefl/client-ID.yaml (instead of --config)")
    show.add_argument("--json", action="store_true", help="values and sources as JSON")


def _config(args: argparse.Namespace) -> int:
    from ..service.layered import service_config_from_args, to_json_text

    config = service_config_from_args(args.role, args)
    print(to_json_text(config) if args.json else config.describe())
    return 0


CONFIG = Command(
    "config",
    "inspect the layered service configuration (config show)",
    _config_arguments, _config)


# ---------------------------------------------------------------------------------------
# edgefl install-service
# ---------------------------------------------------------------------------------------

def _install_service_arguments(parser: argparse.ArgumentParser) -> None:
    from ..service.install import ROLE_UNITS

    parser.add_argument("--role", required=True, choices=list(ROLE_UNITS),
                        help="the service to install")
    parser.add_argument("--id", dest="node_id", metavar="ID",
                        help="client id (client), the client whose model to serve (infer), "
                             "node id (aggregator; default: aggregator)")
    parser.add_argument("--profile", metavar="NAME",
                        help="device profile (default: detected from the board)")
    parser.add_argument("--prefix", default="/", metavar="DIR",
                        help="stage the files under DIR instead of / (default: /)")
    parser.add_argument("--python", metavar="PATH",
                        help="interpreter the unit runs (default: this one, sys.executable); "
                             "it must import edgefl (checked by running PATH -c 'import "
                             "edgefl')")
    parser.add_argument("--no-python-check", dest="check_python", action="store_false",
                        help="with --prefix, staging for another machine: check only the "
                             "interpreter's path, not that it exists here and imports edgefl")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the files and commands, write nothing; an interpreter "
                             "the unit could not run (a development venv under /home or "
                             "/tmp) is a warning here, not an error")
    parser.add_argument("--signing-key", metavar="FILE|new",
                        help="install this Ed25519 private key (or a new one) as the node's "
                             "keys.signing_key: /etc/edgefl/keys/<role>-<id>.key, mode 0600, "
                             "owned by the service user")
    parser.add_argument("--trust-key", action="append", default=[], metavar="FILE",
                        help="a public key (PATH.pub of `edgefl keys gen --out PATH`; a "
                             "private key is refused) the node checks signatures with: a "
                             "client's keys.aggregator, the aggregator's keys.operators "
                             "(repeat it during a key change-over: old and new)")


def _install_service(args: argparse.Namespace) -> int:
    from ..service.install import format_report, install, plan_install

    plan = plan_install(args.role, args.node_id, profile=args.profile, prefix=args.prefix,
                        python=args.python, check_python=args.check_python,
                        signing_key=args.signing_key, trusted_keys=tuple(args.trust_key),
                        dry_run=args.dry_run)
    done = install(plan, dry_run=args.dry_run)
    print(format_report(plan, done, args.dry_run))
    return 0


INSTALL_SERVICE = Command(
    "install-service",
    "write a systemd unit and site-file skeleton for a role and print the systemctl "
    "commands (it runs none of them)",
    _install_service_arguments, _install_service)


# edgefl aggregator / edgefl client / edgefl status: the roles over MQTT
# ---------------------------------------------------------------------------------------

def _mqtt_transport(config, client_id: str, **options):
    """An MqttTransport from a service config's broker section (url, user, password file,
    TLS files; `options` win over the section's, e.g. a TLS file given on the command
    line). The aggregator service's control connection (client id <node>-ctl) logs in
    with broker.control_username when set: a broker that binds each account to one client
    id (docs/brokers.md, `edgefl broker accounts`) needs an account per connection."""
    from ..service.accounts import control_username
    from ..transport.mqtt import MqttTransport

    broker = config.section("broker")
    tls = {k: broker[k] for k in ("ca_file", "cert_file", "key_file") if broker.get(k)}
    username, password_file = broker.get("username"), broker.get("password_file")
    if broker.get("control_username") and config["node.id"] and \
            client_id == control_username(config["node.id"]):
        username = broker["control_username"]
        password_file = broker.get("control_password_file")
    transport = MqttTransport(broker["url"], client_id, username=username,
                              password_file=password_file,
                              **{"keepalive": broker["keepalive"], **tls, **options})
    transport.set_queue_limits(config["limits.queue_messages"], config.mib("limits.queue_mb"))
    return transport


def _role_start(role: str, args: argparse.Namespace, flags=None):
    """The role's resolved settings (flags: its own options for settings, see
    load_service_config), with logging and the C core's threads set up from them."""
    from ..service import logs, profiles
    from ..service.layered import load_service_config

    config = load_service_config(role, args.site, profile=args.profile,
                                 overrides=args.overrides, flags=flags)
    logs.setup_logging(config["log.level"])
    profiles.apply_threads(config["compute.threads"])
    return config


def _aggregator_arguments(parser: argparse.ArgumentParser) -> None:
    from ..service.layered import add_service_config_arguments, default

    add_service_config_arguments(parser)
    # each is a setting of the layered table (round.*, clients), which the site file and
    # --set can give too; the defaults shown are the package's
    parser.add_argument("--deadline", type=float, metavar="SECONDS",
                        help="a round closes this long after it is announced, with the "
                             f"updates it has (default {default('round.deadline'):g})")
    parser.add_argument("--quorum", type=float, metavar="FRACTION",
                        help="close a round early once this fraction of its uploaders sent "
                             f"their update (default {default('round.quorum')}: all of them, "
                             "or the deadline)")
    parser.add_argument("--min-updates", type=int, metavar="N",
                        help="fewest updates a round is aggregated with; fewer at the deadline "
                             f"announce the round again (default {default('round.min_updates')})")
    parser.add_argument("--clients", metavar="ID,ID,...",
                        help="the client ids of the federation, in the order of the run "
                             "config's partition (default: client-0 ... client-<N-1>)")
    parser.add_argument("--out", metavar="DIR",
                        help="where the site file's run writes metrics.jsonl, summary.json "
                             "and model.npz (default: <state_dir>/run; runs started on the "
                             "control topic write to <state_dir>/runs/<id>/)")
    parser.add_argument("--once", action="store_true",
                        help="exit once no run is active or queued (the site file's run done) "
                             "instead of waiting for the next run; status 1 when a run of this "
                             "start failed, or the site file's run failed in an earlier one")
    two = parser.add_argument_group("two levels: edge aggregators over bridged brokers "
                                    "(docs/scaling.md)")
    two.add_argument("--sites", metavar="FILE",
                     help="the sites file (YAML: edge id -> its clients' ids). Alone: this "
                          "is the centre, and its runs' rounds go to the edge aggregators; "
                          "with --edge: this edge's clients are its entry")
    two.add_argument("--edge", metavar="ID",
                     help="run as the edge aggregator ID of one site: connect to the site's "
                          "broker (bridged to the centre's: broker/bridge-site.conf), serve "
                          "the site's clients and forward one partial aggregate a round; "
                          "the site file's `run` names the centre's run config")
    two.add_argument("--centre-key", metavar="FILE", action="append",
                     help="with --edge: the centre's public key (edgefl keys gen); the edge "
                          "then follows only announcements and models the centre signed "
                          "(repeat it during a key change-over)")


def _export_policy(config):
    """The ExportPolicy of the aggregator's export.* settings."""
    from ..export import ExportPolicy

    return ExportPolicy(every=config["export.every"], softmax=config["export.softmax"],
                        quantize=config["export.quantize"])


def _aggregator(args: argparse.Namespace) -> int:
    import os

    from ..roles import AggregatorSettings
    from ..roles.daemon import (SITE_RUN_DIR, STATE_FILES, STATE_SUBDIRECTORIES, Daemon,
                                DaemonSettings)
    from ..roles.state import hold_state_dir
    from ..transport.base import TransportError
    from ..service.notify import Notifier
    from ..service.signals import install_stop_handlers

    # the command line's round settings and clients: the top layer of the service's settings
    flags = {key: (f"{option} {value}", value) for key, option, value in (
        ("round.deadline", "--deadline", args.deadline), ("round.quorum", "--quorum", args.quorum),
        ("round.min_updates", "--min-updates", args.min_updates),
        ("clients", "--clients", args.clients)) if value is not None}
    config = _role_start("aggregator", args, flags=flags)
    state_dir = config.state_dir
    out = args.out or os.path.join(state_dir, SITE_RUN_DIR)
    clients = config["clients"]
    sites = _sites(args)
    if args.edge:
        return _edge(args, config, sites)
    settings = AggregatorSettings.from_service_config(config)
    daemon_settings = DaemonSettings(settings, client_ids=tuple(clients) if clients else None,
                                     once=args.once, keep_runs=config["retention.keep_runs"],
                                     run_options={"export": _export_policy(config),
                                                  "publish_onnx": config["export.publish"],
                                                  "onnx_record_dir": state_dir,
                                                  **({"sites": sites} if sites else {})})

    def transport(client_id, **options):
        return _mqtt_transport(config, client_id, **options)

    notifier = Notifier.from_environment()
    site_run = (config["run"], out) if config["run"] else None
    # the pings stop when the main loop (the daemon's, or its run's) stops beating
    with hold_state_dir(state_dir, "aggregator", STATE_FILES, STATE_SUBDIRECTORIES), \
            install_stop_handlers() as stop, \
            notifier.watchdog_pinger(healthy=notifier.heartbeat_check()):
        daemon = Daemon(daemon_settings, state_dir, transport, stop=stop, notifier=notifier,
                        site_run=site_run)
        try:
            daemon.run()
        except TransportError as exc:
            raise _control_account_hint(exc, config) from None
        notifier.stopping()
    for run_id in daemon.executed:
        record = daemon.records[run_id]
        where = record["out_dir"]
        if record["state"] == "finished":
            print(f"run {run_id}: finished, final accuracy {record['final_accuracy']:.4f}, "
                  f"{record['rounds_done']} rounds, model sha256 {record['model_sha256']}; "
                  f"outputs in {where}", flush=True)
        elif record["state"] in ("running", "paused"):
            print(f"run {run_id}: interrupted ({stop.name or 'stop requested'}); the checkpoint "
                  f"in {record['state_dir']} resumes the run", flush=True)
        else:
            detail = record.get("error") or f"outputs in {where}"
            print(f"run {run_id}: {record['state']}; {detail}", flush=True)
    if stop.is_set():
        print(f"edgefl aggregator: stopped ({stop.name or 'stop requested'})", flush=True)
    site = daemon.site_record
    if args.once and site is not None and site["id"] not in daemon.executed \
            and site["state"] in ("finished", "stopped", "cancelled", "failed"):
        # the site file's run ended in an earlier start and is not run again (the service
        # queues it once): --once says how it ended, as if it had just run it -- a script
        # must not take "nothing run" for success when the run failed
        if site["state"] == "failed":
            print(f"edgefl aggregator: error: the site file's run {site['id']} "
                  f"({site['site']}) failed earlier and is not run again: {site.get('error')}; "
                  f"a changed run config is queued as a new run, and this one runs again "
                  f"once its record {site['run_dir']} is removed (or queue it with `edgefl "
                  f"ctl start {site['site']}` on the running service)",
                  file=sys.stderr, flush=True)
            return 1
        outputs = "no outputs" if site["state"] == "cancelled" else \
            f"outputs in {site['out_dir']}"
        print(f"edgefl aggregator: the site file's run {site['id']} ({site['site']}) "
              f"{site['state']} earlier and is not run again (a changed run config is a new "
              f"run); {outputs}", flush=True)
    return 1 if any(daemon.records[r]["state"] == "failed" for r in daemon.executed) \
        and args.once else 0


def _sites(args):
    """The --sites file's {edge id: client ids}, or None; --edge needs it."""
    from ..errors import ConfigError
    from ..roles.edge import load_sites

    if args.edge and not args.sites:
        raise ConfigError("--edge needs --sites FILE: the site's clients are its entry there")
    if not args.sites:
        return None
    try:
        sites = load_sites(args.sites)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if args.edge and args.edge not in sites:
        raise ConfigError(f"--edge {args.edge}: the sites file {args.sites} has no entry "
                          f"{args.edge!r} (it has {', '.join(sorted(sites))})")
    return sites


def _edge(args, config, sites) -> int:
    """`edgefl aggregator --edge ID --sites FILE`: the edge aggregator of one site."""
    import os

    from ..errors import ConfigError
    from ..roles import AggregatorSettings
    from ..roles.edge import STATE_FILES
    from ..roles.runner import run_edge
    from ..roles.state import hold_state_dir
    from ..runconfig import load_run_config
    from ..service.signals import install_stop_handlers

    if not config["run"]:
        raise ConfigError(f"--edge {args.edge}: the site file names no run config (`run:`); "
                          f"an edge runs the centre's run config, to build the same model "
                          f"and strategy")
    if config["node.id"] not in (None, args.edge):
        raise ConfigError(f"--edge {args.edge}: the site file's node.id is "
                          f"{config['node.id']!r}; an edge's node id is its edge id (its "
                          f"signatures and status carry it)")
    centre_keys = None
    if args.centre_key:
        from ..transport.signing import KeyFileError, Verifier, load_public_key
        try:
            centre_keys = Verifier(config["node.federation"],
                                   {"*": [load_public_key(p) for p in args.centre_key]})
        except KeyFileError as exc:
            raise ConfigError(f"--centre-key: {exc}") from None
    settings = AggregatorSettings.from_service_config(config, node_id=args.edge)
    run_config = load_run_config(config["run"])
    clients = config["clients"]
    edge_dir = os.path.join(config.state_dir, "edge")
    with hold_state_dir(edge_dir, "edge", STATE_FILES), install_stop_handlers() as stop:
        finished = run_edge(run_config, _mqtt_transport(config, args.edge),
                            edge_dir, settings=settings,
                            edge_id=args.edge, site=sites[args.edge],
                            client_ids=tuple(clients) if clients else None, stop=stop,
                            centre_keys=centre_keys)
    print(f"edgefl aggregator --edge {args.edge}: "
          f"{'the centre finished the run' if finished else 'stopped'}", flush=True)
    return 0


def _control_account_hint(exc, config):
    """`exc`, with what to do when the broker refused the control connection because the
    site file gives it no account of its own (a broker that binds accounts to client ids)."""
    from ..service.accounts import control_username
    from ..transport.base import TransportError

    control = control_username(config["node.id"])
    if f"refused client {control!r}" in str(exc) and not config["broker.control_username"]:
        return TransportError(
            f"{exc}; if the broker binds each account to one client id (docs/brokers.md), "
            f"the control connection needs its own account: set broker.control_username "
            f"({control}) and broker.control_password_file in the site file")
    return exc


AGGREGATOR = Command(
    "aggregator",
    "the aggregator service: runs the federation's rounds over MQTT, one run at a time, "
    "started and steered on the control topic (and the site file's `run` first); resumes "
    "from its checkpoints",
    _aggregator_arguments, _aggregator)


def _client_arguments(parser: argparse.ArgumentParser) -> None:
    from ..service.layered import add_service_config_arguments

    add_service_config_arguments(parser)
    parser.add_argument("--partition", metavar="RUN_CONFIG",
                        help="train on a shard of this run config's dataset and partition "
                             "(a simulated or test fleet) instead of the site file's data")
    parser.add_argument("--shard", type=int, metavar="INDEX",
                        help="with --partition: which client's shard (0-based)")
    parser.add_argument("--exit-when-finished", action="store_true",
                        help="exit once the run is finished instead of waiting for the next")


def _client(args: argparse.Namespace) -> int:
    from ..roles.client import STATE_FILES
    from ..roles.state import hold_state_dir

    if (args.partition is None) != (args.shard is None):
        raise ValueError("--partition and --shard go together")
    run_config, flags = None, {}
    if args.partition is not None:
        from ..runconfig import load_run_config
        from ..runs.outputs import absolute_dataset_paths as _absolute_paths

        run_config = load_run_config(args.partition)
        # the client's data is the run's dataset, a command-line setting
        flags["data"] = (f"--partition {args.partition}",
                         _absolute_paths(run_config.dataset, run_config.path))
    config = _role_start("client", args, flags=flags)
    with hold_state_dir(config.state_dir, "client", STATE_FILES):    # before the data loads
        return _run_client(args, config, run_config)


def _run_client(args: argparse.Namespace, config, run_config) -> int:
    from .. import kernels
    from ..roles import Client, ClientSettings
    from ..service import profiles
    from ..service.notify import Notifier
    from ..service.signals import install_stop_handlers

    # a board on the NumPy reference it did not ask for says so in its log (docs/limits.md)
    kernels.check_run_backend(0, "edgefl client", sys.stderr)
    if run_config is not None:
        from ..runs.prepare import client_shard

        x, y = client_shard(run_config, args.shard)
    else:
        from ..data import load_dataset
        from ..errors import ConfigError

        data = dict(config["data"])
        try:
            dataset = load_dataset(data.pop("name"), **data)
        except (ValueError, FileNotFoundError) as exc:   # an option's value: name the setting
            raise ConfigError(f"{config.source('data')}: {exc}") from None
        x, y = dataset.x_train, dataset.y_train
    rss = profiles.check_memory_budget(config["compute.memory_budget_mb"], "after loading data")
    node = config["node.id"]
    logging.getLogger("edgefl.roles.client").info(
        "%s: %d samples of shape %s loaded (%.0f MiB resident)", node, len(x), x.shape[1:], rss)
    # the board's limits (compute.max_params, ...) are in the settings: a run asking more is
    # refused
    settings = ClientSettings.from_service_config(config,
                                                  exit_when_finished=args.exit_when_finished)
    transport = _mqtt_transport(config, node)
    notifier = Notifier.from_environment()
    # the pings stop when the client's main loop stops beating
    with install_stop_handlers() as stop, \
            notifier.watchdog_pinger(healthy=notifier.heartbeat_check()):
        client = Client(settings, (x, y), transport, config.state_dir, stop=stop,
                        notifier=notifier)
        client.run()
        notifier.stopping()
    print(f"edgefl client {node}: {'run finished' if client.finished else 'stopped'}; last "
          f"round trained {client.progress.trained}", flush=True)
    return 0


CLIENT = Command(
    "client",
    "train on this node's data whenever the aggregator's round tasks it (site file: id, "
    "data, broker, state directory)",
    _client_arguments, _client)


def _serve_arguments(parser: argparse.ArgumentParser) -> None:
    from ..service.layered import add_service_config_arguments

    add_service_config_arguments(parser)


def _serve(args: argparse.Namespace) -> int:
    from ..serve import InferenceService, serve, socket_path_for
    from ..service import logs
    from ..service.layered import load_service_config
    from ..service.notify import Notifier
    from ..service.signals import install_stop_handlers

    config = load_service_config("infer", args.site, profile=args.profile,
                                 overrides=args.overrides)
    logs.setup_logging(config["log.level"])
    service = InferenceService(config["infer.model"], threads=config["infer.threads"],
                               check_interval=config["infer.check_interval"],
                               max_request_bytes=config["infer.max_request_bytes"],
                               max_concurrent=config["infer.max_concurrent"])
    path = socket_path_for(config["infer.socket"], lambda: config.state_dir)
    notifier = Notifier.from_environment()
    with install_stop_handlers() as stop:
        status = serve(service, path, listen=config["infer.listen"], stop=stop,
                       notifier=notifier)
    print(f"edgefl serve: stopped ({stop.name or 'stop requested'}) after "
          f"{service.requests} requests", flush=True)
    return status


SERVE = Command(
    "serve",
    "serve predictions of the latest ONNX model over HTTP on a Unix socket (and optionally "
    "TCP); reloads the model file when the client replaces it",
    _serve_arguments, _serve)


def _status_arguments(parser: argparse.ArgumentParser) -> None:
    from ..service.layered import add_service_config_arguments
    from .ctl import add_tls_arguments

    add_service_config_arguments(parser)
    parser.add_argument("--role", choices=["aggregator", "client"], default="aggregator",
                        help="whose site file --config is (default aggregator)")
    parser.add_argument("--broker", metavar="URL",
                        help="broker to ask, without a site file (default "
                             "mqtt://localhost:1883)")
    parser.add_argument("--federation", metavar="ID", help="federation id (default: the site "
                        "file's node.federation, else 'default')")
    parser.add_argument("--username", metavar="USER",
                        help="log in as USER (the operator) instead of the site file's "
                             "account, which a broker that binds accounts to client ids "
                             "refuses under status's own client id (docs/brokers.md)")
    parser.add_argument("--password-file", metavar="FILE",
                        help="with --username: file whose first line is its password")
    add_tls_arguments(parser, default="the site file's")
    parser.add_argument("--wait", type=seconds, default=2.0, metavar="SECONDS",
                        help="longest wait for the retained statuses (default 2)")
    parser.add_argument("--json", action="store_true", help="print the statuses as JSON")


def _status(args: argparse.Namespace) -> int:
    import json
    import os

    from ..service.layered import default, load_service_config
    from ..service.status import collect_statuses, format_fleet
    from ..transport.base import TransportError
    from ..transport.mqtt import MqttTransport, shown_url

    client_id = f"edgefl-status-{os.getpid()}-{os.urandom(3).hex()}"
    config = None
    if args.site is not None or args.overrides or args.profile is not None:
        config = load_service_config(args.role, args.site, profile=args.profile,
                                     overrides=args.overrides)
    login = {"username": args.username, "password_file": args.password_file} \
        if args.username else {}
    if args.password_file and not args.username:
        raise ValueError("--password-file goes with --username")
    if bool(args.cert_file) != bool(args.key_file):
        raise ValueError("--cert-file and --key-file go together")
    # the TLS files given here win over the site file's, one by one
    given = {k: getattr(args, k) for k in ("ca_file", "cert_file", "key_file")
             if getattr(args, k)}
    site_account = None
    if args.broker is not None:
        broker_url = args.broker
        transport = MqttTransport(args.broker, client_id, clean_session=True, **given, **login)
    elif config is not None:
        broker_url = config["broker.url"]
        if login:
            broker = config.section("broker")
            tls = {k: broker[k] for k in ("ca_file", "cert_file", "key_file") if broker.get(k)}
            transport = MqttTransport(broker_url, client_id, clean_session=True,
                                      **{**tls, **given}, **login)
        else:
            site_account = config.section("broker").get("username")
            transport = _mqtt_transport(config, client_id, clean_session=True, **given)
    else:
        broker_url = default("broker.url")
        transport = MqttTransport(broker_url, client_id, clean_session=True, **given, **login)
    federation = args.federation or (config["node.federation"] if config
                                     else default("node.federation"))
    try:
        transport.connect()
    except TransportError as exc:
        if site_account and "refused client" in str(exc):
            raise TransportError(
                f"{exc}; the site file's account {site_account!r} may be bound to its node's "
                "client id (docs/brokers.md \"Client ids bound to accounts\"): give the "
                "operator's with --username operator --password-file FILE") from None
        raise
    try:
        statuses = collect_statuses(
            transport, federation, args.wait,
            warn=lambda text: print(f"edgefl status: {text}", file=sys.stderr))
    finally:
        transport.close(timeout=1.0, announce_offline=False)
    rows = [statuses[n] for n in sorted(statuses)]
    if args.json:
        print(json.dumps(rows, indent=1))
    elif not rows:
        # The usual cause is a fleet on another federation or broker: say which were asked.
        print(f"no nodes have published a status in federation {federation!r} on "
              f"{shown_url(broker_url)}; another federation: --federation ID (or node.federation in "
              f"the site file given with --config), another broker: --broker URL")
    else:
        print(format_fleet(rows))
    return 0


STATUS = Command(
    "status",
    "print the fleet (node, online, version, profile, last round) from the retained status "
    "topics",
    _status_arguments, _status)
