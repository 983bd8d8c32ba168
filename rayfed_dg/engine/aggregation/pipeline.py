"""The aggregation pipeline: how one round's uploads become the next global model.

Every round, synchronous or asynchronous, passes its uploads through the
same declared parts, in one fixed order:

1. ``transform``: what each client does to its upload before it leaves
   (DP-FedAvg's clip, ``privacy/updates.py``), sent with its task;
2. the exact fold (``exact.py``): workers sum the uploads they trained into
   one order-independent partial each, when the estimator reads the uploads
   only as their weighted sum and the method does too; otherwise each
   upload travels whole;
3. the ``Estimator``: the point the round moves to, from the uploads and
   the global model x_t (the weighted mean; DP's fixed-denominator mean with
   its noise; FedBuff's staleness-weighted buffer; FedAsync's mixing; the
   robust rules of ``robust.py``; a user's own, registered like a method);
4. noise, where the estimator declares it adds it (DP-FedAvg noises the sum
   before its fixed division, so its noise is part of its estimator);
5. the server optimizer (``server_opt.py``): a step from x_t along the
   estimate minus x_t, for the broadcast parameters;
6. the method's assembly (``Method.assemble_global``): the keys it declares
   in ``assembles``, set from the round's results.

Which parts combine is decided in one function, ``refusal``, from the
parts' declarations and the method's (``methods.Declarations``), never from
their names; each refusal is one line naming the key to change.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from difflib import get_close_matches
from typing import Any, ClassVar

import numpy as np

from rayfed_dg.errors import ConfigError, EngineError
from rayfed_dg.methods import ClientUpdate, Declarations, Slot

from .exact import Reducer
from .server_opt import ServerOptimizer

State = dict[str, np.ndarray]


def traits(d: Declarations) -> frozenset[str]:
    """What a method does on the server, from its declarations: the server
    hooks it overrides, ``reads_uploads`` (it reads each upload whole) and
    ``round_phases`` (a phase that needs the whole cohort at one model)."""
    out = set(d.overrides)
    if not d.folds_on_workers:
        out.add("reads_uploads")
    if any(p.slot is not Slot.AT_EVALUATION for p in d.phases):
        out.add("round_phases")
    return frozenset(out)


@dataclass
class Uploads:
    """What an estimator reads of one round: x_t, the exact weighted sum
    (complete when the estimator ``sums``), each returned client's update
    (its tensors where they travelled whole), in ``order`` (client order; an
    asynchronous update's is its arrival order), and per client its reduce
    weight, the model it trained from and its staleness."""
    round: int
    x: State
    reducer: Reducer
    updates: Mapping[int, ClientUpdate]
    order: list[int]
    weights: Mapping[int, float] = field(default_factory=dict)
    starts: Mapping[int, State] = field(default_factory=dict)  # asynchronous: the version each trained from
    staleness: Mapping[int, int] = field(default_factory=dict)

    def uploads(self) -> list[tuple[int, Mapping[str, np.ndarray]]]:
        """(client, whole upload) in ``order``, for the clients that returned one."""
        return [(c, self.updates[c].update) for c in self.order if c in self.updates]


class Estimator:
    """An aggregation part that makes the round's estimate.  A subclass
    declares what it needs and allows in class attributes; ``estimate``
    returns a full state (keys nobody uploaded keep x_t's value)."""

    name: ClassVar[str] = ""
    key: ClassVar[str] = "server.aggregator"  # the config key that chose it (refusals name it)
    sums: ClassVar[bool] = True  # reads the uploads only as their weighted sum: workers may fold them
    steps_optimizer: ClassVar[bool] = True  # the server optimizer may step along its estimate
    sensitivity_bounded: ClassVar[bool] = False  # one client moves it by a known bound (noise may be added)
    noises: ClassVar[bool] = False  # adds noise itself (the pipeline's step 4)
    # method traits it cannot take, in the order checked: trait -> why (``{phase}``: the first round phase)
    refuses: ClassVar[dict[str, str]] = {}
    advice: ClassVar[str] = "use another method"

    def __init__(self, cfg: Any, init: State):
        self.cfg = cfg

    def weights(self, clients: list[int], method_weights: Callable[[list[int]], np.ndarray]) -> dict[int, float]:
        return dict(zip(clients, (float(w) for w in method_weights(clients))))

    def bind(self, parameters: list[str]) -> None:
        """The global model's broadcast parameters (``server_opt.stepped_keys``:
        what a server optimizer steps; buffers, a method's local keys and the
        keys it assembles are not among them), given once the model is built,
        for an estimator that treats them apart from the buffers."""

    def client_clip(self) -> float | None:
        """The L2 clip each client applies to its update before it leaves (the
        pipeline's step 1, sent with the task); None: the upload leaves as it is."""
        return None

    def estimate(self, u: Uploads) -> State:
        raise NotImplementedError

    def record(self) -> dict[str, Any]:
        """Facts of the round's aggregation for its records (DP's clip)."""
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class Mean(Estimator):
    """The weighted mean of the uploads, sum_i w_i y_i / sum_i w_i over the
    clients that returned (FedAvg, McMahan et al. 2017), from the exact sum."""

    name = "mean"

    def estimate(self, u: Uploads) -> State:
        return u.reducer.result(u.x)


ESTIMATORS: dict[str, type[Estimator]] = {"mean": Mean}


def register_aggregator(cls: type[Estimator]) -> type[Estimator]:
    """Register an estimator class under its ``name``, for ``server.aggregator``
    (a plugin module's import calls this, as ``register_method`` for methods)."""
    if not cls.name or not issubclass(cls, Estimator):
        raise TypeError(f"{cls!r} must subclass Estimator and set a name")
    ESTIMATORS[cls.name] = cls
    return cls


def aggregator_class(name: str) -> type[Estimator]:
    if name not in ESTIMATORS:
        near = get_close_matches(name, sorted(ESTIMATORS), n=1)
        hint = f"did you mean {near[0]!r}? " if near else ""
        raise ConfigError(f"server.aggregator={name!r} is not a registered aggregator; {hint}choose one of "
                          f"{sorted(ESTIMATORS)} or register yours (docs/extending.md)")
    return ESTIMATORS[name]


def refusal(estimator: type[Estimator], chosen: list[type[Estimator]], d: Declarations) -> str | None:
    """Why these parts cannot run together with this method (one line), or
    None.  ``chosen``: every estimator the config asks for (one is allowed);
    ``estimator``: the one that runs."""
    noiser = next((p for p in chosen if p.noises), None)
    loose = next((p for p in chosen if p is not noiser and not p.sensitivity_bounded), None)
    if noiser is not None and loose is not None:
        return (f"{loose.key}={loose.name}: {noiser.key} adds noise calibrated to one client's bounded effect on a "
                f"fixed-denominator mean, which {loose.name} does not have; use {loose.key} mean or drop "
                f"{noiser.key}")
    if len(chosen) > 1:
        a, b = chosen[0], chosen[1]
        return (f"{b.key}={b.name}: {a.key} combines the uploads its own way, and a round has one estimator; "
                f"use {b.key} mean or drop {a.key.split('=')[0]}")
    t = traits(d)
    for trait, why in estimator.refuses.items():
        if trait in t:
            phase = next((p.label for p in d.phases if p.slot is not Slot.AT_EVALUATION), "")
            return f"{estimator.key}: method {d.name} {why.format(phase=phase)}; {estimator.advice}"
    return None


class Pipeline:
    """One federation's aggregation: its estimator, server optimizer and the
    method's assembly (the module docstring's steps 3 to 6)."""

    def __init__(self, estimator: Estimator, optimizer: ServerOptimizer | None, method: Any,
                 assembled: set[str]):
        self.estimator, self.optimizer, self.method, self.assembled = estimator, optimizer, method, assembled

    def folds(self) -> bool:
        """Whether workers fold the uploads (the estimator and the method read only their sum)."""
        return self.estimator.sums and self.method.folds_on_workers

    def run(self, u: Uploads, results: list[ClientUpdate], server_state: dict) -> State:
        """The new global model of round ``u.round``."""
        est = self.estimator.estimate(u)
        new = est if self.optimizer is None or not self.estimator.steps_optimizer else self.optimizer.step(u.x, est)
        own = self.method.assemble_global(u.round, results, est, u.x, server_state)
        if not own.keys() <= self.assembled:
            raise EngineError(f"method {self.method.name}: assemble_global set {sorted(own.keys() - self.assembled)}, "
                              "which its assembles(model) does not name; add them there")
        new.update(own)
        return new

    def state_dict(self) -> dict:
        """The parts' state, under the checkpoint's keys."""
        return {**({"server_optimizer": self.optimizer.state_dict()} if self.optimizer is not None else {}),
                **self.estimator.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if self.optimizer is not None:  # a config with a server optimizer resumes only its own runs
            self.optimizer.load_state_dict(state["server_optimizer"])
        self.estimator.load_state_dict(state)
