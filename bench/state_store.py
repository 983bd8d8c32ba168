"""The client-state store at 10^3, 10^4 and 10^5 clients: the server's memory and checkpoint bytes per round.

FedBN (each client keeps its BN layers) and SCAFFOLD (each keeps a control
variate as large as the model) on the 32 px conv net, 20 clients a round,
5 rounds, a checkpoint every round, the same worker pool at every scale.
To keep the dataset and the split out of the comparison, clients index 30
shared blocks of 64 images (client i holds block i mod 30: the split's
index arrays are 30 objects however many clients there are; the printed
``split`` column is its pickled size, what the server receives).  The
store's memory budget is 4 MiB (``engine.client_state_memory_mb``), less
than the states the run touches, so it spills.

Per run it prints the server actor's RSS (the whole process: torch, the
model, the split, the store) after round 1 and its peak after each round,
the store's own bytes in memory and in its spill file after the last
round, and each checkpoint's bytes: its ``.pt`` (global model, server and
optimizer state, the names and digests of the pieces it is made of), its
piece (the states changed since the previous checkpoint) per round and per
client trained since the previous checkpoint, and the piece's index, the
checkpoint's manifest (which client is where: the clients it wrote).  A
last run at 10^5 trains twice the clients a round, so the pieces'
proportionality shows.  Then: the memory ratio 10^5 / 10^3 (target <= 1.2),
and what a plain store (a dict in the server, all of it in every
checkpoint) would have held: clients touched x state size, and the
population x state size once every client is touched.

A last case (``--many``, FedBN only) touches many clients: 10^5 clients,
``--many-per-round`` (500) a round for ``--many-rounds`` (24) rounds, a
narrow conv net (width 8) trained one step a client without evaluation, so
about 10^4 distinct clients are touched.  Per checkpoint it prints the
clients written, the piece's and its index's bytes, the ``.pt``'s, the
pieces the checkpoint names, and the manifest a checkpoint wrote before
(32 bytes for every client ever touched): the index stays 16 bytes a
written client while the clients touched grow.

    python bench/state_store.py [--rounds 5] [--per-round 20] [--methods fedbn scaffold]
                                [--many-rounds 24] [--many-per-round 500] [--skip-scales]
"""
from __future__ import annotations

import argparse
import os
import pickle
import shutil
import tempfile
from pathlib import Path

import numpy as np
import psutil

SCALES = (1_000, 10_000, 100_000)
BUDGET_MB = 4
OLD_MANIFEST = 32  # bytes a client in the manifest every checkpoint wrote before pieces had an index


def index_bytes(piece: Path) -> int:
    """The bytes of a piece's index: its last 8 bytes say how long it is (``clientstore.py``)."""
    with open(piece, "rb") as f:
        f.seek(-8, 2)
        return int.from_bytes(f.read(8), "little") + 8


def block_population(n_clients: int):
    """(images, labels, split): random 32 px images, client i holding block i mod 30 of 64 images, one source
    domain's validation and the target's test of 32 each."""
    from rayfed_dg.data.protocol import FederatedSplit

    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (30 * 64 + 64, 32, 32, 3), dtype=np.uint8)
    labels = rng.integers(0, 10, len(images)).astype(np.int64)
    blocks = [np.arange(b * 64, (b + 1) * 64) for b in range(30)]
    split = FederatedSplit("t", [blocks[i % 30] for i in range(n_clients)], ["d"] * n_clients,
                           {"d": np.arange(1920, 1952)}, {"t": np.arange(1952, 1984)})
    return images, labels, split


def run(method: str, n_clients: int, rounds: int, per_round: int, tiny: bool = False) -> dict:
    import ray
    import torch

    from rayfed_dg.config import load_config
    from rayfed_dg.engine import run_federation
    from rayfed_dg.engine.running.host import EngineHost
    from rayfed_dg.engine.store.clientstore import piece_name, read_index

    images, labels, split = block_population(n_clients)
    cfg = load_config(None, [f"method.name={method}", f"training.clients_per_round={per_round}",
                             f"training.rounds={rounds}", "training.batch_size=32", "evaluation.every=0",
                             "evaluation.personal=false", "engine.num_workers=2", "engine.num_cpus_per_worker=1",
                             "output.checkpoint_every=1", "output.save_best_checkpoint=false",
                             f"engine.client_state_memory_mb={BUDGET_MB}",
                             *(["model.width=8", "training.local_steps=1", "training.batch_size=8"] if tiny else [])])
    run_dir = Path(tempfile.mkdtemp(prefix="rayfed-dg-bench-store-"))
    ckpt = run_dir / "checkpoints" / "t"
    host = EngineHost(cfg.engine, [ray.put(images), ray.put(labels)], 2)
    pid = ray.get(host.server.__ray_call__.remote(lambda self: os.getpid()))
    server = psutil.Process(pid)
    rows: list[dict] = []
    touched: set[int] = set()

    def on_round(out, res) -> None:
        trained = {c.client for c in out.clients if not c.dropped}
        store = ray.get(host.server.__ray_call__.remote(
            lambda self, c: (self.fed.store.memory_bytes, self.fed.store.spill_bytes, self.fed.store.get(c)),
            min(trained)))
        touched.update(trained)
        piece = ckpt / piece_name(out.round)
        pt = ckpt / f"round_{out.round:05d}.pt"
        rows.append({"round": out.round, "rss": server.memory_info().rss, "mem": store[0], "spill": store[1],
                     "pt": pt.stat().st_size, "piece": piece.stat().st_size if piece.exists() else 0,
                     "index": index_bytes(piece) if piece.exists() else 0,
                     "written": len(read_index(piece)[0]) if piece.exists() else 0,
                     "named": len(torch.load(pt, weights_only=True)["server"]["client_pieces"]["pieces"]),
                     "trained": len(trained), "touched": len(touched),
                     "state": sum(v.nbytes for v in store[2].values())})

    try:
        run_federation(cfg, split, None, None, 10, run_dir, progress=False, on_round=on_round, host=host)
    finally:
        host.close()
        shutil.rmtree(run_dir, ignore_errors=True)
    return {"rows": rows, "split": len(pickle.dumps(split))}


def line(label: str, o: dict) -> str:
    rs, mib = o["rows"], 2**20
    piece = [r["piece"] for r in rs]
    per = [r["piece"] / r["trained"] / 1024 for r in rs]
    peak = max(r["rss"] for r in rs)
    return (f"{label:>9} {o['split'] / 1024:6.0f} K {rs[0]['rss'] / mib:8.0f} MiB {peak / mib:5.0f} MiB "
            f"{rs[-1]['mem'] / mib:6.2f} MiB {rs[-1]['spill'] / mib:5.2f} MiB {rs[-1]['pt'] / mib:5.2f} MiB "
            f"{np.mean(piece) / mib:6.2f} MiB {np.mean(per):8.1f} KiB ({min(per):.1f}-{max(per):.1f}) "
            f"{np.mean([r['index'] for r in rs]) / 1024:6.2f} KiB"
            f"  for {', '.join(str(r['trained']) for r in rs)} clients")


def many(rounds: int, per_round: int) -> None:
    """FedBN at 10^5 clients touching many of them: each checkpoint's bytes against the clients touched so far."""
    n = SCALES[-1]
    o = run("fedbn", n, rounds, per_round, tiny=True)
    print(f"\nfedbn, many clients touched: {n:,} clients, {per_round} a round, {rounds} rounds, a checkpoint every "
          f"round, conv net width 8, one local step, no evaluation")
    print(f"{'round':>5} {'trained':>7} {'touched':>7} {'written':>7} {'piece':>10} {'index':>10} "
          f"{'index/written':>13} {'.pt':>9} {'pieces':>6} {'manifest before':>15}")
    for r in o["rows"]:
        print(f"{r['round']:5d} {r['trained']:7d} {r['touched']:7d} {r['written']:7d} {r['piece'] / 1024:6.1f} KiB "
              f"{r['index'] / 1024:6.2f} KiB {r['index'] / max(r['written'], 1):11.2f} B {r['pt'] / 1024:5.1f} KiB "
              f"{r['named']:6d} {OLD_MANIFEST * r['touched'] / 1024:11.1f} KiB")
    rs = o["rows"]
    half = len(rs) // 2
    early, late = (np.mean([r["index"] for r in part]) for part in (rs[:half], rs[half:]))
    print(f"index per checkpoint, second half of the rounds / first half: {late / early:.3f} while the clients "
          f"touched grew {np.mean([r['touched'] for r in rs[half:]]) / np.mean([r['touched'] for r in rs[:half]]):.2f}x"
          f" (the manifest before grew as they did)")
    trained = sum(r["trained"] for r in rs[1:])
    print(f".pt: {(rs[-1]['pt'] - rs[0]['pt']) / trained:.0f} bytes more per client trained (the records a checkpoint "
          f"carries; the client and ledger rows stay in the run directory's tables), {rs[-1]['pt'] / 1024:.0f} KiB at "
          "the last round")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--per-round", type=int, default=20)
    ap.add_argument("--methods", nargs="+", default=["fedbn", "scaffold"])
    ap.add_argument("--many-rounds", type=int, default=24)
    ap.add_argument("--many-per-round", type=int, default=500)
    ap.add_argument("--skip-scales", action="store_true", help="only the many-clients case")
    args = ap.parse_args()
    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    mib, big = 2**20, SCALES[-1]
    try:
        for method in [] if args.skip_scales else args.methods:
            out = {n: run(method, n, args.rounds, args.per_round) for n in SCALES}
            double = run(method, big, args.rounds, 2 * args.per_round)
            print(f"\n{method}: {args.per_round} clients a round, {args.rounds} rounds, checkpoint every round, "
                  f"memory budget {BUDGET_MB} MiB; the last row trains {2 * args.per_round} a round")
            print(f"{'clients':>9} {'split':>8} {'server RSS r1':>12} {'peak':>9} {'store mem':>10} {'spill':>9} "
                  f"{'.pt':>9} {'piece/round':>11} {'piece per trained client':>25} {'index':>10}")
            for n, o in out.items():
                print(line(f"{n}", o))
            print(line(f"{big}x2", double))
            peak = {n: max(r["rss"] for r in o["rows"]) for n, o in out.items()}
            pieces = [np.mean([r["piece"] for r in o["rows"]]) for o in (double, out[big])]
            size, touched = out[big]["rows"][-1]["state"], out[big]["rows"][-1]["touched"]
            print(f"server peak RSS 10^5 / 10^3: {peak[big] / peak[SCALES[0]]:.3f} (target <= 1.2); piece per round "
                  f"at {2 * args.per_round} / {args.per_round} clients a round: "
                  f"{pieces[0] / pieces[1]:.3f}")
            print(f"a plain store (a dict, all of it in memory and in every checkpoint), {size / 1024:.1f} KiB "
                  f"a client: {touched * size / mib:.1f} MiB after these {touched} clients, "
                  + ", ".join(f"{n * size / mib:,.0f} MiB" for n in SCALES) + " with every client of "
                  + ", ".join(f"{n:,}" for n in SCALES) + " touched")
        if args.many_rounds:
            many(args.many_rounds, args.many_per_round)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
