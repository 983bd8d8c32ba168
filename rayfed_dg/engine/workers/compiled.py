"""Compiled local steps (``engine.compile``): the model's feature body run
through ``torch.compile`` (TorchInductor) for the training steps of a full
batch.

What is compiled: ``model.body`` (every backbone's convolutional part, where
the steps' time goes; the whole model where there is none), in place with
``nn.Module.compile``, so the state-dict keys, the module tree and the
methods' hooks on submodules stay as they are.  Both ``model(x)`` and
``model.features(x)`` (methods that take the head apart) go through it.
Python the compiler cannot trace (a style layer's seeded draw, a hook that
stores a tensor) is a graph break: the compiled graphs stop and resume
around it, with the same numbers as eager there.

Which calls: a gate in front of the compiled body sends it only the calls of
a training step, in training mode, with gradients on, of exactly
``training.batch_size`` samples (``dynamic=False``: one graph of fixed
shape).  A client's smaller last batch, evaluation and ``no_grad`` passes
run the eager body, so no batch size ever triggers a recompile.  Deep copies
of the model (a frozen global model in a method's loss) drop the compiled
call (``nn.Module.__getstate__``) and run eager.

When: once per worker per federation, in ``ClientRunner.bind``.  The
dynamo caches are reset first (a worker serving federation after federation
compiles each one's model afresh, as a new process would), then one warm-up
step (forward and backward of a seeded random batch, under the run's
precision, in a forked RNG; the buffers it moves are put back and the
gradients dropped) compiles the graphs outside any client's seconds.  Its
wall time is printed once by the worker (Ray shows it on the driver) and
kept as ``ClientRunner.compile_seconds``.

``reduce-overhead`` adds CUDA graphs (Inductor's cudagraph trees) on a GPU.
The config refuses it for workers that train on the CPU; a worker that
lands on the CPU anyway (``engine.gpus_declared_only``, a rehearsal)
compiles with ``default``, which is what Inductor does with CUDA graphs on
CPU tensors.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Any

import torch
import torch.nn as nn

from rayfed_dg.methods import Precision


class StepGate:
    """``nn.Module``'s compiled call for one module: the compiled function
    for a training step's batch of ``batch`` samples, the module's eager
    call for anything else (counted in ``calls``: compiled, eager)."""

    def __init__(self, module: nn.Module, compiled: Any, batch: int):
        self.module, self.compiled, self.batch = module, compiled, batch
        self.calls = [0, 0]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        m = self.module
        x = args[0] if args else None
        if m.training and torch.is_grad_enabled() and isinstance(x, torch.Tensor) and x.shape[0] == self.batch:
            self.calls[0] += 1
            return self.compiled(*args, **kwargs)
        self.calls[1] += 1
        return m._call_impl(*args, **kwargs)


def compiled_part(model: nn.Module) -> nn.Module:
    """The module ``engine.compile`` compiles: the backbone's body, else the model."""
    body = getattr(model, "body", None)
    return body if isinstance(body, nn.Module) else model


def torch_mode(mode: str, device: torch.device) -> str:
    """``torch.compile``'s mode for ``engine.compile`` on ``device``: CUDA graphs only on CUDA."""
    return "default" if mode == "reduce-overhead" and device.type != "cuda" else mode


def compile_steps(model: nn.Module, mode: str, device: torch.device, batch: int, resolution: int,
                  precision: Precision) -> float | None:
    """Compile ``model``'s training steps in place (the module docstring) and
    warm them up; the seconds that took (None: ``mode`` off, or a warm-up
    that failed, leaving the compile to the first training step)."""
    if "torch._dynamo" in sys.modules:  # a previous federation's graphs (and their models) go
        sys.modules["torch._dynamo"].reset()
    if mode == "off":
        return None
    part = compiled_part(model)
    part.compile(mode=torch_mode(mode, device), dynamic=False)
    # nn.Module.compile keeps torch.compile's function here; the gate keeps other shapes off it
    part._compiled_call_impl = StepGate(part, part._compiled_call_impl, batch)
    t0 = time.perf_counter()
    try:
        warm_up(model, device, batch, resolution, precision)
    except Exception as err:  # a method's layer that needs a client task's state: it compiles at the first step
        print(f"rayfed-dg worker {os.getpid()}: engine.compile={mode}: the warm-up step failed "
              f"({type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}); the model compiles at "
              "its first training step instead", file=sys.stderr, flush=True)
        return None
    seconds = time.perf_counter() - t0
    print(f"rayfed-dg worker {os.getpid()}: engine.compile={mode} ({torch_mode(mode, device)} on {device.type}): "
          f"compiled the training step of batch {batch} at {resolution} px in {seconds:.1f} s", file=sys.stderr,
          flush=True)
    return seconds


def warm_up(model: nn.Module, device: torch.device, batch: int, resolution: int, precision: Precision) -> None:
    """One forward and backward pass of a random channels-last batch, as the
    worker's batches are, in training mode; the model's state as it was after."""
    buffers = [b.detach().clone() for b in model.buffers()]
    was = model.training
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(batch, resolution, resolution, 3, generator=gen).to(device).permute(0, 3, 1, 2)
        x = x.contiguous(memory_format=torch.channels_last)
        try:
            model.train()
            with precision.autocast():
                out = model(x)
            out.float().sum().backward()
        finally:
            model.train(was)
            for p in model.parameters():
                p.grad = None
            with torch.no_grad():
                for b, saved in zip(model.buffers(), buffers):
                    b.copy_(saved)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
