"""Ed25519 signatures on what the roles exchange: the keys, the signed envelope, and its
checks (docs/protocol.md "Signatures", docs/security.md).

Who signs what:

    aggregator  round and end-of-run announcements, model and client_model frames, the ONNX
                manifest and the ONNX frame its parts make up        -> checked by boards
    board       its update frames                                    -> checked by the aggregator
    operator    control commands (`edgefl ctl`)                      -> checked by the aggregator
    aggregator  its replies to control commands (kind "reply")       -> checked by `edgefl ctl`
    aggregator  its service's events (kind "event") and retained run records (kind
                "run_record"; roles/signed_log.py)                   -> checked by `edgefl ctl`
    both        secure aggregation messages (kind "secure": a board's keys, shares, masked
                input and unmasking answer; the aggregator's phase messages to a board)
                                                                     -> checked by the other

A JSON document carries its envelope as the field "sig"; a frame carries it as the scalar
"sig" (edgefl.transport.wire.content_digest says what its hash covers: header fields,
metadata, and the payload bytes as they travel). The envelope:

    {"v": 1, "kind": "announce", "fed": "lab", "run": "3f9c...", "round": 3,
     "by": "aggregator", "key": "<fingerprint>", "nonce": "<16 hex>", "at": 1700000000.0,
     "exp": null, "hash": "<sha256 of the content>", "sig": "<base64 of 64 bytes>"}

`sig` is Ed25519 over DOMAIN + the canonical JSON (sorted keys, no spaces, ASCII) of the
envelope without "sig": a signature is of a hash and these fields, never of a copy of a 4 MB
frame, and binds the content to its federation, run, round, kind and signer, so it cannot be
moved to another federation, run, round or message kind. "exp" (Unix time) is set where a
message must not outlive a window (operator commands and the replies to them); a round's
messages are bound to their run and round instead, as a retained announcement may be read
hours later (and the service's events and run records to their run: a log, and a retained
record read later).

Keys are files: the private key PEM (PKCS#8, unencrypted: a service starts unattended; the
file is 0600 and the service user's) and the public key PEM (SubjectPublicKeyInfo) beside it
as `<name>.pub`; a raw 32-byte key file is read too. A key's fingerprint is the first 16 hex
digits of the sha256 of its 32 raw public bytes. Only `cryptography` computes signatures.
"""
from __future__ import annotations

import base64
import hashlib
import json
import math
import os
import time
from typing import Iterable, Mapping

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (Ed25519PrivateKey,
                                                               Ed25519PublicKey)

from ..forksafe import openssl

__all__ = ["SignatureError", "KeyFileError", "Signer", "Verifier", "DOMAIN", "VERSION",
           "KINDS", "generate_key", "write_key_pair", "load_private_key", "load_public_key",
           "public_key_pem", "private_key_pem", "fingerprint", "canonical", "doc_digest",
           "NonceStore"]

VERSION = 1
DOMAIN = b"edgefl-signature-v1\n"
KINDS = ("announce", "finished", "model", "client_model", "onnx_manifest", "onnx", "update",
         "command", "secure", "reply", "event", "run_record")
FIELDS = ("v", "kind", "fed", "run", "round", "by", "key", "nonce", "at", "exp", "hash", "sig")
MAX_SKEW_S = 300.0           # how far in the future a signing time may be (clocks differ)
MAX_TIME = 1e11              # Unix seconds: year 5138


class SignatureError(ValueError):
    """A message refused for its signature; the message says why (missing, malformed,
    unknown key, bad signature, another federation, run, round, kind or signer, expired)."""


class KeyFileError(ValueError):
    """A key file that cannot be read as an Ed25519 key; the message names the file."""


# ---------------------------------------------------------------------------------------
# keys
# ---------------------------------------------------------------------------------------

def generate_key() -> Ed25519PrivateKey:
    with openssl():
        return Ed25519PrivateKey.generate()


def _raw_public(key: Ed25519PublicKey) -> bytes:
    with openssl():
        return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def fingerprint(key) -> str:
    """16 hex digits of the sha256 of the raw public key (of a private key: its public's)."""
    if isinstance(key, Ed25519PrivateKey):
        with openssl():
            key = key.public_key()
    return hashlib.sha256(_raw_public(key)).hexdigest()[:16]


def write_key_pair(path: str | os.PathLike, key: Ed25519PrivateKey | None = None, *,
                   force: bool = False) -> tuple[str, str]:
    """Write the private key at `path` (PEM, mode 0600, created so: never readable by others
    even for a moment) and its public key at `path`.pub; (private path, public path).
    Both names are checked before either file is written: IsADirectoryError when either is
    a directory (`force` replaces files only), FileExistsError unless `force` when either
    exists. A write that fails leaves the old pair as it was."""
    path = os.fspath(path)
    pub_path = path + ".pub"
    for p in (path, pub_path):
        if os.path.isdir(p):
            raise IsADirectoryError(f"{p} is a directory, not a key file: --out PATH names "
                                    "the private key file, its public key goes to PATH.pub "
                                    "(--force replaces files, never a directory)")
    if not force:
        for p in (path, pub_path):
            if os.path.exists(p):
                raise FileExistsError(f"{p} exists; pass --force to replace it (the key it "
                                      "holds is then gone)")
    key = key or generate_key()
    from ..io import atomic_write_all     # mkstemp: the files are 0600 from their creation

    # the two files are one pair: neither is renamed into place until both are written
    # (a full disk halfway left a new private key beside the old public one)
    atomic_write_all([(path, private_key_pem(key), 0o600),
                      (pub_path, public_key_pem(key), 0o644)])
    return path, pub_path


def _read(path) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(1 << 16)
    except OSError as exc:
        raise KeyFileError(f"{os.fspath(path)}: cannot read the key file: "
                           f"{exc.strerror or exc}") from None


def load_private_key(path, *, owner_only: bool = False) -> Ed25519PrivateKey:
    """The private key file at `path` (KeyFileError naming it otherwise). `owner_only`:
    where a node signs with it, also refused when other accounts may read or change it."""
    data = _read(path)
    if len(data) != 32 and b"PUBLIC KEY" in data:
        # a node's own key to sign with, given its .pub: the message names the mix-up,
        # not PEM parsing's "could not deserialize"
        stem = os.fspath(path)[:-4] if os.fspath(path).endswith(".pub") else None
        hint = f"use {stem}, the private key beside it" if stem and os.path.isfile(stem) \
            else "a node signs with its private key (the file `edgefl keys gen` wrote " \
                 "without .pub)"
        raise KeyFileError(f"{os.fspath(path)}: a public key, not a private key to sign "
                           f"with; {hint}")
    try:
        with openssl():
            if len(data) == 32:
                return Ed25519PrivateKey.from_private_bytes(data)
            key = serialization.load_pem_private_key(data, password=None)
    # UnsupportedAlgorithm (a key of a curve or algorithm cryptography does not know) is
    # not a ValueError: without it here, such a file stopped a service with a traceback
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise KeyFileError(f"{os.fspath(path)}: not an unencrypted Ed25519 private key "
                           f"(PEM PKCS#8 or 32 raw bytes): {exc}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyFileError(f"{os.fspath(path)}: a {type(key).__name__}, not an Ed25519 "
                           "private key")
    if owner_only:
        _check_owner_only(path)
    return key


def _check_owner_only(path) -> None:
    # whoever reads a signing key signs as its node; one the group may read (root:edgefl
    # 0640, as a password file is) is the inference service's and the operators' too
    try:
        mode = os.stat(path).st_mode & 0o777
    except OSError as exc:
        raise KeyFileError(f"{os.fspath(path)}: cannot read the key file: "
                           f"{exc.strerror or exc}") from None
    if mode & 0o077 and not _systemd_credential(path):
        raise KeyFileError(f"{os.fspath(path)}: mode {mode:04o}: other accounts may read or "
                           "change this signing key, and whoever reads it signs as this "
                           "node; make it its owner's alone (chmod 600 "
                           f"{os.fspath(path)}, owned by the account that signs with it)")


def _systemd_credential(path) -> bool:
    """Whether `path` is in this service's systemd credentials directory
    ($CREDENTIALS_DIRECTORY, set for a unit with LoadCredential=). systemd keeps such a file
    private, and for a unit with User= grants that user read access by an ACL entry, so
    its mode reads 0440 (the group bits show the ACL's mask) where no group may read it."""
    directory = os.environ.get("CREDENTIALS_DIRECTORY")
    if not directory:
        return False
    real, home = os.path.realpath(path), os.path.realpath(directory)
    return os.path.commonpath([real, home]) == home


def load_public_key(path, *, private_ok: bool = False) -> Ed25519PublicKey:
    """A public key file (KeyFileError naming it otherwise). A private key file is refused
    unless `private_ok` (`keys show`, which reads either): where a node is told whom to
    trust, a private key is another node's signing key copied where it does not belong,
    and install-service would spread it further. (A raw 32-byte file cannot say which it
    is: it is read as a public key.)"""
    data = _read(path)
    if len(data) != 32 and b"PRIVATE KEY" in data:
        if not private_ok:
            raise KeyFileError(_private_not_public(os.fspath(path)))
        private = load_private_key(path)
        with openssl():
            return private.public_key()
    try:
        if len(data) == 32:
            with openssl():
                return Ed25519PublicKey.from_public_bytes(data)
        with openssl():
            key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise KeyFileError(f"{os.fspath(path)}: not an Ed25519 public key (PEM or 32 raw "
                           f"bytes): {exc}") from None
    if not isinstance(key, Ed25519PublicKey):
        raise KeyFileError(f"{os.fspath(path)}: a {type(key).__name__}, not an Ed25519 "
                           "public key")
    return key


def _private_not_public(path: str) -> str:
    pub = path + ".pub"
    hint = f"use its public key, {pub}" if os.path.isfile(pub) else \
        "use its public key (the .pub file `edgefl keys gen` wrote beside it)"
    return f"{path}: a private key, not a public key (a signing key stays with its node); {hint}"


def public_key_pem(key: Ed25519PublicKey | Ed25519PrivateKey) -> bytes:
    """The public key file's content (PEM SubjectPublicKeyInfo) of a key or of its private
    key."""
    with openssl():
        if isinstance(key, Ed25519PrivateKey):
            key = key.public_key()
        return key.public_bytes(serialization.Encoding.PEM,
                                serialization.PublicFormat.SubjectPublicKeyInfo)


def private_key_pem(key: Ed25519PrivateKey) -> bytes:
    """The private key file's content (PEM PKCS#8, unencrypted)."""
    with openssl():
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())


# ---------------------------------------------------------------------------------------
# the envelope
# ---------------------------------------------------------------------------------------

def canonical(doc) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode("ascii")


def doc_digest(doc: Mapping) -> str:
    """sha256 (hex) of a JSON document without its "sig" field, in canonical form: what the
    receiver parsed, whatever spacing or key order it travelled in."""
    return hashlib.sha256(canonical({k: v for k, v in doc.items() if k != "sig"})).hexdigest()


class Signer:
    """Signs as `by` (an aggregator's, a board's or an operator's id) in federation `fed`."""

    def __init__(self, key: Ed25519PrivateKey, by: str, fed: str):
        self.key, self.by, self.fed = key, by, fed
        self.fingerprint = fingerprint(key)

    @classmethod
    def from_file(cls, path, by: str, fed: str) -> "Signer":
        return cls(load_private_key(path, owner_only=True), by, fed)

    def envelope(self, kind: str, run: str, round: int, digest: str, *,
                 nonce: str | None = None, expires_in: float | None = None) -> dict:
        if kind not in KINDS:
            raise ValueError(f"signature kind {kind!r}; valid: {', '.join(KINDS)}")
        at = time.time()
        env = {"v": VERSION, "kind": kind, "fed": self.fed, "run": str(run),
               "round": int(round), "by": self.by, "key": self.fingerprint,
               "nonce": nonce or os.urandom(8).hex(), "at": at,
               "exp": None if expires_in is None else at + float(expires_in), "hash": digest}
        message = DOMAIN + canonical(env)
        with openssl():
            raw = self.key.sign(message)
        env["sig"] = base64.b64encode(raw).decode("ascii")
        return env

    def sign_doc(self, doc: dict, kind: str, run: str, round: int, **options) -> dict:
        """`doc` with its envelope as the field "sig" (a new dict)."""
        out = {k: v for k, v in doc.items() if k != "sig"}
        out["sig"] = self.envelope(kind, run, round, doc_digest(out), **options)
        return out

    def frame_signer(self, run: str):
        """The `sign` argument of wire.encode for a frame of run `run`: the envelope takes
        the frame's kind, round and message id (its nonce)."""
        def sign(digest: str, kind: str, round: int, message_id: int) -> dict:
            return self.envelope(kind, run, round, digest, nonce=f"{message_id:016x}")
        return sign

    def manifest_signer(self, run: str):
        """frame_signer for an ONNX manifest: an `onnx` frame without buffers, signed as kind
        "onnx_manifest" so that it cannot pass for the model frame, nor the model for it."""
        def sign(digest: str, kind: str, round: int, message_id: int) -> dict:
            return self.envelope("onnx_manifest", run, round, digest,
                                 nonce=f"{message_id:016x}")
        return sign


def _field(env: Mapping, key: str, kinds, where: str):
    value = env.get(key)
    if isinstance(value, bool) or not isinstance(value, kinds):
        names = "/".join(k.__name__ for k in (kinds if isinstance(kinds, tuple) else (kinds,)))
        raise SignatureError(f"{where}: signature field {key!r} = {str(value)[:40]!r} must be "
                             f"{names}")
    return value


def check_envelope_shape(env, where: str) -> dict:
    """The envelope's fields and their types (SignatureError naming the field)."""
    if env is None:
        raise SignatureError(f"{where}: unsigned (this node requires signatures)")
    if not isinstance(env, Mapping):
        raise SignatureError(f"{where}: signature must be an object, got {type(env).__name__}")
    unknown = sorted(set(env) - set(FIELDS))
    if unknown:
        raise SignatureError(f"{where}: unknown signature field(s) {unknown}")
    if env.get("v") != VERSION or isinstance(env.get("v"), bool):
        raise SignatureError(f"{where}: signature version {env.get('v')!r}, this node "
                             f"speaks {VERSION}")
    for key in ("kind", "fed", "run", "by", "key", "nonce", "hash", "sig"):
        _field(env, key, str, where)
    round_ = _field(env, "round", int, where)
    if not 0 <= round_ < 2 ** 32:
        raise SignatureError(f"{where}: signature round {round_} out of range")
    for key in ("at",) + (("exp",) if env.get("exp") is not None else ()):
        value = _field(env, key, (int, float), where)
        # Unix seconds: a bound keeps every later subtraction within a float
        if not (math.isfinite(value) and 0 <= value < MAX_TIME):
            raise SignatureError(f"{where}: signature field {key!r} = {value!r} is not a "
                                 "time (Unix seconds)")
    return dict(env)


class Verifier:
    """Checks envelopes of federation `fed` against trusted public keys.

    keys: {signer id: [public keys]} -- a signer's message verifies only with its own keys
    (a board's update with that board's, never another's); the id "*" holds keys any signer
    id may use (the aggregator's, during a rotation two of them: the old and the new)."""

    def __init__(self, fed: str, keys: Mapping[str, Iterable[Ed25519PublicKey]]):
        self.fed = fed
        self.keys = {by: {fingerprint(k): k for k in ks} for by, ks in keys.items()}

    @property
    def fingerprints(self) -> list:
        return sorted({fp for ks in self.keys.values() for fp in ks})

    def _key(self, by: str, fp: str, where: str) -> Ed25519PublicKey:
        for holder in (by, "*"):
            key = self.keys.get(holder, {}).get(fp)
            if key is not None:
                return key
        if by not in self.keys and "*" not in self.keys:
            raise SignatureError(f"{where}: signed by {by!r}, for whom this node holds no "
                                 "public key")
        raise SignatureError(f"{where}: signed by {by!r} with key {fp}, which is not one "
                             f"of the trusted keys of {by!r}")

    def verify(self, env, digest: str, *, kind: str, where: str, run: str | None = None,
               round: int | None = None, by: str | None = None,
               now: float | None = None) -> dict:
        """The checked envelope of content `digest`: shape, key, signature, then what it is
        for (kind, federation, and run, round, signer when given), then its expiry."""
        env = check_envelope_shape(env, where)
        key = self._key(env["by"], env["key"], where)
        try:
            raw = base64.b64decode(env["sig"].encode("ascii"), validate=True)
        except (ValueError, UnicodeEncodeError):
            raise SignatureError(f"{where}: signature is not base64") from None
        # one encoding per signature: the unused low bits of the last base64 character
        # would otherwise give a second string for the same bytes
        if base64.b64encode(raw).decode("ascii") != env["sig"]:
            raise SignatureError(f"{where}: signature is not in canonical base64")
        message = DOMAIN + canonical({k: v for k, v in env.items() if k != "sig"})
        try:
            with openssl():
                key.verify(raw, message)
        except InvalidSignature:
            raise SignatureError(f"{where}: bad signature (key {env['key']} of "
                                 f"{env['by']!r}): forged or altered") from None
        # the signature is good: now whether it says what this message is
        if env["hash"] != digest:
            raise SignatureError(f"{where}: content sha256 {digest[:16]} is not the signed "
                                 f"{env['hash'][:16]}: altered after signing")
        if env["kind"] != kind:
            raise SignatureError(f"{where}: signed as a {env['kind']!r}, used as a {kind!r}")
        if env["fed"] != self.fed:
            raise SignatureError(f"{where}: signed for federation {env['fed']!r}, this is "
                                 f"{self.fed!r}")
        if run is not None and env["run"] != run:
            raise SignatureError(f"{where}: signed for run {env['run']!r}, not {run!r} "
                                 "(replayed from another run?)")
        if round is not None and env["round"] != round:
            raise SignatureError(f"{where}: signed for round {env['round']}, not {round} "
                                 "(replayed from another round?)")
        if by is not None and env["by"] != by:
            raise SignatureError(f"{where}: signed by {env['by']!r}, not {by!r}")
        now = time.time() if now is None else now
        if env["exp"] is not None and now > env["exp"]:
            raise SignatureError(f"{where}: signature expired {now - env['exp']:.0f} s ago")
        if env["at"] > now + MAX_SKEW_S:
            raise SignatureError(f"{where}: signed {env['at'] - now:.0f} s in the future "
                                 f"(clock skew beyond {MAX_SKEW_S:.0f} s?)")
        return env

    def verify_doc(self, doc: Mapping, *, kind: str, where: str, **expect) -> dict:
        return self.verify(doc.get("sig"), doc_digest(doc), kind=kind, where=where, **expect)

    def verify_frame(self, frame, *, kind: str | None = None, where: str, **expect) -> dict:
        from .wire import SIGNATURE_SCALAR

        env = frame.scalars.get(SIGNATURE_SCALAR)
        env = check_envelope_shape(env, where)     # before the hash: cheap refusals first
        return self.verify(env, frame.content_sha256(), kind=kind or frame.kind, where=where,
                           round=expect.pop("round", frame.round), **expect)


class NonceStore:
    """Nonces of accepted commands, remembered until their signature expires, in a JSON file
    (atomic replace), so a restarted aggregator still refuses a replay within the window."""

    def __init__(self, path: str):
        self.path = path
        self.seen: dict = {}
        self.error: str | None = None     # why the file could not be read (then replaced)
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
            if isinstance(doc, dict):
                self.seen = {str(k): float(v) for k, v in doc.items()
                             if isinstance(v, (int, float))}
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as exc:
            # refusing every command would lock the operator out; an unreadable file is
            # replaced, and the window it covered is said in the log by the caller
            self.error = f"{path}: {exc}"

    def check_and_add(self, nonce: str, expires: float, where: str,
                      now: float | None = None) -> None:
        from ..io import atomic_write

        now = time.time() if now is None else now
        self.seen = {n: e for n, e in self.seen.items() if e >= now}
        if nonce in self.seen:
            raise SignatureError(f"{where}: nonce {nonce} was used already (a replayed "
                                 "command)")
        self.seen[nonce] = float(expires)
        atomic_write(self.path, json.dumps(self.seen, sort_keys=True).encode())
