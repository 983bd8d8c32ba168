"""Reports from records: partition summaries and heatmaps (like FedFD-A Fig. 7)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from rayfed_dg.data import DomainDataset, FederatedSplit
from rayfed_dg.utils import render_table


def client_class_counts(ds: DomainDataset, split: FederatedSplit) -> np.ndarray:
    return np.stack([np.bincount(ds.labels[idx], minlength=ds.num_classes) for idx in split.clients])


def client_domain_counts(ds: DomainDataset, split: FederatedSplit) -> np.ndarray:
    return np.stack([np.bincount(ds.domains[idx], minlength=len(ds.domain_names)) for idx in split.clients])


def partition_summary(ds: DomainDataset, split: FederatedSplit) -> str:
    cc, dc = client_class_counts(ds, split), client_domain_counts(ds, split)
    lines = [f"target {split.target}: {split.num_clients} clients, {int(cc.sum())} training samples; "
             f"validation {', '.join(f'{d} {len(v)}' for d, v in split.val.items())}; "
             f"test {len(next(iter(split.test.values())))}",
             f"{'client':>6} {'size':>6}  {'domains':30s} classes (" + " ".join(ds.class_names) + ")"]
    for i in range(split.num_clients):
        doms = ", ".join(f"{ds.domain_names[j]} {n}" for j, n in enumerate(dc[i]) if n)
        lines.append(f"{i:>6} {int(cc[i].sum()):>6}  {doms:30s} " + " ".join(str(int(x)) for x in cc[i]))
    return "\n".join(lines)


def partition_heatmap(ds: DomainDataset, split: FederatedSplit, path: Path, title: str = "") -> Path:
    """Clients x classes sample counts, with each client's domain mix in a
    strip on the left."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cc, dc = client_class_counts(ds, split), client_domain_counts(ds, split)
    n = split.num_clients
    h = max(3.0, 0.22 * n + 1.5)
    fig, (ax_d, ax) = plt.subplots(1, 2, figsize=(2 + 0.5 * ds.num_classes + 1.5, h),
                                   gridspec_kw={"width_ratios": [1, max(2, ds.num_classes / 2)]}, sharey=True)
    frac = dc / np.maximum(dc.sum(1, keepdims=True), 1)
    cmap = plt.get_cmap("tab10")
    left = np.zeros(n)
    for j, name in enumerate(ds.domain_names):
        if frac[:, j].any():
            ax_d.barh(np.arange(n), frac[:, j], left=left, color=cmap(j % 10), label=name, height=0.9)
            left += frac[:, j]
    ax_d.set_xlim(0, 1)
    ax_d.set_xlabel("domain share")
    ax_d.set_ylabel("client")
    ax_d.legend(loc="upper center", bbox_to_anchor=(0.5, -0.08 - 0.3 / h), fontsize=7, ncol=1, frameon=False)
    im = ax.imshow(cc, aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_xticks(range(ds.num_classes), ds.class_names, rotation=45, ha="right", fontsize=7)
    ax.set_yticks(range(n), [str(i) for i in range(n)], fontsize=6)
    ax.set_xlabel("class")
    if n <= 40 and ds.num_classes <= 12:
        for i in range(n):
            for c in range(ds.num_classes):
                ax.text(c, i, str(int(cc[i, c])), ha="center", va="center", fontsize=5,
                        color="white" if cc[i, c] < cc.max() / 2 else "black")
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.02, label="samples")
    fig.suptitle(title or f"partition, target {split.target}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def collect_summaries(run_dirs: list[Path]) -> dict[str, list[dict]]:
    """method label -> the per-run summaries found under ``run_dirs`` (a run
    directory with ``summary.json``, or one whose sub-directories have them)."""
    import json

    out: dict[str, list[dict]] = {}
    for rd in run_dirs:
        rd = Path(rd)
        top = json.loads((rd / "summary.json").read_text()) if (rd / "summary.json").is_file() else {}
        if "targets" in top:  # a one-method run; otherwise a compare run's sub-directories
            runs = [(rd, top.get("method", rd.name), top)]
        else:
            runs = [(p.parent, p.parent.name, json.loads(p.read_text())) for p in sorted(rd.glob("*/summary.json"))]
        for sd, label, s in runs:
            out.setdefault(label + _data_stage(sd), []).append(s)
    return out


def _data_stage(run_dir: Path) -> str:
    """' + stage(k=v, ...)' for each data stage the run's config enabled
    (settings that differ from the stage's defaults), so runs with different
    stage settings (e.g. CCST's K or style) are not averaged together."""
    import yaml

    from rayfed_dg.stages import get_stage_class

    path = run_dir / "config.yaml"
    if not path.is_file():
        return ""
    out = ""
    for name, params in ((yaml.safe_load(path.read_text()) or {}).get("stages") or {}).items():
        if params is None:
            continue
        p_cls = get_stage_class(name).Params
        given, default = p_cls.model_validate(params).model_dump(), p_cls().model_dump()
        changed = [f"{k}={v}" for k, v in sorted(given.items()) if v != default[k] and not k.endswith(
            ("_vgg", "_decoder", "cache_dir"))]
        out += f" + {name}" + (f"({', '.join(changed)})" if changed else "")
    return out


def seeds_table(run_dirs: list[Path]) -> str:
    """Markdown: target accuracy (%) at the source-validation-selected round,
    mean +- std over the runs (seeds) of each method."""
    runs = collect_summaries(run_dirs)
    if not runs:
        return "(no summaries found)"
    targets = list(next(iter(runs.values()))[0]["targets"])
    rows = []
    for label, ss in runs.items():
        cells = []
        for t in targets + ["__avg"]:
            vals = [100 * (s["average_target_acc"] if t == "__avg" else s["targets"][t]["target_acc"])
                    for s in ss if t == "__avg" or t in s["targets"]]
            cells.append(f"{np.mean(vals):.2f} ± {np.std(vals):.2f}" if len(vals) > 1 else
                         (f"{vals[0]:.2f}" if vals else "-"))
        rows.append([label, len(ss)] + cells)
    return render_table(["method", "runs"] + targets + ["avg"], rows, "md")
