"""The broker accounts of a federation, generated: one account per MQTT connection, each
bound to its client id, with the access each needs, as the state file of Mosquitto's
dynamic security plugin, plus every account's password file and the broker section of each
node's site file (`edgefl broker accounts`, `edgefl fleet up`).

Why one account per connection, bound to its client id: MQTT identifies a session by its
client id, and a broker that lets any account connect under any id lets a board's account
take the aggregator's session over (the broker closes the older connection, and a clean
connect wipes its queued QoS 1 updates). The dynamic security plugin (shipped with
Mosquitto >= 2.0) refuses a connection whose client id is not the one bound to its
account, before it touches the session in place; docs/brokers.md has the measurements
and why `use_username_as_clientid` was not chosen.

The connections of a federation and their accounts (username = client id):

    aggregator        the aggregator's rounds (edgefl/roles/aggregator.py)
    aggregator-ctl    the aggregator service's control connection (roles/daemon.py)
    client-1 ...      one per board
    operator          people's tools (edgefl ctl, status, dashboards): not bound, since
                      each tool run connects under a fresh id; see docs/brokers.md
    edgefl-admin      the plugin's own administration ($CONTROL/dynamic-security), for
                      adding a board to a running broker with mosquitto_ctrl; not bound

Passwords are random (192 bits), so the hash's work factor is not what protects them; they
are hashed as the plugin itself hashes (PBKDF2-HMAC-SHA512, Mosquitto's iteration count)
through `cryptography`.
"""
from __future__ import annotations

import base64
import glob
import json
import os
import secrets
from dataclasses import dataclass, field
from typing import Sequence

from ..io import atomic_write
from ..transport.topics import DEFAULT_PREFIX, Topics, validate_id

__all__ = ["Account", "FederationAccounts", "federation_accounts", "dynsec_state",
           "hash_password", "find_dynsec_plugin", "write_accounts", "DYNSEC_FILE",
           "password_file_line", "acl_text", "write_password_file_accounts",
           "CREDENTIALS_DIR", "OPERATOR", "ADMIN", "control_username"]

DYNSEC_FILE = "dynamic-security.json"     # the plugin's state, under the output directory
CREDENTIALS_DIR = "credentials"           # <username>.pw, one per account, mode 0600
OPERATOR = "operator"
ADMIN = "edgefl-admin"
# What Mosquitto 2.0's own tools write (mosquitto_ctrl, mosquitto_passwd): the broker hashes
# each connect's password this many times, so a higher count costs the gateway at every
# reconnect storm without protecting a random password any better.
ITERATIONS = 101
_SALT_BYTES = 12

# Where Debian, Raspberry Pi OS, Fedora and a source install put the plugin.
_DYNSEC_CANDIDATES = ("/usr/lib/*/mosquitto_dynamic_security.so",
                      "/usr/lib/mosquitto_dynamic_security.so",
                      "/usr/lib64/mosquitto_dynamic_security.so",
                      "/usr/local/lib/mosquitto_dynamic_security.so")


def control_username(aggregator: str) -> str:
    """The account (and client id) of the aggregator service's control connection: the
    daemon connects it as `<node id>-ctl` (roles/daemon.py)."""
    return f"{aggregator}-ctl"


@dataclass(frozen=True)
class Account:
    """One broker account: its username, the client id bound to it (None: any), the dynsec
    role that grants its access, what it is for, and its password (never printed)."""
    username: str
    client_id: str | None
    role: str
    purpose: str
    password: str = field(repr=False)


@dataclass(frozen=True)
class FederationAccounts:
    federation: str
    prefix: str
    aggregator: str
    clients: tuple
    accounts: tuple

    def account(self, username: str) -> Account:
        for account in self.accounts:
            if account.username == username:
                return account
        raise KeyError(f"no account {username!r} in federation {self.federation!r}; "
                       f"accounts: {', '.join(a.username for a in self.accounts)}")


def federation_accounts(federation: str, clients: Sequence[str], *,
                        aggregator: str = "aggregator", prefix: str = DEFAULT_PREFIX,
                        passwords: dict | None = None) -> FederationAccounts:
    """The accounts of a federation with these client ids. passwords: {username: password}
    to keep (e.g. read back from an earlier run); the others are drawn at random."""
    validate_id(federation, "federation id")
    validate_id(aggregator, "aggregator id")
    clients = tuple(validate_id(c, "client id") for c in clients)
    if not clients:
        raise ValueError("a federation needs at least one client id")
    names = [aggregator, control_username(aggregator), *clients, OPERATOR, ADMIN]
    seen = set()
    for name in names:
        if name in seen:
            raise ValueError(f"account {name!r} appears twice (client ids must differ from "
                             f"each other and from {aggregator!r}, "
                             f"{control_username(aggregator)!r}, {OPERATOR!r}, {ADMIN!r})")
        seen.add(name)
    passwords = dict(passwords or {})

    def make(username, client_id, role, purpose):
        password = passwords.get(username) or secrets.token_urlsafe(24)
        return Account(username, client_id, role, purpose, password)

    accounts = [
        make(aggregator, aggregator, "edgefl-aggregator", "the aggregator's rounds"),
        make(control_username(aggregator), control_username(aggregator), "edgefl-aggregator",
             "the aggregator service's control connection"),
        *(make(c, c, f"edgefl-board-{c}", f"board {c}") for c in clients),
        make(OPERATOR, None, "edgefl-operator",
             "operators' tools: edgefl ctl, edgefl status, dashboards"),
        make(ADMIN, None, "edgefl-admin",
             "administration of the accounts on a running broker (mosquitto_ctrl dynsec)"),
    ]
    return FederationAccounts(federation, prefix, aggregator, clients, tuple(accounts))


def hash_password(password: str, salt: bytes | None = None,
                  iterations: int = ITERATIONS) -> dict:
    """The dynamic security plugin's fields for a password: PBKDF2-HMAC-SHA512 over the
    password with a random salt, base64-encoded as the plugin stores them."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.pbkdf2 import PBKDF2HMAC

    from ..forksafe import openssl

    salt = os.urandom(_SALT_BYTES) if salt is None else salt
    with openssl():
        digest = PBKDF2HMAC(algorithm=hashes.SHA512(), length=64, salt=salt,
                            iterations=iterations).derive(password.encode())
    return {"password": base64.b64encode(digest).decode(),
            "salt": base64.b64encode(salt).decode(), "iterations": iterations}


def _acl(kind: str, topic: str) -> dict:
    return {"acltype": kind, "topic": topic, "allow": True}


def _writes(*topics: str) -> list:
    return [_acl("publishClientSend", t) for t in topics]


def _reads(*filters: str) -> list:
    # subscribePattern: the filter subscribed to must lie within the ACL's (an ACL of
    # update/+ allows update/+ and update/client-1); publishClientReceive: delivery
    return [acl for f in filters for acl in (_acl("subscribePattern", f),
                                             _acl("publishClientReceive", f))]


def _roles(fed: FederationAccounts) -> list:
    """The access of each account, the same grants as broker/acl (docs/brokers.md's table),
    spelled out for this federation."""
    t = Topics(fed.federation, fed.prefix)
    agg = fed.aggregator
    roles = [
        {"rolename": "edgefl-aggregator",
         "textdescription": "the aggregator service's two connections",
         "acls": _writes(t.round(), t.model(), t.subscription("client_model"), t.onnx(),
                         f"{t.onnx()}/+", t.events(), t.subscription("reply"),
                         t.subscription("runs"), t.status(agg), t.metrics(agg),
                         t.subscription("secure_to"), t.subscription("task"))
         + _reads(t.subscription("update"), t.subscription("status"),
                  t.subscription("metrics"), t.ctl(), t.subscription("secure"))},
        *({"rolename": f"edgefl-board-{c}", "textdescription": f"board {c}",
           "acls": _writes(t.update(c), t.status(c), t.metrics(c), t.secure(c))
           + _reads(t.round(), t.model(), t.client_model(c), t.onnx(), f"{t.onnx()}/+",
                    t.events(), t.secure_to(c), t.topic("task", c))} for c in fed.clients),
        {"rolename": "edgefl-operator", "textdescription": "operators: commands, and read all",
         "acls": _writes(t.ctl()) + _reads(f"{t.base}/#")},
        {"rolename": "edgefl-admin", "textdescription": "the dynamic security plugin's API",
         "acls": _writes("$CONTROL/dynamic-security/#")
         + _reads("$CONTROL/dynamic-security/#")},
    ]
    return roles


def dynsec_state(fed: FederationAccounts) -> dict:
    """The dynamic security plugin's state (its plugin_opt_config_file) for the federation:
    every account with its bound client id, hashed password and role; anything not granted
    is denied."""
    clients = []
    for a in fed.accounts:
        entry = {"username": a.username, "textname": a.purpose}
        if a.client_id is not None:
            entry["clientid"] = a.client_id
        entry.update(hash_password(a.password))
        entry["roles"] = [{"rolename": a.role}]
        clients.append(entry)
    return {"clients": clients, "groups": [], "roles": _roles(fed),
            "defaultACLAccess": {"publishClientSend": False, "publishClientReceive": False,
                                 "subscribe": False, "unsubscribe": True}}


def password_file_line(username: str, password: str, salt: bytes | None = None,
                       iterations: int = ITERATIONS) -> str:
    """One line of a Mosquitto password file in the format mosquitto_passwd writes
    (`user:$7$<iterations>$<salt>$<hash>`, PBKDF2-HMAC-SHA512, base64), for a broker
    without the dynamic security plugin; no trailing newline."""
    fields = hash_password(password, salt, iterations)
    return f"{username}:$7${iterations}${fields['salt']}${fields['password']}"


def acl_text(fed: FederationAccounts) -> str:
    """A Mosquitto acl_file granting each account the topics its dynsec role grants: for a
    broker without the plugin. It binds no client id (docs/brokers.md)."""
    lines = [f"# Mosquitto ACL of federation {fed.federation}, written by `edgefl broker "
             "accounts --mechanism passwd`.",
             "# It grants what the dynamic security accounts grant, but binds no client id: "
             "any account",
             "# can take another's session over (docs/brokers.md). Anything not granted is "
             "denied.", ""]
    roles = {r["rolename"]: r for r in _roles(fed)}
    for a in fed.accounts:
        if a.username == ADMIN:
            continue                    # the plugin's own API: nothing to grant without it
        lines.append(f"user {a.username}")
        for acl in roles[a.role]["acls"]:
            if acl["acltype"] == "publishClientSend":
                lines.append(f"topic write {acl['topic']}")
            elif acl["acltype"] == "subscribePattern":
                lines.append(f"topic read {acl['topic']}")
        lines.append("")
    return "\n".join(lines)


def write_password_file_accounts(fed: FederationAccounts, out_dir: str) -> dict:
    """The accounts for a broker without the dynamic security plugin: out_dir/broker/
    passwords (hashed by mosquitto_passwd when it is installed, else in its format here),
    out_dir/broker/acl and the credentials, all mode 0600. Refuses to replace files."""
    import shutil
    import subprocess

    broker_dir = os.path.join(out_dir, "broker")
    cred_dir = os.path.join(out_dir, CREDENTIALS_DIR)
    passwords = os.path.join(broker_dir, "passwords")
    acl = os.path.join(broker_dir, "acl")
    accounts = [a for a in fed.accounts if a.username != ADMIN]
    credentials = {a.username: os.path.join(cred_dir, f"{a.username}.pw") for a in accounts}
    existing = [p for p in (passwords, acl, *credentials.values()) if os.path.lexists(p)]
    if existing:
        raise FileExistsError(f"{existing[0]}: exists (accounts were generated there "
                              f"before); choose another directory")
    os.makedirs(broker_dir, exist_ok=True)
    os.makedirs(cred_dir, mode=0o700, exist_ok=True)
    passwd = shutil.which("mosquitto_passwd") or next(
        (p for p in ("/usr/bin/mosquitto_passwd", "/usr/local/bin/mosquitto_passwd")
         if os.access(p, os.X_OK)), None)
    if os.environ.get("EDGEFL_MOSQUITTO_PASSWD") is not None:     # tests: "none" = absent
        passwd = os.environ["EDGEFL_MOSQUITTO_PASSWD"] or None
        passwd = None if passwd == "none" else passwd
    if passwd:
        # the plain lines exist only in this 0600 file until mosquitto_passwd hashes them
        atomic_write(passwords, "".join(f"{a.username}:{a.password}\n" for a in accounts),
                     mode=0o600)
        done = subprocess.run([passwd, "-U", passwords], capture_output=True, text=True,
                              timeout=60)
        if done.returncode != 0:
            os.unlink(passwords)
            raise OSError(f"{passwd} -U {passwords} failed ({done.returncode}): "
                          f"{(done.stderr or done.stdout).strip()}")
    else:
        atomic_write(passwords, "".join(password_file_line(a.username, a.password) + "\n"
                                        for a in accounts), mode=0o600)
    atomic_write(acl, acl_text(fed), mode=0o600)
    for a in accounts:
        atomic_write(credentials[a.username], a.password + "\n", mode=0o600)
    return {"passwords": passwords, "acl": acl, "credentials": credentials,
            "hashed_by": passwd or "edgefl"}


def find_dynsec_plugin() -> str | None:
    """The dynamic security plugin's shared object, or None if it is not installed (it ships
    in Debian's mosquitto package from 2.0)."""
    override = os.environ.get("EDGEFL_MOSQUITTO_DYNSEC")
    if override is not None:
        return override if override and os.path.exists(override) else None
    for pattern in _DYNSEC_CANDIDATES:
        for path in sorted(glob.glob(pattern)):
            return path
    return None


def write_accounts(fed: FederationAccounts, out_dir: str) -> dict:
    """Write the plugin's state to out_dir/broker/dynamic-security.json (mode 0600: it holds
    the hashes, and the broker rewrites it when accounts change) and each account's password
    to out_dir/credentials/<username>.pw (mode 0600). Returns {"dynsec": path,
    "credentials": {username: path}}. Refuses to replace files that exist: they would
    change passwords a running fleet uses."""
    broker_dir = os.path.join(out_dir, "broker")
    cred_dir = os.path.join(out_dir, CREDENTIALS_DIR)
    dynsec = os.path.join(broker_dir, DYNSEC_FILE)
    credentials = {a.username: os.path.join(cred_dir, f"{a.username}.pw")
                   for a in fed.accounts}
    existing = [p for p in (dynsec, *credentials.values()) if os.path.lexists(p)]
    if existing:
        raise FileExistsError(f"{existing[0]}: exists (accounts were generated there "
                              f"before); choose another directory, or remove "
                              f"{broker_dir} and {cred_dir} to draw new passwords")
    os.makedirs(broker_dir, exist_ok=True)
    os.makedirs(cred_dir, mode=0o700, exist_ok=True)
    atomic_write(dynsec, json.dumps(dynsec_state(fed), indent=1) + "\n", mode=0o600)
    for a in fed.accounts:
        atomic_write(credentials[a.username], a.password + "\n", mode=0o600)
    return {"dynsec": dynsec, "credentials": credentials}
