"""Figures of runs (``rayfed-dg plot RUN_DIR ... --kind ...``), as PNGs.

``curves``   learning curves per target: mean source-validation accuracy
             (and, dashed, each client's own model for methods with
             client-local state) and target accuracy per round, one line
             per method (the mean over its seeds, with a band of ± one
             standard error when there are several), each seed's round
             selected by training-domain validation marked with a star;
             ``--x sim_time``: against the virtual clock's simulated time
             (runs with ``devices.enabled``), as step curves, a seed's
             accuracy holding until its next evaluation
``clients``  each client's local training loss per round, coloured by its
             domain, one figure per run; beyond a dozen clients, a dot per
             sampled client and round and a line per domain (the mean over
             that round's sampled clients of the domain)
``tsne``     t-SNE (``pca``: PCA) of the saved global model's penultimate
             features (``model.features``) on every domain's held-out
             images (source validation splits and the target), coloured by
             domain and marked by class: the figure FedDG papers use to show
             domain-invariant features; one figure per run and target

Reads records (``metrics``, ``clients``), ``summary.json``, ``config.yaml``
and ``best_<target>.pt`` / ``final_<target>.pt``; works on runs still going
or killed for ``curves`` and ``clients``.  Methods and targets appear in the
order of the run's config and ``report``'s table, under the same labels;
accuracies are in percent, as in every table.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import numpy as np

from rayfed_dg.engine.running.plan import load_data
from rayfed_dg.engine.running.reevaluate import load_run_config, saved_features
from rayfed_dg.engine.store.records import split_means
from rayfed_dg.engine.store.rundir import RunDir
from rayfed_dg.engine.store.selection import TrainingDomainValidation
from rayfed_dg.errors import ConfigError
from rayfed_dg.reporting import RunRecord, collect_runs

MARKERS = "os^vDPX*<>hp8dH"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_")


def _save(fig, path: Path) -> Path:
    from rayfed_dg.utils import atomic_write_with

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_with(path, lambda buf: fig.savefig(buf, dpi=130, format="png", bbox_inches="tight"))
    _plt().close(fig)
    return path


def _integer_rounds(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _targets(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(r["target"] for r in rows))


def _target_order(runs: list[RunRecord], rows: list[dict]) -> list[str]:
    """The targets in the order the runs ran them (their summaries or
    ``run.json``), then any other target seen in ``rows``."""
    order = [t for r in runs for t in (r.targets() or [])]
    seen = set(_targets(rows))
    return [t for t in dict.fromkeys(order) if t in seen] + [t for t in _targets(rows) if t not in set(order)]


def _by_round(rows: list[dict], target: str, split: str) -> dict[int, float]:
    return split_means((r for r in rows if r["target"] == target), split)


def _by_sim_time(rows: list[dict], target: str, split: str) -> dict[float, float]:
    """``_by_round`` keyed by each round's simulated time (its aggregation on the virtual clock)."""
    when = {r["round"]: r["sim_time"] for r in rows if r["target"] == target and r.get("sim_time") is not None}
    return {when[rnd]: acc for rnd, acc in _by_round(rows, target, split).items() if rnd in when}


def _common_x(per_seed: list[dict], x: str) -> tuple[list, list[dict]]:
    """The points every seed's curve has: the rounds all evaluated; on the
    clock, from the latest first point on, every seed's evaluation times,
    each seed holding its last value before (a step curve: the accuracy a
    seed had at that simulated time)."""
    if x == "round":
        return sorted(set.intersection(*(set(c) for c in per_seed))), per_seed
    xs = sorted({t for c in per_seed for t in c if t >= max(min(c) for c in per_seed)})
    return xs, [{t: c[max(s for s in c if s <= t)] for t in xs} for c in per_seed]


def _mean_curve(ax, label: str, split: str, per_seed: list[dict], x: str, color, legend: bool) -> dict:
    """The mean over seeds of ``per_seed``'s curves drawn on ``ax`` (with a
    band of ± one standard error over several seeds); returns it by point."""
    rounds, per_seed = _common_x(per_seed, x)
    mean = {r: 100 * float(np.mean([c[r] for c in per_seed])) for r in rounds}
    n = len(per_seed)
    name = f"{label} (own client models)" if split == "personal_val" else \
        f"{label}" + (f" ({n} seeds, band ± SE)" if n > 1 else "")
    ax.plot(rounds, [mean[r] for r in rounds], color=color, lw=1.6, ls="--" if split == "personal_val" else "-",
            drawstyle="default" if x == "round" else "steps-post", label=name if legend else None)
    if n > 1:  # the spread over seeds: mean ± standard error, as report's cells
        se = np.array([100 * np.std([c[r] for c in per_seed], ddof=1) / np.sqrt(n) for r in rounds])
        m = np.array([mean[r] for r in rounds])
        ax.fill_between(rounds, m - se, m + se, color=color, lw=0, step=None if x == "round" else "post",
                        alpha=0.12 if split == "personal_val" else 0.22)
    return mean


def _mark_selected(ax, ms: list[list[dict]], target: str, x: str, mean: dict, color) -> None:
    """Each seed's selected round (training-domain validation) as a star on the mean curve ``mean``."""
    for rows in ms:
        sel = TrainingDomainValidation().choose([r for r in rows if r["target"] == target])
        if sel is not None and x == "sim_time":
            sel = next((r["sim_time"] for r in rows if r["target"] == target and r["round"] == sel), None)
        if sel in mean:
            ax.plot([sel], [mean[sel]], marker="*", ms=12, color=color, mec="black", mew=0.6, ls="none", zorder=5)


def _legend_below(plt, fig, axes) -> None:
    """One legend under the figure: the first column's lines and the selection's star."""
    handles, labels = [], []
    for ax in axes[:, 0]:
        h, lab = ax.get_legend_handles_labels()
        handles += h
        labels += lab
    handles.append(plt.Line2D([], [], marker="*", ms=11, color="grey", mec="black", ls="none"))
    labels.append("round selected by training-domain validation")
    ncol = max(1, min(len(labels), int(fig.get_figwidth() // 2.6)))
    fig.tight_layout()
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=ncol, fontsize=8, frameon=False)


def learning_curves(runs: dict[str, list[RunRecord]], targets: list[str] | None, path: Path,
                    x: str = "round") -> Path:
    """``x``: ``round``, or ``sim_time``: the virtual clock's seconds (runs with ``devices.enabled``)."""
    plt = _plt()
    metrics = {label: [r.metrics() or [] for r in rs] for label, rs in runs.items()}
    if x == "sim_time" and not any(m.get("sim_time") is not None for ms in metrics.values() for rows in ms
                                   for m in rows):
        raise ConfigError("--x sim_time: these runs have no simulated time (devices.enabled was off); "
                          "plot them with --x round")
    by_x = _by_round if x == "round" else _by_sim_time
    targets = targets or _target_order([r for rs in runs.values() for r in rs],
                                       [m for ms in metrics.values() for rows in ms for m in rows])
    if not targets:
        raise ConfigError("no evaluation rows in these runs yet")
    fig, axes = plt.subplots(2, len(targets), figsize=(3.6 * len(targets) + 1.2, 6.4), squeeze=False,
                             sharex="col")
    cmap = plt.get_cmap("tab10")
    for j, t in enumerate(targets):
        for i, (label, ms) in enumerate(metrics.items()):
            color = cmap(i % 10)
            curves = {split: [by_x(rows, t, split) for rows in ms]
                      for split in ("source_val", "target_test", "personal_val")}
            for row, split in ((0, "source_val"), (1, "target_test"), (0, "personal_val")):
                per_seed = [c for c in curves[split] if c]
                if not per_seed:
                    continue
                mean = _mean_curve(axes[row, j], label, split, per_seed, x, color,
                                   legend=j == 0 and (row == 1 or split == "personal_val"))
                if split != "personal_val":
                    _mark_selected(axes[row, j], ms, t, x, mean, color)
        axes[0, j].set_title(f"target {t}", fontsize=10)
        axes[1, j].set_xlabel("round" if x == "round" else "simulated time (s)")
    axes[0, 0].set_ylabel("mean source-validation accuracy (%)")
    axes[1, 0].set_ylabel("target accuracy (%)")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        if x == "round":
            _integer_rounds(ax)
    _legend_below(plt, fig, axes)
    return _save(fig, path)


FEW_CLIENTS = 12  # up to this many clients, a line per client; beyond, dots and a line per domain


def client_losses(run: RunRecord, title: str, path: Path, targets: list[str] | None = None) -> Path:
    rows = RunDir(run.path).read_rows("clients")
    targets = targets or _target_order([run], rows)
    if not targets:
        raise ConfigError(f"{run.path}: no client rows yet")
    return _save(client_losses_figure(rows, targets, title), path)


def client_losses_figure(rows: list[dict], targets: list[str], title: str):
    """Each client's mean local training loss per round (``clients`` rows).
    Up to ``FEW_CLIENTS`` clients: a line per client, with a marker on every
    round it trained (a client sampled once is a dot).  Beyond: a dot per
    sampled client and round, and per domain a line through the mean of its
    sampled clients each round, so every client-round is on the figure at
    any scale."""
    plt = _plt()
    domains = sorted({r["domain"] for r in rows})  # colours as in the feature maps: domains in name order
    cmap = plt.get_cmap("tab10")
    fig, axes = plt.subplots(1, len(targets), figsize=(3.8 * len(targets) + 0.8, 3.6), squeeze=False)
    many = False
    for j, t in enumerate(targets):
        ax = axes[0, j]
        mine = [r for r in rows if r["target"] == t and r["train_loss"] is not None]
        clients = sorted({r["client"] for r in mine})
        per_round: dict[int, int] = {}
        for r in mine:
            per_round[r["round"]] = per_round.get(r["round"], 0) + 1
        k = max(per_round.values(), default=0)
        if len(clients) <= FEW_CLIENTS:
            for c in clients:
                pts = sorted((r["round"], r["train_loss"]) for r in mine if r["client"] == c)
                dom = next(r["domain"] for r in mine if r["client"] == c)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], color=cmap(domains.index(dom) % 10),
                        lw=1.4, alpha=0.9, marker="o", ms=3)
        else:
            many = True
            rng = np.random.default_rng(0)  # a little horizontal jitter keeps a round's dots apart
            for d in domains:
                pts = [(r["round"], r["train_loss"]) for r in mine if r["domain"] == d]
                if not pts:
                    continue
                color = cmap(domains.index(d) % 10)
                x = np.array([p[0] for p in pts], float)
                ax.scatter(x + rng.uniform(-0.15, 0.15, len(x)), [p[1] for p in pts], s=8, color=color, alpha=0.5,
                           linewidths=0)
                rounds = sorted({p[0] for p in pts})
                ax.plot(rounds, [np.mean([p[1] for p in pts if p[0] == r]) for r in rounds], color=color, lw=1.8,
                        marker="o", ms=3)
        sampled = f", {k} a round" if k < len(clients) else ""
        ax.set_title(f"target {t}: {len(clients)} clients trained{sampled}", fontsize=10)
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
        _integer_rounds(ax)
    axes[0, 0].set_ylabel("mean local training loss")
    handles = [plt.Line2D([], [], color=cmap(i % 10), lw=2, marker="o", ms=3) for i in range(len(domains))]
    labels = [f"domain {d}: sampled clients (dots), their mean (line)" if many else f"client of {d}"
              for d in domains]
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0),
               ncol=max(1, min(len(domains), int(fig.get_figwidth() // (4.5 if many else 1.8)))), fontsize=8,
               frameon=False)
    return fig


def feature_map(feats: dict[str, np.ndarray], kind: str, class_names: list[str], domain_order: list[str],
                title: str, path: Path) -> Path:
    """2-D embedding of ``feats`` (``engine.running.reevaluate.saved_features``),
    colour = domain, marker = class."""
    plt = _plt()
    x = feats["features"].astype(np.float64)
    if kind == "pca":
        from sklearn.decomposition import PCA

        xy = PCA(n_components=2, random_state=0).fit_transform(x)
    else:
        from sklearn.manifold import TSNE

        xy = TSNE(n_components=2, perplexity=float(min(30, max(5, (len(x) - 1) // 3))), init="pca",
                  random_state=0).fit_transform(x)
    cmap = plt.get_cmap("tab10")
    domain_order = sorted(domain_order)  # colours as in the client plots: domains in name order
    fig, ax = plt.subplots(figsize=(9.0, 6.4))
    fig.subplots_adjust(left=0.03, right=0.70, top=0.86, bottom=0.03)
    domains = [d for d in domain_order if d in set(feats["domain"])]
    classes = sorted(set(feats["label"].tolist()))
    for d in domains:
        in_d = feats["domain"] == d
        tgt = bool(feats["is_target"][in_d][0])
        for c in classes:
            m = in_d & (feats["label"] == c)
            if m.any():
                ax.scatter(xy[m, 0], xy[m, 1], s=16 if tgt else 12, marker=MARKERS[c % len(MARKERS)],
                           color=cmap(domain_order.index(d) % 10), alpha=0.75, linewidths=0.4,
                           edgecolors="black" if tgt else "none")
    dom_handles = [plt.Line2D([], [], marker="o", ls="none", color=cmap(domain_order.index(d) % 10),
                              mec="black" if bool(feats["is_target"][feats["domain"] == d][0]) else "none")
                   for d in domains]
    dom_labels = [f"{d} (target)" if bool(feats["is_target"][feats["domain"] == d][0]) else f"{d} (source val)"
                  for d in domains]
    fig.legend(dom_handles, dom_labels, title="domain (colour)", loc="upper left", bbox_to_anchor=(0.71, 0.86),
               fontsize=8, title_fontsize=8, frameon=False)
    cls_handles = [plt.Line2D([], [], marker=MARKERS[c % len(MARKERS)], ls="none", color="grey") for c in classes]
    fig.legend(cls_handles, [class_names[c] for c in classes], title="class (marker)", loc="lower left",
               bbox_to_anchor=(0.71, 0.03), fontsize=8, title_fontsize=8, frameon=False, ncol=2)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_title(title, fontsize=9)
    return _save(fig, path)


def plot_runs(run_dirs: list[Path], kind: str, out: Path | None = None, target: str | None = None,
              weights: str = "best", per_domain: int = 200, x: str = "round") -> list[Path]:
    """Write the ``kind`` figures of the runs under ``run_dirs``; returns the
    PNG paths; ``x``: the curves' axis (``round`` or ``sim_time``)."""
    runs = collect_runs(run_dirs, unfinished=kind in ("curves", "clients"))
    if not runs:
        raise ConfigError(f"no runs with records under {', '.join(map(str, run_dirs))}")
    out = out or Path(run_dirs[0]) / "plots"
    targets = [t.strip() for t in target.split(",")] if target else None
    if kind == "curves":
        return [learning_curves(runs, targets, out / ("curves.png" if x == "round" else "curves_sim_time.png"), x)]
    paths = []
    for label, rs in runs.items():
        for run in rs:
            seed = run.summary.get("seed")
            tag = _slug(label) + (f"_seed{seed}" if len(rs) > 1 and seed is not None else "")
            if kind == "clients":
                what = label + (f", seed {seed}" if seed is not None else "")
                paths.append(client_losses(run, f"{what}: local training loss per client", out / f"clients_{tag}.png",
                                           targets))
                continue
            paths += _feature_maps(run, label, tag, kind, out, targets, weights, per_domain)
    return paths


_DATA: dict[str, Any] = {}


def _feature_maps(run: RunRecord, label: str, tag: str, kind: str, out: Path, targets: list[str] | None,
                  weights: str, per_domain: int) -> list[Path]:
    import json

    cfg = load_run_config(run.path, [])
    key = json.dumps(cfg.data.model_dump(mode="json"), sort_keys=True)
    if key not in _DATA:
        _DATA.clear()  # one dataset in memory at a time
        _DATA[key] = load_data(cfg)
    ds = _DATA[key]
    paths = []
    for t in targets or list(run.summary.get("targets", {})):
        # t-SNE takes up to a minute a figure on 2 cores: say what is being computed
        print(f"{'t-SNE' if kind == 'tsne' else 'PCA'}: {label}" + (f", seed {run.summary['seed']}" if
              run.summary.get("seed") is not None else "") + f", target {t}: features of up to {per_domain} "
              "held-out images per domain" + (" (up to a minute on 2 cores)" if kind == "tsne" else ""),
              file=sys.stderr, flush=True)
        feats = saved_features(cfg, ds, t, run.path, weights, per_domain)
        s = run.summary.get("targets", {}).get(t, {})
        which = f"round {s.get('selected_round')} (selected by source validation)" if weights == "best" else \
            "the last round"
        name = "t-SNE" if kind == "tsne" else "PCA"
        seed = run.summary.get("seed")
        acc = s.get("target_acc") if weights == "best" else None
        title = (f"{label}" + (f", seed {seed}" if seed is not None else "") + f", target {t}"
                 + (f" (accuracy {100 * acc:.1f}%)" if acc is not None else "")
                 + f"\n{name} of the global model's penultimate features, {which};\n"
                 f"held-out images (source validation splits, target), at most {per_domain} per domain")
        paths.append(feature_map(feats, kind, list(ds.class_names), list(ds.domain_names), title,
                                 out / f"{kind}_{tag}_{_slug(t)}.png"))
    return paths
