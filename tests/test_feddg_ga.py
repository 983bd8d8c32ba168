"""FedDG-GA (CVPR 2023): the generalization adjustment by hand, and on a real Ray server."""
import numpy as np
import pytest
from conftest import tiny_cfg

from rayfed_dg.data import leave_one_domain_out
from rayfed_dg.engine import ClientRunner
from rayfed_dg.methods.feddg_ga import ga_step, ga_update


def test_ga_update_and_step_by_hand():
    # gaps 0.3, 0.1, -0.1: mean 0.1, deviations 0.2, 0, -0.2, largest 0.2 -> A = 1, 0, -1
    new = ga_update(np.full(3, 1 / 3), np.array([0.3, 0.1, -0.1]), 0.2)
    np.testing.assert_allclose(new, [1 / 3 + 0.2, 1 / 3, 1 / 3 - 0.2])
    # clipped at 0, then renormalised: [-0.05, 0.45, 0.6] -> [0, 0.45, 0.6] / 1.05
    new = ga_update(np.array([0.05, 0.45, 0.5]), np.array([-1.0, 0.0, 1.0]), 0.1)
    np.testing.assert_allclose(new, [0.0, 0.45 / 1.05, 0.6 / 1.05])
    # equal gaps (the reference code divides by zero here): weights unchanged
    np.testing.assert_allclose(ga_update(np.array([0.2, 0.8]), np.array([0.5, 0.5]), 0.2), [0.2, 0.8])
    # a weight beyond 1 is clipped to 1 before the renormalisation: [1.1, 0.05, -0.15] -> [1, 0.05, 0] / 1.05
    new = ga_update(np.array([0.9, 0.05, 0.05]), np.array([1.0, 0.0, -1.0]), 0.2)
    np.testing.assert_allclose(new, [1 / 1.05, 0.05 / 1.05, 0.0])
    # nothing left to renormalise (weights that are all 0): uniform, not 0 / 0
    np.testing.assert_allclose(ga_update(np.zeros(2), np.array([0.5, 0.5]), 0.2), [0.5, 0.5])
    # d^r decays linearly from d at round 1 to d / R at round R
    assert ga_step(1, 10, 0.2) == 0.2 and abs(ga_step(10, 10, 0.2) - 0.02) < 1e-12
    assert abs(ga_step(6, 10, 0.2) - 0.1) < 1e-12


@pytest.mark.slow
def test_weights_follow_the_gaps_and_drive_the_next_reduce(ray_session, tiny_ds, engine_host):
    ray = ray_session
    cfg = tiny_cfg("method.name=feddg_ga", "training.rounds=4")
    split = leave_one_domain_out(tiny_ds, "texture", cfg.data.val_fraction, cfg.data.split_seed)
    server = engine_host(tiny_ds, 2).open(cfg, split, tiny_ds.num_classes)
    g0 = ray.get(server.get_state.remote())["global_state"]
    out1 = ray.get(server.run_round.remote())
    s1 = ray.get(server.get_state.remote())
    ray.get(server.run_round.remote())
    s2 = ray.get(server.get_state.remote())

    runner = ClientRunner(cfg, tiny_ds.images, tiny_ds.labels, tiny_ds.num_classes, 3)
    clients = list(range(split.num_clients))
    val = {c: split.val[split.client_domains[c]] for c in clients}
    ups = {c: runner.run_client(c, 1, split.clients[c], g0, {}, {}, val_indices=val[c]) for c in clients}
    before, after = [], []
    for c in clients:
        _, loss, n = runner.evaluate(ups[c].update, val[c], 512)
        before.append(loss / n)
        assert abs(float(ups[c].payload["ga_local"][0]) - loss / n) < 1e-6
        _, loss, n = runner.evaluate(s1["global_state"], val[c], 512)
        after.append(loss / n)
    # round 1 reduces uniformly (a^1 = 1/K), not by data size
    key = "head.weight"
    expect = sum(ups[c].update[key].astype(np.float64) for c in clients) / len(clients)
    np.testing.assert_allclose(s1["global_state"][key], expect.astype(np.float32), rtol=1e-5, atol=1e-6)
    w1 = ga_update(np.full(3, 1 / 3), np.array(after) - np.array(before), ga_step(1, 4, 0.2))
    got = np.array([s1["server_state"]["ga_weights"][c] for c in clients])
    np.testing.assert_allclose(got, w1, rtol=1e-6)
    assert abs(got.sum() - 1) < 1e-9 and np.ptp(got) > 0.05  # the adjustment moved them
    # round 2 reduces with the adjusted weights
    ups2 = {c: runner.run_client(c, 2, split.clients[c], s1["global_state"], {}, {}, val_indices=val[c]) for c in clients}
    expect = sum(w1[c] * ups2[c].update[key].astype(np.float64) for c in clients)
    np.testing.assert_allclose(s2["global_state"][key], expect.astype(np.float32), rtol=1e-5, atol=1e-6)
    # what the evaluation sent up: one ledger row of two float64 per participant
    rows = [x for x in out1.ledger if x.group == "eval:global_on_client"]
    assert sorted(x.client for x in rows) == clients and all(x.bytes == 16 for x in rows)


def test_the_server_moves_the_weights_after_a_trained_round(ray_session, tiny_ds, engine_host):
    """The fast tier's check of the wiring (the test above, slow, checks the values): ``after_round`` runs on the
    server after each round its clients trained, so the weights exist and move from round 1."""
    ray = ray_session
    cfg = tiny_cfg("method.name=feddg_ga", "training.rounds=2", "training.local_steps=2")
    split = leave_one_domain_out(tiny_ds, "texture", cfg.data.val_fraction, cfg.data.split_seed)
    server = engine_host(tiny_ds, 2).open(cfg, split, tiny_ds.num_classes)
    assert "ga_weights" not in ray.get(server.get_state.remote())["server_state"]
    ray.get(server.run_round.remote())
    w = ray.get(server.get_state.remote())["server_state"]["ga_weights"]
    assert sorted(w) == list(range(split.num_clients)) and abs(sum(w.values()) - 1) < 1e-9
    assert np.ptp(list(w.values())) > 0


def test_a_client_without_validation_samples_is_refused_naming_it():
    from types import SimpleNamespace

    from rayfed_dg.methods import build_method

    method = build_method(tiny_cfg("method.name=feddg_ga"), 3)
    with pytest.raises(ValueError, match="client 2 has no validation samples for FedDG-GA"):
        method.upload_payload(None, SimpleNamespace(client_id=2, val_indices=np.array([], dtype=np.int64)))
