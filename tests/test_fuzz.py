"""Fuzzing of the frame decoder and of chunk reassembly with hypothesis (docs/limits.md
"Fuzzing"): random bytes, valid frames truncated, bit-flipped, with oversized length fields,
a wrong layer-table hash, a wrong CRC or non-finite values, chunk storms (many chunk sets,
duplicates, any order, interleaved senders, sets that never complete, forged chunks), and
sound chunks around a forged frame (accepted in chunks exactly when it is accepted whole)
through `Reassembler`. The properties: nothing but FrameError is ever raised, every refusal is logged
with its code, corruption is always caught (every bit of a frame is under a CRC), what is
delivered is what was sent and only once, and the reassembler's memory stays within its
limits at every step. Signed frames and documents whose signature envelope is altered in
any field (changed, removed, added, replaced by any JSON value, one character flipped), or
whose content changes under a valid envelope, are refused with SignatureError, never
accepted and never another exception.

A few hundred examples per property in CI (profile "ci"); EDGEFL_FUZZ_PROFILE=long runs
10,000 each. `python tools/fuzz.py` is the long run with a table of outcomes."""
from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import struct
import tempfile
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis.configuration import set_hypothesis_home_dir
from hypothesis import strategies as st

from edgefl.params import LayerTable
from edgefl.transport import signing, wire
from edgefl.transport.wire import Expectation, FrameError

# database=None and a home of its own: the examples are derandomised, and hypothesis keeps
# its database and caches in .hypothesis/ of the working directory, where tests write nothing
_HYPOTHESIS_HOME = tempfile.mkdtemp(prefix="edgefl-hypothesis-")
atexit.register(shutil.rmtree, _HYPOTHESIS_HOME, True)
set_hypothesis_home_dir(_HYPOTHESIS_HOME)
settings.register_profile(
    "ci", max_examples=300, deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                           HealthCheck.data_too_large])
settings.register_profile(
    "long", max_examples=10_000, deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                           HealthCheck.data_too_large])
FUZZ = settings.get_profile(os.environ.get("EDGEFL_FUZZ_PROFILE", "ci"))

TABLE = LayerTable.from_shapes([("w", (16, 8)), ("b", (8,))])
OTHER = LayerTable.from_shapes([("w", (8, 17))])            # same size class, other model
SENDERS = ("pi-01", "pi-02", "pi-03")

# header fields: (byte offset, struct format) in the 64-byte header (docs/protocol.md)
FIELDS = {"round": (8, "<I"), "chunk_index": (12, "<I"), "chunk_count": (16, "<I"),
          "meta_len": (20, "<I"), "payload_len": (24, "<Q"), "table_hash": (32, "<Q"),
          "message_id": (40, "<Q"), "crc": (48, "<I")}


def seal_header(data: bytes) -> bytes:
    """The header CRC recomputed: a frame a buggy writer sends, not line noise."""
    return data[:60] + struct.pack("<I", zlib.crc32(data[:60])) + data[64:]


def seal(data: bytes) -> bytes:
    """Body CRC, then header CRC, recomputed."""
    with_crc = data[:48] + struct.pack("<I", zlib.crc32(data[64:])) + data[52:]
    return seal_header(with_crc)


def set_field(data: bytes, name: str, value: int) -> bytes:
    at, fmt = FIELDS[name]
    return data[:at] + struct.pack(fmt, value) + data[at + struct.calcsize(fmt):]


def weights(seed: int, scale: float = 1.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(TABLE.size) * scale).astype(np.float32)


@st.composite
def frames(draw):
    """(a valid whole frame, the Expectation that accepts it)."""
    kind = draw(st.sampled_from(["update", "update", "model", "client_model", "onnx"]))
    seed = draw(st.integers(0, 2 ** 16))
    round_ = draw(st.integers(0, 5))
    if kind == "onnx":
        blob = draw(st.binary(min_size=0, max_size=600))
        return (wire.encode("onnx", round_, "agg", {"model.onnx": blob}),
                Expectation(None, kinds="onnx"))
    compression = draw(st.sampled_from(["none", "f16", "int8"]))
    n = draw(st.integers(1, 2))
    buffers = {f"b{i}": weights(seed + i) for i in range(n)}
    scalars = draw(st.dictionaries(st.text(min_size=1, max_size=8),
                                   st.integers(-5, 5) | st.floats(allow_nan=False,
                                                                  allow_infinity=False),
                                   max_size=3))
    if kind == "client_model":
        data = wire.encode(kind, round_, "agg", buffers, scalars, TABLE, compression,
                           recipient="pi-01")
        return data, Expectation(TABLE, kinds=kind, topic_recipient="pi-01")
    sender = "agg" if kind == "model" else draw(st.sampled_from(SENDERS))
    data = wire.encode(kind, round_, sender, buffers, scalars, TABLE, compression)
    return data, Expectation(TABLE, kinds=kind,
                             topic_sender=sender if kind == "update" else None)


class Outcomes:
    """Feeds payloads to a Reassembler, checks the invariants after each, and remembers what
    was refused (code) and delivered."""

    def __init__(self, reassembler: wire.Reassembler, caplog):
        self.r = reassembler
        self.caplog = caplog
        self.codes: list[str] = []
        self.delivered: list = []

    def add(self, payload: bytes, expect: Expectation):
        try:
            frame = self.r.add(payload, expect)
        except FrameError as exc:
            assert exc.code and exc.reason, "a FrameError without code or reason"
            self.codes.append(exc.code)
            frame = None
        # any other exception fails the test right here: that is the property
        assert self.r.bytes_in_flight <= self.r.max_bytes
        assert self.r.bytes_buffered <= self.r.bytes_in_flight
        if frame is not None:
            self.delivered.append(frame)
        return frame

    def assert_every_reject_logged(self):
        logged = [r.getMessage() for r in self.caplog.records
                  if r.name == "edgefl.transport.wire" and r.getMessage().startswith("rejected")]
        assert [m.split("]")[0][len("rejected ["):] for m in logged] == self.codes
        assert sum(self.r.rejected.values()) == len(self.codes)


def fresh(caplog, **limits) -> Outcomes:
    caplog.clear()
    caplog.set_level(logging.DEBUG, "edgefl.transport.wire")
    return Outcomes(wire.Reassembler(**limits), caplog)


# ---------------------------------------------------------------------------------------
# whole frames
# ---------------------------------------------------------------------------------------

@FUZZ
@given(data=st.binary(max_size=400), expect=st.sampled_from([
    Expectation(TABLE, kinds="update"), Expectation(None, kinds="onnx")]))
def test_random_bytes_are_refused_with_a_logged_code(caplog, data, expect):
    out = fresh(caplog)
    assert out.add(data, expect) is None
    assert len(out.codes) == 1
    out.assert_every_reject_logged()


@FUZZ
@given(data=st.binary(min_size=0, max_size=300))
def test_random_bytes_behind_a_valid_magic_are_refused(caplog, data):
    out = fresh(caplog)
    out.add(wire.MAGIC + bytes([wire.VERSION]) + data, Expectation(TABLE, kinds="update"))
    out.add(seal_header((wire.MAGIC + bytes([wire.VERSION]) + data).ljust(64, b"\0"))
            + data, Expectation(TABLE, kinds="update"))
    assert len(out.codes) == 2
    out.assert_every_reject_logged()


@FUZZ
@given(frame=frames(), cut=st.floats(0, 1, exclude_max=True))
def test_truncated_frames_are_refused_as_truncated(caplog, frame, cut):
    data, expect = frame
    out = fresh(caplog)
    out.add(data[:int(len(data) * cut)], expect)
    assert out.codes == ["truncated"]
    out.assert_every_reject_logged()


@FUZZ
@given(frame=frames(), flips=st.lists(st.integers(0, 2 ** 31), min_size=1, max_size=4,
                                      unique=True))
def test_bit_flips_anywhere_are_always_caught(caplog, frame, flips):
    data, expect = frame
    out = fresh(caplog)
    assert out.add(data, expect) is not None               # the intact frame is accepted
    b = bytearray(data)
    for bit in {f % (8 * len(b)) for f in flips}:   # distinct bits: two flips never cancel
        b[bit // 8] ^= 1 << (bit % 8)
    assert out.add(bytes(b), expect) is None
    assert len(out.codes) == 1                              # every bit is under a CRC
    out.assert_every_reject_logged()


@FUZZ
@given(frame=frames(), field=st.sampled_from(["meta_len", "payload_len"]),
       value=st.integers(0, 2 ** 32 - 1) | st.sampled_from([2 ** 32 - 1, 2 ** 31, 1 << 20]))
def test_oversized_or_wrong_length_fields_are_refused(caplog, frame, field, value):
    data, expect = frame
    at, fmt = FIELDS[field]
    if value == struct.unpack_from(fmt, data, at)[0]:
        value += 16
    out = fresh(caplog)
    lengths = {"meta_len": wire.read_header(data).meta_len,
               "payload_len": wire.read_header(data).payload_len, field: value}
    announced = 64 + wire.header._align(lengths["meta_len"]) + lengths["payload_len"]
    out.add(seal_header(set_field(data, field, value)), expect)
    assert len(out.codes) == 1
    if announced != len(data):        # else the body no longer parses: metadata, buffer...
        assert out.codes[0] in ("size", "truncated")
    out.assert_every_reject_logged()


@FUZZ
@given(frame=frames(), bad_hash=st.integers(1, 2 ** 64 - 1))
def test_a_wrong_table_hash_is_refused(caplog, frame, bad_hash):
    data, expect = frame
    out = fresh(caplog)
    original = struct.unpack_from("<Q", data, 32)[0]
    forged = seal_header(set_field(data, "table_hash", bad_hash ^ original))
    got = out.add(forged, expect)
    if expect.table is None:          # onnx without a model to check against: not checkable
        assert got is not None and out.codes == []
    else:
        assert out.codes == ["table_hash"]
        out.add(data, Expectation(OTHER, kinds=expect.kinds))   # the intact frame, wrong model
        assert out.codes == ["table_hash", "table_hash"]
    out.assert_every_reject_logged()


@FUZZ
@given(frame=frames(), delta=st.integers(1, 2 ** 32 - 1))
def test_a_wrong_crc_is_refused(caplog, frame, delta):
    data, expect = frame
    crc = struct.unpack_from("<I", data, 48)[0]
    out = fresh(caplog)
    out.add(seal_header(set_field(data, "crc", crc ^ delta)), expect)
    assert out.codes == ["crc"]
    out.assert_every_reject_logged()


@FUZZ
@given(seed=st.integers(0, 2 ** 16), at=st.integers(0, TABLE.size - 1),
       bad=st.sampled_from([np.nan, np.inf, -np.inf]), buffer=st.integers(0, 1))
def test_non_finite_values_are_refused_even_with_valid_crcs(caplog, seed, at, bad, buffer):
    data = wire.encode("update", 1, "pi-01", {"p": weights(seed), "m": weights(seed + 1)},
                       None, TABLE)
    h = wire.read_header(data)
    start = h.data_offset + buffer * wire.header._align(4 * TABLE.size) + 4 * at
    forged = seal(data[:start] + np.float32(bad).tobytes() + data[start + 4:])
    out = fresh(caplog)
    out.add(forged, Expectation(TABLE, kinds="update"))
    assert out.codes == ["non_finite"]
    out.assert_every_reject_logged()


@FUZZ
@given(frame=frames(), at=st.integers(0, 2 ** 31), value=st.integers(0, 255))
def test_resealed_garbage_is_refused_or_decodes_to_checked_values(caplog, frame, at, value):
    """A writer's bug, not noise: a byte changed and both CRCs recomputed. Whatever gets
    through decodes to finite values of the model's size."""
    data, expect = frame
    b = bytearray(data)
    b[at % len(b)] = value
    out = fresh(caplog)
    got = out.add(seal(bytes(b)), expect)
    if got is not None and expect.table is not None:
        for arr in got.buffers.values():
            assert arr.size == TABLE.size and np.isfinite(arr).all()
    out.assert_every_reject_logged()


# ---------------------------------------------------------------------------------------
# chunk storms
# ---------------------------------------------------------------------------------------

@st.composite
def storms(draw):
    """Payloads of several chunked messages from several senders, with duplicates, gaps
    (messages that never complete), corrupted and forged chunks, in any order; and what
    each complete message must decode to."""
    payloads, originals = [], {}
    for i in range(draw(st.integers(1, 8))):
        sender = draw(st.sampled_from(SENDERS))
        round_ = draw(st.sampled_from([1, 1, 1, 2]))
        seed = draw(st.integers(0, 2 ** 16))
        w = weights(seed)
        frame = wire.encode("update", round_, sender, {"params": w}, None, TABLE)
        h = wire.read_header(frame)
        originals[(sender, h.message_id)] = w
        chunks = wire.split(frame, draw(st.sampled_from([200, 256, 400, 700, 4096])))
        for j, c in enumerate(chunks):
            fate = draw(st.sampled_from(["send"] * 6 + ["drop", "twice", "flip", "forge"]))
            if fate == "drop":
                continue
            if fate == "flip":
                b = bytearray(c)
                b[draw(st.integers(0, len(b) - 1))] ^= 1 << draw(st.integers(0, 7))
                payloads.append((sender, bytes(b), False))
            elif fate == "forge":                # past the CRCs: a buggy sender
                b = bytearray(c)
                b[draw(st.integers(0, len(b) - 1))] = draw(st.integers(0, 255))
                payloads.append((sender, seal(bytes(b)), bytes(b) == c))
            payloads.append((sender, c, True))
            if fate == "twice":
                payloads.append((sender, c, True))
    order = draw(st.permutations(range(len(payloads))))
    return [payloads[k] for k in order], originals


@FUZZ
@given(storm=storms(), max_bytes=st.sampled_from([1500, 4000, 1 << 20]),
       per_sender=st.sampled_from([None, 1200, 3000]), budget=st.sampled_from([None, 6, 40]))
def test_chunk_storms_stay_within_limits_and_deliver_exactly_what_was_sent(
        caplog, storm, max_bytes, per_sender, budget):
    payloads, originals = storm
    clock = [0.0]
    out = fresh(caplog, max_bytes=max_bytes, max_bytes_per_sender=per_sender,
                max_chunks_per_sender=budget, max_pending_per_sender=3, timeout_s=30,
                clock=lambda: clock[0])
    for sender, payload, _ in payloads:
        clock[0] += 0.5
        out.add(payload, Expectation(TABLE, kinds="update", rounds={1, 2},
                                     topic_sender=sender))
    out.assert_every_reject_logged()
    seen = set()
    for frame in out.delivered:
        key = (frame.sender, frame.message_id)
        assert key not in seen, "a message delivered twice"
        seen.add(key)
        # a forged (resealed) payload can be a valid frame of its own, e.g. with another
        # message id or a renamed buffer: whatever is delivered is still checked, finite and
        # of the model's size
        assert frame.buffers
        for arr in frame.buffers.values():
            assert arr.size == TABLE.size and np.isfinite(arr).all()
    forged = sum(1 for _, _, original in payloads if not original)
    assert len(seen - set(originals)) <= forged
    clock[0] += 31
    out.r.expire()                                         # nothing incomplete lingers
    assert out.r.pending == 0 and out.r.bytes_in_flight == 0 and out.r.bytes_buffered == 0


@FUZZ
@given(storm=storms())
def test_clean_storms_deliver_every_complete_message_bit_for_bit(caplog, storm):
    payloads, originals = storm
    clean = [(s, p) for s, p, original in payloads if original]
    out = fresh(caplog, max_pending_per_sender=16)
    for sender, payload in clean:
        out.add(payload, Expectation(TABLE, kinds="update", rounds={1, 2},
                                     topic_sender=sender))
    out.assert_every_reject_logged()
    assert out.codes == []
    for frame in out.delivered:
        assert np.array_equal(frame.buffers["params"],
                              originals[(frame.sender, frame.message_id)])
    complete = {k for k in originals if _all_chunks_present(k, clean)}
    assert {(f.sender, f.message_id) for f in out.delivered} == complete


def _all_chunks_present(key, payloads) -> bool:
    sender, message_id = key
    seen, count = set(), None
    for s, p in payloads:
        h = wire.read_header(p)
        if s == sender and h.message_id == message_id:
            seen.add(h.chunk_index)
            count = h.chunk_count
    return count is not None and len(seen) == count


@FUZZ
@given(n=st.integers(50, 400), budget=st.integers(5, 60))
def test_a_chunk_flood_is_cut_off_once_and_then_ignored(caplog, n, budget):
    chunk = wire.split(wire.encode("update", 1, "pi-01", {"p": weights(1)}, None, TABLE),
                       256)[0]
    out = fresh(caplog, max_chunks_per_sender=budget)
    expect = Expectation(TABLE, kinds="update", rounds=1, topic_sender="pi-01")
    for _ in range(n):
        out.add(chunk, expect)
    assert out.codes == (["flood"] if n > budget else [])
    assert out.r.stats["ignored"] == max(0, n - budget - 1)
    floods = [r for r in caplog.records if "floods round 1" in r.getMessage()]
    assert len(floods) == (1 if n > budget else 0)
    out.assert_every_reject_logged()


# ---------------------------------------------------------------------------------------
# signature fields (docs/security.md): a signed frame or document whose envelope is
# altered in any field, or replaced by any JSON value, is refused with SignatureError --
# never accepted, never another exception
# ---------------------------------------------------------------------------------------

_SIGNING_KEY = signing.generate_key()
_SIGNER = signing.Signer(_SIGNING_KEY, "agg", "fed")
_VERIFIER = signing.Verifier("fed", {"*": [_SIGNING_KEY.public_key()]})
_JSON = st.recursive(st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70)
                     | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=90),
                     lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)


@st.composite
def altered_envelopes(draw, envelope: dict):
    """`envelope` with one field changed, removed or added, or replaced as a whole."""
    env = dict(envelope)
    how = draw(st.sampled_from(["change", "change", "remove", "add", "whole", "flip"]))
    if how == "whole":
        return draw(_JSON)
    key = draw(st.sampled_from(sorted(env)))
    if how == "remove":
        del env[key]
    elif how == "add":
        env[draw(st.text(min_size=1, max_size=6).filter(lambda k: k not in env))] = draw(_JSON)
    elif how == "flip" and isinstance(env[key], str) and env[key]:
        at = draw(st.integers(0, len(env[key]) - 1))
        c = env[key][at]
        env[key] = env[key][:at] + ("A" if c != "A" else "B") + env[key][at + 1:]
    else:
        value = draw(_JSON)
        if value == env[key] and type(value) is type(env[key]):
            value = [value]
        env[key] = value
    return env


@FUZZ
@given(data=st.data(), frame=frames())
def test_altered_signature_fields_of_a_frame_are_refused(data, frame):
    payload, expect = frame
    f = wire.decode(payload, expect)
    signed = wire.encode(f.kind, f.round, f.sender,
                         {k: (v if f.kind == "onnx" else np.array(v)) for k, v in
                          f.buffers.items()}, dict(f.scalars), None if f.kind == "onnx"
                         else TABLE, "none", recipient=f.recipient,
                         sign=_SIGNER.frame_signer("run-1"))
    good = wire.decode(signed, expect)
    _VERIFIER.verify_frame(good, where="fuzz", run="run-1")          # the unaltered one passes
    env = dict(good.scalars)["sig"]
    bad = data.draw(altered_envelopes(env))
    resent = wire.encode(good.kind, good.round, good.sender,
                         {k: (v if good.kind == "onnx" else np.array(v)) for k, v in
                          good.buffers.items()}, {**dict(good.scalars), "sig": bad},
                         None if good.kind == "onnx" else TABLE, "none",
                         recipient=good.recipient, message_id=good.message_id)
    with pytest.raises(signing.SignatureError):
        _VERIFIER.verify_frame(wire.decode(resent, expect), where="fuzz", run="run-1")


@FUZZ
@given(data=st.data(), doc=st.dictionaries(st.text(max_size=8).filter(lambda k: k != "sig"),
                                           _JSON, max_size=5),
       kind=st.sampled_from(signing.KINDS), round_=st.integers(0, 2 ** 32 - 1))
def test_altered_signature_fields_of_a_document_are_refused(data, doc, kind, round_):
    signed = _SIGNER.sign_doc(doc, kind, "run-1", round_)
    expect = dict(kind=kind, where="fuzz", run="run-1", round=round_, by="agg")
    _VERIFIER.verify_doc(signed, **expect)
    bad = {**signed, "sig": data.draw(altered_envelopes(signed["sig"]))}
    with pytest.raises(signing.SignatureError):
        _VERIFIER.verify_doc(bad, **expect)
    # the content altered under a valid envelope
    key = data.draw(st.text(min_size=1, max_size=8).filter(lambda k: k != "sig"))
    value = data.draw(_JSON)
    if doc.get(key, object()) != value:
        with pytest.raises(signing.SignatureError):
            _VERIFIER.verify_doc({**signed, key: value}, **expect)


@FUZZ
@given(data=st.data(), frame=frames(), room=st.integers(700, 1200))
def test_a_signed_frame_hashed_along_its_chunks_has_the_one_pass_digest(data, frame, room):
    """A receiver that checks signatures hashes a chunked frame while its chunks arrive
    (Reassembler digests): in any order, with repeats, the digest is the one pass's; a frame
    whose chunks were tampered with never passes."""
    payload, expect = frame
    f = wire.decode(payload, expect)
    signed = wire.encode(f.kind, f.round, f.sender,
                         {k: (v if f.kind == "onnx" else np.array(v)) for k, v in
                          f.buffers.items()}, dict(f.scalars), None if f.kind == "onnx"
                         else TABLE, "none", recipient=f.recipient,
                         sign=_SIGNER.frame_signer("run-1"))
    whole = wire.decode(signed, expect)
    chunks = wire.split(signed, room)
    order = data.draw(st.permutations(range(len(chunks))))
    repeats = data.draw(st.lists(st.integers(0, 2 ** 16), max_size=3))
    reassembler = wire.Reassembler(10, digests=True)
    got = None
    for i in list(order) + [r % len(chunks) for r in repeats]:
        got = reassembler.add(chunks[i], expect) or got
    assert got is not None and got.content_sha256() == whole.content_sha256()
    _VERIFIER.verify_frame(got, where="fuzz", run="run-1")
    # one chunk replaced by the same slice of another signed frame of the same message id
    if len(chunks) > 1:
        other = wire.encode(whole.kind, whole.round, whole.sender,
                            {k: (v if whole.kind == "onnx" else np.array(v) * 0 + 1) for k, v
                             in whole.buffers.items()}, dict(whole.scalars),
                            None if whole.kind == "onnx" else TABLE, "none",
                            recipient=whole.recipient, message_id=whole.message_id)
        swapped = wire.split(other, room)
        k = data.draw(st.integers(0, 2 ** 16)) % len(chunks)
        mixed = chunks[:k] + swapped[k:k + 1] + chunks[k + 1:]
        reassembler = wire.Reassembler(10, digests=True)
        try:
            got = None
            for c in mixed:
                got = reassembler.add(c, expect) or got
            if got is not None and bytes(got.payload) != bytes(whole.payload):
                with pytest.raises(signing.SignatureError):
                    _VERIFIER.verify_frame(got, where="fuzz", run="run-1")
        except wire.FrameError:
            pass


def chunks_by_hand(whole: bytes, room: int, sender: str) -> list:
    """`whole` cut into chunks of `room` bytes as docs/protocol.md section 5 lays them out,
    their headers copying the whole frame's kind, round, table hash and message id as its
    bytes hold them: for a frame split() would refuse to cut."""
    kind, round_ = whole[5], struct.unpack_from("<I", whole, 8)[0]
    table_hash, message_id = struct.unpack_from("<QQ", whole, 32)
    n = -(-len(whole) // room)
    out = []
    for i in range(n):
        meta = json.dumps({"sender": sender, "offset": i * room,
                           "total": len(whole)}).encode()
        piece = whole[i * room:(i + 1) * room]
        body = meta + bytes(-len(meta) % 16) + piece
        head = struct.pack("<4sBBBBIIIIQQQI8x", b"EDFL", 1, kind, 4, 1, round_, i, n,
                           len(meta), len(piece), table_hash, message_id, zlib.crc32(body))
        out.append(head + struct.pack("<I", zlib.crc32(head)) + body)
    return out


@FUZZ
@given(seed=st.integers(0, 2 ** 16), signed=st.booleans(),
       compression=st.sampled_from(["none", "f16", "int8"]),
       forge=st.sampled_from(["byte", "nested", "none"]), at=st.integers(0, 2 ** 31),
       value=st.integers(0, 255), depth=st.integers(1, 6000), room=st.integers(64, 4096))
def test_a_forged_frame_is_accepted_in_chunks_exactly_when_it_is_accepted_whole(
        caplog, seed, signed, compression, forge, at, value, depth, room):
    """Chunks each sound (their CRCs hold) around a whole frame forged past its own checks:
    a byte changed and resealed, or metadata nested up to 6,000 levels deep (past the
    interpreter's recursion limit, which hypothesis raises to 2,048), through a reassembler hashing along its chunks as a receiver
    checking signatures does. Refused exactly when the frame sent whole is, with a
    FrameError and nothing else; delivered with the same content and digest when not."""
    scalars = {"num_samples": 3, **({"sig": {"by": "pi-01"}} if signed else {})}
    data = bytearray(wire.encode("update", 1, "pi-01", {"p": weights(seed)}, scalars, TABLE,
                                 compression))
    if forge == "byte":
        data[at % len(data)] = value
    elif forge == "nested":
        meta = b"[" * depth + b"]" * depth
        start = wire.read_header(bytes(data)).data_offset
        data = data[:64] + meta + bytes(-len(meta) % 16) + data[start:]
        struct.pack_into("<I", data, 20, len(meta))
        # the first chunk holds it: that is where the hash along reads it from
        room = max(room, 64 + len(meta) + 16)
    whole = seal(bytes(data))
    expect = Expectation(TABLE, kinds="update", rounds=1, topic_sender="pi-01")
    try:
        alone = wire.decode(whole, expect)
    except FrameError:
        alone = None
    out = fresh(caplog, digests=True, max_bytes=1 << 20)
    got = None
    for chunk in chunks_by_hand(whole, room, "pi-01"):
        got = out.add(chunk, expect) or got
    out.assert_every_reject_logged()
    assert (got is None) == (alone is None), (alone, got, out.codes)
    if got is not None:
        assert got.content_sha256() == alone.content_sha256()
        assert bytes(got.payload) == bytes(alone.payload)
        assert dict(got.scalars) == dict(alone.scalars)


_BOARD = signing.Signer(_SIGNING_KEY, "c0", "fed")
_BOARDS = signing.Verifier("fed", {"c0": [_SIGNING_KEY.public_key()]})


def _same_sealed(got, good) -> bool:
    """Whether two reassembled secure messages mean the same: id, envelope fields as parsed
    (a float's 17th digit may differ in the text), and body."""
    return (got.message_id == good.message_id and dict(got.envelope) == dict(good.envelope)
            and bytes(got.body) == bytes(good.body))


def _reassemble(chunks):
    from edgefl.privacy import secagg

    assembler, out = secagg.ChunkAssembler(1 << 20), None
    for chunk in chunks:
        out = assembler.add_sealed("c0", chunk) or out
    return out


@FUZZ
@given(data=st.data(), n=st.integers(1, 300), room=st.integers(100, 2000))
def test_altered_signature_or_bytes_of_a_secure_message_are_refused(data, n, room):
    """A signed secure aggregation message (docs/protocol.md section 11) with its envelope
    altered, or any byte of any chunk flipped: refused with SignatureError or SecAggError,
    or never complete -- never accepted, never another exception."""
    from edgefl.privacy import secagg
    from edgefl.roles.trust import secure_context, secure_signer, verify_secure

    msg = secagg.MaskedInput(2, 0, np.arange(n, dtype=np.uint32), np.ones(2, np.uint64),
                             ("x",))
    context = secure_context("attempt", "c0")
    expect = dict(context=context, run="run-1", round=2, by="c0", where="fuzz")
    chunks = secagg.to_chunks(msg, room, 77, secure_signer(_BOARD, "run-1", 2, context))
    good = _reassemble(chunks)
    verify_secure(_BOARDS, good, **expect)                 # the unaltered one passes
    env = json.dumps(data.draw(altered_envelopes(good.envelope))).encode()
    body = secagg._SEAL.pack(secagg.SEAL_MAGIC, len(env)) + env + bytes(good.body)
    room_ = room - secagg._CHUNK.size
    resent = [secagg._CHUNK.pack(secagg.CHUNK_MAGIC, 77, i, -(-len(body) // room_))
              + body[i * room_:(i + 1) * room_] for i in range(-(-len(body) // room_))]
    with pytest.raises((signing.SignatureError, secagg.SecAggError)):
        verify_secure(_BOARDS, _reassemble(resent), **expect)
    # one byte of one chunk flipped
    # (positions drawn unbounded: the envelope's signing time varies the chunks' sizes)
    i = data.draw(st.integers(0, 2 ** 16)) % len(chunks)
    at = data.draw(st.integers(0, 2 ** 16)) % len(chunks[i])
    flipped = bytearray(chunks[i])
    flipped[at] ^= data.draw(st.integers(1, 255))
    try:
        got = _reassemble(chunks[:i] + [bytes(flipped)] + chunks[i + 1:])
        if got is not None:
            verify_secure(_BOARDS, got, **expect)
            got.message()
            # a flip that changes nothing the receiver reads may pass (the signing time's
            # 17th digit, parsing to the same float); anything else passing is a hole
            assert _same_sealed(got, good), \
                f"byte {at} of chunk {i} flipped, and the altered message passed"
    except (signing.SignatureError, secagg.SecAggError):
        pass


def test_the_ci_profile_runs_hundreds_of_examples():
    assert FUZZ.max_examples >= 300 and FUZZ.deadline is None


if __name__ == "__main__":            # pragma: no cover
    pytest.main([__file__, "-q"])
