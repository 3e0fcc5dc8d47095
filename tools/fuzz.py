#!/usr/bin/env python3
"""The long fuzz run of edgefl's frame decoder and chunk reassembly (tests/test_fuzz.py is
the short one, with hypothesis, in CI): prints a Markdown table of what was generated and
what came of it, or the numbers as JSON (--json).

    python tools/fuzz.py [--frames 100000] [--seed 1] [--json]

Every generated payload goes through one wire.Reassembler with small limits (max_bytes,
per-sender bytes, a chunk budget per sender and round, an expiry on a simulated clock) and
digests on, as the update topic of an aggregator that checks signatures would feed it, with
the sender taken from the topic:

  random      random bytes (sometimes behind a valid magic and version)
  truncated   a valid frame cut short
  bitflip     a valid frame with 1..4 bits flipped anywhere
  length      meta_len or payload_len rewritten (header CRC recomputed)
  hash        a wrong layer-table hash (header CRC recomputed)
  crc         a wrong body CRC (header CRC recomputed)
  nonfinite   a NaN or +-Inf in the tensor data, both CRCs recomputed
  resealed    any byte changed and both CRCs recomputed (a buggy writer)
  valid       a valid whole frame (f32, f16 or int8)
  storm       the chunks of several messages of several senders, with duplicates, drops
              (never completes), bit flips and resealed forgeries, shuffled together
  flood       one sender sending the same chunk 2..8 times its budget
  forged      one message's chunks, each valid on its own, around a whole frame forged past
              its own checks (metadata nested deeper than the interpreter's stack, header
              fields that disagree with the chunks', another sender named inside, a byte
              changed and resealed), or with chunk metadata padded out with whitespace
  signed      a valid update signed by its sender's key (must verify)
  sigfield    a signed update whose signature envelope has a field changed, removed or
              added, a character flipped, or is signed by another board's key, re-encoded
              with valid CRCs (must be refused with SignatureError)

A run fails (exit status 1) if anything but FrameError escapes, if a reject is not logged
with its code, if the reassembler ever holds more than its limit, if a frame is delivered
twice, or if a delivered frame holds a value that is not finite or has the wrong size;
and if a `signed` frame does not verify, a `sigfield` frame does, or verifying raises
anything but SignatureError (the aggregator's check of uplink signatures).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import struct
import sys
import time
import zlib
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

from _bench import markdown, need_counts    # noqa: E402
from edgefl.params import LayerTable    # noqa: E402
from edgefl.transport import signing, wire    # noqa: E402

TABLE = LayerTable.from_shapes([("w", (16, 8)), ("b", (8,))])
SENDERS = ("pi-01", "pi-02", "pi-03", "pi-04")
LIMITS = {"max_bytes": 8 << 10, "max_bytes_per_sender": 3 << 10, "max_chunks_per_sender": 64,
          "max_pending_per_sender": 3, "timeout_s": 30.0}
# generator -> weight: a storm yields ~10-60 payloads and a flood 128-512, so they are drawn
# less often to leave room for the single-frame generators
KINDS = {"random": 10, "truncated": 10, "bitflip": 10, "length": 10, "hash": 10, "crc": 10,
         "nonfinite": 10, "resealed": 10, "valid": 10, "storm": 10, "flood": 0.5,
         "signed": 5, "sigfield": 10, "forged": 10}
RUN_ID = "fuzz-run"
BOARD_KEYS = {s: signing.generate_key() for s in SENDERS}
UPLINK = signing.Verifier("fuzz", {s: [k.public_key()] for s, k in BOARD_KEYS.items()})


def seal_header(data: bytes) -> bytes:
    return data[:60] + struct.pack("<I", zlib.crc32(data[:60])) + data[64:]


def seal(data: bytes) -> bytes:
    return seal_header(data[:48] + struct.pack("<I", zlib.crc32(data[64:])) + data[52:])


def chunk_of(whole: bytes, i: int, n: int, room: int, meta: bytes) -> bytes:
    """Chunk i of n of `whole` laid out from docs/protocol.md section 5 (flag CHUNK, dtype
    bytes, the whole frame's kind, round, table hash and message id as its header says),
    with `meta` as its metadata: for frames split() would refuse to cut."""
    (_, _, kind, _, _, round_, _, _, _, _, table_hash, message_id, _) = \
        struct.unpack_from("<4sBBBBIIIIQQQI", whole, 0)
    piece = whole[i * room:(i + 1) * room]
    body = meta + bytes(-len(meta) % 16) + piece
    head = struct.pack("<4sBBBBIIIIQQQI8x", wire.MAGIC, wire.VERSION, kind, wire.DTYPES["bytes"],
                       wire.FLAG_CHUNK, round_, i, n, len(meta), len(piece), table_hash,
                       message_id, zlib.crc32(body))
    return head + struct.pack("<I", zlib.crc32(head)) + body


class Generator:
    """Seeded payload generator: each method returns [(sender, payload, round)]."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.np = np.random.default_rng(seed)
        self.round = 1

    def weights(self) -> np.ndarray:
        return self.np.standard_normal(TABLE.size).astype(np.float32)

    def frame(self, sender: str) -> bytes:
        buffers = {f"b{i}": self.weights() for i in range(self.rng.randint(1, 2))}
        return wire.encode("update", self.round, sender, buffers,
                           {"num_samples": self.rng.randint(1, 999)}, TABLE,
                           self.rng.choice(["none", "none", "f16", "int8"]))

    def one(self, kind: str) -> list:
        r, s = self.rng, self.rng.choice(SENDERS)
        if kind == "random":
            body = r.randbytes(r.randint(0, 300))
            return [(s, (wire.MAGIC + b"\x01" + body) if r.random() < 0.5 else body)]
        if kind == "storm":
            return self.storm()
        if kind in ("signed", "sigfield"):
            return [(s, self.signed(s, altered=kind == "sigfield"))]
        if kind == "forged":
            return self.forged(s)
        if kind == "flood":
            chunk = wire.split(self.frame(s), 256)[0]
            return [(s, chunk)] * (LIMITS["max_chunks_per_sender"] * r.randint(2, 8))
        data = self.frame(s)
        if kind == "valid":
            return [(s, data)]
        if kind == "truncated":
            return [(s, data[:r.randrange(len(data))])]
        if kind == "bitflip":
            b = bytearray(data)
            for _ in range(r.randint(1, 4)):
                bit = r.randrange(8 * len(b))
                b[bit // 8] ^= 1 << (bit % 8)
            return [(s, bytes(b))]
        if kind == "length":
            at, fmt = r.choice([(20, "<I"), (24, "<Q")])
            value = r.choice([r.getrandbits(32), 2 ** 32 - 1, 1 << 20, r.randint(0, 2000)])
            return [(s, seal_header(data[:at] + struct.pack(fmt, value)
                                    + data[at + struct.calcsize(fmt):]))]
        if kind == "hash":
            return [(s, seal_header(data[:32] + struct.pack("<Q", r.getrandbits(64) | 1)
                                    + data[40:]))]
        if kind == "crc":
            crc = struct.unpack_from("<I", data, 48)[0] ^ (r.getrandbits(32) | 1)
            return [(s, seal_header(data[:48] + struct.pack("<I", crc) + data[52:]))]
        if kind == "nonfinite":
            h = wire.read_header(data)
            at = h.data_offset + 4 * r.randrange(TABLE.size) \
                if h.dtype == "f32" else h.data_offset
            bad = np.float32(r.choice([np.nan, np.inf, -np.inf])).tobytes()
            if h.dtype != "f32":            # f16 / int8 have no NaN code to plant: force f32
                data = wire.encode("update", self.round, s, {"p": self.weights()}, None, TABLE)
                at = wire.read_header(data).data_offset + 4 * r.randrange(TABLE.size)
            return [(s, seal(data[:at] + bad + data[at + 4:]))]
        if kind == "resealed":
            b = bytearray(data)
            b[r.randrange(len(b))] = r.randrange(256)
            return [(s, seal(bytes(b)))]
        raise ValueError(kind)

    def signed(self, sender: str, altered: bool) -> bytes:
        """An update signed by `sender`'s key; altered: its envelope then changed."""
        r = self.rng
        buffers = {"p": self.weights()}
        scalars = {"num_samples": r.randint(1, 999)}
        signer = signing.Signer(BOARD_KEYS[sender], sender, "fuzz")
        if altered and r.random() < 0.2:      # another board's key in this board's name
            other = r.choice([x for x in SENDERS if x != sender])
            signer = signing.Signer(BOARD_KEYS[other], sender, "fuzz")
            altered = False
        data = wire.encode("update", self.round, sender, buffers, scalars, TABLE,
                           sign=signer.frame_signer(RUN_ID))
        if not altered:
            return data
        h = wire.read_header(data)
        env = dict(wire.decode(data, wire.Expectation(TABLE)).scalars)["sig"]
        key = r.choice(sorted(env))
        how = r.choice(["change", "remove", "add", "flip"])
        if how == "remove":
            del env[key]
        elif how == "add":
            env["x" + key] = r.choice([None, 1, "a", [1], {}])
        elif how == "flip" and isinstance(env[key], str) and env[key]:
            at = r.randrange(len(env[key]))
            env[key] = env[key][:at] + ("A" if env[key][at] != "A" else "B") + env[key][at + 1:]
        else:   # a value that differs from the signed one (None for null "exp" would not)
            old = env[key]
            env[key] = r.choice([v for v in (None, True, 0, -1, 2 ** 40, 1.5, "", "x" * 70, [],
                                             {"a": 1})
                                 if not (type(v) is type(old) and v == old)])
        return wire.encode("update", self.round, sender, buffers, {**scalars, "sig": env},
                           TABLE, message_id=h.message_id)

    def forged(self, sender: str) -> list:
        """The `forged` generator: a message's chunks, in order, around a forged frame."""
        r = self.rng
        data = bytearray(self.frame(sender))
        h = wire.read_header(bytes(data))
        how = r.choice(["nested", "header", "sender", "resealed", "bloated"])
        room = r.choice([256, 1024, 4096])
        if how == "nested":
            # read from the first chunk when hashing along (digests), so it fits there, and
            # the message within LIMITS' 3 KiB per sender: a short payload
            depth = r.randint(1000, 1300)
            meta = b"[" * depth + b"]" * depth
            payload = data[h.data_offset:h.data_offset + 16 * r.randint(1, 8)]
            data = data[:64] + meta + bytes(-len(meta) % 16) + payload
            struct.pack_into("<IQ", data, 20, len(meta), len(payload))
            room = len(data) - r.randrange(len(payload))
        elif how == "header":     # kind, round, message id or table hash of another message
            at, fmt, value = r.choice([(5, "<B", wire.KINDS["model"]), (8, "<I", self.round + 1),
                                       (40, "<Q", r.getrandbits(64)),
                                       (32, "<Q", r.getrandbits(64))])
            struct.pack_into(fmt, data, at, value)
        elif how == "sender":
            other = r.choice([x for x in SENDERS if x != sender])
            data = bytearray(wire.encode("update", self.round, other, {"p": self.weights()},
                                         None, TABLE, message_id=h.message_id))
        elif how == "resealed":
            data[r.randrange(len(data))] = r.randrange(256)
        whole = seal(bytes(data))
        n = -(-len(whole) // room)
        pad = b" " * (r.randint(1, 64) << 10) if how == "bloated" else b""
        return [(sender, chunk_of(whole, i, n, room,
                                  b'{"sender":"%s",%s"offset":%d,"total":%d}'
                                  % (sender.encode(), pad, i * room, len(whole))))
                for i in range(n)]

    def storm(self) -> list:
        r, out = self.rng, []
        for _ in range(r.randint(2, 8)):
            s = r.choice(SENDERS)
            for c in wire.split(self.frame(s), r.choice([200, 256, 400, 700, 4096])):
                fate = r.random()
                if fate < 0.08:
                    continue                                  # lost: never completes
                if fate < 0.14:
                    b = bytearray(c)
                    b[r.randrange(len(b))] ^= 1 << r.randrange(8)
                    out.append((s, bytes(b)))
                elif fate < 0.18:
                    b = bytearray(c)
                    b[r.randrange(len(b))] = r.randrange(256)
                    out.append((s, seal(bytes(b))))
                out.append((s, c))
                if fate > 0.9:
                    out.append((s, c))                        # QoS 1 repeat
        r.shuffle(out)
        return out


class _Codes(logging.Handler):
    """Collects the codes of the reassembler's 'rejected [code] ...' log lines."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.codes: list[str] = []

    def emit(self, record):
        msg = record.getMessage()
        if msg.startswith("rejected ["):
            self.codes.append(msg[len("rejected ["):msg.index("]")])


def run(frames: int, seed: int) -> dict:
    log = logging.getLogger("edgefl.transport.wire")
    handler = _Codes()
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    log.propagate = False                 # the flood warnings would swamp the terminal
    clock = [0.0]
    r = wire.Reassembler(clock=lambda: clock[0], digests=True, **LIMITS)
    gen = Generator(seed)
    by_kind: Counter = Counter()
    codes: Counter = Counter()
    failures: list[str] = []
    accepted = ignored = generated = signature_refused = 0
    delivered: set = set()
    peak_buffered = 0
    t0 = time.perf_counter()
    while generated < frames:
        kind = gen.rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
        for sender, payload in gen.one(kind):
            generated += 1
            by_kind[kind] += 1
            clock[0] += 0.01
            ignored_before = r.stats["ignored"]
            expect = wire.Expectation(TABLE, kinds="update", rounds=gen.round,
                                      topic_sender=sender)
            try:
                frame = r.add(payload, expect)
            except wire.FrameError as exc:
                codes[exc.code] += 1
                frame = None
            except Exception as exc:        # noqa: BLE001 -- the finding this tool reports
                failures.append(f"{kind}: {type(exc).__name__}: {exc}")
                frame = None
            ignored += r.stats["ignored"] - ignored_before
            if r.bytes_in_flight > r.max_bytes or r.bytes_buffered > r.bytes_in_flight:
                failures.append(f"{kind}: {r.bytes_buffered} bytes buffered, "
                                f"{r.bytes_in_flight} reserved, limit {r.max_bytes}")
            peak_buffered = max(peak_buffered, r.bytes_buffered)
            if frame is not None:
                accepted += 1
                key = (frame.sender, frame.message_id)
                if key in delivered:
                    failures.append(f"{kind}: message {key} delivered twice")
                delivered.add(key)
                for name, arr in frame.buffers.items():
                    if arr.size != TABLE.size or not np.isfinite(arr).all():
                        failures.append(f"{kind}: buffer {name} delivered with bad values")
                if kind in ("signed", "sigfield"):
                    try:
                        UPLINK.verify_frame(frame, kind="update", where="fuzz", run=RUN_ID,
                                            round=gen.round, by=sender)
                        verified = True
                    except signing.SignatureError:
                        verified = False
                        signature_refused += 1
                    except Exception as exc:    # noqa: BLE001 -- the finding reported
                        failures.append(f"{kind}: verify raised {type(exc).__name__}: {exc}")
                        verified = None
                    if verified is not None and verified != (kind == "signed"):
                        failures.append(f"{kind}: signature {'accepted' if verified else 'refused'}")
        if gen.rng.random() < 0.02:
            gen.round += 1                    # a new round: new budgets
            clock[0] += LIMITS["timeout_s"]   # and what is incomplete expires
    seconds = time.perf_counter() - t0
    log.removeHandler(handler)
    logged = Counter(handler.codes)
    if logged != codes:
        failures.append(f"rejects logged {dict(logged)} differ from rejects raised "
                        f"{dict(codes)}")
    return {"seed": seed, "frames": generated, "accepted": accepted,
            "rejected": sum(codes.values()), "ignored_flood": ignored,
            "signature_refused": signature_refused,
            "duplicates": r.stats["duplicates"], "expired": r.stats["expired"],
            "rejected_by_code": dict(sorted(codes.items())),
            "generated_by_kind": dict(sorted(by_kind.items())),
            "max_bytes_in_flight": r.peak_bytes, "max_bytes_buffered": peak_buffered,
            "limit_bytes": r.max_bytes, "limits": LIMITS, "seconds": round(seconds, 2),
            "failures": failures[:20], "failure_count": len(failures)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=100_000,
                        help="payloads to generate (default 100,000; at least 10,000 for "
                             "the documented run)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    need_counts(parser, args, "frames")
    result = run(args.frames, args.seed)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        summary = {k: result[k] for k in ("frames", "accepted", "rejected", "ignored_flood",
                                          "signature_refused",
                                          "duplicates", "expired", "max_bytes_in_flight",
                                          "max_bytes_buffered", "limit_bytes", "seconds")}
        print(markdown([summary]))
        print()
        print(markdown([{"code": c, "rejected": n}
                        for c, n in result["rejected_by_code"].items()]))
        print()
        print(markdown([{"generator": k, "payloads": n}
                        for k, n in result["generated_by_kind"].items()]))
        print()
        print(f"failures: {result['failure_count']}")
        for f in result["failures"]:
            print(f"  {f}")
    return 1 if result["failure_count"] else 0


if __name__ == "__main__":
    sys.exit(main())
