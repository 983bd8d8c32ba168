"""DP for the statistics clients share (engine/privacy/payloads.py): each record clipped, noise
of std z x clip seeded by (seed, round, client, group), unconfigured groups untouched, undeclared and integer groups
refused, and through the engine the server computing from the noised statistics only (StableFDG's style exchange,
CCST's style bank)."""
import hashlib
import zlib

import numpy as np
import pytest
from conftest import tiny_cfg

from rayfed_dg.config import PrivacyConfig
from rayfed_dg.engine.privacy.payloads import privatize, release
from rayfed_dg.errors import ConfigError
from rayfed_dg.methods.payloads import check_payload_groups, released_payload_groups


def _privacy(**groups) -> PrivacyConfig:
    return PrivacyConfig(payloads={g: {"clip": c, "noise_multiplier": z} for g, (c, z) in groups.items()})


def _noise(seed, rnd, client, group, shape, std):
    """The noise by hand: numpy's Generator on SeedSequence([seed, DP_PAYLOAD = 22, round, client, crc32(group)])."""
    words = [seed, 22, rnd, client, zlib.crc32(group.encode())]
    return np.random.default_rng(np.random.SeedSequence(words)).normal(0.0, std, size=shape)


def test_each_record_is_clipped_to_the_clip_norm():
    rng = np.random.default_rng(0)
    x = np.array([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0]], np.float32)
    # image records: row by row; a row under the clip is left as it is
    np.testing.assert_allclose(privatize(x, "image", 1.0, 0.0, rng), [[0.6, 0.8], [0.3, 0.4], [0, 0]], rtol=1e-6)
    # a client record: the whole array as one vector, norm sqrt(25 + 0.25) scaled to 1
    whole = privatize(x, "client", 1.0, 0.0, rng)
    np.testing.assert_allclose(whole, x / np.sqrt(25.25), rtol=1e-6)
    big = np.random.default_rng(1).normal(0, 5, size=(50, 3, 4, 4)).astype(np.float32)
    rows = privatize(big, "image", 2.5, 0.0, rng)
    assert rows.dtype == np.float32 and rows.shape == big.shape
    assert np.all(np.linalg.norm(rows.reshape(50, -1), axis=1) <= 2.5 * (1 + 1e-6))


def test_noise_std_is_z_times_clip_on_a_seeded_draw():
    n, clip, z = 200_000, 2.0, 1.5
    out = release({"g": np.zeros(n)}, {"g": "client"}, _privacy(g=(clip, z)), 7, 3, 1, "test")["g"]
    sigma = z * clip
    # the sample std of n normal draws has a standard error sigma / sqrt(2 n); the mean sigma / sqrt(n): 4 of each
    assert abs(out.std() - sigma) < 4 * sigma / np.sqrt(2 * n)
    assert abs(out.mean()) < 4 * sigma / np.sqrt(n)


def test_noise_is_seeded_by_round_client_and_group_and_added_to_the_clipped_records():
    x = {"a": np.full((2, 3), 2.0, np.float32), "b": np.ones(4)}
    declared, p = {"a": "image", "b": "client"}, _privacy(a=(1.0, 0.7), b=(3.0, 0.2))
    out = release(x, declared, p, 5, 2, 4, "test")
    clipped_a = np.full((2, 3), 2.0 * (1.0 / np.sqrt(12.0)))  # each row (2, 2, 2) to norm 1
    expect_a = clipped_a + _noise(5, 2, 4, "a", (2, 3), 0.7)
    np.testing.assert_array_equal(out["a"], expect_a.astype(np.float32))  # rounded to float32 once
    assert out["a"].dtype == np.float32 and out["b"].dtype == np.float64  # the bytes the ledger counts are kept
    np.testing.assert_array_equal(out["b"], np.ones(4) + _noise(5, 2, 4, "b", (4,), 0.2 * 3.0))  # norm 2 < 3: unclipped
    # the same draw whatever else is in the payload or its order; another round, client or seed, another one
    alone = release({"a": x["a"]}, declared, p, 5, 2, 4, "test")["a"]
    assert np.array_equal(alone, out["a"])
    for other in ((5, 3, 4), (5, 2, 5), (6, 2, 4)):
        assert not np.allclose(release(x, declared, p, *other, "test")["a"], out["a"])


def test_groups_not_configured_leave_the_client_untouched():
    x = {"a": np.arange(4.0), "b": np.arange(3.0)}
    out = release(x, {"a": "client", "b": "client"}, _privacy(a=(1.0, 1.0)), 0, 1, 0, "test")
    assert out["b"] is x["b"]  # the very array: no copy, no cast
    off = release(x, {"a": "client", "b": "client"}, None, 0, 1, 0, "test")
    assert all(off[k] is x[k] for k in x)
    assert not np.array_equal(out["a"], x["a"])


def test_a_non_finite_payload_stops_the_run_as_a_diverged_client():
    from rayfed_dg.engine.workers.faults import DivergedError

    with pytest.raises(DivergedError, match="client 3's payload 'style' in round 2 is not finite"):
        release({"style": np.array([1.0, np.nan])}, {"style": "client"}, None, 0, 2, 3, "method m")
    assert release({"n": np.array([1, 2])}, {"n": "exact"}, None, 0, 2, 3, "method m")["n"].dtype.kind == "i"


def test_a_payload_its_owner_does_not_declare_is_refused_under_privacy():
    with pytest.raises(TypeError, match="method m sends the payload 'x' that its shared_payloads does not declare"):
        release({"x": np.ones(2)}, {}, _privacy(), 0, 1, 0, "method m")
    # several undeclared: the first in name order, in what was wrong and in what to add
    with pytest.raises(TypeError, match="payload 'a' that .* does not declare; add 'a': one of"):
        release({"b": np.ones(2), "a": np.ones(2), "c": np.ones(2)}, {"c": "client"}, _privacy(), 0, 1, 0, "method m")
    x = np.ones(2)  # without privacy a plugin that predates the declarations still runs, its payload untouched
    assert release({"x": x}, {}, None, 0, 1, 0, "method m")["x"] is x


def test_privatize_refuses_an_integer_payload_and_an_unknown_record_each_alone():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="records 'image' and dtype int64 cannot be clipped"):
        privatize(np.arange(4, dtype=np.int64).reshape(2, 2), "image", 1.0, 1.0, rng)
    with pytest.raises(ValueError, match="records 'exact' and dtype float32 cannot be clipped"):
        privatize(np.ones(4, np.float32), "exact", 1.0, 1.0, rng)


def test_integer_and_unknown_payload_groups_are_refused_in_one_line():
    def check(*sets):
        check_payload_groups(tiny_cfg(*sets))

    with pytest.raises(ConfigError) as e:
        check("method.name=fedgma", "privacy={payloads: {fedgma_sign: {clip: 1, noise_multiplier: 1}}}")
    assert "privacy.payloads.fedgma_sign" in str(e.value) and "integers" in str(e.value)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="privacy.payloads.styel: no method or data stage shares a payload 'styel'; "
                                          "did you mean 'style'"):
        check("method.name=stablefdg", "privacy={payloads: {styel: {clip: 1, noise_multiplier: 1}}}")
    # a group some compare row releases is fine on a row that does not (it noises nothing there)
    check("method.name=fedavg", "privacy={payloads: {style: {clip: 1, noise_multiplier: 1}}}")


def test_released_payload_groups_say_what_one_record_is():
    assert released_payload_groups(tiny_cfg()) == {}
    assert released_payload_groups(tiny_cfg("method.name=stablefdg")) == {"style": "client"}
    assert released_payload_groups(tiny_cfg("method.name=fediir")) == {"fediir_grad_sum": "client",
                                                                       "fediir_batches": "exact"}
    assert released_payload_groups(tiny_cfg("method.name=elcfs", "stages.amplitude={}")) == {
        "amplitude_spectra": "image"}
    assert released_payload_groups(tiny_cfg("stages.ccst={style: single}")) == {"ccst_style": "image"}
    assert released_payload_groups(tiny_cfg("stages.ccst={}")) == {"ccst_style": "client"}


# ------------------------------------------------------------------ through the engine

STYLE = ["method.name=stablefdg", "method.attention=false", "method.shift_p=1.0", "training.local_steps=2",
         "training.rounds=1", "evaluation.every=0"]
STYLE_DP = "privacy={payloads: {style: {clip: 1.0, noise_multiplier: 0.5}}}"


def _round_one(engine_host, ds, split, cfg, workers):
    import ray

    server = engine_host(ds, workers).open(cfg, split, 10)
    out = ray.get(server.run_round.remote())
    return out, ray.get(server.get_state.remote())["global_state"]


def test_stablefdg_exchanges_only_the_noised_styles_with_any_worker_count(ray_session, tiny_ds, engine_host):
    """Round 1 through the engine with DP on ``style``: what the server aggregates is exactly what the clients
    train when each receives a peer's clean style clipped to 1 plus the seeded noise (std 0.5) recomputed here, not
    its clean style; 1 and 2 workers give the same bits; a privacy section that configures no group StableFDG
    sends changes no bit of the run."""
    import dataclasses

    from rayfed_dg.data import leave_one_domain_out
    from rayfed_dg.engine import ClientRunner, ClientTask
    from rayfed_dg.engine.workers.worker import to_numpy_state
    from rayfed_dg.methods.stablefdg import assign_styles
    from rayfed_dg.seeding import Stream, numpy_rng

    ds = tiny_ds
    split = leave_one_domain_out(ds, "mono", 0.2, 0)
    split = dataclasses.replace(split, clients=[c[:64] for c in split.clients])
    cfg = tiny_cfg(*STYLE, STYLE_DP)
    out, g1 = _round_one(engine_host, ds, split, cfg, 2)
    _, g1_one = _round_one(engine_host, ds, split, cfg, 1)
    assert all(np.array_equal(g1[k], g1_one[k]) for k in g1)
    up = sorted((r.client, r.bytes) for r in out.ledger if r.group == "prepare:style")
    assert up == [(c, 4 * 8 * 4) for c in range(3)]  # the noised style: the clean one's float32 bytes

    clean_cfg = tiny_cfg(*STYLE)
    runner = ClientRunner(clean_cfg, ds.images, ds.labels, 10, 3)
    g0 = to_numpy_state(runner.model.state_dict(), runner.model.state_dict().keys())  # the server's initial model
    sampled = out.sampled
    clean = {c: runner.prepare(ClientTask(client=c, round=1, indices=split.clients[c], local_state={}), g0)["style"]
             for c in sampled}
    assert all(np.linalg.norm(clean[c]) > 1.0 for c in sampled)  # the clip binds
    noised = {c: (clean[c].astype(np.float64) * (1.0 / np.linalg.norm(clean[c].astype(np.float64)))
                  + _noise(0, 1, c, "style", clean[c].shape, 0.5)).astype(np.float32) for c in sampled}
    given = assign_styles(sampled, sampled, 1, numpy_rng(0, Stream.PAYLOAD, 1))
    n = split.client_sizes()[sampled].astype(np.float64)

    def aggregate(styles):
        ups = [runner.run_client(c, 1, split.clients[c], g0, {}, {"styles": styles[given[c][0]][None]}).update
               for c in sampled]
        return sum(w * u["head.weight"].astype(np.float64) for w, u in zip(n, ups)) / n.sum()

    np.testing.assert_allclose(g1["head.weight"], aggregate(noised).astype(np.float32), rtol=1e-5, atol=1e-6)
    assert not np.allclose(g1["head.weight"], aggregate(clean).astype(np.float32), rtol=1e-5, atol=1e-6)

    _, plain = _round_one(engine_host, ds, split, clean_cfg, 1)
    _, other = _round_one(engine_host, ds, split, tiny_cfg(
        *STYLE, "privacy={payloads: {ccst_style: {clip: 0.1, noise_multiplier: 9}}}"), 1)
    assert all(np.array_equal(plain[k], other[k]) for k in plain)
    assert not all(np.array_equal(plain[k], g1[k]) for k in plain)


def test_ccst_bank_holds_the_noised_styles_only(ray_session, tiny_ds, engine_host, tmp_path):
    """CCST's stage with DP on ``ccst_style``: every client restyles its images with exactly the bank rows that
    the clean styles clipped to 5 plus the seeded noise (round 0) give, named in the stylization cache by their
    bytes, and never with a clean row."""
    import dataclasses

    import ray
    import torch

    from rayfed_dg.data import leave_one_domain_out
    from rayfed_dg.stages import StageClient, build_stages
    from rayfed_dg.stages.ccst import CACHE_VERSION, _digest

    cfg = tiny_cfg("stages.ccst={k: 3, work_size: 32, cache_dir: " + str(tmp_path) + "}", "training.rounds=1",
                   "privacy={payloads: {ccst_style: {clip: 5.0, noise_multiplier: 0.2}}}")
    split = leave_one_domain_out(tiny_ds, "colour", 0.2, 0)
    split = dataclasses.replace(split, clients=[c[:2] for c in split.clients])
    info = ray.get(engine_host(tiny_ds, 1).open(cfg, split, 10).setup.remote())
    ups = sorted((r.client, r.direction, r.bytes) for r in info["ledger"] if r.group == "payload:ccst_style")
    assert ups == [(c, "up", 400) for c in range(3)]

    stage = build_stages(cfg)[0]
    view = StageClient(images=tiny_ds.images, labels=tiny_ds.labels, device=torch.device("cpu"), threads=1, seed=0,
                       resolution=16)
    clean = [stage.client_style(view, c, split.clients[c]) for c in range(3)]  # the stage's phase, not released
    assert all(np.linalg.norm(s) > 5.0 for s in clean)  # the clip binds
    noised = [(s.astype(np.float64) * (5.0 / np.linalg.norm(s.astype(np.float64)))
               + _noise(0, 0, c, "ccst_style", s.shape, 1.0)).astype(np.float32) for c, s in enumerate(clean)]
    fingerprint = stage.backend(view).fingerprint()

    def names(bank):  # the cache files of client c restyled with bank row r != c (K = 3 of 3 clients: all of them)
        out = set()
        for c in range(3):
            for r in range(3):
                if r != c:
                    h = hashlib.sha256()
                    for part in (CACHE_VERSION, fingerprint, "overall"):
                        h.update(part.encode() + b"|")
                    h.update(np.ascontiguousarray(bank[r][0], np.float32).tobytes())
                    h.update(_digest(tiny_ds.images[split.clients[c]]))
                    out.add(f"{h.hexdigest()[:32]}.npz")
        return out

    written = {p.name for p in tmp_path.glob("*.npz")}  # (the cache's .locks folder beside them)
    assert written == names(noised)
    assert not written & names(clean)
