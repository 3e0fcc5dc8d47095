"""Secure aggregation against a malicious or broken client (edgefl/privacy/secagg.py): a
message whose fields are not what the protocol sends (keys of the wrong size or type,
ciphertexts that are not bytes or are addressed to parties outside the sender's
neighbourhood, reveals that are not share maps or ask the server to take both secrets of one
client) is refused when it arrives, naming the client and the field, and the round goes on
without it, exact; a tampered share that can only show at reconstruction fails the round
cleanly, naming the client whose secret it is. And the protocol's two properties over many
dropout patterns: the sum is the clear sum of the survivors whenever at least t are left
(never unmasked with fewer), and the server never holds both secrets of one client."""
import dataclasses

import numpy as np
import pytest

from edgefl.privacy import secagg, shamir
from edgefl.privacy.secagg import (SecAggAborted, SecAggClient, SecAggError, SecAggServer,
                                   run_in_process)
from test_secagg import clear_ring_sum, contributions, setup_for, through_keys


def _run(setup, contribs, edit, vanish=()):
    """One round with every client's message passing through `edit(phase, message)` (which
    may replace it) and over the wire encoding; clients in `vanish` send no masked input.
    Returns (server, {(phase, client): the SecAggError that refused its message})."""
    carry = lambda m: secagg.message_from_bytes(m.to_bytes())       # noqa: E731
    clients = {c: SecAggClient(c, setup) for c in contribs}
    server, refused = SecAggServer(setup), {}

    def send(phase, c, msg):
        try:
            server.receive(carry(edit(phase, msg)))
        except SecAggError as exc:
            refused[(phase, c)] = exc

    for c in clients:
        send("keys", c, clients[c].advertise())
    out = server.advance()
    for c in out:
        send("shares", c, clients[c].share_keys(carry(out[c])))
    out = server.advance()
    for c in out:
        if c not in vanish:
            send("masked", c, clients[c].masked_input(carry(out[c]), contribs[c], c))
    out = server.advance()
    for c in out:
        send("unmask", c, clients[c].unmask(carry(out[c])))
    server.advance()
    return server, refused


def _only(phase, client, change):
    return lambda p, m: change(m) if (p, getattr(m, "client", None)) == (phase, client) else m


BAD = [
    # (phase, field the error names, the change to client 3's message)
    ("keys", "s_public", lambda m: dataclasses.replace(m, s_public=m.s_public[:31])),
    ("keys", "c_public", lambda m: dataclasses.replace(m, c_public="not bytes")),
    # a point of small order: every key agreement with it fails
    ("keys", "c_public", lambda m: dataclasses.replace(m, c_public=bytes(32))),
    ("keys", "s_public", lambda m: dataclasses.replace(m, s_public=bytes(32))),
    ("shares", "ciphertexts", lambda m: dataclasses.replace(m, ciphertexts=5)),
    ("shares", "ciphertexts", lambda m: dataclasses.replace(
        m, ciphertexts={h: "not bytes" for h in m.ciphertexts})),
    ("shares", "ciphertexts", lambda m: dataclasses.replace(
        m, ciphertexts={**m.ciphertexts, 999: b"x" * 40})),
    ("shares", "ciphertexts", lambda m: dataclasses.replace(
        m, ciphertexts={h: m.ciphertexts[h] for h in sorted(m.ciphertexts)[:1]})),
    ("unmask", "seed_shares", lambda m: dataclasses.replace(m, seed_shares=5)),
    ("unmask", "seed_shares", lambda m: dataclasses.replace(
        m, seed_shares={c: "x" for c in m.seed_shares})),
    ("unmask", "key_shares", lambda m: dataclasses.replace(
        m, key_shares={c: 1.5 for c in m.key_shares})),
    ("unmask", "key_shares", lambda m: dataclasses.replace(
        m, key_shares={c: -v for c, v in m.key_shares.items()})),
    ("unmask", "seed_shares", lambda m: dataclasses.replace(
        m, seed_shares={**m.seed_shares, 999: 1})),
]


@pytest.mark.parametrize("phase, what, change", BAD,
                         ids=[f"{p}-{w}-{i}" for i, (p, w, _) in enumerate(BAD)])
def test_a_malformed_message_is_refused_naming_client_and_field_and_the_round_goes_on(
        phase, what, change):
    """Before, such a message was taken, and its content crashed the aggregator at the next
    phase (TypeError, OverflowError, ShamirError out of advance(): the run failed) or an
    honest neighbour's client (TypeError, ValueError from the key broadcast)."""
    contribs = contributions(6, size=40)
    setup = setup_for(contribs, threshold=4)
    # client 5 sends no masked input, so the reveals carry key shares as well as seed shares
    server, refused = _run(setup, contribs, _only(phase, 3, change), vanish={5})
    assert list(refused) == [(phase, 3)]
    kind = {"keys": "advertise", "shares": "share", "unmask": "reveal"}[phase]
    assert f"client 3's {kind} message: {what}" in str(refused[(phase, 3)])
    # the rest of the round is as if client 3 had dropped out in that phase
    survivors = [c for c in contribs if c != 5 and (phase == "unmask" or c != 3)]
    assert server.total.count == len(survivors)
    assert np.array_equal(server.ring_words, clear_ring_sum(setup, contribs, survivors))


def test_a_reveal_of_the_other_secret_is_refused_so_the_server_never_holds_both():
    """A reveal carrying the mask-key share of a survivor (or the seed share of a dropped
    client) is refused whole: the server never holds both secrets of one client, whatever a
    client sends it."""
    contribs = contributions(6, size=40)
    setup = setup_for(contribs, threshold=4)
    held = {}

    def both(phase, m):
        if phase == "unmask" and m.client == 3:
            held.update(m.seed_shares)
            return dataclasses.replace(m, key_shares={**m.key_shares, 0: m.seed_shares[0]},
                                       seed_shares={**m.seed_shares, 5: 1})
        return m

    server, refused = _run(setup, contribs, both, vanish={5})
    assert list(refused) == [("unmask", 3)]
    assert "client 3's reveal" in str(refused[("unmask", 3)])
    assert 3 not in server.revealed
    assert server.total.count == 5


def test_a_tampered_share_fails_the_round_cleanly_naming_whose_secret():
    """A share that is a field element, but the wrong one, can only show at reconstruction
    (the secret comes out longer than 32 bytes): SecAggAborted naming the client and the
    secret, not shamir's error escaping the aggregator."""
    contribs = contributions(4, size=40)
    setup = setup_for(contribs, threshold=3)

    def tamper(phase, m):
        if phase == "unmask" and m.client == 2:     # holder x = 3, the last of the three used
            return dataclasses.replace(m, seed_shares={
                **m.seed_shares, 0: (m.seed_shares[0] + shamir.PRIME // 3) % shamir.PRIME})
        return m

    with pytest.raises(SecAggAborted, match=r"round 3: the shares of client 0's self-mask "
                                            r"seed from clients \[0, 1, 2\] do not give it "
                                            r"back .*nothing is unmasked"):
        _run(setup, contribs, tamper, vanish={3})


@pytest.mark.parametrize("neighbours", [0, 2, 4])
def test_over_many_dropout_patterns_the_sum_is_exact_and_never_both_secrets(neighbours):
    """The protocol's properties over random dropouts in every phase: a round that finishes
    had at least t clients in each phase (a complete graph finishes exactly then) and its
    sum is the survivors' clear ring sum; one that does not fails with SecAggAborted; and no
    client's seed share and mask-key share both reach the server."""
    rng = np.random.default_rng(2026 + neighbours)
    finished = aborted = 0
    for case in range(25):
        n = int(rng.integers(3, 10))
        contribs = contributions(n, size=24, seed=case)
        t = int(rng.integers(n // 2 + 1, n + 1))
        setup = setup_for(contribs, threshold=t, neighbours=neighbours)
        vanish = {phase: [c for c in contribs if rng.random() < 0.08]
                  for phase in secagg.PHASES[:4]}
        gone = set().union(*vanish.values())
        before_unmask = set().union(*(vanish[p] for p in ("keys", "shares", "masked")))
        try:
            server = run_in_process(setup, contribs, {c: c for c in contribs}, vanish=vanish,
                                    wire=case % 2 == 0)
        except SecAggAborted:
            aborted += 1
            if neighbours == 0:
                assert n - len(gone) < t, (case, n, t, vanish)
            continue
        finished += 1
        survivors = sorted(set(contribs) - before_unmask)
        assert n - len(gone) >= t, (case, n, t, vanish)
        assert server.total.count == len(survivors) >= t
        assert np.array_equal(server.ring_words, clear_ring_sum(setup, contribs, survivors))
        seeds = {c for r in server.revealed.values() for c in r.seed_shares}
        keys = {c for r in server.revealed.values() for c in r.key_shares}
        assert not seeds & keys, (case, seeds & keys)
        assert seeds <= set(survivors) and keys <= set(server.dropped)
    assert finished >= 5 and aborted >= 1          # both outcomes were exercised


def test_a_client_refuses_a_broadcast_or_forward_it_cannot_read_naming_the_neighbour():
    """What the server relays is checked by the board too (a server that did not check what
    it relays, or one not the aggregator's): a neighbour's key that is not a usable X25519
    public key, a ciphertext that is not bytes, are SecAggError naming that neighbour, which
    the client role reports, not a TypeError that ends its loop."""
    contribs = contributions(4, size=40)
    setup = setup_for(contribs, threshold=3)
    clients = {c: SecAggClient(c, setup) for c in contribs}
    server = SecAggServer(setup)
    for c in clients:
        server.receive(clients[c].advertise())
    broadcast = server.advance()[0]
    for bad in ("not bytes", b"short", bytes(32)):
        keys = {**broadcast.keys, 2: [bad, broadcast.keys[2][1]]}
        with pytest.raises(SecAggError, match="client 0: the key broadcast's c_public of "
                                              "client 2 is"):
            SecAggClient(0, setup).share_keys(secagg.KeysBroadcast(3, keys))
    share = clients[0].share_keys(broadcast)
    # a mask key of small order shows when the masks are made
    low = SecAggClient(0, setup)
    low.share_keys(secagg.KeysBroadcast(3, {**broadcast.keys,
                                            1: [broadcast.keys[1][0], bytes(32)]}))
    with pytest.raises(SecAggError, match=r"round 3: the s_public of client 1 \(paired with "
                                          r"client 0\) is not a usable X25519 public key"):
        low.masked_input(secagg.SharesForward(3, {0: share.ciphertexts[0],
                                                  1: share.ciphertexts[0]}), contribs[0], 0)
    with pytest.raises(SecAggError, match="client 0: the forward's ciphertext from client 1 "
                                          "is str"):
        clients[0].masked_input(secagg.SharesForward(3, {0: share.ciphertexts[0], 1: "x"}),
                                contribs[0], 0)


@pytest.mark.parametrize("header", [
    5, "advertise", None,
    {"kind": "advertise", "round": 3, "client": 0, "c_public": {"b64": 5},
     "s_public": {"b64": "AA=="}},
    {"kind": "share", "round": 3, "client": 0, "ciphertexts": {"1": {"b64": ["AA=="]}}},
])
def test_a_message_whose_header_is_not_an_object_of_fields_is_a_secagg_error(header):
    """Before, a header that was JSON but not an object, or a byte string field that was
    not text, raised AttributeError out of message_from_bytes: out of the aggregator's
    handling of a client's secure message, which ended the run (any member's one message
    on its own secure topic)."""
    import json
    import struct
    head = json.dumps(header).encode()
    with pytest.raises(SecAggError, match="not a secure aggregation message|message: "):
        secagg.message_from_bytes(struct.pack(">I", len(head)) + head)


def _to_masked_inputs(setup, contribs):
    """Every client of `contribs` through the keys and shares phases: (clients, server, the
    server's requests for masked inputs)."""
    clients = {c: SecAggClient(c, setup) for c in contribs}
    server = SecAggServer(setup)
    for c in clients:
        server.receive(clients[c].advertise())
    out = server.advance()
    for c in out:
        server.receive(clients[c].share_keys(out[c]))
    return clients, server, server.advance()


@pytest.mark.parametrize("change", [
    lambda m: dataclasses.replace(m, words=np.append(m.words, m.words[:1])),
    lambda m: dataclasses.replace(m, words=m.words[:1]),
    lambda m: dataclasses.replace(m, scalars=m.scalars[:1], scalar_names=()),
], ids=["one-word-more", "one-word", "no-scalars"])
def test_a_first_masked_input_of_another_shape_does_not_decide_the_rounds(change):
    """Over a broker the setup leaves the vector's size and the scalars' names open. Before,
    the first masked input to arrive fixed them, so one client that sent first with
    another shape had every honest input refused, the phase failed below t, and each new
    attempt failed the same way: the round never closed. Now the round's shape is the one
    at least t clients sent (t is more than half, so there is at most one); a client of
    another shape is dropped, its pairwise masks removed, its self mask never revealed."""
    import dataclasses as dc
    contribs = contributions(6, size=40)
    setup = dc.replace(setup_for(contribs, threshold=4), vector_size=None, scalar_names=None)
    clients, server, out = _to_masked_inputs(setup, contribs)
    for c in (3, 0, 1, 2, 4, 5):                           # client 3's arrives first
        msg = clients[c].masked_input(out[c], contribs[c], c)
        server.receive(change(msg) if c == 3 else msg)
    requests = server.advance()
    assert server.survivors == (0, 1, 2, 4, 5) and server.dropped == (3,)
    for c in requests:
        server.receive(clients[c].unmask(requests[c]))
    server.advance()
    assert server.total.count == 5
    assert np.array_equal(server.ring_words, clear_ring_sum(setup_for(contribs, threshold=4),
                                                            contribs, [0, 1, 2, 4, 5]))
    assert not {c for r in server.revealed.values() for c in r.seed_shares} & {3}


def test_no_shape_sent_by_t_clients_fails_the_phase_naming_the_shapes():
    import dataclasses as dc
    contribs = contributions(4, size=40)
    setup = dc.replace(setup_for(contribs, threshold=3), vector_size=None, scalar_names=None)
    clients, server, out = _to_masked_inputs(setup, contribs)
    for c in clients:
        msg = clients[c].masked_input(out[c], contribs[c], c)
        server.receive(dc.replace(msg, words=msg.words[:20]) if c >= 2 else msg)
    with pytest.raises(SecAggAborted, match=r"round 3: no shape of masked input came from "
                                            r"3 clients \(the threshold\): 40 words .* from "
                                            r"clients \[0, 1\], 20 words .* from clients "
                                            r"\[2, 3\]; .*nothing is unmasked"):
        server.advance()


def test_a_client_refuses_an_unmask_request_naming_fewer_than_t_survivors():
    """Bonawitz et al.'s round 4 check, on the board: a sum of fewer than t inputs is not
    one the round promised (with one survivor named, the sum is that client's input), so a
    request naming fewer than t survivors gets no shares. Before, the board answered it."""
    contribs = contributions(5, size=40)
    setup = setup_for(contribs, threshold=3)
    clients, server, forward = through_keys(setup, contribs)
    for c in clients:
        server.receive(clients[c].masked_input(forward[c], contribs[c], c))
    with pytest.raises(SecAggError, match=r"round 3: client 0 refuses to unmask: the request "
                                          r"names 2 survivors \[0, 1\], fewer than the "
                                          r"threshold 3"):
        clients[0].unmask(secagg.UnmaskRequest(3, (0, 1), (2, 3, 4)))
    answer = clients[0].unmask(secagg.UnmaskRequest(3, (0, 1, 2), (3, 4)))   # t: answered
    assert sorted(answer.seed_shares) == [0, 1, 2] and sorted(answer.key_shares) == [3, 4]


@pytest.mark.parametrize("copied", [("c_public", "s_public"), ("s_public",), ("c_public",)])
def test_an_advertisement_of_another_clients_keys_is_refused_naming_both(copied):
    """Bonawitz et al. have the server check that the advertised public keys are distinct.
    Client 3 advertises (some of) client 1's keys: before, the server took them, so client
    3's neighbours encrypted its shares to client 1's key and masked with a secret client 1
    holds. Now the later advertisement is refused naming both clients, client 3 is a
    dropout of the keys phase, and the round sums the others exactly."""
    contribs = contributions(6, size=40)
    setup = setup_for(contribs, threshold=4)
    seen = {}

    def copy_keys(phase, msg):
        if phase == "keys" and msg.client == 1:
            seen[1] = msg
        if phase == "keys" and msg.client == 3:
            return dataclasses.replace(msg, **{k: getattr(seen[1], k) for k in copied})
        return msg

    server, refused = _run(setup, contribs, copy_keys)
    assert list(refused) == [("keys", 3)]
    message = str(refused[("keys", 3)])
    assert "client 3's advertise message" in message and "client 1" in message, message
    survivors = [c for c in contribs if c != 3]
    assert server.total.count == len(survivors)
    assert np.array_equal(server.ring_words, clear_ring_sum(setup, contribs, survivors))
