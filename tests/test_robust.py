"""The robust aggregation parts (engine/aggregation/robust.py: Yin et al., ICML 2018):
the coordinate-wise median and trimmed mean by hand, their independence from
the uploads' order and from the worker count, the pipeline's refusals, and a
server round whose new global model is recomputed here from the clients'
uploads."""
import itertools

import numpy as np
import pytest
from conftest import REPO, tiny_cfg

from rayfed_dg.config import load_config
from rayfed_dg.engine.aggregation.exact import Reducer
from rayfed_dg.engine.aggregation.pipeline import ESTIMATORS, Estimator, Uploads, register_aggregator
from rayfed_dg.engine.aggregation.robust import Median, TrimmedMean, trimmed
from rayfed_dg.engine.rounds.parts import check_pipeline
from rayfed_dg.errors import ConfigError
from rayfed_dg.methods import ClientUpdate


def uploads(values: dict[int, dict[str, np.ndarray]], x: dict[str, np.ndarray], order=None) -> Uploads:
    order = list(values) if order is None else order
    ups = {c: ClientUpdate(client=c, num_samples=1, update=v, private={}, payload={}, train_loss=0.0, seconds=0.0)
           for c, v in values.items()}
    return Uploads(1, x, Reducer(order, dict.fromkeys(order, 1.0)), ups, order)


def server(**kw):
    return load_config(None, [f"server.{k}={v}" for k, v in kw.items()]).server


X = {"w": np.zeros(3, np.float32), "n": np.array(0, np.int64), "only0": np.zeros(1, np.float32),
     "nobody": np.full(2, 7.0, np.float32)}
# five clients; coordinate j of w: column j
W = np.array([[1.0, -3.0, 10.0],
              [4.0, 2.0, -1.0],
              [2.0, 8.0, 0.5],
              [100.0, -1.0, 0.25],
              [3.0, 5.0, 2.0]])
N = [3, 8, 5, 5, 4]


def five(m: int = 5):
    return {c: {"w": W[c].astype(np.float32), "n": np.array(N[c], np.int64),
                **({"only0": np.array([9.0], np.float32)} if c == 0 else {})} for c in range(m)}


def test_median_by_hand_odd_and_even():
    out = Median(server(aggregator="median"), X).estimate(uploads(five(), X))
    # columns sorted: [1,2,3,4,100] -> 3; [-3,-1,2,5,8] -> 2; [-1,0.25,0.5,2,10] -> 0.5; n: [3,4,5,5,8] -> 5
    np.testing.assert_array_equal(out["w"], np.array([3.0, 2.0, 0.5], np.float32))
    assert out["w"].dtype == np.float32 and out["n"] == 5 and out["n"].dtype == np.int64
    assert out["only0"][0] == 9.0  # one client uploaded it: the median of one value
    np.testing.assert_array_equal(out["nobody"], X["nobody"])  # nobody uploaded it: x_t's value
    four = Median(server(aggregator="median"), X).estimate(uploads(five(4), X))
    # four clients: the mean of the two middle values: [1,2,4,100] -> 3; [-3,-1,2,8] -> 0.5; [-1,.25,.5,10] -> .375
    np.testing.assert_array_equal(four["w"], np.array([3.0, 0.5, 0.375], np.float32))
    assert four["n"] == 5  # [3,5,5,8] -> 5



def test_trimmed_mean_by_hand():
    out = TrimmedMean(server(aggregator="trimmed_mean", trim=0.2), X).estimate(uploads(five(), X))
    # beta m = 1 from each end: [2,3,4] -> 3; [-1,2,5] -> 2; [0.25,0.5,2] -> 11/12; n: [4,5,5] -> 14/3 -> 5
    np.testing.assert_allclose(out["w"], np.array([3.0, 2.0, 11 / 12], np.float32), rtol=0, atol=0)
    assert out["n"] == 5  # rounded to the nearest integer, not truncated
    plain = TrimmedMean(server(aggregator="trimmed_mean", trim=0.19), X).estimate(uploads(five(), X))
    # floor(0.19 x 5) = 0: the plain mean of all five
    np.testing.assert_array_equal(plain["w"], (W.sum(axis=0) / 5).astype(np.float32))


@pytest.mark.parametrize("m, beta, cut", [(5, 0.2, 1), (5, 0.19, 0), (3, 0.49, 1), (10, 0.25, 2), (1, 0.49, 0),
                                          (4, 0.0, 0)])
def test_trimmed_count_is_the_floor_of_beta_m(m, beta, cut):
    assert trimmed(m, beta) == cut
    assert m - 2 * cut >= 1


def test_trim_of_half_or_more_is_refused_by_the_config():
    with pytest.raises(ConfigError, match="server.trim"):
        load_config(None, ["server.aggregator=trimmed_mean", "server.trim=0.5"])
    with pytest.raises(ConfigError, match="server.trim applies to server.aggregator trimmed_mean only"):
        load_config(None, ["server.aggregator=median", "server.trim=0.2"])


def test_nan_poisons_its_coordinate_and_infinities_are_trimmed():
    vals = {0: {"w": np.array([np.nan, 1.0, np.inf])}, 1: {"w": np.array([1.0, np.inf, 2.0])},
            2: {"w": np.array([2.0, 3.0, 3.0])}, 3: {"w": np.array([3.0, -np.inf, 4.0])},
            4: {"w": np.array([4.0, 5.0, 5.0])}}
    x = {"w": np.zeros(3)}
    med = Median(server(aggregator="median"), x).estimate(uploads(vals, x))["w"]
    assert np.isnan(med[0]) and med[1] == 3.0 and med[2] == 4.0
    tm = TrimmedMean(server(aggregator="trimmed_mean", trim=0.2), x).estimate(uploads(vals, x))["w"]
    assert np.isnan(tm[0]) and tm[1] == 3.0 and tm[2] == 4.0  # [1,3,5] and [3,4,5] once the infinities go


def test_every_order_of_the_uploads_gives_the_same_bits():
    """The kept values are summed in sorted order: an upload order that a
    plain running sum would round differently gives the same result."""
    vals = [1e16, 1.0, -1e16, 3.0, 1.0, 2.0 ** -30]
    ups = {c: {"w": np.array([v, -v])} for c, v in enumerate(vals)}
    x = {"w": np.zeros(2)}
    naive = {sum(np.array(p, np.float64)) for p in itertools.permutations(vals)}
    assert len(naive) > 1  # the order matters to a running sum
    for est in (TrimmedMean(server(aggregator="trimmed_mean", trim=0.0), x), Median(server(aggregator="median"), x)):
        outs = {est.estimate(uploads(ups, x, list(p)))["w"].tobytes() for p in itertools.permutations(range(6))}
        assert len(outs) == 1


def test_the_pipeline_refuses_what_does_not_combine():
    def why(*sets):
        with pytest.raises(ConfigError) as e:
            check_pipeline(tiny_cfg(*sets))
        return str(e.value)

    dp = ("privacy.updates.clip=1.0", "privacy.updates.noise_multiplier=1.0")
    assert why("server.aggregator=median", *dp).startswith(
        "server.aggregator=median: privacy.updates adds noise calibrated to one client's bounded effect")
    assert why("server.aggregator=trimmed_mean", "server.mode=fedbuff") == (
        "server.aggregator=trimmed_mean: server.mode=fedbuff combines the uploads its own way, and a round has one "
        "estimator; use server.aggregator mean or drop server.mode")
    assert why("server.aggregator=median", "method.name=feddg_ga").startswith(
        "server.aggregator: method feddg_ga weighs clients itself (aggregation_weights)")
    assert "did you mean 'median'" in why("server.aggregator=medain")
    for ok in (("server.aggregator=median",), ("server.aggregator=median", "method.name=fedbn"),
               ("server.aggregator=trimmed_mean", "server.optimizer=fedavgm"),
               ("server.aggregator=median", "method.name=csac")):  # csac's uploads travel whole anyway
        check_pipeline(tiny_cfg(*ok))


def test_two_estimators_bounded_alike_are_refused_as_two_not_as_noise_on_an_unbounded_one():
    from rayfed_dg.engine.aggregation.pipeline import refusal
    from rayfed_dg.engine.privacy.updates import DPMean
    from rayfed_dg.methods import declarations

    class Clipped(Estimator):  # a user's rule with a bounded sensitivity, beside DP's own
        name, sensitivity_bounded = "clipped", True

    why = refusal(DPMean, [DPMean, Clipped], declarations(tiny_cfg()))
    assert why is not None and why.startswith("server.aggregator=clipped: privacy.updates combines the uploads its "
                                              "own way, and a round has one estimator")


def test_the_assembly_may_set_some_of_its_keys_in_a_round_and_none_it_did_not_declare():
    from rayfed_dg.engine.aggregation.pipeline import Pipeline
    from rayfed_dg.errors import EngineError

    class Copy(Estimator):
        name = "copy"

        def estimate(self, u):
            return {k: v + 1.0 for k, v in u.x.items()}

    class Sets:
        name = "m"

        def __init__(self, own):
            self.own = own

        def assemble_global(self, r, results, est, x, server_state):
            return dict(self.own)

    x = {"a": np.zeros(1), "b": np.zeros(1), "c": np.zeros(1)}
    u = Uploads(1, x, None, {}, [])
    new = Pipeline(Copy(None, x), None, Sets({"a": np.full(1, 7.0)}), {"a", "b"}).run(u, [], {})
    assert {k: float(v[0]) for k, v in new.items()} == {"a": 7.0, "b": 1.0, "c": 1.0}  # b: not set this round
    with pytest.raises(EngineError, match=r"method m: assemble_global set \['c'\], which its assembles"):
        Pipeline(Copy(None, x), None, Sets({"a": x["a"], "c": x["c"]}), {"a", "b"}).run(u, [], {})


def test_a_users_aggregator_registers_like_a_method(monkeypatch):
    monkeypatch.setattr("rayfed_dg.engine.aggregation.pipeline.ESTIMATORS", dict(ESTIMATORS))
    from rayfed_dg.engine.aggregation import pipeline

    @register_aggregator
    class Largest(Estimator):
        """The coordinate-wise largest upload (a toy rule)."""
        name = "largest"
        sums = False

        def estimate(self, u):
            return {k: np.max([y[k] for _, y in u.uploads()], axis=0) for k in u.x}

    assert pipeline.ESTIMATORS["largest"] is Largest
    check_pipeline(tiny_cfg("server.aggregator=largest"))
    out = Largest(None, X).estimate(uploads(five(), {"w": X["w"]}))
    np.testing.assert_array_equal(out["w"], np.array([100.0, 8.0, 10.0], np.float32))
    with pytest.raises(TypeError):
        register_aggregator(type("NoName", (Estimator,), {}))


def round_one(ray, tiny_ds, engine_host, *sets):
    """(x_0, the global model after round 1 on a server actor, each client's
    upload recomputed here, the model's parameter names) for six clients."""
    from rayfed_dg.data import leave_one_domain_out
    from rayfed_dg.engine import ClientRunner
    from rayfed_dg.methods import build_method

    cfg = tiny_cfg("partition.strategy=single_domain", "partition.num_clients=6", "training.local_steps=2", *sets)
    split = leave_one_domain_out(tiny_ds, "colour", cfg.data.val_fraction, cfg.data.split_seed, "single_domain", 6)
    srv = engine_host(tiny_ds, 1).open(cfg, split, tiny_ds.num_classes)
    g0 = ray.get(srv.get_state.remote())["global_state"]
    ray.get(srv.run_round.remote())
    got = ray.get(srv.get_state.remote(None, False))["global_state"]
    runner = ClientRunner(cfg, tiny_ds.images, tiny_ds.labels, tiny_ds.num_classes, split.num_clients)
    first = {k: g0[k] for k in runner.local_keys}  # the client store's state of a client not yet trained
    ups = [runner.run_client(c, 1, split.clients[c], g0, first).update for c in range(split.num_clients)]
    params = {n for n, _ in build_method(cfg, 6).build_model(tiny_ds.num_classes).named_parameters()}
    return g0, got, ups, params, split.client_sizes().astype(np.float64)


@pytest.mark.parametrize("rule", [("server.aggregator=median",),
                                  ("server.aggregator=trimmed_mean", "server.trim=0.25", "server.optimizer=fedavgm",
                                   "server.momentum=0", "server.lr=0.5")], ids=["median", "trimmed_fedavgm"])
def test_a_server_round_is_the_rule_over_the_clients_uploads(ray_session, tiny_ds, engine_host, rule):
    """Round 1 on a server actor, against the clients' uploads recomputed
    here: the global model is the rule applied by hand to them (and, with
    FedAvgM at beta 0, eta 0.5, x_t + 0.5 (rule - x_t) for the parameters)."""
    g0, got, ups, params, _ = round_one(ray_session, tiny_ds, engine_host, *rule)
    for k in g0:
        s = np.sort(np.stack([np.asarray(u[k], np.float64) for u in ups]), axis=0)
        want = (s[2] + s[3]) / 2 if "median" in rule[0] else (s[1] + s[2] + s[3] + s[4]) / 4  # m = 6, trim 1 each
        if "server.optimizer=fedavgm" in rule and k in params:
            want = g0[k] + 0.5 * (want.astype(g0[k].dtype).astype(np.float64) - g0[k])
        if np.issubdtype(g0[k].dtype, np.integer):
            want = np.rint(want)
        np.testing.assert_allclose(got[k], want.astype(g0[k].dtype), rtol=1e-6, atol=1e-7, err_msg=k)
    assert any(not np.allclose(got[k], g0[k]) for k in params)


def test_the_extending_pages_aggregator_runs_as_a_plugin(ray_session, tiny_ds, engine_host, monkeypatch):
    """docs/examples/my_aggregator.py (docs/extending.md), loaded by a
    config's ``plugins:`` on the server actor: round 1's global model is the
    norm-bounded mean of the clients' uploads recomputed here."""
    monkeypatch.syspath_prepend(str(REPO / "docs" / "examples"))
    import my_aggregator

    g0, got, ups, params, sizes = round_one(ray_session, tiny_ds, engine_host, "plugins=[my_aggregator]",
                                            "server.aggregator=norm_bounded")
    floats = [k for k in g0 if np.issubdtype(g0[k].dtype, np.floating)]
    deltas = [{k: np.asarray(u[k], np.float64) - g0[k] for k in floats} for u in ups]
    norms = [np.sqrt(sum((d[k] ** 2).sum() for k in floats)) for d in deltas]
    assert max(norms) > my_aggregator.BOUND  # the bound binds for some client
    for k in floats:
        acc = sum(w * min(1.0, my_aggregator.BOUND / n) * d[k] for w, n, d in zip(sizes, norms, deltas))
        np.testing.assert_allclose(got[k], (g0[k] + acc / sizes.sum()).astype(g0[k].dtype), rtol=1e-6, atol=1e-7,
                                   err_msg=k)


def test_a_robust_rule_refused_through_the_cli_is_one_line_exit_2(ray_session, tmp_path, capsys, monkeypatch):
    from rayfed_dg.cli import main

    monkeypatch.setenv("RAYFED_DG_CACHE", str(tmp_path / "cache"))
    run_dir = tmp_path / "run"
    qs = [str(REPO / "configs" / "quickstart.yaml"), "--set", "compare=null", "--set", "data.resolution=16"]
    code = main(["run", *qs, "--set", "server.aggregator=median", "--set", "method.name=feddg_ga",
                 "--target", "texture", "--run-dir", str(run_dir), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "weighs clients itself" in err[0], err
    assert not run_dir.exists()
