"""What client-batched training (``engine.client_batching``,
``engine/workers/batched.py``) accepts: the method, the settings and the
model, each refused in one line before anything trains."""
from __future__ import annotations

import torch.nn as nn

from rayfed_dg.errors import ConfigError

from .base import get_method_class

# dropout that draws per channel or shifts its output: its draws cannot be replayed per client as plain
# ``nn.Dropout``'s elementwise mask is (batched.py)
_RANDOM = (nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def check_batching(cfg) -> None:
    """Raise ``ConfigError`` for a config that client batching cannot train."""
    e = cfg.engine
    if not e.client_batching:
        return
    for m in [cfg.method] + list(cfg.compare or []):
        if not get_method_class(m.name).declare(m.params).batchable:
            raise ConfigError(f"engine.client_batching: method {m.name} does not declare batchable (it trains its "
                              "clients its own way); set engine.client_batching: false for it")
    if cfg.training.precision != "fp32":
        raise ConfigError(f"engine.client_batching: training.precision={cfg.training.precision} is not batched; "
                          "use training.precision: fp32 or engine.client_batching: false")
    if cfg.server.mode != "sync":
        raise ConfigError(f"engine.client_batching: server.mode={cfg.server.mode} trains clients from different "
                          "model versions; batching needs server.mode: sync")
    if e.compile != "off":
        raise ConfigError(f"engine.client_batching: engine.compile={e.compile} compiles the one-client step, not a "
                          "group's vmapped one; set engine.compile: off or engine.client_batching: false")
    if cfg.active_stages():
        raise ConfigError("engine.client_batching: data stages add samples to clients, which batching does not "
                          "stack; drop stages: or set engine.client_batching: false")


def model_refusal(model: nn.Module) -> str | None:
    """Why ``model`` cannot train client-batched, in one line (None: it can)."""
    for name, m in model.named_modules():
        if isinstance(m, _RANDOM) or "drop" in type(m).__name__.lower() and type(m) is not nn.Dropout:
            return (f"engine.client_batching: the model's {name or 'root'} ({type(m).__name__}) draws random "
                    "numbers that batching cannot replay per client; only nn.Dropout is batched")
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.momentum is None and m.track_running_stats:
            return (f"engine.client_batching: the model's {name} is a BatchNorm with momentum None (a cumulative "
                    "average), which vmap cannot batch; set a momentum or engine.client_batching: false")
    return None


def check_model(model: nn.Module) -> None:
    why = model_refusal(model)
    if why is not None:
        raise ConfigError(why)
