"""DSON in federated form: gPerXAN's Table 4 row "gFedAvg w/ DSON".

Seo, Suh, Kim, Kim, Han, Han, "Learning to Optimize Domain Specific
Normalization for Domain Generalization", ECCV 2020; evaluated in the
gPerXAN paper (Le et al., CVPR 2024, Sec. 4.4.1, Table 4) as one of the
normalization schemes that replace PerXAN in gPerXAN's framework: FedAvg
with the guiding regularizer.

* Normalization (``models/norms.py`` ``DSON``, DSON Eq. 3-5): mean and
  variance are mixtures of the batch and the instance statistics,
  mu = w_bn mu_bn + w_in mu_in, var = w_bn var_bn + w_in var_in, followed by
  one affine transform; (w_bn, w_in) is a learned softmax pair per layer.
* Domain specific: DSON keeps separate normalization layers (affine
  parameters, BN statistics, mixture weights) per source domain.  In FL the
  domain is the client, so every DSON tensor stays on the client
  (``local_keys``, ledger group ``dson_domain_specific``) and is never
  overwritten by the broadcast; convolutions and the classifier are averaged.
* Guiding regularizer (gPerXAN Eq. 3-4), as in the ``gperxan`` method:
  L = CE(h(g(x)), y) + lam * CE(h_g(g(x)), y) with h_g the round's global
  classifier, frozen.  ``lam: 0`` is plain FedAvg with DSON.

Choices: DSON itself replaces every BatchNorm (``placement: all``, the
default; gPerXAN does not say where its ablation put DSON); at test DSON
averages the predictions of all its domain-specific normalizations, but
gPerXAN's framework evaluates one global model whose local tensors are the
clients' average (Algorithm 1, line 12), so that is what the unseen target
sees here too, as for PerXAN.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from rayfed_dg.models import DSON, apply_norm, state_keys_of

from .base import Method, register_method
from .gperxan import GPerXAN


@register_method
class DSONMethod(GPerXAN):
    name = "dson"

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")
        lam: float = Field(0.5, ge=0.0, le=1.0)  # guiding regularizer (gPerXAN's lambda; 0: FedAvg w/ DSON)
        placement: str = "all"  # which BatchNorm layers become DSON (models/norms.py)
        personalize: bool = True  # the DSON layers are domain (client) specific

    def build_model(self, num_classes):
        model = Method.build_model(self, num_classes)  # pretrained BN values are loaded before surgery
        apply_norm(model, self.p.placement, "dson")
        return model

    def local_keys(self, model):
        return state_keys_of(model, (DSON,)) if self.p.personalize else set()

    def tensor_group(self, key, is_local):
        return "dson_domain_specific" if is_local else "shared"
