"""data.augment: DomainBed's augmentation on tensors, by hand on tiny tensors,
seeded only by the client's generator, the same on every worker."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchvision.transforms.v2.functional as TF
from conftest import tiny_cfg

from rayfed_dg.data import augment as A
from rayfed_dg.engine import ClientRunner


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_grayscale_weights_by_hand():
    x = torch.tensor([[1.0, 0, 0], [0, 1, 0], [0, 0, 1], [0.5, 0.2, 0.1]]).view(4, 3, 1, 1)
    got = A.grayscale(x).flatten().tolist()
    assert got == pytest.approx([0.2989, 0.587, 0.114, 0.5 * 0.2989 + 0.2 * 0.587 + 0.1 * 0.114], abs=1e-7)


def test_brightness_contrast_saturation_by_hand():
    # one image of two pixels: (0.5, 0.2, 0.1) and (0.1, 0.4, 0.9)
    x = torch.tensor([[0.5, 0.1], [0.2, 0.4], [0.1, 0.9]]).view(1, 3, 1, 2)
    f = torch.tensor([1.3])
    assert A.adjust_brightness(x, f).flatten().tolist() == pytest.approx([0.65, 0.13, 0.26, 0.52, 0.13, 1.0])
    gray = [0.2989 * r + 0.587 * g + 0.114 * b for r, g, b in ((0.5, 0.2, 0.1), (0.1, 0.4, 0.9))]
    mean = sum(gray) / 2  # contrast blends with the image's mean luma
    want = [min(1.0, max(0.0, 1.3 * v + (1 - 1.3) * mean)) for v in (0.5, 0.1, 0.2, 0.4, 0.1, 0.9)]
    assert A.adjust_contrast(x, f).flatten().tolist() == pytest.approx(want, abs=1e-6)
    f = torch.tensor([0.7])  # saturation blends each pixel with its own luma
    want = [0.7 * v + 0.3 * gray[i % 2] for i, v in enumerate((0.5, 0.1, 0.2, 0.4, 0.1, 0.9))]
    assert A.adjust_saturation(x, f).flatten().tolist() == pytest.approx(want, abs=1e-6)


def test_hue_by_hand_and_against_torchvision():
    red_green_blue = torch.eye(3).view(3, 3, 1, 1)
    shifted = A.adjust_hue(red_green_blue, torch.full((3,), 1 / 3))  # a third of the circle: r->g->b->r
    assert torch.allclose(shifted.view(3, 3), torch.tensor([[0.0, 1, 0], [0, 0, 1], [1, 0, 0]]), atol=1e-6)
    x = torch.rand(5, 3, 4, 4, generator=gen(1))
    h = torch.tensor([-0.3, -0.1, 0.0, 0.2, 0.3])
    f = torch.tensor([0.7, 0.9, 1.0, 1.1, 1.3])
    for i in range(5):
        xi = x[i:i + 1]
        assert torch.allclose(A.adjust_hue(xi, h[i:i + 1]), TF.adjust_hue(xi, float(h[i])), atol=1e-5)
        assert torch.allclose(A.adjust_contrast(xi, f[i:i + 1]), TF.adjust_contrast(xi, float(f[i])), atol=1e-6)
        assert torch.allclose(A.adjust_saturation(xi, f[i:i + 1]), TF.adjust_saturation(xi, float(f[i])), atol=1e-6)
        assert torch.allclose(A.adjust_brightness(xi, f[i:i + 1]), TF.adjust_brightness(xi, float(f[i])), atol=1e-6)


def test_flip_mode_by_hand():
    x = torch.arange(8 * 3 * 3 * 3, dtype=torch.float32).view(8, 3, 3, 3) / 216
    flips = torch.rand(8, generator=gen(5)) < 0.5  # what the mode draws
    assert flips.any() and not flips.all()
    out = A.augment(x.clone(), "flip", gen(5), 3)
    for i in range(8):
        assert torch.equal(out[i], x[i].flip(-1) if flips[i] else x[i])


def test_crop_boxes_follow_random_resized_crop():
    b = A.crop_boxes(4000, 37, 37, gen(2))
    top, left, h, w = b.double().unbind(1)
    assert (top >= 0).all() and (left >= 0).all() and (top + h <= 37).all() and (left + w <= 37).all()
    area = h * w / 37 ** 2
    assert area.min() >= 0.66 and area.max() <= 1.0  # scale (0.7, 1) up to rounding the sides
    assert area.min() < 0.72 and area.max() > 0.95  # and it spans that range
    ratio = w / h
    assert ratio.min() >= 0.7 and ratio.max() <= 1.4 and ratio.min() < 0.8 and ratio.max() > 1.25
    assert torch.equal(b, A.crop_boxes(4000, 37, 37, gen(2)))  # seeded
    # no draw can fit (area > the image): torchvision's fallback, the whole (square) image
    assert A.crop_boxes(3, 10, 10, gen(0), scale=(2.0, 3.0)).tolist() == [[0, 0, 10, 10]] * 3


@pytest.mark.parametrize("box", [(3, 5, 20, 27), (0, 0, 37, 37), (10, 2, 9, 12)])
def test_resized_crop_equals_interpolating_the_crop(box):
    x = torch.rand(2, 3, 37, 37, generator=gen(3))
    t, l, h, w = box
    got = A.resized_crop(x, torch.tensor([box, box]), 32)
    want = F.interpolate(x[:, :, t:t + h, l:l + w], size=(32, 32), mode="bilinear", align_corners=False)
    assert got.shape == (2, 3, 32, 32) and torch.allclose(got, want, atol=1e-5)


def test_domainbed_output_size_range_determinism_and_no_global_rng():
    x = torch.rand(64, 3, 37, 37, generator=gen(4))
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a = A.augment(x, "domainbed", gen(7), 32)
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG was not touched
    assert a.shape == (64, 3, 32, 32) and a.min() >= 0 and a.max() <= 1
    assert torch.equal(a, A.augment(x, "domainbed", gen(7), 32))  # same seed, same batch
    assert not torch.allclose(a, A.augment(x, "domainbed", gen(8), 32))
    gray = (a[:, 0] == a[:, 1]).flatten(1).all(1) & (a[:, 1] == a[:, 2]).flatten(1).all(1)
    assert 1 <= int(gray.sum()) <= 16  # RandomGrayscale(0.1) of 64 images
    assert A.augment(x, "domainbed", None, 32).shape == (64, 3, 32, 32)  # evaluation: resized only


def test_worker_batches_are_the_same_on_any_worker_and_sized_to_the_resolution(tiny_ds):
    from rayfed_dg.data import load_dataset

    cfg = tiny_cfg("data.augment=domainbed", "training.local_steps=3")
    assert cfg.data.decode_size == 18  # 16 * 8/7
    ds = load_dataset("embedded_digits", None, cfg.data.decode_size)
    idx = np.arange(0, 200)
    batches = []
    for _ in range(2):  # two workers (runners) given the same client and round
        runner = ClientRunner(cfg, ds.images, ds.labels, 10, 3)
        batches.append([x for x, _ in runner.batches(idx, gen(11))])
    assert len(batches[0]) == 3 and all(b.shape == (32, 3, 16, 16) for b in batches[0])
    assert all(torch.equal(p, q) for p, q in zip(*batches))
    x_eval, _ = runner._tensors(idx[:8], None)  # evaluation: the decoded image resized, not cropped
    assert x_eval.shape == (8, 3, 16, 16)
