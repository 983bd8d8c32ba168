"""The asynchronous modes' server updates, FedBuff and FedAsync, as estimators
of the aggregation pipeline: the staleness functions and the two updates on
numpy state dicts.  The virtual clock that names each update's arrivals is
``engine/clock/asynchronous.py``; ``docs/asynchronous.md`` is the user's page.

Staleness tau_i of an upload: the server updates applied between the
download of the model the client trained from and the update that takes
its upload (0: it trained on the newest model).

* FedBuff (Nguyen, Malik, Zhan, Yousefpour, Rabbat, Malek, Huba, "Federated
  Learning with Buffered Asynchronous Aggregation", AISTATS 2022,
  Algorithm 1): the server adds each arriving Delta_i = y_i - x_{v_i} (the
  client's upload minus the version it downloaded) to a buffer and, every K
  arrivals, steps
      x <- x + eta_g (1/K) sum_{i=1..K} s(tau_i) Delta_i,
  s(tau) = 1 / sqrt(1 + tau) in the paper (``polynomial`` with a = 1/2).
  Here the 1/K mean is the method's reduce weights' mean, sum_i w_i s(tau_i)
  Delta_i / sum_i w_i (w_i = 1 is the paper's; FedAvg's sample counts
  otherwise), and with a server optimizer (``server.optimizer``) the
  optimizer steps along that mean instead of eta_g (Algorithm 1's
  ServerUpdate).
* FedAsync (Xie, Koyejo, Gupta, "Asynchronous Federated Optimization",
  2019, Algorithm 1): every arrival mixes in at once,
      x_t = (1 - alpha_t) x_{t-1} + alpha_t x_new,  alpha_t = alpha s(t - tau),
  with the paper's counter: a client that downloaded the newest model
  x_{t-1} has t - tau = 1, so t - tau = tau_i + 1.  Its local objective's
  proximal term (rho/2) ||x - x_tau||^2 is FedProx's (``method: fedprox``).

Staleness functions (Xie et al., Sec. 5.2), of the staleness x (tau_i for
FedBuff, t - tau for FedAsync): constant s(x) = 1; polynomial
s_a(x) = (x + 1)^-a; hinge s_{a,b}(x) = 1 if x <= b, else 1 / (a (x - b) + 1).

Both updates compute in float64 over the buffer in the order given (the
simulation's: by finish time, then client), so the bits depend on neither
the worker count nor the order Ray returns results in.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from .pipeline import Estimator, State, Uploads


def staleness_weight(kind: str, x: float, a: float = 0.5, b: float = 4.0) -> float:
    """s(x) (module docstring): ``constant``, ``polynomial`` (x + 1)^-a, ``hinge``."""
    if kind == "constant":
        return 1.0
    if kind == "polynomial":
        return float((x + 1.0) ** -a)
    if kind == "hinge":
        return 1.0 if x <= b else 1.0 / (a * (x - b) + 1.0)
    raise ValueError(f"unknown staleness function {kind!r}")


def fedasync_alpha(alpha: float, kind: str, staleness: int, a: float = 0.5, b: float = 4.0) -> float:
    """alpha_t = alpha s(t - tau), with t - tau = ``staleness`` + 1 (Xie et al.'s counter starts at 1)."""
    return alpha * staleness_weight(kind, staleness + 1, a, b)


def _cast(new: np.ndarray, like: np.ndarray) -> np.ndarray:
    like = np.asarray(like)
    if np.issubdtype(like.dtype, np.integer):
        new = np.rint(new)
    return np.asarray(new).astype(like.dtype)


def fedbuff_delta(x: Mapping[str, np.ndarray], buffer: Sequence[tuple[Mapping[str, np.ndarray],
                                                                      Mapping[str, np.ndarray], float, float]]
                  ) -> dict[str, np.ndarray]:
    """The buffer's mean update sum_i w_i s_i (y_i - x_{v_i}) / sum_i w_i, in
    float64, for each key of ``x`` that every upload holds; ``buffer``: (y_i
    the upload, x_{v_i} the version it trained from, w_i its reduce weight,
    s_i its staleness weight), summed in the order given."""
    wsum = math.fsum(w for _, _, w, _ in buffer)
    if not buffer or wsum <= 0:
        raise ValueError("a FedBuff update needs uploads with a positive weight sum")
    out = {}
    for k in x:
        if all(k in y for y, _, _, _ in buffer):
            acc = np.zeros(np.shape(x[k]), np.float64)
            for y, start, w, s in buffer:
                acc += (w * s) * (np.asarray(y[k], np.float64) - np.asarray(start[k], np.float64))
            out[k] = acc / wsum
    return out


def fedbuff_step(x: Mapping[str, np.ndarray], delta: Mapping[str, np.ndarray], eta: float) -> dict[str, np.ndarray]:
    """x + eta ``delta`` (``fedbuff_delta``; eta = 1 gives the point a server
    optimizer steps towards), cast to x's dtypes; keys without a delta keep x's value."""
    return {k: _cast(np.asarray(v, np.float64) + eta * delta[k], v) if k in delta else v for k, v in x.items()}


def fedasync_step(x: Mapping[str, np.ndarray], upload: Mapping[str, np.ndarray], alpha_t: float
                  ) -> dict[str, np.ndarray]:
    """FedAsync's mixing: (1 - alpha_t) x + alpha_t x_new for each uploaded
    key (the others keep x's value), in float64, cast to x's dtypes."""
    return {k: _cast((1.0 - alpha_t) * np.asarray(v, np.float64) + alpha_t * np.asarray(upload[k], np.float64), v)
            if k in upload else v for k, v in x.items()}




_ASYNC_REFUSES = {  # what an update that combines uploads as they arrive cannot take of a method
    "after_round": "keeps server state across rounds (after_round)",
    "assemble_global": "sets global tensors of its own (assemble_global)",
    "server_payloads": "sends clients payloads made on the server (server_payloads)",
    "reads_uploads": "reads each client's upload on the server (folds_on_workers False)",
    "round_phases": "declares the round phase {phase}, which needs the whole cohort at one model",
}
_ASYNC_ADVICE = ("asynchronous modes take methods whose aggregation is a weighted average of the uploads "
                 "(docs/asynchronous.md lists them): change method.name or use server.mode sync")


class FedBuff(Estimator):
    """FedBuff's update (module docstring) over one buffer of arrivals; with
    a server optimizer, the point x + mean the optimizer steps towards."""

    name = "fedbuff"
    key = "server.mode=fedbuff"
    sums = False  # each upload minus the version it trained from
    refuses = _ASYNC_REFUSES
    advice = _ASYNC_ADVICE

    def estimate(self, u: Uploads) -> State:
        s = self.cfg
        buffer = [(y, u.starts[c], float(u.weights[c]),
                   staleness_weight(s.staleness, u.staleness[c], s.staleness_a, s.staleness_b))
                  for c, y in u.uploads()]
        # without a server optimizer eta_g is FedBuff's own step; with one, the optimizer takes the step
        return fedbuff_step(u.x, fedbuff_delta(u.x, buffer), s.eta if s.optimizer == "none" else 1.0)


class FedAsync(Estimator):
    """FedAsync's mixing of one arrival (module docstring): its own server step."""

    name = "fedasync"
    key = "server.mode=fedasync"
    sums = False
    steps_optimizer = False  # the config refuses a server optimizer with it
    refuses = _ASYNC_REFUSES
    advice = _ASYNC_ADVICE

    def estimate(self, u: Uploads) -> State:
        s = self.cfg
        ((c, y),) = u.uploads()
        alpha = fedasync_alpha(s.alpha, s.staleness, u.staleness[c], s.staleness_a, s.staleness_b)
        return fedasync_step(u.x, y, alpha)


ASYNC_ESTIMATORS: dict[str, type[Estimator]] = {"fedbuff": FedBuff, "fedasync": FedAsync}
