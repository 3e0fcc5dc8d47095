"""Running edgefl as systemd services on boards (issue #6): what the roles (`edgefl client`,
`edgefl aggregator`, the inference service) call around their main loop.

    layered   the layered configuration: defaults -> device profile -> site file -> --set
    keys      the key table of the settings: each key's type, roles and valid values
    profiles  the device profiles (edgefl/profiles/*.yaml), board detection, threads, memory
    notify    sd_notify over NOTIFY_SOCKET: READY, STATUS, WATCHDOG pings, STOPPING
    signals   SIGTERM/SIGINT -> a stop event; a second signal kills
    logs      journald-friendly logging (syslog priority prefixes, no duplicate timestamps)
    status    the fleet table of `edgefl status`
    install   `edgefl install-service`: unit, site-file skeleton, sysusers entry

A role's start-up and main loop, in this order:

    from edgefl.service import layered, logs, notify, profiles, signals

    config = layered.service_config_from_args("client", args)   # ConfigError names file+key
    logs.setup_logging(config["log.level"])
    profiles.apply_threads(config["compute.threads"])
    stop = signals.install_stop_handlers()
    notifier = notify.Notifier.from_environment()
    state_dir = config.state_dir
    ... load state and data; profiles.check_memory_budget(config["compute.memory_budget_mb"],
                                                          "after loading data")
    ... connect to config["broker.url"]
    notifier.ready(f"client {config['node.id']}: waiting for a round")
    with notifier.watchdog_pinger(healthy=notifier.heartbeat_check()):
        while not stop.is_set():
            notifier.beat()             # no beat for half of WatchdogSec=: no pings
            ...one step (long C calls in a worker thread)...
            notifier.status(f"round {r}: training")
            stop.wait(poll_seconds)
    notifier.stopping()
    ... persist state; return 0
"""
