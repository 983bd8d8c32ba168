"""Evaluate a run's saved global models again, with evaluation-time settings
changed (e.g. FedFD-A's ``method.inference``: Table 3 c1 of its paper asks
how one trained model does with global statistics, instance statistics or
the adapter).  Reads the run directory's ``config.yaml`` and its
``best_<target>.pt`` (or ``final_``) through ``RunDir``; writes nothing;
runs in this process, without Ray."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from rayfed_dg.config import ConfigError, ExperimentConfig, apply_overrides, load_config, method_variants, validate
from rayfed_dg.engine.store.records import Split, split_mean
from rayfed_dg.engine.store.rundir import RunDir

# sections an evaluation may change; anything else would not describe the saved model or its data
EVAL_SECTIONS = ("method", "evaluation", "engine")


def load_run_config(run_dir: Path, overrides: list[str]) -> ExperimentConfig:
    saved = RunDir(run_dir).config_path
    if not saved.is_file():
        raise ConfigError(f"{run_dir}: no config.yaml; pass a run directory (for a compare run, one method's "
                          "subdirectory, e.g. RUN/fedfda)")
    old = load_config(saved)
    if old.compare:
        rows = method_variants(old)
        if len(rows) > 1:
            raise ConfigError(f"{run_dir} holds several methods; pass one of its subdirectories: "
                              + ", ".join(label for label, _ in rows))
        # a comparison of one row keeps that row's files in the run directory itself (Experiment.row_dir)
        old = rows[0][1]
        cfg = validate(apply_overrides(old.to_dict(), overrides), f"{saved} (its one compare row, with --set)")
    else:
        cfg = load_config(saved, overrides)
    a, b = old.to_dict(), cfg.to_dict()
    changed = sorted(s for s in b if s not in EVAL_SECTIONS and a.get(s) != b.get(s))
    if changed:
        raise ConfigError(f"--set changes {', '.join(changed)}: evaluate may only change "
                          f"{', '.join(s + '.*' for s in EVAL_SECTIONS)}; train a new run for the rest")
    if cfg.method.name != old.method.name:
        raise ConfigError(f"--set method.name: the saved models were trained with {old.method.name}")
    return cfg


def _runner(cfg: ExperimentConfig, ds, target: str):
    from rayfed_dg.engine.workers.worker import ClientRunner

    from .plan import split_for

    threads = torch.get_num_threads()
    # the model of some methods depends on the partition (COPA: one head per client)
    runner = ClientRunner(cfg, ds.images, ds.labels, ds.num_classes, split_for(cfg, ds, target).num_clients)
    torch.set_num_threads(threads)  # the runner pins a worker's share; this process may use them all
    return runner


def _saved_state(runner, run_dir: Path, weights: str, target: str) -> dict[str, np.ndarray]:
    path = RunDir(run_dir).weights(weights, target)
    if not path.is_file():
        raise ConfigError(f"{path} is missing: the run saved no {weights} model for target {target}"
                          + (" (output.save_best_checkpoint was off?)" if weights == "best" else ""))
    state = {k: v.numpy() for k, v in torch.load(path, weights_only=True).items()}
    expected = set(runner.model.state_dict())
    if set(state) != expected:
        diff = sorted(set(state) ^ expected)
        raise ConfigError(f"{path} does not fit the model these settings build ({len(diff)} tensors differ, "
                          f"e.g. {diff[0]}); evaluate with the settings the run was trained with")
    return state


def evaluate_saved(cfg: ExperimentConfig, ds, targets: list[str], run_dir: Path, weights: str = "best") -> dict:
    """{target: {"source_val": acc, "target_test": acc, "domains": {...}}} for the saved models."""
    from .plan import split_for

    runner = _runner(cfg, ds, targets[0])
    out = {}
    for t in targets:
        state = _saved_state(runner, run_dir, weights, t)
        split = split_for(cfg, ds, t)
        res: dict[str, Any] = {"domains": {}}
        rows = []  # as the metrics table's, of one round
        for name, sets in ((Split.SOURCE_VAL, split.val), (Split.TARGET_TEST, split.test)):
            for dom, idx in sets.items():
                correct, _, n = runner.evaluate(state, np.asarray(idx), cfg.evaluation.batch_size)
                res["domains"][f"{name}:{dom}"] = correct / max(n, 1)
                rows.append({"round": 0, "split": name, "accuracy": correct / max(n, 1)})
            res[name] = split_mean(rows, name, 0)
        out[t] = res
    return out


@torch.no_grad()
def saved_features(cfg: ExperimentConfig, ds, target: str, run_dir: Path, weights: str = "best",
                   per_domain: int = 200, seed: int = 0) -> dict[str, np.ndarray]:
    """Penultimate features (``model.features``) of a run's saved global
    model on every domain's held-out images: each source domain's validation
    split and the target domain, a seeded sample of at most ``per_domain``
    images each.  Returns arrays ``features`` (N x D), ``domain`` (names),
    ``label`` (class indices), ``is_target`` and ``index`` (into the dataset)."""
    from .plan import split_for

    runner = _runner(cfg, ds, target)
    runner._load(_saved_state(runner, run_dir, weights, target))
    runner.model.eval()
    split = split_for(cfg, ds, target)
    rng = np.random.default_rng(seed)
    feats, doms, labels, is_target, index = [], [], [], [], []
    for sets, tgt in ((split.val, False), (split.test, True)):
        for dom, idx in sets.items():
            idx = np.sort(rng.choice(np.asarray(idx), min(per_domain, len(idx)), replace=False))
            for s in range(0, len(idx), cfg.evaluation.batch_size):
                x, _ = runner._tensors(idx[s:s + cfg.evaluation.batch_size], None)
                feats.append(runner.model.features(x).flatten(1).cpu().numpy())
            doms += [dom] * len(idx)
            labels.append(ds.labels[idx])
            index.append(idx)
            is_target += [tgt] * len(idx)
    return {"features": np.concatenate(feats), "domain": np.array(doms), "label": np.concatenate(labels),
            "is_target": np.array(is_target), "index": np.concatenate(index)}
