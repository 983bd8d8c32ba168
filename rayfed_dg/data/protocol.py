"""Leave-one-domain-out split and client partitions.

The target domain is the whole test set; every source domain is split into
train / validation, stratified by class and seeded.  Partitions spread the
source *train* samples over clients; each source domain's validation split is
kept whole for model selection (mean accuracy over source domains).  No
target sample ever reaches training or selection.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from rayfed_dg.utils import Registry

from .base import DataError, DomainDataset


@dataclass
class FederatedSplit:
    """Indices into a ``DomainDataset`` for one leave-one-domain-out run."""

    target: str
    clients: list[np.ndarray]  # train indices per client, sorted
    client_domains: list[str]  # the (main) domain of each client: display, client-side validation
    val: dict[str, np.ndarray]  # source domain -> validation indices
    test: dict[str, np.ndarray]  # target domain -> all its indices
    # source domain -> its in-domain test indices (data.source_test_fraction > 0), never trained or selected on
    source_test: dict[str, np.ndarray] = field(default_factory=dict)
    # the held-out validation domain -> all its indices (data.heldout_val_domain), neither trained on nor a target
    heldout_val: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def num_clients(self) -> int:
        return len(self.clients)

    def client_sizes(self) -> np.ndarray:
        return np.array([len(c) for c in self.clients], dtype=np.int64)


def stratified_split(indices: np.ndarray, labels: np.ndarray, val_fraction: float, seed: int):
    """Split ``indices`` into (train, val) per class; every class with at
    least two samples contributes at least one of each."""
    rng = np.random.default_rng(seed)
    train, val = [], []
    for c in np.unique(labels[indices]):
        idx = indices[labels[indices] == c].copy()
        rng.shuffle(idx)
        n_val = int(round(len(idx) * val_fraction))
        if len(idx) >= 2:
            n_val = min(max(n_val, 1), len(idx) - 1)
        else:
            n_val = 0
        val.append(idx[:n_val])
        train.append(idx[n_val:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(val))


def _seed_for(*parts: int | float | str) -> np.random.SeedSequence:
    return np.random.SeedSequence([abs(hash_str(str(p))) for p in parts])


def hash_str(s: str) -> int:
    # stable across processes (Python's hash() is salted)
    h = 1469598103934665603
    for ch in s.encode():
        h = ((h ^ ch) * 1099511628211) % (1 << 63)
    return h


def partition_per_domain(source_train: dict[str, np.ndarray], labels, **_) -> tuple[list, list]:
    names = list(source_train)
    return [source_train[d] for d in names], names


def partition_single_domain(source_train, labels, num_clients: int, seed: int, **_):
    """N / #sources clients per source domain, each domain split uniformly."""
    names = list(source_train)
    if num_clients % len(names):
        raise DataError(f"partition.num_clients={num_clients} is not a multiple of the {len(names)} source domains")
    per = num_clients // len(names)
    clients, doms = [], []
    for d in names:
        idx = source_train[d].copy()
        np.random.default_rng(_seed_for(seed, "single", d)).shuffle(idx)
        for part in np.array_split(idx, per):
            clients.append(np.sort(part))
            doms.append(d)
    return clients, doms


def partition_dirichlet_domains(source_train, labels, num_clients: int, alpha: float, seed: int, min_size: int, **_):
    """Multi-domain Dirichlet: per domain, proportions ~ Dir(alpha) over all
    clients, with the proportion of a client already holding its fair share
    (total / N) zeroed before renormalising, as in StableFDG's reference
    split; redrawn (up to 1,000 times) until every client has ``min_size``."""
    names = list(source_train)
    rng = np.random.default_rng(_seed_for(seed, "dirichlet", alpha))
    fair = sum(len(v) for v in source_train.values()) / num_clients
    for _attempt in range(1000):
        buckets: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        main = np.zeros((num_clients, len(names)), dtype=np.int64)
        for j, d in enumerate(names):
            idx = source_train[d].copy()
            rng.shuffle(idx)
            p = rng.dirichlet(np.full(num_clients, alpha))
            p[main.sum(1) >= fair] = 0.0
            p = p / p.sum() if p.sum() > 0 else np.full(num_clients, 1.0 / num_clients)
            cuts = (np.cumsum(p) * len(idx)).astype(int)[:-1]
            for i, part in enumerate(np.split(idx, cuts)):
                buckets[i].append(part)
                main[i, j] = len(part)
        sizes = main.sum(1)
        if sizes.min() >= min_size:
            clients = [np.sort(np.concatenate(b)) for b in buckets]
            doms = [names[int(np.argmax(m))] for m in main]
            return clients, doms
    raise DataError(
        f"partition dirichlet(alpha={alpha}) could not give all {num_clients} clients "
        f"min_size={min_size} samples in 1000 draws; lower partition.min_size or raise alpha"
    )


def _even_split(idx: np.ndarray, k: int, rng: np.random.Generator) -> list[np.ndarray]:
    idx = idx.copy()
    rng.shuffle(idx)
    return np.array_split(idx, k)


def partition_label_dirichlet(source_train, labels, num_clients: int, alpha: float, seed: int, min_size: int, **_):
    """Label non-IID (FedFD-A appendix D.1): N / #sources clients per domain;
    within each domain, each class is spread over that domain's clients with
    proportions ~ Dir(alpha).  Redrawn until every client has ``min_size``."""
    names = list(source_train)
    if num_clients % len(names):
        raise DataError(f"partition.num_clients={num_clients} is not a multiple of the {len(names)} source domains")
    per = num_clients // len(names)
    rng = np.random.default_rng(_seed_for(seed, "label_dirichlet", alpha))
    clients, doms = [], []
    for d in names:
        idx = source_train[d]
        for _attempt in range(1000):
            buckets: list[list[np.ndarray]] = [[] for _ in range(per)]
            for c in np.unique(labels[idx]):
                ic = idx[labels[idx] == c].copy()
                rng.shuffle(ic)
                cuts = (np.cumsum(rng.dirichlet(np.full(per, alpha))) * len(ic)).astype(int)[:-1]
                for i, part in enumerate(np.split(ic, cuts)):
                    buckets[i].append(part)
            parts = [np.sort(np.concatenate(b)) for b in buckets]
            if min(len(p) for p in parts) >= min_size:
                break
        else:
            raise DataError(f"partition label_dirichlet(alpha={alpha}) could not give the {per} clients of {d} "
                            f"min_size={min_size} samples in 1000 draws; lower partition.min_size or raise alpha")
        clients += parts
        doms += [d] * per
    return clients, doms


def partition_explicit(source_train, labels, seed: int, clients_spec: list[list[str]] | None = None, **_):
    """Clients named by their domains (FedFD-A Table 11: P+A, A+C, C+P); each
    domain's training data is split evenly among the clients that list it."""
    if not clients_spec:
        raise DataError("partition.strategy explicit needs partition.clients, e.g. [[photo, art_painting], ...]")
    names = list(source_train)
    holders: dict[str, list[int]] = {d: [] for d in names}
    for i, spec in enumerate(clients_spec):
        for d in spec:
            if d not in holders:
                raise DataError(f"partition.clients[{i}] names {d!r}, which is not a source domain here "
                                f"(sources: {', '.join(names)}; the target cannot be a client's domain)")
            holders[d].append(i)
    parts: list[list[np.ndarray]] = [[] for _ in clients_spec]
    for d, who in holders.items():
        if not who:
            continue
        rng = np.random.default_rng(_seed_for(seed, "explicit", d))
        for i, chunk in zip(who, _even_split(source_train[d], len(who), rng)):
            parts[i].append(chunk)
    clients = [np.sort(np.concatenate(p)) if p else np.zeros(0, np.int64) for p in parts]
    return clients, ["+".join(spec) for spec in clients_spec]


def partition_heterogeneity(source_train, labels, num_clients: int, seed: int, heterogeneity: float | None = None, **_):
    """Domain heterogeneity lambda in [0, 1] (Bai et al., ICLR 2024 FedDG
    benchmark): client i has home domain i mod #sources; a fraction lambda of
    each domain is spread evenly over all clients, the rest evenly over the
    domain's home clients.  lambda = 0: single-domain clients; lambda = 1:
    every client has the same domain mix."""
    if heterogeneity is None:
        raise DataError("partition.strategy heterogeneity needs partition.heterogeneity (lambda in [0, 1])")
    names = list(source_train)
    if num_clients < len(names):
        raise DataError(f"partition.num_clients={num_clients} is smaller than the {len(names)} source domains")
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for j, d in enumerate(names):
        rng = np.random.default_rng(_seed_for(seed, "heterogeneity", d))
        idx = source_train[d].copy()
        rng.shuffle(idx)
        n_shared = int(round(heterogeneity * len(idx)))
        home = [i for i in range(num_clients) if i % len(names) == j]
        for i, chunk in enumerate(np.array_split(idx[:n_shared], num_clients)):
            parts[i].append(chunk)
        for i, chunk in zip(home, np.array_split(idx[n_shared:], len(home))):
            parts[i].append(chunk)
    return [np.sort(np.concatenate(p)) for p in parts], [names[i % len(names)] for i in range(num_clients)]


def partition_proportional(source_train, labels, num_clients: int, seed: int, **_):
    """Single-domain clients in proportion to the domains' sizes, FedIIR's
    split (Guo et al., ICML 2023; its ``main.py``): every source domain gets
    one client, then each further client goes to the domain with the most
    training samples per client (ties: the first domain); a domain's k
    clients hold floor(n / k) samples each in a seeded order, the last one
    also the n mod k left over, as the reference's ``split_dataset_fl``."""
    names = list(source_train)
    if num_clients < len(names):
        raise DataError(f"partition.num_clients={num_clients} is smaller than the {len(names)} source domains")
    sizes = np.array([len(source_train[d]) for d in names], dtype=np.float64)
    per = np.ones(len(names), dtype=np.int64)
    for _extra in range(num_clients - len(names)):
        per[int(np.argmax(sizes / per))] += 1
    clients, doms = [], []
    for d, k in zip(names, per):
        idx = source_train[d].copy()
        np.random.default_rng(_seed_for(seed, "proportional", d)).shuffle(idx)
        each = len(idx) // int(k)
        if each < 1:
            raise DataError(f"partition.num_clients={num_clients} gives source domain {d} {k} clients for its "
                            f"{len(idx)} training samples; lower num_clients")
        for i in range(int(k)):
            clients.append(np.sort(idx[i * each:(i + 1) * each if i < k - 1 else len(idx)]))
            doms.append(d)
    return clients, doms


def partition_centralized(source_train, labels, **_):
    """The centralized reference (ERM on pooled data, the upper row of the
    FedDG papers' tables): one client holding every source domain's training
    data.  Aggregating one client is the identity, so a run is plain SGD on
    the pooled sources; as a ``compare`` row it trains as many local steps per
    round as the comparison's clients together (``engine.running.plan.match_budget``)."""
    names = list(source_train)
    return [np.sort(np.concatenate([source_train[d] for d in names]))], ["+".join(names)]


PARTITIONS: Registry = Registry("partition.strategy", DataError)
for _name, _fn in (("per_domain", partition_per_domain), ("single_domain", partition_single_domain),
                   ("dirichlet", partition_dirichlet_domains), ("label_dirichlet", partition_label_dirichlet),
                   ("explicit", partition_explicit), ("heterogeneity", partition_heterogeneity),
                   ("centralized", partition_centralized), ("proportional", partition_proportional)):
    PARTITIONS.add(_name, _fn)


def leave_one_domain_out(
    ds: DomainDataset,
    target: str,
    val_fraction: float,
    split_seed: int,
    strategy: str = "per_domain",
    num_clients: int | None = None,
    alpha: float | None = None,
    min_size: int = 1,
    clients_spec: list[list[str]] | None = None,
    heterogeneity: float | None = None,
    source_test_fraction: float = 0.0,
    heldout_val_domain: str | None = None,
) -> FederatedSplit:
    """The target's split.  ``source_test_fraction`` > 0 first sets aside
    that fraction of each source domain (per class, its own seed) as the
    in-domain test split, then ``val_fraction`` of the domain for
    validation; 0 sets nothing aside and draws nothing more: the train / val
    split is the one without a test split.
    ``heldout_val_domain`` is neither trained on nor a target: all of it
    validates (FedDG-Benchmark's held-out-domain validation)."""
    t = ds.domain_index(target)
    h = None if heldout_val_domain is None else ds.domain_index(heldout_val_domain)
    if h == t:
        raise DataError(f"target {target} is data.heldout_val_domain; choose another target or validation domain")
    partition = PARTITIONS.get(strategy)
    source_train, val, source_test, heldout = {}, {}, {}, {}
    for j, d in enumerate(ds.domain_names):
        if j == t:
            continue
        idx = np.flatnonzero(ds.domains == j)
        if j == h:
            heldout[d] = idx
            continue
        frac = val_fraction
        if source_test_fraction > 0:
            seed = int(_seed_for(split_seed, d, "source_test").generate_state(1)[0])
            idx, source_test[d] = stratified_split(idx, ds.labels, source_test_fraction, seed=seed)
            frac = val_fraction / (1 - source_test_fraction)  # still val_fraction of the whole domain
        tr, va = stratified_split(idx, ds.labels, frac, seed=int(_seed_for(split_seed, d).generate_state(1)[0]))
        source_train[d], val[d] = tr, va
    if strategy not in ("per_domain", "explicit", "centralized") and num_clients is None:
        raise DataError(f"partition.strategy {strategy} needs partition.num_clients")
    if strategy in ("dirichlet", "label_dirichlet") and alpha is None:
        raise DataError(f"partition.strategy {strategy} needs partition.alpha > 0")
    clients, doms = partition(
        source_train, ds.labels, num_clients=num_clients, alpha=alpha, seed=split_seed, min_size=min_size,
        clients_spec=clients_spec, heterogeneity=heterogeneity,
    )
    for i, c in enumerate(clients):
        if len(c) < min_size:
            raise DataError(
                f"client {i} ({doms[i]}) got {len(c)} training samples, fewer than partition.min_size={min_size}; "
                "use fewer clients or a smaller min_size"
            )
    test = {target: np.flatnonzero(ds.domains == t)}
    return FederatedSplit(target=target, clients=clients, client_domains=doms, val=val, test=test,
                          source_test=source_test, heldout_val=heldout)


def manifest(ds: DomainDataset, split: FederatedSplit) -> dict[str, np.ndarray]:
    """Columns of the partition manifest: client (-1 outside training),
    domain, class, sample id (index in the dataset) and split."""
    client: list[np.ndarray] = []
    parts: list[np.ndarray] = []
    part: list[str] = []
    for i, idx in enumerate(split.clients):
        client.append(np.full(len(idx), i))
        parts.append(idx)
        part += ["train"] * len(idx)
    for name, sets in (("val", split.val), ("test", split.test), ("source_test", split.source_test),
                       ("heldout_val", split.heldout_val)):
        for idx in sets.values():
            client.append(np.full(len(idx), -1))
            parts.append(idx)
            part += [name] * len(idx)
    sid = np.concatenate(parts).astype(np.int64)
    return {
        "client": np.concatenate(client).astype(np.int64),
        "domain": np.array(ds.domain_names, dtype=object)[ds.domains[sid]],
        "class": np.array(ds.class_names, dtype=object)[ds.labels[sid]],
        "sample_id": sid,
        "split": np.array(part, dtype=object),
    }
