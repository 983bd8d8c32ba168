"""Seconds per local step of each method vs FedAvg, measured in one run.

Every method trains the same backbone on the same batches (same batch size
and resolution) through the engine's own client code (``ClientRunner``),
without Ray, so only the method's compute differs.  Methods are interleaved
over repetitions so machine noise hits all alike; the ratio is the median
step time of a method over FedAvg's.  A timed call is one client's local
update of ``--steps`` steps over ``--epochs`` epochs of its data, in round 2
after a warm-up round of two clients, so what a method receives from the
server from round 2 on (StableFDG's shared style, COPA's assembled heads) is
in the timing, and the timed client starts from its own state after the
warm-up (CSAC's pre-trained private model).  A method's data stages
(``stages_needed``: ELCFS's amplitude bank) run first over the two clients;
their one-off cost is not in the per-step time.

    python bench/method_cost.py [--arch resnet18] [--res 64] [--batch 32] [--steps 10] [--epochs 1] [--methods ...]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

# the paper baselines: CSAC pre-trains one step in the warm-up round (its default is 1,800)
DEFAULT = ["fedavg", "fedprox", "gperxan", "fedfd", "fedfda", "stablefdg", "rsc", "elcfs", "copa",
           "csac:pretrain_steps=1", "dson"]


class LocalStageServer:
    """A data stage's server half run in this process over the bench's clients
    (``stages.base.StageServer``): shared arrays are kept for the training calls."""

    def __init__(self, runner, index: int, clients: dict):
        self.runner, self.index, self.clients = runner, index, clients
        self.num_clients, self.seed = len(clients), runner.cfg.training.seed
        self.shared: dict = {}

    def training_set(self, c):
        return self.clients[c]

    def map(self, phase, args, releases=None):
        return {c: self.runner.run_stage(self.index, phase.__name__, c, self.clients[c], a, releases)
                for c, a in args.items()}

    def set_training_set(self, client_id, keep, images, labels):
        raise NotImplementedError("stages that replace training sets (CCST) are timed by bench/ccst_cost.py")

    def share(self, name, arrays):
        self.shared[name] = arrays

    def ledger(self, *args, **kw):
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="resnet18")
    ap.add_argument("--res", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--epochs", type=int, default=1,
                    help="local epochs per update: the client holds batch x steps / epochs images")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--methods", nargs="*", default=None, help="name or name:key=value,key=value")
    args = ap.parse_args()

    from rayfed_dg.config import load_config
    from rayfed_dg.engine import ClientRunner
    from rayfed_dg.engine.workers.worker import to_numpy_state
    from rayfed_dg.methods import GlobalEval, Phase, get_method_class, method_names

    methods = args.methods or [m for m in DEFAULT if m in method_names()]
    rng = np.random.default_rng(0)
    if args.steps % args.epochs:
        ap.error("--steps must be a multiple of --epochs")
    n = args.batch * args.steps // args.epochs
    # client 0 (timed) holds the first n images, client 1 (warm-up peer) the next n
    images = rng.integers(0, 256, (2 * n, args.res, args.res, 3), dtype=np.uint8)
    labels = rng.integers(0, 7, 2 * n).astype(np.int64)
    own, peer = np.arange(n), np.arange(n, 2 * n)
    runners = {}
    for spec in methods:
        name, _, kv = spec.partition(":")
        sets = [f"method.{x}" for x in kv.split(",") if x]
        sets += [f"stages.{st}={{}}" for st in get_method_class(name).stages_needed]
        cfg = load_config(None, [f"model.arch={args.arch}", f"data.resolution={args.res}",
                                 f"training.batch_size={args.batch}", f"training.local_epochs={args.epochs}",
                                 f"engine.num_cpus_per_worker={args.threads}", f"method.name={name}", *sets])
        r = ClientRunner(cfg, images, labels, 7, num_clients=2)
        stage_data: dict = {}
        for i, stage in enumerate(r.stages):
            srv = LocalStageServer(r, i, {0: own, 1: peer})
            stage.run(srv)
            stage_data.update(srv.shared)
        sd = r.model.state_dict()
        g = to_numpy_state(sd, sd.keys())
        local = {k: g[k] for k in r.local_keys}
        # the warm-up round: both clients train, the server's hooks see their uploads
        state: dict = {}
        first = r.method.server_payloads(1, [0, 1], state, np.random.default_rng(1), g, {})
        nval = r.method.client_val_size()  # validation samples, for methods that use them: the client's own
        val = {c: idx[:nval] if nval else None for c, idx in ((0, own), (1, peer))}
        results = [r.run_client(c, 1, idx, g, local, first.get(c, {}), val_indices=val[c], stage_data=stage_data)
                   for c, idx in ((0, own), (1, peer))]
        if Phase.EVALUATE_ON_CLIENTS in r.method.phases:  # e.g. FedDG-GA: the global model on each client's data
            for res, idx in zip(results, (own, peer)):
                correct, loss, cnt = r.evaluate(g, idx, args.batch)
                res.global_eval = GlobalEval(accuracy=correct / cnt, loss=loss / cnt, samples=cnt)
        g = dict(g, **r.method.assemble_global(1, results, g, g, state))  # e.g. COPA's head ensemble
        r.method.after_round(1, results, state)
        # the timed client continues from its own state after round 1 (e.g. CSAC's pre-trained private model)
        local0 = {**{k: results[0].update[k] for k in r.local_keys if k in results[0].update}, **results[0].private}
        prepared = {}
        if Phase.PREPARE in r.method.phases:  # e.g. StableFDG: styles computed with round 2's model before training
            from rayfed_dg.engine import ClientTask

            prepared = {c: r.prepare(ClientTask(client=c, round=2, indices=idx, local_state=local), g)
                        for c, idx in ((0, own), (1, peer))}
        payload = r.method.server_payloads(2, [0, 1], state, np.random.default_rng(2), g, prepared).get(0, {})
        runners[spec] = (r, g, payload, val[0], local0, stage_data)
    torch.set_num_threads(args.threads)
    times = {m: [] for m in methods}
    for rep in range(args.repeat + 1):
        for m in methods:
            r, g, payload, val0, local0, stage_data = runners[m]
            t0 = time.perf_counter()
            r.run_client(0, 2, own, g, local0, payload, val_indices=val0, stage_data=stage_data)
            if rep:  # the first repetition warms up
                times[m].append((time.perf_counter() - t0) / args.steps)
    base = statistics.median(times[methods[0]])
    print(f"backbone {args.arch}, {args.res}px, batch {args.batch}, {args.steps} steps ({args.epochs} epochs of {n} "
          f"images) x {args.repeat} repeats, {args.threads} threads")
    for m in methods:
        t = statistics.median(times[m])
        print(f"{m:40s} {t * 1000:8.1f} ms/step   ratio vs {methods[0]}: {t / base:.3f}")


if __name__ == "__main__":
    main()
