"""The exact sum's edges (engine/aggregation/exact.py) by hand: which tensors get a window, a window for a tensor
whose largest term is below 1, the count of terms a sum holds exactly.  Its main tests: tests/test_aggregate.py."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rayfed_dg.engine.aggregation import exact
from rayfed_dg.engine.aggregation.exact import FixedSum, Reducer


def test_boolean_complex_and_non_finite_tensors_get_no_window_and_the_next_one_does():
    ref = {"mask": np.array([True, False]), "z": np.array([1 + 2j]), "inf": np.array([1.0, np.inf]),
           "nan": np.array([np.nan, 1.0]), "x": np.array([0.5, -3.0], np.float32)}
    # 2^MARGIN * max w * max |x_t| = 16 * 7 * 3 = 336 < 2^9: f = 9 - B, as in test_aggregate.py
    assert exact.windows(ref, [2.0, -7.0]) == {"x": 9 - exact.B}


def test_a_tensor_whose_largest_term_is_below_one_keeps_its_window():
    v = np.array([0.01, -0.003], np.float64)
    # 16 * 1 * 0.01 = 0.16 = 0.64 * 2^-2: f = -2 - B = -46
    assert exact.windows({"s": v}, [1.0]) == {"s": -2 - exact.B}
    red = Reducer([0], {0: 1.0}, {"s": v})
    red.add(0, {"s": v})
    got = red.result({"s": v})["s"]
    want = np.round(v * 2.0 ** 46) * 2.0 ** -46  # rounded to the window, not to the finer grid a windowless term takes
    assert np.array_equal(got, want) and not np.array_equal(got, np.round(v * 2.0 ** 48) * 2.0 ** -48)


def test_a_sum_holds_two_to_the_62_minus_b_terms_and_refuses_one_more():
    most = 2 ** (62 - exact.B)  # B-bit integers: 2^(62 - B) of them sum within int64's 2^62
    s = FixedSum({"x": -40}, terms=most - 1)
    s.add(1.0, {"x": torch.tensor([1.0])})  # the last one it holds
    assert s.terms == most
    with pytest.raises(AssertionError, match=f"at most {most} terms"):
        s.add(1.0, {"x": torch.tensor([1.0])})
    FixedSum({"x": -40}, terms=1).merge(FixedSum({"x": -40}, terms=most - 1))  # a partial's terms count in a merge
    with pytest.raises(AssertionError):
        FixedSum({"x": -40}, terms=2).merge(FixedSum({"x": -40}, terms=most - 1))
    FixedSum({"x": 0}).merge(FixedSum({"x": 0}, terms=most))  # a fresh sum counts from zero
    with pytest.raises(AssertionError):
        FixedSum({"x": 0}).merge(FixedSum({"x": 0}, terms=most + 1))


BIG = 2.0 ** 44 - 1  # the largest integer of B = 44 bits: 512 of them sum to 2^53 - 512, 513 pass 2^53


def _fold(seq):
    s = FixedSum({"x": 0})
    for v in seq:
        s.add(1.0, {"x": torch.tensor([v], dtype=torch.float64)})
    return s.total("x").item()


def test_a_float64_accumulator_never_holds_a_sum_past_two_to_the_53():
    """513 terms of 2^44 - 1 sum to 2^53 + 2^44 - 513, odd and above 2^53: a float64 accumulator would round it.
    The two negative terms bring the exact total back below 2^53, where any rounding on the way shows."""
    assert exact.B == 44 and exact.FLUSH == 512
    assert _fold([BIG] * 513 + [-BIG] * 2) == 511 * BIG
    assert _fold([1.0] * 512 + [BIG] * 513 + [-BIG] * 2) == 512 + 511 * BIG  # the second accumulator likewise


def test_a_merge_never_writes_the_partial_it_reads():
    part = FixedSum({"x": 0})
    part.add(1.0, {"x": torch.tensor([3.0, 5.0], dtype=torch.float64)})
    packed = part.pack()
    big = FixedSum({"x": 0})  # a partial past FLUSH terms travels as int64
    for _ in range(exact.FLUSH + 1):
        big.add(1.0, {"x": torch.tensor([1.0, 2.0], dtype=torch.float64)})
    packed_ints = big.pack()
    before = [p.copy() for p in packed.pieces + packed_ints.pieces]
    out = FixedSum({"x": 0})
    for _ in range(2):  # the first merge makes the accumulators, the second adds into them
        out.merge(packed)
        out.merge(packed_ints)
    assert out.total("x").tolist() == [2 * 3.0 + 2 * 513.0, 2 * 5.0 + 2 * 1026.0]
    assert all(np.array_equal(a, b) for a, b in zip(before, packed.pieces + packed_ints.pieces))


def test_one_step_up_to_two_to_the_1023_two_steps_above():
    from rayfed_dg.engine.aggregation.exact import _scale

    for x, e in ((2.0 ** 60, -1023), (2.0 ** 60, -1022), (2.0 ** -60, 1023), (2.0 ** -60, 1024), (2.0 ** -60, 1025)):
        # 2^-1023 is subnormal and 2^1024 not a float64: those take the two steps; every product is a normal float64
        assert _scale(torch.tensor([x], dtype=torch.float64), e).item() == math.ldexp(x, e) != 0.0, e


def test_terms_far_below_one_are_scaled_in_two_steps_exactly():
    # a global model of 2^-970: its window e = -1008 is outside the one-step guard (|e| < 1000): w v scaled in two steps
    v = np.array([2.0 ** -970, -3 * 2.0 ** -975], np.float64)
    assert exact.windows({"t": v}, [2.0]) == {"t": -970 + 5 + 1 - exact.B}  # 16 * 2 * 2^-970 = 2^-965
    red = Reducer([0, 1], {0: 2.0, 1: 2.0}, {"t": v})
    red.add(1, {"t": v})
    red.add(0, {"t": v / 2})
    assert red.result({"t": v})["t"].tolist() == [0.75 * 2.0 ** -970, -2.25 * 2.0 ** -975]  # (2 v + v) / 4, exact


def test_terms_of_two_to_the_minus_1000_without_a_window_take_the_two_step_path():
    """Without a window a term takes its own exponent on the grid from 0: 2^-1000 and 1.5 x 2^-1000 take e = -1040,
    where w 2^-e = 2^1040 is not a float64 (``math.ldexp`` raises): the one-multiply path is taken only for
    -1000 < e < 1000, and the term is w v scaled by 2^1040 in two steps, exactly."""
    assert exact.term_exponent(2.0 ** -1000, None) == -1040 == exact.term_exponent(1.5 * 2.0 ** -1000, None)
    red = Reducer([0, 1], {0: 1.0, 1: 3.0})  # no reference: no window
    red.add(0, {"t": np.array([2.0 ** -1000], np.float64)})
    red.add(1, {"t": np.array([-0.5 * 2.0 ** -1000], np.float64)})
    assert red.result({"t": np.zeros(1)})["t"].tolist() == [-2.0 ** -1003]  # (1 - 1.5) 2^-1000 / 4, exact


def test_a_tensor_longer_than_a_chunk_sums_exactly_to_its_last_element():
    """CPU deposits run chunk by chunk (``exact.CHUNK`` elements): a tensor of one chunk and a short one, three
    weighted terms (the first written, the others added through the scratch buffer), is each term rounded to the
    window 2^-30 and summed, element by element, the last chunk's too."""
    n = exact.CHUNK + 777
    rng = np.random.default_rng(5)
    vs, ws = [rng.uniform(-1.0, 1.0, n) for _ in range(3)], [0.3, -1.7, 2.5]
    s = FixedSum({"x": -30})
    for w, v in zip(ws, vs):
        s.add(w, {"x": torch.from_numpy(v)})
    want = sum(np.round(w * v * 2.0 ** 30) for w, v in zip(ws, vs)) * 2.0 ** -30
    got = s.total("x").numpy()
    assert got.shape == (n,) and np.array_equal(got, want)
    assert not np.array_equal(got[-777:], sum(w * v for w, v in zip(ws, vs))[-777:])  # rounded, not the float sum


def test_a_partial_past_two_to_the_53_merges_exactly():
    """513 terms of 2^44 - 1 (odd, above 2^53) in a worker's partial, held as int64 past FLUSH: merged into the
    server's sum, directly and packed, the total keeps its last bit (a float64 accumulator would round it)."""
    part = FixedSum({"x": 0})
    for _ in range(513):
        part.add(1.0, {"x": torch.tensor([BIG], dtype=torch.float64)})
    want = 513 * (2 ** 44 - 1)
    assert want > 2 ** 53 and want % 2 == 1
    for source in (part, part.pack()):
        out = FixedSum({"x": 0})
        out.merge(source)
        out.add(1.0, {"x": torch.tensor([-BIG], dtype=torch.float64)})  # back below 2^53: any rounding shows
        assert int(out.total("x").item()) == want - (2 ** 44 - 1)


def test_a_dropped_client_and_one_not_sampled_are_refused_in_add_and_in_a_partial():
    """A client reported dropped is not waited for any more: an upload of it arriving later (a retried task) is
    refused, not folded beside its drop; a client outside the round's sample is refused by name, not a KeyError."""
    red = Reducer([0, 1], {0: 1.0, 1: 3.0})
    red.add(1, None)
    for late in (lambda: red.add(1, {"t": np.ones(1)}),
                 lambda: red.add_partial(exact.Partial([1], FixedSum({}).pack())),
                 lambda: red.add(7, {"t": np.ones(1)}),
                 lambda: red.add_partial(exact.Partial([7], FixedSum({}).pack()))):
        with pytest.raises(ValueError, match=r"client (1|7) is not one this reduce still waits for"):
            late()
    assert red.dropped == [1] and red.missing == [0] and not red.folded


def test_the_weighted_sums_are_not_divided_and_wait_for_every_client():
    """``Reducer.sums`` (what DP-FedAvg noises): sum_i w_i v_i, not divided by the weights' sum, only once every
    sampled client is folded or dropped."""
    red = Reducer([0, 1, 2], {0: 1.0, 1: 3.0, 2: 5.0})
    red.add(0, {"t": np.array([0.5, -2.0])})
    with pytest.raises(AssertionError, match="not every client has been folded in"):
        red.sums(["t"])
    red.add(2, None)
    red.add(1, {"t": np.array([0.25, 1.0])})
    assert red.sums(["t"])["t"].tolist() == [0.5 + 3 * 0.25, -2.0 + 3 * 1.0]
