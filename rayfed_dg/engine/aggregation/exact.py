"""Weighted averaging that does not depend on order: a fixed-point sum in a
window fixed before the round.

The round's average is sum_i w_i v_i / sum_i w_i over the clients that
returned.  Workers fold the uploads of the clients they trained into one
partial sum each (``FixedSum``, ``engine/workers/worker.py``), the server
merges one partial per worker (``Reducer.add_partial``), and methods that
read each client's upload send it whole and have it folded on the server
(``Reducer.add``).  Any split of the clients into partials, any order of
folding and merging, gives the same bits: the global model does not depend
on the worker count or on which worker trained which client.

The sum (a fixed-point accumulator, as in the binned sums of Demmel and
Nguyen's ReproBLAS, with one window a tensor chosen before any term):

* a term is y = w v, v the upload, w its reduce weight, computed as
  v * (w 2^-e) in float64: exact when w is an integer below 2^29 (a sample
  count), otherwise rounded once, and only from (w, v, e);
* the round's window: before the round the server sets, per tensor, the
  exponent f = E - ``B``, E the binary exponent of 2^``MARGIN`` max_i |w_i|
  max |x_t| (x_t the round's global model: every upload starts from it), so
  that a term up to 2^``MARGIN`` times the largest the global model gives is
  an integer of at most ``B`` bits in units of 2^f (``windows``); the
  exponents travel with the round's folds (``Fold.window``).  DP-FedAvg
  folds clipped updates, far smaller than x_t: the bound below holds, but
  relative to them it is about float32's resolution, under the noise;
* a term whose max |y| fits the window is deposited as R = round(y 2^-f)
  (to nearest, ties to even); one that does not (an upload that grew more
  than 2^``MARGIN``-fold, or a tensor the global model holds at zero) takes
  the lowest exponent above on a grid of ``GRID`` bits from f (from 0 when
  there is no window) where it fits, its own accumulator;
* accumulators add integers exactly: a float64 one up to ``FLUSH`` terms
  (|sum| <= 2^53), then moved into an int64 one (|sum| <= 2^62 up to
  ``MAX_TERMS`` terms, asserted).  A partial travels as one int64 a value
  and exponent: 8 bytes a value when every term fits its window.

Why the order does not matter: a term's exponent and integer are functions
of the term and the round's window only, and integer sums are exact, so each
accumulator holds exactly the sum over its terms whatever the order or split.

Error against the exact sum of the terms: each term loses at most half a
unit of its exponent, 2^(f-1) <= 2^(``MARGIN`` - ``B``) max_i |w_i| max |x_t|
(2^-40 of it) for a term in the window, 2^(``GRID`` - ``B``) of its own max |y|
otherwise; the accumulators are converted to float64 once each (at most half
an ulp) and added in increasing exponent (one exponent, the usual case: one
rounding), before the division by the weights' sum (an exact sum of the
weights as fractions, rounded once).  A tensor with a non-finite term
averages to NaN.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np
import torch

B = 44  # bits of a term's integer
FLUSH = 2 ** (53 - B)  # terms a float64 accumulator adds exactly before they move to the int64 one
MAX_TERMS = 2 ** (62 - B)  # terms the int64 accumulators add exactly
MARGIN = 4  # bits of growth over the global model's largest term that still fit the round's window
GRID = 8  # bits between the exponents a term outside the window may take
CHUNK = 1 << 18  # elements per pass on a CPU: a chunk's passes run in cache (the fastest of 2^13 to 2^21 here)


def _exponent(m: float) -> int:
    """The least e with m 2^-e < 2^B (m > 0)."""
    return math.frexp(m)[1] - B


def windows(reference: Mapping[str, np.ndarray], weights: Iterable[float]) -> dict[str, int]:
    """The round's window exponent f of each tensor of ``reference`` (the
    global model) whose largest term is finite and not zero (module docstring)."""
    wmax = max((abs(float(w)) for w in weights), default=0.0) * 2.0 ** MARGIN
    out = {}
    for k, v in reference.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a read-only view (the object store's): only read
            a = torch.as_tensor(np.asarray(v))
        if a.is_complex() or a.dtype == torch.bool:
            continue
        lo, hi = (float(x) for x in torch.aminmax(a)) if a.numel() else (0.0, 0.0)  # one pass, no |a| copy
        m = max(-lo, hi) * wmax
        if 0.0 < m < math.inf:
            out[k] = _exponent(m)
    return out


def term_exponent(m: float, floor: int | None) -> int:
    """The exponent of a term whose max |y| is ``m`` > 0 in a tensor of window ``floor`` (None: none)."""
    need, base = _exponent(m), 0 if floor is None else floor
    if floor is not None and need <= floor:
        return floor
    return base + GRID * -(-(need - base) // GRID)


def _scale(x: torch.Tensor, e: int) -> torch.Tensor:
    """``x`` *= 2^e, exact (in two steps where 2^e lies outside float64's normal range)."""
    if -1022 <= e <= 1023:
        return x.mul_(math.ldexp(1.0, e))
    h = e // 2
    return x.mul_(math.ldexp(1.0, h)).mul_(math.ldexp(1.0, e - h))


@dataclass
class _Cell:
    """The terms of one tensor at one exponent: float64 integers (``n``
    terms since the last flush; None until a term is folded here) and the
    int64 sum of those before (None until a flush)."""
    size: int
    device: torch.device
    f: torch.Tensor | None = None
    i: torch.Tensor | None = None
    n: int = 0

    def make_room(self, terms: int) -> None:
        """Flush to int64 first if ``terms`` more would pass ``FLUSH``."""
        if self.f is not None and self.n + terms > FLUSH:
            moved = self.f.to(torch.int64)
            self.i = moved if self.i is None else self.i.add_(moved)
            self.f, self.n = None, 0

    def add_floats(self, x: torch.Tensor, terms: int) -> None:
        """Add a float64 sum of ``terms`` integers (a partial's)."""
        self.make_room(terms)
        self.f = x.to(self.device, copy=True) if self.f is None else self.f.add_(x.to(self.device))
        self.n += terms

    def add_ints(self, x: torch.Tensor) -> None:
        self.i = x.to(self.device, copy=True) if self.i is None else self.i.add_(x.to(self.device))

    def ints(self) -> torch.Tensor:
        """The int64 sum (not to be written: it may be the accumulator itself)."""
        if self.f is None:
            assert self.i is not None
            return self.i
        out = self.f.to(torch.int64)
        return out if self.i is None else out.add_(self.i)

    def value(self) -> torch.Tensor:
        """The sum in float64 on the CPU: exact while it is float64 integers, else rounded once."""
        if self.i is None:
            assert self.f is not None
            return self.f.to("cpu", copy=True)
        return self.ints().to("cpu", torch.float64)


@dataclass
class PackedSum:
    """A ``FixedSum`` as it travels from a worker: each accumulator as float64
    integers (with the number of terms in it) or, once past ``FLUSH`` terms,
    as int64: 8 bytes a value and exponent.  ``cells`` names the accumulators
    in order as (tensor, exponent, terms; -1 for int64), ``pieces`` holds
    them (on a GPU copied to the host in one piece, then split)."""
    terms: int
    shapes: dict[str, tuple[int, ...]]
    nonfinite: set[str]
    cells: list[tuple[str, int, int]]
    pieces: list[np.ndarray]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)


@dataclass
class FixedSum:
    """Sum_i w_i v_i of named tensors in the round's ``window`` (module
    docstring): ``add`` folds one weighted upload, ``merge`` another sum.
    The accumulators live on the tensors' device (a worker training on
    CUDA folds there)."""
    window: Mapping[str, int] = field(default_factory=dict)
    terms: int = 0
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    nonfinite: set[str] = field(default_factory=set)
    cells: dict[str, dict[int, _Cell]] = field(default_factory=dict)
    _scratch: torch.Tensor | None = None

    def _count(self, terms: int) -> None:
        self.terms += terms
        assert self.terms <= MAX_TERMS, f"a fixed-point sum holds at most {MAX_TERMS} terms exactly"

    def _cell(self, key: str, e: int, n: int, device: torch.device) -> _Cell:
        at = self.cells.setdefault(key, {})
        if e not in at:
            at[e] = _Cell(n, device)
        return at[e]

    def _mark_nonfinite(self, key: str) -> None:
        self.nonfinite.add(key)
        self.cells.pop(key, None)

    def add(self, weight: float, tensors: Mapping[str, torch.Tensor]) -> None:
        """Fold ``weight`` * each tensor in."""
        self._count(1)
        w = float(weight)
        for key, v in tensors.items():
            self.shapes.setdefault(key, tuple(v.shape))
            if key in self.nonfinite:
                continue
            v = v.detach().reshape(-1)
            if not v.is_floating_point():
                v = v.double()  # integer buffers (num_batches_tracked): small, exact below 2^53
            lo, hi = (float(x) for x in torch.aminmax(v)) if v.numel() else (0.0, 0.0)
            m = abs(w) * max(-lo, hi)  # max |w v| (rounding is monotone); aminmax gives NaN, both, where a v is NaN
            if not math.isfinite(m):
                self._mark_nonfinite(key)
            elif m > 0.0:
                e = term_exponent(m, self.window.get(key))
                cell = self._cell(key, e, v.numel(), v.device)
                cell.make_room(1)
                if cell.f is None:  # the first term is written, not added to zeros
                    cell.f = torch.empty(v.numel(), dtype=torch.float64, device=v.device)
                    self._deposit(cell.f, v, w, e, first=True)
                else:
                    self._deposit(cell.f, v, w, e)
                cell.n += 1

    def _deposit(self, acc: torch.Tensor, v: torch.Tensor, w: float, e: int, first: bool = False) -> None:
        """acc += round(w v 2^-e) (or =, for the ``first`` term), elementwise:
        v to float64 (exact), one multiply by s = w 2^-e, a rounding, an add,
        chunk by chunk in cache on a CPU."""
        n = v.numel()
        step = n if v.device.type != "cpu" else CHUNK
        s = math.ldexp(w, -e) if -1000 < e < 1000 else 0.0
        # v s rounds as (w v) 2^-e does unless s is subnormal; a product below 2^-1022 rounds to 0 either way
        fast = abs(s) >= 2.0 ** -1022 and math.isfinite(s)
        if self._scratch is None or self._scratch.numel() < min(step, n) or self._scratch.device != v.device:
            self._scratch = torch.empty(min(step, n), dtype=torch.float64, device=v.device)
        for lo in range(0, n, step):
            hi = min(lo + step, n)
            z = acc[lo:hi] if first else self._scratch[:hi - lo]
            z.copy_(v[lo:hi])
            if fast:
                z.mul_(s)
            else:  # y = w v rounded as the term is defined, then scaled exactly
                _scale(z.mul_(w), -e)
            z.round_()
            if not first:
                acc[lo:hi].add_(z)

    def merge(self, other: FixedSum | PackedSum) -> None:
        """Add another sum (a worker's partial)."""
        self._count(other.terms)
        for key, shape in other.shapes.items():
            self.shapes.setdefault(key, shape)
        for key in other.nonfinite:
            self._mark_nonfinite(key)
        for key, e, terms, x in _pieces(other):
            if key in self.nonfinite:
                continue
            cell = self._cell(key, e, x.numel(), x.device)
            if terms < 0:
                cell.add_ints(x)
            else:
                cell.add_floats(x, terms)

    # -------------------------------------------------------------- wire
    def pack(self) -> PackedSum:
        """The sum as numpy: on a CPU views of the accumulators (no copy
        here; Ray's serialization makes the one it needs), on a GPU one copy
        of them all to the host."""
        order = [(k, e) for k in sorted(self.cells) for e in sorted(self.cells[k])]
        cells = [self.cells[k][e] for k, e in order]
        parts = [c.ints() if c.f is None or c.i is not None else c.f for c in cells]
        if parts and parts[0].device.type != "cpu":  # one copy: float64 and int64 as 8-byte words
            flat = torch.cat([p.view(torch.int64) for p in parts]).cpu()
            parts = [x.view(p.dtype) for x, p in zip(flat.split([p.numel() for p in parts]), parts)]
        return PackedSum(self.terms, dict(self.shapes), set(self.nonfinite),
                         [(k, e, c.n if c.i is None else -1) for (k, e), c in zip(order, cells)],
                         [p.numpy() for p in parts])

    # ------------------------------------------------------------ result
    def total(self, key: str) -> torch.Tensor:
        """The sum of ``key``'s terms in float64 (to within the module docstring's bound), its shape."""
        shape = self.shapes[key]
        if key in self.nonfinite:
            return torch.full(shape, math.nan, dtype=torch.float64)
        exps = sorted(self.cells.get(key, {}))  # added in increasing exponent: a fixed order
        if not exps:
            return torch.zeros(shape, dtype=torch.float64)
        out = _scale(self.cells[key][exps[0]].value(), exps[0])
        for e in exps[1:]:
            out.add_(_scale(self.cells[key][e].value(), e))
        return out.reshape(shape)


def _pieces(s: FixedSum | PackedSum):
    """(tensor, exponent, terms, sum) of each accumulator of ``s``: float64
    integers of ``terms`` terms, or int64 (``terms`` -1)."""
    if isinstance(s, FixedSum):
        for key, at in s.cells.items():
            for e, cell in at.items():
                yield (key, e, cell.n, cell.f) if cell.i is None else (key, e, -1, cell.ints())
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a partial from the object store is read-only: only read
        for (key, e, terms), piece in zip(s.cells, s.pieces):
            yield key, e, terms, torch.from_numpy(piece)


@dataclass
class Partial:
    """A worker's fold of one round: the clients it folded and their sum."""
    clients: list[int]
    sums: PackedSum


class Reducer:
    """A round's weighted average: whole uploads (``add``) and workers'
    partial sums (``add_partial``) in any order, each sampled client once;
    ``None`` for a client that returned nothing (dropped: the weights are
    renormalised over the others).  ``reference``: the round's global model,
    which sets the sum's window (``windows``; None: every term sets its own)."""

    def __init__(self, order: list[int], weights: Mapping[int, float],
                 reference: Mapping[str, np.ndarray] | None = None):
        self.order = list(order)  # the sampled clients
        self.weights = {c: float(w) for c, w in weights.items()}
        self.window = windows(reference, self.weights.values()) if reference is not None else {}
        self.sum = FixedSum(self.window)
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
                mean = self.sum.total(k).div_(float(self._wsum[k]))  # total() is a fresh tensor: divided in place
                if np.issubdtype(ref.dtype, np.integer):
                    mean.round_()
                out[k] = mean.numpy().astype(ref.dtype)
            else:
                out[k] = ref
        return out
