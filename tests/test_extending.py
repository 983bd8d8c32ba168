"""The engine extension points' examples of docs/extending.md, run as the page
shows them: a device-model feature driving the round's plan and the
asynchronous clock, and a privacy mechanism's two halves.  (The aggregation
part's example runs on a server actor in tests/test_robust.py.)"""
import numpy as np
import pytest
from conftest import REPO

from rayfed_dg.engine.clock.asynchronous import AsyncClock
from rayfed_dg.engine.clock.devices import plan_round


@pytest.fixture
def examples(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "docs" / "examples"))


def test_a_diurnal_device_feature_drives_the_round_plan_and_the_async_clock(examples):
    from my_devices import Diurnal

    dev = Diurnal(step_s=30.0)
    # at t = 0 client c's local hour is 3c mod 24: clients 3..6 (hours 9..18) are online of 0..7
    plan = plan_round(dev, 8, 0, 1, 0.0, 2, np.full(8, 10), over_selection=2.0)
    assert set(plan.selected) <= {3, 4, 5, 6} and len(plan.selected) == 4
    assert len(plan.aggregated) == 2 and plan.close == 300.0  # 10 steps x 30 s, nobody drops out
    clock = AsyncClock(8, 3, 2, 0, dev, lambda c: 10)
    upd = clock.next_update()
    assert {t.client for t in upd.arrivals} <= {3, 4, 5, 6} and all(t.finish - t.start == 300.0
                                                                       for t in upd.arrivals)
    # twelve hours on, the other half of the clients is online
    late = plan_round(dev, 8, 0, 2, 12 * 3600.0, 2, np.full(8, 10), over_selection=2.0)
    assert set(late.selected) <= {0, 1, 2, 7}


def test_a_mechanisms_halves_bound_one_clients_effect(examples):
    from my_mechanism import client_side, server_side

    rng = np.random.default_rng(0)
    ups = [{"w": rng.normal(0, 5, 4), "b": rng.normal(0, 5, 2)} for _ in range(5)]
    clipped = [client_side(u, 1.0) for u in ups]
    assert all(np.sqrt(sum((c[k] ** 2).sum() for k in c)) <= 1.0 + 1e-12 for c in clipped)
    without = server_side(clipped[1:], 1.0, 0.0, 0, 1)
    full = server_side(clipped, 1.0, 0.0, 0, 1)
    assert np.sqrt(sum(((full[k] - without[k]) ** 2).sum() for k in full)) <= 1.0 + 1e-12  # sensitivity: the clip
    a, b = server_side(clipped, 1.0, 2.0, 0, 1), server_side(clipped, 1.0, 2.0, 0, 1)
    assert all(np.array_equal(a[k], b[k]) for k in a)  # seeded by (seed, round)
    assert not np.allclose(a["w"], server_side(clipped, 1.0, 2.0, 0, 2)["w"])
