"""Weighted averaging that does not depend on order: a binned reproducible sum.

The round's average is sum_i w_i v_i / sum_i w_i over the clients that
returned.  Workers fold the uploads of the clients they trained into one
partial sum each (``BinnedSum``, ``engine/workers/worker.py``), the server merges
one partial per worker (``Reducer.add_partial``), and methods that read
each client's upload send it whole and have it folded on the server
(``Reducer.add``).  Any split of the clients into partials, any order of
folding and merging, gives the same bits: the global model does not
depend on the worker count or on which worker trained which client.

The sum, after Demmel and Nguyen's binned summation (ReproBLAS),
simplified to one window per tensor:

* a term is y = float64(w) * float64(v), v the upload, w its reduce weight
  (exact when w is an integer below 2^29, e.g. a sample count; otherwise
  rounded once, and only from (w, v));
* bins of ``W`` = 32 bits at fixed exponents (bin j holds the weights
  2^(jW) to 2^(jW + W - 1)); a tensor keeps ``K`` = 3 limbs, for bins t,
  t-1, t-2, t the bin of 2 max|y| over the terms seen so far (a margin: no
  term rounds up into bin t+1);
* a term's part in bin j is R_j - 2^W R_(j+1), R_j = round(y / 2^(jW))
  (to nearest, ties to even: a function of the term and the bin only;
  power-of-two scaling is exact, and so is the difference, an integer
  |part| <= 2^(W-1)); limb k += the part in bin t - k.  The float64 limbs
  add such integers exactly for up to ``MAX_TERMS`` = 2^20 terms
  (asserted); what lies below bin t-2 is dropped;
* a term (or a merged partial) with a higher top bin first shifts the
  limbs down; limbs falling out of the window are dropped.

Why the order does not matter: the boundaries are fixed and a part depends
only on the term and its bin, so each limb holds exactly the sum over the
terms of their part in that bin, and the window is set by max|y| over all
terms; a dropped limb holds exactly what would never have been deposited
had the largest term come first.  (Parts are rounded to the nearest rather
than truncated: torch's ``round`` is vectorised on the CPU and ``trunc`` is
not, ten times slower; either gives an order-independent sum.)

Error against the exact sum of the terms: each term loses at most half of
bin t-2's unit, 2^((t-2)W - 1) <= 2^-64 max|y| (max over the tensor), and
the result is rounded to float64 once the limbs are combined (at most 1
ulp), before the division by the weights' sum (an exact sum of the weights
as fractions, rounded once).  A tensor with a non-finite term averages to
NaN.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import torch

W = 32  # bits per bin
K = 3  # bins kept per tensor
MAX_TERMS = 2 ** 20  # limbs stay below 2^52: the carries of ``_normalize`` stay exact
CHUNK = 1 << 17  # elements per pass on a CPU: the passes over one chunk run in cache, not memory
FAST_FROM = -29  # from this top bin up, w * 2^(-tW) * v rounds where w * v does, in every kept bit


def _top(m: float) -> int:
    """The top bin of a window holding terms up to ``m`` > 0: the bin of 2m's
    leading bit, so |y| < 2^((t+1)W - 1) and no term rounds up into bin t+1."""
    return math.frexp(m)[1] // W


def _scale(x: torch.Tensor, e: int) -> torch.Tensor:
    """``x`` *= 2^e, exact (in two steps where 2^e lies outside float64's normal range)."""
    if -1022 <= e <= 1023:
        return x.mul_(math.ldexp(1.0, e))
    h = e // 2
    return x.mul_(math.ldexp(1.0, h)).mul_(math.ldexp(1.0, e - h))


def _shift(limbs: torch.Tensor, d: int) -> None:
    """Move the window ``d`` bins up: limb k takes limb k - d's sum, the top ``d`` start at zero."""
    for k in range(K - 1, d - 1, -1):
        limbs[k].copy_(limbs[k - d])
    limbs[:min(d, K)].zero_()


def _normalize(limbs: torch.Tensor) -> None:
    """Carry, exactly, so that limbs 1.. lie in [-2^(W-1), 2^(W-1)): the form that travels."""
    for k in range(K - 1, 0, -1):
        c = torch.floor((limbs[k] + 2.0 ** (W - 1)) * 2.0 ** -W)
        limbs[k].sub_(c, alpha=2.0 ** W)
        limbs[k - 1].add_(c)


@dataclass
class PackedSum:
    """A ``BinnedSum`` as it travels from a worker: numpy, limbs 1.. as int32
    (16 bytes a value, against 24 in the accumulator)."""
    terms: int
    shapes: dict[str, tuple[int, ...]]
    top: dict[str, int | None]
    nonfinite: set[str]
    high: dict[str, np.ndarray]  # float64 limb 0
    low: dict[str, np.ndarray]  # int32 limbs 1..K-1, shape (K - 1, n)


class BinnedSum:
    """Sum_i w_i v_i of named tensors, exact up to the window (module
    docstring): ``add`` folds one weighted upload, ``merge`` another sum.
    The limbs live on the tensors' device (a worker training on CUDA folds
    there)."""

    def __init__(self) -> None:
        self.terms = 0
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.top: dict[str, int | None] = {}  # None: only zeros so far
        self.nonfinite: set[str] = set()
        self.limbs: dict[str, torch.Tensor] = {}  # key -> (K, n) float64 integers
        self._scratch: torch.Tensor | None = None  # (K, chunk) float64

    def _count(self, terms: int) -> None:
        self.terms += terms
        assert self.terms <= MAX_TERMS, f"a binned sum holds at most {MAX_TERMS} terms exactly"

    def _slot(self, key: str, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        if key not in self.limbs:
            self.shapes[key] = shape
            self.top[key] = None
            self.limbs[key] = torch.zeros((K, math.prod(shape)), dtype=torch.float64, device=device)
        return self.limbs[key]

    def _raise_top(self, key: str, t: int | None) -> int | None:
        """The window of ``key`` after a term (or sum) whose top bin is ``t``."""
        cur = self.top[key]
        if t is not None and (cur is None or t > cur):
            if cur is not None:
                _shift(self.limbs[key], t - cur)
            self.top[key] = cur = t
        return cur

    def add(self, weight: float, tensors: Mapping[str, torch.Tensor]) -> None:
        """Fold ``weight`` * each tensor in."""
        self._count(1)
        w = float(weight)
        for key, v in tensors.items():
            limbs = self._slot(key, tuple(v.shape), v.device)
            if key in self.nonfinite:
                continue
            v = v.detach().reshape(-1)
            if not v.is_floating_point():
                v = v.double()  # integer buffers (num_batches_tracked): small, exact below 2^53
            lo, hi = (float(x) for x in torch.aminmax(v)) if v.numel() else (0.0, 0.0)
            m = abs(w) * max(-lo, hi)  # max |w v| (rounding is monotone); aminmax gives NaN, both, where a v is NaN
            if not math.isfinite(m):
                self.nonfinite.add(key)
                continue
            if m == 0.0:
                continue
            t = self._raise_top(key, _top(m))
            assert t is not None
            self._deposit(limbs, v, w, t)

    def _deposit(self, limbs: torch.Tensor, v: torch.Tensor, w: float, t: int) -> None:
        """limb k += part of (w v) in bin t - k, elementwise, in chunks that
        stay in cache: R_k = round(w v 2^(-(t-k)W)) for every k at once, then
        part_k = R_k - 2^W R_(k-1) (exact: an integer below 2^W), then one add."""
        n = v.numel()
        step = n if v.device.type != "cpu" else CHUNK
        # one multiply by s = w 2^(-tW) (exact) instead of two, where v s rounds as (w v) 2^(-tW) does in every
        # kept bit: s normal, and from bin FAST_FROM up a product that differs (subnormal, below 2^-1022) lies
        # below half the window's last unit and rounds to zero either way
        try:
            s = math.ldexp(w, -t * W)
            fast = t >= FAST_FROM and abs(s) >= 2.0 ** -1022
        except OverflowError:
            fast = False
        rows = torch.tensor([math.ldexp(s if fast else 1.0, k * W) for k in range(K)], dtype=torch.float64,
                            device=v.device)[:, None]
        if self._scratch is None or self._scratch.shape[1] < min(step, n) or self._scratch.device != v.device:
            self._scratch = torch.empty((K, min(step, n)), dtype=torch.float64, device=v.device)
        for lo in range(0, n, step):
            hi = min(lo + step, n)
            z = self._scratch[:, :hi - lo]
            if fast:
                torch.mul(v[None, lo:hi], rows, out=z)
            else:  # y = w v rounded as the term is defined, then scaled to bin t's units (|y 2^(-tW)| < 2^W)
                y = _scale(v[lo:hi].to(torch.float64, copy=True).mul_(w), -t * W)
                torch.mul(y[None], rows, out=z)
            z.round_()
            for k in range(K - 1, 0, -1):
                z[k].sub_(z[k - 1], alpha=2.0 ** W)
            limbs[:, lo:hi].add_(z)

    def merge(self, other: BinnedSum | PackedSum) -> None:
        """Add another sum (a worker's partial)."""
        if isinstance(other, PackedSum):
            other = BinnedSum.unpack(other)
        self._count(other.terms)
        for key, shape in other.shapes.items():
            limbs = self._slot(key, shape, other.limbs[key].device)
            if key in other.nonfinite:
                self.nonfinite.add(key)
            t = other.top[key]
            if key in self.nonfinite or t is None:
                continue
            cur = self._raise_top(key, t)
            assert cur is not None
            d = cur - t
            if d < K:
                limbs[d:].add_(other.limbs[key][:K - d].to(limbs.device))

    # -------------------------------------------------------------- wire
    def pack(self) -> PackedSum:
        """The sum as numpy, normalised (limbs 1.. in int32); consumes the limbs."""
        high, low = {}, {}
        for key, limbs in self.limbs.items():
            _normalize(limbs)
            high[key] = limbs[0].cpu().numpy()
            low[key] = limbs[1:].to(torch.int32).cpu().numpy()
        return PackedSum(self.terms, dict(self.shapes), dict(self.top), set(self.nonfinite), high, low)

    @staticmethod
    def unpack(p: PackedSum) -> BinnedSum:
        out = BinnedSum()
        out.terms, out.shapes, out.top, out.nonfinite = p.terms, dict(p.shapes), dict(p.top), set(p.nonfinite)
        for key in p.shapes:
            limbs = torch.empty((K, p.high[key].size), dtype=torch.float64)
            view = limbs.numpy()  # copied in by numpy: a partial from the object store is read-only, which
            view[0], view[1:] = p.high[key], p.low[key]  # torch.from_numpy would warn about on every merge
            out.limbs[key] = limbs
        return out

    # ------------------------------------------------------------ result
    def total(self, key: str) -> torch.Tensor:
        """The sum of ``key``'s terms in float64 (to within the module docstring's bound), its shape."""
        shape, t = self.shapes[key], self.top[key]
        if key in self.nonfinite:
            return torch.full(shape, math.nan, dtype=torch.float64)
        if t is None:
            return torch.zeros(shape, dtype=torch.float64)
        limbs = self.limbs[key].cpu().clone()
        _normalize(limbs)
        # limb0 2^2W + limb1 2^W + limb2 in bin t-2's units: Fast2Sum (|limb1| < 2^(W-1) <= |limb0| 2^W when
        # limb0 != 0) keeps the first sum's rounding error, so the result is rounded once, within 1 ulp
        a, b = limbs[0] * 2.0 ** (2 * W), limbs[1] * 2.0 ** W
        s = a + b
        e = b - (s - a)
        return _scale(s + (e + limbs[2]), (t - K + 1) * W).reshape(shape)


@dataclass
class Partial:
    """A worker's fold of one round: the clients it folded and their sum."""
    clients: list[int]
    sums: PackedSum


class Reducer:
    """A round's weighted average: whole uploads (``add``) and workers'
    partial sums (``add_partial``) in any order, each sampled client once;
    ``None`` for a client that returned nothing (dropped: the weights are
    renormalised over the others)."""

    def __init__(self, order: list[int], weights: Mapping[int, float]):
        self.order = list(order)  # the sampled clients
        self.weights = {c: float(w) for c, w in weights.items()}
        self.sum = BinnedSum()
        self.folded: set[int] = set()
        self._dropped: set[int] = set()
        self._wsum: dict[str, Fraction] = {}  # exact: any order gives the same sum

    def _take(self, clients: Iterable[int]) -> None:
        for c in clients:
            if c in self.folded or c in self._dropped or c not in self.weights:
                raise ValueError(f"client {c} is not one this reduce still waits for")

    def _weigh(self, keys: Iterable[str], clients: Iterable[int]) -> None:
        w = sum((Fraction(self.weights[c]) for c in clients), Fraction(0))
        for k in keys:
            self._wsum[k] = self._wsum.get(k, Fraction(0)) + w

    def add(self, client_id: int, update: Mapping[str, np.ndarray] | None) -> None:
        """Client ``client_id``'s whole upload (None: it was dropped)."""
        self._take([client_id])
        if update is None:
            self._dropped.add(client_id)
            return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only object-store views, only read
            self.sum.add(self.weights[client_id], {k: torch.as_tensor(np.asarray(v)) for k, v in update.items()})
        self.folded.add(client_id)
        self._weigh(update.keys(), [client_id])

    def add_partial(self, partial: Partial) -> None:
        """A worker's partial sum of ``partial.clients``' uploads."""
        self._take(partial.clients)
        self.sum.merge(partial.sums)
        self.folded.update(partial.clients)
        self._weigh(partial.sums.shapes.keys(), partial.clients)

    @property
    def dropped(self) -> list[int]:
        return sorted(self._dropped)

    @property
    def missing(self) -> list[int]:
        """Sampled clients neither folded in nor dropped yet."""
        return [c for c in self.order if c not in self.folded and c not in self._dropped]

    @property
    def complete(self) -> bool:
        return not self.missing

    def sums(self, keys: Iterable[str]) -> dict[str, np.ndarray]:
        """The weighted sums of ``keys`` in float64, not divided (DP-FedAvg
        noises the sum, ``dp.py``)."""
        assert self.complete, "not every client has been folded in"
        return {k: self.sum.total(k).numpy() for k in keys}

    def result(self, like: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Weighted means, renormalised over the clients that returned, cast
        to the dtype of ``like``; keys nobody uploaded keep ``like``'s value."""
        assert self.complete, "not every client has been folded in"
        out = {}
        for k, ref in like.items():
            if k in self._wsum and self._wsum[k] > 0:
                mean = (self.sum.total(k) / float(self._wsum[k])).numpy()
                if np.issubdtype(ref.dtype, np.integer):
                    mean = np.rint(mean)
                out[k] = np.asarray(mean).astype(ref.dtype)
            else:
                out[k] = ref
        return out
