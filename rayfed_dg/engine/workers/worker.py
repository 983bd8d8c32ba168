"""Worker actor: builds the model once and trains whichever clients it is given.

Clients are virtual.  A task carries everything a client is: its sample
indices, its persistent local state (from the server's client state store)
and its payloads; the worker keeps nothing between tasks except the model
buffers it overwrites at the start of each task.  A task is therefore safe to
repeat, which is what Ray's actor restarts and task retries need.

The data path: batches are gathered from the dataset's object-store views
and copied to the device (on CUDA through pinned host memory, without
blocking), or, with the dataset resident on the device
(``engine.data_on_device``), gathered there by index; then augmented and
normalised on the device.  Both give the same bits: the augmentation draws
on the CPU generator whatever the device (data/augment.py).

Every payload leaves a client through ``_release`` (engine/privacy/payloads.py):
a method's ``upload_payload`` and ``round_prepare`` results and a data
stage's released client phases, clipped and noised here when
``privacy.payloads`` names their group.
"""
from __future__ import annotations

import math
import os
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from rayfed_dg.config import EngineConfig, ExperimentConfig
from rayfed_dg.data.augment import augment
from rayfed_dg.engine.aggregation.exact import FixedSum, Partial
from rayfed_dg.engine.privacy.payloads import release
from rayfed_dg.engine.privacy.updates import clip_update
from rayfed_dg.engine.store.records import ClientTask, Fold
from rayfed_dg.methods import ClientContext, ClientUpdate, LocalResult, Method, Precision, build_method
from rayfed_dg.seeding import Stream, numpy_rng, seed_int, seed_torch, torch_generator
from rayfed_dg.stages import StageClient, build_stages
from rayfed_dg.utils import exit_quietly_on_sigterm

from .compiled import compile_steps
from .faults import OWN_FAULTS, DivergedError, InjectedFault, JobFailed


def run_each(items: Sequence[Any], fn: Callable[[Any], Any]) -> list[Any]:
    """The worker side of ``submit_many``: ``fn`` on each item; an item's own
    fault (``OWN_FAULTS``) becomes a ``JobFailed``, anything else is raised."""
    out: list[Any] = []
    for item in items:
        try:
            out.append(fn(item))
        except OWN_FAULTS as err:
            out.append(JobFailed(repr(err).splitlines()[0][:200]))
    return out


def resolve_device(device: str, num_gpus: float, declared_only: bool = False) -> torch.device:
    """The device a worker trains on.  A worker that was given GPUs trains on
    CUDA or stops the run saying why: never silently on the CPU, unless the
    GPUs are declared only (``engine.gpus_declared_only``: a rehearsal)."""
    wants = device == "cuda" or (device == "auto" and num_gpus > 0)
    if wants and torch.cuda.is_available():
        return torch.device("cuda")
    if wants and not (declared_only and device == "auto"):
        from rayfed_dg.errors import EngineError

        fix = ("engine.num_gpus_per_worker: 0 (or engine.gpus_declared_only: true on a rehearsal cluster whose "
               "GPUs are declared)") if num_gpus > 0 else "engine.device: auto (the CPU, without GPUs)"
        raise EngineError(f"engine.num_gpus_per_worker={num_gpus:g} (engine.device={device}) but this worker sees "
                          f"no usable CUDA: {cuda_report()}; install a driver that supports it, or set {fix}")
    return torch.device("cpu")


def cuda_report() -> str:
    """What this process's torch sees of CUDA, in one line: its build, the
    driver (nvidia-smi), the visible devices."""
    import shutil
    import subprocess

    driver = "no NVIDIA driver found (nvidia-smi missing)"
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            driver = f"driver {out.stdout.strip().splitlines()[0]}" if out.returncode == 0 and out.stdout.strip() \
                else f"nvidia-smi failed ({(out.stderr or out.stdout).strip()[:120]})"
        except (OSError, subprocess.SubprocessError) as e:
            driver = f"nvidia-smi failed ({e})"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return (f"torch {torch.__version__} built for CUDA {torch.version.cuda or 'none (a CPU build)'}, "
            f"{driver}, CUDA_VISIBLE_DEVICES={visible if visible is not None else 'unset'}, "
            f"torch.cuda.device_count()={torch.cuda.device_count()}")


# share of the GPU memory a worker may use (its num_gpus_per_worker fraction) that the decoded uint8 dataset
# may take to be kept on the device under engine.data_on_device: auto; the rest is the model's and the batches'
RESIDENT_SHARE = 0.25


def resident_budget(total_memory: int, num_gpus: float) -> float:
    """Bytes the dataset may take on a GPU of ``total_memory`` bytes for a
    worker given ``num_gpus`` of it (0: GPUs not declared, the whole device)."""
    return RESIDENT_SHARE * total_memory * (min(1.0, num_gpus) if num_gpus > 0 else 1.0)


def to_numpy_state(sd: dict[str, torch.Tensor], keys, copy: bool = True) -> dict[str, np.ndarray]:
    """``copy=False`` returns views of the model's tensors: only for values that
    Ray serializes at once (a task's return value)."""
    out = {k: sd[k].detach().cpu().numpy() for k in keys}
    return {k: v.copy() for k, v in out.items()} if copy else out


def configure_cuda(e: EngineConfig) -> None:
    """Apply ``engine``'s CUDA settings.  They are process-wide: ``bind``
    sets them every time, so a federation never inherits the previous one's."""
    if e.num_gpus_per_worker > 0:
        # fractional num_gpus caps nothing in Ray: bound memory ourselves
        torch.cuda.set_per_process_memory_fraction(min(1.0, e.num_gpus_per_worker))
    torch.backends.cuda.matmul.allow_tf32 = e.tf32
    torch.backends.cudnn.allow_tf32 = e.tf32
    torch.backends.cudnn.benchmark = e.cudnn_benchmark
    torch.backends.cudnn.deterministic = not e.cudnn_benchmark


def batch_positions(n: int, batch_size: int, steps: int | None, epochs: int,
                    gen: torch.Generator) -> Iterator[np.ndarray]:
    """The positions among ``n`` samples of each seeded mini-batch: ``steps``
    batches, or ``epochs`` passes when ``steps`` is None.  Lazy, so that the
    permutations and the batches' augmentations draw on ``gen`` in turn."""
    done = 0
    epoch = 0
    while True:
        order = torch.randperm(n, generator=gen).numpy()
        for s in range(0, n, batch_size):
            chunk = order[s:s + batch_size]
            if len(chunk) < 2 and n >= 2:  # BatchNorm needs two samples
                continue
            yield chunk
            done += 1
            if steps is not None and done >= steps:
                return
        epoch += 1
        if steps is None and epoch >= epochs:
            return


def mixed_arrays(images: np.ndarray, labels: np.ndarray, indices: np.ndarray, extra: dict,
                 chunk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The host arrays (images, labels) of ``chunk``: positions below
    ``len(indices)`` are the client's own samples, the rest are rows of the
    data stage's additions ``extra``."""
    nb = len(indices)
    base = chunk < nb
    raw = np.empty((len(chunk),) + images.shape[1:], np.uint8)
    lab = np.empty(len(chunk), np.int64)
    raw[base] = images[indices[chunk[base]]]
    lab[base] = labels[indices[chunk[base]]]
    raw[~base] = extra["images"][chunk[~base] - nb]
    lab[~base] = extra["labels"][chunk[~base] - nb]
    return raw, lab


def fetched(extra: Any) -> dict | None:
    """A task's ``extra`` arrays: an ObjectRef (in an actor) read zero-copy, or a plain dict or None."""
    if extra is None or isinstance(extra, dict):
        return extra
    import ray

    return ray.get(extra)


def stage_arrays(stage_data: dict) -> dict:
    """Data stages' shared arrays: ObjectRefs (in an actor) read zero-copy, or plain dicts (in tests)."""
    if not stage_data or all(isinstance(v, dict) for v in stage_data.values()):
        return dict(stage_data)
    import ray

    return {k: v if isinstance(v, dict) else ray.get(v) for k, v in stage_data.items()}


def inject_fault(cfg: ExperimentConfig, task: ClientTask) -> None:
    """Fail ``task`` when ``engine.fault_clients`` names its client or its
    seeded draw falls under ``task.fault_p``: raise, or kill the process."""
    e, cid, rnd = cfg.engine, task.client, task.round
    if cid in e.fault_clients or (task.fault_p > 0 and numpy_rng(
            cfg.training.seed, Stream.FAULT, rnd, cid, task.attempt).random() < task.fault_p):
        if e.fault_mode == "kill":
            os._exit(1)  # a dead worker process, as after an OOM kill
        raise InjectedFault(f"injected fault in client {cid} round {rnd} attempt {task.attempt}")


def checked_loss(method: Method, res: Any, precision: Precision, cid: int, rnd: int) -> float:
    """The loss of ``local_train``'s result ``res``, once it keeps the method
    contract (a ``LocalResult``, trained at ``training.precision``) and the
    loss is finite."""
    if not isinstance(res, LocalResult):
        raise TypeError(f"method {method.name}: local_train returned {type(res).__name__}; in method contract "
                        "v2 it returns a LocalResult (train_steps returns one)")
    if precision.dtype is not None and res.steps and not precision.autocasts:
        raise TypeError(f"method {method.name}: local_train ignored training.precision="
                        f"{precision.name}: pass precision=ctx.precision to train_steps (or refuse the "
                        "precision in its check)")
    loss = float(res.loss)
    if not math.isfinite(loss):
        raise DivergedError(f"client {cid} round {rnd}: local training diverged (loss {loss}); "
                            "lower training.lr or the method's loss weights")
    return loss


class PartialSums:
    """One process's partial sums of its clients' uploads (``Fold``), by
    (federation, round, epoch), each with the clients folded into it."""

    def __init__(self) -> None:
        self.sums: dict[tuple[int, int, int], tuple[list[int], FixedSum]] = {}

    def fold(self, to: Fold, client: int, upload: dict[str, torch.Tensor]) -> None:
        """Add ``client``'s upload to the partial sum of ``to``'s (federation,
        round, epoch); an older one of that federation was abandoned by the
        server (``take``) and is dropped."""
        key = (to.federation, to.round, to.epoch)
        self._drop_others(to.federation, key)
        part = self.sums.setdefault(key, ([], FixedSum(to.window)))
        try:
            part[1].add(to.weight, upload)
        except BaseException:  # half folded: the whole partial is lost, and the server re-runs its clients
            del self.sums[key]
            raise
        part[0].append(client)

    def absorb(self, other: PartialSums) -> None:
        """Add ``other``'s partial sums (a batched group's, folded aside until
        every upload of the group succeeded), as ``fold`` would have."""
        for key, (clients, part) in other.sums.items():
            self._drop_others(key[0], key)
            if key in self.sums:
                self.sums[key][0].extend(clients)
                self.sums[key][1].merge(part)
            else:
                self.sums[key] = (clients, part)

    def take(self, federation: int, round: int, epoch: int) -> Partial | None:
        """The partial sum of (federation, round, epoch), handed over once
        (None: none was folded, or the process was restarted)."""
        part = self.sums.pop((federation, round, epoch), None)
        self._drop_others(federation)
        return None if part is None else Partial(sorted(part[0]), part[1].pack())

    def _drop_others(self, federation: int, keep: tuple[int, int, int] | None = None) -> None:
        """Drop ``federation``'s partial sums but ``keep``: ones the server has abandoned."""
        for k in [k for k in self.sums if k[0] == federation and k != keep]:
            del self.sums[k]


class ClientRunner:
    """Model, data and method hooks of one worker; used by the actor and by
    tests that want the exact client computation without Ray."""

    def __init__(self, cfg: ExperimentConfig, images: np.ndarray, labels: np.ndarray, num_classes: int,
                 num_clients: int):
        self.images = images  # zero-copy view of the object store
        self.labels = labels
        self.resident: tuple[torch.Tensor, torch.Tensor] | None = None  # (images, labels) on the device
        self.partials = PartialSums()
        self.bind(cfg, num_classes, num_clients)

    def bind(self, cfg: ExperimentConfig, num_classes: int, num_clients: int) -> None:
        """Build one federation's model, method and stages: what a fresh
        process would build, so that a worker serving federation after
        federation computes exactly what a new one would."""
        self.cfg = cfg  # validated once, in the driver
        e = self.cfg.engine
        self.threads = max(1, int(e.num_cpus_per_worker))
        torch.set_num_threads(self.threads)
        self.device = resolve_device(e.device, e.num_gpus_per_worker, e.gpus_declared_only)
        if self.device.type == "cuda":
            configure_cuda(e)
        self._place_data()
        d = self.cfg.data
        self.mean = torch.tensor(d.mean, dtype=torch.float32).view(1, 3, 1, 1).to(self.device)
        self.std = torch.tensor(d.std, dtype=torch.float32).view(1, 3, 1, 1).to(self.device)
        self.method = build_method(self.cfg, num_clients)
        torch.manual_seed(seed_int(self.cfg.training.seed, Stream.INIT))
        self.model: nn.Module = self.method.build_model(num_classes).to(self.device)
        self._state = self.model.state_dict()  # tensors share storage with the model
        self._global: tuple[list, list[np.ndarray], dict[str, torch.Tensor]] | None = None
        self.local_keys = self.method.local_keys(self.model)
        self.private_keys = self.method.private_keys(self.model)
        self.upload_keys = [k for k in self._state if k not in self.private_keys]
        self.stages = build_stages(self.cfg)
        self.compile_seconds = compile_steps(self.model, e.compile, self.device, self.cfg.training.batch_size,
                                             d.resolution, self._precision())  # engine.compile: None when off

    def _place_data(self) -> None:
        """Keep the dataset on the device, or not (``engine.data_on_device``);
        a worker serving federation after federation copies it once."""
        want, dev = self.cfg.engine.data_on_device, self.device
        if want == "auto":
            want = dev.type == "cuda" and self.images.nbytes <= resident_budget(
                torch.cuda.get_device_properties(dev).total_memory, self.cfg.engine.num_gpus_per_worker)
        if not want:
            self.resident = None
        elif self.resident is None or self.resident[0].device != dev:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # read-only object-store views: only ever read
                self.resident = (torch.as_tensor(self.images).to(dev), torch.as_tensor(self.labels).to(dev))

    def _host_to_device(self, a: np.ndarray, idx: np.ndarray | None = None) -> torch.Tensor:
        """``a`` (its rows ``idx``, when given) on the device.  On CUDA through
        pinned host memory, copied without blocking (the caching host
        allocator keeps a pinned buffer until its copy is done)."""
        t = torch.from_numpy(np.ascontiguousarray(a if idx is None else a[idx]))
        return t.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else t

    # -------------------------------------------------------------- helpers
    def _load(self, arrays: Mapping[str, np.ndarray | torch.Tensor]) -> None:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only object-store views are copied, never written
            for k, v in arrays.items():
                self._state[k].copy_(v if isinstance(v, torch.Tensor) else torch.as_tensor(np.asarray(v)))

    def _on_device(self, state: dict[str, np.ndarray]) -> Mapping[str, np.ndarray | torch.Tensor]:
        """The round's global ``state`` as tensors on the device, copied there
        once per worker and round: every task of a round reads the same
        read-only object-store buffer, which the copy kept here holds on to,
        so arrays at the same addresses are the same model.  Writable arrays
        (a caller's own, which it may change) are loaded as they are."""
        if not all(isinstance(v, np.ndarray) and not v.flags.writeable for v in state.values()):
            return state
        key = [(k, v.__array_interface__["data"][0], v.shape, v.dtype.str) for k, v in state.items()]
        if self._global is None or self._global[0] != key:
            self._global = None  # the previous round's copy goes first (device memory)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # read-only: only ever read
                self._global = (key, list(state.values()), {k: torch.as_tensor(v).to(self.device)
                                                            for k, v in state.items()})
        return self._global[2]

    def _tensors(self, idx: np.ndarray, gen: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The dataset's samples ``idx`` as a batch (``_batch``), gathered on
        the device when the dataset is resident there, else from the host."""
        if self.resident is not None:
            images, labels = self.resident
            at = torch.from_numpy(np.ascontiguousarray(idx, dtype=np.int64)).to(self.device, non_blocking=True)
            return self._batch(images.index_select(0, at), labels.index_select(0, at), gen)
        return self._batch(self._host_to_device(self.images, idx), self._host_to_device(self.labels, idx), gen)

    def _to_tensors(self, raw: np.ndarray, labels: np.ndarray, gen: torch.Generator | None):
        """A batch of host arrays (``_batch``)."""
        return self._batch(self._host_to_device(raw), self._host_to_device(labels), gen)

    def _batch(self, raw: torch.Tensor, y: torch.Tensor, gen: torch.Generator | None):
        """uint8 images (N, D, D, 3) on the device as the model's batch:
        augmented when ``gen`` is given (training; every random draw from it,
        data/augment.py), else only resized from the decode size to the
        resolution; then normalised."""
        x = raw.permute(0, 3, 1, 2).float().div_(255.0)
        x = augment(x, self.cfg.data.augment, gen, self.cfg.data.resolution)
        # channels-last, as the permuted uint8 batch already is without a crop: conv layers on the CPU
        # run faster on it than on a crop's NCHW output (bench/augment_cost.py measures it)
        x = x.contiguous(memory_format=torch.channels_last)
        x = (x - self.mean) / self.std
        return x, y

    def batches(self, indices: np.ndarray, gen: torch.Generator,
                extra: dict | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Seeded mini-batches over the client's samples; ``extra`` holds
        data-stage additions (CCST's stylized copies) as arrays."""
        t = self.cfg.training
        n = len(indices) + (0 if extra is None else len(extra["labels"]))
        for chunk in batch_positions(n, t.batch_size, t.local_steps, t.local_epochs, gen):
            if extra is None:
                yield self._tensors(indices[chunk], gen)
            else:
                yield self._to_tensors(*mixed_arrays(self.images, self.labels, indices, extra, chunk), gen)

    # ---------------------------------------------------------------- tasks
    def _client(self, task: ClientTask, global_state: dict[str, np.ndarray], stream: Stream) -> ClientContext:
        """Load the round's global model and the client's local state; seed
        everything the client does in this phase from (seed, stream, round, client)."""
        seed = self.cfg.training.seed
        self._load(self._on_device({k: v for k, v in global_state.items() if k not in self.local_keys}))
        self._load(task.local_state)
        seed_torch(seed_int(seed, stream, task.round, task.client), self.device)
        gen = torch_generator(seed, stream, task.round, task.client)
        return ClientContext(client_id=task.client, round=task.round, device=self.device, generator=gen,
                             num_samples=len(task.indices), payload=task.payload, indices=task.indices,
                             labels=self.labels[task.indices], fetch=lambda idx: self._tensors(idx, None),
                             val_indices=task.val_indices, stage_data=stage_arrays(task.stage_data),
                             pixel_mean=self.mean, pixel_std=self.std, precision=self._precision())

    def _precision(self) -> Precision:
        """``training.precision`` on this device, fresh (a new fp16 scaler) per task."""
        return Precision(self.cfg.training.precision, self.device.type)

    def _release(self, payload: dict[str, np.ndarray], declared: dict[str, str], round: int, client: int,
                 owner: str) -> dict[str, np.ndarray]:
        """What of ``payload`` leaves the client: ``privacy.payloads``' groups clipped and noised here."""
        return release(payload, declared, self.cfg.privacy, self.cfg.training.seed, round, client, owner)

    def prepare(self, task: ClientTask, global_state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The method's per-round client phase, before any client trains."""
        ctx = self._client(task, global_state, Stream.PREPARE)
        out = {k: np.asarray(v) for k, v in self.method.round_prepare(self.model, ctx).items()}
        return self._release(out, self.method.shared_payloads, task.round, task.client, f"method {self.method.name}")

    def train(self, task: ClientTask, global_state: dict[str, np.ndarray], views: bool = False) -> ClientUpdate:
        """One client's local training.  ``views``: the update holds views of
        the model's tensors, for a result that Ray serializes before the
        model is touched again (saves a model-sized copy)."""
        t0 = time.perf_counter()
        inject_fault(self.cfg, task)
        ctx = self._client(task, global_state, Stream.TRAIN)
        extra = fetched(task.extra)
        self.method.round_start(self.model, ctx)
        res = self.method.local_train(self.model, lambda: self.batches(task.indices, ctx.generator, extra), ctx)
        return self.upload(task, ctx, res, global_state, extra, t0, views)

    def upload(self, task: ClientTask, ctx: ClientContext, res: LocalResult, global_state: dict[str, np.ndarray],
               extra: dict | None, t0: float, views: bool = False) -> ClientUpdate:
        """The update of a client whose trained state the model holds (``train``,
        and each client of a batched group): folded into this process's
        partial sum, or returned whole; its seconds counted from ``t0``."""
        cid, rnd = task.client, task.round
        loss = checked_loss(self.method, res, ctx.precision, cid, rnd)
        sd = self.model.state_dict()
        out = ClientUpdate(
            client=cid,
            num_samples=len(task.indices) + (0 if extra is None else len(extra["labels"])),
            update={}, private=to_numpy_state(sd, sorted(self.private_keys)),
            payload=self._release(self.method.upload_payload(self.model, ctx), self.method.shared_payloads, rnd, cid,
                                  f"method {self.method.name}"),
            train_loss=loss, seconds=time.perf_counter() - t0, stats=dict(res.stats), steps=res.steps,
            samples_stepped=res.samples, sizes={k: sd[k].nelement() * sd[k].element_size() for k in self.upload_keys})
        upload = {k: sd[k] for k in self.upload_keys}
        if task.dp_clip is not None:  # DP-FedAvg folds the clipped update instead (the server refuses it unfolded)
            upload, norm = clip_update(upload, global_state, task.dp_clip)
            out.unclipped = norm <= task.dp_clip
        if task.fold is None:
            out.update = to_numpy_state(sd, self.upload_keys, copy=not views)
        else:  # last, once nothing can fail: a task that raised folded nothing, and a retry folds once
            self.fold(task.fold, cid, upload)
            out.update = to_numpy_state(sd, [k for k in self.upload_keys if k in self.local_keys])  # the client store's
        return out

    def fold(self, to: Fold, client: int, upload: dict[str, torch.Tensor]) -> None:
        """Add ``client``'s upload to this process's partial sum of ``to``'s (``PartialSums.fold``)."""
        self.partials.fold(to, client, upload)

    def take_partial(self, federation: int, round: int, epoch: int) -> Partial | None:
        """This process's partial sum of (federation, round, epoch), handed
        over once (None: it folded none, or its process was restarted)."""
        return self.partials.take(federation, round, epoch)

    def run_client(self, client: int, round: int, indices: np.ndarray, global_state: dict[str, np.ndarray],
                   local_state: dict | None = None, payload: dict | None = None, *, extra: dict | None = None,
                   val_indices: np.ndarray | None = None, stage_data: dict | None = None) -> ClientUpdate:
        """One client's training task in this process, without Ray (tests, benches)."""
        return self.train(ClientTask(client=client, round=round, indices=np.asarray(indices),
                                     local_state=local_state or {}, payload=payload or {}, extra=extra,
                                     val_indices=val_indices, stage_data=stage_data or {}), global_state)

    @torch.no_grad()
    def evaluate(self, global_state: dict[str, np.ndarray], indices: np.ndarray,
                 batch_size: int, local_state: dict[str, np.ndarray] | None = None) -> tuple[int, float, int]:
        """(correct, summed cross-entropy, samples) of the global model, or of a
        client's own model when its ``local_state`` is given."""
        self._load(self._on_device(global_state))
        if local_state:
            self._load(local_state)
        self.model.eval()
        precision = self._precision()
        correct, loss_sum = 0, 0.0
        for s in range(0, len(indices), batch_size):
            x, y = self._tensors(indices[s:s + batch_size], None)
            with precision.autocast():
                logits = self.model(x)
                loss_sum += float(F.cross_entropy(logits, y, reduction="sum"))
            correct += int((logits.argmax(1) == y).sum())
        return correct, loss_sum, len(indices)

    def run_stage(self, stage: int, phase: str, client_id: int, indices: np.ndarray, args: dict,
                  releases: str | None = None):
        """A data stage's client half: its client phase ``phase`` (the name
        of the ``stage``-th configured stage's method that ``StageHost.map`` was handed);
        ``releases``: the payload group its result leaves the client as (round 0)."""
        view = StageClient(images=self.images, labels=self.labels, device=self.device, threads=self.threads,
                           seed=self.cfg.training.seed, resolution=self.cfg.data.resolution)
        st = self.stages[stage]
        out = getattr(st, phase)(view, client_id, indices, **args)
        if releases is None:
            return out
        return self._release({releases: out}, st.shared_payloads, 0, client_id, f"stage {st.name}")[releases]


class Worker(ClientRunner):
    """The Ray actor (started by ``host.EngineHost``), serving every federation
    of an experiment in turn.

    The dataset's references, and the federation each task names, come from
    the experiment's ``DataSource`` actor and are resolved here (the dataset
    as zero-copy views of the object store).  A worker builds a federation's
    model and method on its first task of that federation; a restarted
    worker (``max_restarts``) starts with none and builds it again on its
    next task, so a task is always safe to repeat."""

    def __init__(self, data_source: str):
        import ray

        exit_quietly_on_sigterm()  # Ray's SIGTERM inside a finaliser: a traceback at the end of a run, else
        # the dataset's references come from the named data source actor, not from the constructor's
        # arguments: a restarted worker re-runs this and asks again, and Ray need not keep references or
        # handles passed to a constructor alive for restarts (it warns about them)
        self._source = ray.get_actor(data_source)
        refs: list = ray.get(self._source.refs.remote())
        self.images, self.labels = ray.get(refs)
        self.resident = None
        self.federation: int | None = None
        self.partials = PartialSums()
        # torch.optim's first optimizer imports torch._dynamo (about 2 s of CPU): a start-up cost of the
        # process, paid here while the pool starts rather than inside round 1's time
        import torch._dynamo  # noqa: F401

    def _serve(self, federation: int) -> None:
        if self.federation != federation:
            import ray

            spec: Any = ray.get(self._source.federation.remote(federation))  # (config, classes, clients)
            self.federation = None  # half-built until bind returns
            self.bind(*spec)
            self.federation = federation

    def train_in(self, federation: int, task: ClientTask, global_state: dict[str, np.ndarray]) -> ClientUpdate:
        self._serve(federation)
        return self.train(task, global_state, views=True)

    def train_many_in(self, federation: int, tasks: list[ClientTask], global_state: dict[str, np.ndarray]) -> list:
        """Several clients in one Ray task (``dispatch.py``: small jobs travel
        together); each update is a copy but the last one's."""
        self._serve(federation)
        last = len(tasks) - 1
        return run_each(list(enumerate(tasks)), lambda it: self.train(it[1], global_state, views=it[0] == last))

    def train_group_in(self, federation: int, tasks: list[ClientTask], global_state: dict[str, np.ndarray]) -> list:
        """A group of clients trained together (``engine.client_batching``, ``batched.py``)."""
        from .batched import train_group

        self._serve(federation)
        return train_group(self, tasks, global_state, views=True)

    def prepare_in(self, federation: int, task: ClientTask, global_state: dict[str, np.ndarray]):
        self._serve(federation)
        return self.prepare(task, global_state)

    def evaluate_in(self, federation: int, *args):
        self._serve(federation)
        return self.evaluate(*args)

    def run_stage_in(self, federation: int, *args):
        self._serve(federation)
        return self.run_stage(*args)

    def ping(self) -> int:
        return os.getpid()

    def node(self) -> str:
        """The Ray node this worker runs on (the experiment's placement records)."""
        import ray

        return ray.get_runtime_context().get_node_id()
