"""`edgefl install-service`: write a role's systemd unit (with this interpreter's path), a
site-file skeleton and the sysusers entry for the `edgefl` user, then print the systemctl
commands. Nothing is downloaded, and the operator runs the printed commands; the one program
the installer runs is the unit's interpreter, `PYTHON -c "import edgefl"` (an argument list,
no shell), to refuse an interpreter the unit could not start edgefl with.

    plan = plan_install("client", "07", profile="rpi4")          # validates everything
    for path, action in install(plan): print(action, path)
    print(format_commands(plan))

The units are package data (edgefl/service/units/, mirrored in devices/systemd/ for review).
Their ExecStart names PYTHON_PLACEHOLDER, the venv path docs/deployment.md uses; the
installer puts the real interpreter there. `prefix` stages the files under another root
(tests, image builds); the paths inside the files stay the final ones. Staged for another
machine, whose interpreter is not on this one, `check_python=False` (--no-python-check)
checks only the interpreter's path.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from importlib import resources

import yaml

from ..config import dump_yaml, load_yaml, read_yaml_text
from ..io import atomic_write
from . import profiles
from .layered import ETC_DIR, KEYS, ROLES

__all__ = ["PYTHON_PLACEHOLDER", "InstallError", "InstallPlan", "PlannedFile", "ROLE_UNITS",
           "check_imports_edgefl", "check_interpreter", "check_node_id", "format_commands",
           "install", "plan_install", "render_unit", "unit_template"]

PYTHON_PLACEHOLDER = "/opt/edgefl/venv/bin/python"
UNIT_DIR = "/etc/systemd/system"
SYSUSERS_FILE = "/etc/sysusers.d/edgefl.conf"
STATE_ROOT = "/var/lib/edgefl"
# ProtectHome=yes and PrivateTmp=yes hide these from the service: an interpreter there
# cannot start (status=203/EXEC)
HIDDEN_FROM_SERVICE = ("/home", "/root", "/run/user", "/tmp", "/var/tmp")
# `import edgefl` loads NumPy and the C core: seconds on a Pi Zero 2 W reading a cold SD card
IMPORT_CHECK_TIMEOUT_S = 120.0
_SAFE_PATH = re.compile(r"^/[A-Za-z0-9/._+-]+$")
_SAFE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class InstallError(ValueError):
    """An installation that would not work; the message names the cause and the fix."""


@dataclass(frozen=True)
class RoleUnit:
    role: str
    template: str            # file name in edgefl/service/units/ and devices/systemd/
    command: str             # the edgefl subcommand ExecStart runs (a command of the CLI:
                             # tests/test_service.py checks every one)
    instance: bool           # a template unit: one instance per id

    def unit_name(self, node_id: str) -> str:
        return self.template.replace("@.", f"@{node_id}.") if self.instance else self.template

    def site_path(self, node_id: str) -> str:
        return os.path.join(ETC_DIR, f"{self.role}-{node_id}.yaml" if self.instance
                            else f"{self.role}.yaml")


ROLE_UNITS = {
    "client": RoleUnit("client", "edgefl-client@.service", "client", True),
    "aggregator": RoleUnit("aggregator", "edgefl-aggregator.service", "aggregator", False),
    "infer": RoleUnit("infer", "edgefl-infer.service", "serve", False),
}


def _units_dir():
    return resources.files("edgefl").joinpath("service").joinpath("units")


def unit_template(role: str) -> str:
    """The unit text of `role` as shipped (ExecStart names PYTHON_PLACEHOLDER)."""
    return _units_dir().joinpath(_role(role).template).read_text(encoding="utf-8")


def _role(role: str) -> RoleUnit:
    if role not in ROLE_UNITS:
        raise InstallError(f"role {role!r}: valid roles are {', '.join(ROLES)}")
    return ROLE_UNITS[role]


def check_interpreter(python: str, *, here: bool = True) -> str:
    """`python` if a systemd service can execute it and start edgefl with it: an absolute
    path without characters that systemd's ExecStart would interpret, outside the directories
    the units' sandbox hides; and with `here` (the default: the unit is for this machine) an
    executable file, whose real path (a venv's python is a symlink) is outside them too, and
    which imports edgefl (check_imports_edgefl). here=False, for files staged for another
    machine (--prefix with --no-python-check), checks only the path."""
    if not os.path.isabs(python):
        raise InstallError(f"interpreter {python!r}: need an absolute path")
    if not _SAFE_PATH.match(python):
        raise InstallError(f"interpreter {python!r}: the path has characters systemd's ExecStart "
                           f"would interpret (spaces, quotes, %, $); use a venv at a plain path "
                           f"such as {os.path.dirname(os.path.dirname(PYTHON_PLACEHOLDER))}")
    _check_not_hidden(python, python)
    if not here:
        return python
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise InstallError(f"interpreter {python}: no such executable file")
    real = os.path.realpath(python)
    if real != python:
        _check_not_hidden(python, real)
    check_imports_edgefl(python)
    return python


def _check_not_hidden(python: str, path: str) -> None:
    for hidden in HIDDEN_FROM_SERVICE:
        if path == hidden or path.startswith(hidden + "/"):
            what = python if path == python else f"{python} (a link to {path})"
            raise InstallError(
                f"interpreter {what} is under {hidden}, which the units' sandbox hides "
                f"(ProtectHome=yes, PrivateTmp=yes), so the service could not start: install "
                f"edgefl in a venv outside {', '.join(HIDDEN_FROM_SERVICE)} made with a Python "
                f"that is outside them too (docs/deployment.md uses "
                f"{os.path.dirname(os.path.dirname(PYTHON_PLACEHOLDER))} and the system's "
                f"python3) and run that venv's edgefl, or pass --python; from a development "
                f"checkout, docs/deployment.md \"From a development checkout\" has the recipe, "
                f"and --dry-run shows the files anyway")


def check_imports_edgefl(python: str, timeout: float = IMPORT_CHECK_TIMEOUT_S) -> None:
    """Raise InstallError unless `python -c "import edgefl"` succeeds, run as the unit runs
    it: an argument list (no shell), from / (not the installer's working directory, which
    may be a checkout of edgefl), without the installer's PYTHON* variables (PYTHONPATH) and
    user site-packages. The error names the interpreter and the import error. The check runs
    outside the sandbox: it cannot see what the sandbox would hide from the interpreter."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(PYTHONNOUSERSITE="1", PYTHONDONTWRITEBYTECODE="1")
    try:
        result = subprocess.run([python, "-c", "import edgefl"], cwd="/", env=env,
                                stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                timeout=timeout)
    except subprocess.TimeoutExpired:
        raise InstallError(f"interpreter {python}: `import edgefl` did not finish within "
                           f"{timeout:g} s, so the unit could not start either") from None
    except OSError as exc:
        raise InstallError(f"interpreter {python}: cannot run it ({exc.strerror})") from None
    if result.returncode != 0:
        lines = [line.strip() for line in result.stderr.splitlines() if line.strip()]
        why = lines[-1] if lines else f"exit status {result.returncode}, no message"
        raise InstallError(
            f"interpreter {python} cannot import edgefl ({why}), so the unit would fail on "
            f"every start: install edgefl into that interpreter's environment ({python} -m "
            f"pip install ./edgefl, a checkout or a wheel) or pass the python of the venv "
            f"edgefl is installed in; staging with --prefix for another machine, "
            f"--no-python-check skips this check")


def check_node_id(role: str, node_id: str | None) -> str:
    """The node id for `role`: required for client and infer (the client whose model infer
    serves), "aggregator" by default. It names a unit instance, files and a topic level, so
    it is restricted to letters, digits, '.', '_' and '-' (64 at most, no leading symbol)."""
    if node_id is None:
        if role == "aggregator":
            return "aggregator"
        what = "client id" if role == "client" else "id of the client whose model it serves"
        raise InstallError(f"--role {role} needs --id (the {what})")
    if not _SAFE_ID.match(node_id):
        raise InstallError(f"--id {node_id!r}: use 1-64 letters, digits, '.', '_' or '-', "
                           f"starting with a letter or digit (it names the unit instance, the "
                           f"site file and an MQTT topic level)")
    return node_id


def render_unit(role: str, python: str) -> str:
    """The unit of `role` with ExecStart's interpreter replaced by `python` (not checked
    here: see check_interpreter)."""
    text = unit_template(role)
    exec_lines = [line for line in text.splitlines() if line.startswith("ExecStart=")]
    if len(exec_lines) != 1 or not exec_lines[0].startswith(f"ExecStart={PYTHON_PLACEHOLDER} "):
        raise InstallError(f"{_role(role).template}: expected one ExecStart= line starting "
                           f"with {PYTHON_PLACEHOLDER}; the shipped unit was modified")
    return text.replace(f"ExecStart={PYTHON_PLACEHOLDER} ", f"ExecStart={python} ", 1)


@dataclass(frozen=True)
class PlannedFile:
    path: str        # the final path (/etc/...)
    target: str      # where it is written: path under the prefix
    content: str
    mode: int
    keep_existing: bool = False   # a site file the owner may have edited is never replaced
    owner: str | None = None      # user:group to own it (a private key: the service user)
    secret: bool = False          # a private key: never printed (--dry-run shows its path)


@dataclass(frozen=True)
class InstallPlan:
    role: str
    node_id: str
    profile: str
    profile_note: str
    unit: str                 # the unit to enable, e.g. edgefl-client@07.service
    python: str
    prefix: str
    files: tuple
    commands: tuple           # argument lists, printed for the operator
    warnings: tuple = ()


def plan_install(role: str, node_id: str | None = None, *, profile: str | None = None,
                 prefix: str = "/", python: str | None = None, check_python: bool = True,
                 device_tree_model: str = profiles.DEVICE_TREE_MODEL,
                 signing_key: str | None = None, trusted_keys: tuple = (),
                 dry_run: bool = False) -> InstallPlan:
    """Validate the request and build the files and commands of an installation.
    check_python=False (--no-python-check) is for files staged under a `prefix` for another
    machine: the interpreter's path is checked, not whether it exists here and imports
    edgefl (the plan warns).
    signing_key: a private key file to install as the node's keys.signing_key, or "new" to
    generate one: placed in /etc/edgefl/keys/ with mode 0600, owned by the service user (a
    printed chown, as the user exists once systemd-sysusers has run), its public key beside
    it. trusted_keys: public key files the node checks signatures with (a client: the
    aggregator's, keys.aggregator; the aggregator: the operators', keys.operators), each
    installed as the public key it parses as; a private key is refused, before anything is
    written.
    dry_run: an interpreter the unit could not run (a development venv under /home or
    /tmp) is a warning, not an error, so that anyone can see what install-service would
    write; install() of such a plan refuses to write it."""
    spec = _role(role)
    node_id = check_node_id(role, node_id)
    if not check_python and os.path.abspath(prefix) == "/":
        raise InstallError("--no-python-check is for staging files with --prefix for another "
                           "machine; a unit installed here runs this machine's interpreter, "
                           "which must import edgefl")
    warnings = []
    try:
        python = check_interpreter(python or sys.executable, here=check_python)
    except InstallError as exc:
        if not dry_run:
            raise
        python = python or sys.executable
        warnings.append(f"a real install stops here: {exc}")
    profile_given = profile is not None
    if profile is None:
        profile, how = profiles.detect_profile(device_tree_model)
        if profile is None:
            raise InstallError(f"cannot detect the board ({how}); pass --profile, one of "
                               f"{', '.join(profiles.profile_names())}")
        note = f"detected from {how}"
    else:
        try:
            profiles.profile_path(profile)
        except ValueError as exc:
            raise InstallError(f"--profile: {exc}") from None
        note = "from --profile"
    prefix = os.path.abspath(prefix)
    unit = spec.unit_name(node_id)

    def staged(path):
        return os.path.join(prefix, path.lstrip("/"))

    site = spec.site_path(node_id)
    sysusers = _units_dir().joinpath("sysusers-edgefl.conf").read_text(encoding="utf-8")
    unit_path = os.path.join(UNIT_DIR, spec.template)
    key_files, keys = _key_files(role, node_id, signing_key, trusted_keys, staged)
    profile_shown, note_shown = profile, note
    kept = _kept_site_file(staged(site), profile, note, profile_given, keys)
    if kept is not None:
        profile_shown, note_shown, more = kept
        warnings += more
    files = (
        PlannedFile(unit_path, staged(unit_path), render_unit(role, python), 0o644),
        PlannedFile(site, staged(site), site_skeleton(role, node_id, profile, keys), 0o644,
                    keep_existing=True),
        PlannedFile(SYSUSERS_FILE, staged(SYSUSERS_FILE), sysusers, 0o644),
    ) + key_files
    # the private key becomes the service user's once that user exists (systemd-sysusers)
    chowns = tuple(("chown", f.owner, f.path) for f in key_files if f.owner)
    commands = (("systemd-sysusers", SYSUSERS_FILE),) + chowns + (
        ("systemctl", "daemon-reload"), ("systemctl", "enable", "--now", unit))
    if not check_python:
        warnings.append(f"interpreter {python} not checked (--no-python-check): on the "
                        f"machine the files are for, it must exist and `{python} -c "
                        f"'import edgefl'` must succeed, or {unit} fails on every start")
    return InstallPlan(role, node_id, profile_shown, note_shown, unit, python, prefix, files,
                       commands, tuple(warnings))


def _kept_site_file(target: str, profile: str, note: str, given: bool, keys: dict):
    """What a site file that exists, which install() keeps as the operator edited it, makes
    of this installation: None when there is none, else (the profile the service runs
    with, where that comes from, warnings). A warning names each thing asked for that the
    kept file does not take: a --profile (`given`) other than the file's, and the keys.*
    settings of the key files installed now that the file does not set. Without them the
    report said "profile rpi4" and "written" for the keys while the service ran on with the
    old profile, signing nothing."""
    if not os.path.exists(target):        # as install() asks: a dangling link is replaced
        return None
    try:
        doc = load_yaml(read_yaml_text(target, "a site file"))
    except (ValueError, yaml.YAMLError) as exc:     # ConfigError is a ValueError
        return profile, note, [
            f"{target} exists and is kept as it is, but it does not read ({exc}): the "
            f"service cannot start until it is fixed (edgefl config show --config {target} "
            "names the problem)"]
    doc = doc if isinstance(doc, dict) else {}
    warnings = []
    has = doc.get("profile")
    auto = has is None or has == "auto"       # the service detects the board as it starts
    shown = profile
    if has != profile and (given or not auto):
        # the file's profile is the one the service runs with
        shown = "auto" if auto else str(has)
        note = (f"its site file's, kept{': detected at start' if auto else ''}; "
                f"{'--profile' if given else 'detected'} {profile} not applied")
        if given:
            warnings.append(f"{target} exists and is kept as it is: it says profile: "
                            f"{has if has is not None else '(none)'}, not {profile} "
                            f"(--profile); edit it to change that")
    set_keys = doc.get("keys") if isinstance(doc.get("keys"), dict) else {}
    missing = []
    for setting, value in keys.items():
        there = set_keys.get(setting)
        there = there if isinstance(there, list) else [there]
        wanted = value if isinstance(value, list) else [value]
        if any(path not in there for path in wanted):
            missing.append(f"keys.{setting}: {_flow(value)}")
    if missing:
        warnings.append(f"{target} exists and is kept as it is: it does not set "
                        f"{', '.join(missing)}; add them to it, or the service does not use "
                        f"the keys installed")
    return shown, note, warnings


KEYS_DIR = f"{ETC_DIR}/keys"
SERVICE_OWNER = "edgefl:edgefl"      # the units' User= and Group= (sysusers-edgefl.conf)


def _key_files(role: str, node_id: str, signing_key, trusted_keys, staged):
    """The key files of an installation and the keys.* settings naming them."""
    from ..transport.signing import (KeyFileError, generate_key, load_private_key,
                                     load_public_key, private_key_pem, public_key_pem)

    files, keys = [], {}
    if signing_key is not None:
        if role == "infer":
            raise InstallError("--signing-key: the inference service signs nothing")
        try:
            key = generate_key() if signing_key == "new" else load_private_key(signing_key)
        except KeyFileError as exc:
            raise InstallError(f"--signing-key: {exc}") from None
        path = f"{KEYS_DIR}/{role}-{node_id}.key"
        _keep_node_key(staged(path), key)
        private = private_key_pem(key).decode("ascii")
        public = public_key_pem(key).decode("ascii")
        files += [PlannedFile(path, staged(path), private, 0o600, owner=SERVICE_OWNER,
                              secret=True),
                  PlannedFile(path + ".pub", staged(path + ".pub"), public, 0o644)]
        keys["signing_key"] = path
    if trusted_keys:
        if role not in ("client", "aggregator"):
            raise InstallError("--trust-key: only the client and the aggregator check "
                               "signatures")
        setting = "aggregator" if role == "client" else "operators"
        paths = []
        for i, source in enumerate(trusted_keys):
            try:
                key = load_public_key(source)
            except KeyFileError as exc:          # it names the file
                raise InstallError(f"--trust-key {exc}") from None
            # the key as parsed, in the format `keys gen` writes, not the file's bytes:
            # only a public key reaches the board, whatever else the file held around it
            path = f"{KEYS_DIR}/{setting}-{i}.pub"
            files.append(PlannedFile(path, staged(path), public_key_pem(key).decode("ascii"),
                                     0o644))
            paths.append(path)
        keys[setting] = paths
    return tuple(files), keys


def _keep_node_key(target: str, key) -> None:
    """Refuse to replace a node's private key that is there with another: its public key is
    the one the fleet trusts (keys.fleet, a board's keys.aggregator), and the old key would
    be gone for good. A second `--signing-key new` (a reinstall) once did that silently."""
    from ..transport.signing import KeyFileError, fingerprint, load_private_key

    if not os.path.lexists(target):
        return
    try:
        there = fingerprint(load_private_key(target))
        if there == fingerprint(key):
            return                   # the same key: nothing changes
        what = f"holds this node's key (fingerprint {there})"
    except (KeyFileError, OSError) as exc:
        what = f"does not read as a private key ({exc})"
    raise InstallError(f"--signing-key: {target} exists and {what}: not replaced, as the "
                       f"fleet trusts its public key and the old key would be lost; leave "
                       f"--signing-key out to keep it (or give that file), or to change the "
                       f"key remove it first and give the fleet the new .pub")


def site_skeleton(role: str, node_id: str, profile: str, keys: dict | None = None) -> str:
    """The site file the installer writes: the settings only this site knows, and the
    profile's values as comments to override. keys: the keys.* settings of the key files
    installed with it."""
    site = _role(role).site_path(node_id)
    with open(profiles.profile_path(profile), encoding="utf-8") as f:
        board = load_yaml(f) or {}
    who = {"client": f"edgefl client {node_id}", "aggregator": "the edgefl aggregator",
           "infer": f"the edgefl inference service (model of client {node_id})"}[role]
    lines = [
        f"# Site settings of {who}, written by `edgefl install-service`.",
        f"# Layers, later ones win: package defaults -> device profile {profile} -> this file",
        "# -> --set on the command line. To see every value and where it came from:",
        f"#   edgefl config show --role {role} --config {site}",
        f"profile: {profile}",
    ]
    if role in ("client", "aggregator"):
        lines += [
            "node:",
            f"  id: {_yaml_scalar(node_id)}",
            "  federation: default",
            "broker:",
            "  url: mqtt://localhost:1883      # e.g. mqtts://gateway.local:8883 (TLS)",
            f"  # username: {_yaml_scalar(node_id)}",
            f"  # password_file: {ETC_DIR}/{role}-{node_id}.password   # mode 0640, group edgefl",
            f"  # ca_file: {ETC_DIR}/ca.crt",
        ]
    if role == "aggregator":
        # its control connection's own account, where the broker binds accounts to client
        # ids (edgefl broker accounts, docs/brokers.md)
        lines += [
            f"  # control_username: {_yaml_scalar(node_id + '-ctl')}",
            f"  # control_password_file: {ETC_DIR}/{role}-{node_id}-ctl.password",
        ]
    if role == "client":
        lines += [
            "data:                            # this board's training data (docs/data.md)",
            "  name: fashion-mnist            # a demo (apt install dataset-fashion-mnist);",
            "  limit_train: 6000              # replace with the board's own npz or csv",
        ]
    if role == "aggregator":
        lines += ["run: quickstart                  # optional: a run config queued first, once "
                  "(a YAML file in",
                  "#                                  # edgefl simulate's format, or a built-in "
                  "name). Without it the",
                  "#                                  # service waits for runs started with "
                  "`edgefl ctl start CONFIG`",
                  "# clients: [pi-01, pi-02, pi-03]   # the client ids in the order of the run's "
                  "partition",
                  "#                                  # (default: client-0 ... client-<N-1>)",
                  "round:",
                  "  deadline: 300.0                # seconds a round waits for updates",
                  "  quorum: 1.0                    # close early once this fraction of "
                  "uploaders sent theirs",
                  "  min_updates: 1                 # fewer at the deadline: the round is "
                  "announced again",
                  "export:                          # the global model to ONNX, published on "
                  "the onnx topic",
                  "  every: 0                       # also after every N-th round (0: the "
                  "final model only)",
                  "  quantize: none                 # or int8",
                  "  publish: true                  # for the clients to install (and "
                  "edgefl serve to serve)"]
    if role == "infer":
        lines += ["infer:",
                  f"  model: {STATE_ROOT}/client-{node_id}/model.onnx   # written by "
                  f"edgefl-client@{node_id}",
                  "  # socket: null                 # default /run/edgefl-infer/predict.sock "
                  "($RUNTIME_DIRECTORY)",
                  "  # listen: 127.0.0.1:8080       # also TCP: remove PrivateNetwork=yes from "
                  "the unit first"]
    if role in ("client", "aggregator"):
        lines += _keys_section(role, keys or {})
    board_lines = []
    for section, values in board.items():
        if section in KEYS:          # a top-level key (suggested_model), not a section
            if role in KEYS[section].roles:
                board_lines.append(f"# {section}: {_flow(values)}")
            continue
        keys = [(k, v) for k, v in values.items() if role in KEYS[f"{section}.{k}"].roles]
        if keys:
            board_lines.append(f"# {section}:")
            board_lines += [f"#   {k}: {_flow(v)}" for k, v in keys]
    if board_lines:
        # named by the package-relative path, not this machine's: files staged with --prefix
        # go to a board whose edgefl is installed elsewhere
        where = _in_package(profiles.profile_path(profile))
        lines += ["", f"# The profile's settings ({profile}, {where} in the package); "
                      "uncomment to override:"] + board_lines
    lines += ["# log:", "#   level: info"]
    return "\n".join(lines) + "\n"


def _keys_section(role: str, keys: dict) -> list:
    """The keys section: what install-service placed, and the rest commented
    (docs/deployment.md "Keys"; docs/security.md)."""
    lines = ["keys:                            # Ed25519 signatures (docs/security.md)"
             if keys else "# keys:                          # Ed25519 signatures "
             "(docs/security.md)"]
    c = "" if keys else "# "
    if "signing_key" in keys:
        lines.append(f"  signing_key: {keys['signing_key']}   # mode 0600, the service user's")
    else:
        lines.append(f"{c}  # signing_key: {KEYS_DIR}/{role}-<id>.key   # edgefl keys gen, "
                     "or install-service --signing-key new")
    if role == "client":
        if "aggregator" in keys:
            lines.append(f"  aggregator: {_flow(keys['aggregator'])}")
        else:
            lines.append(f"{c}  # aggregator: [{KEYS_DIR}/aggregator.pub]   # refuse what "
                         "the aggregator did not sign")
    else:
        lines.append(f"{c}  # fleet: {KEYS_DIR}/fleet        # <client id>.pub of every board")
        if "operators" in keys:
            lines.append(f"  operators: {_flow(keys['operators'])}")
        else:
            lines.append(f"{c}  # operators: [{KEYS_DIR}/operator.pub]   # commands must be "
                         "signed")
    return lines


def _in_package(path: str) -> str:
    """`path` relative to the directory the edgefl package is in: edgefl/profiles/rpi4.yaml."""
    import edgefl

    root = os.path.dirname(os.path.dirname(os.path.abspath(edgefl.__file__)))
    return os.path.relpath(path, root)


def _yaml_scalar(value: str) -> str:
    # quoted when edgefl's YAML would read it as something else ("07" is an int, "on" a
    # bool, "1e5" a float)
    return value if load_yaml(value) == value else f'"{value}"'


def _flow(value) -> str:
    if isinstance(value, str):
        return _yaml_scalar(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return dump_yaml(value, default_flow_style=True, sort_keys=False).strip()


def install(plan: InstallPlan, dry_run: bool = False) -> list[tuple[str, str]]:
    """Write the plan's files (nothing with dry_run). Returns (path, action) pairs, action one
    of "written", "replaced", "unchanged", "kept (exists)", or "would write" and so on with
    dry_run."""
    refused = [w for w in plan.warnings if w.startswith("a real install stops here: ")]
    if refused and not dry_run:      # a dry run's plan: its interpreter failed the checks
        raise InstallError(refused[0][len("a real install stops here: "):])
    if not dry_run and plan.prefix == "/" and hasattr(os, "geteuid") and os.geteuid() != 0:
        raise InstallError(f"writing {UNIT_DIR} and {ETC_DIR} needs root: run it with sudo, "
                           f"e.g. sudo {os.path.dirname(plan.python)}/edgefl install-service ...")
    done = []
    for f in plan.files:
        exists = os.path.exists(f.target)
        if exists and f.keep_existing:
            action = "kept (exists)"
        elif exists:
            with open(f.target, encoding="utf-8") as old:
                action = "unchanged" if old.read() == f.content else "replaced"
        else:
            action = "written"
        if dry_run:
            action = {"written": "would write", "replaced": "would replace"}.get(action, action)
        elif action in ("written", "replaced"):
            _write(f.target, f.content, f.mode)
            if f.owner:
                _own(f.target, f.owner, plan.prefix)
        done.append((f.target, action))
    return done


def _write(path: str, content: str, mode: int) -> None:
    directory = os.path.dirname(path)
    try:
        os.makedirs(directory, exist_ok=True)
        atomic_write(path, content, mode=mode)
    except PermissionError as exc:
        raise InstallError(f"{directory}: permission denied ({exc.strerror}); run as root or "
                           f"stage the files with --prefix DIR") from None


def _own(path: str, owner: str, prefix: str) -> None:
    """chown to the service user now when that is possible (root, installing on this
    machine, the user exists); otherwise the printed chown does it."""
    import shutil

    if prefix != "/" or not hasattr(os, "geteuid") or os.geteuid() != 0:
        return
    user, group = owner.split(":")
    try:
        shutil.chown(path, user, group)
    except (LookupError, OSError):
        pass      # the user is made by systemd-sysusers, then the printed chown runs


def format_commands(plan: InstallPlan) -> str:
    """The commands for the operator, one per line, shell-quoted (printed, never run)."""
    lines = [shlex.join(c) for c in plan.commands]
    return "\n".join(lines)


def format_report(plan: InstallPlan, done, dry_run: bool) -> str:
    lines = [f"{plan.unit}: {plan.role} {plan.node_id}, profile {plan.profile} "
             f"({plan.profile_note}), interpreter {plan.python}"]
    width = max(len(action) for _, action in done)
    lines += [f"  {action:<{width}}  {path}" for path, action in done]
    if dry_run:
        for f in plan.files:
            body = (f"(a private key, mode {f.mode:04o}, owned by {f.owner}: not shown)"
                    if f.secret else f.content.rstrip("\n"))
            lines += ["", f"--- {f.target}", body]
        lines.append("")
    for warning in plan.warnings:
        lines.append(f"warning: {warning}")
    if plan.prefix != "/":
        lines.append(f"staged under {plan.prefix}: copy the files to / (their paths inside are "
                     f"final), then on the board, as root:")
    else:
        lines.append("next, as root:")
    lines += ["  " + line for line in format_commands(plan).splitlines()]
    lines.append(f"then: journalctl -u {plan.unit} -f    and    systemctl status {plan.unit}")
    return "\n".join(lines)

