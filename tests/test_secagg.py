"""Secure aggregation, SecAgg+ (edgefl/privacy/secagg.py): real key agreement and real masks
between in-process clients. The secure sum equals the clear sum of the quantised
contributions exactly in the ring and the float sum within the stated bound; one client's
masked input looks uniform; dropouts up to n - t are recovered and one more fails cleanly;
late and inconsistent messages are refused."""
import math

import numpy as np
import pytest
from scipy import stats

from edgefl import kernels
from edgefl.privacy import secagg, shamir
from edgefl.privacy.secagg import (LateMessage, MaskedInput, Quantiser, SecAggAborted,
                                   SecAggClient, SecAggError, SecAggServer, UnmaskRequest,
                                   run_in_process)
from edgefl.privacy.settings import SecureAggregation
from edgefl.strategies import Contribution

ENTROPY = b"fixed test entropy"
P_VALUE = 1e-3            # the uniformity tests' significance level (fixed seeds: deterministic)


def contributions(n, size=2000, seed=0, spread=0.05):
    rng = np.random.default_rng(seed)
    return {c: Contribution((rng.standard_normal(size) * spread).astype(np.float32),
                            int(rng.integers(1, 50)),
                            {"train_steps": float(rng.integers(1, 9)), "x": float(c) - 2.5})
            for c in range(n)}


def setup_for(contribs, *, threshold=0.7, neighbours=0, bits=32, clip=1.0, round=3):
    settings = SecureAggregation(threshold=threshold, neighbours=neighbours, ring_bits=bits,
                                 clip_range=clip)
    first = next(iter(contribs.values()))
    return secagg.round_setup(settings, run_id="test-run", round=round,
                              participants=sorted(contribs), seed=11,
                              vector_size=first.vector.size, scalar_names=first.scalars,
                              max_weight=max(c.weight for c in contribs.values()))


def clear_ring_sum(setup, contribs, survivors):
    q = setup.quantiser
    total = np.zeros(setup.vector_size, q.dtype)
    for c in survivors:
        kernels.ring_add(total, q.encode(contribs[c], c, setup.max_weight))
    return total


def through_keys(setup, ids, entropy=None, edit_share=None):
    """Clients `ids` advertise and share their keys with a new server (`edit_share(share)`
    may replace a client's share message on its way): returns (clients, server, forward),
    forward being each client's message from the server for the masked-input phase."""
    clients = {c: SecAggClient(c, setup, entropy) for c in ids}
    server = SecAggServer(setup)
    for c in clients:
        server.receive(clients[c].advertise())
    out = server.advance()
    for c in clients:
        share = clients[c].share_keys(out[c])
        server.receive(edit_share(share) if edit_share else share)
    return clients, server, server.advance()


@pytest.mark.parametrize("bits", [32, 64])
@pytest.mark.parametrize("neighbours", [0, 4])
def test_the_secure_sum_is_the_clear_sum_exactly_in_the_ring(bits, neighbours):
    contribs = contributions(10)
    setup = setup_for(contribs, bits=bits, neighbours=neighbours)
    server = run_in_process(setup, contribs, {c: c for c in contribs}, wire=True)
    want = clear_ring_sum(setup, contribs, sorted(contribs))
    assert server.ring_words.dtype == want.dtype
    assert np.array_equal(server.ring_words, want)
    total = server.total
    assert total.count == 10 and total.weight == sum(c.weight for c in contribs.values())
    assert total.scalars["train_steps"] == sum(c.scalars["train_steps"] for c in contribs.values())
    assert total.scalars["x"] == pytest.approx(sum(c.scalars["x"] for c in contribs.values()),
                                               abs=10 * 2.0 ** -secagg.SCALAR_FRACTION_BITS)
    # the dequantised sum is within one level per unit of weight of the clear float sum
    # (stochastic rounding moves each client's value by less than one level, times its
    # weight), plus float32's rounding of the result
    clear = sum(c.weight * np.clip(c.vector.astype(np.float64), -1, 1) for c in contribs.values())
    bound = total.weight * setup.quantiser.unit + 4 * np.finfo(np.float32).eps * np.abs(clear).max()
    assert np.abs(total.vector - clear).max() <= bound


@pytest.mark.parametrize("bits", [32, 64])
def test_masks_expanded_ahead_give_the_same_masked_input_and_sum(bits):
    """A client that expands its masks before it has its contribution (expand_masks, as the
    simulator does while clients train) sends the same masked words as one that masks at
    once; a wrong size guessed ahead is expanded again. The round run in halves
    (InProcessRound: masked inputs sent as they come, out of order, one client vanishing)
    sums to run_in_process's ring sum, bit for bit."""
    contribs = contributions(6)
    setup = setup_for(contribs, bits=bits)
    ids = sorted(contribs)
    for size in (setup.vector_size, setup.vector_size - 1):
        ahead, _, forward = through_keys(setup, ids, ENTROPY)
        at_once, _, forward2 = through_keys(setup, ids, ENTROPY)
        ahead[2].expand_masks(forward[2], size)
        got = ahead[2].masked_input(forward[2], contribs[2], 7)
        want = at_once[2].masked_input(forward2[2], contribs[2], 7)
        assert got.words.tobytes() == want.words.tobytes()
        assert got.scalars.tobytes() == want.scalars.tobytes()
    # into words the caller keeps (whatever they held), or refused naming what is wrong
    ahead, _, forward = through_keys(setup, ids, ENTROPY)
    kept = np.full(setup.vector_size, 7, setup.quantiser.dtype)
    ahead[2].expand_masks(forward[2], setup.vector_size, out=kept)
    got = ahead[2].masked_input(forward[2], contribs[2], 7)
    assert got.words is kept and got.words.tobytes() == want.words.tobytes()
    with pytest.raises(SecAggError, match="expand_masks: out must be"):
        ahead[3].expand_masks(forward[3], setup.vector_size,
                              out=np.zeros(setup.vector_size, np.float32))
    vanish = {"masked": [4]}
    want = run_in_process(setup, contribs, {c: c for c in ids}, vanish=vanish, entropy=ENTROPY)
    halves = secagg.InProcessRound(setup, vanish=vanish, entropy=ENTROPY)
    halves.expand_masks(setup.vector_size)
    for c in (5, 0, 4, 3):
        halves.send_masked(c, contribs[c], c)
    got = halves.finish(contribs, {c: c for c in ids})
    assert got.dropped == want.dropped == (4,)
    assert np.array_equal(got.ring_words, want.ring_words)
    assert np.array_equal(got.ring_scalars, want.ring_scalars)
    assert np.array_equal(got.ring_words, clear_ring_sum(setup, contribs, [0, 1, 2, 3, 5]))


def test_the_quantised_sum_is_unbiased_and_within_the_bound_on_a_clipped_input():
    contribs = contributions(4, size=20000, spread=2.0)         # many values beyond clip 1
    setup = setup_for(contribs, bits=32)
    total = run_in_process(setup, contribs, {c: c for c in contribs}).total
    clipped = sum(c.weight * np.clip(c.vector.astype(np.float64), -1, 1)
                  for c in contribs.values())
    err = total.vector - clipped
    assert np.abs(err).max() <= total.weight * setup.quantiser.unit * (1 + 1e-6)
    # unbiased: the mean error over 20000 coordinates is well inside its standard error
    assert abs(err.mean()) <= 5 * total.weight * setup.quantiser.unit / math.sqrt(err.size)


def masked_vector(bits, zeros=True):
    contribs = contributions(5, size=1 << 18)
    if zeros:   # the most structured input there is: all zeros, weight 1
        contribs[0] = Contribution(np.zeros(1 << 18, np.float32), 1, contribs[0].scalars)
    clients, _, forward = through_keys(setup_for(contribs, bits=bits), contribs, ENTROPY)
    return clients[0].masked_input(forward[0], contribs[0], 0)


@pytest.mark.parametrize("bits", [32, 64])
def test_what_the_aggregator_receives_from_one_client_looks_uniform(bits):
    """Chi-square on the byte values of one client's masked input (of an all-zero update),
    and a binomial test on each bit position's frequency of ones; the keys are derived from
    fixed entropy, so the test is deterministic."""
    masked = masked_vector(bits)
    data = np.frombuffer(masked.words.tobytes(), np.uint8)
    counts = np.bincount(data, minlength=256)
    assert stats.chisquare(counts).pvalue > P_VALUE
    words = masked.words
    ones = [int(((words >> words.dtype.type(b)) & words.dtype.type(1)).sum()) for b in range(bits)]
    p_values = [stats.binomtest(k, words.size, 0.5).pvalue for k in ones]
    # Bonferroni over the bit positions
    assert min(p_values) > P_VALUE / bits
    # and the unmasked quantised input is anything but uniform (the test can fail)
    q = setup_for(contributions(5), bits=bits).quantiser
    plain = q.encode(Contribution(np.zeros(words.size, np.float32), 1), 0, 1)
    assert stats.chisquare(np.bincount(np.frombuffer(plain.tobytes(), np.uint8),
                                       minlength=256)).pvalue < P_VALUE


@pytest.mark.parametrize("phase", ["masked", "unmask"])
def test_dropout_at_exactly_the_threshold_succeeds_and_one_more_fails_cleanly(phase):
    contribs = contributions(10)
    setup = setup_for(contribs, threshold=0.7)          # t = 7 of 10
    assert setup.threshold == 7
    gone = [1, 4, 8]                                     # n - t
    server = run_in_process(setup, contribs, {c: c for c in contribs}, vanish={phase: gone})
    survivors = [c for c in contribs if c not in gone] if phase == "masked" else sorted(contribs)
    assert np.array_equal(server.ring_words, clear_ring_sum(setup, contribs, survivors))
    assert server.total.count == len(survivors)
    with pytest.raises(SecAggAborted, match=r"round 3: only 6 of 10 clients .*threshold is 7, "
                                            r"so the round fails and nothing is unmasked"):
        run_in_process(setup, contribs, vanish={phase: gone + [9]})


def test_a_sparse_graph_recovers_a_dropout_and_fails_cleanly_when_a_neighbourhood_cannot():
    contribs = contributions(12)
    setup = setup_for(contribs, threshold=0.6, neighbours=4)
    graph = setup.neighbourhoods()
    assert all(len(v) == 5 and c in v for c, v in graph.items())
    assert all(c in graph[j] for c in graph for j in graph[c])          # symmetric
    server = run_in_process(setup, contribs, {c: c for c in contribs}, vanish={"masked": [5]})
    assert np.array_equal(server.ring_words,
                          clear_ring_sum(setup, contribs, [c for c in contribs if c != 5]))
    # a whole neighbourhood but one gone: client 0's self-mask seed has too few holders left
    victims = sorted(graph[0] - {0})[:3]
    with pytest.raises(SecAggAborted, match="shares of client .* came back, 4 needed; nothing "
                                            "is unmasked"):
        run_in_process(setup, contribs, vanish={"unmask": victims})


def test_a_client_reappearing_after_its_masks_were_removed_is_refused():
    contribs = contributions(5)
    setup = setup_for(contribs, threshold=0.6)
    clients, server, forward = through_keys(setup, contribs)
    for c in (0, 1, 2, 3):
        server.receive(clients[c].masked_input(forward[c], contribs[c], c))
    requests = server.advance()
    assert requests[0].dropped == (4,)
    late = clients[4].masked_input(forward[4], contribs[4], 4)
    with pytest.raises(LateMessage, match="client 4's masked message arrived in phase 'unmask'"
                                          ".*cannot be unmasked"):
        server.receive(late)
    for c in (0, 1, 2, 3):
        server.receive(clients[c].unmask(requests[c]))
    server.advance()
    assert server.total.count == 4
    with pytest.raises(LateMessage):
        server.receive(late)


def test_clients_never_reveal_both_secrets_of_one_client_nor_answer_twice():
    contribs = contributions(4)
    setup = setup_for(contribs, threshold=0.75)
    clients, server, forward = through_keys(setup, contribs)
    for c in clients:
        server.receive(clients[c].masked_input(forward[c], contribs[c], c))
    with pytest.raises(SecAggError, match=r"client 0 refuses to unmask: client\(s\) \[2\] are "
                                          r"listed both as survivors and as dropped"):
        clients[0].unmask(UnmaskRequest(3, (0, 1, 2, 3), (2,)))
    # a request that leaves the client out of the survivors says its masked input is not in
    # the sum: it has nothing there to unmask, and hands over no one's shares
    with pytest.raises(SecAggError, match="client 0 is not listed as a survivor"):
        clients[0].unmask(UnmaskRequest(3, (1, 2, 3), ()))
    clients[0].unmask(UnmaskRequest(3, (0, 1, 2, 3), ()))
    with pytest.raises(SecAggError, match="answered an unmask request already"):
        clients[0].unmask(UnmaskRequest(3, (0, 1, 3), (2,)))


def test_a_client_answers_each_phase_once_so_a_second_forward_cannot_strip_its_pair_masks():
    """A second SharesForward naming only the client itself would get back its input under
    its self mask alone, and the unmask phase hands the server that seed: the client's
    update in the clear. So a client shares its keys once, sends one masked input, and
    answers the unmask request only after it sent that input."""
    contribs = contributions(4)
    setup = setup_for(contribs, threshold=0.75)
    clients = {c: SecAggClient(c, setup, ENTROPY) for c in contribs}
    server = SecAggServer(setup)
    for c in clients:
        server.receive(clients[c].advertise())
    broadcast = server.advance()
    with pytest.raises(SecAggError, match="client 0 has not shared its keys"):
        clients[0].masked_input(secagg.SharesForward(3, {}), contribs[0], 0)
    for c in clients:
        server.receive(clients[c].share_keys(broadcast[c]))
    with pytest.raises(SecAggError, match="client 0 has shared its keys already"):
        clients[0].share_keys(broadcast[0])
    forward = server.advance()
    with pytest.raises(SecAggError, match="client 0 has not sent its masked input"):
        clients[0].unmask(UnmaskRequest(3, (0, 1, 2, 3), ()))
    for c in clients:
        server.receive(clients[c].masked_input(forward[c], contribs[c], c))
    alone = secagg.SharesForward(3, {0: forward[0].ciphertexts[0]})
    with pytest.raises(SecAggError, match="client 0 has sent its masked input already"):
        clients[0].masked_input(alone, contribs[0], 0)
    with pytest.raises(SecAggError, match="client 0 has sent its masked input already"):
        clients[0].expand_masks(alone, 2000)
    requests = server.advance()
    for c in clients:
        server.receive(clients[c].unmask(requests[c]))
    server.advance()
    assert server.total.count == 4


def test_a_setup_whose_threshold_is_at_most_half_is_refused_by_server_and_client():
    """At most half would let two disjoint groups of holders each reach t, one asked for a
    client's self-mask seed and the other for its mask key; a board takes the setup from
    the aggregator's announcement, so it checks it too."""
    import dataclasses
    contribs = contributions(5)
    setup = dataclasses.replace(setup_for(contribs, threshold=0.6), threshold=2)
    with pytest.raises(SecAggError, match="threshold 2 for 5 participants: must be more "
                                          "than half"):
        SecAggServer(setup)
    with pytest.raises(SecAggError, match="threshold 2 for 5 participants: must be more "
                                          "than half"):
        SecAggClient(0, setup)


def test_bad_messages_are_refused_naming_the_client():
    contribs = contributions(3)
    setup = setup_for(contribs, threshold=2)
    server = SecAggServer(setup)
    a = SecAggClient(0, setup).advertise()
    server.receive(a)
    with pytest.raises(SecAggError, match="client 0 sent its advertise message twice"):
        server.receive(a)
    with pytest.raises(SecAggError, match="client 7 may not send"):
        server.receive(a.__class__(3, 7, a.c_public, a.s_public))
    with pytest.raises(SecAggError, match="a masked message in phase 'keys'"):
        server.receive(MaskedInput(3, 0, np.zeros(3, np.uint32), np.zeros(3, np.uint64)))
    with pytest.raises(LateMessage, match="round 3: a advertise message of round 2"):
        server.receive(a.__class__(2, 0, a.c_public, a.s_public))
    with pytest.raises(SecAggError, match="not a secure aggregation message"):
        secagg.message_from_bytes(b"\x00\x00\x00\x02{}")
    blob = MaskedInput(3, 0, np.zeros(3, np.uint32), np.zeros(2, np.uint64)).to_bytes()
    with pytest.raises(SecAggError, match="masked input of client 0: 27 bytes"):
        secagg.message_from_bytes(blob[:-1])


def test_a_tampered_share_does_not_authenticate():
    contribs = contributions(3)
    setup = setup_for(contribs, threshold=2)

    def flip_a_bit(share):
        if share.client != 1:
            return share
        bad = bytearray(share.ciphertexts[0])     # the ciphertext meant for client 0
        bad[5] ^= 1
        return share.__class__(share.round, 1, {**share.ciphertexts, 0: bytes(bad)})

    clients, server, forward = through_keys(setup, contribs, edit_share=flip_a_bit)
    for c in clients:
        server.receive(clients[c].masked_input(forward[c], contribs[c], c))
    request = server.advance()
    with pytest.raises(SecAggError, match="the shares client 1 sent to client 0 do not "
                                          "authenticate"):
        clients[0].unmask(request[0])


def test_scalars_whose_sum_would_wrap_the_fixed_point_are_refused_not_summed():
    """Each scalar fits 64-bit fixed point on its own; the sum of the round's must too, or
    it wraps (three loss sums of 2e11 came back as -5e11)."""
    contribs = {c: Contribution(np.zeros(8, np.float32), 1,
                                {"train_loss_x_steps": 2e11, "train_steps": 10.0})
                for c in range(3)}
    setup = setup_for(contribs, threshold=1.0)
    with pytest.raises(SecAggError, match="the sum of 3 must stay within the 64-bit fixed point"):
        run_in_process(setup, contribs)
    fine = {c: Contribution(np.zeros(8, np.float32), 1,
                            {"train_loss_x_steps": 1e11, "train_steps": 10.0})
            for c in range(3)}
    assert run_in_process(setup_for(fine, threshold=1.0), fine).total.scalars[
        "train_loss_x_steps"] == 3e11


def test_a_ring_too_small_for_the_round_is_refused_with_the_bound():
    with pytest.raises(SecAggError, match=r"ring_bits 32 cannot hold the sum of 100 "
                                          r"contributions of weight up to 2000000: n \* weight "
                                          r"\* \(levels \+ 1\) must stay below 2\^31.*ring_bits: 64"):
        Quantiser.for_round(32, 1.0, 100, 2_000_000)
    # one level of headroom: a value rounds to at most levels + 1
    levels = Quantiser.for_round(64, 1.0, 100, 2_000_000).levels
    assert levels == 2 ** 63 // (2 * 10 ** 8) - 1
    assert 2 * 10 ** 8 * (levels + 1) < 2 ** 63 <= 2 * 10 ** 8 * (levels + 2)


def test_shamir_threshold():
    secret = bytes(range(32))
    shares = shamir.split(secret, [1, 2, 3, 4, 5], 3)
    assert shamir.combine({x: shares[x] for x in (5, 2, 4)}, 3) == secret
    with pytest.raises(shamir.ShamirError, match="2 shares, 3 needed"):
        shamir.combine({x: shares[x] for x in (2, 4)}, 3)
    with pytest.raises(shamir.ShamirError, match="threshold 6 for 5 holders"):
        shamir.split(secret, [1, 2, 3, 4, 5], 6)


@pytest.mark.parametrize("threshold", [2, 3, 5])
def test_shamir_fewer_shares_than_the_threshold_do_not_give_the_secret(threshold):
    # the polynomial has degree threshold - 1: threshold - 1 shares, interpolated as a
    # polynomial of one degree less, give a random field element (almost never 32 bytes,
    # which combine refuses), not the secret; with a degree too low they would give it
    secret = bytes(range(32))
    holders = list(range(1, threshold + 3))
    for _ in range(5):
        shares = shamir.split(secret, holders, threshold)
        assert int.from_bytes(secret, "big") not in shares.values()
        assert shamir.combine({x: shares[x] for x in holders[-threshold:]}, threshold) == secret
        fewer = {x: shares[x] for x in holders[:threshold - 1]}
        try:
            guess = shamir.combine(fewer, threshold - 1)
        except shamir.ShamirError:
            guess = None
        assert guess != secret


def test_chunks_reassemble_in_any_order_and_repeats_are_dropped():
    msg = secagg.MaskedInput(3, 1, np.arange(5000, dtype=np.uint32),
                             np.arange(3, dtype=np.uint64), ("a", "b"))
    chunks = secagg.to_chunks(msg, 1024, (7 << 32) | 1)
    n = len(chunks)
    assert n == -(-len(msg.to_bytes()) // (1024 - 20)) and all(len(c) <= 1024 for c in chunks)
    inbox = secagg.ChunkAssembler(1 << 20)
    order = chunks[::-1] + chunks[:2]
    got = [inbox.add("client-1", c) for c in order]
    assert [g is None for g in got] == [True] * (n - 1) + [False] + [True, True]
    whole = got[n - 1]
    assert np.array_equal(whole.words, msg.words) and whole.scalar_names == ("a", "b")
    assert inbox.repeats == 2
    with pytest.raises(SecAggError, match="from 'client-1': over 10000 bytes"):
        small = secagg.ChunkAssembler(10_000)
        for c in secagg.to_chunks(msg, 1024, 9):
            small.add("client-1", c)
    with pytest.raises(SecAggError, match="not a secure aggregation chunk"):
        inbox.add("client-2", b"XXXX" + bytes(40))


def test_empty_chunks_count_against_a_senders_limit():
    """A member sending empty chunks of a message of 2^31 of them added a held piece for
    each, none counted against the sender's byte limit: the aggregator's memory grew for as
    long as the round lasted. Each held piece now counts its bookkeeping too."""
    inbox = secagg.ChunkAssembler(100_000)
    with pytest.raises(SecAggError, match="from 'client-1': over 100000 bytes"):
        for index in range(100_000):
            inbox.add("client-1", secagg._CHUNK.pack(secagg.CHUNK_MAGIC, 7, index, 2 ** 31))
    assert index < 2_000 and not inbox._parts


@pytest.mark.parametrize("in_c", [True, False], ids=["c-openssl", "cryptography"])
def test_block_wise_masks_are_the_keystream_added_word_by_word(in_c, monkeypatch):
    """apply_masks adds each key's stream block by block (in C, in pieces on threads); the
    result is the whole keystream (mask_stream) added at once, words then scalars, with each
    mask's sign."""
    if in_c and not kernels.masks_in_c():
        pytest.skip("no C core or no usable libcrypto: the masks come from cryptography")
    monkeypatch.setenv("EDGEFL_MASK_THREADS", "3")       # three pieces, even on one core
    monkeypatch.setattr(kernels, "_MASKS", dict(kernels._MASKS))   # restored afterwards
    kernels.use_c_masks(in_c)
    rng = np.random.default_rng(5)
    for dtype in (np.uint32, np.uint64):
        n = kernels.MASK_PIECE_WORDS * 3 + 37        # pieces, blocks and a tail
        words = rng.integers(0, 2 ** 32, n, dtype=np.uint64).astype(dtype)
        scalars = rng.integers(0, 2 ** 63, 3, dtype=np.uint64)
        masks = [(bytes([k]) * 32, k == 1) for k in range(3)]
        want_w, want_s = words.copy(), scalars.copy()
        for key, subtract in masks:
            stream = secagg.mask_stream(key, words.nbytes + scalars.nbytes)
            kernels.ring_add(want_w, np.frombuffer(stream, dtype, n), subtract)
            # (a copy: at words.nbytes = 4 mod 8 the view is not aligned for uint64)
            kernels.ring_add(want_s, np.frombuffer(stream, np.uint64, 3, words.nbytes).copy(),
                             subtract)
        secagg.apply_masks(words, scalars, masks)
        assert np.array_equal(words, want_w) and np.array_equal(scalars, want_s)
