"""The per-client cycle of a worker, phase by phase, for bench/engine_overhead.py's two shapes, measured in one run.

One process, no Ray, one thread (``engine.num_cpus_per_worker: 1``), FedAvg
through the project's own code: a ``ClientRunner`` (the worker's class) and
its method, so the bench times whatever implementation is in the tree.  Per
client, the phases a worker goes through:

1a. receive: the task and the round's global state unpickled as a worker
    gets them (pickle protocol 5, the state's arrays out of band, as Ray's
    object store hands them: zero-copy views; the server's ``ray.put`` of the
    state, once a round, is not in the cycle);
1b. load: ``ClientRunner._client`` (the state copied into the model, seeding,
    the client's context);
2.  optimizer: ``method.make_optimizer`` (and ``model.train()``);
3.  data: each batch drawn from ``ClientRunner.batches`` (batch positions,
    gather, copy to the device, augment, normalise);
4.  forward + backward: ``method.loss`` in the precision's autocast,
    ``backward``, the loss read back;
5.  update: ``zero_grad`` and the optimizer's step;
6.  fold: the upload folded into the worker's partial sum,
    ``ClientRunner.fold`` (``PartialSums.fold``) with a ``Fold`` record;
7.  pack: ``ClientRunner.take_partial`` (the partial packed for the wire),
    once a round, divided by the round's clients;
8a. return: the ``ClientUpdate`` that a real ``ClientRunner.train`` call
    returned for the same client, pickled and unpickled (protocol 5);
8b. merge: the round's ``Partial`` pickled, unpickled and merged by the
    server (``Reducer.add_partial``), once a round, divided by its clients.

Steps 2 to 5 are ``Method.local_train`` / ``train_steps`` taken apart (fp32:
``Precision.step`` is ``backward`` then ``step``).  For comparison, per
client: one real ``ClientRunner.train`` call (a Fold to another federation,
so it never touches the timed partial), whose time should match phases 1b
to 6 (it also runs the hooks the phases skip: ``round_start``,
``upload_payload``, the ``ClientUpdate``); and the bare loop of
bench/engine_overhead.py (``load_state_dict``, a fresh SGD, the steps on
un-augmented batches, a float64 ``add_`` of the state into an accumulator).
The three run client after client, interleaved, so machine noise hits them
alike.  Each figure is the median over the timed clients (the amortised
phases: over the rounds); the whole cycle is the sum of the phases'
medians, each phase's share is of that sum.  A warm-up client (its own
round) comes first, untimed.  The next round starts from the round's
average (``Reducer.result``, timed on its own: the server's, once a round).

On ``--device cuda`` the phases are cut at ``torch.cuda.synchronize()``
(without a GPU it says so and exits 0).

    python bench/client_cycle.py [--shapes resnet,cross_device] [--clients N] [--rounds 2] [--device cpu|cuda]
    python bench/client_cycle.py --smoke     # tiny sizes: the code path, in seconds
"""
from __future__ import annotations

import argparse
import pickle
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_overhead import SHAPES, make_data  # noqa: E402

# (key, label): the rows of the table, in the cycle's order
PHASES = [
    ("receive", "1a receive (unpickle task + state)"),
    ("load", "1b load (ClientRunner._client)"),
    ("optimizer", "2  optimizer (make_optimizer)"),
    ("data", "3  data (ClientRunner.batches)"),
    ("forward_backward", "4  forward + backward"),
    ("update", "5  update (zero_grad, step)"),
    ("fold", "6  fold (ClientRunner.fold)"),
    ("pack", "7  pack (take_partial) / clients"),
    ("return", "8a return (ClientUpdate pickled)"),
    ("merge", "8b merge (Partial, add_partial) / clients"),
]
IN_TRAIN = ("load", "optimizer", "data", "forward_backward", "update", "fold")  # what ClientRunner.train runs
PER_ROUND = ("pack", "merge")
# --smoke: (samples a client, batch size) of each shape, 3 clients x 1 round
SMOKE = {"resnet": (16, 8), "cross_device": (10, 5)}


def wire(obj) -> tuple[bytes, list]:
    """``obj`` pickled as Ray ships it: protocol 5, the arrays' buffers out of band."""
    bufs: list = []
    return pickle.dumps(obj, protocol=5, buffer_callback=bufs.append), bufs


class Laps:
    """Seconds between successive calls, summed by phase name; each cut after ``sync``."""

    def __init__(self, sync: Callable[[], None]):
        self.sync, self.sums = sync, defaultdict(float)
        sync()
        self.t = time.perf_counter()

    def __call__(self, name: str) -> None:
        self.sync()
        now = time.perf_counter()
        self.sums[name] += now - self.t
        self.t = now


@dataclass
class Times:
    phases: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    train: list[float] = field(default_factory=list)
    bare: list[float] = field(default_factory=list)
    result: list[float] = field(default_factory=list)  # the server's Reducer.result, per round
    steps: int = 0
    label: str = ""

    def median(self, key: str) -> float:
        return statistics.median(self.phases[key])



def phased_client(r, task_blob: bytes, state_wire: tuple[bytes, list], sync) -> tuple[dict[str, float], int]:
    """One client's cycle on the worker, phases 1a to 6: (seconds by phase, steps)."""
    from rayfed_dg.seeding import Stream

    lap = Laps(sync)
    task = pickle.loads(task_blob)
    state = pickle.loads(state_wire[0], buffers=state_wire[1])
    lap("receive")
    ctx = r._client(task, state, Stream.TRAIN)
    lap("load")
    opt = r.method.make_optimizer(r.model, ctx.round)
    r.model.train()
    lap("optimizer")
    assert ctx.precision.scaler is None, "the bench steps without a gradient scaler (not fp16)"
    steps = 0
    for x, y in r.batches(task.indices, ctx.generator):
        lap("data")
        with ctx.precision.autocast():
            loss = r.method.loss(r.model, x, y, ctx)
        lap("forward_backward")
        opt.zero_grad(set_to_none=True)
        lap("update")
        loss.backward()
        float(loss.detach())
        lap("forward_backward")
        opt.step()
        lap("update")
        steps += 1
    lap("data")  # the generator's end
    sd = r.model.state_dict()
    r.fold(task.fold, task.client, {k: sd[k] for k in r.upload_keys})
    lap("fold")
    return dict(lap.sums), steps


def bare_client(model, global_sd, acc, cfg, images, labels, idx, cid, rnd, device, sync) -> float:
    """bench/engine_overhead.py's plain loop for one client: seconds."""
    from rayfed_dg.seeding import Stream, seed_int, seed_torch, torch_generator

    t = cfg.training
    mean = torch.tensor(cfg.data.mean).view(1, 3, 1, 1).to(device)
    std = torch.tensor(cfg.data.std).view(1, 3, 1, 1).to(device)
    sync()
    t0 = time.perf_counter()
    model.load_state_dict(global_sd)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay)
    gen = torch_generator(t.seed, Stream.TRAIN, rnd, cid)
    seed_torch(seed_int(t.seed, Stream.TRAIN, rnd, cid), device)
    order = idx[torch.randperm(len(idx), generator=gen).numpy()]
    for s in range(0, len(order), t.batch_size):
        b = order[s:s + t.batch_size]
        x = torch.from_numpy(images[b]).to(device).permute(0, 3, 1, 2).float().div_(255.0)
        x = (x.contiguous(memory_format=torch.channels_last) - mean) / std
        loss = F.cross_entropy(model(x), torch.from_numpy(labels[b]).to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    for k, v in model.state_dict().items():
        acc[k].add_(v, alpha=float(len(idx)))
    sync()
    return time.perf_counter() - t0


def close_round(r, rnd: int, weights: dict[int, float], like: dict[str, np.ndarray], sync,
                times: Times | None) -> dict[str, np.ndarray]:
    """Phases 7 and 8b of round ``rnd`` (per client: over its clients) and the
    server's average, the next round's global state; ``times`` None: untimed."""
    from rayfed_dg.engine.aggregation.exact import Reducer

    n = len(weights)
    sync()
    t0 = time.perf_counter()
    part = r.take_partial(0, rnd, 0)
    t1 = time.perf_counter()
    head, bufs = wire(part)
    red = Reducer(list(weights), weights)
    red.add_partial(pickle.loads(head, buffers=bufs))
    t2 = time.perf_counter()
    avg = red.result(like)
    t3 = time.perf_counter()
    if times is not None:
        times.phases["pack"].append((t1 - t0) / n)
        times.phases["merge"].append((t2 - t1) / n)
        times.result.append(t3 - t2)
    return avg


def run_shape(name: str, per_client: int, batch: int | None, per_round: int, rounds: int, device: str) -> Times:
    """The timed rounds of one shape, after a warm-up round of one client."""
    from dataclasses import replace

    from rayfed_dg.config import load_config
    from rayfed_dg.engine import ClientRunner, ClientTask
    from rayfed_dg.engine.store.records import Fold
    from rayfed_dg.engine.workers.worker import to_numpy_state

    sets = [*SHAPES[name].config, *([f"training.batch_size={batch}"] if batch else []), "data.resolution=32",
            "training.local_epochs=1", "engine.num_cpus_per_worker=1", f"engine.device={device}"]
    cfg = load_config(None, sets)
    n_clients = 1 + per_round * rounds
    images, labels = make_data(n_clients, per_client, 32)
    r = ClientRunner(cfg, images, labels, 10, n_clients)  # sets one thread
    dev = r.device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    sd = r.model.state_dict()
    glob = to_numpy_state(sd, sd.keys())
    bare = r.method.build_model(10).to(dev)  # the bare loop's own model
    t = cfg.training
    times = Times(label=f"{cfg.model.arch} 32px, {per_client} samples/client, batch {t.batch_size}, SGD lr {t.lr:g} "
                        f"momentum {t.momentum:g} weight decay {t.weight_decay:g}")
    first = 0
    for rnd in range(1, rounds + 2):  # round 1: the warm-up client, untimed
        timed = rnd > 1
        clients = list(range(first, first + (per_round if timed else 1)))
        first += len(clients)
        weights = {c: float(per_client) for c in clients}
        state_wire = wire(glob)  # the server's ray.put, once a round
        gsd = {k: torch.as_tensor(v).to(dev) for k, v in glob.items()}
        acc = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in gsd.items()}
        for c in clients:
            idx = np.arange(c * per_client, (c + 1) * per_client)
            task = ClientTask(client=c, round=rnd, indices=idx, local_state={}, fold=Fold(0, rnd, 0, weights[c]))
            phases, steps = phased_client(r, pickle.dumps(task, protocol=5), state_wire, sync)
            sync()
            t0 = time.perf_counter()
            # the real call, as Worker.train_in makes it; its fold goes to another federation's partial
            upd = r.train(replace(task, fold=Fold(1, rnd, 0, weights[c])), glob, views=True)
            sync()
            t1 = time.perf_counter()
            head, bufs = wire(upd)
            pickle.loads(head, buffers=bufs)
            phases["return"] = time.perf_counter() - t1
            b = bare_client(bare, gsd, acc, cfg, images, labels, idx, c, rnd, dev, sync)
            if timed:
                for k, v in phases.items():
                    times.phases[k].append(v)
                times.train.append(t1 - t0)
                times.bare.append(b)
                times.steps = steps
        glob = close_round(r, rnd, weights, glob, sync, times if timed else None)
        r.take_partial(1, rnd, 0)  # the real calls' partial, dropped
    return times


def table(name: str, times: Times, per_round: int, rounds: int, device: str) -> list[str]:
    """The printed breakdown of one shape."""
    ms = {k: 1e3 * times.median(k) for k, _ in PHASES}
    cycle = sum(ms.values())
    train, bare = 1e3 * statistics.median(times.train), 1e3 * statistics.median(times.bare)
    in_train = sum(ms[k] for k in IN_TRAIN)
    out = [f"[{name}] {times.label}; {times.steps} steps a client; {per_round} clients x {rounds} rounds after a "
           f"warm-up client; {device}, {torch.get_num_threads()} thread(s); medians over the clients "
           f"(7 and 8b: over the rounds, per client)",
           f"[{name}]   {'phase':44s} {'ms/client':>10s} {'share':>7s}"]
    for k, lab in PHASES:
        out.append(f"[{name}]   {lab:44s} {ms[k]:10.2f} {100 * ms[k] / cycle:6.1f}%")
    out += [f"[{name}]   {'whole cycle (sum of the phases)':44s} {cycle:10.2f} {100.0:6.1f}%",
            f"[{name}]   {'one real ClientRunner.train call':44s} {train:10.2f}   (phases 1b-6: {in_train:.2f}, "
            f"ratio {in_train / train:.3f})",
            f"[{name}]   {'bare loop (engine_overhead.py plain loop)':44s} {bare:10.2f}   (cycle / bare "
            f"{cycle / bare:.3f}; train call / bare {train / bare:.3f})",
            f"[{name}]   server, once a round, not in the cycle: Reducer.result "
            f"{1e3 * statistics.median(times.result):.2f} ms"]
    return out


def main(argv: list[str] | None = None) -> dict[str, Times]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="resnet,cross_device", help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--clients", type=int, default=None,
                    help="timed clients a round, the partial's (default: the shape's clients a round, 10 and 50)")
    ap.add_argument("--rounds", type=int, default=2, help="timed rounds, after a warm-up round of one client")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (3 clients x 1 round of a few samples)")
    args = ap.parse_args(argv)
    names = args.shapes.split(",")
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        ap.error(f"--shapes: unknown {', '.join(unknown)}; use a comma-separated list of {', '.join(SHAPES)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        from rayfed_dg.engine.workers.worker import cuda_report

        print(f"no GPU available: {cuda_report()}; --device cuda skipped")
        return {}
    out = {}
    for name in names:
        s = SHAPES[name]
        clients, rounds = (3, 1) if args.smoke else (args.clients or s.per_round, args.rounds)
        per_client, batch = SMOKE[name] if args.smoke else (s.per_client, None)
        t0 = time.perf_counter()
        out[name] = run_shape(name, per_client, batch, clients, rounds, args.device)
        print("\n".join(table(name, out[name], clients, rounds, args.device)))
        print(f"[{name}] ({time.perf_counter() - t0:.1f} s)", flush=True)
    return out


if __name__ == "__main__":
    main()
