"""Every method's defaults and the range of each of its parameters, written out by hand.

A user who runs a method without setting its parameters gets these values, and the papers' tables are compared
with runs at them; a value outside a range is refused at load time, one line naming the parameter.  Both are
contracts that no training test pins (a default changed from 0.01 to 1.01, or a bound widened from 1 to 2, passes
every value test, which set their parameters explicitly: found by bench/mutation.py).  Changing one here is a
deliberate edit with its source.
"""
from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from rayfed_dg.config import ConfigError, load_config
from rayfed_dg.methods import get_method_class, method_names

DEFAULTS = {
    "copa": {"lam": 1.0, "norm": "ibn", "ensemble": "prob"},
    "csac": {"lam": 0.6, "pretrain_steps": 1800, "aggregation": "l2"},  # the paper's lambda and its code's steps
    "dson": {"lam": 0.5, "placement": "all", "personalize": True},
    "dsu": {"p": 0.5, "blocks": ["conv1", "stem", "block1", "block2", "block3", "block4"]},  # DSU's code
    "elcfs": {"band": 0.1, "meta_step": 0.001, "clip": 100.0},  # the reference functions' L, beta, c
    "fedadg": {"alpha": 0.85, "label_smoothing": 0.1, "label_scale": 0.7, "warmup_fraction": 0.3,
               "adv_lr": 0.007, "noise_dim": 2048, "gen_hidden": 4096, "rp_size": 1024, "disc_hidden": 1024},
    "fedavg": {},
    "fedbn": {},
    "feddg_ga": {"step_size": 0.2, "metric": "loss", "val_samples": None},  # the paper's d = 0.2, loss gap
    "feddyn": {"alpha": 0.01},
    # lambda2: auto = 1 / (pooled features), docs/results/defaults.md; the paper's 4.0 is one option away
    "fedfd": {"base": "silobn", "lambda1": 0.1, "lambda2": "auto", "u_low": 0.0, "u_high": 1.0, "u_fixed": None,
              "inference": "auto", "select_every": None, "select_samples": None},  # FedFD-A's Sec. 5 setting
    "fedfda": {"base": "silobn", "lambda1": 0.1, "lambda2": "auto", "u_low": 0.0, "u_high": 1.0, "u_fixed": None,
               "inference": "auto", "select_every": None, "select_samples": None},
    "fedgma": {"mask_threshold": 0.4, "step_size": 1.0},  # the paper's tau = 0.4, eta = 1
    "fediir": {"penalty": 0.001, "ema": 0.95, "grad_batches": 0},  # the reference's PACS penalty and EMA
    "fedprox": {"mu": 0.01},  # CCST's reference value
    # SAM's default radius; FedLGF's terms off, its README's perturbation
    "fedsam": {"rho": 0.05, "local_flatness": 0.0, "global_flatness": 0.0, "perturb": "singular",
               "perturb_dist": "normal", "perturb_init": 10.0, "perturb_grad": 0.1},
    "fedsr": {"z_dim": 512, "l2r": 0.01, "cmi": 0.001, "eval_samples": 20},
    "gperxan": {"lam": 0.5, "norm": "xan", "personalize": True, "placement": "auto", "bn_weight": "auto"},
    "mixstyle": {"p": 0.5, "blocks": ["block1", "block2", "block3"], "alpha": 0.1},  # MixStyle's paper
    "moon": {"mu": 1.0, "tau": 0.5, "out_dim": 256, "projection_head": True},  # MOON's reference code
    "rsc": {"spatial_drop": 1 / 3, "channel_drop": 1 / 3.2, "batch_drop": 1 / 3, "spatial_p": 0.5},  # RSC's code
    "scaffold": {},
    "silobn": {},
    "stablefdg": {"style": True, "attention": True, "shift_p": 0.5, "selection": "kmeans++",
                  "oversample": "balanced", "oversample_size": None, "alpha": 3.0, "detach_explored": True,
                  "explore_p": 0.5, "mix_alpha": 0.1, "styles_per_client": 1, "attention_dim": 30,
                  "attention_scores": "cosine", "style_samples": None},
}

# "[a, b]", "(a, b)", "[a, b)": an interval; ">= a", "> a": a lower bound; "int >= a": an integer one
RANGES = {
    "copa.lam": ">= 0", "csac.lam": ">= 0", "csac.pretrain_steps": "int >= 1", "dson.lam": "[0, 1]",
    "dsu.p": "[0, 1]", "elcfs.band": "[0, 0.5]", "elcfs.meta_step": "> 0", "elcfs.clip": "> 0",
    "fedadg.alpha": "[0, 1]", "fedadg.label_smoothing": "[0, 1)", "fedadg.label_scale": "> 0",
    "fedadg.warmup_fraction": "[0, 1]", "fedadg.adv_lr": "> 0", "fedadg.noise_dim": "int >= 1",
    "fedadg.gen_hidden": "int >= 1", "fedadg.rp_size": "int >= 1", "fedadg.disc_hidden": "int >= 1",
    "feddg_ga.step_size": "(0, 1)", "feddg_ga.val_samples": "int >= 1", "feddyn.alpha": "> 0",
    "fedfd.lambda1": "[0, 1]", "fedfd.select_every": "int >= 1",
    "fedfd.select_samples": "int >= 1", "fedfda.lambda1": "[0, 1]",
    "fedfda.select_every": "int >= 1", "fedfda.select_samples": "int >= 1", "fedgma.mask_threshold": "[0, 1]",
    "fedgma.step_size": "> 0", "fediir.penalty": ">= 0", "fediir.ema": "[0, 1)", "fediir.grad_batches": "int >= 0",
    "fedprox.mu": ">= 0", "fedsam.rho": ">= 0", "fedsam.local_flatness": ">= 0", "fedsam.global_flatness": ">= 0",
    "fedsam.perturb_init": "> 0", "fedsam.perturb_grad": "> 0", "fedsr.z_dim": "int >= 1", "fedsr.l2r": ">= 0",
    "fedsr.cmi": ">= 0",
    "fedsr.eval_samples": "int >= 1", "gperxan.lam": "[0, 1]", "mixstyle.p": "[0, 1]", "mixstyle.alpha": "> 0",
    "moon.mu": ">= 0", "moon.tau": "> 0", "moon.out_dim": "int >= 1", "rsc.spatial_drop": "(0, 1)",
    "rsc.channel_drop": "(0, 1)", "rsc.batch_drop": "[0, 1]", "rsc.spatial_p": "[0, 1]",
    "stablefdg.shift_p": "[0, 1]", "stablefdg.oversample_size": "int >= 1", "stablefdg.alpha": ">= 0",
    "stablefdg.explore_p": "[0, 1]", "stablefdg.mix_alpha": "> 0", "stablefdg.styles_per_client": "int >= 1",
    "stablefdg.attention_dim": "int >= 1", "stablefdg.style_samples": "int >= 2",
}


def edges(spec: str) -> tuple[list, list]:
    """(values a range accepts at its edges, values just outside it it refuses)."""
    if spec.startswith("int >= "):
        a = int(spec[7:])
        return [a], [a - 1]
    eps = 1e-6
    if spec.startswith(">= "):
        a = float(spec[3:])
        return [a], [a - eps]
    if spec.startswith("> "):
        a = float(spec[2:])
        return [a + eps], [a]
    lo, hi = (float(t) for t in spec[1:-1].split(","))
    ok, bad = [], []
    if spec[0] == "[":
        ok, bad = ok + [lo], bad + [lo - eps]
    else:
        ok, bad = ok + [lo + eps], bad + [lo]
    if spec[-1] == "]":
        ok, bad = ok + [hi], bad + [hi + eps]
    else:
        ok, bad = ok + [hi - eps], bad + [hi]
    return ok, bad


def test_every_method_has_its_defaults_written_here():
    assert sorted(DEFAULTS) == method_names()


@pytest.mark.parametrize("name", sorted(DEFAULTS))
def test_defaults(name):
    want = DEFAULTS[name]
    got = get_method_class(name).Params().model_dump()
    assert got.keys() == want.keys()
    for k, v in want.items():
        same = math.isclose(got[k], v, rel_tol=1e-12) if isinstance(v, float) else got[k] == v
        assert same and type(got[k]) is type(v), (k, got[k], v)


@pytest.mark.parametrize("key", sorted(RANGES))
def test_each_parameter_accepts_its_range_and_refuses_just_outside_it(key):
    name, field = key.split(".")
    params = get_method_class(name).Params
    ok, bad = edges(RANGES[key])
    for v in ok:
        assert getattr(params(**{field: v}), field) == v, (key, v)
    for v in bad:
        with pytest.raises(ValidationError):
            params(**{field: v})


def test_every_bounded_parameter_has_its_range_written_here():
    bounded = {f"{n}.{f}" for n in method_names() for f, info in get_method_class(n).Params.model_fields.items()
               if any(hasattr(m, a) for m in info.metadata for a in ("ge", "gt", "le", "lt"))}
    assert bounded == set(RANGES)


def test_a_value_outside_its_range_is_one_config_error_naming_the_parameter():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["method.name=fedprox", "method.mu=-0.5"])
    msg = str(e.value)
    assert "\n" not in msg and "mu" in msg and "-0.5" in msg, msg


@pytest.mark.parametrize("name", ["fedfd", "fedfda"])
def test_fedfd_u_range_may_be_a_single_value_but_not_reversed(name):
    params = get_method_class(name).Params
    one = params(u_low=0.3, u_high=0.3)
    assert (one.u_low, one.u_high) == (0.3, 0.3)
    with pytest.raises(ValidationError, match="u_high must be >= u_low"):
        params(u_low=0.4, u_high=0.3)


@pytest.mark.parametrize("name", ["fedfd", "fedfda"])
def test_fedfd_lambda2_is_auto_or_non_negative(name):
    params = get_method_class(name).Params
    assert params(lambda2=0.0).lambda2 == 0.0 and params(lambda2=4.0).lambda2 == 4.0
    for bad in (-1e-6, "paper"):
        with pytest.raises(ValidationError):
            params(lambda2=bad)
