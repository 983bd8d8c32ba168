"""DP-FedAvg with adaptive clipping (engine/privacy/updates.py) and the privacy accountant
(engine/privacy/accountant.py): clipping, the noise's std, the accountant against
closed forms, adaptive clipping by hand, the target epsilon's refusal and
stop, each bad input, and end to end on tiny digits runs: the global model
is the broadcast plus the noised sum of clipped updates over m, the same
bits on 1 or 2 workers and after a resume."""
import math

import numpy as np
import pytest
import torch
from conftest import REPO, tiny_cfg
from scipy import optimize, stats

from rayfed_dg.cli import main
from rayfed_dg.config import ConfigError, PrivacyConfig, UpdatePrivacyConfig
from rayfed_dg.data import leave_one_domain_out
from rayfed_dg.engine import ClientRunner, run_federation
from rayfed_dg.engine.aggregation.pipeline import refusal as pipeline_refusal
from rayfed_dg.engine.privacy.accountant import UPDATES, Accountant, payload_group, releases
from rayfed_dg.engine.privacy.updates import DPMean, UpdateDP, check_privacy, clip_update, update_noise
from rayfed_dg.engine.store.rundir import RunDir
from rayfed_dg.engine.workers.faults import DivergedError
from rayfed_dg.methods import Method, get_method_class
from rayfed_dg.reporting import privacy_table
from rayfed_dg.seeding import Stream, numpy_rng

QS = str(REPO / "configs" / "quickstart.yaml")
TINY = ["--set", "compare=null", "--set", "data.resolution=16", "--set", "model.width=8"]


# ------------------------------------------------------------------ clipping and noise

def test_clipping_bounds_the_update_and_leaves_a_short_one_unchanged():
    broadcast = {"w": np.zeros((3, 4), np.float32), "b": np.ones(5, np.float32), "n": np.array(7)}
    upload = {"w": torch.ones(3, 4), "b": torch.full((5,), 3.0), "n": torch.tensor(9)}
    clipped, norm = clip_update(upload, broadcast, 2.0)
    assert set(clipped) == {"w", "b"}  # the integer buffer is not part of the update
    assert norm == pytest.approx(math.sqrt(12 * 1.0 + 5 * 2.0 ** 2))  # the update, not the upload: b moved by 2
    flat = np.concatenate([clipped[k].numpy().ravel() for k in ("b", "w")])
    assert np.linalg.norm(flat) == pytest.approx(2.0, rel=1e-12)
    np.testing.assert_allclose(clipped["w"].numpy(), 2.0 / math.sqrt(32.0))  # scaled as one vector
    short, _ = clip_update(upload, broadcast, 10.0)
    np.testing.assert_array_equal(short["w"].numpy(), np.ones((3, 4)))
    np.testing.assert_array_equal(short["b"].numpy(), np.full(5, 2.0))
    # a diverged update cannot be clipped (min(1, C / nan) would be 1): the run stops as for a NaN loss
    with pytest.raises(DivergedError, match="non-finite norm"):
        clip_update({**upload, "w": torch.full((3, 4), float("nan"))}, broadcast, 2.0)


def _variance_interval(n: int, p: float = 1e-6) -> tuple[float, float]:
    """Where sum(x^2) / n / sigma^2 falls with probability 1 - p for n draws of N(0, sigma^2): chi-square(n) / n."""
    return stats.chi2.ppf(p / 2, n) / n, stats.chi2.ppf(1 - p / 2, n) / n


@pytest.mark.parametrize("adaptive", [False, True])
def test_the_noise_on_the_sum_has_std_noise_multiplier_times_clip(adaptive):
    n, clip, z = 200_000, 0.5, 1.3
    u = UpdatePrivacyConfig(clip=clip, noise_multiplier=z, adaptive=adaptive,
                            **({"count_noise_multiplier": 1.0} if adaptive else {}))
    dp = UpdateDP(u, seed=4, per_round=1, keys=["a"])
    noise = dp.release(1, {"a": np.zeros(n)}, {"a": np.zeros(n)})["a"]  # m = 1: the new value is the noise
    # adaptive: Andrew et al.'s z_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2), here (1.3^-2 - 2^-2)^(-1/2)
    std = clip * (z if not adaptive else (z ** -2 - 0.25) ** -0.5)
    lo, hi = _variance_interval(n)
    assert lo < float(np.mean(noise ** 2)) / std ** 2 < hi
    assert abs(float(np.mean(noise))) < stats.norm.ppf(1 - 1e-6 / 2) * std / math.sqrt(n)


def test_the_new_global_is_the_broadcast_plus_the_noised_sum_over_m():
    u = UpdatePrivacyConfig(clip=0.7, noise_multiplier=0.9)
    rng = np.random.default_rng(1)
    prev = {"b": rng.normal(size=4).astype(np.float32), "a": rng.normal(size=(2, 3)).astype(np.float32)}
    sums = {"a": rng.normal(size=(2, 3)), "b": rng.normal(size=4)}
    out = UpdateDP(u, seed=7, per_round=3, keys=["a", "b"]).release(5, sums, prev)
    draw = numpy_rng(7, Stream.DP_UPDATES, 5)  # keys in sorted order, from the round's stream
    for k in ("a", "b"):
        noise = draw.normal(0.0, 0.9 * 0.7, size=prev[k].shape)
        expect = (prev[k].astype(np.float64) + (sums[k] + noise) / 3).astype(np.float32)
        np.testing.assert_array_equal(out[k], expect)
        assert out[k].dtype == np.float32


def test_adaptive_clipping_by_hand_on_two_rounds():
    u = UpdatePrivacyConfig(clip=1.0, noise_multiplier=0.5, adaptive=True, target_quantile=0.5, clip_lr=0.2,
                            count_noise_multiplier=0.5)
    dp = UpdateDP(u, seed=3, per_round=4, keys=[])
    # round 1: 3 of the 4 updates within the clip; round 2: 1 of the 3 that returned (one client failed)
    xi1 = numpy_rng(3, Stream.DP_UPDATES, 1, 1).normal(0.0, 0.5)
    xi2 = numpy_rng(3, Stream.DP_UPDATES, 2, 1).normal(0.0, 0.5)
    b1 = ((1 - .5) * 3 + (0 - .5) * 1 + xi1) / 4 + 0.5  # sum of centred bits plus noise, over m, plus 1/2
    c1 = 1.0 * math.exp(-0.2 * (b1 - 0.5))
    b2 = ((1 - .5) * 1 + (0 - .5) * 2 + xi2) / 4 + 0.5
    c2 = c1 * math.exp(-0.2 * (b2 - 0.5))
    dp.adapt(1, unclipped=3, returned=4)
    assert dp.clip == pytest.approx(c1, rel=1e-14)
    dp.adapt(2, unclipped=1, returned=3)
    assert dp.clip == pytest.approx(c2, rel=1e-14)
    assert c1 < 1.0 < c1 / c2 + 0.3 and abs(xi1) < 2 and abs(xi2) < 2  # mostly within the clip: it shrank, then grew
    assert update_noise(u, 4) == pytest.approx((0.5 ** -2 - 1.0 ** -2) ** -0.5)


# ------------------------------------------------------------------ the accountant

def _privacy(z: float, accountant: str = "rdp", **kw) -> PrivacyConfig:
    return PrivacyConfig(accountant=accountant, updates=UpdatePrivacyConfig(clip=1.0, noise_multiplier=z), **kw)


def test_pld_equals_the_gaussian_mechanisms_closed_form():
    # R Gaussian mechanisms of multiplier z are mu-GDP with mu = sqrt(R) / z (Dong, Roth and Su, 2022, Cor. 3.3), and
    # mu-GDP is (eps, delta)-DP exactly where delta = Phi(-eps / mu + mu / 2) - e^eps Phi(-eps / mu - mu / 2)
    # (Balle and Wang, ICML 2018, Thm. 8)
    z, rounds, delta = 3.0, 5, 1e-5
    mu = math.sqrt(rounds) / z
    exact = optimize.brentq(lambda e: stats.norm.cdf(-e / mu + mu / 2) - math.exp(e) * stats.norm.cdf(-e / mu - mu / 2)
                            - delta, 1e-3, 50, xtol=1e-12)
    acc = Accountant(_privacy(z, "pld", delta=delta), num_clients=2, per_round=2)  # every client: no sampling
    eps = acc.epsilon(acc.counts(rounds, {}))
    assert eps == pytest.approx(exact, rel=1e-6)  # PLD's discretisation (1e-4) errs upward only
    assert eps >= exact - 1e-9


def _gaussian_rdp_epsilon(z: float, rounds: int, delta: float) -> float:
    """R Gaussians of multiplier z, by hand: RDP R a / (2 z^2), to (eps, delta) by Canonne, Kamath and Steinke's
    conversion, over dp-accounting's orders."""
    from dp_accounting.rdp.rdp_privacy_accountant import DEFAULT_RDP_ORDERS

    return min(rounds * a / (2 * z * z) + math.log1p(-1 / a) - math.log(delta * a) / (a - 1)
               for a in DEFAULT_RDP_ORDERS if a > 1.01)


def test_rdp_of_unsampled_rounds_is_the_gaussian_rdp_converted_by_hand():
    z, rounds, delta = 1.5, 15, 1e-5
    acc = Accountant(_privacy(z, delta=delta), num_clients=3, per_round=3)
    assert acc.epsilon(acc.counts(rounds, {})) == pytest.approx(_gaussian_rdp_epsilon(z, rounds, delta), rel=1e-12)


def test_sampling_without_replacement_is_wang_et_als_bound_at_half_the_multiplier():
    import dp_accounting as dp

    # Abadi et al.'s setting (q = 0.01, 10,000 steps, delta 1e-5) at z = 8: replacing a client moves the clipped
    # sum by 2 clips, so the event's multiplier over its sensitivity is 4
    acc = Accountant(_privacy(8.0), num_clients=100, per_round=1)
    eps = acc.epsilon(acc.counts(10_000, {}))
    ref = dp.rdp.RdpAccountant(neighboring_relation=dp.NeighboringRelation.REPLACE_ONE)
    ref.compose(dp.SampledWithoutReplacementDpEvent(100, 1, dp.GaussianDpEvent(4.0)), 10_000)
    assert eps == pytest.approx(ref.get_epsilon(1e-5), rel=1e-12)
    assert eps == pytest.approx(2.2211, abs=1e-4)
    unsampled = Accountant(_privacy(8.0), num_clients=100, per_round=1)
    unsampled.sampled = False  # what the same rounds would cost without amplification
    assert eps < unsampled.epsilon(unsampled.counts(10_000, {})) / 10


def test_releases_count_each_groups_worst_client_per_round():
    def row(r, c, group, direction="up"):
        return {"round": r, "client": c, "group": group, "direction": direction}

    rows = [row(0, 0, "payload:style"), row(0, 1, "payload:style"), row(0, 1, "payload:bank", "down"),
            row(1, 0, "prepare:style"), row(1, 0, "payload:style"), row(1, 1, "payload:style"),
            row(1, 2, "shared"), row(1, 2, "payload:other"), row(2, 1, "payload:style", "down")]
    assert releases(rows) == {"style": 3, "other": 1}  # round 0: 1; round 1: client 0 twice; downs are free


def test_payload_group_reads_only_payload_and_prepare_rows():
    assert payload_group("payload:style") == "style" and payload_group("prepare:bank") == "bank"
    for other in ("state:bn.weight", "model:body.0.weight", "shared", "payload", "updates"):
        assert payload_group(other) is None, other


def test_a_group_never_released_costs_nothing_even_without_noise():
    """A payload group without noise (z 0) is non-private once released, and free while it is not."""
    acc = Accountant(_privacy(3.0), 3, 3)
    assert acc.epsilon({UPDATES: 4, "stats": 0}, ["stats"]) == 0.0
    assert acc.epsilon({UPDATES: 4, "stats": 0}) == pytest.approx(acc.epsilon({UPDATES: 4}), rel=1e-12)
    assert math.isfinite(acc.epsilon({UPDATES: 4})) and acc.epsilon({UPDATES: 4, "stats": 1}) == math.inf


def test_rows_give_each_payload_group_its_own_clip_whatever_its_name():
    """Groups named before and after ``updates`` in sort order: each row carries its own group's clip."""
    p = _privacy(3.0, payloads={"alpha": {"clip": 0.25, "noise_multiplier": 2.0},
                                "zeta": {"clip": 0.5, "noise_multiplier": 2.0}})
    acc = Accountant(p, 3, 3)
    rows = {r.group: r for r in acc.rows(2, acc.counts(2, {"alpha": 1, "zeta": 1}), clip=0.75)}
    assert [rows[g].clip for g in (UPDATES, "alpha", "zeta", "total")] == [0.75, 0.25, 0.5, None]
    assert [rows[g].noise_multiplier for g in (UPDATES, "alpha", "zeta", "total")] == [3.0, 2.0, 2.0, None]


def test_pld_calibration_is_below_rdps_and_spends_the_target():
    """PLD's multiplier for 8 unsampled rounds at epsilon 6 is below RDP's (a tighter accountant) and spends the
    target within the search's tolerance."""
    z_rdp = Accountant(_privacy(1.0, "rdp"), 3, 3).calibrate(8, 6.0)
    z_pld = Accountant(_privacy(1.0, "pld"), 3, 3).calibrate(8, 6.0)
    assert z_pld < z_rdp * 0.99
    acc = Accountant(_privacy(z_pld, "pld"), 3, 3)
    assert 6.0 * 0.995 <= acc.epsilon(acc.counts(8, {})) <= 6.0 + 1e-9


def test_groups_compose_into_the_total():
    p = _privacy(1.0, payloads={"style": {"clip": 1.0, "noise_multiplier": 2.0}})
    acc = Accountant(p, num_clients=3, per_round=3)
    counts = acc.counts(4, {"style": 6})
    assert counts == {UPDATES: 4, "style": 6}
    rows = acc.rows(4, counts, 0.5)
    by = {r.group: r for r in rows}
    assert [r.group for r in rows] == [UPDATES, "style", "total"]
    assert by[UPDATES].clip == 0.5 and by["style"].clip == 1.0 and by["total"].releases == 10
    # 4 Gaussians of z = 1 and 6 of z = 2 are one Gaussian of z^-2 = 4 + 6/4 (RDP adds)
    assert by["total"].epsilon == pytest.approx(Accountant(_privacy((4 + 1.5) ** -0.5), 3, 3).epsilon({UPDATES: 1}))
    assert by["total"].epsilon > max(by[UPDATES].epsilon, by["style"].epsilon)


def test_the_total_with_image_rows_protects_an_image_so_client_level_mechanisms_enter_at_half_z():
    """Every client each round (ADD_OR_REMOVE_ONE): one image moves its client's clipped update, and a
    ``client`` record, by up to 2 clips, its own ``image`` row by 1 clip.  RDP of Gaussians adds as z^-2."""
    p = _privacy(2.0, payloads={"amplitude_spectra": {"clip": 1.0, "noise_multiplier": 3.0},
                                "style": {"clip": 1.0, "noise_multiplier": 4.0}})
    records = {"amplitude_spectra": "image", "style": "client"}
    acc = Accountant(p, 3, 3, records)

    def gaussians(inv_sq: float) -> float:
        return Accountant(_privacy(inv_sq ** -0.5), 3, 3).epsilon({UPDATES: 1})

    by = {r.group: r for r in acc.rows(5, acc.counts(5, {"amplitude_spectra": 1, "style": 5}), 1.0)}
    # each group at its own unit: updates and style per client (z), the spectra per image (z)
    assert by[UPDATES].epsilon == pytest.approx(gaussians(5 / 2.0 ** 2), rel=1e-9)
    assert by["style"].epsilon == pytest.approx(gaussians(5 / 4.0 ** 2), rel=1e-9)
    # the total per image: 5 updates at z/2 = 1, 5 styles at z/2 = 2, one spectrum at z = 3
    assert by["total"].epsilon == pytest.approx(gaussians(5 / 1.0 ** 2 + 5 / 2.0 ** 2 + 1 / 3.0 ** 2), rel=1e-9)
    # without an image row released the total stays per client: 5 at z = 2, 5 at z = 4
    client = {r.group: r for r in acc.rows(5, acc.counts(5, {"style": 5}), 1.0)}
    assert client["total"].epsilon == pytest.approx(gaussians(5 / 2.0 ** 2 + 5 / 4.0 ** 2), rel=1e-9)


def test_the_updates_and_one_image_group_alone_total_per_image():
    """Two groups, one of them image rows: the total protects an image (the updates at z / 2)."""
    p = _privacy(2.0, payloads={"amplitude_spectra": {"clip": 1.0, "noise_multiplier": 3.0}})
    acc = Accountant(p, 3, 3, {"amplitude_spectra": "image"})
    total = acc.epsilon(acc.counts(5, {"amplitude_spectra": 1}))
    assert total == pytest.approx(Accountant(_privacy((5 / 1.0 ** 2 + 1 / 3.0 ** 2) ** -0.5), 3, 3).epsilon(
        {UPDATES: 1}), rel=1e-9)


def test_the_updates_sampling_amplifies_the_updates_only_not_a_payload_group_of_any_name():
    """Sampled clients (m < N: REPLACE_ONE, every multiplier halved): a payload group, named before or after
    ``updates`` in sort order, is noised by the client itself and is not amplified by the sampling."""
    p = _privacy(2.0, payloads={"alpha": {"clip": 1.0, "noise_multiplier": 3.0},
                                "zeta": {"clip": 1.0, "noise_multiplier": 3.0}})
    acc = Accountant(p, num_clients=100, per_round=10)
    for g in ("alpha", "zeta"):
        assert acc.epsilon({UPDATES: 4, g: 5}, [g]) == pytest.approx(_gaussian_rdp_epsilon(1.5, 5, 1e-5), rel=1e-9)
    assert acc.epsilon({UPDATES: 4}, [UPDATES]) < _gaussian_rdp_epsilon(1.0, 4, 1e-5) / 2  # amplified


def test_pld_is_refused_for_sampled_clients_only_and_rdp_calibrates_them_to_its_own_target():
    dp = ("privacy.updates.clip=1", "privacy.updates.noise_multiplier=1")
    check_privacy(tiny_cfg(*dp), num_clients=10, per_round=3, train_samples=1000)  # rdp: Wang et al.'s bound
    check_privacy(tiny_cfg(*dp, "privacy.accountant=pld"), num_clients=3, per_round=3, train_samples=1000)
    with pytest.raises(ConfigError, match="privacy.accountant: pld accounts Poisson sampling only, and the engine "
                                          "samples 3 of 10 clients without replacement"):
        check_privacy(tiny_cfg(*dp, "privacy.accountant=pld"), num_clients=10, per_round=3, train_samples=1000)
    z = Accountant(_privacy(1.0), 100, 10).calibrate(20, 4.0)  # sampled: the event at z / 2, RDP only
    acc = Accountant(_privacy(z), 100, 10)
    assert 4.0 * 0.995 <= acc.epsilon(acc.counts(20, {})) <= 4.0 + 1e-9


def test_the_first_rounds_forecast_counts_the_methods_noised_payloads(tiny_ds):
    """Before round 1 no round has released anything yet: the forecast takes one release of each payload the
    method shares and the config noises, so a budget that round 1's style would exceed stops before it."""
    from rayfed_dg.engine.running.run import FederationRun

    acc = Accountant(_privacy(2.0, payloads={"style": {"clip": 1.0, "noise_multiplier": 1.0}}), 3, 3)
    updates_only, with_style = acc.epsilon({UPDATES: 1}), acc.epsilon({UPDATES: 1, "style": 1})
    cfg = tiny_cfg("method.name=stablefdg", "privacy.updates.clip=1", "privacy.updates.noise_multiplier=2",
                   "privacy.payloads={style: {clip: 1, noise_multiplier: 1}}",
                   f"privacy.target_epsilon={(updates_only + with_style) / 2}")
    split = leave_one_domain_out(tiny_ds, "texture", cfg.data.val_fraction, cfg.data.split_seed)
    run = FederationRun(cfg, split, None)
    assert run.per_round == {"style": 1}
    run._check_budget(0, run._forecast([]))
    assert run.finished and run.res.stopped.startswith(
        f"privacy.target_epsilon={(updates_only + with_style) / 2:g}: stopped before round 1 of 2, which would "
        f"spend epsilon {with_style:.4g}")


# ------------------------------------------------------------------ bad input

@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_what_leaves_a_client_without_noise_makes_epsilon_infinite(accountant):
    acc = Accountant(_privacy(3.0, accountant, payloads={"style": {"clip": 1.0, "noise_multiplier": 3.0}}), 3, 3)
    by = {r.group: r for r in acc.rows(2, acc.counts(2, {"style": 2, "amplitude": 1}), 1.0)}
    assert list(by) == [UPDATES, "amplitude", "style", "total"]  # released but not configured: counted all the same
    assert by["amplitude"].noise_multiplier == 0 and by["amplitude"].clip is None
    assert math.isinf(by["amplitude"].epsilon) and math.isinf(by["total"].epsilon)
    assert math.isfinite(by[UPDATES].epsilon) and math.isfinite(by["style"].epsilon)
    payloads_only = Accountant(PrivacyConfig(accountant=accountant, payloads={"style": {"clip": 1.0,
                                                                                   "noise_multiplier": 3.0}}), 3, 3)
    by = {r.group: r for r in payloads_only.rows(1, payloads_only.counts(1, {"style": 1}), None)}
    assert math.isinf(by[UPDATES].epsilon) and math.isinf(by["total"].epsilon) and math.isfinite(by["style"].epsilon)


def refusal(cls) -> str | None:
    """DP-FedAvg's refusal of method class ``cls`` at its default parameters, its reason alone."""
    why = pipeline_refusal(DPMean, [DPMean], cls.declare(cls.Params()))
    return None if why is None else why.split(f"method {cls.name} ")[1].split("; ")[0]


def test_methods_whose_aggregation_is_not_a_weighted_mean_refuse_dp():
    for name in ("fedavg", "fedprox", "fedbn", "silobn", "gperxan", "stablefdg", "fediir", "mixstyle"):
        assert refusal(get_method_class(name)) is None, name
    why = {n: refusal(get_method_class(n)) for n in ("copa", "csac", "feddyn", "fedgma", "feddg_ga", "scaffold")}
    assert "folds_on_workers" in why["csac"] and "assemble_global" in why["fedgma"]
    assert "aggregation_weights" in why["feddg_ga"] and "aggregation_weights" in why["scaffold"]
    assert all(why.values())

    class ReadsResults(Method):  # a hook no built-in method overrides alone
        def after_round(self, round, results, server_state):
            server_state["seen"] = len(results)

    assert refusal(ReadsResults) == "reads the clients' results on the server (after_round)"


def bad_inputs():
    dp = ["--set", "privacy.updates.clip=1.0", "--set", "privacy.updates.noise_multiplier=1.0"]
    yield [QS, *TINY, "--set", "privacy.updates.noise_multiplier=1.0"], \
        "privacy.updates: Value error, privacy.updates needs a clip norm"
    yield [QS, *TINY, *dp, "--set", "privacy.delta=0.4"], \
        "privacy.delta=0.4 is not below 1 / 3 (the clients, the unit of privacy of the updates)"
    yield [QS, *TINY, "--set", "privacy.payloads={ccst_style: {clip: 1, noise_multiplier: 1}}", "--set",
           "privacy.delta=0.01"], "privacy.delta=0.01 is not below 1 / 1073 (the training samples"
    yield [QS, *TINY, *dp, "--set", "method.name=scaffold"], \
        "privacy.updates: method scaffold weighs clients from their data or its own state (aggregation_weights)"
    yield [QS, *TINY, *dp, "--set", "server.mode=fedbuff"], "privacy.updates: server.mode picks the aggregated clients"
    yield [QS, *TINY, *dp, "--set", "privacy.accountant=pld", "--set", "training.clients_per_round=2"], \
        "privacy.accountant: pld accounts Poisson sampling only"
    yield [QS, *TINY, *dp, "--set", "privacy.updates.adaptive=true"], \
        "privacy.updates.count_noise_multiplier: 2 sigma_b = 0.3 must exceed noise_multiplier 1"
    yield [QS, *TINY, *dp, "--set", "privacy.target_epsilon=1"], \
        "privacy.target_epsilon=1: the 8 rounds of updates alone would spend epsilon"
    yield [QS, *TINY, "--set", "privacy.target_epsilon=4"], \
        "privacy.target_epsilon=4: the model updates leave the clients without noise (no privacy.updates)"
    # a statistic the run shares without noise would leave before any budget check could stop it
    yield [QS, *TINY, *dp, "--set", "privacy.target_epsilon=100", "--set", "method.name=stablefdg"], \
        "privacy.target_epsilon=100: this run shares 'style' without noise"


def test_each_bad_privacy_input_is_one_line_naming_its_key_exit_2_and_writes_nothing(tmp_path, capsys):
    seen = 0
    for argv, expect in bad_inputs():
        run_dir = tmp_path / f"run-{seen}"
        code = main(["run", *argv, "--run-dir", str(run_dir), "--no-progress"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and expect in err[0], (argv, err)
        assert not run_dir.exists()
        seen += 1
    assert seen == 10


def test_check_privacy_refuses_what_a_config_alone_cannot_show():
    cfg = tiny_cfg("privacy.updates.clip=1", "privacy.updates.noise_multiplier=1", "privacy.target_epsilon=8")
    check_privacy(cfg, num_clients=3, per_round=3, train_samples=1000)  # 2 rounds at z = 1: 7.08 <= 8
    with pytest.raises(ConfigError, match=r"would spend epsilon 7\.077"):
        check_privacy(cfg.model_copy(update={"privacy": cfg.privacy.model_copy(update={"target_epsilon": 7.0})}),
                      3, 3, 1000)


def test_check_privacy_boundaries_each_side():
    """Each of check_privacy's bounds at its boundary (refused) and just inside it (accepted)."""
    def dp(*sets, n=4, m=4, samples=1000):
        check_privacy(tiny_cfg("privacy.updates.clip=1", *sets), num_clients=n, per_round=m, train_samples=samples)

    with pytest.raises(ConfigError, match=r"privacy.delta=0.25 is not below 1 / 4 \(the clients"):
        dp("privacy.delta=0.25")
    dp("privacy.delta=0.24")
    dp("privacy.delta=0.05", samples=50)  # the samples' bound is the payloads' only: none here
    # adaptive: 2 sigma_b must exceed z; at 2 sigma_b = z the update noise's multiplier is infinite
    adaptive = ("privacy.updates.adaptive=true", "privacy.updates.noise_multiplier=1")
    with pytest.raises(ConfigError, match="2 sigma_b = 1 must exceed noise_multiplier 1"):
        dp(*adaptive, "privacy.updates.count_noise_multiplier=0.5")
    dp(*adaptive, "privacy.updates.count_noise_multiplier=0.75")
    dp("privacy.updates.adaptive=true", "privacy.updates.noise_multiplier=0",  # no noise: nothing to split
       "privacy.updates.count_noise_multiplier=0")
    with pytest.raises(ConfigError, match="^privacy.updates: devices.enabled picks the aggregated clients on a clock"):
        dp("devices.enabled=true")


def test_check_privacy_payload_bounds_and_the_target_with_every_kind_of_record():
    def check(*sets, n=3, m=3, samples=1000):
        check_privacy(tiny_cfg("privacy.updates.clip=1", "privacy.updates.noise_multiplier=1", *sets),
                      num_clients=n, per_round=m, train_samples=samples)

    style = "privacy.payloads={style: {clip: 1, noise_multiplier: 2}}"
    with pytest.raises(ConfigError, match=r"privacy.delta=0.001 is not below 1 / 1000 \(the training samples"):
        check("method.name=stablefdg", style, "privacy.delta=0.001")
    check("method.name=stablefdg", style, "privacy.delta=0.0009")
    # a target: noised groups of client records and of image rows count as noised; an exact count never is
    noised = ("privacy.target_epsilon=1000", "stages.amplitude={}", "method.name=elcfs")
    check(*noised, "privacy.payloads={amplitude_spectra: {clip: 1, noise_multiplier: 2}}")
    check("privacy.target_epsilon=1000", "method.name=stablefdg", style)
    with pytest.raises(ConfigError, match="this run shares 'fediir_batches' without noise, so epsilon is unbounded "
                                          "from the first release; add privacy.payloads.fediir_batches "):
        check("privacy.target_epsilon=1000", "method.name=fediir")  # two clean groups: the first named, twice
    with pytest.raises(ConfigError, match="shares 'fediir_batches' without noise"):  # counts cannot be noised
        check("privacy.target_epsilon=1000", "method.name=fediir",
              "privacy.payloads={fediir_grad_sum: {clip: 1, noise_multiplier: 2}}")
    # a target the rounds spend exactly is met, not exceeded
    cfg = tiny_cfg("privacy.updates.clip=1", "privacy.updates.noise_multiplier=1", "privacy.target_epsilon=8")
    acc = Accountant(cfg.privacy, 3, 3)
    exact = acc.epsilon(acc.counts(cfg.training.rounds, {}), [UPDATES])
    check_privacy(cfg.model_copy(update={"privacy": cfg.privacy.model_copy(update={"target_epsilon": exact})}),
                  3, 3, 1000)


def test_the_update_noise_multiplier_by_hand_with_and_without_adaptive_clipping():
    def u(z, adaptive):
        return UpdatePrivacyConfig(clip=1.0, noise_multiplier=z, adaptive=adaptive,
                                   count_noise_multiplier=0.75 if adaptive else None)

    assert update_noise(u(0.0, True), 4) == 0.0  # no noise to split
    assert update_noise(u(1.0, False), 4) == 1.0
    assert update_noise(u(1.0, True), 4) == pytest.approx((1.0 - 1.5 ** -2) ** -0.5)  # z_Delta = 1.3416...


def test_calibrate_prints_the_multiplier_that_spends_the_target(capsys):
    # epsilon 6 (z = 2.302414...): rounding to the nearest 4th decimal would go down, past the target
    assert main(["privacy", "calibrate", QS, *TINY, "--epsilon", "6"]) == 0
    out = capsys.readouterr()
    key, _, z = out.out.strip().partition("=")
    assert key == "privacy.updates.noise_multiplier" and "over 8 rounds of 3 of 3 clients" in out.err
    acc = Accountant(_privacy(float(z)), 3, 3)
    # z rounded up to 4 decimals: at most the target, within the search's tolerance
    assert z == "2.3025" and 6.0 - 2e-3 <= acc.epsilon(acc.counts(8, {})) <= 6.0


# ------------------------------------------------------------------ end to end (tiny digits runs)

def _clipped_by_hand(update: dict, g0: dict, keys: list[str], clip: float) -> tuple[dict, bool]:
    delta = {k: update[k].astype(np.float64) - g0[k].astype(np.float64) for k in keys}
    norm = math.sqrt(sum(float(np.sum(d * d)) for d in delta.values()))
    return {k: d * min(1.0, clip / norm) for k, d in delta.items()}, norm <= clip


def test_dp_fedavg_end_to_end_by_hand_same_bits_on_one_or_two_workers_and_after_a_resume(ray_session, tiny_ds,
                                                                                       engine_host):
    ray = ray_session
    cfg = tiny_cfg("training.local_steps=2", "privacy.updates.clip=0.3", "privacy.updates.noise_multiplier=0.8",
                   "privacy.updates.adaptive=true", "privacy.updates.count_noise_multiplier=1.0")
    split = leave_one_domain_out(tiny_ds, "texture", cfg.data.val_fraction, cfg.data.split_seed)
    runs = {}
    for workers in (1, 2):
        server = engine_host(tiny_ds, workers).open(cfg, split, tiny_ds.num_classes)
        g0 = ray.get(server.get_state.remote())["global_state"]
        clips = [ray.get(server.run_round.remote()).dp_clip]
        s1 = ray.get(server.get_state.remote())
        clips.append(ray.get(server.run_round.remote()).dp_clip)
        runs[workers] = g0, s1, ray.get(server.get_state.remote(None, False))["global_state"], clips
    (g0, s1, g2, clips), (_, _, g2b, clipsb) = runs[1], runs[2]
    assert clips == clipsb and clips[0] == 0.3 and s1["dp_clip"] == clips[1] != 0.3
    for k in g2:
        np.testing.assert_array_equal(g2[k], g2b[k])
    # round 1 by hand: each client's update clipped, the noise of std z_Delta x clip on the sum, over m = 3
    runner = ClientRunner(cfg, tiny_ds.images, tiny_ds.labels, tiny_ds.num_classes, split.num_clients)
    keys = sorted(k for k, v in g0.items() if np.issubdtype(v.dtype, np.floating))
    parts = [_clipped_by_hand(runner.run_client(c, 1, split.clients[c], g0).update, g0, keys, 0.3)
             for c in range(split.num_clients)]
    z_delta = (0.8 ** -2 - 2.0 ** -2) ** -0.5
    noise = numpy_rng(cfg.training.seed, Stream.DP_UPDATES, 1)
    for k in keys:
        total = sum(p[0][k] for p in parts) + noise.normal(0.0, z_delta * 0.3, size=g0[k].shape)
        np.testing.assert_allclose(s1["global_state"][k], (g0[k] + total / 3).astype(np.float32), rtol=1e-6,
                                   atol=1e-7)
    tracked = [k for k in g0 if k.endswith("num_batches_tracked")]
    assert tracked and all(s1["global_state"][k] == g0[k] for k in tracked)  # integer buffers are not released
    unclipped = sum(p[1] for p in parts)
    xi = numpy_rng(cfg.training.seed, Stream.DP_UPDATES, 1, 1).normal(0.0, 1.0)
    assert clips[1] == pytest.approx(0.3 * math.exp(-0.2 * ((unclipped - 1.5 + xi) / 3 + 0.5 - 0.5)), rel=1e-12)
    # a federation resumed from round 1's state ends round 2 with the same bits (the clip came with the state)
    server = engine_host(tiny_ds, 1).open(cfg, split, tiny_ds.num_classes)
    ray.get(server.set_state.remote(s1))
    assert ray.get(server.run_round.remote()).dp_clip == clips[1]
    g2r = ray.get(server.get_state.remote(None, False))["global_state"]
    for k in g2:
        np.testing.assert_array_equal(g2[k], g2r[k])


def test_a_target_epsilon_stops_before_the_round_that_would_exceed_it(ray_session, tiny_ds, engine_host, tmp_path,
                                                                     capsys):
    z = 2.0
    acc = Accountant(_privacy(z), 3, 3)
    eps2, eps3 = (acc.epsilon(acc.counts(r, {})) for r in (2, 3))
    target = (eps2 + eps3) / 2
    sets = ("training.rounds=4", "training.local_steps=1", "privacy.updates.clip=1", f"privacy.updates.noise_multiplier={z}",
            f"privacy.target_epsilon={target}")
    cfg = tiny_cfg(*sets)
    split = leave_one_domain_out(tiny_ds, "texture", cfg.data.val_fraction, cfg.data.split_seed)
    run_dir = tmp_path / "run"
    res = run_federation(cfg, split, None, None, tiny_ds.num_classes, run_dir=run_dir, progress=False,
                         host=engine_host(tiny_ds, 1))
    line = f"privacy.target_epsilon={target:g}: stopped before round 3 of 4, which would spend epsilon {eps3:.4g}"
    assert res.rounds_done == 2 and res.stopped.startswith(line)
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"rayfed-dg: target texture: {res.stopped}"
    assert res.epsilon == {UPDATES: pytest.approx(eps2, rel=1e-12), "total": pytest.approx(eps2, rel=1e-12)}
    rows = RunDir(run_dir).read_rows("privacy")
    assert [(r["round"], r["group"], r["releases"]) for r in rows] == \
        [(1, "updates", 1), (1, "total", 1), (2, "updates", 2), (2, "total", 2)]
    assert RunDir(run_dir).weights("final", "texture").is_file()  # what was done is kept
    assert RunDir(run_dir).saved_rounds("texture")[-1] == 2
    # resumed, it stops again at once: the stop is part of the checkpoint
    again = run_federation(cfg, split, None, None, tiny_ds.num_classes, run_dir=run_dir, progress=False,
                           host=engine_host(tiny_ds, 1))
    assert again.rounds_done == 2 and again.stopped == res.stopped
    # a run without privacy writes no privacy table; a privacy section without a mechanism changes no number
    # and records its updates as unprotected
    out = {}
    for name, extra in (("plain", ()), ("accounted", ("privacy.delta=1e-6",))):
        out[name] = run_federation(tiny_cfg("training.rounds=1", "training.local_steps=1", *extra), split, None, None,
                                   tiny_ds.num_classes, run_dir=tmp_path / name, progress=False,
                                   host=engine_host(tiny_ds, 1))
    assert not RunDir(tmp_path / "plain").has_table("privacy") and "epsilon" not in out["plain"].summary()
    assert out["plain"].metrics == out["accounted"].metrics and out["plain"].ledger == out["accounted"].ledger
    assert out["accounted"].epsilon == {UPDATES: math.inf, "total": math.inf}


def test_report_shows_the_epsilon_each_run_spent(tmp_path):
    from rayfed_dg.engine.store.records import PrivacyRow

    def run(folder, eps):
        rd = RunDir(tmp_path / folder)
        rd.path.mkdir()
        (rd.path / "summary.json").write_text('{"targets": {"mono": {}}, "label": "fedavg", "method": "fedavg"}')
        for r, e in ((1, eps / 2), (2, eps)):
            rd.write_rows("privacy", "mono", r, [dict(PrivacyRow(r, g, r, 1.0, 1.0, e, 1e-5).row(), target="mono")
                                                 for g in ("updates", "total")])
    run("seed0", 3.0)
    run("seed1", 4.0)
    table = privacy_table([tmp_path / "seed0", tmp_path / "seed1"], "md").splitlines()
    assert table[0] == "| method | target | seeds | rounds | delta | updates | total |"
    assert table[2] == "| fedavg | mono | 2 | 2 | 1e-05 | 4 | 4 |"  # the last round's, the largest over seeds
