"""A method of your own, outside the package: FedAvg whose clients train on
label-smoothed targets (Szegedy et al., "Rethinking the Inception
Architecture for Computer Vision", CVPR 2016, Sec. 7).  Each client's loss
is the cross-entropy against q'(k) = (1 - eps) * delta(k, y) + eps / K
instead of the one-hot delta(k, y), which penalises confident logits on the
client's own domain; aggregation and every other hook stay FedAvg's.

A config loads it with ``plugins: [my_method]`` (this file in the current
directory or on PYTHONPATH) and runs it as ``method: {name: fedavg_ls}``.
"""
import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from rayfed_dg.methods import ClientContext, Method, register_method


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt key is a config error, as for the built-in methods
    smoothing: float = Field(0.1, ge=0.0, lt=1.0)  # eps


@register_method
class FedAvgLabelSmoothing(Method):
    name = "fedavg_ls"
    Params = Params

    def loss(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, ctx: ClientContext) -> torch.Tensor:
        # torch spreads eps over all K classes, the true one included: exactly q' above
        return F.cross_entropy(model(x), y, label_smoothing=self.p.smoothing)
