"""Secure aggregation, SecAgg+ (Bell, Bonawitz, Gascon, Lepoint, Raykova, CCS 2020, on
Bonawitz et al., CCS 2017): the aggregator learns the sum of a round's contributions and
nothing else about any one of them, and the sum survives clients vanishing mid-round.

One round, as explicit messages between transport-agnostic state machines (`SecAggServer`,
`SecAggClient`); the in-process simulation (`run_in_process`) and MQTT carry the same
messages (each has `to_bytes` / `message_from_bytes`):

    server -> all     RoundSetup      participants, threshold t, neighbour graph seed, the
                                      ring and the quantiser, the vector's size
    1 client -> srv   AdvertiseKeys   two fresh X25519 public keys: c (share encryption) and
                                      s (pairwise masks)
      srv -> client   KeysBroadcast   its neighbours' public keys (those that advertised)
    2 client -> srv   ShareKeys       a fresh self-mask seed b_i and the mask private key
                                      s_i, each Shamir-shared t_N-of-|N(i)| among its
                                      neighbourhood N(i) (itself included), every pair of
                                      shares encrypted to its holder (AES-GCM under
                                      HKDF(X25519(c_i, c_j)))
      srv -> client   SharesForward   the ciphertexts addressed to it
    3 client -> srv   MaskedInput     y_i = q_i + PRG(b_i) + sum_{j in N(i), j shared}
                                      sign(i, j) PRG(s_ij)  (mod 2^bits), where q_i is its
                                      quantised contribution with its weight folded in
      srv -> client   UnmaskRequest   who sent masked input (survivors) and who shared but
                                      did not (dropped)
    4 client -> srv   UnmaskResponse  for each neighbour it holds shares of: the b-share of a
                                      survivor or the s-share of a dropped client, never both
                                      for one client (a client answers one request a round,
                                      naming at least t survivors)
      server          sum = sum_{survivors} y_i - PRG(b_i) -/+ the masks the survivors shared
                      with dropped clients (s_ij from the dropped client's reconstructed s and
                      the survivor's public key): the exact ring sum of the survivors' q_i

Threat model: an honest-but-curious aggregator (and clients that may collude with it, fewer
than t; with a neighbour graph, fewer than t_N of any client's neighbourhood): it sees
masked inputs, which are uniformly distributed in the ring whatever the contribution, and at
most t_N - 1 shares of any secret it is not meant to learn. The client's never-both rule
stops a server from unmasking one client by calling it both alive and dropped, and a client
answers each phase once, in order (a second masked input under a SharesForward naming no
neighbour would carry its self mask alone). An actively malicious server that lies about
the survivor set to different clients needs Bonawitz et al.'s consistency round
(signatures), not implemented here.

A client message whose fields are not what the protocol sends (keys, ciphertexts, shares)
is refused whole when it arrives, naming the client and the field (`_check_fields`): that
client has not answered the phase, as with a dropout. So is an advertisement of a public key
another client advertised first (`_check_distinct`, Bonawitz et al.'s distinct-keys check).

Failures are clean: a phase that ends with fewer than t clients (or a neighbourhood with fewer
than t_N holders of a secret that is needed) raises SecAggAborted naming the phase and the
counts; the server has reconstructed nothing by then (reconstruction happens only once every
needed secret has enough shares), and the caller's state is untouched -- the run may retry
the round or stop. A masked input arriving after the unmask request is refused
(LateMessage): its masks with the dropped clients' are being removed, so unmasking it would
be unmasking a single client.

Quantisation (`Quantiser`): each coordinate of a contribution's vector is clipped to
[-clip_range, clip_range] and rounded (stochastically: unbiased) to one of 2 levels + 1
integers, times the client's whole-number weight; the sum of n contributions of weights
w_i <= max_weight stays exact in the ring while n * max_weight * (levels + 1) < 2^(bits-1)
(a value rounds to at most levels + 1), so
`Quantiser.for_round` picks the largest such levels (capped at 2^40) and refuses a round
where fewer than MIN_LEVELS would remain. Each client's rounding moves its value by less than
one level, so the dequantised sum is within sum_i w_i * clip_range / levels of the clipped
float sum per coordinate (half that with round-to-nearest; stochastic rounding, used here,
is unbiased). Scalars (weights, FedNova's norms, the loss sums) ride along as 64-bit
fixed point with SCALAR_FRACTION_BITS fractional bits, masked with the same streams.
"""
from __future__ import annotations

import base64
import dataclasses
import functools
import hashlib
import json
import math
import os
import random
import struct
import types
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from .. import kernels
from ..forksafe import openssl
from ..strategies import Contribution, SumTotal
from . import shamir

__all__ = ["SecAggError", "SecAggAborted", "LateMessage", "Quantiser", "RoundSetup",
           "AdvertiseKeys", "KeysBroadcast", "ShareKeys", "SharesForward", "MaskedInput",
           "UnmaskRequest", "UnmaskResponse", "SecAggClient", "SecAggServer", "neighbours_of",
           "mask_stream", "run_in_process", "InProcessRound", "message_from_bytes", "MIN_LEVELS",
           "SCALAR_FRACTION_BITS", "PHASES", "round_setup", "to_chunks", "ChunkAssembler",
           "max_weight_of", "Sealed", "unseal", "secure_digest"]

MIN_LEVELS = 16               # fewer quantisation levels than this is not worth sending
MAX_LEVELS = 2 ** 40          # beyond this the float64 scaling has no fraction left to round
SCALAR_FRACTION_BITS = 24
MAX_SHARE_CIPHERTEXT = 1024   # a pair of shares as JSON under AES-GCM is at most ~400 bytes
PHASES = ("keys", "shares", "masked", "unmask", "done")


class SecAggError(RuntimeError):
    """A secure round that cannot go on: a bad message, a bad setting (the message says
    which)."""


class SecAggAborted(SecAggError):
    """The round failed cleanly: too few clients left in a phase. Nothing was revealed and the
    caller's state is unchanged."""


class LateMessage(SecAggError):
    """A message for a phase that is over (a masked input after the unmask request)."""


# ======================================================================== quantisation
@dataclass(frozen=True)
class Quantiser:
    """How contributions enter the ring: bits, clip, levels (see the module docstring)."""
    bits: int
    clip: float
    levels: int

    @classmethod
    def for_round(cls, bits: int, clip: float, participants: int, max_weight: int) \
            -> "Quantiser":
        """The most levels with participants * max_weight * (levels + 1) < 2^(bits-1) (a
        value rounds to at most levels + 1: stochastic rounding of a float64 product that came
        out a hair above levels, kernels.MAX_QUANT_LEVELS), or SecAggError when fewer than
        MIN_LEVELS would remain."""
        if bits not in kernels.RING_DTYPES:
            raise SecAggError(f"ring_bits {bits}; valid: 32, 64")
        bound = participants * max(int(max_weight), 1)
        levels = min((2 ** (bits - 1) - 1) // bound - 1, MAX_LEVELS)
        if levels < MIN_LEVELS:
            raise SecAggError(
                f"ring_bits {bits} cannot hold the sum of {participants} contributions of "
                f"weight up to {max_weight}: n * weight * (levels + 1) must stay below "
                f"2^{bits - 1}, "
                f"which leaves {levels} levels (< {MIN_LEVELS}); use ring_bits: 64 or "
                f"uniform weighting")
        return cls(bits, float(clip), int(levels))

    @property
    def dtype(self):
        return kernels.RING_DTYPES[self.bits]

    @property
    def unit(self) -> float:
        """The value of one level."""
        return self.clip / self.levels

    def encode(self, contribution: Contribution, seed: int, max_weight: int,
               add_to: np.ndarray | None = None) -> np.ndarray:
        """The contribution's vector quantised with its weight folded in (uint words);
        `add_to`: added into these words (mod 2^bits) in the same pass, and returned."""
        if contribution.weight > max_weight:
            raise SecAggError(f"contribution weight {contribution.weight} exceeds the round's "
                              f"max_weight {max_weight}")
        out = np.empty(contribution.vector.size, self.dtype) if add_to is None else add_to
        return kernels.quantize(out, contribution.vector, self.clip, self.levels,
                                weight=contribution.weight, seed=seed, stochastic=True,
                                add=add_to is not None)

    def decode(self, words: np.ndarray) -> np.ndarray:
        out = np.empty(words.size, np.float32)
        return kernels.dequantize(out, words, self.unit)


def encode_scalars(weight: int, scalars: Mapping[str, float], names: Sequence[str],
                   participants: int = 2) -> np.ndarray:
    """[weight, scalars in `names` order] as 64-bit two's-complement fixed point, each small
    enough that the sum of `participants` of them stays within the 64 bits (a sum past
    2^63 would wrap, silently, to the other sign)."""
    values = [float(weight)] + [float(scalars[n]) for n in names]
    bound = min(2 ** 62, 2 ** 63 // max(int(participants), 1))
    # finite first: round() of an infinity or a NaN raises its own error
    if not all(math.isfinite(v) for v in values) or \
            any(abs(round(v * 2 ** SCALAR_FRACTION_BITS)) >= bound for v in values):
        raise SecAggError(f"scalars {dict(zip(['weight', *names], values))} do not fit: "
                          f"the sum of {participants} must stay within the 64-bit fixed "
                          f"point (|value| < {bound / 2 ** SCALAR_FRACTION_BITS:.4g})")
    return np.array([round(v * 2 ** SCALAR_FRACTION_BITS) % 2 ** 64 for v in values],
                    np.uint64)


def decode_scalars(words: np.ndarray) -> list[float]:
    return [float(int(v)) / 2 ** SCALAR_FRACTION_BITS for v in words.view(np.int64)]


# ======================================================================== keys and PRG
def _hkdf(secret: bytes, label: str, *parts) -> bytes:
    info = "|".join(["edgefl-secagg", label, *map(str, parts)]).encode()
    with openssl():
        return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(secret)


def _prg(key: bytes):
    """The PRG of every mask: AES-256-CTR under `key` (a key is used for one stream only,
    so the counter starts at 0); its keystream is what it encrypts zeros to."""
    return Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor()


def mask_stream(key: bytes, nbytes: int, out: bytearray | None = None) -> bytearray:
    """The first nbytes of `key`'s mask keystream."""
    out = bytearray(nbytes) if out is None else out
    with openssl():
        _prg(key).update_into(_zeros(nbytes), out)
    return out


_ZEROS = {"buf": b""}     # one read-only buffer of zeros, grown on demand, for the PRG to encrypt


def _zeros(n: int) -> memoryview:
    if len(_ZEROS["buf"]) < n:
        _ZEROS["buf"] = bytes(n)
    return memoryview(_ZEROS["buf"])[:n]


def _public_bytes(key: X25519PublicKey) -> bytes:
    with openssl():
        return key.public_bytes(Encoding.Raw, PublicFormat.Raw)


def neighbours_of(participants: Sequence[int], k: int, seed: int, round: int) -> dict:
    """{client: its neighbourhood, itself included} (see `_graph`): every client of a round
    derives the same graph, so it is built once per process and round."""
    return _graph(tuple(sorted(int(c) for c in participants)), int(k), int(seed), int(round))


@functools.lru_cache(maxsize=8)
def _graph(ids: tuple, k: int, seed: int, round: int) -> dict:
    """{client: its neighbourhood, itself included}: SecAgg+'s random k-regular graph, a
    Harary graph (each client joined to the k/2 nearest on either side of a ring) over a
    permutation seeded by (seed, round). k = 0, or k >= n - 1, joins everyone (SecAgg);
    an odd k takes one more (a Harary graph of even degree)."""
    n = len(ids)
    if k <= 0 or k >= n - 1:
        everyone = frozenset(ids)
        return types.MappingProxyType({c: everyone for c in ids})
    half = (k + 1) // 2
    digest = hashlib.sha256(f"edgefl-secagg-graph|{seed}|{round}".encode()).digest()
    ring = list(ids)
    random.Random(int.from_bytes(digest, "big")).shuffle(ring)
    pos = {c: i for i, c in enumerate(ring)}
    return types.MappingProxyType(
        {c: frozenset(ring[(pos[c] + d) % n] for d in range(-half, half + 1)) for c in ids})


def _check_public_key(key, what: str, agree: bool = True) -> X25519PublicKey:
    """`key` as an X25519 public key: 32 bytes and, with `agree`, one every key agreement
    can use -- not a point of small order, with which OpenSSL's agreement fails -- tried by
    one agreement with a throwaway key (the server, for every neighbour of the client; a
    board skips it, its own agreements fail as cleanly: _agree); SecAggError starting with
    `what` otherwise."""
    if not isinstance(key, bytes) or len(key) != 32:
        raise SecAggError(f"{what} is {_describe(key)}, not a 32-byte X25519 public key")
    with openssl():
        public = X25519PublicKey.from_public_bytes(key)
    if agree:
        _agree(X25519PrivateKey.generate(), public, what)
    return public


def _agree(private: X25519PrivateKey, public: X25519PublicKey, what: str) -> bytes:
    """X25519(private, public); SecAggError naming `what` when OpenSSL refuses the public
    key (a point of small order gives the all-zero secret)."""
    try:
        with openssl():
            return private.exchange(public)
    except ValueError as exc:
        raise SecAggError(f"{what} is not a usable X25519 public key ({exc})") from None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _describe(value) -> str:
    """A field's value for an error: its type, and its length when it has one."""
    size = f" of {len(value)}" if isinstance(value, (bytes, str, dict, list, tuple)) else ""
    return f"{type(value).__name__}{size}"


def _check_threshold(setup: "RoundSetup") -> None:
    """t must be more than half the participants (so t_N is more than half of every
    neighbourhood): two disjoint groups of holders, one asked for a client's self-mask seed
    and the other for its mask key, could otherwise each reach it."""
    n = len(setup.participants)
    if not n // 2 < setup.threshold <= n:
        raise SecAggError(f"round {setup.round}: threshold {setup.threshold} for {n} "
                          f"participants: must be more than half of them and at most all")


def _neighbour_threshold(setup: "RoundSetup", holders: int) -> int:
    """t_N, the shares needed of a secret held by `holders` clients: t scaled to the
    neighbourhood, rounded up (t itself on a complete graph)."""
    n = len(setup.participants)
    return max(1, -(-setup.threshold * holders // n))


# ======================================================================== messages
def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode("ascii")


def _unb64(s: str) -> bytes:
    if not isinstance(s, str):     # a ValueError, as a bad encoding's, for message_from_bytes
        raise ValueError(f"a byte string field holds {type(s).__name__}, not base64 text")
    return base64.b64decode(s.encode("ascii"), validate=True)


class _Message:
    """A dataclass message: a JSON header (bytes fields as base64, int-keyed maps as string
    keys) and, for masked inputs, the raw words after it."""
    kind = ""

    def to_bytes(self) -> bytes:
        header, blob = self._header(), self._blob()
        head = json.dumps({"kind": self.kind, **header}, separators=(",", ":")).encode()
        return struct.pack(">I", len(head)) + head + blob

    def _header(self) -> dict:
        return _plain(dataclasses.asdict(self))

    def _blob(self) -> bytes:
        return b""


def _plain(value):
    if isinstance(value, bytes):
        return {"b64": _b64(value)}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, frozenset, set)):
        return [_plain(v) for v in (sorted(value) if isinstance(value, (set, frozenset))
                                    else value)]
    return value


def _unplain(value):
    if isinstance(value, dict):
        if set(value) == {"b64"}:
            return _unb64(value["b64"])
        return {(int(k) if k.lstrip("-").isdigit() else k): _unplain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unplain(v) for v in value]
    return value


@dataclass(frozen=True)
class RoundSetup(_Message):
    kind = "setup"
    run_id: str
    round: int
    participants: tuple
    threshold: int
    neighbours: int
    graph_seed: int
    ring_bits: int
    clip_range: float
    levels: int
    max_weight: int
    vector_size: int | None         # None: the shape t masked inputs have (a broker's
    scalar_names: tuple | None      # aggregator does not run the strategy's client half)

    def to_dict(self) -> dict:
        """The setup as JSON-able values (a round announcement carries it)."""
        return _plain(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, doc) -> "RoundSetup":
        try:
            values = dict(doc)
            values["participants"] = tuple(int(c) for c in values["participants"])
            if values.get("scalar_names") is not None:
                values["scalar_names"] = tuple(values["scalar_names"])
            return cls(**values)
        except (TypeError, KeyError, ValueError) as exc:
            raise SecAggError(f"secure aggregation setup {doc!r}: {exc}") from None

    @property
    def quantiser(self) -> Quantiser:
        return Quantiser(self.ring_bits, self.clip_range, self.levels)

    def neighbourhoods(self) -> dict:
        return neighbours_of(self.participants, self.neighbours, self.graph_seed, self.round)


@dataclass(frozen=True)
class AdvertiseKeys(_Message):
    kind = "advertise"
    round: int
    client: int
    c_public: bytes          # X25519: the shares' encryption
    s_public: bytes          # X25519: the pairwise masks


@dataclass(frozen=True)
class KeysBroadcast(_Message):
    kind = "keys"
    round: int
    keys: dict               # {client: [c_public, s_public]} of the neighbours that advertised


@dataclass(frozen=True)
class ShareKeys(_Message):
    kind = "share"
    round: int
    client: int
    ciphertexts: dict        # {holder: AES-GCM ciphertext of (b-share, s-share)}


@dataclass(frozen=True)
class SharesForward(_Message):
    kind = "forward"
    round: int
    ciphertexts: dict        # {sender: ciphertext addressed to this client}


@dataclass(frozen=True)
class MaskedInput(_Message):
    kind = "masked"
    round: int
    client: int
    words: np.ndarray = field(repr=False)       # uint32/uint64: the masked vector
    scalars: np.ndarray = field(repr=False)     # uint64: masked [weight, scalars...]
    scalar_names: tuple = ()                    # the scalars' names (in the clear)

    def _header(self) -> dict:
        return {"round": self.round, "client": self.client, "bits": self.words.dtype.itemsize * 8,
                "n": int(self.words.size), "m": int(self.scalars.size),
                "names": list(self.scalar_names)}

    def _blob(self) -> bytes:
        return self.words.tobytes() + self.scalars.tobytes()

    @property
    def nbytes(self) -> int:
        return self.words.nbytes + self.scalars.nbytes


@dataclass(frozen=True)
class UnmaskRequest(_Message):
    kind = "unmask"
    round: int
    survivors: tuple         # sent masked input: reveal their self-mask shares
    dropped: tuple           # shared keys but sent no masked input: reveal their mask keys


@dataclass(frozen=True)
class UnmaskResponse(_Message):
    kind = "reveal"
    round: int
    client: int
    seed_shares: dict        # {survivor: share of b}
    key_shares: dict         # {dropped: share of s}


_KINDS = {cls.kind: cls for cls in (RoundSetup, AdvertiseKeys, KeysBroadcast, ShareKeys,
                                    SharesForward, MaskedInput, UnmaskRequest, UnmaskResponse)}


def message_from_bytes(data: bytes):
    """The message `to_bytes` wrote; SecAggError naming what is wrong otherwise."""
    try:
        (size,) = struct.unpack_from(">I", data)
        header = json.loads(bytes(data[4:4 + size]))
        if not isinstance(header, dict):
            raise ValueError(f"its header is a JSON {type(header).__name__}, not an object")
        kind = header.pop("kind")
        cls = _KINDS[kind]
    except (struct.error, ValueError, KeyError, TypeError) as exc:
        raise SecAggError(f"not a secure aggregation message ({exc})") from None
    blob = memoryview(data)[4 + size:]
    try:
        if cls is MaskedInput:
            dtype = kernels.RING_DTYPES[header["bits"]]
            n, m = header["n"], header["m"]
            if len(blob) != n * dtype.itemsize + 8 * m:
                raise SecAggError(f"masked input of client {header['client']}: {len(blob)} "
                                  f"bytes of words, expected {n * dtype.itemsize + 8 * m}")
            words = np.frombuffer(blob, dtype, n).copy()
            scalars = np.frombuffer(blob, np.uint64, m, n * dtype.itemsize).copy()
            return MaskedInput(header["round"], header["client"], words, scalars,
                               tuple(header.get("names", ())))
        values = _unplain(header)
        for name in ("participants", "scalar_names", "survivors", "dropped"):
            if values.get(name) is not None:
                values[name] = tuple(values[name])
        return cls(**values)
    except (TypeError, KeyError, ValueError) as exc:
        raise SecAggError(f"{kind} message: {exc}") from None


# ======================================================================== chunks
# A message travels as one or more chunks (an MQTT payload has a size limit, and a masked
# input is 4 bytes a parameter): b"SAC1", the sender's message id (u64), the chunk's index
# and the chunk count (u32 each, big-endian), then that slice of the body. The body is
# `to_bytes()`, or, signed, b"SAS1", the length of the signature envelope (u32), the
# envelope (JSON, edgefl.transport.signing) and then `to_bytes()`; the envelope's hash is
# `secure_digest` of the message (docs/protocol.md section 11).
_CHUNK = struct.Struct(">4sQII")
CHUNK_MAGIC = b"SAC1"
_HELD_PIECE_BYTES = 100          # a held chunk's dict entry and bytes object, about
_SEAL = struct.Struct(">4sI")
SEAL_MAGIC = b"SAS1"
MAX_SEAL_BYTES = 4096         # a signature envelope is about 350 bytes


def secure_digest(context: str, message_id: int, body) -> str:
    """sha256 (hex) of what a secure message's signature covers: its context (the round
    attempt and the client whose exchange it is: the roles pass "<announce id>|<node>"), its
    message id, and its bytes (`to_bytes()`), so that it cannot be moved to another attempt,
    client or place in the exchange."""
    h = hashlib.sha256(b"edgefl-secagg-message\n%s\n%016x\n"
                       % (context.encode("utf-8"), int(message_id)))
    h.update(body)
    return h.hexdigest()


@dataclass(frozen=True)
class Sealed:
    """A reassembled secure message: its id, its signature envelope (None: unsigned; not
    checked here) and its bytes; `message()` parses them."""
    message_id: int
    envelope: object
    body: object = field(repr=False)          # bytes or a memoryview of them

    def message(self):
        return message_from_bytes(self.body)


def unseal(data, message_id: int) -> Sealed:
    """The envelope and the message of a reassembled body (SecAggError if the envelope
    cannot be read)."""
    if bytes(data[:4]) != SEAL_MAGIC:
        return Sealed(message_id, None, data)
    if len(data) < _SEAL.size:
        raise SecAggError("a signed secure message shorter than its signature header")
    _, size = _SEAL.unpack_from(data)
    if size > MAX_SEAL_BYTES or _SEAL.size + size > len(data):
        raise SecAggError(f"a signed secure message's signature of {size} bytes (the "
                          f"limit is {MAX_SEAL_BYTES}, the message has {len(data)})")
    try:
        envelope = json.loads(bytes(data[_SEAL.size:_SEAL.size + size]))
    except ValueError as exc:
        raise SecAggError(f"a secure message's signature is not JSON ({exc})") from None
    return Sealed(message_id, envelope, memoryview(data)[_SEAL.size + size:])


def to_chunks(msg, max_payload: int, message_id: int, sign=None) -> list[bytes]:
    """`msg.to_bytes()` in chunks of at most `max_payload` bytes each (header included).
    sign(body, message_id) -> dict: when given, the signature envelope it returns travels
    in front of the message (see above)."""
    body = msg.to_bytes()
    if sign is not None:
        envelope = json.dumps(sign(body, message_id), separators=(",", ":")).encode()
        body = _SEAL.pack(SEAL_MAGIC, len(envelope)) + envelope + body
    room = int(max_payload) - _CHUNK.size
    if room < 64:
        raise SecAggError(f"max_payload {max_payload}: too small for secure aggregation chunks")
    count = max(1, -(-len(body) // room))
    return [_CHUNK.pack(CHUNK_MAGIC, message_id, i, count) + body[i * room:(i + 1) * room]
            for i in range(count)]


class ChunkAssembler:
    """Puts chunked messages back together, per sender: at most `max_bytes` held for one
    sender, one message in progress per sender (a new message id drops the unfinished one:
    a sender that re-sends starts over)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = int(max_bytes)
        self._parts: dict = {}           # sender -> (message id, count, {index: bytes}, size)
        self._done: dict = {}            # sender -> id of its last complete message
        self.repeats = 0                 # chunks of a message already complete (QoS 1 repeats)

    def add(self, sender, payload: bytes):
        """The whole message once its last chunk is in (parsed: message_from_bytes; a
        signature it carries is not checked), else None; SecAggError naming the sender for
        a malformed chunk or one over the limit."""
        sealed = self.add_sealed(sender, payload)
        return None if sealed is None else sealed.message()

    def forget(self, sender, message_id: int) -> None:
        """Take back a completed message (refused for its signature): chunks with its id
        are reassembled again, so a forgery sent first under a sender's next message id
        does not make the sender's own message a repeat."""
        if self._done.get(sender) == message_id:
            del self._done[sender]

    def add_sealed(self, sender, payload: bytes) -> Sealed | None:
        """`add`, returning the message unparsed with its signature envelope (Sealed)."""
        if len(payload) < _CHUNK.size:
            raise SecAggError(f"secure message from {sender!r}: {len(payload)} bytes, shorter "
                              f"than a chunk header")
        magic, mid, index, count = _CHUNK.unpack_from(payload)
        if magic != CHUNK_MAGIC or not 0 <= index < count:
            raise SecAggError(f"secure message from {sender!r}: not a secure aggregation "
                              f"chunk (magic {magic!r}, chunk {index} of {count})")
        if self._done.get(sender) == mid:
            self.repeats += 1            # MQTT QoS 1 may deliver a chunk twice
            return None
        held = self._parts.get(sender)
        if held is None or held[0] != mid or held[1] != count:
            held = (mid, count, {}, 0)
        mid, count, parts, size = held
        data = bytes(payload[_CHUNK.size:])
        if index not in parts:
            # a held piece costs its bookkeeping too: empty chunks of a message of 2^31
            # would otherwise be held without limit
            size += len(data) + _HELD_PIECE_BYTES
            parts[index] = data
        if size > self.max_bytes:
            self._parts.pop(sender, None)
            raise SecAggError(f"secure message from {sender!r}: over {self.max_bytes} bytes; "
                              f"dropped")
        if len(parts) < count:
            self._parts[sender] = (mid, count, parts, size)
            return None
        self._parts.pop(sender, None)
        self._done[sender] = mid
        return unseal(b"".join(parts[i] for i in range(count)), mid)

    def clear(self) -> None:
        self._parts.clear()
        self._done.clear()


# ======================================================================== client
class SecAggClient:
    """One client's side of one secure round: feed it the server's messages in order."""

    def __init__(self, client: int, setup: RoundSetup, entropy: bytes | None = None):
        """`entropy`: None (the OS's generator: always, outside tests), or bytes from which
        the keys and the self-mask seed are derived (HKDF), so a test's masks repeat."""
        if client not in setup.participants:
            raise SecAggError(f"round {setup.round}: client {client} is not a participant")
        _check_threshold(setup)      # the setup is the aggregator's: the board checks it
        self.client, self.setup = int(client), setup
        self.neighbourhood = setup.neighbourhoods()[self.client]
        if entropy is None:
            with openssl():
                self._c = X25519PrivateKey.generate()
                self._s = X25519PrivateKey.generate()
            self._seed = os.urandom(shamir.SECRET_BYTES)      # b_i, the self-mask seed
        else:
            draw = [_hkdf(bytes(entropy), what, setup.round, client) for what in "csb"]
            with openssl():
                self._c = X25519PrivateKey.from_private_bytes(draw[0])
                self._s = X25519PrivateKey.from_private_bytes(draw[1])
            self._seed = draw[2]
        self._keys: dict = {}
        self._aeads: dict = {}
        self._held: dict = {}        # {sender: (b-share, s-share)} decrypted on demand
        self._shared_with: tuple = ()
        self._ready = None           # (shared with, words, scalars): masks expanded ahead
        # Each phase is answered once, in order: a second sharing could go to other keys,
        # and a second masked input under another SharesForward (one naming no neighbour)
        # would carry the self mask alone, which the unmask phase then removes.
        self._shared = False
        self._masked = False
        self._answered = False

    def advertise(self) -> AdvertiseKeys:
        with openssl():
            c_public, s_public = self._c.public_key(), self._s.public_key()
        return AdvertiseKeys(self.setup.round, self.client, _public_bytes(c_public),
                             _public_bytes(s_public))

    def share_keys(self, msg: KeysBroadcast) -> ShareKeys:
        self._check_round(msg)
        if self._shared:
            raise SecAggError(f"round {msg.round}: client {self.client} has shared its keys "
                              f"already; it shares them once a round")
        # the server checked them (_check_fields); a board checks what it acts on too
        keys = {}
        for c, k in msg.keys.items():
            if _is_int(c) and c in self.neighbourhood:
                pair = k if isinstance(k, (list, tuple)) and len(k) == 2 else (k, k)
                keys[c] = tuple(_check_public_key(key, f"round {msg.round}: client "
                                                       f"{self.client}: the key broadcast's "
                                                       f"{name} of client {c}", agree=False)
                                for key, name in zip(pair, ("c_public", "s_public")))
        if self.client not in keys:
            raise SecAggError(f"round {msg.round}: the key broadcast to client {self.client} "
                              f"lacks its own keys")
        self._keys = keys
        holders = sorted(keys)
        need = _neighbour_threshold(self.setup, len(self.neighbourhood))
        if len(holders) < need:
            raise SecAggAborted(f"round {msg.round}: client {self.client} has {len(holders)} "
                                f"neighbours with keys, {need} needed")
        seed_shares = shamir.split(self._seed, [h + 1 for h in holders], need)
        with openssl():
            s_private = self._s.private_bytes_raw()
        key_shares = shamir.split(s_private, [h + 1 for h in holders], need)
        out = {}
        for h in holders:
            plain = json.dumps([self.client, h, str(seed_shares[h + 1]),
                                str(key_shares[h + 1])]).encode()
            aead = self._aead(h)
            with openssl():
                out[h] = aead.encrypt(self._nonce(self.client), plain, self._aad(self.client, h))
        self._shared = True
        return ShareKeys(self.setup.round, self.client, out)

    def masked_input(self, msg: SharesForward, contribution: Contribution,
                     quantise_seed: int = 0) -> MaskedInput:
        """y = quantised contribution + self mask + pairwise masks with the neighbours that
        shared (their ciphertexts are in `msg`)."""
        self._check_round(msg)
        self._check_can_mask(msg)
        setup = self.setup
        if setup.vector_size is not None and contribution.vector.size != setup.vector_size:
            raise SecAggError(f"round {setup.round}: client {self.client}'s contribution has "
                              f"{contribution.vector.size} values, the round {setup.vector_size}")
        names = tuple(sorted(contribution.scalars))
        if setup.scalar_names is not None and names != tuple(setup.scalar_names):
            raise SecAggError(f"round {setup.round}: client {self.client}'s scalars "
                              f"{sorted(contribution.scalars)}, the round's "
                              f"{list(setup.scalar_names)}")
        self._take_shares(msg)
        q = setup.quantiser
        if contribution.weight > setup.max_weight:
            raise SecAggError(f"contribution weight {contribution.weight} exceeds the round's "
                              f"max_weight {setup.max_weight}")
        scalars = encode_scalars(contribution.weight, contribution.scalars, names,
                                 len(setup.participants))
        n = contribution.vector.size
        ready, self._ready = self._ready, None        # the words are handed out: used once
        if ready is not None and ready[0] == self._shared_with and ready[1].size == n \
                and ready[1].dtype == q.dtype and ready[2].size >= scalars.size:
            # the masks were expanded ahead (expand_masks): add the quantised vector to them
            words = q.encode(contribution, quantise_seed, setup.max_weight, add_to=ready[1])
            kernels.ring_add(scalars, ready[2][:scalars.size])
        else:
            # quantised and masked in one pass (the same words as q.encode, then the masks)
            words = np.empty(n, q.dtype)
            apply_masks(words, scalars, self._masks(), encode=(q, contribution, quantise_seed))
        self._masked = True
        return MaskedInput(setup.round, self.client, words, scalars, names)

    def expand_masks(self, msg: SharesForward, size: int, scalars: int = 16,
                     threads: int | None = None, out: np.ndarray | None = None) -> None:
        """Expand this round's masks ahead of the contribution: they depend only on the keys
        and on who shared (`msg`, the same SharesForward `masked_input` will get), so a
        client can run the keystreams while it trains; `masked_input` then only adds its
        quantised vector. `size`: the vector's words expected, `scalars`: room for that many
        scalars (a contribution that does not fit gets its masks expanded then, as without
        this call). The masked input is the same words either way. `out`: words of the ring's
        dtype and `size` to expand into (overwritten; they become the masked input's), for a
        caller that keeps them from round to round rather than map fresh pages each time."""
        self._check_round(msg)
        self._check_can_mask(msg)
        self._take_shares(msg)
        dtype = self.setup.quantiser.dtype
        if out is None:
            words = np.zeros(int(size), dtype)
        elif not isinstance(out, np.ndarray) or out.dtype != dtype or out.size != size \
                or not out.flags.c_contiguous or not out.flags.writeable:
            raise SecAggError(f"expand_masks: out must be {size} writable contiguous {dtype} "
                              f"words, got {getattr(out, 'size', '?')} "
                              f"{getattr(out, 'dtype', type(out).__name__)}")
        else:
            words = out
            words.fill(0)
        extra = np.zeros(int(scalars), np.uint64)
        masks = self._masks()
        kernels.secagg_mask(words, extra, b"".join(k for k, _ in masks),
                            bytes(1 if sub else 0 for _, sub in masks), threads=threads)
        self._ready = (self._shared_with, words, extra)

    def _take_shares(self, msg: SharesForward) -> None:
        """Keep the ciphertexts of the neighbours that shared: whom this client masks with."""
        held = {s: c for s, c in msg.ciphertexts.items() if _is_int(s) and s in self._keys}
        for s, c in held.items():
            if not isinstance(c, bytes):
                raise SecAggError(f"round {msg.round}: client {self.client}: the forward's "
                                  f"ciphertext from client {s} is {_describe(c)}, not bytes")
        self._held = held
        self._shared_with = tuple(sorted(self._held))

    def _masks(self) -> list:
        """[(key, subtract)]: the self mask, then sign(i, j) PRG(s_ij) per neighbour j that
        shared (subtracted when i > j, so each pair's two masks cancel in the sum)."""
        setup = self.setup
        return [(_self_key(setup, self.client, self._seed), False)] + \
            [(_pair_key(setup, self._s, self._keys[j][1], self.client, j), self.client > j)
             for j in self._shared_with if j != self.client]

    def unmask(self, msg: UnmaskRequest) -> UnmaskResponse:
        self._check_round(msg)
        survivors, dropped = set(msg.survivors), set(msg.dropped)
        both = survivors & dropped
        if both:
            raise SecAggError(f"round {msg.round}: client {self.client} refuses to unmask: "
                              f"client(s) {sorted(both)} are listed both as survivors and as "
                              f"dropped (that would reveal their update)")
        if self._answered:
            raise SecAggError(f"round {msg.round}: client {self.client} has answered an unmask "
                              f"request already; a second could name other survivors")
        if not self._masked:
            raise SecAggError(f"round {msg.round}: client {self.client} has not sent its "
                              f"masked input, so it has nothing in the sum to unmask")
        if self.client not in survivors:
            raise SecAggError(f"round {msg.round}: client {self.client} is not listed as a "
                              f"survivor, so its masked input is not in the sum")
        if len(survivors) < self.setup.threshold:
            # the server closes the masked phase only with t inputs in the sum; fewer would
            # be a sum the round did not promise (one survivor: that client's input)
            raise SecAggError(f"round {msg.round}: client {self.client} refuses to unmask: "
                              f"the request names {len(survivors)} survivors "
                              f"{sorted(survivors)}, fewer than the threshold "
                              f"{self.setup.threshold}")
        self._answered = True
        seeds, keys = {}, {}
        for sender, ciphertext in self._held.items():
            if sender not in survivors and sender not in dropped:
                continue
            aead = self._aead(sender)
            try:
                with openssl():
                    plain = aead.decrypt(self._nonce(sender), ciphertext,
                                         self._aad(sender, self.client))
            except InvalidTag:
                raise SecAggError(f"round {msg.round}: the shares client {sender} sent to "
                                  f"client {self.client} do not authenticate") from None
            frm, to, b_share, s_share = json.loads(plain)
            if (frm, to) != (sender, self.client):
                raise SecAggError(f"round {msg.round}: share addressed {frm}->{to} delivered "
                                  f"as {sender}->{self.client}")
            if sender in survivors:
                seeds[sender] = int(b_share)
            else:
                keys[sender] = int(s_share)
        return UnmaskResponse(msg.round, self.client, seeds, keys)

    # -- helpers
    def _check_can_mask(self, msg) -> None:
        """The masked-input phase follows this client's sharing and happens once."""
        if not self._shared:
            raise SecAggError(f"round {msg.round}: client {self.client} has not shared its "
                              f"keys, so it masks with no one yet")
        if self._masked:
            raise SecAggError(f"round {msg.round}: client {self.client} has sent its masked "
                              f"input already; a second, under other neighbours' shares, "
                              f"would lose the pairwise masks that hide its update")

    def _check_round(self, msg) -> None:
        if msg.round != self.setup.round:
            raise SecAggError(f"client {self.client}: a {msg.kind} message of round "
                              f"{msg.round} in round {self.setup.round}")

    def _aead(self, other: int) -> AESGCM:
        # one key agreement per peer and round: the same key decrypts in the unmask phase
        aead = self._aeads.get(other)
        if aead is None:
            shared = _agree(self._c, self._keys[other][0],
                            f"round {self.setup.round}: client {self.client}: the key "
                            f"broadcast's c_public of client {other}")
            lo, hi = sorted((self.client, other))
            key = _hkdf(shared, "shares", self.setup.run_id, self.setup.round, lo, hi)
            with openssl():
                aead = self._aeads[other] = AESGCM(key)
        return aead

    @staticmethod
    def _nonce(sender: int) -> bytes:
        # one key per unordered pair and round, one message per direction: the sender's id
        # makes the two directions' nonces differ
        return struct.pack(">QI", sender, 0)

    def _aad(self, sender: int, holder: int) -> bytes:
        return f"{self.setup.run_id}|{self.setup.round}|{sender}->{holder}".encode()


def _self_key(setup: RoundSetup, client: int, seed: bytes) -> bytes:
    return _hkdf(seed, "self", setup.run_id, setup.round, client)


def _pair_key(setup: RoundSetup, private: X25519PrivateKey, public: X25519PublicKey,
              a: int, b: int) -> bytes:
    lo, hi = sorted((a, b))
    shared = _agree(private, public, f"round {setup.round}: the s_public of client {b} "
                                     f"(paired with client {a})")
    return _hkdf(shared, "pair", setup.run_id, setup.round, lo, hi)


def apply_masks(words: np.ndarray, scalars: np.ndarray, masks, encode=None) -> None:
    """words, scalars (+|-)= PRG(key) mod 2^bits for each (key, subtract) of `masks`: each
    key's keystream (`mask_stream`'s) covers the vector's words first, then 8 bytes per
    scalar (kernels.secagg_mask: in the C core, OpenSSL's AES-256-CTR with the GIL released,
    the vector in pieces over the cores, each piece walked in cache-sized blocks with every
    key's stream in turn; `cryptography`'s AES, the oracle, without the core). `encode` =
    (quantiser, contribution, seed): the words are first set to the contribution's
    quantised vector (Quantiser.encode), in the same pass over memory."""
    if words.dtype not in kernels.RING_DTYPES.values():
        raise SecAggError(f"masked words must be uint32 or uint64, got {words.dtype}")
    keys = b"".join(key for key, _ in masks)
    subtract = bytes(1 if sub else 0 for _, sub in masks)
    if encode is None:
        if masks:
            kernels.secagg_mask(words, scalars, keys, subtract)
        return
    q, contribution, seed = encode
    kernels.secagg_mask(words, scalars, keys, subtract, contribution.vector, q.clip, q.levels,
                        weight=contribution.weight, seed=seed, stochastic=True)


# ======================================================================== server
class SecAggServer:
    """The aggregator's side of one secure round. `receive` each client message, `advance`
    to close a phase (it returns the next messages, {client: message}); after the unmask
    phase `total` is the survivors' sum."""

    def __init__(self, setup: RoundSetup):
        if len(setup.participants) < 2:
            raise SecAggError(f"round {setup.round}: a secure round needs 2 or more "
                              f"participants (the sum of one update is that update)")
        _check_threshold(setup)
        self.setup = setup
        self.vector_size, self.scalar_names = setup.vector_size, setup.scalar_names
        self.phase = "keys"
        self.neighbourhoods = setup.neighbourhoods()
        self.keys: dict = {}
        self._key_owner: dict = {}     # {public key bytes: the client that advertised it}
        self.shares: dict = {}
        self.masked: dict = {}         # {client: _Received}: the words are summed on arrival
        # {(size, scalar names): [words, scalars]}: the ring sums of the masked inputs, one
        # per shape; the round's is the shape t clients sent (advance)
        self._sums: dict = {}
        self._sum = None               # (words, scalars): the round's, once chosen
        self.revealed: dict = {}
        self.survivors: tuple = ()
        self.dropped: tuple = ()
        self.total: SumTotal | None = None
        self.ring_words = self.ring_scalars = None    # the unmasked ring sums, once done

    @property
    def round(self) -> int:
        return self.setup.round

    def receive(self, msg) -> None:
        """Take one client message of the current phase; LateMessage for a past phase's,
        SecAggError for anything else out of place."""
        expect = {"keys": AdvertiseKeys, "shares": ShareKeys, "masked": MaskedInput,
                  "unmask": UnmaskResponse}.get(self.phase)
        order = {AdvertiseKeys: 0, ShareKeys: 1, MaskedInput: 2, UnmaskResponse: 3}
        if msg.round != self.round:
            raise LateMessage(f"round {self.round}: a {msg.kind} message of round {msg.round}")
        if type(msg) is not expect:
            if type(msg) in order and (expect is None or order[type(msg)] < order[expect]):
                raise LateMessage(f"round {self.round}: client {msg.client}'s {msg.kind} "
                                  f"message arrived in phase {self.phase!r}, after its own "
                                  f"phase closed" + (" (its masks are being removed: it "
                                                     "cannot be unmasked)"
                                                     if isinstance(msg, MaskedInput) else ""))
            raise SecAggError(f"round {self.round}: a {msg.kind} message in phase "
                              f"{self.phase!r}")
        allowed = {"keys": self.setup.participants, "shares": self.keys,
                   "masked": self.shares, "unmask": self.survivors}[self.phase]
        book = {"keys": self.keys, "shares": self.shares, "masked": self.masked,
                "unmask": self.revealed}[self.phase]
        if msg.client not in allowed:
            raise SecAggError(f"round {self.round}: client {msg.client} may not send a "
                              f"{msg.kind} message in phase {self.phase!r}")
        if msg.client in book:
            raise SecAggError(f"round {self.round}: client {msg.client} sent its {msg.kind} "
                              f"message twice")
        self._check_fields(msg)
        if isinstance(msg, AdvertiseKeys):
            self._check_distinct(msg)
        if isinstance(msg, MaskedInput):
            q = self.setup.quantiser
            size, names = self.vector_size, self.scalar_names
            if msg.words.dtype != q.dtype or (size is not None and msg.words.size != size) \
                    or (names is not None and tuple(msg.scalar_names) != tuple(names)) \
                    or msg.scalars.size != 1 + len(msg.scalar_names):
                raise SecAggError(f"round {self.round}: client {msg.client}'s masked input "
                                  f"has {msg.words.size} {msg.words.dtype} words and scalars "
                                  f"{list(msg.scalar_names)} ({msg.scalars.size} words), "
                                  f"expected {size} {q.dtype} and {names}")
            # Summed now rather than held: ring addition is order-free, so the sum is the same
            # as summing at unmask time -- without keeping n vectors alive until then (fresh
            # pages for each of them cost as much as quantising it). One sum per shape when
            # the setup leaves it open (over a broker): were the first input to fix it, one
            # client sending first with another shape would have every honest input refused,
            # in every attempt of the round.
            shape = (msg.words.size, tuple(msg.scalar_names))
            held = self._sums.get(shape)
            if held is None:
                self._sums[shape] = [msg.words.copy(), msg.scalars.copy()]
            else:
                kernels.ring_add(held[0], msg.words)
                kernels.ring_add(held[1], msg.scalars)
            msg = _Received(msg.client, msg.words.size, tuple(msg.scalar_names), msg.nbytes)
        book[msg.client] = msg

    def _check_fields(self, msg) -> None:
        """A client's keys, ciphertexts and shares are what the protocol sends, or the whole
        message is refused (SecAggError naming the client and the field; the client is then
        one that did not answer the phase). Taken, a bad field fails later and elsewhere: a
        key that is not a usable X25519 point in every honest neighbour's key agreement, a
        ciphertext that is not bytes in the forward the neighbour reads, a share that is not
        a field element in the reconstruction (and a reveal may not hand the server a secret
        it must not have: a mask-key share of a survivor, a seed share of a dropped
        client)."""
        where = f"round {self.round}: client {msg.client}'s {msg.kind} message"
        if isinstance(msg, AdvertiseKeys):
            for name in ("c_public", "s_public"):
                _check_public_key(getattr(msg, name), f"{where}: {name}")
        elif isinstance(msg, ShareKeys):
            # its neighbours with keys, as its KeysBroadcast named them
            holders = self.neighbourhoods[msg.client] & self.keys.keys()
            cts = msg.ciphertexts
            if not isinstance(cts, dict):
                raise SecAggError(f"{where}: ciphertexts is {_describe(cts)}, not a map of "
                                  f"holder to ciphertext")
            for h, ct in cts.items():
                if not _is_int(h) or h not in holders:
                    raise SecAggError(f"{where}: ciphertexts holds one for {h!r}, which is "
                                      f"not one of its neighbours with keys "
                                      f"{sorted(holders)}")
                if not isinstance(ct, bytes) or not 16 < len(ct) <= MAX_SHARE_CIPHERTEXT:
                    raise SecAggError(f"{where}: ciphertexts[{h}] is {_describe(ct)}, not an "
                                      f"AES-GCM ciphertext of a pair of shares (17 to "
                                      f"{MAX_SHARE_CIPHERTEXT} bytes)")
            need = _neighbour_threshold(self.setup, len(self.neighbourhoods[msg.client]))
            if len(cts) < need:
                # its secrets could not be reconstructed: its masked input, taken, would
                # fail the unmask phase, which ends the run
                raise SecAggError(f"{where}: ciphertexts for {len(cts)} holders, and its "
                                  f"secrets need {need} shares to be reconstructed")
        elif isinstance(msg, UnmaskResponse):
            forwarded = self._shared_with(msg.client)
            for name, asked, what in (("seed_shares", self.survivors, "a survivor"),
                                      ("key_shares", self.dropped, "a dropped client")):
                shares = getattr(msg, name)
                if not isinstance(shares, dict):
                    raise SecAggError(f"{where}: {name} is {_describe(shares)}, not a map "
                                      f"of client to share")
                for c, share in shares.items():
                    if not _is_int(c) or c not in asked or c not in forwarded:
                        raise SecAggError(f"{where}: {name} holds a share of {c!r}, which is "
                                          f"not {what} whose shares were forwarded to it")
                    if not _is_int(share) or not 0 <= share < shamir.PRIME:
                        raise SecAggError(f"{where}: {name}[{c}] is {_describe(share)}, not "
                                          f"a share (a whole number below 2^521 - 1)")

    def _check_distinct(self, msg: "AdvertiseKeys") -> None:
        """Bonawitz et al.'s check that the advertised public keys are distinct: a client
        advertising another's key would have its neighbours encrypt its shares to, and mask
        with, a secret it does not hold (the honest ones then fail to read its shares), or
        pose as that client to them. The later advertisement is refused, naming both
        clients; its sender is then a dropout of the keys phase. A client's own two keys
        may be equal (only its own agreements are affected)."""
        for name in ("c_public", "s_public"):
            owner = self._key_owner.get(getattr(msg, name))
            if owner is not None and owner != msg.client:
                raise SecAggError(f"round {self.round}: client {msg.client}'s advertise "
                                  f"message: {name} is a public key client {owner} "
                                  f"advertised first; the keys of a round must be distinct, "
                                  f"so client {msg.client} is refused (a dropout)")
        for name in ("c_public", "s_public"):
            self._key_owner[getattr(msg, name)] = msg.client

    def advance(self) -> dict:
        """Close the current phase: at least t clients must have answered (SecAggAborted
        otherwise; the phase stays open to nobody). Returns {client: message} to send."""
        r = self.round
        if self.phase == "keys":
            self._need(self.keys, "advertised keys")
            self.phase = "shares"
            return {c: KeysBroadcast(r, {j: [self.keys[j].c_public, self.keys[j].s_public]
                                         for j in sorted(self.neighbourhoods[c])
                                         if j in self.keys})
                    for c in sorted(self.keys)}
        if self.phase == "shares":
            self._need(self.shares, "shared keys")
            self.phase = "masked"
            out = {}
            for c in sorted(self.shares):
                out[c] = SharesForward(r, {s: m.ciphertexts[c] for s, m in sorted(self.shares.items())
                                           if c in m.ciphertexts})
            return out
        if self.phase == "masked":
            self._need(self.masked, "sent masked input")
            shape = self._round_shape()
            self._sum = tuple(self._sums.pop(shape))
            self._sums.clear()
            # a client of another shape is not in the sum: dropped (its pairwise masks are
            # removed with its reconstructed mask key; its self mask, never revealed, keeps
            # its input hidden)
            self.survivors = tuple(sorted(c for c, m in self.masked.items()
                                          if (m.size, m.scalar_names) == shape))
            self.dropped = tuple(sorted(set(self.shares) - set(self.survivors)))
            self.phase = "unmask"
            request = UnmaskRequest(r, self.survivors, self.dropped)
            return {c: request for c in self.survivors}
        if self.phase == "unmask":
            self._need(self.revealed, "answered the unmask request")
            self.total = self._unmask()
            self.phase = "done"
            return {}
        raise SecAggError(f"round {r}: the round is {self.phase}")

    def _round_shape(self) -> tuple:
        """The (size, scalar names) of the masked inputs in the sum: the shape at least t
        clients sent (t is more than half of them: at most one shape can); SecAggAborted
        naming the shapes and their senders when none did."""
        senders: dict = {}
        for c, m in sorted(self.masked.items()):
            senders.setdefault((m.size, m.scalar_names), []).append(c)
        shape, most = max(senders.items(), key=lambda kv: len(kv[1]))
        if len(most) < self.setup.threshold:
            self.phase = "failed"
            seen = ", ".join(f"{size} words and scalars {list(names)} from clients {cs}"
                             for (size, names), cs in senders.items())
            raise SecAggAborted(f"round {self.round}: no shape of masked input came from "
                                f"{self.setup.threshold} clients (the threshold): {seen}; "
                                f"the round fails and nothing is unmasked")
        return shape

    def _need(self, book: Mapping, what: str) -> None:
        if len(book) < self.setup.threshold:
            phase, self.phase = self.phase, "failed"
            raise SecAggAborted(
                f"round {self.round}: only {len(book)} of {len(self.setup.participants)} "
                f"clients {what} (phase {phase!r}); the threshold is {self.setup.threshold}, "
                f"so the round fails and nothing is unmasked")

    def _unmask(self) -> SumTotal:
        setup, q = self.setup, self.setup.quantiser
        # every secret needed, reconstructed only once all of them have enough shares
        needed = [(c, "seed") for c in self.survivors] + [(c, "key") for c in self.dropped]
        pieces = {}
        for c, which in needed:
            holders = self.neighbourhoods[c]
            t_n = _neighbour_threshold(setup, len(holders))
            got = {h + 1: getattr(self.revealed[h], f"{which}_shares")[c]
                   for h in sorted(holders) if h in self.revealed
                   and c in getattr(self.revealed[h], f"{which}_shares")}
            if len(got) < t_n:
                self.phase = "failed"
                raise SecAggAborted(f"round {self.round}: {len(got)} shares of client {c}'s "
                                    f"{'self-mask seed' if which == 'seed' else 'mask key'} "
                                    f"came back, {t_n} needed; nothing is unmasked")
            pieces[(c, which)] = got
        names = self.masked[self.survivors[0]].scalar_names
        words, scalars = self._sum
        masks = []
        for c in self.survivors:
            seed = self._combine(c, "seed", pieces[(c, "seed")])
            masks.append((_self_key(setup, c, seed), True))
        for d in self.dropped:
            secret = self._combine(d, "key", pieces[(d, "key")])
            with openssl():
                private = X25519PrivateKey.from_private_bytes(secret)
            for j in self.survivors:
                # j masked with d iff d is j's neighbour and d's shares reached j
                if j in self.neighbourhoods[d] and d in self._shared_with(j):
                    with openssl():
                        public = X25519PublicKey.from_public_bytes(self.keys[j].s_public)
                    key = _pair_key(setup, private, public, d, j)
                    # j added sign(j, d) PRG: + when j < d; take it away
                    masks.append((key, j < d))
        apply_masks(words, scalars, masks)
        self.ring_words, self.ring_scalars = words, scalars
        values = decode_scalars(scalars)
        return SumTotal(q.decode(words), values[0], dict(zip(names, values[1:])),
                        len(self.survivors))

    def _combine(self, c: int, which: str, shares: dict) -> bytes:
        """Client c's secret from its shares {x: share}; SecAggAborted naming it and the
        holders whose shares were used when they do not give a secret back (a share changed
        on its way or by its holder: each is a field element, so only the result shows)."""
        t_n = _neighbour_threshold(self.setup, len(self.neighbourhoods[c]))
        try:
            return shamir.combine(shares, t_n)
        except shamir.ShamirError as exc:
            self.phase = "failed"
            used = sorted(shares)[:t_n]
            raise SecAggAborted(
                f"round {self.round}: the shares of client {c}'s "
                f"{'self-mask seed' if which == 'seed' else 'mask key'} from clients "
                f"{[x - 1 for x in used]} do not give it back ({exc}); nothing is "
                f"unmasked") from None

    def _shared_with(self, j: int) -> set:
        """The senders whose shares the server forwarded to j (whom j masked with)."""
        return {s for s, m in self.shares.items() if j in m.ciphertexts}

    def uplink_bytes(self) -> int:
        """Bytes of the masked inputs summed (the record's uplink_bytes)."""
        return sum(self.masked[c].nbytes for c in self.survivors)


@dataclass(frozen=True)
class _Received:
    """What the server keeps of a masked input once its words are in the running sum."""
    client: int
    size: int
    scalar_names: tuple
    nbytes: int


# ======================================================================== in process
def max_weight_of(strategy, sample_counts: Mapping[int, int]) -> int:
    """The quantiser's weight bound for a round of these participants: 1 under uniform
    weighting, else their largest sample count (`strategies.client_weight`)."""
    if getattr(strategy, "weighting", "samples") == "uniform":
        return 1
    return max(int(n) for n in sample_counts.values())


def round_setup(settings, *, run_id: str, round: int, participants: Sequence[int], seed: int,
                vector_size: int | None, scalar_names: Sequence[str] | None,
                max_weight: int) -> RoundSetup:
    """The RoundSetup of one round from the run's `privacy.secure_aggregation` settings
    (privacy.settings.SecureAggregation): t for this many participants, the quantiser
    (SecAggError when the ring cannot hold the sum)."""
    participants = tuple(sorted(int(c) for c in participants))
    q = Quantiser.for_round(settings.ring_bits, settings.clip_range, len(participants),
                            max_weight)
    return RoundSetup(str(run_id), int(round), participants,
                      settings.threshold_count(len(participants)), int(settings.neighbours),
                      int(seed), q.bits, q.clip, q.levels, int(max_weight),
                      None if vector_size is None else int(vector_size),
                      None if scalar_names is None else tuple(sorted(scalar_names)))


def run_in_process(setup: RoundSetup, contributions: Mapping[int, Contribution],
                   seeds: Mapping[int, int] | None = None, *,
                   vanish: Mapping[str, Sequence[int]] | None = None,
                   wire: bool = False, entropy: bytes | None = None) -> SecAggServer:
    """One secure round between in-process clients (real keys, real masks): returns the
    server, whose `total` is the survivors' sum. `vanish` = {phase: clients} makes clients
    drop before sending that phase's message ("keys", "shares", "masked", "unmask");
    `seeds` are the clients' quantisation seeds; `wire` sends every message through
    to_bytes / message_from_bytes, as a transport would; `entropy` (tests only) seeds the
    clients' keys (SecAggClient)."""
    return InProcessRound(setup, vanish=vanish, wire=wire, entropy=entropy).finish(
        contributions, seeds)


class InProcessRound:
    """`run_in_process` in two halves, for a caller that has the contributions only later:
    the constructor runs the phases that need no contribution (keys, shares), `expand_masks`
    lets the clients expand their masks ahead (SecAggClient.expand_masks; the simulator
    does it while they train), `send_masked` sends one client's masked input as soon as its
    contribution exists, and `finish` sends the rest and runs the unmask phase. The messages
    and the dropouts are run_in_process's; the masked inputs may arrive in any order (the
    server's ring sum does not depend on it)."""

    def __init__(self, setup: RoundSetup, *, vanish: Mapping[str, Sequence[int]] | None = None,
                 wire: bool = False, entropy: bytes | None = None):
        self.vanish = {k: set(v) for k, v in (vanish or {}).items()}
        unknown = set(self.vanish) - set(PHASES[:4])
        if unknown:
            raise SecAggError(f"vanish: unknown phase(s) {sorted(unknown)}; valid: "
                              f"{PHASES[:4]}")
        self.carry = (lambda m: message_from_bytes(m.to_bytes())) if wire else (lambda m: m)
        self.server = SecAggServer(setup)
        setup_msg = self.carry(setup)
        self.clients = {c: SecAggClient(c, setup_msg, entropy) for c in setup.participants}
        self.gone: set = set()
        self._step("keys", {c: self.clients[c].advertise for c in self.clients})
        out = self.server.advance()
        self._step("shares", {c: (lambda c=c: self.clients[c].share_keys(self.carry(out[c])))
                              for c in out})
        self.forward = {c: self.carry(m) for c, m in self.server.advance().items()}
        self.sent: set = set()

    def _step(self, phase, make) -> None:
        self.gone.update(self.vanish.get(phase, ()))
        for c, payload in sorted(make.items()):
            if c not in self.gone:
                self.server.receive(self.carry(payload()))

    def expand_masks(self, size: int, threads: int | None = None,
                     buffers: dict | None = None) -> None:
        """Every client that will send a masked input expands its masks for a vector of
        `size` words now (SecAggClient.expand_masks). `buffers` {client: words}: kept from
        round to round by the caller, each client's words expanded into its own (made or
        replaced here when missing or of another size or dtype); the round's masked inputs
        are those words, so a buffer is not to be touched until the round is over."""
        dtype = self.server.setup.quantiser.dtype
        for c, msg in sorted(self.forward.items()):
            if c not in self.gone and c not in self.vanish.get("masked", ()):
                out = None
                if buffers is not None:
                    out = buffers.get(c)
                    if out is None or out.size != size or out.dtype != dtype:
                        out = buffers[c] = np.empty(int(size), dtype)
                self.clients[c].expand_masks(msg, size, threads=threads, out=out)

    def send_masked(self, c: int, contribution: Contribution, seed: int = 0) -> None:
        """Client c's masked input, to the server (once; none from a client that vanishes
        in the masked phase or before)."""
        if c in self.sent or c not in self.forward:
            return
        self.sent.add(c)
        if c not in self.gone and c not in self.vanish.get("masked", ()):
            self.server.receive(self.carry(self.clients[c].masked_input(
                self.forward[c], contribution, seed)))

    def finish(self, contributions: Mapping[int, Contribution],
               seeds: Mapping[int, int] | None = None) -> SecAggServer:
        """The masked inputs not sent yet, then the unmask phase: returns the server, its
        `total` the sum."""
        seeds = seeds or {}
        self.gone.update(self.vanish.get("masked", ()))
        for c in sorted(self.forward):
            if c not in self.gone:
                self.send_masked(c, contributions[c], seeds.get(c, 0))
        out = self.server.advance()
        self._step("unmask", {c: (lambda c=c: self.clients[c].unmask(self.carry(out[c])))
                              for c in out})
        self.server.advance()
        return self.server
