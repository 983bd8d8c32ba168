"""Driver side: start Ray, run leave-one-domain-out federations, write records.

The driver holds no model and does no training: it puts the decoded dataset
in the object store once per run, opens each federation on actors
(``host.py``), calls ``run_round``, and hands each finished round to the
federation's ``FederationRun``: it turns the round's typed rows into table
rows once (``records.table_rows``), writes them, and hands the
``RoundResult`` to the round callbacks (progress bar, run-directory writer,
a Tune reporter).  ``run_federation`` drives one federation round by round;
``experiment.run_planned`` drives many side by side through the same
objects.  What goes where in the run directory, and in which order, is
``rundir.RunDir``'s: the round's table rows reach disk before its
checkpoint, so a run killed at any point keeps every finished round
readable and a resumed run rewrites the rounds it repeats under the same
names (no duplicate rows).
"""
from __future__ import annotations

import shutil
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import ray

from rayfed_dg.config import ConfigError, ExperimentConfig
from rayfed_dg.data import FederatedSplit
from rayfed_dg.engine.privacy.accountant import Accountant, releases
from rayfed_dg.engine.store.formats import check_resumable
from rayfed_dg.engine.store.records import (
    RoundResult,
    Split,
    dropped_rows,
    round_row,
    split_mean,
    stage_rows,
    table_rows,
)
from rayfed_dg.engine.store.rundir import RunDir
from rayfed_dg.engine.store.selection import select_round
from rayfed_dg.engine.workers.resources import ensure_workers
from rayfed_dg.methods import declarations
from rayfed_dg.methods.payloads import released_payload_groups
from rayfed_dg.utils import render_table

from .host import EngineHost
from .plan import clients_per_round


@dataclass
class TargetResult:
    target: str
    metrics: list[dict] = field(default_factory=list)
    ledger: list[dict] = field(default_factory=list)
    clients: list[dict] = field(default_factory=list)
    dropped: list[dict] = field(default_factory=list)
    seconds_per_round: list[float] = field(default_factory=list)
    seconds_clients_per_round: list[float] = field(default_factory=list)  # each round's clients' phase
    selected_round: int | None = None
    selected_val: float | None = None
    selected_target_acc: float | None = None
    rounds_done: int = 0
    tasks_retried: int = 0
    tasks_rerun: int = 0
    setup_info: dict = field(default_factory=dict)
    epsilon: dict[str, float] | None = None  # with privacy: epsilon per group and in total after the last round
    stopped: str | None = None  # why the run ended before training.rounds (privacy.target_epsilon), in one line

    def add_round(self, out: RoundResult, rows: dict[str, list[dict]]) -> bool:
        """Fold one round's records in (``rows``: its table rows,
        ``records.table_rows``); True when it is the new selected round."""
        self.rounds_done, self.tasks_retried, self.tasks_rerun = out.round, out.tasks_retried, out.tasks_rerun
        self.seconds_per_round.append(out.seconds_total)
        self.seconds_clients_per_round.append(out.seconds_clients)
        self.metrics += rows["metrics"]
        self.ledger += rows["ledger"]
        self.clients += rows["clients"]
        self.dropped += [dict(d.row(), target=self.target) for d in out.dropped]
        best, best_val = select_round(self.metrics) if out.metrics else (None, None)
        if best != out.round:
            return False
        self.selected_round, self.selected_val = best, best_val
        self.selected_target_acc = self.mean(Split.TARGET_TEST, out.round)
        return True

    def mean(self, split: Split, round: int) -> float | None:
        """Mean accuracy of ``split`` at ``round`` (None: not evaluated then)."""
        return split_mean(self.metrics, split, round)

    def summary(self) -> dict:
        return {"selected_round": self.selected_round, "source_val_acc": self.selected_val,
                "target_acc": self.selected_target_acc,
                # each client's own model (methods with client-local state) at the selected round, mean over clients
                "personal_val_acc": None if self.selected_round is None else
                self.mean(Split.PERSONAL_VAL, self.selected_round),
                "final_target_acc": next((m["accuracy"] for m in reversed(self.metrics)
                                          if m["split"] == Split.TARGET_TEST), None),
                "clients_dropped": len(self.dropped), "tasks_retried": self.tasks_retried,
                # uncharged re-runs after a worker that other tasks shared died: depends on timing, like seconds
                "tasks_rerun": self.tasks_rerun,
                "setup": self.setup_info,
                "mean_seconds_per_round": float(np.mean(self.seconds_per_round)) if self.seconds_per_round else None,
                **({"epsilon": self.epsilon, "stopped": self.stopped} if self.epsilon is not None else {})}


# ------------------------------------------------------------------ callbacks

class RoundCallback(Protocol):
    def on_round(self, out: RoundResult, res: TargetResult, new_best: bool, server_state: Callable[..., dict]) -> None:
        """``server_state(pieces=None, clients=True)``: the server's state (``Federation.get_state``)."""

    def close(self) -> None:
        ...


class ProgressBar:
    """``bar``: tqdm's ``desc``, ``position`` (one line per running
    federation) and ``leave``, where they differ from one bar per target."""

    def __init__(self, cfg: ExperimentConfig, res: TargetResult, bar: dict | None = None):
        from tqdm import tqdm

        self.bar = tqdm(total=cfg.training.rounds, initial=res.rounds_done, unit="round",
                        **{"desc": f"target {res.target}", "leave": True, **(bar or {})})

    def on_round(self, out, res, new_best, server_state):
        src, tgt = res.mean(Split.SOURCE_VAL, out.round), res.mean(Split.TARGET_TEST, out.round)
        post = {"loss": f"{out.train_loss:.3f}"}
        if src is not None:
            post |= {"src_val": f"{100 * src:.1f}%", "target": f"{100 * tgt:.1f}%"}
        if out.dropped:
            post["dropped"] = len(out.dropped)
        self.bar.set_postfix(post)
        self.bar.update(1)

    def close(self):
        self.bar.close()


class RunDirWriter:
    """Best and final weights, and resumable checkpoints every
    ``output.checkpoint_every`` rounds (and at the last round)."""

    def __init__(self, cfg: ExperimentConfig, run_dir: RunDir, target: str):
        self.cfg, self.run_dir, self.target = cfg, run_dir, target

    def on_round(self, out, res, new_best, server_state):
        o, r, last = self.cfg.output, out.round, out.round == self.cfg.training.rounds or res.stopped is not None
        best = new_best and o.save_best_checkpoint
        ckpt = bool(o.checkpoint_every) and (r % o.checkpoint_every == 0 or last)
        if not (best or last or ckpt):
            return
        state = server_state(self.run_dir.checkpoints(self.target)) if ckpt else server_state(None, False)
        if best:
            self.run_dir.save_weights("best", self.target, state["global_state"])
        if last:
            self.run_dir.save_weights("final", self.target, state["global_state"])
        if ckpt:
            # the metrics', clients', ledger's and rounds' rows are in the run directory's tables already (written
            # before the callbacks), the failed clients too: a checkpoint that carried them would grow with every
            # round and client so far
            result = asdict(replace(res, metrics=[], clients=[], ledger=[], dropped=[], seconds_per_round=[],
                                    seconds_clients_per_round=[]))
            self.run_dir.save_checkpoint(self.target, r, {"server": state, "result": result, "rows": ROWS},
                                         state["client_pieces"]["pieces"])

    def close(self):
        pass


class OnRound:
    """A plain function ``fn(out, res)`` as a callback (e.g. Tune's reporter)."""

    def __init__(self, fn: Callable[[RoundResult, TargetResult], None]):
        self.fn = fn

    def on_round(self, out, res, new_best, server_state):
        self.fn(out, res)

    def close(self):
        pass


# ------------------------------------------------------------------ federation

# a checkpoint's ``rows``: which of its result's row lists are read back from the run directory's tables (the
# rounds table: its seconds lists; with it, the failed clients from the ledger and clients tables); today's
# checkpoints write ROWS
TABLED = {"result": (), "tables": ("clients", "ledger"), "all tables": ("metrics", "clients", "ledger"),
          "all tables and rounds": ("metrics", "clients", "ledger", "rounds")}
ROWS = "all tables and rounds"


def _resume(run_dir: RunDir | None, target: str) -> tuple[TargetResult, dict | None]:
    state = run_dir.latest_checkpoint(target) if run_dir is not None else None
    if state is None or run_dir is None:
        return TargetResult(target), None
    res = TargetResult(**state["result"])  # the checkpoint in today's shape (``formats.upgrade_checkpoint``)
    for table in TABLED[state["rows"]]:  # the rows of this checkpoint's rounds that are the tables'
        rows = run_dir.read_target_rows(table, target, res.rounds_done)
        if table != "rounds":
            setattr(res, table, rows)
            continue
        res.seconds_per_round = [row["seconds"] for row in rows]
        res.seconds_clients_per_round = [row["seconds_clients"] for row in rows]
    if "rounds" in TABLED[state["rows"]]:
        res.dropped = dropped_rows(target, res.ledger, res.clients)
    else:  # an older checkpoint carried its last rounds' seconds: into the table, where the next one leaves them
        first = res.rounds_done - len(res.seconds_per_round) + 1
        for r, s, c in zip(range(first, res.rounds_done + 1), res.seconds_per_round, res.seconds_clients_per_round):
            run_dir.write_rows("rounds", target, r, [round_row(target, r, s, c)])
    if "client_pieces" in state["server"]:  # where the server reads the states the manifest names
        state["server"]["client_pieces"]["directory"] = str(run_dir.checkpoints(target))
    return res, state


def _callbacks(cfg: ExperimentConfig, target: str, res: TargetResult, run_dir: RunDir | None, bar: dict | None,
               on_round, tensorboard: Path | None) -> list[Any]:
    """The round callbacks of one federation, in the order they run."""
    if tensorboard is None and run_dir is not None and cfg.output.tensorboard:
        tensorboard = run_dir.tensorboard()
    callbacks: list[Any] = [ProgressBar(cfg, res, bar)] if bar is not None else []
    if tensorboard is not None:
        from rayfed_dg.engine.store.tblog import TensorBoardLogger

        # a resumed run hides what the killed one logged from the first round it repeats
        purge = res.rounds_done + 1 if res.rounds_done else None
        callbacks.append(TensorBoardLogger(tensorboard / target, purge))
    if run_dir is not None and (cfg.output.wandb is not None or cfg.output.mlflow is not None):
        from rayfed_dg.engine.store.trackers import (
            tracker_callbacks,  # W&B / MLflow: imported only when the config asks for them
        )

        callbacks += tracker_callbacks(cfg, run_dir.path, target)
    callbacks += [RunDirWriter(cfg, run_dir, target)] if run_dir is not None else []
    callbacks += [OnRound(on_round)] if on_round is not None else []
    return callbacks


class FederationRun:
    """One federation seen from the driver, between its rounds: its records
    so far (``res``, resumed from the newest checkpoint in ``run_dir``),
    its round callbacks, and what a finished round does.  Both drivers use
    it: ``run_federation`` (one federation, ``ray.get`` per round) and
    ``experiment.run_planned`` (many at once, one ``ray.wait`` loop).

    ``state``: the checkpoint to resume from, until ``opened``;
    ``bar``: the progress bar's options (``ProgressBar``), None for none;
    ``stop_after``: finished after that round (tests of resume use it)."""

    def __init__(self, cfg: ExperimentConfig, split: FederatedSplit, run_dir: RunDir | None, bar: dict | None = None,
                 on_round: Callable[[RoundResult, TargetResult], None] | None = None, stop_after: int | None = None,
                 tensorboard: Path | None = None):
        self.cfg, self.split, self.run_dir, self.bar = cfg, split, run_dir, bar
        self.on_round, self.stop_after, self.tensorboard = on_round, stop_after, tensorboard
        self.res, self.state = _resume(run_dir, split.target)
        # a resumed run may have nothing left (or have stopped at its privacy budget)
        self.finished = self.res.rounds_done >= cfg.training.rounds or self.res.stopped is not None
        self.accountant = None if cfg.privacy is None else \
            Accountant(cfg.privacy, split.num_clients, clients_per_round(cfg, split), released_payload_groups(cfg))
        # the method's payloads configured for noise: the first round's forecast (one release each, per round)
        self.per_round: Counter[str] = Counter() if cfg.privacy is None else Counter(
            {g: 1 for g in declarations(cfg).shared_payloads if g in cfg.privacy.payloads})
        self.released: Counter[str] = Counter()  # payload releases so far, by group (accountant.releases)
        self.server: Any = None
        self.callbacks: list[Any] = []

    def opened(self, server: Any, setup: dict) -> None:
        """The federation is open on ``server`` and its data stages ran
        (``setup``, ``Server.setup``): a fresh run records the stages' ledger
        as round 0; the callbacks start."""
        self.server = server
        target = self.split.target
        fresh, self.state = self.state is None, None  # the checkpoint was sent to the server: drop the copy
        if fresh:
            rows = stage_rows(target, setup["ledger"])
            self.res.ledger += rows["ledger"]
            if self.run_dir is not None:
                self.run_dir.write_round(target, 0, rows)
        self.res.setup_info = setup["info"]
        if self.accountant is not None:  # the releases so far (a resumed run's from its ledger); the next round's check
            self.released = releases(self.res.ledger)
            last = [row for row in self.res.ledger if row["round"] == self.res.rounds_done]
            self._check_budget(self.res.rounds_done, self._forecast(last))
        if self.run_dir is not None:  # queued before the first round
            server.spill_to.remote(str(self.run_dir.client_state(target)))
        self.callbacks = _callbacks(self.cfg, target, self.res, self.run_dir, self.bar, self.on_round,
                                    self.tensorboard)

    def round_done(self, out: RoundResult) -> None:
        """Fold in a finished round: its table rows made once and written,
        then the callbacks (the server is idle: the next round is not sent yet)."""
        rows = table_rows(self.split.target, out)  # the one place a round's typed rows become table rows
        if self.accountant is not None:
            rows["privacy"] = self._account(out, rows["ledger"])
        new_best = self.res.add_round(out, rows)
        if self.run_dir is not None:  # before the callbacks: no checkpoint covers a round whose rows are not on disk
            self.run_dir.write_round(self.split.target, out.round, rows)
        for cb in self.callbacks:
            cb.on_round(out, self.res, new_best, lambda pieces=None, clients=True: ray.get(
                self.server.get_state.remote(pieces, clients)))
        self.finished = out.round >= self.cfg.training.rounds or self.res.stopped is not None or (
            self.stop_after is not None and out.round >= self.stop_after)

    def _account(self, out: RoundResult, ledger: list[dict]) -> list[dict]:
        """The round's privacy rows (``accountant.py``), and the check before the next round."""
        assert self.accountant is not None
        now = releases(ledger)
        self.released += now
        rows = self.accountant.rows(out.round, self.accountant.counts(out.round, self.released), out.dp_clip)
        self.res.epsilon = {row.group: row.epsilon for row in rows}
        self._check_budget(out.round, now)
        return [dict(row.row(), target=self.split.target) for row in rows]

    def _forecast(self, last_rows: list[dict]) -> Counter[str]:
        """The next round's payload releases, as the last round run released (none run: one of each payload
        the method shares and the config noises; the data stages released theirs in round 0)."""
        return releases(last_rows) if self.res.rounds_done else self.per_round

    def _check_budget(self, done: int, last: Counter[str]) -> None:
        """Stop before round ``done`` + 1 if it would take the total epsilon
        past ``privacy.target_epsilon``, forecasting its releases as ``last``
        (the previous round's)."""
        p, acc = self.cfg.privacy, self.accountant
        if p is None or acc is None or p.target_epsilon is None or done >= self.cfg.training.rounds:
            return
        eps = acc.epsilon(acc.counts(done + 1, self.released + last))
        if eps > p.target_epsilon:
            self.res.stopped = (f"privacy.target_epsilon={p.target_epsilon:g}: stopped before round {done + 1} of "
                                f"{self.cfg.training.rounds}, which would spend epsilon {eps:.4g} at delta {p.delta:g}")
            self.finished = True
            print(f"rayfed-dg: target {self.split.target}: {self.res.stopped}", file=sys.stderr)

    def close(self) -> None:
        for cb in self.callbacks:
            cb.close()
        if self.run_dir is not None:  # the spilled states: scratch, the checkpoints hold what a resume needs
            shutil.rmtree(self.run_dir.client_state(self.split.target), ignore_errors=True)


def run_federation(cfg: ExperimentConfig, split: FederatedSplit, images_ref, labels_ref, num_classes: int,
                   run_dir: Path | None = None, progress: bool = True,
                   on_round: Callable[[RoundResult, TargetResult], None] | None = None,
                   stop_after: int | None = None, tensorboard: Path | None = None,
                   host: EngineHost | None = None) -> TargetResult:
    """Run one federation (one target domain) to the end, resuming from the
    newest valid checkpoint in ``run_dir`` if there is one.  ``stop_after``
    ends early after that round (tests of resume use it).  ``host``: running
    actors (``host.EngineHost``); without one, the federation starts its
    own, sized against the cluster, and ends them.  TensorBoard scalars go
    to ``tensorboard/<target>`` (default, with ``output.tensorboard``:
    ``run_dir/tensorboard``)."""
    fed = FederationRun(cfg, split, None if run_dir is None else RunDir(run_dir), {} if progress else None, on_round,
                        stop_after, tensorboard)
    if fed.finished:
        return fed.res
    own = host is None
    if host is None:
        host = EngineHost(cfg.engine, [images_ref, labels_ref],
                          ensure_workers(cfg.engine, clients_per_round(cfg, split)))
    try:
        server = host.open(cfg, split, num_classes)
        setup = ray.get(server.setup.remote())
        if fed.state is not None:
            ray.get(server.set_state.remote(fed.state["server"]))
        fed.opened(server, setup)
        try:
            while not fed.finished:
                fed.round_done(ray.get(server.run_round.remote()))
        finally:
            fed.close()
    finally:
        if own:
            host.close()
    return fed.res


# ------------------------------------------------------------------ experiment

def check_resume_dir(cfg: ExperimentConfig, run_dir: RunDir) -> None:
    """A run directory can be resumed only with the config that made it."""
    from rayfed_dg.config import load_config

    if not run_dir.has_config():
        raise ConfigError(f"--resume {run_dir.path}: no config.yaml there; not a rayfed-dg run directory")
    check_resumable(run_dir.path)
    old = load_config(run_dir.config_path).to_dict()
    new = cfg.to_dict()
    diff = sorted(f"{s}.{k}" for s in new if s != "output" for k in (new[s] or {}) if isinstance(new[s], dict)
                  and (old.get(s) or {}).get(k) != new[s][k])
    if new.get("compare") != old.get("compare"):
        diff.append("compare")
    if diff:
        raise ConfigError(f"--resume {run_dir.path}: that run used a different config ({', '.join(diff[:4])} differ); "
                          "resume with the same config and --set values")


def format_table(summaries: dict[str, dict]) -> str:
    """One aligned table: per variant label, a row of target accuracies (%)
    and a row of the selected rounds."""
    targets = list(next(iter(summaries.values()))["targets"])
    rows = []
    for label, summary in summaries.items():
        avg = summary.get("average_target_acc")
        rows.append([label] + [f"{100 * summary['targets'][t]['target_acc']:.2f}" for t in targets]
                    + [f"{100 * avg:.2f}" if avg is not None else "-"])
        rows.append(["selected round"] + [str(summary["targets"][t]["selected_round"]) for t in targets] + [""])
    return render_table(["method"] + targets + ["avg"], rows)
