"""What a run is made of, resolved once for the CLI, tune.py and the benches:
the dataset, the targets, each target's split, the clients per round, each
row's config, and the checks that must pass before anything is written (the
Ray side of those checks is in ``resources.py``)."""
from __future__ import annotations

from rayfed_dg.config import ExperimentConfig
from rayfed_dg.data import DomainDataset, FederatedSplit, leave_one_domain_out, load_dataset
from rayfed_dg.engine.clock.asynchronous import check_async
from rayfed_dg.engine.clock.devices import check_devices, model_bytes
from rayfed_dg.engine.privacy.updates import check_privacy
from rayfed_dg.engine.rounds.federation import clients_per_round
from rayfed_dg.engine.rounds.parts import check_pipeline
from rayfed_dg.engine.workers.resources import ensure_workers, init_ray
from rayfed_dg.errors import ConfigError, DataError, ModelError

__all__ = ["clients_per_round"]  # re-exported: the CLI and tune.py resolve a run here


def load_data(cfg: ExperimentConfig) -> DomainDataset:
    """The config's dataset, decoded at ``data.decode_size`` (the resolution,
    or larger when a random crop is taken from it); ``data.root`` is resolved
    against the data root (``$RAYFED_DG_DATA``) unless absolute."""
    from rayfed_dg.data.sources import resolve_root

    d = cfg.data
    ds = load_dataset(d.name, resolve_root(d.name, d.root), d.decode_size, d.domains, **d.loader_options())
    return ds.subsample(d.limit_per_domain, d.split_seed) if d.limit_per_domain else ds


def resolve_targets(ds: DomainDataset, target: str | None, heldout_val_domain: str | None = None) -> list[str]:
    """``all`` (or None): every domain but the held-out validation domain."""
    if heldout_val_domain is not None:
        ds.domain_index(heldout_val_domain)  # raises DataError with a did-you-mean
    if target in (None, "all"):
        return [d for d in ds.domain_names if d != heldout_val_domain]
    names = [t.strip() for t in target.split(",")]
    for t in names:
        ds.domain_index(t)  # raises DataError with a did-you-mean
        if t == heldout_val_domain:
            raise ConfigError(f"--target {t} is data.heldout_val_domain; it validates and is never a target")
    return names




def split_for(cfg: ExperimentConfig, ds: DomainDataset, target: str) -> FederatedSplit:
    p, d = cfg.partition, cfg.data
    return leave_one_domain_out(ds, target, d.val_fraction, d.split_seed, p.strategy, p.num_clients, p.alpha,
                                p.min_size, p.clients, p.heterogeneity, d.source_test_fraction, d.heldout_val_domain)


def make_splits(cfg: ExperimentConfig, ds: DomainDataset, targets: list[str]) -> list[FederatedSplit]:
    """All partitions of a run, checked (clients per round, data stages)
    before anything is written."""
    from rayfed_dg.stages import build_stages

    splits = [split_for(cfg, ds, t) for t in targets]
    stages = build_stages(cfg)
    for s in splits:
        clients_per_round(cfg, s)
        for stage in stages:
            stage.check_clients(s.num_clients)
    return splits


def match_budget(base: ExperimentConfig, base_split: FederatedSplit, row: ExperimentConfig,
                 row_split: FederatedSplit) -> ExperimentConfig:
    """A ``compare`` row with its own partition (e.g. the centralized
    reference) trains as many local SGD steps per round, summed over the
    round's clients, as the comparison's partition, so rows differ in who
    holds the data, not in compute.

    * ``training.local_steps`` S with K clients per round: the row's clients
      per round become min(K, its clients) = K' and its local steps
      ceil(K * S / K') (the centralized client: K * S steps a round).
    * ``training.local_epochs`` with every client in every round: unchanged:
      an epoch over the pooled data is the same number of samples as an epoch
      on every client (the step counts differ only in each client's last
      partial batch).  With partial participation an epoch budget depends on
      which clients were sampled, so the row needs ``training.local_steps``.
    """
    if row.partition == base.partition:
        return row
    t = base.training
    k_base = clients_per_round(base, base_split)
    k_row = min(k_base, row_split.num_clients)
    if t.local_steps is None:
        if k_base < base_split.num_clients:
            raise ConfigError(f"compare row {row.method.label or row.method.name}: its own partition with partial "
                              f"participation ({k_base} of {base_split.num_clients} clients a round) and "
                              "training.local_epochs has no fixed step budget to match; set training.local_steps")
        k_row = row_split.num_clients
        changes = {"clients_per_round": None if k_row == row_split.num_clients else k_row}
    else:
        changes = {"clients_per_round": None if k_row == row_split.num_clients else k_row,
                   "local_steps": -(-k_base * t.local_steps // k_row)}
    from rayfed_dg.config import validate

    tree = row.to_dict()
    tree["training"].update(changes)
    return validate(tree, f"compare row {row.method.label or row.method.name} (budget of {k_base} clients a round)")


def resolve_variants(cfg: ExperimentConfig, ds: DomainDataset,
                     targets: list[str]) -> list[tuple[str, ExperimentConfig, list[FederatedSplit]]]:
    """(label, config, splits) of every row to run, checked before anything is
    written: rows with their own partition get their own splits and the
    comparison's step budget (``match_budget``)."""
    from rayfed_dg.config import method_variants

    base_splits = make_splits(cfg, ds, targets)
    out = []
    for label, vcfg in method_variants(cfg):
        if vcfg.partition == cfg.partition:
            same = vcfg.active_stages() == cfg.active_stages()  # typed: the row's are written resolved
            out.append((label, vcfg, base_splits if same else make_splits(vcfg, ds, targets)))
            continue
        splits = [split_for(vcfg, ds, t) for t in targets]
        vcfg = match_budget(cfg, base_splits[0], vcfg, splits[0])
        out.append((label, vcfg, make_splits(vcfg, ds, targets)))
    return out


def preflight(cfg: ExperimentConfig, splits: list[FederatedSplit], num_classes: int) -> None:
    """Fail before anything is written: the model builds (weights found, the
    method accepts the backbone; client batching can batch it), the stages can run, the aggregation parts
    combine (``parts.check_pipeline``), the privacy section
    can be honoured (``dp.check_privacy``), and the worker pool fits the Ray
    cluster."""

    from rayfed_dg.methods import build_method
    from rayfed_dg.stages import build_stages

    try:
        model = build_method(cfg, splits[0].num_clients).build_model(num_classes)
    except (ValueError, KeyError) as e:
        if isinstance(e, (ConfigError, ModelError, DataError)):
            raise
        # a method that cannot build on this backbone is a config problem, not a crash
        raise ConfigError(f"method {cfg.method.name} cannot build model.arch={cfg.model.arch}: {e}") from None
    if cfg.engine.client_batching:
        from rayfed_dg.methods.batching import check_model

        check_model(model)
    if cfg.devices.enabled:
        for s in splits:
            check_devices(cfg, s, model_bytes(model.state_dict()))
    for stage in build_stages(cfg):
        stage.preflight()
    check_pipeline(cfg)
    for s in splits:
        check_async(cfg, s.num_clients)
        check_privacy(cfg, s.num_clients, clients_per_round(cfg, s), int(s.client_sizes().sum()))
    init_ray(cfg)
    for s in splits:
        ensure_workers(cfg.engine, clients_per_round(cfg, s))
