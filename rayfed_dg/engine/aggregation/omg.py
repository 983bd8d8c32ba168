"""FedOMG: the round's step found on the server by matching the clients' updates.

Nguyen, Nguyen, Park, Pham, Hwang, "Federated Domain Generalization with
Data-free On-server Gradient Matching" (FedOMG: Federated learning via
On-server Matching Gradient), ICLR 2025, arXiv 2501.14653.  Reference code
github.com/skydvn/FedOMG, the domain-generalization experiments:
``FedOMG-DG/algorithms/FedOMG/utils/fed_merge.py`` (``FedOMG`` lines 59-79,
``OMG`` lines 82-125), called once a round by
``FedOMG-DG/algorithms/FedOMG/train_pacs_OMG.py`` (line 84; its defaults,
lines 35-36).  (``system/flcore/servers/server_OMG.py``, the FL experiments,
has the same solver with the step count, learning rate and momentum as
arguments and unweighted updates.)

With x_t the global model, y_i client i's upload, p_i = w_i / sum_j w_j its
normalised aggregation weight (the method's: |D_i| for FedAvg), m the
clients that returned, and the broadcast parameters flattened into one
vector (fed_merge.py line references):

    d_i   = p_i (y_i - x_t)                                        (l. 65)
    s     = (1/m) sum_i sqrt(d_i.d_i + 1e-4)                       (l. 89)
    G_ij  = d_i.d_j / s^2                                          (l. 88, 90)
    b_i   = (1/m) sum_j G_ij,   gbar = (1/m) sum_i b_i             (l. 91-92)
    c     = kappa sqrt(gbar + 1e-4)                                (l. 104)
    F(w)  = a.b + c sqrt(a^T G a + 1e-4),   a = softmax(w)         (l. 110-111)
    w_0 = 0;  for k < T:  v_k = grad F(w_k) + mu v_{k-1} (v_0 = grad F(w_0)),
              w_{k+1} = w_k - lr v_k                               (l. 98-117: torch SGD, momentum mu)
    w*    = the w_k, k = 0..T, of the smallest F (the first on a tie)  (l. 112-114)
    a*    = softmax(w*),  lambda = c / (sqrt(a*^T G a* + 1e-4) + 1e-4)  (l. 119-122)
    g     = sum_i (1/m + lambda a*_i) d_i / (1 + kappa^2)           (l. 123-124)
    x_{t+1} = x_t + eta_g g                                        (l. 73)

with grad F(w) = a * (q - a.q), q = b + c G a / sqrt(a^T G a + 1e-4) (the
chain rule through the softmax; the reference takes it by autograd).  This
is CAGrad's dual problem (Liu et al., NeurIPS 2021) on the clients'
updates: g is about (g_0 + kappa |g_0| g_a / |g_a|) / (1 + kappa^2), g_0 =
(1/m) sum_i d_i, g_a = sum_i a*_i d_i: the mean update turned, within the
radius kappa |g_0| (kappa is the paper's; the code's ``parameter_c``),
towards the combination of the updates that the worst-aligned client agrees
with most.  At kappa = 0, g = (1/m) sum_i p_i (y_i - x_t): a step of eta_g / m
towards FedAvg's average.  The sign: d_i = y_i - x_t, each client's update
(the code's ``grad_param - global_param``); the solver reads the d_i only
through their products, so the sign shows in the step alone, x_t + eta_g g.

Defaults (``server.omg_*``), the reference's for its DG experiments: T = 20
steps (21 evaluations of F, ``range(21)``), lr 25, momentum 0.5 (l. 102,
108), kappa 0.5 (``--parameter_c``) and eta_g 0.5 (``--global_model_lr``).

Where we differ from the reference code:

* m is the number of clients that returned; the reference passes 3, PACS's
  source domains, and doubles lr when m = 50: we use ``server.omg_lr`` as set;
* the buffers (BatchNorm's running statistics, its counters) take the weighted
  mean sum_i p_i y_i, as after a server optimizer (``server_opt.py``); the
  reference flattens ``parameters()`` only and never updates the global
  model's buffers.  A method's local keys and the keys it assembles are not
  matched either (``Estimator.bind``);
* p_i are the method's aggregation weights; the reference's ``Cal_Weight_Dict``
  weighs by each domain's test-split size (l. 30), and its GA script by 1/3;
* float64 NumPy with the gradient in closed form, not float32 torch autograd.

Composition: the estimate is x_t + eta_g g on the matched parameters, so a
server optimizer (``steps_optimizer``) steps from x_t along eta_g g as it
steps along a mean's pseudo-gradient (set ``omg_global_lr`` 1 to give it the
direction at its own scale).  A method that sets global tensors itself from
the round's average (``assemble_global``: FedDyn, FedGMA, CSAC, COPA) is
refused: its hook would read FedOMG's step as an average.  A method's own
aggregation weights are taken as the p_i, as the reference takes its weights.

Order and worker count: the uploads travel whole (``sums`` False) and are
read in client order (``Uploads.uploads``), so the Gram matrix, the solver
and the combination see them in one order whatever their arrival or the
worker that trained them.  Nothing is random (w_0 = 0).  No state is kept
between rounds (the reference builds its optimizer afresh each round).
Memory: the round's m uploads and one key's m x n differences at a time.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .pipeline import Estimator, State, Uploads, register_aggregator

EPS = 1e-4  # the reference's 1e-4, inside every square root and under lambda


def softmax(w: np.ndarray) -> np.ndarray:
    e = np.exp(w - w.max())
    return e / e.sum()


def objective(G: np.ndarray, b: np.ndarray, c: float, w: np.ndarray) -> tuple[float, np.ndarray]:
    """F(w) and its gradient in w (the module docstring)."""
    a = softmax(w)
    root = float(np.sqrt(a @ G @ a + EPS))
    q = b + c * (G @ a) / root
    return float(a @ b + c * root), a * (q - a @ q)


def omg_weights(gram: np.ndarray, kappa: float, steps: int, lr: float, momentum: float) -> np.ndarray:
    """The coefficients alpha of g = sum_i alpha_i d_i, from the Gram matrix
    d_i.d_j of the weighted updates (the module docstring's solver)."""
    m = gram.shape[0]
    scale = np.mean(np.sqrt(np.diag(gram) + EPS))
    G = gram / scale ** 2
    b = G.mean(axis=1)
    c = kappa * float(np.sqrt(b.mean() + EPS))
    w = np.zeros(m)
    v = np.zeros(m)
    best, w_best = np.inf, w
    for k in range(steps + 1):
        f, grad = objective(G, b, c, w)
        if f < best:
            best, w_best = f, w.copy()
        if k < steps:
            v = grad if k == 0 else momentum * v + grad  # torch.optim.SGD: no dampening, buffer = grad at first
            w = w - lr * v
    a = softmax(w_best)
    lam = c / (float(np.sqrt(a @ G @ a + EPS)) + EPS)
    return (1.0 / m + lam * a) / (1.0 + kappa ** 2)


def _cast(value: np.ndarray, like: np.ndarray) -> np.ndarray:
    if np.issubdtype(like.dtype, np.integer):
        value = np.rint(value)
    return np.asarray(value).astype(like.dtype)


@register_aggregator
class FedOMG(Estimator):
    """FedOMG's step over the broadcast parameters, the weighted mean over the
    buffers (module docstring); ``server.omg_*`` are its settings."""

    name = "fedomg"
    sums = False  # the Gram matrix needs every upload whole
    refuses = {"assemble_global": "sets global tensors itself from the round's average (assemble_global), and "
                                  "FedOMG's matched step is no average"}
    advice = "use server.aggregator mean"

    def __init__(self, cfg, init: State):
        super().__init__(cfg, init)
        # None until ``bind``: every floating tensor is matched (a state made by hand)
        self.parameters: set[str] | None = None

    def bind(self, parameters: list[str]) -> None:
        self.parameters = set(parameters)

    def _matched(self, u: Uploads, ups: list[tuple[int, Mapping[str, np.ndarray]]]) -> list[str]:
        """The keys FedOMG steps: broadcast floating parameters somebody uploaded, sorted."""
        keys = (k for k, v in u.x.items() if np.issubdtype(np.asarray(v).dtype, np.floating)
                and (self.parameters is None or k in self.parameters) and any(k in y for _, y in ups))
        return sorted(keys)

    def _diffs(self, u: Uploads, ups, p: np.ndarray, k: str) -> np.ndarray:
        """(m, n) float64: row i is d_i = p_i (y_i - x_t) over key ``k`` (zero where client i did not upload it)."""
        x = np.asarray(u.x[k], np.float64).ravel()
        return np.stack([pi * (np.asarray(y[k], np.float64).ravel() - x) if k in y else np.zeros_like(x)
                         for pi, (_, y) in zip(p, ups)])

    def estimate(self, u: Uploads) -> State:
        ups = u.uploads()
        out = dict(u.x)
        if not ups:
            return out
        w = np.array([float(u.weights[c]) for c, _ in ups], np.float64)
        p = w / w.sum()
        matched = self._matched(u, ups)
        gram = np.zeros((len(ups), len(ups)))
        for k in matched:
            d = self._diffs(u, ups, p, k)
            gram += d @ d.T
        s = self.cfg
        alpha = omg_weights(gram, s.omg_kappa, s.omg_steps, s.omg_lr, s.omg_momentum)
        for k in matched:
            x = np.asarray(u.x[k], np.float64)
            g = (alpha @ self._diffs(u, ups, p, k)).reshape(x.shape)
            out[k] = _cast(x + s.omg_global_lr * g, np.asarray(u.x[k]))
        for k in set(u.x) - set(matched):  # buffers: the weighted mean of those who uploaded them
            have = [(pi, y[k]) for pi, (_, y) in zip(p, ups) if k in y]
            if have:
                tot = sum(pi for pi, _ in have)
                acc = sum(pi * np.asarray(v, np.float64) for pi, v in have)  # client order
                out[k] = _cast(acc / tot, np.asarray(u.x[k]))
        return out
