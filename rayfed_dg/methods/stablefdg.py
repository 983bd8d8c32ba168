"""StableFDG: style-based learning and attention-based feature highlighter.

Park, Han, Lee, Ryu, Moon, "StableFDG: Style and Attention Based Learning for
Federated Domain Generalization", NeurIPS 2023.  Modules in
``models/style.py``.

* Style sharing (Sec. 3.1 step 1, Eq. 2-3, Algorithm 1): at the start of
  every round, before anyone trains, each participating client computes
  Phi_n = [mu_n, sigma_n, Sigma_n(mu), Sigma_n(sigma)] (4C floats) at the
  first residual block's output with the round's global model (eval mode,
  no gradient) over its local data (the engine's per-round preparation
  phase, ``round_prepare``) and uploads it; the server gives every
  participant ``styles_per_client`` styles of the *same round's* other
  participants, no client its own and no two clients the same one (a seeded
  random assignment: a derangement with one style each), as the paper's
  Algorithm 1 and the reference code do.  (Before 0.2 a style computed in
  round t was shared in round t+1 from a pool of every client ever seen: with
  30 clients and 10 per round, 68% of shared styles came from clients not in
  the round, 2.9 rounds old on average.)
* Selective style shifting (step 2, probability ``shift_p``): k-means++
  seeding with k = floor(B/2) in the per-sample style space picks the samples
  that keep their style; the others are AdaIN-shifted to mu ~ N(mu_n',
  Sigma_n'(mu)), sigma ~ N(sigma_n', Sigma_n'(sigma)) (the paper's garbled
  noise term read with Sigma as a variance, Eq. 2), per sample and channel.
  The reference code gives the kept samples centroid styles in an order
  unrelated to the samples and hard-codes B/2 = 16; we do neither.
* Class-balanced oversampling (step 3, appendix G) to ``oversample_size``
  (default B), exploration (step 4, Eq. 4-5, alpha = 3) and MixStyle over the
  enlarged batch (step 5, Beta(0.1, 0.1)), after blocks 1, 2 and 3, each
  firing with probability 0.5; only the first firing one enlarges the batch.
  The extrapolated styles are AdaIN targets without gradient, as the
  reference code detaches every target style; differentiated through
  (``detach_explored: false``, kept for the ablation) half of each
  enlarged batch carried 4 times the gradient along its style directions, and from
  scratch the model fitted its own source domains far worse than FedAvg
  (digits: mean source validation 67.3% vs 91.6%; docs/results.md).  The
  batch average of Eq. 4-5 is over the concatenated batch, as the paper's
  text says; the reference code takes it over the batch before
  oversampling.
* Placement: blocks 1-3 and the last block are ResNet ``layer1``..``layer4``
  (the conv net's blocks; a timm CNN's last four ``feature_info`` stages,
  EfficientNet-Lite0 ``blocks.1``, ``blocks.2``, ``blocks.4`` and its last
  map after ``conv_head``; a timm network whose head does more than
  average-pool that map has no place for the highlighter and is rejected).
* Feature highlighter (Sec. 3.2, Eq. 6-8), d = 30, on the last block's map;
  a sample whose class has no other sample in the batch gets a partner drawn
  from the client's own data (appended to the batch and trained on, as the
  reference's supplemental samples are), never a sample of another class.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Literal

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from rayfed_dg.models import feature_sites, insert_after, replace_module
from rayfed_dg.models.style import (
    FeatureHighlighter,
    StyleExplore,
    StyleShift,
    StyleState,
    channel_stats,
    style_information,
)

from .base import Declarations, Method, Phase, register_method


@register_method
class StableFDG(Method):
    name = "stablefdg"
    shared_payloads = {"style": "client"}  # Phi_n: 4C moments over all the client's (capped) samples

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")
        style: bool = True  # Sec. 3.1 (ablation: attention only)
        attention: bool = True  # Sec. 3.2 (ablation: style only)
        shift_p: float = Field(0.5, ge=0.0, le=1.0)
        selection: str = Field("kmeans++", pattern="^(kmeans\\+\\+|random)$")  # Table 11
        oversample: str = Field("balanced", pattern="^(balanced|random|none)$")  # Table 12
        oversample_size: int | None = Field(None, ge=1)  # default: the batch size
        alpha: float = Field(3.0, ge=0.0)  # exploration level
        # the extrapolated styles as AdaIN targets without gradient (models/style.py explore)
        detach_explored: bool = True
        explore_p: float = Field(0.5, ge=0.0, le=1.0)  # probability per block (Table 13)
        mix_alpha: float = Field(0.1, gt=0.0)
        styles_per_client: int = Field(1, ge=1)  # Table 10
        attention_dim: int = Field(30, ge=1)
        attention_scores: Literal["cosine", "dot", "scaled"] = "cosine"  # Eq. 6 vs the reference code
        style_samples: int | None = Field(None, ge=2)  # cap on samples used for Phi

    def build_model(self, num_classes):
        model = super().build_model(num_classes)
        p = self.p
        state = StyleState(shift=p.style, shift_p=p.shift_p, selection=p.selection, oversample=p.oversample,
                           oversample_size=p.oversample_size, explore=p.style, alpha=p.alpha,
                           detach_explored=p.detach_explored,
                           explore_p=p.explore_p, mix_alpha=p.mix_alpha)
        model.style_state = state
        # on a timm CNN: its last four feature_info stages and, for the highlighter, a head that only pools
        sites = feature_sites(model.body, need=("block1", "block2", "block3"))
        if p.attention and "pool" not in sites:
            try:
                feature_sites(model.body, need=("pool",))
            except ValueError as e:
                raise ValueError(f"the feature highlighter attends over the last feature map before global average "
                                 f"pooling; {e} (method.attention: false runs the style part alone)") from None
        channels = model.head.in_features
        insert_after(model.body, sites["block1"], StyleShift(state), StyleExplore(state))
        for b in ("block2", "block3"):
            insert_after(model.body, sites[b], StyleExplore(state))
        if p.attention:
            replace_module(model.body, sites["pool"], FeatureHighlighter(channels, state, p.attention_dim,
                                                                                p.attention_scores))
            model.head = nn.Linear(2 * channels, num_classes)
        return model

    # --------------------------------------------------------------- styles
    def _block1(self, model) -> nn.Module:
        return model.body.get_submodule(feature_sites(model.body)["block1"])

    @torch.no_grad()
    def compute_style(self, model, x_batches) -> np.ndarray:
        """Phi_n at the first block's output (style operations off)."""
        captured = []
        hook = self._block1(model)[0].register_forward_hook(lambda m, i, o: captured.append(channel_stats(o)))
        was = model.training
        model.eval()
        try:
            for x in x_batches:
                model.features(x)
        finally:
            hook.remove()
            model.train(was)
        mus = torch.cat([c[0] for c in captured]).cpu()
        sigs = torch.cat([c[1] for c in captured]).cpu()
        return style_information(mus, sigs)

    @classmethod
    def declare(cls, params) -> Declarations:
        # the attention-only ablation shares no style
        phases = (Phase.PREPARE, Phase.PERSONAL_EVAL) if params.style else (Phase.PERSONAL_EVAL,)
        return replace(super().declare(params), phases=phases)

    @property
    def phases(self) -> tuple[Phase, ...]:  # type: ignore[override]
        return self.declare(self.p).phases

    def round_prepare(self, model, ctx):
        """Phi_n with the round's global model, before any client trains."""
        idx = ctx.indices
        if self.p.style_samples and len(idx) > self.p.style_samples:
            idx = idx[torch.randperm(len(idx), generator=ctx.generator)[:self.p.style_samples].numpy()]
        bs = 256
        return {"style": self.compute_style(model, (ctx.fetch(idx[s:s + bs])[0] for s in range(0, len(idx), bs)))}

    def round_start(self, model, ctx):
        st: StyleState = model.style_state
        st.gen = ctx.generator
        st.received = np.asarray(ctx.payload["styles"]) if "styles" in ctx.payload else None

    def server_payloads(self, round, client_ids, server_state, rng, global_state, prepared):
        pool = {c: v["style"] for c, v in prepared.items() if "style" in v}
        if not pool:
            return {}
        return {c: {"styles": np.stack([pool[o] for o in others])}
                for c, others in assign_styles(client_ids, sorted(pool), self.p.styles_per_client, rng).items()
                if others}

    # ---------------------------------------------------------------- train
    def _with_partners(self, x, y, ctx):
        """Append, for each class with a single sample in the batch, one more
        sample of that class from the client's data (if it has one)."""
        if not self.p.attention or ctx.fetch is None:
            return x, y
        extra = []
        for c in torch.unique(y):
            if int((y == c).sum()) == 1:
                pool = np.flatnonzero(ctx.labels == int(c))
                if len(pool) >= 2:
                    extra.append(pool[int(torch.randint(len(pool), (1,), generator=ctx.generator))])
        if not extra:
            return x, y
        # a draw may hit the very sample already in the batch; it is still a same-class partner slot
        xe, ye = ctx.fetch(ctx.indices[np.array(extra)])
        return torch.cat([x, xe]), torch.cat([y, ye])

    def loss(self, model, x, y, ctx):
        st: StyleState = model.style_state
        x, y = self._with_partners(x, y, ctx)
        st.labels, st.fired = y, False
        hl = self._highlighter(model)
        if hl is not None:
            hl.partners = None
        feats_in = x
        # the highlighter needs partners for the final (possibly enlarged) batch: set them
        # from the labels as they stand when the last block is reached
        if hl is not None:
            handle = hl.register_forward_pre_hook(lambda m, inp: setattr(m, "partners", _partners(st.labels)))
        try:
            logits = model(feats_in)
        finally:
            if hl is not None:
                handle.remove()
        return F.cross_entropy(logits, st.labels)

    def _highlighter(self, model):
        for m in model.modules():
            if isinstance(m, FeatureHighlighter):
                return m
        return None


def _partners(labels: torch.Tensor) -> torch.Tensor:
    from rayfed_dg.models.style import same_class_partners

    partner, _ = same_class_partners(labels.cpu(), None)
    return partner.to(labels.device)


def assign_styles(clients: list[int], pool: list[int], per_client: int,
                  rng: np.random.Generator) -> dict[int, list[int]]:
    """Give each client up to ``per_client`` styles from ``pool`` (client ids
    with a known style): never its own, and no style to two clients while
    unused ones remain.  When the pool is exactly the clients and
    per_client = 1 this is a uniformly random derangement."""
    clients = list(clients)
    if per_client == 1 and sorted(pool) == sorted(clients) and len(clients) >= 2:
        while True:  # rejection sampling: a uniform derangement in e ~ 2.7 draws
            perm = rng.permutation(len(clients))
            if all(perm[i] != i for i in range(len(clients))):
                return {c: [clients[perm[i]]] for i, c in enumerate(clients)}
    out: dict[int, list[int]] = {c: [] for c in clients}
    used: set[int] = set()
    order = [clients[i] for i in rng.permutation(len(clients))]
    for _ in range(per_client):
        for c in order:
            fresh = [o for o in pool if o != c and o not in used and o not in out[c]]
            cand = fresh or [o for o in pool if o != c and o not in out[c]]
            if cand:
                pick = cand[int(rng.integers(len(cand)))]
                out[c].append(pick)
                used.add(pick)
    return out
