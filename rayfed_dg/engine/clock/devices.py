"""The device model on a virtual clock: how long a client's training takes in
simulated seconds, whether its device is online at a simulated time, and
whether a training drops out before uploading (``DeviceModel``, built from
the config's ``devices:`` section); and the synchronous round's rule on that
clock (``plan_round``): who is selected, who is aggregated, when the round
closes.

Pure: no Ray, no wall time, no torch.  Every random choice is seeded from
``rayfed_dg.seeding`` (per client, per draw, per Markov step), so the same
config gives the same devices and the same participants on any worker count,
machine load or resume.  docs/cross_device.md describes every knob and the
trace formats.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from rayfed_dg.config import DevicesConfig, ExperimentConfig, TrainingConfig
from rayfed_dg.data.protocol import FederatedSplit
from rayfed_dg.errors import ConfigError, EngineError
from rayfed_dg.seeding import Stream, numpy_rng

from . import profiles
from .network import Network, SharedLink, shared_uploads
from .traces import AvailabilityTrace, read_availability, read_speeds

__all__ = ["AvailabilityTrace", "DeviceModel", "Devices", "MarkovChain", "RoundPlan", "check_devices", "model_bytes",
           "plan_round", "planned_steps", "planned_work"]

MAX_WAITS = 100_000  # a round start that finds nobody online this many wait_s steps in a row is an error
_SNAPSHOT = 256  # markov: the chain's states are kept every this many steps, so an earlier t replays at most this many


class Devices(Protocol):
    def duration(self, client: int, steps: float, draw: int) -> float:
        """Simulated seconds of one training (``steps`` local steps in full
        batches' worth, ``planned_work``, plus the model's download and
        upload if modelled); ``draw``: which training of this client (the
        sync round number; the async start counter)."""
        ...

    def available(self, client: int, t: float) -> bool:
        """Whether the device is online at simulated time ``t``."""
        ...

    def drops(self, client: int, draw: int) -> bool:
        """Whether this training drops out before uploading."""
        ...


def _epoch_batches(batch_size: int, n_samples: int) -> list[int]:
    """The sizes of one epoch's mini-batches as the worker's ``batches``
    draws them: full ones, then the rest, unless it is a single sample of
    several (BatchNorm needs two)."""
    full, rest = divmod(n_samples, batch_size)
    return [batch_size] * full + ([rest] if rest >= 2 or n_samples == 1 else [])


def planned_work(training: TrainingConfig, n_samples: int) -> float:
    """A training's local steps in full batches' worth, what its duration
    counts: a batch of k samples counts k / batch_size (an epoch's last batch
    is short; compute goes with the samples)."""
    b = training.batch_size
    epoch = _epoch_batches(b, n_samples)
    if training.local_steps is None:
        return training.local_epochs * sum(epoch) / b
    laps, part = divmod(training.local_steps, len(epoch))
    return (laps * sum(epoch) + sum(epoch[:part])) / b


def planned_steps(training: TrainingConfig, n_samples: int) -> int:
    """The local steps a client of ``n_samples`` samples takes in one round:
    ``training.local_steps``, or ``local_epochs`` passes of its mini-batches."""
    if training.local_steps is not None:
        return training.local_steps
    return training.local_epochs * len(_epoch_batches(training.batch_size, n_samples))


class MarkovChain:
    """Each device's online state as a two-state Markov chain observed every
    ``step`` seconds (constant in between): it starts in its stationary
    distribution and moves with the exact transition probabilities of the
    continuous-time chain with those mean sojourns over one step.  Step k's
    uniforms come from (seed, stream, k), so the state at any t is the same
    whatever was asked before; states are kept every ``_SNAPSHOT`` steps."""

    def __init__(self, seed: int, num_clients: int, mean_on: float, mean_off: float, step: float):
        self.seed, self.n, self.step = seed, num_clients, step
        a, b = 1.0 / mean_on, 1.0 / mean_off  # rates of leaving the online and the offline state
        decay = math.exp(-(a + b) * step)
        self.p_on = b / (a + b)  # stationary share online
        self.p_stay_on = self.p_on + (1 - self.p_on) * decay
        self.p_come_on = self.p_on * (1 - decay)
        self.snapshots = {0: numpy_rng(seed, Stream.DEVICE_MARKOV, 0).random(num_clients) < self.p_on}
        self.last = (0, self.snapshots[0])

    def state(self, t: float) -> np.ndarray:
        k = int(t // self.step)
        base = max(s for s in self.snapshots if s <= k)
        on = self.snapshots[base]
        if base < self.last[0] <= k:
            base, on = self.last
        for j in range(base + 1, k + 1):
            u = numpy_rng(self.seed, Stream.DEVICE_MARKOV, j).random(self.n)
            on = np.where(on, u < self.p_stay_on, u < self.p_come_on)
            if j % _SNAPSHOT == 0:
                self.snapshots[j] = on
        self.last = (k, on)
        return on


class DeviceModel:
    """Implements ``Devices`` from the ``devices:`` section for the clients
    whose domains ``client_domains`` lists (a multi-domain client,
    ``photo+sketch``, is offline in either domain's window); ``model_bytes``:
    what one download (and again one upload) carries over ``network``.  A
    device's speed is fixed; its transfers' jitter is drawn per training."""

    def __init__(self, cfg: DevicesConfig, seed: int, client_domains: list[str], model_bytes: int = 0):
        self.cfg, self.seed, self.n = cfg, seed, len(client_domains)
        links = self.profile = None
        if cfg.profiles:
            computes, links = profiles.tiers(cfg.profiles)
            self.profile = profiles.assign([p.share for p in cfg.profiles], self.n, seed)
            self.speeds = 1.0 / np.array([computes[k].slowdown for k in self.profile.tolist()])
        elif cfg.speed == "lognormal":
            self.speeds = np.exp(cfg.speed_sigma * numpy_rng(seed, Stream.DEVICE_SPEED).standard_normal(self.n))
        elif cfg.speed == "trace":
            assert cfg.speed_trace is not None  # the config's validator
            self.speeds = read_speeds(cfg.speed_trace, cfg.trace_format, self.n)
        else:
            self.speeds = np.ones(self.n)
        doms = [set(d.split("+")) for d in client_domains]
        if cfg.domain_slowdown:
            self.speeds = self.speeds / np.array([max(cfg.domain_slowdown.get(x, 1.0) for x in d) for d in doms])
        self.network = Network(cfg, seed, self.n, model_bytes, links, self.profile)
        if cfg.availability == "diurnal":
            self.phase = numpy_rng(seed, Stream.DEVICE_PHASE).uniform(0.0, cfg.period_s, self.n)
        elif cfg.availability == "markov":
            self.chain = MarkovChain(seed, self.n, cfg.mean_online_s, cfg.mean_offline_s, cfg.markov_step_s)
        elif cfg.availability == "trace":
            assert cfg.availability_trace is not None
            self.trace = read_availability(cfg.availability_trace, cfg.trace_format, self.n)
        self.windows = [(w.start_s, w.end_s, np.array([w.domain in d for d in doms], bool))
                        for w in cfg.domain_offline]

    def ready(self, client: int, steps: float, draw: int) -> float:
        """Seconds from a training's start until its upload starts: the download, the local steps and the
        training's overhead, both at the device's speed."""
        c = self.cfg
        return self.network.down_s(client, draw) + (c.overhead_s + steps * c.step_seconds) / float(self.speeds[client])

    def duration(self, client: int, steps: float, draw: int) -> float:
        """The whole training with its upload on the device's own link."""
        return self.ready(client, steps, draw) + self.network.up_s(client, draw)

    def online(self, t: float) -> np.ndarray:
        """Every client's ``available`` at ``t`` (one boolean per client)."""
        c = self.cfg
        if c.availability == "diurnal":
            on = (t - self.phase) % c.period_s < c.online_fraction * c.period_s
        elif c.availability == "markov":
            on = self.chain.state(t).copy()
        elif c.availability == "trace":
            on = self.trace.online(t)
        else:
            on = np.ones(self.n, bool)
        for start, end, mask in self.windows:
            if start <= t < end:
                on &= ~mask
        return on

    def available(self, client: int, t: float) -> bool:
        if any(start <= t < end and mask[client] for start, end, mask in self.windows):
            return False
        c = self.cfg
        if c.availability == "diurnal":
            return bool((t - self.phase[client]) % c.period_s < c.online_fraction * c.period_s)
        if c.availability == "markov":
            return bool(self.chain.state(t)[client])
        if c.availability == "trace":
            return self.trace.available(client, t)
        return True

    def drops(self, client: int, draw: int) -> bool:
        p = self.cfg.dropout
        return p > 0 and bool(numpy_rng(self.seed, Stream.DEVICE_DROPOUT, client, draw).random() < p)


def model_bytes(state: Mapping[str, Any]) -> int:
    """Bytes of a model's tensors (NumPy arrays or torch tensors): one download, and again one upload."""
    return sum(int(v.nbytes) for v in state.values())


def check_devices(cfg: ExperimentConfig, split: FederatedSplit, nbytes: int) -> None:
    """The device model's bad input, before anything is written: a window
    naming a domain the dataset does not have, a trace that does not cover
    the clients (raised while reading it), a deadline no device can meet
    (the fastest client's training on the clock exceeds it)."""
    d = cfg.devices
    domains = [*split.val, split.target, *split.heldout_val]
    named = [(f"domain_offline.{i}.domain", w.domain) for i, w in enumerate(d.domain_offline)]
    for key, domain in [*named, *((f"domain_slowdown.{x}", x) for x in d.domain_slowdown)]:
        if domain not in domains:
            raise ConfigError(f"devices.{key}: unknown domain {domain!r}; use one of {', '.join(domains)}")
    dev = DeviceModel(d, cfg.training.seed, split.client_domains, nbytes)
    if d.deadline_s is not None:
        # the floor of every training: the network's jitter (exponential) only adds to it, so a deadline above the
        # floor is met by some draws, one below it by none
        dev.network.jitter_s = 0.0
        sizes = split.client_sizes()
        fastest = min(dev.duration(c, planned_work(cfg.training, int(n)), 0) for c, n in enumerate(sizes))
        if fastest > d.deadline_s:
            raise ConfigError(f"devices.deadline_s: {d.deadline_s:g} s is shorter than the fastest client's "
                              f"training ({fastest:g} s simulated, without jitter); raise it to {fastest:g} or more, "
                              "or lower devices.step_seconds (or raise the network's bandwidths)")


@dataclass
class RoundPlan:
    """One synchronous round on the clock: selected at ``start``, each
    selected client's ``finish`` (would-be, for those that drop out), the
    clients aggregated (in client order), why each other selected client
    was not (``dropout``, ``deadline``, ``late``: K others uploaded first),
    and ``close``, when the round aggregates and the next one starts."""
    start: float
    selected: list[int]
    finish: dict[int, float]
    aggregated: list[int]
    reasons: dict[int, str]
    close: float


def plan_round(dev: Devices, num_clients: int, seed: int, r: int, t: float, k: int, steps: np.ndarray,
               over_selection: float = 1.0, deadline_s: float | None = None, wait_s: float = 60.0) -> RoundPlan:
    """Round ``r``, ready at simulated time ``t``, that aggregates up to
    ``k`` clients, ``steps[c]`` local steps each:

    1. the clients online at t; none: t moves on by ``wait_s`` until one is;
    2. sample ceil(over_selection x k) of them (all if fewer are online),
       seeded by (seed, round): with every client online and no
       over-selection, the clients the round samples without the clock;
    3. each selected client finishes at t + its duration unless it drops out
       (with a shared server link, ``devices.network.server_mbps``: the
       uploads of those that do not drop out divide it, ``shared_uploads``;
       a dropout's would-be finish is on its own link);
    4. the round closes when k have uploaded or at t + deadline_s, whichever
       is first (FedScale's rule); the first k uploads by then (ties in
       client order) are aggregated.  Without a deadline and fewer than k
       uploads, it closes at the last selected client's finish (a dropout
       is noticed when its training would have ended).
    """
    start = t
    for _ in range(MAX_WAITS):
        on = dev.online(t) if isinstance(dev, DeviceModel) else \
            np.array([dev.available(c, t) for c in range(num_clients)], bool)
        online = np.flatnonzero(on)
        if len(online):
            break
        t += wait_s
    else:
        raise EngineError(f"round {r}: no client was online from {start:g} s to {t:g} s simulated; check "
                          "devices.availability and devices.domain_offline")
    m = math.ceil(round(over_selection * k, 9))
    if m >= len(online):
        selected = [int(c) for c in online]
    else:
        selected = sorted(int(c) for c in numpy_rng(seed, Stream.SAMPLE, r).choice(online, size=m, replace=False))
    finish = {c: t + dev.duration(c, float(steps[c]), r) for c in selected}
    dropped = {c for c in selected if dev.drops(c, r)}
    if isinstance(dev, DeviceModel) and dev.network.shared:
        net = dev.network
        assert net.capacity_bps is not None
        up = {c: t + dev.ready(c, float(steps[c]), r) for c in selected if c not in dropped}
        ends = shared_uploads(SharedLink(net.capacity_bps), up, net.bits, {c: float(net.up_bps[c]) for c in up})
        finish.update({c: e + net.up_delay_s(c, r) for c, e in ends.items()})
    cutoff = math.inf if deadline_s is None else t + deadline_s
    arrivals = sorted((finish[c], c) for c in selected if c not in dropped and finish[c] <= cutoff)[:k]
    made = {c for _, c in arrivals}
    if len(made) == k:
        close = arrivals[-1][0]
    else:
        close = cutoff if deadline_s is not None else max(finish.values())
    reasons = {c: "dropout" if c in dropped else "deadline" if finish[c] > cutoff else "late"
               for c in selected if c not in made}
    return RoundPlan(t, selected, finish, sorted(made), reasons, close)
