"""How a method's parameters reach the code that reads them (a parameter
read as a hard-coded default, or as another field, would pass every test
that runs methods at their defaults).

For every registered method and every field of its ``Params``, a
non-default value (inside its range; each other member of an enum) must
change what a short federation computes, bit for bit: two rounds of three
clients on the embedded digits (16 px, conv net of width 8, two local steps
of batch 8), driven through the engine's own in-process halves,
``Federation`` (server: weights, payloads, aggregate, server state) and
``ClientRunner`` (client: prepare, train, upload), without Ray.  What is
compared: every client's upload, payload, loss and stats, the server's
weights and state after each round, and the final global model (and each
client's own) on fixed samples.  Equal outputs mean the parameter never
reached its code.

A field that by design cannot change those outputs there is listed in
``NOT_OBSERVABLE`` with its reason; a field neither observable nor listed
fails, so a new parameter is covered as soon as it is registered (its value
is picked from its type and range, or given in ``VALUES``; a setting it is
read under goes in ``SETTINGS``).  One use that shows is enough there:
where a parameter is read in several places and a break of one of them
passed the fast tests, that use has a value test of its own (the second
part of this file).
"""
from __future__ import annotations

import functools
import json
import re
import types
import typing
from collections.abc import Iterator
from typing import Any, Literal

import numpy as np
import pytest
from conftest import tiny_cfg
from pydantic import ValidationError

from rayfed_dg.methods import GlobalEval, Phase, get_method_class, method_names

# settings both runs of a method share, to keep the probe small (as tests/test_contract.py's EXTRA): CSAC's 1,800
# pre-training steps cut to 2, FedADG's AlexNet-sized generator and discriminator scaled to the tiny conv net,
# ELCFS's amplitude bank (built by hand in ``_probe``)
BASE = {"csac": ["method.pretrain_steps=2"], "elcfs": ["stages.amplitude={}"],
        "fedadg": ["method.noise_dim=8", "method.gen_hidden=16", "method.rp_size=8", "method.disc_hidden=8"]}

# (method, param) -> the values to try where the type's pick would not do: free strings and lists, a pick that
# equals what the default resolves to, or one the probe cannot tell apart from the default
VALUES: dict[tuple[str, str], list[Any]] = {
    ("dson", "placement"): ["blocks:1"],
    ("gperxan", "placement"): ["blocks:1"],  # auto is blocks:2 on the conv net
    ("gperxan", "bn_weight"): [0.25],  # auto is 0.5 from scratch
    ("fedfd", "lambda2"): [0.1],  # auto is 1 / 8 on the probe's conv net of width 8
    ("fedfda", "lambda2"): [0.1],
    ("mixstyle", "blocks"): [["block1"]],
    ("dsu", "blocks"): [["block1"]],
    ("fedfd", "inference"): ["instance"],  # auto is global for FedFD, and adapter needs FedFD-A's adapters
    ("fedfda", "inference"): ["global", "instance"],  # auto is adapter for FedFD-A
    ("elcfs", "clip"): [1.0],  # CCST's port's clip: the inner gradient's entries stay below 50 here
}

# (method, param) -> settings both runs share, where the parameter is read only under another setting or the probe's
# default sizes hide it
SETTINGS: dict[tuple[str, str], list[str]] = {
    ("rsc", "spatial_drop"): ["data.resolution=32"],  # at 16 px the last map has one location: ceil(1 * drop) = 1
    ("stablefdg", "attention_scores"): ["data.resolution=32"],  # at 16 px: a softmax over one position
    ("fedfd", "select_samples"): ["method.select_every=1"],  # read only with client-side selection
    ("fedfda", "select_samples"): ["method.select_every=1"],
    # FedLGF's perturbation is read only with a flatness term on (global: its own copy of the round's model)
    ("fedsam", "perturb"): ["method.local_flatness=0.1"],
    ("fedsam", "perturb_dist"): ["method.global_flatness=0.1"],
    ("fedsam", "perturb_init"): ["method.local_flatness=0.1"],
    ("fedsam", "perturb_grad"): ["method.global_flatness=0.1"],
}

# (method, param) -> why no value can change the probe's outputs (checked: listing an observable one fails).  Empty:
# every parameter shows, some under SETTINGS (a later-round term shows in round 2)
NOT_OBSERVABLE: dict[tuple[str, str], str] = {}

# the probe: 3 clients of 30 training and 10 validation samples (embedded digits, "texture" held out)
PROBE = ["training.local_steps=2", "training.batch_size=8", "training.rounds=2", "engine.num_cpus_per_worker=1"]
ROUNDS = 2


@functools.cache
def _data(resolution: int):
    from rayfed_dg.data import leave_one_domain_out, load_dataset

    ds = load_dataset("embedded_digits", None, resolution).subsample(40, 0)
    return ds, leave_one_domain_out(ds, "texture", 0.2, 0)


def _amplitude_bank(ds, split, cfg) -> dict[str, np.ndarray]:
    """ELCFS's bank as its stage (stages/amplitude.py) shares it: an eighth of each client's spectra, their owners."""
    from rayfed_dg.stages.amplitude import amplitude_spectrum, bank_sample

    rows = [idx[bank_sample(len(idx), 0.125, cfg.training.seed, c)] for c, idx in enumerate(split.clients)]
    return {"bank": np.concatenate([amplitude_spectrum(ds.images[i], cfg.data.resolution) for i in rows]),
            "owners": np.concatenate([np.full(len(i), c) for c, i in enumerate(rows)])}


def _probe(name: str, sets: tuple[str, ...]) -> Iterator[tuple[str, np.ndarray]]:
    """Everything a short federation of ``name`` computes, by name, in the order it is computed."""
    from rayfed_dg.engine import ClientRunner
    from rayfed_dg.engine.rounds.federation import Federation
    from rayfed_dg.stages.amplitude import SHARED

    cfg = _cfg(name, sets)
    ds, split = _data(cfg.data.resolution)
    fed = Federation(cfg, split, ds.num_classes, 0)
    runner = ClientRunner(cfg, ds.images, ds.labels, ds.num_classes, split.num_clients)
    if SHARED in fed.method.stages_needed:
        fed.data.add_stage_outputs({}, {SHARED: _amplitude_bank(ds, split, cfg)})
    bs = cfg.evaluation.batch_size
    for r in range(1, ROUNDS + 1):
        cohort = fed.cohort()
        sampled = cohort.train
        prepared = {c: runner.prepare(fed.task(r, c, {}, 0), fed.global_state) for c in sampled} \
            if Phase.PREPARE in fed.method.phases else {}
        payloads = fed.payloads(r, sampled, prepared)
        reducer = fed.reducer(sampled)
        yield f"r{r}/weights", np.array([reducer.weights[c] for c in sampled])
        results = []
        for c in sampled:
            yield from _named(f"r{r}/c{c}/prepared", prepared.get(c, {}))
            yield from _named(f"r{r}/c{c}/down", payloads.get(c, {}))
            upd = runner.train(fed.task(r, c, payloads.get(c, {}), 0), fed.global_state)
            reducer.add(c, upd.update)
            fed.store.put(c, upd.update, upd.private)
            results.append(upd)
            yield f"r{r}/c{c}/loss", np.array([upd.train_loss, upd.steps, upd.samples_stepped])
            for part in ("stats", "update", "private", "payload"):
                yield from _named(f"r{r}/c{c}/{part}", getattr(upd, part))
        fed.aggregate(cohort, reducer, {u.client: u for u in results})
        if Phase.EVALUATE_ON_CLIENTS in fed.method.phases:  # as engine/rounds/evaluation.py's evaluate_on_clients
            for u in results:
                correct, loss, n = runner.evaluate(fed.global_state, fed.data.client_val(u.client), bs)
                u.global_eval = GlobalEval(accuracy=correct / max(n, 1), loss=loss / max(n, 1), samples=n)
        fed.end_round(cohort, results)
        yield from _named(f"r{r}/global", fed.global_state)
        yield from _named(f"r{r}/server", fed.server_state)
    held_out = np.concatenate([split.test[d] for d in sorted(split.test)])[:64]
    yield "test/global", np.array(runner.evaluate(fed.global_state, held_out, bs))
    for c in range(split.num_clients):  # each client's own model, where it keeps state
        own = fed.store.get(c)
        if own:
            yield f"test/own{c}", np.array(runner.evaluate(fed.global_state, held_out, bs, own))


def _named(prefix: str, tree: Any) -> Iterator[tuple[str, np.ndarray]]:
    """The arrays of a (nested) dict by path, copied: the federation goes on changing its own."""
    if isinstance(tree, dict):
        for key, sub in tree.items():
            yield from _named(f"{prefix}/{key}", sub)
    else:
        yield prefix, np.array(tree, copy=True)


def _cfg(name: str, sets: tuple[str, ...] | list[str] = ()):
    return tiny_cfg(f"method.name={name}", *PROBE, *BASE.get(name, []), *sets)


@functools.cache
def _outputs(name: str, sets: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    return dict(_probe(name, sets))


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)


def _first_difference(base: dict[str, np.ndarray], name: str, sets: tuple[str, ...]) -> str | None:
    """The first output of ``name`` under ``sets`` that differs from ``base`` bit for bit (None: none); the
    federation stops there (most parameters show in the first client's update)."""
    seen = set()
    for key, value in _probe(name, sets):
        if key not in base or not _same(base[key], value):
            return key
        seen.add(key)
    return next(iter(sorted(base.keys() - seen)), None)


def _candidates(field, d: Any) -> tuple[list[Any], bool]:
    """Values other than ``d`` (the probe's default) of a field's type, in order, and whether each is to be tried
    (an enum's members; otherwise the first its ``Params`` accepts)."""
    ann = field.annotation
    args = typing.get_args(ann) if typing.get_origin(ann) in (typing.Union, types.UnionType) else (ann,)
    members = [v for a in args if typing.get_origin(a) is Literal for v in typing.get_args(a)]
    if members and not {float, int} & set(args):
        return [v for v in members if v != d], True
    if bool in args:
        return [not d], False
    if float in args:
        if isinstance(d, int | float) and not isinstance(d, bool) and d != 0:
            return [d / 2, d * 2], False
        return [0.5, 0.25, 2.0], False
    if int in args:
        return ([2, 4] if d is None else [v for v in (d // 2, d + 1) if v != d]), False
    pattern = next((m.pattern for m in field.metadata if getattr(m, "pattern", None)), None)
    alternatives = re.fullmatch(r"\^\((.*)\)\$", pattern or "")
    if str in args and alternatives:  # "^(a|b\\+\\+)$"
        return [v for v in (re.sub(r"\\(.)", r"\1", a) for a in alternatives.group(1).split("|")) if v != d], True
    return [], False


def _values(name: str, param: str) -> list[Any]:
    """The values to set: each other member of an enum, else the first pick its ``Params`` accepts (none: the
    type offers no value)."""
    if (name, param) in VALUES:
        return VALUES[name, param]
    cls, base = get_method_class(name).Params, _cfg(name, SETTINGS.get((name, param), [])).method.params
    picks, every = _candidates(cls.model_fields[param], getattr(base, param))
    valid = []
    for v in picks:
        try:
            cls(**{**base.model_dump(), param: v})
        except ValidationError:
            continue
        valid.append(v)
    return valid if every else valid[:1]


CASES = [(n, p) for n in method_names() for p in get_method_class(n).Params.model_fields]


@pytest.mark.parametrize("name,param", CASES, ids=[f"{n}.{p}" for n, p in CASES])
def test_a_non_default_parameter_changes_what_the_federation_computes(name, param):
    values, shared = _values(name, param), tuple(SETTINGS.get((name, param), []))
    assert values or (name, param) in NOT_OBSERVABLE, f"{name}.{param}: no value to try; give one in VALUES"
    for value in values:
        changed = _first_difference(_outputs(name, shared), name, (*shared, f"method.{param}={json.dumps(value)}"))
        if (name, param) in NOT_OBSERVABLE:
            assert changed is None, f"{name}.{param}={value} changes {changed}: drop it from NOT_OBSERVABLE"
        else:
            assert changed, f"{name}.{param}={value} changes nothing the federation computes: it never reaches its use"


@pytest.mark.parametrize("name", sorted({n for n, _ in CASES}))
def test_the_probe_is_deterministic(name):
    """The control: the same config gives the same numbers, so a difference above is the parameter's."""
    assert _first_difference(_outputs(name, ()), name, ()) is None


def test_the_tables_name_existing_parameters():
    for name, param in [*VALUES, *SETTINGS, *NOT_OBSERVABLE]:
        assert (name, param) in CASES, f"{name}.{param} is no parameter of a registered method"
    assert all(NOT_OBSERVABLE.values())


# ---------------------------------------------------------------- parameters read in several places
# The test above needs one use of a parameter to show.  Where a parameter has several uses and a break of one of them
# (its default literal in that place only) still passed every fast test, each use gets its own value check here.

def _ctx(seed=0, **kw):
    import torch

    from rayfed_dg.methods import ClientContext

    return ClientContext(client_id=0, round=1, device=torch.device("cpu"), generator=torch.Generator().manual_seed(seed),
                         num_samples=8, **kw)


def _batch(n=8, seed=0, size=16):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, size, size, generator=g), torch.arange(n) % 4


def _built(name, *sets):
    from rayfed_dg.methods import build_method

    method = build_method(tiny_cfg(f"method.name={name}", *sets), 3)
    return method, method.build_model(10)


def test_fedadg_adv_lr_reaches_both_the_discriminators_and_the_generators_optimizer():
    """Every step of D's and of G's SGD runs at ``adv_lr`` (F and C at ``training.lr``)."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from rayfed_dg.methods.fedadg import DISC, GEN

    method, model = _built("fedadg", "method.adv_lr=0.003", "method.warmup_fraction=0", "training.lr=0.05",
                           *BASE["fedadg"])
    part = {id(p): n.split(".")[0] for n, p in model.named_parameters()}
    seen: list[tuple[set[str], float]] = []
    hook = register_optimizer_step_pre_hook(
        lambda opt, a, k: seen.append(({part[id(p)] for p in opt.param_groups[0]["params"]},
                                       opt.param_groups[0]["lr"])))
    try:
        x, y = _batch()
        method.local_train(model, lambda: iter([(x, y)]), _ctx())
    finally:
        hook.remove()
    assert seen == [({DISC}, 0.003), ({"body", "head"}, 0.05), ({GEN}, 0.003)]


def test_fedadg_label_smoothing_reaches_the_warm_up_cross_entropy():
    """In the warm-up (all of the round at ``warmup_fraction: 1``) the loss is CE with ``label_smoothing``."""
    import copy

    import torch.nn.functional as F

    method, model = _built("fedadg", "method.label_smoothing=0.3", "method.warmup_fraction=1", *BASE["fedadg"])
    x, y = _batch()
    logits = copy.deepcopy(model).train()(x).detach()
    res = method.local_train(model, lambda: iter([(x, y)]), _ctx())
    assert res.loss == pytest.approx(float(F.cross_entropy(logits, y, label_smoothing=0.3)), rel=1e-6)
    assert res.loss != pytest.approx(float(F.cross_entropy(logits, y, label_smoothing=0.1)), rel=1e-3)


def test_feddg_ga_accuracy_metric_reads_accuracies_and_gives_weight_to_a_drop():
    """``metric: accuracy``, two clients at weight 1/2, round 1 of 2 (d = 0.2): accuracies before 0.8 and 0.5,
    after 0.6 and 0.5, so gaps -(after - before) = (0.2, 0), centred (0.1, -0.1), normalised (1, -1): weights
    (0.7, 0.3).  The losses after (3.0, 0.1) read in place of the accuracies would give (0.3, 0.7)."""
    from rayfed_dg.methods import ClientUpdate, build_method

    method = build_method(tiny_cfg("method.name=feddg_ga", "method.metric=accuracy", "training.rounds=2"), 2)

    def upd(c, before, after_acc, after_loss):
        return ClientUpdate(client=c, num_samples=10, update={}, private={},
                            payload={"ga_local": np.array([before])}, train_loss=0.0, seconds=0.0,
                            global_eval=GlobalEval(accuracy=after_acc, loss=after_loss, samples=10))

    state: dict = {}
    method.after_round(1, [upd(0, 0.8, 0.6, 3.0), upd(1, 0.5, 0.5, 0.1)], state)
    assert state["ga_weights"] == {0: pytest.approx(0.7), 1: pytest.approx(0.3)}


def _stablefdg(*sets):
    return _built("stablefdg", *sets)


def test_stablefdg_style_samples_caps_the_samples_of_the_shared_style():
    """With ``style_samples: 3`` the style is that of the 3 samples the client's generator draws, not of all 10."""
    import torch

    method, model = _stablefdg("method.style_samples=3")
    x, y = _batch(40)
    fetch = lambda idx: (x[idx], y[idx])  # noqa: E731
    indices = np.arange(5, 15)
    got = method.round_prepare(model, _ctx(seed=3, indices=indices, labels=y[indices].numpy(), fetch=fetch))["style"]
    drawn = indices[torch.randperm(10, generator=torch.Generator().manual_seed(3))[:3].numpy()]
    assert np.array_equal(got, method.compute_style(model, [x[drawn]]))
    assert not np.allclose(got, method.compute_style(model, [x[indices]]))


@pytest.mark.parametrize("style", [True, False])
def test_stablefdg_style_false_turns_exploration_off_too(style):
    """Without style sharing no style operation runs in training: forwards under four generators agree (with it,
    exploration and MixStyle fire at random after blocks 1-3 and they do not)."""
    import torch

    method, model = _stablefdg(f"method.style={json.dumps(style)}")
    model.train()
    x, y = _batch()
    outs = []
    for seed in range(4):
        st = model.style_state
        st.labels, st.fired, st.gen = y, False, torch.Generator().manual_seed(seed)
        with torch.no_grad():
            outs.append(model(x))
    assert all(torch.equal(outs[0], o) for o in outs[1:]) is not style


@pytest.mark.parametrize("attention", [True, False])
def test_stablefdg_partners_are_added_only_for_the_highlighter(attention):
    """A class with one sample in the batch gets a same-class partner from the client's data only with
    ``attention`` (the highlighter mixes each query with a partner's)."""
    method, model = _stablefdg(f"method.attention={json.dumps(attention)}")
    x, y = _batch(40)
    indices = np.arange(40)
    ctx = _ctx(indices=indices, labels=y.numpy(), fetch=lambda idx: (x[idx], y[idx]))
    bx, by = method._with_partners(x[:5], y[:5], ctx)  # classes 0, 1, 2, 3, 0: three singletons
    assert len(by) == (8 if attention else 5)
    assert sorted(by[5:].tolist()) == ([1, 2, 3] if attention else [])


@pytest.mark.parametrize("name", ["gperxan", "copa"])
def test_ibn_norm_takes_ibn_nets_placement_not_xans(name):
    """``norm: ibn`` puts IBN-a in the first BN of each block of stages 1-3 (IBN-Net's placement), not at XAN's
    ``stages:4``; on the conv net both read blocks:2, on a ResNet they differ."""
    from rayfed_dg.models import IBN

    _, model = _built(name, "method.norm=ibn", "model.arch=resnet18")
    assert sorted(n for n, m in model.named_modules() if isinstance(m, IBN)) == [
        f"body.layer{s}.{b}.bn1" for s in (1, 2, 3) for b in (0, 1)]



@pytest.mark.parametrize("metric", ["loss", "accuracy"])
def test_feddg_ga_uploads_the_local_models_value_of_its_metric(metric):
    """``ga_local`` is the trained model's accuracy or loss on the client's validation samples, the one
    ``after_round`` compares with the new global model's (a loss against accuracies would mix two scales)."""
    from rayfed_dg.methods.base import evaluate_on_val

    method, model = _built("feddg_ga", f"method.metric={metric}")
    model.eval()
    x, y = _batch(40)
    ctx = _ctx(val_indices=np.arange(10, 30), fetch=lambda idx: (x[idx], y[idx]))
    acc, loss = evaluate_on_val(model, ctx)
    assert acc != loss
    assert method.upload_payload(model, ctx)["ga_local"].tolist() == [loss if metric == "loss" else acc]


@pytest.mark.parametrize("attention", [True, False])
def test_stablefdg_attention_false_builds_no_highlighter(attention):
    """The highlighter replaces the pooling and doubles the classifier's input, [GAP(z), attended z]; without
    ``attention`` the pooling and the C-input head stay."""
    from rayfed_dg.models.style import FeatureHighlighter

    _, model = _stablefdg(f"method.attention={json.dumps(attention)}")
    _, plain = _built("fedavg")
    assert any(isinstance(m, FeatureHighlighter) for m in model.modules()) is attention
    assert model.head.in_features == plain.head.in_features * (2 if attention else 1)


@pytest.mark.parametrize("name", ["fedfd", "fedfda"])
def test_fedfd_base_sets_which_batchnorm_state_stays_on_the_client(name):
    """``base: fedbn`` keeps every BatchNorm tensor local (affine and statistics), ``silobn`` the statistics,
    ``fedavg`` none; the adapters are always shared."""
    kinds = {}
    for base in ("fedbn", "silobn", "fedavg"):
        method, model = _built(name, f"method.base={base}", "method.lambda2=0.1")
        kinds[base] = sorted({k.rsplit(".", 1)[1] for k in method.local_keys(model)})
        assert not any(".adapter." in k for k in method.local_keys(model))
    assert kinds == {"fedbn": ["bias", "num_batches_tracked", "running_mean", "running_var", "weight"],
                     "silobn": ["num_batches_tracked", "running_mean", "running_var"], "fedavg": []}
