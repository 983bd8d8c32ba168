import itertools
import math

import numpy as np
import pytest
import torch

from rayfed_dg.engine import Reducer, select_round
from rayfed_dg.engine.aggregation.exact import BinnedSum


def test_weighted_mean_matches_hand_computation():
    like = {"w": np.zeros(3, np.float32), "n": np.array(0, np.int64)}
    ups = {0: {"w": np.array([1, 2, 3], np.float32), "n": np.array(10)},
           3: {"w": np.array([4, 0, -2], np.float32), "n": np.array(20)},
           5: {"w": np.array([0, 8, 1], np.float32), "n": np.array(30)}}
    sizes = {0: 100, 3: 300, 5: 600}
    red = Reducer([0, 3, 5], sizes)
    for cid in (5, 0, 3):  # arrival order must not matter
        red.add(cid, ups[cid])
    out = red.result(like)
    # (100*[1,2,3] + 300*[4,0,-2] + 600*[0,8,1]) / 1000
    np.testing.assert_allclose(out["w"], [1.3, 5.0, 0.3], rtol=1e-6)
    assert out["w"].dtype == np.float32
    assert out["n"] == 25 and out["n"].dtype == np.int64  # (100*10 + 300*20 + 600*30) / 1000
    assert red.dropped == []


def test_arrival_order_is_bitwise_irrelevant_and_drop_renormalises():
    rng = np.random.default_rng(0)
    ups = {c: {"w": rng.normal(size=1000).astype(np.float32)} for c in range(6)}
    w = {c: float(rng.integers(1, 100)) for c in range(6)}
    like = {"w": np.zeros(1000, np.float32)}
    results = []
    for order in ([0, 1, 2, 3, 4, 5], [5, 3, 1, 0, 2, 4], [2, 5, 4, 3, 1, 0]):
        red = Reducer(list(range(6)), w)
        for c in order:
            red.add(c, ups[c])
        results.append(red.result(like)["w"])
    assert all(np.array_equal(results[0], r) for r in results[1:])
    red = Reducer([0, 1, 2], w)
    red.add(1, None)
    red.add(0, ups[0])
    red.add(2, ups[2])
    expect = (w[0] * ups[0]["w"].astype(np.float64) + w[2] * ups[2]["w"]) / (w[0] + w[2])
    np.testing.assert_allclose(red.result(like)["w"], expect.astype(np.float32), rtol=1e-6, atol=1e-7)
    assert red.dropped == [1]


# ------------------------------------------------------------------ the binned sum


def _sum(terms, parts=None):
    """``terms`` [(w, array)] folded in the given order, in ``parts`` (lists of
    term indices, each its own partial sum, packed as a worker sends it), merged
    in the order given; the float64 total of "x"."""
    parts = parts or [list(range(len(terms)))]
    out = BinnedSum()
    for part in parts:
        b = BinnedSum()
        for i in part:
            b.add(terms[i][0], {"x": torch.as_tensor(terms[i][1])})
        out.merge(b.pack())
    return out


def test_parts_are_rounded_at_fixed_bin_boundaries_by_hand():
    b = BinnedSum()
    b.add(1.0, {"x": torch.tensor([2.0 ** 40 + 3 + 2.0 ** -3, -(2.0 ** 33 + 0.75)], dtype=torch.float64)})
    # 2 max |y| = 2^41 + ...: bin 1 (2^32 .. 2^63); limbs for bins 1, 0, -1: R_j - 2^32 R_(j+1), R_j = round(y 2^-32j)
    assert b.top["x"] == 1
    assert b.limbs["x"].tolist() == [[256.0, -2.0], [3.0, -1.0], [2.0 ** 29, 2.0 ** 30]]
    b.add(1.0, {"x": torch.tensor([-(2.0 ** -40), 0.0], dtype=torch.float64)})  # below half of bin -1's unit: dropped
    assert b.limbs["x"].tolist() == [[256.0, -2.0], [3.0, -1.0], [2.0 ** 29, 2.0 ** 30]]
    b.add(3.0, {"x": torch.tensor([2.0 ** 68, 1.5], dtype=torch.float32)})  # w v = 3 2^68: bin 2, the window shifts
    assert b.top["x"] == 2
    assert b.limbs["x"].tolist() == [[48.0, 0.0], [256.0, -2.0], [3.0, 3.0]]  # 4.5 rounds to 4; bin -1 dropped
    assert b.total("x").tolist() == [3 * 2.0 ** 68 + 2.0 ** 40 + 3, -(2.0 ** 33) + 3]
    c = BinnedSum()  # a weight that is not an integer: the term is w * v rounded once, kept whole in the window
    c.add(0.1, {"x": torch.tensor([3.0])})
    assert c.top["x"] == -1 and c.total("x").item() == 0.1 * 3.0


ADVERSARIAL = [  # per position: huge and tiny magnitudes, cancellation, subnormals (float32 and float64)
    (3.0, np.array([1e30, 1e20, 1e-30, 1.0, 1e-45, -2.5], np.float32)),
    (1.0, np.array([1e-30, 1.0, 3e-38, -1e20, -1e-45, 1e10], np.float32)),
    (0.1, np.array([-1e30, -1e20, 1e-37, 7.0, 1e-45, -1e10], np.float32)),
    (7.0, np.array([2.0 ** 100, 1.0, -1e-30, 1e20, 0.0, 3.0], np.float32)),
    (1 / 3, np.array([-3e29, 1.5, 1e-30, -1e20, 2e-45, 1e-10], np.float32)),
]
TINY = [(w, np.array([5e-324, 1e-310, -2.2e-308, 3e-320], np.float64) * k) for w, k in
        ((0.3, 1.0), (1.0, -7.0), (2.5, 3.0), (1e-5, 1.0))]  # top bins -33 .. -32: the exact slow path


def _partitions(items):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for p in _partitions(rest):
        for i in range(len(p)):
            yield p[:i] + [[first] + p[i]] + p[i + 1:]
        yield [[first]] + p


@pytest.mark.parametrize("terms", [ADVERSARIAL, TINY], ids=["adversarial", "subnormal"])
def test_every_order_and_every_split_into_partials_gives_the_same_bits(terms):
    idx = list(range(len(terms)))
    ref = _sum(terms).total("x").numpy()
    for perm in itertools.permutations(idx):
        assert np.array_equal(_sum(terms, [list(perm)]).total("x").numpy(), ref, equal_nan=True), perm
    splits = list(_partitions(idx))
    assert len(splits) == (52 if len(terms) == 5 else 15)  # Bell numbers
    for parts in splits:
        for order in (parts, parts[::-1], [p[::-1] for p in parts]):
            assert np.array_equal(_sum(terms, order).total("x").numpy(), ref), order
    # the result is the exact sum of the terms, to within the bound
    exact = np.array([math.fsum(float(np.float64(w) * np.float64(v[j])) for w, v in terms) for j in range(len(ref))])
    big = max(abs(float(np.float64(w) * np.float64(x))) for w, v in terms for x in v)
    bound = len(terms) * 2.0 ** -64 * big + np.spacing(np.abs(exact))
    assert np.all(np.abs(ref - exact) <= bound)


def test_error_against_an_exact_sum_within_the_bound_and_below_float64_summation():
    rng = np.random.default_rng(0)
    n, k = 4096, 40
    terms = [(float(rng.integers(1, 2 ** 12)),
              (rng.normal(size=n) * np.exp2(rng.integers(-60, 60, size=n))).astype(np.float32)) for _ in range(k)]
    for j in range(0, k, 7):  # cancellation: each of these is the negation of the one before
        terms[j] = (terms[j - 1][0], -terms[j - 1][1])
    got = _sum(terms, [list(range(0, k, 3)), list(range(1, k, 3)), list(range(2, k, 3))]).total("x").numpy()
    exact = np.array([math.fsum(w * float(v[i]) for w, v in terms) for i in range(n)])
    big = max(w * float(np.abs(v).max()) for w, v in terms)
    err = np.abs(got - exact)
    assert np.all(err <= k * 2.0 ** -64 * big + np.spacing(np.abs(exact)))
    naive = np.zeros(n)
    for w, v in terms:
        naive += w * v.astype(np.float64)
    assert err.max() < np.abs(naive - exact).max()  # better than today's float64 sum in one order


def test_integer_tensors_and_non_finite_uploads():
    red = Reducer([0, 1, 2], {0: 1.0, 1: 2.0, 2: 4.0})
    red.add(2, {"n": np.array([7, -3], np.int64), "x": np.array([1.0, np.inf], np.float32),
                "y": np.ones(2, np.float32)})
    red.add(0, {"n": np.array([2 ** 40, 1], np.int64), "x": np.array([np.nan, 0.0], np.float32),
                "y": np.zeros(2, np.float32)})
    red.add(1, None)
    out = red.result({"n": np.zeros(2, np.int64), "x": np.zeros(2, np.float32), "y": np.zeros(2, np.float32)})
    assert out["n"].tolist() == [round((2 ** 40 + 4 * 7) / 5), round((1 - 12) / 5)] and out["n"].dtype == np.int64
    assert np.isnan(out["x"]).all()  # a tensor with a non-finite term averages to NaN
    assert out["y"].tolist() == [np.float32(0.8)] * 2 and red.dropped == [1]
    with pytest.raises(ValueError, match="client 2 is not one"):
        red.add(2, {"y": np.ones(2, np.float32)})


def test_an_all_zero_tensor_sets_no_window_and_merges_as_nothing():
    # a zero tensor (a bias never moved from 0) holds no bin: terms of 1e-60 added after it keep every bit
    # (a window set at 0's bin would drop them, 2^-199 below its 96 bits), and a partial whose tensor was all
    # zero merges into a sum as nothing
    s = BinnedSum()
    s.add(1.0, {"b": torch.zeros(2, dtype=torch.float64)})
    s.add(0.5, {"b": torch.tensor([1e-60, -3e-61], dtype=torch.float64)})
    assert s.total("b").tolist() == [0.5 * 1e-60, 0.5 * -3e-61]
    zero, other = BinnedSum(), BinnedSum()
    zero.add(2.0, {"x": torch.zeros(2)})
    other.add(1.0, {"x": torch.tensor([1.5, -2.0])})
    other.merge(zero.pack())
    zero.merge(other.pack())
    assert other.total("x").tolist() == [1.5, -2.0] == zero.total("x").tolist()


def test_a_tensor_only_clients_of_weight_zero_uploaded_keeps_its_value():
    # no weight behind it: no mean to take (not 0/0 = NaN); the others are averaged as usual
    red = Reducer([0, 1], {0: 0.0, 1: 2.0})
    red.add(0, {"a": np.array([4.0], np.float32), "b": np.array([7.0], np.float32)})
    red.add(1, {"a": np.array([1.0], np.float32)})
    out = red.result({"a": np.zeros(1, np.float32), "b": np.array([3.0], np.float32)})
    assert out["a"].tolist() == [1.0] and out["b"].tolist() == [3.0]


def test_worker_fold_equals_the_server_fold_of_whole_uploads(tiny_ds):
    """The same clients trained with and without ``Fold``: the partials of any
    split give the bits of the whole uploads folded on the server; a folded
    update keeps the client store's keys and the ledger's sizes."""
    from conftest import tiny_cfg

    from rayfed_dg.data import leave_one_domain_out
    from rayfed_dg.engine import ClientRunner, ClientTask
    from rayfed_dg.engine.store.records import Fold
    from rayfed_dg.engine.workers.worker import to_numpy_state

    cfg = tiny_cfg("method.name=fedbn", "training.local_steps=2")
    split = leave_one_domain_out(tiny_ds, "texture", 0.2, 0)
    runner = ClientRunner(cfg, tiny_ds.images, tiny_ds.labels, tiny_ds.num_classes, 3)
    sd = runner.model.state_dict()
    g0 = to_numpy_state(sd, sd.keys())
    n = {c: float(s) for c, s in enumerate(split.client_sizes())}
    task = lambda c, fold=None: ClientTask(client=c, round=1, indices=split.clients[c], fold=fold,  # noqa
                                           local_state={k: g0[k] for k in runner.local_keys})
    whole = {c: runner.train(task(c), g0) for c in range(3)}
    server = Reducer([0, 1, 2], n)
    for c in (2, 0, 1):
        server.add(c, whole[c].update)
    for parts in ([[0, 1, 2]], [[2], [0, 1]], [[1], [2], [0]]):
        red = Reducer([0, 1, 2], n)
        for e, part in enumerate(parts):
            for c in part:
                folded = runner.train(task(c, Fold(7, 1, e, n[c])), g0)
                assert set(folded.update) == runner.local_keys and folded.sizes == {
                    k: v.nbytes for k, v in whole[c].update.items()}
            p = runner.take_partial(7, 1, e)
            assert p is not None and p.clients == sorted(part) and runner.take_partial(7, 1, e) is None
            red.add_partial(p)
        a, b = red.result(g0), server.result(g0)
        assert all(np.array_equal(a[k], b[k]) for k in g0), parts
    runner.train(task(0, Fold(7, 2, 0, 1.0)), g0)
    runner.train(task(1, Fold(7, 2, 1, 1.0)), g0)  # a newer epoch: the server gave up on epoch 0's partial
    assert runner.take_partial(7, 2, 0) is None and runner.take_partial(7, 2, 1) is None


class Poison(float):
    def __float__(self):
        raise AssertionError("selection read a target accuracy")


def test_selection_uses_source_validation_only():
    rows = [
        {"round": 1, "split": "source_val", "domain": "a", "accuracy": 0.6},
        {"round": 1, "split": "source_val", "domain": "b", "accuracy": 0.8},
        {"round": 1, "split": "target_test", "domain": "t", "accuracy": Poison(0.99)},
        {"round": 2, "split": "source_val", "domain": "a", "accuracy": 0.9},
        {"round": 2, "split": "source_val", "domain": "b", "accuracy": 0.7},
        {"round": 2, "split": "target_test", "domain": "t", "accuracy": Poison(0.10)},
        {"round": 3, "split": "source_val", "domain": "a", "accuracy": 0.5},
        {"round": 3, "split": "source_val", "domain": "b", "accuracy": 0.5},
    ]
    rnd, acc = select_round(rows)
    assert rnd == 2 and abs(acc - 0.8) < 1e-12  # round 1 ties at 0.7 < 0.8


# ------------------------------------------------------------------ end to end, on local Ray


def _records(res):
    """A federation's metrics, ledger and clients tables, less the seconds."""
    return res.metrics, res.ledger, [{k: v for k, v in r.items() if k != "seconds"} for r in res.clients]


@pytest.mark.parametrize("method", [
    ("method.name=fedavg",),  # folded on the workers
    ("method.name=csac", "method.pretrain_steps=2"),  # layer-wise weights: every upload travels whole
    ("method.name=fedbn", "server.aggregator=trimmed_mean", "server.trim=0.2"),  # sorted per coordinate, on the server
], ids=["fedavg", "csac", "fedbn_trimmed_mean"])
def test_same_bits_whatever_the_workers_and_the_order_of_the_clients(ray_session, tiny_ds, engine_host, method):
    """9 clients, 6 a round, on 1 and 2 workers, dispatched largest first or
    in client order, one client per task or grouped: which worker folds which
    client changes, the records do not."""
    from conftest import tiny_cfg

    from rayfed_dg.data import leave_one_domain_out
    from rayfed_dg.engine import run_federation

    sets = (*method, "partition.strategy=single_domain", "partition.num_clients=9",
            "training.clients_per_round=6", "training.local_steps=2")
    split = leave_one_domain_out(tiny_ds, "colour", 0.2, 0, "single_domain", 9)
    runs = [run_federation(tiny_cfg(*sets, *extra), split, None, None, tiny_ds.num_classes, progress=False,
                           host=engine_host(tiny_ds, workers))
            for workers, extra in ((1, ()), (2, ("engine.schedule=in_order",)),
                                   (2, ("engine.group_small_clients=false",)))]
    first = _records(runs[0])
    assert len(first[2]) == 2 * 6 and {m["split"] for m in first[0]} >= {"source_val", "target_test"}
    assert all(_records(r) == first for r in runs[1:])


@pytest.mark.slow
def test_a_worker_killed_after_folding_loses_its_partial_and_the_round_is_the_same(ray_session, tiny_ds,
                                                                                   engine_host):
    """One worker: client 0 trains and folds, then client 1's first attempt
    kills the process (seeded: its draw is 0.194 < 0.2, client 0's 0.233,
    client 2's 0.99), so client 0's fold is lost although its update came
    back; the server trains it again, uncharged, from the local state it
    started the round with (FedBN's), and the records equal the fault-free
    run's but for client 1's charged retry."""
    from conftest import tiny_federation

    sets = ("method.name=fedbn", "training.local_steps=2", "engine.num_workers=1")
    clean = tiny_federation(tiny_ds, "colour", *sets, host=engine_host(tiny_ds, 1))
    faulty = tiny_federation(tiny_ds, "colour", *sets, "engine.fault_probability=0.2", "engine.fault_mode=kill",
                             "engine.max_restarts=10")
    assert faulty.metrics == clean.metrics and faulty.ledger == clean.ledger
    assert faulty.tasks_retried == 1 and [(r["client"], r["retried"]) for r in faulty.clients if r["retried"]] == [
        (1, 1)]
    assert faulty.tasks_rerun >= 2  # client 2 (queued behind the death) and client 0 (its fold was lost)


def test_scaling_beyond_float64s_exponent_range_is_exact_in_two_steps():
    from rayfed_dg.engine.aggregation.exact import _scale

    # 2^e itself is not a float64 for e = 2000 or -2000, the product is: each half-step is
    x = torch.tensor([2.0 ** -1060, -3 * 2.0 ** -1070], dtype=torch.float64)
    assert _scale(x.clone(), 2000).tolist() == [2.0 ** 940, -3 * 2.0 ** 930]
    y = torch.tensor([2.0 ** 1000, 5 * 2.0 ** 990], dtype=torch.float64)
    assert _scale(y.clone(), -2000).tolist() == [2.0 ** -1000, 5 * 2.0 ** -1010]
    assert _scale(torch.tensor([3.0], dtype=torch.float64), 10).tolist() == [3072.0]
