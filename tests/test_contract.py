"""The method contract, over the whole registry (DomainBed's lesson): every
registered method builds, trains two rounds through the engine on tiny data
with a finite loss, uploads exactly its non-private keys, keeps its local
state per client across rounds, and gives identical numbers with 1 and 2
workers."""
import numpy as np
import pytest
from conftest import tiny_cfg

from rayfed_dg.methods import method_names

# methods whose defaults need more than the contract's tiny setup
# (FedFD-A's paper lambda2 = 4 is for ImageNet weights; from scratch its CAFL gradient dominates: README)
# (ELCFS reads the amplitude bank of its data stage; CSAC's 1,800 pre-training steps, its code's default, are cut to 2)
EXTRA = {"feddg_ga": ["method.val_samples=16"], "fedfda": ["method.lambda2=0.1"], "fedfd": ["method.lambda2=0.1"],
         "elcfs": ["stages.amplitude={}"], "csac": ["method.pretrain_steps=2"]}


def _run(ray, ds, name, workers):
    from rayfed_dg.data import leave_one_domain_out
    from rayfed_dg.engine import launch_server

    cfg = tiny_cfg(f"method.name={name}", "training.local_steps=2", "training.batch_size=16", "training.rounds=2",
                   "data.limit_per_domain=60", *EXTRA.get(name, []))
    ds = ds.subsample(60, 0)
    split = leave_one_domain_out(ds, "texture", 0.2, 0)
    server = launch_server(
        cfg, split, [ray.put(ds.images), ray.put(ds.labels)], ds.num_classes, workers)
    ray.get(server.setup.remote())  # the data stages, as run_federation does (ELCFS's amplitude bank)
    outs = [ray.get(server.run_round.remote()) for _ in range(2)]
    state = ray.get(server.get_state.remote())
    keys = ray.get(server.__ray_call__.remote(lambda s: (sorted(s.local_keys), sorted(s.groups))))
    ray.get(server.shutdown.remote())
    return split, outs, state, keys


@pytest.mark.slow
@pytest.mark.parametrize("name", method_names())
def test_method_contract(ray_session, tiny_ds, name):
    split, outs, state, (local_keys, all_keys) = _run(ray_session, tiny_ds, name, workers=1)
    from rayfed_dg.engine import ClientRunner

    runner = ClientRunner(tiny_cfg(f"method.name={name}", *EXTRA.get(name, [])), tiny_ds.images, tiny_ds.labels, 10,
                          split.num_clients)
    private = runner.private_keys
    sd = runner.model.state_dict()
    for out in outs:
        assert np.isfinite(out.train_loss) and not out.dropped
        assert all(np.isfinite(m["loss"]) for m in out.metrics), name
        for c in out.sampled:
            up = [r for r in out.ledger if r["client"] == c and r["direction"] == "up"
                  and not r["group"].startswith(("payload:", "eval:", "prepare:"))]
            # exactly the non-private state leaves the client
            assert sum(r["tensors"] for r in up) == len(all_keys) - len(private), name
            assert sum(r["bytes"] for r in up) == sum(sd[k].numel() * sd[k].element_size()
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
    _, outs2, state2, _ = _run(ray_session, tiny_ds, name, workers=2)
    key = lambda o: [(m["split"], m["domain"], m["accuracy"], m["loss"]) for m in o.metrics]  # noqa: E731
    assert [key(o) for o in outs] == [key(o) for o in outs2], name
    assert all(np.array_equal(state["global_state"][k], state2["global_state"][k]) for k in state["global_state"])
