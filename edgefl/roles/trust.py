"""What a role signs with and whom it believes: the keys of a node's site file (`keys.*`,
edgefl/service/keys.py) loaded into a Signer and Verifiers (edgefl.transport.signing).

    trust = Trust.load(fed="lab", node="client-3", signing_key="/etc/edgefl/keys/client-3",
                       aggregator=["/etc/edgefl/keys/aggregator.pub"])
    trust.signer                # signs this node's messages, or None (sends unsigned)
    trust.downlink              # a board's check of the aggregator's messages, or None
    trust.uplink                # the aggregator's check of the boards' updates, or None
    trust.operators             # the aggregator's check of commands, or None

`edgefl ctl` checks the aggregator's replies with the boards' check of the aggregator
(aggregator_verifier of the same keys.aggregator, or of --aggregator-key).

A None check means that direction is not checked: the node behaves as before signatures
existed (and says so in its log and status). A key file that cannot be read stops the role
at start with KeyFileError naming the file and the setting, never later.
"""
from __future__ import annotations

import glob
import os
from dataclasses import dataclass

from ..privacy import secagg
from ..transport.signing import (KeyFileError, SignatureError, Signer, Verifier,
                                 check_envelope_shape, load_public_key)

__all__ = ["Trust", "aggregator_verifier", "fleet_key_files", "secure_signer",
           "verify_secure", "secure_context"]


def secure_context(announce_id: str, node: str) -> str:
    """What a secure aggregation message's signature binds besides run and round: the
    round attempt (its announcement id) and the board whose exchange it is (the sender of
    an upload, the recipient of a phase message)."""
    return f"{announce_id}|{node}"


def secure_signer(signer: Signer | None, run: str, round: int, context: str):
    """The `sign` argument of secagg.to_chunks for one attempt and board, or None (unsigned):
    the envelope's nonce is the message id."""
    if signer is None:
        return None

    def sign(body, message_id: int) -> dict:
        return signer.envelope("secure", run, round,
                               secagg.secure_digest(context, message_id, body),
                               nonce=f"{message_id:016x}")
    return sign


def verify_secure(verifier: Verifier, sealed: "secagg.Sealed", *, context: str, run: str,
                  round: int, by: str, where: str) -> dict:
    """The checked envelope of a reassembled secure message (SignatureError saying why):
    signed by `by`'s own key, for this federation, run, round, attempt and board (the
    context), and this message id."""
    env = check_envelope_shape(sealed.envelope, where)     # an unsigned one costs no hash
    env = verifier.verify(env, secagg.secure_digest(context, sealed.message_id, sealed.body),
                          kind="secure", where=where, run=run, round=round, by=by)
    if env["nonce"] != f"{sealed.message_id:016x}":
        raise SignatureError(f"{where}: signed as message {env['nonce']}, it came as "
                             f"{sealed.message_id:016x}")
    return env


def fleet_key_files(fleet) -> dict:
    """{node id: public key file} of keys.fleet: a mapping as it is, or the <id>.pub files of
    a directory."""
    if fleet is None:
        return {}
    if isinstance(fleet, dict):
        return dict(fleet)
    if not os.path.isdir(fleet):
        raise KeyFileError(f"keys.fleet: {fleet} is not a directory of <node id>.pub files")
    return {os.path.basename(p)[:-len(".pub")]: p
            for p in sorted(glob.glob(os.path.join(glob.escape(fleet), "*.pub")))}


def _public_keys(paths, setting: str) -> list:
    try:
        return [load_public_key(p) for p in paths]
    except KeyFileError as exc:
        raise KeyFileError(f"{setting}: {exc}") from None


def aggregator_verifier(fed: str, paths, setting: str = "keys.aggregator") -> Verifier | None:
    """The check of the aggregator's messages against its public key file(s) `paths` (any
    signer id may use them: a key change-over lists two), or None when there are none.
    KeyFileError naming `setting` and the file."""
    return Verifier(fed, {"*": _public_keys(paths, setting)}) if paths else None


@dataclass(frozen=True, eq=False)
class Trust:
    fed: str
    signer: Signer | None = None
    downlink: Verifier | None = None
    uplink: Verifier | None = None
    operators: Verifier | None = None
    command_window_s: float = 120.0

    @property
    def fingerprint(self) -> str | None:
        """This node's own key's fingerprint (published in its status), or None."""
        return self.signer.fingerprint if self.signer is not None else None

    @property
    def active(self) -> bool:
        """Whether this node signs or checks anything."""
        return any(x is not None for x in (self.signer, self.downlink, self.uplink,
                                           self.operators))

    def describe(self) -> str:
        """One log line: what this node signs and checks."""
        parts = [f"signs with key {self.signer.fingerprint}" if self.signer else
                 "signs nothing (keys.signing_key unset)"]
        for name, v in (("aggregator messages", self.downlink), ("updates", self.uplink),
                        ("commands", self.operators)):
            if v is not None:
                parts.append(f"checks {name} against {', '.join(v.fingerprints)}")
        return "signatures: " + "; ".join(parts)

    @classmethod
    def load(cls, *, fed: str, node: str | None, signing_key=None, aggregator=None,
             fleet=None, operators=None, command_window_s: float = 120.0) -> "Trust":
        signer = None
        if signing_key is not None:
            try:
                signer = Signer.from_file(signing_key, node or "?", fed)
            except KeyFileError as exc:
                raise KeyFileError(f"keys.signing_key: {exc}") from None
        downlink = aggregator_verifier(fed, aggregator)
        files = fleet_key_files(fleet)
        uplink = Verifier(fed, {n: _public_keys([p], f"keys.fleet ({n})")
                                for n, p in files.items()}) if fleet is not None else None
        ops = Verifier(fed, {"*": _public_keys(operators, "keys.operators")}) \
            if operators else None
        return cls(fed, signer, downlink, uplink, ops, float(command_window_s))

    @classmethod
    def from_service_config(cls, config, role: str) -> "Trust":
        get = config.get               # a key of the other role: None
        return cls.load(fed=config["node.federation"], node=config["node.id"],
                        signing_key=get("keys.signing_key"),
                        aggregator=get("keys.aggregator") if role == "client" else None,
                        fleet=get("keys.fleet") if role == "aggregator" else None,
                        operators=get("keys.operators") if role == "aggregator" else None,
                        command_window_s=get("keys.command_window") or 120.0)

