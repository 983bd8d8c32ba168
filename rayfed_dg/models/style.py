"""Feature-style operations (StableFDG, MixStyle) and the attention-based
feature highlighter.  All are identities at evaluation except the
highlighter, which then uses self-attention only.

The modules of one network share a ``StyleState``: the training labels of
the current (possibly enlarged) batch, the random generator of the client
task, the style received from the server and the switches of the method.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

EPS = 1e-6


def channel_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample channel mean and std, sqrt(var + eps) (biased over H x W)."""
    mu = x.mean((2, 3))
    sig = torch.sqrt(x.var((2, 3), unbiased=False) + EPS)
    return mu, sig


def adain(x: torch.Tensor, mu: torch.Tensor, sig: torch.Tensor) -> torch.Tensor:
    m, s = channel_stats(x)
    return (x - m[:, :, None, None]) / s[:, :, None, None] * sig[:, :, None, None] + mu[:, :, None, None]


def style_information(mus: torch.Tensor, sigs: torch.Tensor) -> np.ndarray:
    """Phi_n = [mu_n, sigma_n, Sigma_n(mu), Sigma_n(sigma)] (StableFDG Eq. 2-3)
    from per-sample channel statistics (N, C): means and (biased) variances."""
    mu_n, sig_n = mus.mean(0), sigs.mean(0)
    var_mu = ((mus - mu_n) ** 2).mean(0)
    var_sig = ((sigs - sig_n) ** 2).mean(0)
    return torch.cat([mu_n, sig_n, var_mu, var_sig]).double().numpy().astype(np.float32)


def kmeanspp_seeds(points: torch.Tensor, k: int, gen: torch.Generator) -> torch.Tensor:
    """Indices of the ``k`` samples k-means++ seeding picks (D^2 sampling)."""
    n = points.shape[0]
    first = int(torch.randint(n, (1,), generator=gen))
    chosen = [first]
    d2 = ((points - points[first]) ** 2).sum(1)
    for _ in range(1, k):
        w = d2.clamp_min(0).double()
        if w.sum() <= 0:  # all remaining points coincide with a chosen one
            w = torch.ones(n, dtype=torch.float64)
            w[chosen] = 0
        nxt = int(torch.multinomial(w, 1, generator=gen))
        chosen.append(nxt)
        d2 = torch.minimum(d2, ((points - points[nxt]) ** 2).sum(1))
    return torch.tensor(chosen, dtype=torch.long)


def balanced_oversample(labels: torch.Tensor, size: int, gen: torch.Generator) -> torch.Tensor:
    """Indices (into the batch) of ``size`` extra samples that make the
    enlarged batch as class-balanced as possible: repeatedly add one sample
    of the class now rarest (a tie broken at random with the client's seeded
    generator: a fixed order would favour the lowest class id), drawn at
    random from that class's samples in the batch (StableFDG appendix G)."""
    classes = torch.unique(labels)
    counts = {int(c): int((labels == c).sum()) for c in classes}
    members = {int(c): torch.nonzero(labels == c).flatten() for c in classes}
    out = []
    for _ in range(size):
        low = min(counts.values())
        rarest = sorted(k for k, v in counts.items() if v == low)
        c = rarest[int(torch.randint(len(rarest), (1,), generator=gen))] if len(rarest) > 1 else rarest[0]
        pool = members[c]
        out.append(int(pool[int(torch.randint(len(pool), (1,), generator=gen))]))
        counts[c] += 1
    return torch.tensor(out, dtype=torch.long)


@dataclass
class StyleState:
    labels: torch.Tensor | None = None
    gen: torch.Generator | None = None
    received: np.ndarray | None = None  # (m, 4C) styles received this round
    shift: bool = True
    shift_p: float = 0.5
    selection: str = "kmeans++"  # or "random"
    oversample: str = "balanced"  # balanced | random | none
    oversample_size: int | None = None  # None: the batch size
    explore: bool = True
    alpha: float = 3.0
    detach_explored: bool = True  # the extrapolated styles are AdaIN targets, no gradient (see ``explore``)
    explore_p: float = 0.5
    mix_alpha: float = 0.1
    fired: bool = False  # has a style op enlarged this forward's batch

    def coin(self, p: float) -> bool:
        return float(torch.rand(1, generator=self.gen)) < p


class StyleShift(nn.Module):
    """Selective style shifting (Step 2) at the first residual block's output."""

    def __init__(self, state: StyleState):
        super().__init__()
        self.state = state

    def forward(self, x):
        st = self.state
        if not self.training or not st.shift or st.received is None or x.shape[0] < 2 or not st.coin(st.shift_p):
            return x
        b, c = x.shape[:2]
        mu, sig = channel_stats(x)
        keep_n = b // 2
        if st.selection == "kmeans++":
            keep = kmeanspp_seeds(torch.cat([mu, sig], 1).detach().cpu(), keep_n, st.gen)
        else:
            keep = torch.randperm(b, generator=st.gen)[:keep_n]
        shift = torch.ones(b, dtype=torch.bool)
        shift[keep] = False
        # style of a random received client among those sent this round
        phi = torch.as_tensor(st.received[int(torch.randint(len(st.received), (1,), generator=st.gen))])
        m_c, s_c, v_mu, v_sig = phi[:c], phi[c:2 * c], phi[2 * c:3 * c], phi[3 * c:]
        n = int(shift.sum())
        # the paper's garbled noise term read as: new mu ~ N(mu_n', Sigma_n'(mu)), a variance (Eq. 2)
        new_mu = m_c + torch.randn(n, c, generator=st.gen) * v_mu.clamp_min(0).sqrt()
        new_sig = (s_c + torch.randn(n, c, generator=st.gen) * v_sig.clamp_min(0).sqrt()).clamp_min(EPS)
        idx = torch.nonzero(shift.to(x.device)).flatten()
        out = x.clone()
        out[idx] = adain(x[idx], new_mu.to(x), new_sig.to(x))
        return out


class StyleExplore(nn.Module):
    """Oversampling + exploration (Steps 3-4), then MixStyle (Step 5).

    The first module of a forward that fires (probability ``explore_p``)
    enlarges the batch; later ones only mix, as in the reference code."""

    def __init__(self, state: StyleState):
        super().__init__()
        self.state = state

    def forward(self, x):
        st = self.state
        if not self.training or not st.explore or not st.coin(st.explore_p):
            return x
        if not st.fired and st.oversample != "none":
            st.fired = True
            b = x.shape[0]
            size = st.oversample_size or b
            if st.oversample == "balanced":
                pick = balanced_oversample(st.labels[:b].cpu(), size, st.gen)
            else:
                pick = torch.randint(b, (size,), generator=st.gen)
            x = explore(x, pick.to(x.device), st.alpha, st.detach_explored)
            st.labels = torch.cat([st.labels, st.labels[:b][pick.to(st.labels.device)]])
        return mixstyle(x, st.mix_alpha, st.gen)


def explore(x: torch.Tensor, pick: torch.Tensor, alpha: float, detach: bool = True) -> torch.Tensor:
    """[x, oversampled x[pick] with extrapolated styles] (Eq. 4-5): each
    oversampled feature's mean and std move away from the concatenated
    batch's average by ``alpha`` times their distance to it.

    ``detach``: the new styles are AdaIN's targets, constants as in AdaIN
    and MixStyle (and the reference code, which detaches every target
    style before applying it); the gradient flows through the
    normalisation only.  Without it the explored feature is
    (1 + alpha) x - alpha (x_hat sigma_bar + mu_bar): along each channel's
    mean and std directions (1 + alpha) = 4 times the gradient, on half of
    the enlarged batch:
    from scratch the model then fits its own source domains far worse
    (docs/results.md); ``method.detach_explored: false`` keeps
    that variant for the ablation."""
    extra = x[pick]
    mu_all, sig_all = channel_stats(torch.cat([x, extra]))
    if detach:
        mu_all, sig_all = mu_all.detach(), sig_all.detach()
    b = x.shape[0]
    mu_e, sig_e = mu_all[b:], sig_all[b:]
    new_mu = mu_e + alpha * (mu_e - mu_all.mean(0, keepdim=True))
    # Eq. 5 as written, no clamp (the reference code does not clamp either): a
    # negative sigma flips the normalised feature but keeps its content, whereas
    # clamping at ~0 erased the content of every channel whose std sits below
    # (alpha / (1 + alpha)) of the batch average, and training from scratch
    # stalled (one digits client, alpha = 3, 300 steps: loss 1.39 vs 0.31).
    new_sig = sig_e + alpha * (sig_e - sig_all.mean(0, keepdim=True))
    return torch.cat([x, adain(extra, new_mu, new_sig)])


def mixstyle(x: torch.Tensor, alpha: float, gen: torch.Generator) -> torch.Tensor:
    """MixStyle (Zhou et al., ICLR 2021): mix detached channel statistics with a
    random partner, lambda ~ Beta(alpha, alpha) per sample."""
    b = x.shape[0]
    mu, sig = channel_stats(x)
    mu, sig = mu.detach(), sig.detach()
    lam = torch.distributions.Beta(alpha, alpha).sample((b, 1)) if gen is None else _beta(alpha, b, gen)
    lam = lam.to(x)
    perm = torch.randperm(b, generator=gen).to(x.device)
    mu_mix = lam * mu + (1 - lam) * mu[perm]
    sig_mix = lam * sig + (1 - lam) * sig[perm]
    xn = (x - mu[:, :, None, None]) / sig[:, :, None, None]
    return xn * sig_mix[:, :, None, None] + mu_mix[:, :, None, None]


def _beta(alpha: float, n: int, gen: torch.Generator) -> torch.Tensor:
    # Beta(a, a) from two seeded Gammas: X / (X + Y)
    g1 = torch._standard_gamma(torch.full((n, 1), float(alpha)), generator=gen)
    g2 = torch._standard_gamma(torch.full((n, 1), float(alpha)), generator=gen)
    return g1 / (g1 + g2).clamp_min(1e-12)


class FeatureHighlighter(nn.Module):
    """Attention-based feature highlighter (StableFDG Sec. 3.2, Eq. 6-8).

    On the last block's map z (B, C, H, W): Q = theta_q z, K = theta_k z
    (1x1 convolutions to d channels).  The query of sample i mixes its own
    with a same-class partner's, (q_j + q_i) / 2 (Eq. 8), in training; at
    test it is q_i alone (self-attention).  S = Q^T K (HW x HW), a = softmax
    over key positions of the mean over query positions, and the output is
    [GAP(z), sum_hw a * z]: the classifier input doubles.

    ``scores``: Eq. 6 writes a plain dot product (``dot``); the reference code
    L2-normalises q and k over channels at each position before mixing the
    partner's query, i.e. cosine scores (``cosine``, the default: what the
    published numbers were run with, and bounded, where raw dot products
    sharpen the softmax without bound as features grow); ``scaled`` divides
    the dot product by sqrt(d), as Transformers do.
    """

    def __init__(self, channels: int, state: StyleState, d: int = 30, scores: str = "cosine"):
        super().__init__()
        if scores not in ("cosine", "dot", "scaled"):
            raise ValueError(f"attention scores {scores!r}: use cosine, dot or scaled")
        self.state = state
        self.q = nn.Conv2d(channels, d, 1)
        self.k = nn.Conv2d(channels, d, 1)
        self.d = d
        self.scores = scores
        self.last_attention: torch.Tensor | None = None
        self.partners: torch.Tensor | None = None  # set by the method; None = self-attention

    def forward(self, z):
        b, c, h, w = z.shape
        q = self.q(z).flatten(2)  # (B, d, HW)
        k = self.k(z).flatten(2)
        if self.scores == "cosine":
            q, k = F.normalize(q, dim=1), F.normalize(k, dim=1)
        if self.training and self.partners is not None:
            q = (q + q[self.partners[:b]]) / 2
        s = torch.einsum("bdm,bdn->bmn", q, k)  # query positions m, key positions n
        if self.scores == "scaled":
            s = s / self.d ** 0.5
        a = torch.softmax(s.mean(1), dim=1)  # (B, HW) over key positions
        self.last_attention = a.detach()
        att = torch.einsum("bn,bcn->bc", a, z.flatten(2))
        gap = z.mean((2, 3))
        return torch.cat([gap, att], 1)[:, :, None, None]


def same_class_partners(labels: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """For each sample, a different sample of its class in the batch (the next
    one, cyclically); returns (partner index, has_partner mask)."""
    n = len(labels)
    partner = torch.arange(n)
    has = torch.zeros(n, dtype=torch.bool)
    for c in torch.unique(labels):
        idx = torch.nonzero(labels == c).flatten()
        if len(idx) >= 2:
            partner[idx] = torch.roll(idx, -1)
            has[idx] = True
    return partner, has


class RandomStyleLayer(nn.Module):
    """Base of the per-layer feature-statistics augmentations: fires with
    probability ``p`` in training (identity at evaluation), drawing all its
    randomness from ``gen``, the client task's seeded generator."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p
        self.gen: torch.Generator | None = None

    def forward(self, x):
        # a 1 x 1 map has no spatial statistics (DSU's unbiased variance would be NaN)
        if not self.training or x.shape[0] < 2 or x.shape[2] * x.shape[3] < 2:
            return x
        if float(torch.rand(1, generator=self.gen)) >= self.p:
            return x
        return self.augment(x)

    def augment(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class MixStyleLayer(RandomStyleLayer):
    """MixStyle (Zhou et al., ICLR 2021, Eq. 3-5): the random-shuffle variant,
    since a client holds one domain; statistics detached, lambda ~ Beta(a, a)."""

    def __init__(self, p: float = 0.5, alpha: float = 0.1):
        super().__init__(p)
        self.alpha = alpha

    def augment(self, x):
        return mixstyle(x, self.alpha, self.gen)


class DSULayer(RandomStyleLayer):
    """DSU (Li et al., ICLR 2022, Eq. 3-8): beta ~ N(mu, Sigma_mu^2), gamma ~
    N(sigma, Sigma_sigma^2) per sample and channel, with Sigma the standard
    deviation over the batch of the per-sample statistics; output
    gamma (x - mu) / sigma + beta.  As the official code: unbiased variances,
    eps 1e-6, nothing detached."""

    def __init__(self, p: float = 0.5, eps: float = 1e-6):
        super().__init__(p)
        self.eps = eps

    def augment(self, x):
        mu = x.mean((2, 3))
        sig = (x.var((2, 3)) + self.eps).sqrt()
        s_mu = (mu.var(0, keepdim=True) + self.eps).sqrt()
        s_sig = (sig.var(0, keepdim=True) + self.eps).sqrt()
        beta = mu + torch.randn(mu.shape, generator=self.gen).to(x) * s_mu
        gamma = sig + torch.randn(sig.shape, generator=self.gen).to(x) * s_sig
        xn = (x - mu[:, :, None, None]) / sig[:, :, None, None]
        return xn * gamma[:, :, None, None] + beta[:, :, None, None]
