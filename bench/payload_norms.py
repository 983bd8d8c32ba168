"""The L2 norm of one record of each shared statistic (``privacy.payloads`` group) on a benchmark's clients.

A clip is sensible near the norm a record typically has: far below it the
clipping rewrites every record, far above it the noise (std z x clip)
drowns them.  Each source domain's client computes what it would release,
through the engine's own client code (``ClientRunner``, without Ray, with
DP off): the data stages' statistics once (CCST's styles, overall and
single; the amplitude spectra), the methods' per round with round 1's
global model (the initial one) and round 2's (FedAvg of one round of local
training, the clients' styles not exchanged); FedDG-GA's and SCAFFOLD's
uploads after round 1's local training.  Prints, per group, what one record
is, the records measured and the median, 90th percentile and largest norm.

    python bench/payload_norms.py [--config configs/digits/base.yaml] [--style-images 256]
"""
from __future__ import annotations

import argparse

import numpy as np
import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/digits/base.yaml")
    ap.add_argument("--set", nargs="*", default=[], help="config overrides, key=value")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    from rayfed_dg.config import load_config
    from rayfed_dg.engine import ClientRunner, ClientTask, load_data, resolve_targets, split_for
    from rayfed_dg.engine.workers.worker import to_numpy_state
    from rayfed_dg.stages import StageClient, build_stages

    torch.set_num_threads(args.threads)
    base = load_config(args.config, args.set)
    ds = load_data(base)
    targets = resolve_targets(ds, "all")
    # each source domain's client once: the split that leaves out the next domain
    clients = []
    for i, dom in enumerate(targets):
        split = split_for(base, ds, targets[(i + 1) % len(targets)])
        c = split.client_domains.index(dom)
        clients.append((dom, split.clients[c], split.val[dom]))
    norms: dict[tuple[str, str, str], list[float]] = {}

    def add(group: str, who: str, record: str, rows: np.ndarray) -> None:
        flat = np.asarray(rows, np.float64).reshape(len(rows), -1) if record == "image" else \
            np.asarray(rows, np.float64).reshape(1, -1)
        norms.setdefault((group, who, record), []).extend(np.linalg.norm(flat, axis=1).tolist())

    view = StageClient(images=ds.images, labels=ds.labels, device=torch.device("cpu"), threads=args.threads,
                       seed=base.training.seed, resolution=base.data.resolution)
    for style in ("overall", "single"):
        cfg = load_config(args.config, [*args.set, f"stages.ccst={{style: {style}}}"])
        stage = build_stages(cfg)[0]
        for cid, (_, idx, _) in enumerate(clients):
            add("ccst_style", f"stage ccst ({style})", stage.shared_payloads["ccst_style"],
                stage.client_style(view, cid, idx))
    cfg = load_config(args.config, [*args.set, "stages.amplitude={}"])
    stage = build_stages(cfg)[0]
    for cid, (_, idx, _) in enumerate(clients):
        add("amplitude_spectra", "stage amplitude", "image", stage.client_spectra(view, cid, idx))

    for name, group in (("stablefdg", "style"), ("fediir", "fediir_grad_sum")):
        cfg = load_config(args.config, [*args.set, f"method.name={name}"])
        r = ClientRunner(cfg, ds.images, ds.labels, ds.num_classes, len(clients))
        sd = r.model.state_dict()
        g = to_numpy_state(sd, sd.keys())
        for rnd in (1, 2):
            for cid, (_, idx, _) in enumerate(clients):
                out = r.prepare(ClientTask(client=cid, round=rnd, indices=idx, local_state={}), g)
                add(group, f"method {name} (round {rnd})", "client", out[group][None])
            ups = [r.run_client(cid, rnd, idx, g) for cid, (_, idx, _) in enumerate(clients)]
            n = np.array([len(idx) for _, idx, _ in clients], np.float64)
            g = {k: (sum(w * u.update[k].astype(np.float64) for w, u in zip(n, ups)) / n.sum()).astype(g[k].dtype)
                 if k in ups[0].update else g[k] for k in g}

    for name, group in (("scaffold", "scaffold_dc"), ("feddg_ga", "ga_local")):
        cfg = load_config(args.config, [*args.set, f"method.name={name}"])
        r = ClientRunner(cfg, ds.images, ds.labels, ds.num_classes, len(clients))
        sd = r.model.state_dict()
        g = to_numpy_state(sd, sd.keys())
        down = r.method.server_payloads(1, list(range(len(clients))), {}, np.random.default_rng(0), g, {})
        for cid, (_, idx, val) in enumerate(clients):
            up = r.run_client(cid, 1, idx, g, {}, down.get(cid, {}), val_indices=val)
            add(group, f"method {name} (round 1)", "client", up.payload[group][None])

    d = base.data
    print(f"{d.name} at {d.resolution} px, model {base.model.arch} width {base.model.width}, "
          f"{base.training.local_steps or base.training.local_epochs} local "
          f"{'steps' if base.training.local_steps else 'epochs'}, clients {', '.join(c[0] for c in clients)}")
    print(f"{'group':20s} {'sent by':32s} {'record':7s} {'records':>7s} {'median':>10s} {'p90':>10s} {'max':>10s}")
    for (group, who, record), v in norms.items():
        a = np.array(v)
        print(f"{group:20s} {who:32s} {record:7s} {len(a):7d} {np.median(a):10.4g} {np.quantile(a, 0.9):10.4g} "
              f"{a.max():10.4g}")


if __name__ == "__main__":
    main()
