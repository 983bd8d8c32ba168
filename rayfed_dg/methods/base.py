"""The method hook interface (contract v2) and the method registry.

A federated (DG) method is one class in one file, registered by name with
``@register_method``.  Every hook defaults to FedAvg behaviour, so FedAvg
overrides nothing; the engine calls hooks and never names a method.

## Hook map

Each hook, what it receives and returns, and where it runs.  The driver
validates the config; the server actor holds the federation
(``engine/rounds/federation.py``); worker actors run clients, one sampled client
and round per task.

| Hook | Receives -> returns | Runs in |
|---|---|---|
| ``Params`` | the config's ``method:`` keys -> typed hyper-parameters, ``self.p`` | driver, once |
| ``check(cfg)`` | the whole config -> raises ``ConfigError`` to veto it | driver, once |
| ``stages_needed`` | (attribute) the data stages it reads, ``ctx.stage_data`` (ELCFS) | driver, once |
| ``phases`` | (attribute or property) the optional round phases it needs (below) | server, each round |
| ``folds_on_workers`` | (attribute or property) uploads are read only as their average (below) | server, each round |
| ``batchable`` | (attribute) clients may train together in one vmapped step (below) | driver, once |
| ``shared_payloads`` | (attribute) each payload it uploads -> what one record is (below) | driver, workers |
| ``declare`` | (classmethod) params -> the three above, the server hooks overridden | driver, unbuilt |
| ``__init__`` | params, model and training config, ``num_clients`` (the partition's) | everywhere |
| ``build_model`` | number of classes -> the network, identical everywhere | server, workers |
| ``local_keys`` | model -> state kept per client, never broadcast | server, workers |
| ``private_keys`` | model -> the part of ``local_keys`` never uploaded either | workers |
| ``tensor_group`` | state key, whether local -> its ledger group | server |
| ``assembles`` | model -> the global keys ``assemble_global`` sets | server, once |
| ``client_val_size`` | -> validation samples a client gets for local selection | server |
| ``round_prepare`` | model, ``ClientContext`` -> named arrays for ``server_payloads`` | worker, ``PREPARE`` |
| ``aggregation_weights`` | sampled ids, sizes, server state -> reduce weights (sizes) | server, each round |
| ``server_payloads`` | round, ids, server state, rng, global, prepared -> arrays per client | server, each round |
| ``round_start`` | model, ``ClientContext`` -> snapshots what the loss needs | worker, each client |
| ``loss`` | model, batch, ``ClientContext`` -> the local objective of one batch | worker, each step |
| ``functional_loss`` | forward, batch, params, start -> one client's loss, batched (below) | worker, each step |
| ``local_train`` | model, batches, ``ClientContext`` -> ``LocalResult`` | worker, each client |
| ``upload_payload`` | model, ``ClientContext`` -> named arrays to upload | worker, each client |
| ``assemble_global`` | round, updates, average, previous global, server state -> its tensors | server, each round |
| ``after_round`` | round, updates (``global_eval`` set by its phase), server state | server, each round |

Uploads are summed where they are made: with ``folds_on_workers`` (the
default) each worker folds the weighted uploads of the clients it trains
into one partial sum and the server adds one per worker
(``engine/aggregation/exact.py``); the updates that ``assemble_global`` and
``after_round`` receive then hold no uploaded tensors but the local ones
(payloads, stats and ``global_eval`` are all there).  A method that reads
clients' uploaded tensors there sets it False and gets them whole (COPA:
each client's own head; CSAC's layer-wise weights).

A method declares each payload in ``shared_payloads``: its
name (the key ``upload_payload`` or ``round_prepare`` returns, the ledger's
group after ``payload:`` / ``prepare:``) and what one record of it is,
``"image"`` (each row one image's statistic), ``"client"`` (the whole array
one statistic of the client's data) or ``"exact"`` (integers, never
noised).  The worker clips and noises the groups that ``privacy.payloads``
names before they leave (``engine/privacy/payloads.py``); with ``privacy:``
set, an undeclared payload stops the run (without it, it leaves as it is).

``local_train`` owns the whole local loop; to keep one count of local
steps it runs the shared loop, ``train_steps``, with its own loss and
per-step hook and ``precision=ctx.precision``, and returns (or amends the
``stats`` of) its ``LocalResult``.  ``ctx.precision`` (a ``Precision``) is
``training.precision`` on the worker's device: ``train_steps`` runs each
loss in its ``autocast()`` and each step through its ``step`` (fp16's
gradient scaler), as a loop of the method's own must too; the worker stops
a run whose ``local_train`` never entered it, and a method that cannot
train in a precision refuses it in ``check`` (ELCFS: fp16).
The new global model is the weighted average, then a server optimizer's
step on the broadcast parameters outside ``assembles`` (``server:``), then
``assemble_global``'s tensors; a method that assembles every parameter
refuses a server optimizer in its ``check`` (FedDyn, CSAC's layer-wise
aggregation).

Hooks on a client receive a ``ClientContext``: the round, the client id, the
seeded generator for all of the client's randomness, the device, its
samples, payload and validation indices, the data stages' shared arrays
(``stage_data``), the colour normalisation of the batches (``pixel_mean`` /
``pixel_std``, for methods that work on pixels), the task's ``precision``
and a ``scratch`` dict for snapshots that live for one client task.

## Client-batched training

With ``engine.client_batching`` the clients of a group train in one step
(``engine/workers/batched.py``): ``torch.func.vmap`` of ``functional_loss``
over their stacked parameters and buffers, the optimizer of
``make_optimizer`` on the stacked tensors.  Only a method whose
declaration ``batchable`` is True may: its local objective is
``functional_loss`` (a pure function of the client's parameters and the
parameters it started the round from, calling ``forward`` once), its
loop the default ``local_train``, and ``round_start`` is not called.  The
declaration is inherited only by a subclass that overrides none of the
client training hooks (``BATCH_HOOKS``): one that does states its own.

## Round phases

A round always samples, sends, trains, reduces, aggregates and calls
``after_round``.  Optional phases run only for a method that lists them in
``phases``; the round runs each declared phase at its slot
(``Slot``), in the order listed.

| Phase | Slot: when | What runs | Declared by |
|---|---|---|---|
| ``PREPARE`` | ``BEFORE_TRAINING`` | ``round_prepare`` on every sampled client | StableFDG (``style``) |
| ``EVALUATE_ON_CLIENTS`` | ``AFTER_AGGREGATION`` | new global model on each participant's samples | FedDG-GA |
| ``PERSONAL_EVAL`` | ``AT_EVALUATION`` | each client's own model, ``personal_val`` rows | the default (*) |

``PREPARE`` runs with the round's global model before any client trains;
every sampled client must answer and ``server_payloads`` gets the results.
``EVALUATE_ON_CLIENTS`` runs after aggregation and before ``after_round``,
on each participant's ``client_val_size`` samples, setting
``ClientUpdate.global_eval``.  ``PERSONAL_EVAL`` runs in the evaluated
rounds: the global weights with each client's ``local_keys`` on its
domain's validation split, only with local keys and ``evaluation.personal``.
(*) Every method but COPA, SCAFFOLD, FedDyn, MOON and FedSR, whose local
state only shapes the loss.

Rule for a new phase: add one only when a method needs clients to compute
something at a point of the round that no hook or phase reaches (with a
model the existing hooks never see), and only as an optional phase: a
``Phase`` member with its ``Slot``, one runner in ``engine/rounds/phases.py``'s
``RUNNERS``, its own ``seeding.Stream`` if it draws randomness, ledger rows
for what crosses the wire, and a row in this table.  A method that does not declare it must run
exactly as without it (no extra task, the same numbers).

## Contract v1

A method written for the first contract is refused when it registers, in
one line saying what to change: ``prepares_round``,
``evaluates_global_on_clients``, ``local_state_predicts`` and
``averages_global`` became ``phases`` and ``assembles``;
``assemble_global`` gained ``previous``; ``__init__`` takes
``num_clients``; ``local_train`` returns a ``LocalResult`` (a dict is one
line from the worker).  One order changed with it: ``assemble_global``
receives the clients' weighted ``average`` before the server optimizer
steps the keys the method does not assemble (v1 handed it the stepped
model); no built-in method reads a stepped key there.
"""
from __future__ import annotations

import contextlib
import inspect
import math
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import Enum, IntEnum
from types import MappingProxyType
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict

from rayfed_dg.errors import ConfigError
from rayfed_dg.models import build_backbone
from rayfed_dg.utils import Registry


class NoParams(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Precision:
    """The numeric precision of one client task's training and evaluation
    (``training.precision``) on one device type: ``autocast()`` around the
    forward passes and losses, ``step(opt, loss)`` for the backward pass and
    the optimizer's step, through a gradient scaler for fp16.  The weights
    and the optimizer stay fp32.  The worker makes one per client task, so a
    scaler's state never passes from one client (or retry) to another; fp32
    adds nothing to the plain operations (no autocast, no scaler)."""

    DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}

    def __init__(self, name: str = "fp32", device_type: str = "cpu"):
        self.name, self.device_type = name, device_type
        self.dtype = self.DTYPES[name]
        self.scaler = torch.amp.GradScaler(device_type) if name == "fp16" else None
        self.autocasts = 0  # times autocast() was entered: the worker checks a method's loop used it

    def autocast(self) -> contextlib.AbstractContextManager:
        self.autocasts += 1
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def step(self, opt: torch.optim.Optimizer, loss: torch.Tensor) -> None:
        """``loss.backward()`` then ``opt.step()``; with fp16 the loss is
        scaled, the gradients unscaled before the step (hooks on ``opt`` see
        true gradients), a step with inf or NaN gradients skipped and the
        scale updated."""
        if self.scaler is None:
            loss.backward()
            opt.step()
            return
        self.scaler.scale(loss).backward()
        self.scaler.step(opt)
        self.scaler.update()


FP32 = Precision()


@dataclass
class ClientContext:
    client_id: int
    round: int
    device: torch.device
    generator: torch.Generator
    num_samples: int
    payload: dict[str, np.ndarray] = field(default_factory=dict)
    scratch: dict[str, Any] = field(default_factory=dict)
    # the client's own data, for methods that look beyond the current batch
    indices: np.ndarray | None = None  # dataset indices of the client's training samples
    labels: np.ndarray | None = None  # their labels
    fetch: Callable[[np.ndarray], tuple[torch.Tensor, torch.Tensor]] | None = None  # (x, y) of indices
    # validation samples of the client's own (main) source domain, when ``client_val_size`` asks for them
    val_indices: np.ndarray | None = None
    # arrays a data stage shared with the clients before round 1 (``StageServer.share``), by name
    stage_data: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    # the batches are (pixels in [0, 1] - pixel_mean) / pixel_std, shape (1, 3, 1, 1)
    pixel_mean: torch.Tensor | None = None
    pixel_std: torch.Tensor | None = None
    # training.precision on this device: a method's own loop runs its forward passes in ``precision.autocast()``
    # and its steps through ``precision.step`` (train_steps does both given ``precision=ctx.precision``)
    precision: Precision = field(default_factory=Precision)


Batch = tuple[torch.Tensor, torch.Tensor]


class Slot(IntEnum):
    """Where in a round an optional phase runs (in this order)."""
    BEFORE_TRAINING = 1  # with the round's global model, before any sampled client trains
    AFTER_AGGREGATION = 2  # with the new global model, before ``after_round``
    AT_EVALUATION = 3  # in the rounds that evaluate (``evaluation.every``, the last round)


class Phase(Enum):
    """An optional round phase a method declares in ``Method.phases``; the
    round runs the declared ones at their slot (the phase table above)."""
    PREPARE = ("prepare", Slot.BEFORE_TRAINING)
    EVALUATE_ON_CLIENTS = ("evaluate_on_clients", Slot.AFTER_AGGREGATION)
    PERSONAL_EVAL = ("personal_eval", Slot.AT_EVALUATION)

    def __init__(self, label: str, slot: Slot):
        self.label, self.slot = label, slot


@dataclass
class LocalResult:
    """What ``local_train`` returns: ``loss`` the sample-weighted mean of the
    losses stepped on, ``steps`` the optimizer steps (the round's local
    steps, counted here only), ``samples`` the samples they drew, ``stats``
    anything else the method reports (named floats)."""
    loss: float
    steps: int
    samples: int
    stats: dict[str, float] = field(default_factory=dict)


@dataclass
class GlobalEval:
    """The new global model on one client's validation samples."""
    accuracy: float
    loss: float
    samples: int


@dataclass
class ClientUpdate:
    """What one client returned from one round's training task."""
    client: int
    num_samples: int
    # the uploaded state (every key but the private ones); only its local keys where the worker folded it
    update: dict[str, np.ndarray]
    private: dict[str, np.ndarray]  # state that never leaves the client
    payload: dict[str, np.ndarray]  # the method's extra upload (``upload_payload``)
    train_loss: float
    seconds: float
    stats: dict[str, float] = field(default_factory=dict)  # ``LocalResult.stats``
    steps: int = 0  # ``LocalResult.steps``
    samples_stepped: int = 0  # ``LocalResult.samples``
    global_eval: GlobalEval | None = None  # set in ``Phase.EVALUATE_ON_CLIENTS``
    sizes: dict[str, int] = field(default_factory=dict)  # bytes of each uploaded tensor, folded or not (the ledger)
    unclipped: bool | None = None  # DP-FedAvg: whether its norm was within the clip (engine/privacy/updates.py)


@torch.no_grad()
def evaluate_on_val(model: nn.Module, ctx: ClientContext, batch_size: int = 256) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of ``model`` as it is (mode untouched)
    on the client's validation samples ``ctx.val_indices``."""
    assert ctx.val_indices is not None and ctx.fetch is not None, "the method asked for no validation samples"
    correct, loss = 0, 0.0
    for s in range(0, len(ctx.val_indices), batch_size):
        x, y = ctx.fetch(ctx.val_indices[s:s + batch_size])
        with ctx.precision.autocast():
            logits = model(x)
            loss += float(F.cross_entropy(logits, y, reduction="sum"))
        correct += int((logits.argmax(1) == y).sum())
    n = len(ctx.val_indices)
    return correct / n, loss / n


def frozen(model: nn.Module) -> nn.Module:
    """``model`` as a constant of the loss: no parameter trains, evaluation mode (a copy of the round's global
    model, a previous local model)."""
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def train_steps(opt: torch.optim.Optimizer, batches: Callable[[], Iterator[Batch]],
                loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], steps: int | None = None,
                after_step: Callable[[torch.Tensor, torch.Tensor, int], None] | None = None,
                precision: Precision = FP32) -> LocalResult:
    """The local step loop, the default ``local_train``'s and that of the
    methods owning their loop: per batch, one step of ``opt`` on
    ``loss_fn(x, y)``, then ``after_step(x, y, i)`` (i: steps taken so far,
    from 1).  One pass of ``batches()`` (the worker already caps it at the
    round's budget), or exactly ``steps`` steps, drawing ``batches()`` again
    as often as that takes.  The one place a round's local steps are counted
    (an fp16 step the scaler skips for inf gradients counts too).  Pass
    ``precision=ctx.precision``: the loss runs in its autocast, the step
    through its scaler."""
    # the loss summed on its device in float64 (the bits a host sum of float(loss) gives): no copy to the
    # host, which waits for the device, per step
    total: torch.Tensor | float = 0.0
    n, done = 0, 0
    while True:
        for x, y in batches():
            with precision.autocast():
                loss = loss_fn(x, y)
            opt.zero_grad(set_to_none=True)
            precision.step(opt, loss)
            total = total + loss.detach().double() * len(y)
            n += len(y)
            done += 1
            if after_step is not None:
                after_step(x, y, done)
            if steps is not None and done >= steps:
                break
        if steps is None or done >= steps:
            return LocalResult(loss=float(total) / max(n, 1), steps=done, samples=n)


# the server-side hooks whose override the engine reads from ``Declarations.overrides``
SERVER_HOOKS = ("aggregation_weights", "assemble_global", "after_round", "server_payloads")
# the declarations a class states as attributes; a property of them (of ``self.p``) needs its own ``declare``
DECLARED = ("phases", "folds_on_workers", "shared_payloads", "batchable")
# the client training hooks that a batchable declaration covers: a subclass overriding one of them below the class
# that declared it is not batchable unless it declares so itself
BATCH_HOOKS = ("loss", "local_train", "round_start", "make_optimizer", "functional_loss", "upload_payload")


@dataclass(frozen=True)
class Declarations:
    """What the engine reads of a method before anything is built."""
    name: str
    phases: tuple[Phase, ...]
    folds_on_workers: bool
    shared_payloads: Mapping[str, str]
    overrides: frozenset[str]  # which server-side hooks the class overrides, of SERVER_HOOKS
    batchable: bool = False  # clients may train together (engine.client_batching)


def _class_value(cls: type, attr: str) -> Any:
    """``attr`` as the nearest class in ``cls``'s MRO states it, skipping properties (their value is of the
    params, given by the class's own ``declare``)."""
    for k in cls.__mro__:
        if attr in vars(k) and not isinstance(vars(k)[attr], property):
            return vars(k)[attr]
    raise AttributeError(f"{cls.__qualname__} declares no {attr}")


def _batchable(cls: type) -> bool:
    """``batchable`` as the nearest class declaring it states it, unless a class below it overrides a hook of
    ``BATCH_HOOKS`` (its own training would not be the batched one)."""
    for k in cls.__mro__:
        if "batchable" in vars(k):
            return bool(vars(k)["batchable"])
        if any(h in vars(k) for h in BATCH_HOOKS):
            return False
    return False


class Method:
    """FedAvg (McMahan et al., 2017): local SGD on cross-entropy, weighted
    averaging of all weights by client sample counts (gPerXAN paper Eq. 1)."""

    name = "fedavg"
    Params: type[BaseModel] = NoParams
    # the optional round phases this method needs (the phase table in the module docstring); PERSONAL_EVAL:
    # the state in ``local_keys`` changes the model's predictions, so each client's own model is evaluated
    # beside the global one (not for state only the loss reads, e.g. FedSR's reference distribution)
    phases: tuple[Phase, ...] = (Phase.PERSONAL_EVAL,)
    stages_needed: tuple[str, ...] = ()  # data stages whose shared arrays the method reads
    # the server reads the uploads only through their weighted average, so workers may sum them (the hook map);
    # False: each ``ClientUpdate.update`` reaches ``assemble_global`` and ``after_round`` whole
    folds_on_workers: bool = True
    # the payloads its clients upload (``upload_payload``, ``round_prepare``), by name: what one record is,
    # "image" | "client" | "exact" (the hook map's note; methods/payloads.py RECORDS)
    shared_payloads: dict[str, str] = {}
    # its clients may train together in one vmapped step (engine.client_batching; the module docstring): the
    # objective is ``functional_loss``, the loop the default ``local_train``
    batchable: bool = True

    def __init__(self, params: Any, model_cfg, training_cfg, num_clients: int):
        self.p = params
        self.model_cfg = model_cfg
        self.training = training_cfg
        self.num_clients = num_clients  # the partition's clients (COPA's heads, SCAFFOLD's and FedDyn's 1/N)

    @classmethod
    def declare(cls, params: Any) -> Declarations:
        """The method's declarations for ``params`` (its validated ``Params``), read without building it: the
        class attributes ``phases``, ``folds_on_workers`` and ``shared_payloads``, and the server hooks it
        overrides.  A class that makes one of them a property of ``self.p`` overrides this to give the same
        value from ``params`` (its property reads ``self.declare(self.p)``)."""
        return Declarations(
            name=cls.name, phases=tuple(_class_value(cls, "phases")),
            folds_on_workers=bool(_class_value(cls, "folds_on_workers")),
            shared_payloads=MappingProxyType(dict(_class_value(cls, "shared_payloads"))),
            overrides=frozenset(h for h in SERVER_HOOKS if getattr(cls, h) is not getattr(Method, h)),
            batchable=_batchable(cls))

    @classmethod
    def check(cls, cfg) -> None:
        """Raise ``ConfigError`` for a config this method cannot run."""

    # ------------------------------------------------------------------ model
    def build_model(self, num_classes: int) -> nn.Module:
        m = self.model_cfg
        return build_backbone(m.arch, num_classes, m.pretrained, m.width)

    def local_keys(self, model: nn.Module) -> set[str]:
        return set()

    def private_keys(self, model: nn.Module) -> set[str]:
        return set()

    def client_val_size(self) -> int:
        """How many validation samples of its own source domain each client
        gets for client-side model selection (0: none)."""
        return 0

    def tensor_group(self, key: str, is_local: bool) -> str:
        """Ledger group of a state-dict key ("shared" or "local" by default)."""
        return "local" if is_local else "shared"

    # ------------------------------------------------------------ client side
    def round_prepare(self, model: nn.Module, ctx: ClientContext) -> dict[str, np.ndarray]:
        """With ``Phase.PREPARE``: computed on each sampled client with the
        round's global model (and its local state) before any client trains;
        the results reach ``server_payloads`` of the same round."""
        return {}

    def round_start(self, model: nn.Module, ctx: ClientContext) -> None:
        pass

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, ctx: ClientContext) -> torch.Tensor:
        return F.cross_entropy(model(x), y)

    def functional_loss(self, forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, y: torch.Tensor,
                        params: dict[str, torch.Tensor], start: dict[str, torch.Tensor]) -> torch.Tensor:
        """A ``batchable`` method's ``loss`` of one client, as a pure function
        for ``torch.func.vmap``: ``forward(x)`` runs the client's model (call
        it once: the dropout masks are drawn per call), ``params`` are its
        trainable parameters by name, ``start`` their values when the round
        started (FedProx's anchor)."""
        return F.cross_entropy(forward(x), y)

    def lr_at(self, round: int) -> float:
        """The round's learning rate: constant, or cosine-annealed over the rounds."""
        t = self.training
        if t.lr_schedule == "cosine" and t.rounds > 1:
            return t.lr * 0.5 * (1 + math.cos(math.pi * (round - 1) / t.rounds))
        return t.lr

    def make_optimizer(self, model: nn.Module, round: int = 1, params=None) -> torch.optim.Optimizer:
        """The local optimizer over ``params`` (the model's trainable ones by
        default), as a fresh one would start: one per model and parameter
        list, reset in place for each client (its state cleared, the round's
        learning rate set) rather than built again."""
        t = self.training
        params = [p for p in (model.parameters() if params is None else params) if p.requires_grad]
        lr = self.lr_at(round)
        # weak: a model a method builds per client (a frozen copy) takes its optimizers with it; tensors that
        # are not the model's (client batching's stacked ones, new per group) get a fresh optimizer, never kept
        own = {id(p) for p in model.parameters()}
        cache = self.__dict__.setdefault("_optimizers", weakref.WeakKeyDictionary()).setdefault(model, {}) \
            if all(id(p) in own for p in params) else {}
        opt = cache.get(key := tuple(map(id, params)))
        if opt is not None and len(opt.param_groups) == 1:
            # as new: no state, no step hooks (FedSAM and SCAFFOLD register theirs per client), the
            # hyperparameters of the config with the round's learning rate
            opt.state.clear()
            opt._optimizer_step_pre_hooks.clear()
            opt._optimizer_step_post_hooks.clear()
            group = opt.param_groups[0]
            kept = group["params"]
            group.clear()  # keys a scheduler or a method added go too
            group.update({**opt.defaults, "params": kept, "lr": lr})
            return opt
        if t.optimizer == "adam":
            opt = torch.optim.Adam(params, lr=lr, weight_decay=t.weight_decay)
        else:
            opt = torch.optim.SGD(params, lr=lr, momentum=t.momentum, weight_decay=t.weight_decay)
        cache[key] = opt
        return opt

    def local_train(self, model: nn.Module, batches: Callable[[], Iterator[Batch]], ctx: ClientContext) -> LocalResult:
        """Default loop: a fresh optimizer per client and round (a client in a
        cross-device federation holds no optimizer state between rounds)."""
        opt = self.make_optimizer(model, ctx.round)
        model.train()
        return train_steps(opt, batches, lambda x, y: self.loss(model, x, y, ctx), precision=ctx.precision)

    def upload_payload(self, model: nn.Module, ctx: ClientContext) -> dict[str, np.ndarray]:
        return {}

    # ------------------------------------------------------------ server side
    def aggregation_weights(self, client_ids: list[int], sizes: np.ndarray, server_state: dict) -> np.ndarray:
        return sizes.astype(np.float64)

    def server_payloads(self, round: int, client_ids: list[int], server_state: dict,
                        rng: np.random.Generator, global_state: dict[str, np.ndarray],
                        prepared: dict[int, dict[str, np.ndarray]]) -> dict[int, dict[str, np.ndarray]]:
        """Records to send each sampled client besides the broadcast weights
        (each sized in the ledger); ``prepared`` holds this round's
        ``round_prepare`` results by client (empty without ``Phase.PREPARE``)."""
        return {}

    def assembles(self, model: nn.Module) -> set[str]:
        """The global model's keys that ``assemble_global`` sets (at most):
        a server optimizer steps the other broadcast parameters."""
        return set()

    def assemble_global(self, round: int, results: list[ClientUpdate], average: dict[str, np.ndarray],
                        previous: dict[str, np.ndarray], server_state: dict) -> dict[str, np.ndarray]:
        """The tensors of ``assembles`` that the method sets itself from the
        round's updates; ``average`` is the round's weighted average (the
        previous values for keys nobody uploaded), ``previous`` the global
        model the round started from.  The engine puts them in the new
        global model before broadcasting and evaluating."""
        return {}

    def after_round(self, round: int, results: list[ClientUpdate], server_state: dict) -> None:
        pass


_REGISTRY: Registry[type[Method]] = Registry("method")


# what a method written for the first contract declared, and what replaces it (one line each)
_RETIRED = {
    "prepares_round": "declare phases = (Phase.PREPARE, ...)",
    "evaluates_global_on_clients": "declare phases = (Phase.EVALUATE_ON_CLIENTS, ...)",
    "local_state_predicts": "drop Phase.PERSONAL_EVAL from phases where it was False",
    "averages_global": "name the keys assemble_global sets in assembles(model); a server optimizer steps the rest",
}


def register_method(cls: type[Method]) -> type[Method]:
    """Add ``cls`` to the registry; a class written against the first hook
    contract is refused with one line saying what to change."""
    where = f"method {cls.name!r} ({cls.__module__}.{cls.__qualname__})"
    for attr, fix in _RETIRED.items():
        if any(attr in vars(k) for k in cls.__mro__):
            raise TypeError(f"{where} sets {attr}, gone in method contract v2: {fix}")
    if len(inspect.signature(cls.assemble_global).parameters) != 6:
        raise TypeError(f"{where}: assemble_global takes (round, results, average, previous, server_state) in "
                        "method contract v2 (previous: the global model the round started from)")
    if "num_clients" not in inspect.signature(cls.__init__).parameters:
        raise TypeError(f"{where}: __init__ takes (params, model_cfg, training_cfg, num_clients) in method "
                        "contract v2; pass num_clients on to Method.__init__")
    own_declare = inspect.getattr_static(cls, "declare") is not vars(Method)["declare"]
    for attr in DECLARED:
        if isinstance(inspect.getattr_static(cls, attr), property) and not own_declare:
            raise TypeError(f"{where}: {attr} is a property of the params, which the engine reads before building "
                            f"the method: override the classmethod declare(params) to give it")
    return _REGISTRY.add(cls.name, cls)


register_method(Method)


def method_names() -> list[str]:
    return _REGISTRY.names()


def get_method_class(name: str) -> type[Method]:
    return _REGISTRY.get(name)


def build_method(cfg, num_clients: int) -> Method:
    """The configured method with its typed parameters (validated once, with
    the config) for a partition of ``num_clients`` clients."""
    return get_method_class(cfg.method.name)(cfg.method.params, cfg.model, cfg.training, num_clients)


def declarations(cfg) -> Declarations:
    """The configured method's declarations (``Method.declare``), without building it."""
    return get_method_class(cfg.method.name).declare(cfg.method.params)


__all__ = ["SERVER_HOOKS", "Batch", "ClientContext", "ClientUpdate", "ConfigError", "Declarations", "GlobalEval",
           "LocalResult", "Method", "NoParams", "Phase", "Precision", "Slot", "build_method", "declarations",
           "evaluate_on_val", "frozen", "get_method_class", "method_names", "register_method", "train_steps"]
