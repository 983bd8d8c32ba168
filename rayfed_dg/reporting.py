"""Reports from records: partition summaries and heatmaps (like FedFD-A
Fig. 7), and the results table over seeds with DomainBed's three
model-selection rules (``rayfed-dg report``), and, for runs on the device
model's virtual clock, accuracy at equal simulated time and each domain's
participation (``clock_table``), and for runs with a ``privacy:`` section
the epsilon each spent (``privacy_table``).  Run directories are read
through ``engine.store.rundir.RunDir``."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rayfed_dg.data import DomainDataset, FederatedSplit
from rayfed_dg.engine import format_table
from rayfed_dg.engine.store.rundir import RunDir
from rayfed_dg.engine.store.selection import RULES, mean_se, select
from rayfed_dg.engine.store.sweepdir import SweepDir
from rayfed_dg.errors import ConfigError
from rayfed_dg.utils import render_table


def client_class_counts(ds: DomainDataset, split: FederatedSplit) -> np.ndarray:
    return np.stack([np.bincount(ds.labels[idx], minlength=ds.num_classes) for idx in split.clients])


def client_domain_counts(ds: DomainDataset, split: FederatedSplit) -> np.ndarray:
    return np.stack([np.bincount(ds.domains[idx], minlength=len(ds.domain_names)) for idx in split.clients])


def _client_rows(ds: DomainDataset, split: FederatedSplit) -> list[tuple[int, int, str, list[int]]]:
    cc, dc = client_class_counts(ds, split), client_domain_counts(ds, split)
    return [(i, int(cc[i].sum()), ", ".join(f"{ds.domain_names[j]} {n}" for j, n in enumerate(dc[i]) if n),
             [int(x) for x in cc[i]]) for i in range(split.num_clients)]


def partition_summary(ds: DomainDataset, split: FederatedSplit, table: Path | None = None, limit: int = 40) -> str:
    """What ``rayfed-dg partition`` prints: the split's totals and one line
    per client; beyond ``limit`` clients, statistics over clients and the
    five smallest and largest (every client: the CSV ``table``)."""
    cc, dc = client_class_counts(ds, split), client_domain_counts(ds, split)
    n = split.num_clients
    lines = [f"target {split.target}: {n} clients, {int(cc.sum())} training samples; "
             f"validation {', '.join(f'{d} {len(v)}' for d, v in split.val.items())}; "
             f"test {len(next(iter(split.test.values())))}"]
    rows = _client_rows(ds, split)
    head = f"{'client':>6} {'size':>6}  {'domains':30s} classes (" + " ".join(ds.class_names) + ")"
    line = lambda r: f"{r[0]:>6} {r[1]:>6}  {r[2]:30s} " + " ".join(map(str, r[3]))  # noqa: E731
    if n <= limit:
        return "\n".join(lines + [head] + [line(r) for r in rows])
    sizes, classes, doms = cc.sum(1), (cc > 0).sum(1), (dc > 0).sum(1)

    def spread(x) -> str:
        return f"min {int(x.min())}, median {float(np.median(x)):g}, max {int(x.max())}"

    main = dc.argmax(1)
    per_dom = [f"{d} {int((main == j).sum())} ({int(dc[:, j].sum())} samples)" for j, d in enumerate(ds.domain_names)
               if dc[:, j].any()]
    lines += [f"clients by main domain: {', '.join(per_dom)}",
              f"samples per client: {spread(sizes)}",
              f"classes per client: {spread(classes)} (of {ds.num_classes})",
              f"domains per client: {spread(doms)}",
              "the 5 smallest and the 5 largest clients:", head]
    order = np.argsort(sizes, kind="stable")
    pick = list(dict.fromkeys([int(i) for i in order[:5]] + [int(i) for i in order[-5:]]))
    lines += [line(rows[i]) for i in pick]
    lines.append(f"(every client: {table})" if table is not None else f"({n - len(pick)} more clients not shown)")
    return "\n".join(lines)


def partition_clients_csv(ds: DomainDataset, split: FederatedSplit) -> str:
    """One row per client: client, samples, domains, then its count of each class."""
    import csv
    import io

    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["client", "samples", "domains", *ds.class_names])
    for i, size, doms, counts in _client_rows(ds, split):
        w.writerow([i, size, doms, *counts])
    return buf.getvalue()


MANY_CLIENTS = 60  # beyond this, a heatmap gets a fixed height and no per-client labels


def partition_figure(ds: DomainDataset, split: FederatedSplit, title: str = ""):
    """The heatmap's figure (``partition_heatmap``): clients x classes
    sample counts, each client's domain mix in a strip on the left.  Up to
    ``MANY_CLIENTS`` clients each row is labelled (and counted, when small);
    beyond, the figure keeps a readable size (one pixel row per client or
    less) with a client axis of a few ticks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cc, dc = client_class_counts(ds, split), client_domain_counts(ds, split)
    n = split.num_clients
    many = n > MANY_CLIENTS
    h = 8.0 if many else max(3.0, 0.22 * n + 1.5)
    fig, (ax_d, ax) = plt.subplots(1, 2, figsize=(2 + 0.5 * ds.num_classes + 1.5, h), layout="constrained",
                                   gridspec_kw={"width_ratios": [1, max(2, ds.num_classes / 2)]}, sharey=True)
    frac = dc / np.maximum(dc.sum(1, keepdims=True), 1)
    cmap = plt.get_cmap("tab10")
    left = np.zeros(n)
    for j, name in enumerate(ds.domain_names):
        if frac[:, j].any():
            ax_d.barh(np.arange(n), frac[:, j], left=left, color=cmap(j % 10), label=name, height=1.0 if many else 0.9,
                      linewidth=0)
            left += frac[:, j]
    ax_d.set_xlim(0, 1)
    ax_d.set_xlabel("domain share")
    ax_d.set_ylabel("client")
    im = ax.imshow(cc, aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_xticks(range(ds.num_classes), ds.class_names, rotation=45, ha="right", fontsize=7)
    if not many:
        ax.set_yticks(range(n), [str(i) for i in range(n)], fontsize=6)
    else:
        from matplotlib.ticker import MaxNLocator

        ax.yaxis.set_major_locator(MaxNLocator(10, integer=True))
    ax.set_ylim(n - 0.5, -0.5)
    ax.set_xlabel("class")
    if n <= 40 and ds.num_classes <= 12:
        for i in range(n):
            for c in range(ds.num_classes):
                ax.text(c, i, str(int(cc[i, c])), ha="center", va="center", fontsize=5,
                        color="white" if cc[i, c] < cc.max() / 2 else "black")
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.02, label="samples")
    fig.legend(*ax_d.get_legend_handles_labels(), loc="outside lower left", fontsize=7, ncol=2, frameon=False,
               title="domain", title_fontsize=7)
    fig.suptitle(title or f"partition, target {split.target}", fontsize=9)
    return fig


def partition_heatmap(ds: DomainDataset, split: FederatedSplit, path: Path, title: str = "") -> Path:
    """``partition_figure`` as a PNG."""
    import matplotlib.pyplot as plt

    fig = partition_figure(ds, split, title)
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
        rd = RunDir(self.path)
        return rd.read_rows("metrics") if rd.has_table("metrics") else None

    def targets(self) -> list[str] | None:
        """Its targets in the order they ran: the summary's, else (a run still
        going) the ``run.json`` of its experiment."""
        if self.summary.get("targets"):
            return list(self.summary["targets"])
        rec = RunDir(self.path).experiment()
        return None if rec is None else list(rec[1].get("targets") or []) or None


def run_label(run_dir: Path, summary: dict, depth: int = 0) -> str:
    """A run's row name everywhere (``run``'s table, ``report``, plots): its
    label, plus the data stages that tell it from other runs of that label
    (``_data_stage``)."""
    run_dir = Path(run_dir)
    cfg = RunDir(run_dir).config_tree()
    plugin_error = None
    if cfg.get("plugins"):  # a plugin stage is looked up below (_data_stage), as the run that wrote it did
        from rayfed_dg.plugins import import_plugins

        try:
            import_plugins(cfg["plugins"], str(RunDir(run_dir).config_path))
        except ConfigError as e:  # only a run whose label needs a plugin stage fails (_data_stage)
            plugin_error = str(e)
    method = cfg.get("method") or {}
    if "targets" in summary:
        # runs before summaries named their label: a compare run's sub-directory is named after it
        label = summary.get("label") or (run_dir.name if depth else summary.get("method", run_dir.name))
        name = summary.get("method") or method.get("name")
    else:  # still going: a compare row's directory is its label
        label = run_dir.name if run_dir.name in RunDir(run_dir.parent).compare_labels() else \
            method.get("label") or method.get("name", run_dir.name)
        name = method.get("name")
    return label + _data_stage(cfg, label, name, plugin_error)


def find_runs(run_dir: Path, depth: int = 0, unfinished: bool = False) -> list[RunRecord]:
    """The runs under ``run_dir``: itself if it holds a finished run's
    ``summary.json``, else its sub-directories (a compare run's methods, a
    ``--seeds`` run's ``seedN`` folders, or both; in the experiment's order),
    up to three levels down.  With ``unfinished``, also runs still going or
    killed (records but no summary yet; their summary is empty)."""
    rd = RunDir(run_dir)
    s = rd.summary()
    if s is not None:
        return [RunRecord(rd.path, run_label(rd.path, s, depth), s)]
    if unfinished and rd.has_table("metrics") and rd.has_config():
        return [RunRecord(rd.path, run_label(rd.path, {}, depth), {})]
    if depth >= 3:
        return []
    return [r for sub in rd.subdirs() for r in find_runs(sub.path, depth + 1, unfinished)]


def collect_runs(run_dirs: list[Path], unfinished: bool = False) -> dict[str, list[RunRecord]]:
    """method label -> its runs (one per seed) under ``run_dirs``, in order;
    a run named twice (a folder and one inside it) counts once."""
    out: dict[str, list[RunRecord]] = {}
    seen: set[Path] = set()
    for rd in run_dirs:
        for run in find_runs(Path(rd), unfinished=unfinished):
            where = run.path.resolve()
            if where not in seen:
                seen.add(where)
                out.setdefault(run.label, []).append(run)
    return out


def collect_summaries(run_dirs: list[Path]) -> dict[str, list[dict]]:
    """method label -> the per-run summaries found under ``run_dirs``."""
    return {label: [r.summary for r in runs] for label, runs in collect_runs(run_dirs).items()}


def _data_stage(cfg: dict, label: str, method: str | None, plugin_error: str | None = None) -> str:
    """' + stage(k=v, ...)' for each data stage the run's config enabled
    (settings that differ from the stage's defaults), so runs with different
    stage settings (e.g. CCST's K or style) are not averaged together.  A
    stage the label already names gets only its settings (``ccst``,
    ``ccst(k=3)``, not ``ccst + ccst``); one the method always needs, at
    its defaults (ELCFS's amplitude bank), is not repeated."""
    import re

    from rayfed_dg.methods import get_method_class
    from rayfed_dg.stages import get_stage_class

    try:
        needed = get_method_class(method).stages_needed if method else ()
    except KeyError:
        needed = ()
    words = set(re.split(r"[^a-z0-9]+", label.lower()))
    out = ""
    for name, params in (cfg.get("stages") or {}).items():
        if params is None:
            continue
        try:
            p_cls = get_stage_class(name).Params
        except KeyError:
            raise ConfigError(f"a run uses data stage {name!r}, which is not registered here"
                              + (f" ({plugin_error})" if plugin_error else
                                 "; run report where its plugins import")) from None
        given, default = p_cls.model_validate(params).model_dump(), p_cls().model_dump()
        changed = [f"{k}={v}" for k, v in sorted(given.items()) if v != default[k] and not k.endswith(
            ("_vgg", "_decoder", "cache_dir"))]
        settings = f"({', '.join(changed)})" if changed else ""
        if name.lower() in words:
            out += settings
        elif name not in needed or changed:
            out += f" + {name}{settings}"
    return out


def run_table(summaries: dict[str, dict], run_dir: Path) -> str:
    """``rayfed-dg run``'s closing table (``engine.format_table``) with the
    rows named as ``report`` and the plots name them."""

    many = len(summaries) > 1
    return format_table({run_label(Path(run_dir) / label if many else Path(run_dir), s, int(many)): s
                         for label, s in summaries.items()})


def check_report_inputs(run_dirs: list[Path]) -> None:
    """Each argument of ``report`` is a folder holding finished runs, or one
    line saying what it is instead."""
    for d in run_dirs:
        if not d.exists():
            raise ConfigError(f"report: {d}: no such directory")
        if not d.is_dir():
            raise ConfigError(f"report: {d} is a file; give run directories (what rayfed-dg run writes)")
        kind = SweepDir.kind(d)
        if kind == "sweep":
            raise ConfigError(f"report: {d} is a Ray Tune sweep folder, not a run directory: its table is "
                              f"{SweepDir(d).selection_md} (python tune.py writes it when the sweep ends), "
                              f"or: rayfed-dg collect {d}")
        if kind == "trial":
            raise ConfigError(f"report: {d} is a Ray Tune trial folder, not a run directory: the sweep's table is "
                              f"{SweepDir(d.parent).selection_md}")
        RunDir(d).experiment()  # a run directory of a newer format: refused in one line
    if not collect_runs(run_dirs):
        where = ", ".join(map(str, run_dirs))
        waiting = _expected_runs(run_dirs)
        if waiting:
            raise ConfigError(f"report: no finished runs under {where}: {len(waiting)} not finished yet "
                              f"({waiting[0][0]}: {waiting[0][2]}); resume with: {_resume_hint(waiting[0][1])}")
        sweeps = [p for d in run_dirs for p in [d, *d.glob("*"), *d.glob("*/*")] if p.is_dir() and SweepDir.kind(p)]
        hint = f" ({sweeps[0]} is a Ray Tune folder: see its selection.md)" if sweeps else \
            " (a finished run's directory holds summary.json)"
        raise ConfigError(f"report: no finished runs under {where}{hint}")


def _expected_runs(run_dirs: list[Path]) -> list[tuple[Path, Path, str]]:
    """(run path, experiment root, what is missing) of every run an
    experiment under ``run_dirs`` planned and has not finished: its
    ``run.json`` (seeds x rows) or, before ``run.json``, a compare config's
    rows."""
    out: list[tuple[Path, Path, str]] = []
    seen: set[Path] = set()
    for d in map(RunDir, run_dirs):
        for root in [d, *d.subdirs(), *(x for sub in d.subdirs() for x in sub.subdirs())]:
            rec = _record(root)
            if rec:
                labels = rec.get("labels") or [""]
                rows = [root.seed(s).row(lab, len(labels) > 1) for s in rec.get("seeds") or [None] for lab in labels]
            elif len(root.compare_labels()) > 1 and not any(_record(RunDir(a)) for a in list(root.path.parents)[:2]):
                rows = [root.row(lab, True) for lab in root.compare_labels()]
            else:
                continue
            for row in rows:
                if row.path.resolve() in seen or row.summary() is not None:
                    continue
                seen.add(row.path.resolve())
                out.append((row.path, root.path, _progress(row, rec)))
    return out


def _record(d: RunDir) -> dict:
    """``d``'s run.json, or {} (none, or unreadable: a report reads what it can)."""
    try:
        return d.record() or {}
    except ConfigError:
        return {}


def _progress(run: RunDir, rec: dict) -> str:
    """How far an unfinished run got, per target."""
    if not run.has_table("metrics"):
        return "not started"
    done: dict[str, int] = {}
    for r in run.read_rows("metrics"):
        done[r["target"]] = max(done.get(r["target"], 0), int(r["round"]))
    rounds = rec.get("rounds") or run.config_tree().get("training", {}).get("rounds")
    of = f" of {rounds}" if rounds else ""
    targets = rec.get("targets") or list(done)
    return ", ".join(f"{t} {done.get(t, 0)}{of} rounds" for t in targets)


def unfinished_runs(run_dirs: list[Path]) -> list[str]:
    """One warning line per run an experiment under ``run_dirs`` planned and
    has not finished (left out of the report's table)."""
    lines = []
    for path, root, what in _expected_runs(run_dirs):
        lines.append(f"{path} is not finished ({what}) and is not in the table; resume with: {_resume_hint(root)}")
    return lines


def mixed_environments(run_dirs: list[Path]) -> list[str]:
    """One warning line when the finished runs under ``run_dirs`` were made
    with different code or library versions (their ``run.json``), which can
    move a figure by more than a seed does; runs that predate the record
    are not compared."""
    roots: dict[Path, dict] = {}
    for runs in collect_runs(run_dirs).values():
        for run in runs:
            found = RunDir(run.path).experiment()
            if found and isinstance(found[1].get("environment"), dict):
                roots.setdefault(found[0].path, found[1]["environment"])
    if len(roots) < 2:
        return []
    keys = dict.fromkeys(k for env in roots.values() for k in env)
    parts = []
    for k in keys:
        by_value: dict[str, list[Path]] = {}
        for root, env in roots.items():
            by_value.setdefault(str(env.get(k)), []).append(root)
        if len(by_value) > 1:
            more = {v: f" and {len(w) - 1} more" if len(w) > 1 else "" for v, w in by_value.items()}
            parts.append(f"{k} " + ", ".join(f"{v} ({w[0]}{more[v]})" for v, w in by_value.items()))
    if not parts:
        return []
    return [f"these runs were made with different code or libraries: {'; '.join(parts)}; a difference between them "
            "can come from those as well as from the seed or the method"]


def _resume_hint(root: Path) -> str:
    if _record(RunDir(root)):
        return f"rayfed-dg run --resume {root}"
    if RunDir.seed_of(root.name) is not None:  # made before run.json: say what it needs
        return f"rayfed-dg run CONFIG --resume {root.parent} --seeds SEEDS --target TARGETS"
    return f"rayfed-dg run CONFIG --resume {root} --target TARGETS"


FIGURES = ("target_acc", "source_test", "personal_val")  # what report reads at a rule's round


def rule_accuracies(run: RunRecord, targets: list[str]) -> dict[str, dict[str, dict[str, float | None]]]:
    """{figure: {rule name: {target: figure at the round the rule selects}}}
    for one run, the metrics read once: ``target_acc``, ``source_test`` and
    ``personal_val`` (means over source domains / clients); without a metrics
    table only the training-domain rule's target accuracy is known
    (``summary.json``)."""

    rows = run.metrics()
    out: dict[str, dict[str, dict[str, float | None]]] = {w: {} for w in FIGURES}
    for rule in RULES:
        for w in FIGURES:
            out[w][rule.name] = {}
        for t in targets:
            if rows is None:
                s = run.summary["targets"].get(t)
                sel = {"target_acc": s["target_acc"]} if s is not None and rule.name == "training_domain" else {}
            else:
                sel = select([r for r in rows if r["target"] == t], rule) or {}
            for w in FIGURES:
                out[w][rule.name][t] = sel.get(w)
    return out


SE_NOTE = "mean ± SE over seeds, SE = std(ddof=1)/sqrt(n), n = the seeds column"


def mean_se_cell(values: list[float]) -> str:
    """Fractions as a table cell in percent: mean ± SE, or the one value."""

    if not values:
        return "-"
    m, se = mean_se([100 * v for v in values])
    return f"{m:.2f}" if se is None else f"{m:.2f} ± {se:.2f}"


def _per_seed(label: str, runs: list[RunRecord]) -> dict[str, list[dict[str, dict[str, float | None]]]]:
    """{figure: one ``rule_accuracies`` per seed}: runs of one label and seed
    that hold different targets (one run directory per target) are one
    seed's figures.  Runs whose summary names no seed count as a seed each."""
    merged: dict[object, dict[str, dict[str, dict[str, float | None]]]] = {}
    where: dict[tuple[object, str], Path] = {}
    for i, run in enumerate(runs):
        seed = run.summary.get("seed")
        key = ("seed", seed) if seed is not None else ("run", i)
        for t in run.summary["targets"]:
            if (key, t) in where:
                raise ConfigError(f"report: {label} seed {seed} has target {t} in two runs ({where[key, t]} and "
                                  f"{run.path}); pass only one of them")
            where[key, t] = run.path
        figs = rule_accuracies(run, list(run.summary["targets"]))
        into = merged.setdefault(key, {w: {rule: {} for rule in by_rule} for w, by_rule in figs.items()})
        for w, by_rule in figs.items():
            for rule, by_target in by_rule.items():
                into[w][rule].update(by_target)
    return {w: [m[w] for m in merged.values()] for w in FIGURES}


def seeds_table(run_dirs: list[Path], fmt: str = "md") -> str:
    """Target accuracy (%) per method and model-selection rule (DomainBed's:
    training-domain validation, last round, test-domain oracle as an upper
    bound; held-out-domain validation for runs that hold a domain out),
    mean ± standard error over the seeds of each method.  The targets are
    those of every run, in the order first seen.  Runs that evaluate them
    add, at each rule's round and averaged over targets, the sources'
    in-domain test accuracy and the clients' own (personalized) models'
    validation accuracy."""

    runs = collect_runs(run_dirs)
    if not runs:
        raise ConfigError(f"report: no finished runs under {', '.join(map(str, run_dirs))}")
    targets = list(dict.fromkeys(t for rs in runs.values() for r in rs for t in r.summary["targets"]))

    def avg_over_targets(per_seed: list, rule: str) -> list[float]:
        # a seed's average over targets, then mean ± SE over seeds; only seeds with every target count
        return [float(np.mean([a[rule][t] for t in targets])) for a in per_seed
                if all(a[rule].get(t) is not None for t in targets)]

    figures = {label: _per_seed(label, rs) for label, rs in runs.items()}
    extras = [w for w in EXTRA_COLUMNS if any(avg_over_targets(f[w], rule.name) for f in figures.values()
                                              for rule in RULES)]
    rows = []
    for label, fig in figures.items():
        per_seed = fig["target_acc"]
        for rule in RULES:
            cells = [mean_se_cell([v for a in per_seed if (v := a[rule.name].get(t)) is not None]) for t in targets]
            if rule.needs and all(c == "-" for c in cells):
                continue  # no run of this method evaluated what the rule reads
            rows.append([label, rule.label, len(per_seed)] + cells
                        + [mean_se_cell(avg_over_targets(fig[w], rule.name)) for w in ("target_acc", *extras)])
    return render_table(["method", "selection", "seeds"] + targets + ["avg"] + [EXTRA_COLUMNS[w] for w in extras],
                        rows, fmt)


EXTRA_COLUMNS = {"source_test": "in-domain test (sources)", "personal_val": "personalized (own val)"}


# ------------------------------------------------------------------ the virtual clock

CLOCK_CAPTION = ("On the virtual clock (devices.enabled): target accuracy (%) at the equal simulated time T (the "
                 "earliest end of these runs) and at each run's end, and the mean source-validation accuracy at T "
                 "(what model selection reads), mean ± SE over seeds; per domain, the trainings aggregated / selected "
                 "over the run (mean over seeds)")


def _on_clock(rows: list[dict], t: float, split: str = "target_test") -> float | None:
    """Accuracy on ``split`` (the mean over its domains) at simulated time ``t``: that of the last evaluated round
    aggregated by ``t``."""
    at = [(r["sim_time"], r["round"]) for r in rows if r["split"] == split and r["sim_time"] <= t]
    if not at:
        return None
    last = max(at)[1]
    return float(np.mean([r["accuracy"] for r in rows if r["split"] == split and r["round"] == last]))


def clock_table(run_dirs: list[Path], fmt: str = "md") -> str | None:
    """A table of the runs that ran on the virtual clock (their metrics
    carry ``sim_time``): per method and target, the target accuracy at T,
    the earliest simulated end of any of these runs and targets (so methods
    compare at equal simulated time), and at each run's end, and the
    participation each domain got: trainings aggregated / selected, summed
    over rounds (client rows not dropped / all).  None when no run had a clock."""
    per: dict[tuple[str, str], list[tuple[list[dict], list[dict]]]] = {}
    for label, runs in collect_runs(run_dirs).items():
        for run in runs:
            rd = RunDir(run.path)
            rows = [r for r in run.metrics() or [] if r.get("sim_time") is not None]
            clients = rd.read_rows("clients") if rows and rd.has_table("clients") else []
            for t in dict.fromkeys(r["target"] for r in rows):
                per.setdefault((label, t), []).append(([r for r in rows if r["target"] == t],
                                                       [c for c in clients if c["target"] == t]))
    if not per:
        return None
    horizon = min(max(r["sim_time"] for r in rows) for seeds in per.values() for rows, _ in seeds)
    domains = sorted({c["domain"] for seeds in per.values() for _, clients in seeds for c in clients})
    out = []
    for (label, target), seeds in per.items():
        at_t = [a for rows, _ in seeds if (a := _on_clock(rows, horizon)) is not None]
        end = [a for rows, _ in seeds if (a := _on_clock(rows, max(r["sim_time"] for r in rows))) is not None]
        val_t = [a for rows, _ in seeds if (a := _on_clock(rows, horizon, "source_val")) is not None]
        cells = []
        for d in domains:
            mine = [[c for c in clients if c["domain"] == d] for _, clients in seeds]
            made = np.mean([sum(not c["dropped"] for c in m) for m in mine])
            cells.append(f"{made:g}/{np.mean([len(m) for m in mine]):g}" if any(mine) else "-")
        out.append([label, target, len(seeds), mean_se_cell(at_t), mean_se_cell(end), mean_se_cell(val_t),
                    f"{np.mean([max(r['sim_time'] for r in rows) for rows, _ in seeds]):.6g}"] + cells)
    header = ["method", "target", "seeds", f"at T = {horizon:.6g} s", "at the end", "source val at T",
              "end (simulated s)"] + domains
    return render_table(header, out, fmt)


# ------------------------------------------------------------------ privacy

PRIVACY_CAPTION = ("Privacy (privacy: section, docs/privacy.md): epsilon at delta spent by the end of each run, per "
                   "group (model updates, each shared statistic) and in total, the largest over seeds; rounds: the "
                   "rounds run (fewer than training.rounds where privacy.target_epsilon stopped it)")


def privacy_table(run_dirs: list[Path], fmt: str = "md") -> str | None:
    """Per method and target, the last round's epsilon of each group of the
    ``privacy`` table (``engine/privacy/accountant.py``), the largest over seeds;
    None when no run had a privacy section."""
    per: dict[tuple[str, str], list[list[dict]]] = {}
    for label, runs in collect_runs(run_dirs).items():
        for run in runs:
            rd = RunDir(run.path)
            rows = rd.read_rows("privacy") if rd.has_table("privacy") else []
            for t in dict.fromkeys(r["target"] for r in rows):
                per.setdefault((label, t), []).append([r for r in rows if r["target"] == t])
    if not per:
        return None
    groups = sorted({r["group"] for seeds in per.values() for rows in seeds for r in rows},
                    key=lambda g: (g == "total", g != "updates", g))
    out = []
    for (label, target), seeds in per.items():
        last = [{r["group"]: r for r in rows if r["round"] == max(x["round"] for x in rows)} for rows in seeds]
        cells = [f"{max(s[g]['epsilon'] for s in last if g in s):.4g}" if any(g in s for s in last) else "-"
                 for g in groups]
        out.append([label, target, len(seeds), max(max(r["round"] for r in rows) for rows in seeds),
                    f"{seeds[0][0]['delta']:g}"] + cells)
    return render_table(["method", "target", "seeds", "rounds", "delta"] + groups, out, fmt)
