"""The method contract, over the whole registry (DomainBed's lesson): every
registered method builds, trains two rounds through the engine on tiny data
with a finite loss, uploads exactly its non-private keys, keeps its local
state per client across rounds, and gives identical numbers with 1 and 2
workers."""
import numpy as np
import pytest
from conftest import tiny_cfg

from rayfed_dg.engine.rounds.federation import Federation
from rayfed_dg.methods import method_names

# methods whose defaults need more than the contract's tiny setup
# (ELCFS reads the amplitude bank of its data stage; CSAC's 1,800 pre-training steps, its code's default, are cut to 2;
# FedADG's generator and discriminator, sized for AlexNet's 4096 features, are scaled to the tiny conv net)
EXTRA = {"feddg_ga": ["method.val_samples=16"], "elcfs": ["stages.amplitude={}"], "csac": ["method.pretrain_steps=2"],
         "fedadg": ["method.noise_dim=16", "method.gen_hidden=32", "method.rp_size=16", "method.disc_hidden=16"]}


# a quarter CPU per worker: both hosts and the timm host below fit the 2-CPU test session at once
# (torch still gets one thread per worker, as with a whole CPU)
ENGINE = ["engine.num_cpus_per_worker=0.25"]


def make_hosts(ray, tiny_ds):
    """One host of 1 worker and one of 2 for every method, as an experiment's
    federations share theirs: each method's federation opens on them in turn."""
    from rayfed_dg.data import leave_one_domain_out
    from rayfed_dg.engine.running.host import EngineHost

    ds = tiny_ds.subsample(60, 0)
    split = leave_one_domain_out(ds, "texture", 0.2, 0)
    refs = [ray.put(ds.images), ray.put(ds.labels)]
    return {n: EngineHost(tiny_cfg(*ENGINE).engine, refs, n) for n in (1, 2)}, ds, split


def close_hosts(hosts) -> None:
    for h in hosts[0].values():
        h.close()


@pytest.fixture(scope="module")
def hosts(ray_session, tiny_ds):
    made = make_hosts(ray_session, tiny_ds)
    yield made
    close_hosts(made)


def _run(hosts, name, workers):
    import ray

    made, ds, split = hosts
    cfg = tiny_cfg(f"method.name={name}", "training.local_steps=2", "training.batch_size=16", "training.rounds=2",
                   "data.limit_per_domain=60", *ENGINE, *EXTRA.get(name, []))
    server = made[workers].open(cfg, split, ds.num_classes)
    ray.get(server.setup.remote())  # the data stages, as run_federation does (ELCFS's amplitude bank)
    outs = [ray.get(server.run_round.remote()) for _ in range(2)]
    state = ray.get(server.get_state.remote())
    fed = Federation(cfg, split, ds.num_classes, 0)  # the server's state, built here: no reaching into the actor
    keys = sorted(fed.local_keys), sorted(fed.groups)
    return split, outs, state, keys


@pytest.mark.slow
@pytest.mark.parametrize("name", method_names())
def test_method_contract(ray_session, tiny_ds, hosts, name):
    split, outs, state, (local_keys, all_keys) = _run(hosts, name, workers=1)
    from rayfed_dg.engine import ClientRunner

    runner = ClientRunner(tiny_cfg(f"method.name={name}", *EXTRA.get(name, [])), tiny_ds.images, tiny_ds.labels, 10,
                          split.num_clients)
    private = runner.private_keys
    sd = runner.model.state_dict()
    for out in outs:
        assert np.isfinite(out.train_loss) and not out.dropped
        assert all(np.isfinite(m.loss) for m in out.metrics), name
        for c in out.sampled:
            up = [r for r in out.ledger if r.client == c and r.direction == "up"
                  and not r.group.startswith(("payload:", "eval:", "prepare:"))]
            # exactly the non-private state leaves the client
            assert sum(r.tensors for r in up) == len(all_keys) - len(private), name
            assert sum(r.bytes for r in up) == sum(sd[k].numel() * sd[k].element_size()
                                                      for k in all_keys if k not in private), name
    # local (and private) state is kept per client, never the broadcast
    for c in range(split.num_clients):
        kept = state["client_store"].get(c, {})
        assert sorted(kept) == sorted(set(local_keys) | set(private)), name
    floats = [k for k in local_keys if np.issubdtype(state["global_state"][k].dtype, np.floating)]
    if floats:
        k = floats[0]
        clients = [state["client_store"][c][k] for c in range(split.num_clients)]
        assert any(not np.array_equal(clients[0], x) for x in clients[1:]), f"{name}: local state not per client"
    # identical numbers whatever the number of workers
    _, outs2, state2, _ = _run(hosts, name, workers=2)
    key = lambda o: [(m.split, m.domain, m.accuracy, m.loss) for m in o.metrics]  # noqa: E731
    assert [key(o) for o in outs] == [key(o) for o in outs2], name
    assert all(np.array_equal(state["global_state"][k], state2["global_state"][k]) for k in state["global_state"])


# ---------------------------------------------------------------- on a timm backbone
# Every registered method on timm's tiny EfficientNet (timm's BatchNormAct2d layers, five feature_info stages, a
# head that only average-pools) at 32 px, random init: preflight accepts it and one round of one local step runs
# through the engine.  None is rejected there: every method applies to a timm CNN with BatchNorm and a pooling head.
# Where a method cannot apply it is one line before anything runs (TIMM_REJECTED): on ConvNeXt (LayerNorm, a head
# norm after the pooling) the BatchNorm methods and the two that need the pooled map; on a ViT also the
# stage-placed ones.  (Before: gperxan/copa had no placement for a timm arch, rsc refused every timm arch.)
TIMM_NET = "timm/test_efficientnet"
TIMM_REJECTED = {
    "timm/test_convnext": {
        "gperxan": "placement stages:4 selects no BatchNorm layer of this backbone: xan replaces BatchNorm layers",
        "dson": "placement all selects no BatchNorm layer of this backbone: dson replaces BatchNorm layers",
        "copa": "copa's hybrid batch-instance normalization: placement first_bn:stages:3 selects no BatchNorm layer",
        "fedbn": "fedbn keeps the BatchNorm layers on the clients and this backbone has none",
        "silobn": "silobn keeps the BatchNorm statistics on the clients and this backbone has none",
        "fedfd": "fedfd diversifies BatchNorm statistics and this backbone has no BatchNorm2d layer",
        "fedfda": "fedfda diversifies BatchNorm statistics and this backbone has no BatchNorm2d layer",
        "rsc": "rsc mutes the last feature map before global average pooling; timm/test_convnext's head does more "
               "than average-pool its last feature map",
        "stablefdg": "the feature highlighter attends over the last feature map before global average pooling; "
                     "timm/test_convnext's head does more than average-pool",
    },
    "timm/test_vit": {
        **{m: "selects no BatchNorm layer" for m in ("dson",)},
        **{m: "has no convolutional stages of growing stride" for m in
           ("gperxan", "copa", "mixstyle", "dsu", "rsc", "stablefdg")},
        "fedbn": "has none", "silobn": "has none", "fedfd": "no BatchNorm2d layer", "fedfda": "no BatchNorm2d layer",
    },
}


@pytest.fixture(scope="module")
def timm_host(ray_session):
    pytest.importorskip("timm", reason="timm is not installed (pip install -e '.[dev]' or '.[pretrained]')")
    from rayfed_dg.data import leave_one_domain_out, load_dataset
    from rayfed_dg.engine.running.host import EngineHost

    ds = load_dataset("embedded_digits", None, 64).subsample(40, 0)
    split = leave_one_domain_out(ds, "texture", 0.2, 0)
    host = EngineHost(tiny_cfg().engine, [ray_session.put(ds.images), ray_session.put(ds.labels)], 1)
    yield host, ds, split
    host.close()


def _timm_cfg(name, arch=TIMM_NET):
    return tiny_cfg(f"method.name={name}", f"model.arch={arch}", "data.resolution=64", "training.local_steps=1",
                    "training.batch_size=8", "training.rounds=1", *EXTRA.get(name, []))


@pytest.mark.slow
@pytest.mark.parametrize("name", method_names())
def test_method_contract_on_a_timm_backbone(timm_host, name):
    import ray

    from rayfed_dg.engine import preflight

    host, ds, split = timm_host
    cfg = _timm_cfg(name)
    preflight(cfg, [split], ds.num_classes)  # the driver's check: builds, nothing rejected
    server = host.open(cfg, split, ds.num_classes)
    ray.get(server.setup.remote())
    out = ray.get(server.run_round.remote())
    assert np.isfinite(out.train_loss) and not out.dropped, name
    assert out.metrics and all(np.isfinite(m.loss) for m in out.metrics), name
    fed = Federation(cfg, split, ds.num_classes, 0)
    keys, private = sorted(fed.groups), sorted(fed.method.private_keys(fed.method.build_model(ds.num_classes)))
    for c in out.sampled:  # exactly the non-private state leaves each client
        up = [r for r in out.ledger if r.client == c and r.direction == "up"
              and not r.group.startswith(("payload:", "eval:", "prepare:"))]
        assert sum(r.tensors for r in up) == len(keys) - len(private), name


@pytest.mark.parametrize("arch", sorted(TIMM_REJECTED))
def test_methods_that_cannot_apply_to_a_timm_backbone_are_one_line(ray_session, arch):
    pytest.importorskip("timm", reason="timm is not installed (pip install -e '.[dev]' or '.[pretrained]')")
    from rayfed_dg.data import leave_one_domain_out, load_dataset
    from rayfed_dg.engine import preflight
    from rayfed_dg.errors import ConfigError

    ds = load_dataset("embedded_digits", None, 32).subsample(20, 0)
    split = leave_one_domain_out(ds, "texture", 0.2, 0)
    rejected = {}
    for name in method_names():
        try:
            preflight(_timm_cfg(name, arch), [split], ds.num_classes)
        except ConfigError as e:
            rejected[name] = str(e)
    assert sorted(rejected) == sorted(TIMM_REJECTED[arch]), arch
    for name, line in rejected.items():
        assert "\n" not in line and line.startswith(f"method {name} cannot build model.arch={arch}: "), line
        assert TIMM_REJECTED[arch][name] in line, (name, line)
