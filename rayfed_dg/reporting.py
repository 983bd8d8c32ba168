"""Reports from records: partition summaries and heatmaps (like FedFD-A
Fig. 7), and the results table over seeds with DomainBed's three
model-selection rules (``rayfed-dg report``)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rayfed_dg.data import DomainDataset, FederatedSplit
from rayfed_dg.errors import ConfigError
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


@dataclass
class RunRecord:
    """One finished run (one method, one seed) found under a report's arguments."""
    path: Path
    label: str
    summary: dict

    def metrics(self) -> list[dict] | None:
        """Its evaluation rows, or None for a run without a metrics table."""
        from rayfed_dg.engine.records import read_rows

        return read_rows(self.path, "metrics") if (self.path / "metrics.parquet").exists() else None


_NOT_RUNS = ("checkpoints", "tensorboard", "plots")


def find_runs(run_dir: Path, depth: int = 0, unfinished: bool = False) -> list[RunRecord]:
    """The runs under ``run_dir``: itself if it holds a finished run's
    ``summary.json``, else its sub-directories (a compare run's methods, a
    ``--seeds`` run's ``seedN`` folders, or both), up to three levels down.
    With ``unfinished``, also runs still going or killed (records but no
    summary yet; their summary is empty)."""
    import json

    import yaml

    run_dir = Path(run_dir)
    path = run_dir / "summary.json"
    s = json.loads(path.read_text()) if path.is_file() else {}
    if "targets" in s:
        # runs before summaries named their label: a compare run's sub-directory is named after it
        label = s.get("label") or (run_dir.name if depth else s.get("method", run_dir.name))
        return [RunRecord(run_dir, label + _data_stage(run_dir), s)]
    if unfinished and (run_dir / "metrics.parquet").exists() and (run_dir / "config.yaml").is_file():
        method = (yaml.safe_load((run_dir / "config.yaml").read_text()) or {}).get("method") or {}
        label = method.get("label") or method.get("name", run_dir.name)
        return [RunRecord(run_dir, label + _data_stage(run_dir), {})]
    if depth >= 3:
        return []
    subs = sorted(p for p in run_dir.iterdir() if p.is_dir() and p.name not in _NOT_RUNS
                  and not p.name.endswith(".parquet")) if run_dir.is_dir() else []
    return [r for sub in subs for r in find_runs(sub, depth + 1, unfinished)]


def collect_runs(run_dirs: list[Path], unfinished: bool = False) -> dict[str, list[RunRecord]]:
    """method label -> its runs (one per seed) under ``run_dirs``, in order."""
    out: dict[str, list[RunRecord]] = {}
    for rd in run_dirs:
        for run in find_runs(Path(rd), unfinished=unfinished):
            out.setdefault(run.label, []).append(run)
    return out


def collect_summaries(run_dirs: list[Path]) -> dict[str, list[dict]]:
    """method label -> the per-run summaries found under ``run_dirs``."""
    return {label: [r.summary for r in runs] for label, runs in collect_runs(run_dirs).items()}


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


def rule_accuracies(run: RunRecord, targets: list[str]) -> dict[str, dict[str, float | None]]:
    """{rule name: {target: target accuracy at the round the rule selects}}
    for one run; without a metrics table only the training-domain rule is
    known (from ``summary.json``)."""
    from rayfed_dg.engine.selection import RULES, select

    rows = run.metrics()
    out: dict[str, dict[str, float | None]] = {}
    for rule in RULES:
        accs: dict[str, float | None] = {}
        for t in targets:
            if rows is None:
                s = run.summary["targets"].get(t)
                accs[t] = s["target_acc"] if s is not None and rule.name == "training_domain" else None
            else:
                sel = select([r for r in rows if r["target"] == t], rule)
                accs[t] = None if sel is None else sel["target_acc"]
        out[rule.name] = accs
    return out


SE_NOTE = "mean ± SE over seeds, SE = std(ddof=1)/sqrt(n), n = the seeds column"


def _cell(values: list[float]) -> str:
    from rayfed_dg.engine.selection import mean_se

    if not values:
        return "-"
    m, se = mean_se([100 * v for v in values])
    return f"{m:.2f}" if se is None else f"{m:.2f} ± {se:.2f}"


def _per_seed(label: str, runs: list[RunRecord]) -> list[dict[str, dict[str, float | None]]]:
    """One ``rule_accuracies`` per seed: runs of one label and seed that
    hold different targets (one run directory per target) are one seed's
    figures.  Runs whose summary names no seed count as a seed each."""
    merged: dict[object, dict[str, dict[str, float | None]]] = {}
    where: dict[tuple[object, str], Path] = {}
    for i, run in enumerate(runs):
        seed = run.summary.get("seed")
        key = ("seed", seed) if seed is not None else ("run", i)
        for t in run.summary["targets"]:
            if (key, t) in where:
                raise ConfigError(f"report: {label} seed {seed} has target {t} in two runs ({where[key, t]} and "
                                  f"{run.path}); pass only one of them")
            where[key, t] = run.path
        accs = rule_accuracies(run, list(run.summary["targets"]))
        into = merged.setdefault(key, {rule: {} for rule in accs})
        for rule, by_target in accs.items():
            into[rule].update(by_target)
    return list(merged.values())


def seeds_table(run_dirs: list[Path], fmt: str = "md") -> str:
    """Target accuracy (%) per method and model-selection rule (DomainBed's:
    training-domain validation, last round, test-domain oracle as an upper
    bound), mean ± standard error over the seeds of each method.  The
    targets are those of every run, in the order first seen."""
    from rayfed_dg.engine.selection import RULES

    runs = collect_runs(run_dirs)
    if not runs:
        return "(no finished runs found)"
    targets = list(dict.fromkeys(t for rs in runs.values() for r in rs for t in r.summary["targets"]))
    rows = []
    for label, rs in runs.items():
        per_seed = _per_seed(label, rs)
        for rule in RULES:
            cells = [_cell([v for a in per_seed if (v := a[rule.name].get(t)) is not None]) for t in targets]
            # a seed's average over targets, then mean ± SE over seeds; only seeds with every target count
            avgs = [float(np.mean([a[rule.name][t] for t in targets])) for a in per_seed
                    if all(a[rule.name].get(t) is not None for t in targets)]
            rows.append([label, rule.label, len(per_seed)] + cells + [_cell(avgs)])
    return render_table(["method", "selection", "seeds"] + targets + ["avg"], rows, fmt)
