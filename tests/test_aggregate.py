import numpy as np

from rayfed_dg.engine import Reducer, select_round


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
