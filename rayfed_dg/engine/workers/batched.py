"""Client-batched training (``engine.client_batching``): the clients of a
group take each local step together, in one ``torch.func.vmap`` of the
method's ``functional_loss`` over their stacked parameters and buffers
(``functional_call``), one backward pass and one optimizer step.

Groups (``client_groups``): a round's training clients in id order, split
by their sample count (which fixes every batch's shape and the number of
steps), each run cut into consecutive groups of ``engine.client_group_size``.
The rule reads only the round's clients, so a group, and the bits it
computes, are the same on any worker count; each group is one Ray task.

Per client, what ``ClientRunner.train`` does one by one:

* its start: the round's global model and its local state, loaded and
  seeded by the same ``ClientRunner._client``;
* its batches: ``ClientRunner.batches`` on its own seeded generator,
  stacked across the group;
* its dropout masks: drawn from its own copy of the generator that
  ``_client`` seeded, in its forward's order, by the op ``F.dropout`` uses
  on the device (``DropoutReplay``);
* its BatchNorm running statistics: its own slice of the stacked buffers,
  updated in place under vmap;
* its optimizer: ``make_optimizer`` on the stacked tensors.  SGD (momentum,
  weight decay) and Adam work elementwise, so each client's slice takes the
  step torch.optim takes on its own tensors;
* its upload: ``ClientRunner.upload`` with its trained state loaded into
  the model, the group's seconds shared out.

Only the gradients differ, in their last bits (a batched convolution and
``_Linear`` sum in another order), and the difference grows over steps:
the two paths agree within float rounding (docs/cross_device.md states
what the tests hold them to).  ``round_start`` is not called: a batchable method's
objective reads only the client's parameters and their start.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import time
from collections.abc import Hashable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, vmap
from torch.overrides import TorchFunctionMode

from rayfed_dg.engine.store.records import ClientTask
from rayfed_dg.errors import ConfigError, EngineError
from rayfed_dg.methods import ClientUpdate, LocalResult
from rayfed_dg.methods.batching import check_model
from rayfed_dg.seeding import Stream

from .worker import PartialSums, fetched, inject_fault


@functools.cache
def retain_heap() -> bool:
    """Keep freed memory in this process's heap (glibc: no ``mmap`` per large
    block, no trimming), once per process.  A group's step allocates tensors
    G times a client's, past glibc's largest mmap threshold (32 MiB), each of
    which would come fresh from the kernel and be page-faulted in on first
    touch: on a 2-core CPU that made batched rounds 1.4x slower
    (docs/results/cost.md).  The worker keeps its peak memory instead of
    returning it.  False where there is no glibc."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_max = -1, -4  # malloc.h
    return bool(mallopt(m_mmap_max, 0)) and bool(mallopt(m_trim_threshold, 2**31 - 1))


def client_groups(clients: Sequence[int], signature: Mapping[int, Hashable], size: int) -> list[tuple[int, ...]]:
    """The round's clients in groups: in id order, split by ``signature``
    (equal within a group: the sample count), each run cut into consecutive
    groups of ``size``; ordered by their first client."""
    runs: dict[Hashable, list[int]] = {}
    for cid in sorted(clients):
        runs.setdefault(signature[cid], []).append(cid)
    return sorted(tuple(ids[i:i + size]) for ids in runs.values() for i in range(0, len(ids), size))


class _Rng:
    """The generator a client's dropout draws on: the device's default one, which ``seed_torch`` seeds."""

    def __init__(self, device: torch.device):
        self.device = device

    def get(self) -> torch.Tensor:
        return torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else torch.get_rng_state()

    def set(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)


class DropoutReplay:
    """``nn.Dropout`` in a vmapped forward.  The modules run as the identity
    (evaluation mode) and a hook multiplies their output by a noise tensor
    fed in per client: drawn beforehand from each client's own generator
    state, in its forward's call order, by the op ``F.dropout``'s training
    forward uses on the device (the CPU: ``bernoulli_(1 - p)`` on an
    ``empty_like`` of its input, divided by ``1 - p``; CUDA: the fused
    ``native_dropout``), so each client gets the masks of its one-by-one
    forward."""

    def __init__(self, model: nn.Module, device: torch.device):
        self.model, self.device, self.rng = model, device, _Rng(device)
        self.mods = [m for m in model.modules() if type(m) is nn.Dropout]
        self.calls: dict[tuple, list[tuple[float, torch.Tensor]]] = {}  # by batch: each call's (p, input)
        self.recording: list | None = None
        self.feed: list[torch.Tensor] = []
        self.at = 0

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        hooks = [m.register_forward_hook(self._hook) for m in self.mods]
        modes = [m.training for m in self.mods]
        for m in self.mods:
            m.eval()
        try:
            yield
        finally:
            for h in hooks:
                h.remove()
            for m, mode in zip(self.mods, modes):
                m.train(mode)

    def _hook(self, mod: nn.Module, inp: tuple, out: torch.Tensor) -> torch.Tensor:
        if self.recording is not None:
            self.recording.append((mod.p, inp[0]))
            return out
        noise = self.feed[self.at]
        self.at += 1
        return out * noise

    def draw(self, states: list[torch.Tensor], x: torch.Tensor) -> list[torch.Tensor]:
        """Per dropout call of the forward of one client's batch ``x``, the
        group's stacked noise; advances each client's generator ``states``."""
        if not self.mods:
            return []
        calls = self._layout(x)
        per: list[list[torch.Tensor]] = [[] for _ in calls]
        for i, state in enumerate(states):
            self.rng.set(state)
            for j, (p, like) in enumerate(calls):
                per[j].append(self._noise(p, like))
            states[i] = self.rng.get()
        return [torch.stack(n) for n in per]

    def _layout(self, x: torch.Tensor) -> list[tuple[float, torch.Tensor]]:
        """Each dropout call's p and input (its shape, strides and dtype), from a forward in evaluation mode, once
        per batch layout."""
        key = (tuple(x.shape), x.stride(), x.dtype)
        if key not in self.calls:
            modes = [m.training for m in self.model.modules()]
            self.model.eval()
            self.recording = []
            try:
                with torch.no_grad():
                    self.model(x)
                self.calls[key] = self.recording
            finally:
                self.recording = None
                for m, mode in zip(self.model.modules(), modes):
                    m.training = mode
        return self.calls[key]

    def _noise(self, p: float, like: torch.Tensor) -> torch.Tensor:
        t = torch.empty_like(like)  # its strides: the draws follow the memory order
        if p == 0:  # F.dropout returns its input, drawing nothing
            return t.fill_(1.0)
        if p == 1:
            return t.zero_()
        if self.device.type == "cuda":
            return torch.native_dropout(t.fill_(1.0), p, True)[0]
        return t.bernoulli_(1 - p).div_(1 - p)


class _Linear(torch.autograd.Function):
    """``x W^T`` whose gradients are ``g W`` and ``g^T x``: under vmap each a
    batched product of operands in their own layouts.  Autograd's rule for
    vmap's ``x W^T`` gives the weight's gradient transposed, copied into the
    weight's layout; for ``(W x^T)^T`` the input's gradient multiplies two
    transposed operands, which the CPU's batched product runs 5x slower."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, w):
        return x.matmul(w.t())

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gx = g.matmul(w) if ctx.needs_input_grad[0] else None
        gw = g.reshape(-1, g.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
        return gx, gw


class _BatchedLinear(TorchFunctionMode):
    """``F.linear`` as ``_Linear`` in the vmapped forward: the same products, summed in another order, so the last
    bits move, within the tolerance batching already has against the one-by-one path."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.linear:
            return func(*args, **kwargs)
        a = {**dict(zip(("input", "weight", "bias"), args)), **kwargs}
        y = _Linear.apply(a["input"], a["weight"])
        return y if a.get("bias") is None else y + a["bias"]


def _steps(iters: list[Iterator]) -> Iterator[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """The group's batches, step by step; clients whose batches differ in number or shape stop the run (their
    grouping signature should have kept them apart)."""
    while True:
        drawn = [next(it, None) for it in iters]
        if all(g is None for g in drawn):
            return
        got = [g for g in drawn if g is not None]
        if len(got) < len(drawn) or len({(tuple(g[0].shape), tuple(g[1].shape)) for g in got}) > 1:
            raise EngineError("client-batched group: its clients' batches differ in number or shape; the grouping "
                              "keeps clients of one sample count together, so this is a bug")
        yield [g[0] for g in got], [g[1] for g in got]


def _loss_fn(runner: Any, replay: DropoutReplay):
    """One client's loss, for vmap: the method's ``functional_loss`` of the model at its own state."""
    method, model = runner.method, runner.model

    def one(params, rest, start, x, y, noise):
        replay.feed, replay.at = noise, 0
        with _BatchedLinear():
            return method.functional_loss(lambda inp: functional_call(model, (params, rest), (inp,)), x, y, params,
                                          start)

    return vmap(one)


def _train(runner: Any, state: dict[str, torch.Tensor], start: dict[str, torch.Tensor], rngs: list[torch.Tensor],
           iters: list[Iterator], round: int) -> list[LocalResult]:
    """The group's local steps on its stacked ``state`` (trained in place) from ``start`` (the trainable
    parameters' stacked values before the first step, read-only); each client's ``LocalResult``."""
    model = runner.model
    trainable = [k for k, p in model.named_parameters() if p.requires_grad]
    params = {k: state[k].requires_grad_() for k in trainable}
    rest = {k: v for k, v in state.items() if k not in params}
    opt = runner.method.make_optimizer(model, round, params=list(params.values()))
    replay = DropoutReplay(model, runner.device)
    step = _loss_fn(runner, replay)
    totals, n, steps = np.zeros(len(rngs)), 0, 0
    model.train()
    with replay.active():
        for xs, ys in _steps(iters):
            noise = replay.draw(rngs, xs[0])
            try:
                losses = step(params, rest, start, torch.stack(xs), torch.stack(ys), noise)
            except RuntimeError as e:
                if "randomness" not in str(e):
                    raise
                raise ConfigError("engine.client_batching: the model draws random numbers in its forward, which "
                                  "vmap cannot batch; set engine.client_batching: false") from None
            opt.zero_grad(set_to_none=True)
            losses.sum().backward()  # the clients are independent: each slice gets its own client's gradient
            opt.step()
            totals += np.asarray(losses.detach().tolist()) * len(ys[0])
            n += len(ys[0])
            steps += 1
    return [LocalResult(loss=float(t) / max(n, 1), steps=steps, samples=n) for t in totals]


def train_group(runner: Any, tasks: list[ClientTask], global_state: dict[str, np.ndarray],
                views: bool = False) -> list[ClientUpdate]:
    """Train ``tasks``' clients together on ``runner`` (a ``ClientRunner``);
    their updates, in order, each through ``ClientRunner.upload``.  A fault
    of one is the whole group's (the pool retries or drops it together).
    ``views``: the last update may hold views of the model's tensors (a
    result Ray serializes at once, as ``ClientRunner.train``'s)."""
    t0 = time.perf_counter()
    check_model(runner.model)
    if runner.device.type == "cpu":
        retain_heap()
    for task in tasks:
        inject_fault(runner.cfg, task)
    # the round's global tensors are the same for every client: copied once, not once per client (on a CPU a
    # model-sized copy per client costs as much as a step); a client's local state is its own
    own = set(runner.local_keys).union(*(t.local_state for t in tasks))
    rng, ctxs, rngs, snaps = _Rng(runner.device), [], [], []
    for task in tasks:
        ctxs.append(runner._client(task, global_state, Stream.TRAIN))
        rngs.append(rng.get())
        snaps.append({k: v.detach().clone() for k, v in runner.model.state_dict().items() if k in own})
    g = len(tasks)
    state = {k: torch.stack([s[k] for s in snaps]) if k in own else v.detach().unsqueeze(0).repeat(g, *[1] * v.dim())
             for k, v in runner.model.state_dict().items()}
    start = {k: torch.stack([s[k] for s in snaps]) if k in own else v.detach().unsqueeze(0).expand_as(state[k])
             for k, v in runner.model.named_parameters() if v.requires_grad}
    extras = [fetched(t.extra) for t in tasks]
    iters = [runner.batches(t.indices, c.generator, e) for t, c, e in zip(tasks, ctxs, extras)]
    results = _train(runner, state, start, rngs, iters, tasks[0].round)
    share = (time.perf_counter() - t0) / len(tasks)
    out = []
    # folded aside, and into the worker's partial only once every upload succeeded: a group that raises
    # folds nothing, and its retry folds once
    kept, runner.partials = runner.partials, PartialSums()
    try:
        for i, (task, ctx) in enumerate(zip(tasks, ctxs)):
            with torch.no_grad():
                for k, v in runner.model.state_dict().items():
                    v.copy_(state[k][i])
            out.append(runner.upload(task, ctx, results[i], global_state, extras[i], time.perf_counter() - share,
                                     views=views and i == len(tasks) - 1))
    finally:
        aside, runner.partials = runner.partials, kept
    kept.absorb(aside)
    return out
