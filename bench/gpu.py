"""The engine on a GPU, measured in one run.

On the CUDA GPU torch finds, prints:

1. ``client``: per-client orchestration.  A model whose training costs
   almost nothing on a GPU (conv net of width 4 at 16 px, one local step of
   batch 2), ``--clients`` clients a round, one worker holding the GPU:
   (round wall time - the clients' own seconds) / clients, between the
   first round (process warm-up) and the last (evaluation).
2. ``shapes``: seconds per round of the engine against a bare PyTorch loop
   doing the same work in this process on the same GPU, in each precision
   of ``--precisions`` (``training.precision``; the bare loop autocasts the
   same way, with a gradient scaler for fp16), for the two shapes of
   ``bench/engine_overhead.py`` (imported from there, ``SHAPES``), with the
   GPU's mean utilisation during each (``nvidia-smi`` sampled every 100 ms)
   and the engine's orchestration per client.  Both sides keep the dataset
   on the GPU (the engine by ``engine.data_on_device: auto``) and use the
   same TF32 / cuDNN settings (``--tf32``, ``--cudnn-benchmark``).  The
   engine runs each shape's federations on one set of actors, as an
   experiment does.  Each line also gives images per second (a round's
   training images / its seconds).  Then the compiled-steps column: the
   engine again with ``engine.compile`` in each mode of ``--compile``
   (``default``, ``reduce-overhead``: CUDA graphs, GPU only, skipped on the
   CPU), its s/round and images/s between the first round (where each
   worker compiles, once per federation) and the last, each worker's
   compile seconds, and the ratio to the eager engine over the same rounds.
   In fp32, the client-batching line: the engine with
   ``engine.client_batching``, its images/s and its ratios to the
   sequential engine and to the bare loop (``--no-batching`` leaves it out).
3. ``table``: the quickstart table (``configs/quickstart.yaml``: 2 methods x
   4 targets) with ``engine.concurrent_federations`` 1 and auto, each a
   ``rayfed-dg run`` of its own: wall times, their ratio, and whether the
   two metrics tables are identical.  Skipped, saying so, where the config
   has no such key.

Where no GPU is present it prints "no GPU available: ..." and exits 0.
``--device cpu --tiny`` runs every part on the CPU at toy sizes: a smoke
test that the code runs, whose figures mean nothing.

One invocation with the defaults is sized for 10 minutes on one H100; each
part prints its own elapsed time, and ``--parts``, ``--precisions``,
``--rounds``, ``--repeat`` and ``--clients`` trim it.

    python bench/gpu.py [--parts client,shapes,table] [--precisions fp32,bf16,fp16] [--rounds 5] [--repeat 2]
                        [--workers 1] [--clients 300] [--tf32] [--cudnn-benchmark] [--device cuda|cpu] [--tiny]
                        [--compile default,reduce-overhead|off] [--no-batching]
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]


# bench/engine_overhead.py's two shapes: the ResNet one, and pfl-research's CIFAR10 cross-device
# benchmark with its 2-conv CNN (model.arch simple_cnn)
sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_overhead import SHAPES, Shape  # noqa: E402

TINY = {"resnet": Shape("tiny: 6 clients, 3/round, ResNet-18 32px, 16 samples/client, batch 8", 6, 16, 3,
                        SHAPES["resnet"].config[:1] + ("training.batch_size=8", "training.lr=0.01")),
        "cross_device": Shape("tiny: 40 clients, 10/round, 10 samples/client, batch 5", 40, 10, 10,
                              SHAPES["cross_device"].config[:1] + SHAPES["cross_device"].config[2:]
                              + ("training.batch_size=5",))}


def _cfg(*overrides):
    from rayfed_dg.config import load_config

    return load_config(None, ["data.resolution=32", "training.local_epochs=1", "evaluation.every=0",
                              "output.save_best_checkpoint=false", "output.tensorboard=false", *overrides])


def make_data(n_clients: int, per_client: int, res: int, seed: int = 0):
    """Random pixels and labels: ``n_clients`` clients of ``per_client`` samples, then 64 for evaluation."""
    rng = np.random.default_rng(seed)
    n = n_clients * per_client + 64
    images = rng.integers(0, 256, size=(n, res, res, 3), dtype=np.uint8)
    labels = rng.integers(0, 10, size=n).astype(np.int64)
    clients = [np.arange(i * per_client, (i + 1) * per_client) for i in range(n_clients)]
    return images, labels, clients, np.arange(n - 64, n)


# ----------------------------------------------------------------- measuring

class GpuUtilisation:
    """Mean GPU utilisation (%) over a ``with`` block: ``nvidia-smi`` samples
    every 100 ms in a subprocess.  ``mean`` is None without nvidia-smi (or on the CPU)."""

    def __init__(self, device: torch.device):
        self.on = device.type == "cuda" and shutil.which("nvidia-smi") is not None
        self.mean: float | None = None

    def __enter__(self):
        if self.on:
            gpu = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
            self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                                          "-lms", "100", "-i", gpu], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                         text=True)
        return self

    def __exit__(self, *exc):
        if self.on:
            self.proc.terminate()
            out, _ = self.proc.communicate(timeout=10)
            samples = [float(s) for s in out.split() if s.strip().isdigit()]
            self.mean = float(np.mean(samples)) if samples else None

    def text(self) -> str:
        return "GPU n/a" if self.mean is None else f"GPU {self.mean:.0f} %"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def set_flags(tf32: bool, cudnn_benchmark: bool) -> None:
    """This process's CUDA flags, as a worker sets them from engine.tf32 / engine.cudnn_benchmark."""
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cudnn.benchmark = cudnn_benchmark
    torch.backends.cudnn.deterministic = not cudnn_benchmark


def _batcher(cfg, images: np.ndarray, labels: np.ndarray, device: torch.device):
    """The bare loop's batches: the dataset on the device, a batch gathered, normalised, channels-last."""
    mean = torch.tensor(cfg.data.mean, device=device).view(1, 3, 1, 1)
    std = torch.tensor(cfg.data.std, device=device).view(1, 3, 1, 1)
    x_all, y_all = torch.from_numpy(images).to(device), torch.from_numpy(labels).to(device)

    def batch(idx: np.ndarray):
        at = torch.from_numpy(idx).to(device)
        x = x_all.index_select(0, at).permute(0, 3, 1, 2).float().div_(255.0)
        return ((x - mean) / std).contiguous(memory_format=torch.channels_last), y_all.index_select(0, at)

    return batch


def _step(loss: torch.Tensor, opt: torch.optim.Optimizer, scaler) -> None:
    opt.zero_grad(set_to_none=True)
    if scaler is None:
        loss.backward()
        opt.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


def bare_loop(cfg, images, labels, clients, val_idx, device: torch.device) -> list[float]:
    """The engine's work without the engine: sample clients, load the global
    weights, train each client with a fresh SGD (autocast in
    ``training.precision``, a gradient scaler for fp16), average by sample
    count, evaluate once at the end.  The dataset sits on the device.
    Seconds per round."""
    from rayfed_dg.models import build_backbone
    from rayfed_dg.seeding import Stream, sample_clients, seed_int, seed_torch, torch_generator

    t, m = cfg.training, cfg.model
    dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[t.precision]
    torch.manual_seed(seed_int(t.seed, Stream.INIT))
    model = build_backbone(m.arch, 10, m.pretrained, m.width).to(device)
    global_sd = {k: v.clone() for k, v in model.state_dict().items()}
    batch = _batcher(cfg, images, labels, device)

    def forward(x, y):
        if dtype is None:
            return F.cross_entropy(model(x), y)
        with torch.autocast(device.type, dtype=dtype):
            return F.cross_entropy(model(x), y)

    times = []
    for r in range(1, t.rounds + 1):
        _sync(device)
        t0 = time.perf_counter()
        sampled = sample_clients(t.seed, r, len(clients), t.clients_per_round)
        acc = {k: torch.zeros_like(v, dtype=torch.float32) for k, v in global_sd.items()}
        wsum = 0.0
        for cid in sampled:
            model.load_state_dict(global_sd)
            model.train()
            opt = torch.optim.SGD(model.parameters(), lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay)
            scaler = torch.amp.GradScaler(device.type) if t.precision == "fp16" else None
            gen = torch_generator(t.seed, Stream.TRAIN, r, cid)
            seed_torch(seed_int(t.seed, Stream.TRAIN, r, cid), device)
            idx = clients[cid][torch.randperm(len(clients[cid]), generator=gen).numpy()]
            for s in range(0, len(idx), t.batch_size):
                _step(forward(*batch(idx[s:s + t.batch_size])), opt, scaler)
            w = float(len(clients[cid]))
            for k, v in model.state_dict().items():
                acc[k].add_(v.float(), alpha=w)
            wsum += w
        global_sd = {k: (acc[k] / wsum).to(v.dtype) if v.is_floating_point() else (acc[k] / wsum).round().to(v.dtype)
                     for k, v in global_sd.items()}
        if r == t.rounds:
            model.load_state_dict(global_sd)
            model.eval()
            with torch.no_grad():
                x, y = batch(val_idx)
                float(forward(x, y))
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times


def engine_run(cfg, host, refs, clients, val_idx):
    """(seconds per round, each round's summed client seconds) of one federation on ``host``."""
    from rayfed_dg.data.protocol import FederatedSplit
    from rayfed_dg.engine import run_federation

    split = FederatedSplit(target="t", clients=clients, client_domains=["d"] * len(clients),
                           val={"d": val_idx[:32]}, test={"t": val_idx[32:]})
    res = run_federation(cfg, split, refs[0], refs[1], 10, progress=False, host=host)
    own = [0.0] * len(res.seconds_per_round)
    for c in res.clients:
        own[c["round"] - 1] += c["seconds"]
    return res.seconds_per_round, own


def _middle(rounds: int, n: int) -> list[int]:
    """Indices of the rounds between each repetition's first (warm-up) and last (evaluation)."""
    return [i for i in range(n) if 0 < i % rounds < rounds - 1] or list(range(n))


def _fmt(xs) -> str:
    return ", ".join(f"{x:.3f}" for x in xs)


# --------------------------------------------------------------------- parts

def engine_overrides(args, workers: int) -> list[str]:
    gpu = args.device == "cuda"
    return [f"engine.num_workers={workers}", f"engine.num_cpus_per_worker={args.cpus / workers:g}",
            f"engine.num_gpus_per_worker={1 / workers if gpu else 0:g}", f"engine.device={args.device}",
            f"engine.tf32={str(args.tf32).lower()}", f"engine.cudnn_benchmark={str(args.cudnn_benchmark).lower()}"]


def part_client(args, device) -> None:
    import ray

    from rayfed_dg.engine.running.host import EngineHost

    n, rounds = (30, 3) if args.tiny else (args.clients, 4)
    cfg = _cfg("model.arch=convnet", "model.width=4", "data.resolution=16", "training.local_steps=1",
               "training.batch_size=2", f"training.rounds={rounds}", f"training.clients_per_round={n}",
               *engine_overrides(args, 1))
    images, labels, clients, val_idx = make_data(n, 4, 16)
    refs = [ray.put(images), ray.put(labels)]
    host = EngineHost(cfg.engine, refs, 1)
    try:
        with GpuUtilisation(device) as util:
            walls, own = engine_run(cfg, host, refs, clients, val_idx)
    finally:
        host.close()
    mid = _middle(rounds, rounds)
    orch = [(walls[i] - own[i]) / n for i in mid]
    print(f"[client] {n} clients/round, conv net width 4 at 16 px, 1 step of batch 2, 1 worker: orchestration "
          f"{1000 * float(np.mean(orch)):.2f} ms/client (rounds {mid[0] + 1}-{mid[-1] + 1}: "
          f"{_fmt(1000 * np.array(orch))}), the clients' own {1000 * float(np.mean([own[i] for i in mid])) / n:.2f} "
          f"ms/client; {util.text()}")


def part_shapes(args, device) -> None:
    import ray

    from rayfed_dg.engine.running.host import EngineHost

    shapes = TINY if args.tiny else SHAPES
    rounds = 3 if args.tiny else args.rounds
    for name, shape in shapes.items():
        images, labels, clients, val_idx = make_data(shape.clients, shape.per_client, 32)
        refs = [ray.put(images), ray.put(labels)]
        base = [*shape.config, f"training.rounds={rounds}",
                f"training.clients_per_round={shape.per_round}", *engine_overrides(args, args.workers)]
        host = EngineHost(_cfg(*base).engine, refs, args.workers)
        try:
            for precision in args.precisions.split(","):
                cfg = _cfg(*base, f"training.precision={precision}")
                out: dict[str, list[float]] = {"bare": [], "engine": [], "own": []}
                util: dict[str, list[float]] = {"bare": [], "engine": []}
                for _ in range(1 if args.tiny else args.repeat):  # interleaved, so machine noise hits both alike
                    with GpuUtilisation(device) as u:
                        out["bare"] += bare_loop(cfg, images, labels, clients, val_idx, device)
                    util["bare"] += [] if u.mean is None else [u.mean]
                    with GpuUtilisation(device) as u:
                        walls, own = engine_run(cfg, host, refs, clients, val_idx)
                    out["engine"] += walls
                    out["own"] += own
                    util["engine"] += [] if u.mean is None else [u.mean]
                report(f"{name} {precision}", shape, cfg, out, util, rounds, args.workers)
                compiled_column(args, device, f"{name} {precision}", shape, [*base, f"training.precision={precision}"],
                                host, refs, (clients, val_idx), out["engine"][:rounds])
                if args.batching and precision == "fp32":  # client batching refuses the reduced precisions
                    batching_column(f"{name} {precision}", shape, [*base, "engine.client_batching=true"], host,
                                    refs, (clients, val_idx), out["engine"][:rounds], out["bare"][:rounds])
        finally:
            host.close()


def images_per_s(shape: Shape, seconds: float) -> float:
    """A round's training images (one local epoch of each sampled client) per second."""
    return shape.per_round * shape.per_client / seconds


def worker_compile_seconds(host) -> list[float | None]:
    """Each worker's ``compile_seconds`` (engine/workers/compiled.py) of the federation it bound last."""
    import ray

    return ray.get([w.__ray_call__.remote(lambda self: getattr(self, "compile_seconds", None)) for w in host.workers])


def compiled_column(args, device, tag: str, shape: Shape, sets: list[str], host, refs, data,
                    eager: list[float]) -> None:
    """The engine (config ``sets``) with ``engine.compile`` in each mode of ``--compile``, against the eager engine's
    ``eager`` rounds (its first repetition), between the first and last rounds."""
    rounds = len(eager)
    mid = _middle(rounds, rounds)
    base = float(np.mean([eager[i] for i in mid]))
    for mode in [m for m in args.compile.split(",") if m != "off"]:
        if mode == "reduce-overhead" and device.type != "cuda":
            print(f"[{tag}] engine compile={mode}: skipped (CUDA graphs: GPU workers only; the config refuses it "
                  "on the CPU)")
            continue
        with GpuUtilisation(device) as u:
            walls, _ = engine_run(_cfg(*sets, f"engine.compile={mode}"), host, refs, *data)
        comp = float(np.mean([walls[i] for i in mid]))
        secs = ", ".join("n/a" if x is None else f"{x:.1f}" for x in worker_compile_seconds(host))
        print(f"[{tag}] engine compile={mode} s/round: {comp:.3f}, {images_per_s(shape, comp):.0f} images/s "
              f"({u.text()}; rounds {_fmt(walls)}); compile per worker {secs} s (in round 1); ratio compiled / "
              f"eager engine {comp / base:.3f} (eager {images_per_s(shape, base):.0f} images/s), rounds "
              f"{mid[0] + 1}-{mid[-1] + 1}")


def report(tag: str, shape: Shape, cfg, out, util, rounds: int, workers: int) -> None:
    bare, eng = float(np.mean(out["bare"])), float(np.mean(out["engine"]))
    gpu = {k: f"GPU {np.mean(v):.0f} %" if v else "GPU n/a" for k, v in util.items()}
    print(f"[{tag}] {shape.label} ({cfg.model.arch}), {rounds} rounds, {workers} worker(s)")
    print(f"[{tag}] bare loop s/round: {bare:.3f}, {images_per_s(shape, bare):.0f} images/s ({gpu['bare']}; "
          f"rounds {_fmt(out['bare'])})")
    print(f"[{tag}] engine    s/round: {eng:.3f}, {images_per_s(shape, eng):.0f} images/s ({gpu['engine']}; "
          f"rounds {_fmt(out['engine'])})")
    mid = _middle(rounds, len(out["engine"]))
    steady_b = float(np.mean([out["bare"][i] for i in mid]))
    steady_e = float(np.mean([out["engine"][i] for i in mid]))
    orch = [(workers * out["engine"][i] - out["own"][i]) / shape.per_round for i in mid]
    print(f"[{tag}] ratio engine / bare: {eng / bare:.3f}; between first and last rounds {steady_e / steady_b:.3f}; "
          f"engine orchestration {1000 * float(np.mean(orch)):.2f} ms/client (workers x wall - own, / clients)")


def part_table(args, key: str = "engine.concurrent_federations", values: tuple[str, ...] = ("1", "auto")) -> None:
    from rayfed_dg.config import EngineConfig

    if key.split(".")[1] not in EngineConfig.model_fields:
        print(f"[table] skipped: this checkout's config has no {key} (concurrent federations)")
        return
    sets = [f"engine.device={args.device}",
            f"engine.num_gpus_per_worker={args.table_gpus if args.device == 'cuda' else 0:g}"]
    if args.tiny:
        sets += ["training.rounds=1", "data.resolution=16", "model.width=8"]
    walls, tables = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for v in values:
            run_dir = Path(tmp) / f"run-{v}"
            cmd = [sys.executable, "-m", "rayfed_dg", "run", str(REPO / "configs" / "quickstart.yaml"), "--no-progress",
                   "--run-dir", str(run_dir), "--set", f"{key}={v}", "--set", "output.tensorboard=false",
                   *[a for s in sets for a in ("--set", s)]]
            t0 = time.perf_counter()
            done = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True)
            walls[v] = time.perf_counter() - t0
            if done.returncode:
                print(f"[table] {key}={v} failed (exit {done.returncode}): {done.stderr.strip()[-400:]}")
                return
            import rayfed_dg

            tables[v] = rayfed_dg.load(run_dir).metrics
    first, *rest = values
    rows = {v: t.sort_values(list(t.columns)).reset_index(drop=True) for v, t in tables.items()}  # any run order
    same = all(rows[v].equals(rows[first]) for v in rest)
    print(f"[table] quickstart ({' '.join(sets)}): " + ", ".join(f"{key}={v} {walls[v]:.1f} s" for v in values)
          + "; " + ", ".join(f"ratio {first} / {v}: {walls[first] / walls[v]:.2f}" for v in rest)
          + f"; metrics tables identical: {same} ({len(tables[first])} rows)")


def batching_column(tag: str, shape: Shape, sets: list[str], host, refs, data, eager: list[float],
                    bare: list[float]) -> None:
    """The engine with ``engine.client_batching`` against the eager engine's and the bare loop's ``eager`` and
    ``bare`` rounds (their first repetition), between the first and last rounds."""
    mid = _middle(len(eager), len(eager))
    mean = lambda xs: float(np.mean([xs[i] for i in mid]))  # noqa: E731
    walls, _ = engine_run(_cfg(*sets), host, refs, *data)
    got = mean(walls)
    print(f"[{tag}] engine client_batching s/round: {got:.3f}, {images_per_s(shape, got):.0f} images/s (rounds "
          f"{_fmt(walls)}); ratio sequential engine / batched {mean(eager) / got:.3f}, bare loop / batched "
          f"{mean(bare) / got:.3f}, rounds {mid[0] + 1}-{mid[-1] + 1}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="client,shapes,table")
    ap.add_argument("--precisions", default="fp32,bf16,fp16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=2, help="interleaved repetitions of bare loop and engine")
    ap.add_argument("--workers", type=int, default=1, help="engine workers sharing the GPU (shapes)")
    ap.add_argument("--clients", type=int, default=300, help="clients a round in the per-client part")
    ap.add_argument("--cpus", type=float, default=None, help="CPUs for Ray and the workers (default: all, up to 8)")
    ap.add_argument("--table-gpus", type=float, default=0.125, help="engine.num_gpus_per_worker of the table part")
    ap.add_argument("--tf32", action="store_true", help="engine.tf32 (and the same in the bare loop)")
    ap.add_argument("--cudnn-benchmark", action="store_true", help="engine.cudnn_benchmark (and in the bare loop)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tiny", action="store_true", help="toy sizes: a smoke test of the code path")
    ap.add_argument("--compile", default="default,reduce-overhead",
                    help="engine.compile modes of the compiled-steps column (shapes); off: none")
    ap.add_argument("--no-batching", dest="batching", action="store_false",
                    help="leave out the client-batching line (engine.client_batching, fp32 only)")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        from rayfed_dg.engine.workers.worker import cuda_report

        print(f"no GPU available: {cuda_report()}; nothing measured (--device cpu --tiny runs the code on the CPU)")
        return
    args.cpus = args.cpus or float(min(8, os.cpu_count() or 1))
    device = torch.device(args.device)
    torch.set_num_threads(max(1, int(args.cpus / args.workers)))  # the bare loop gets a worker's threads
    set_flags(args.tf32, args.cudnn_benchmark)
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        print(f"GPU: {p.name}, {p.total_memory / 2 ** 30:.1f} GiB; torch {torch.__version__}, "
              f"CUDA {torch.version.cuda}; {args.cpus:g} CPUs for Ray; tf32 {args.tf32}, "
              f"cudnn_benchmark {args.cudnn_benchmark}")
    else:
        print(f"device: CPU ({args.cpus:g} CPUs for Ray){'; toy sizes' if args.tiny else ''}: "
              "a smoke test, not a GPU figure")
    import ray

    from rayfed_dg.config import EngineConfig

    parts = args.parts.split(",")
    ray.init(num_cpus=int(args.cpus), num_gpus=1 if device.type == "cuda" else 0, include_dashboard=False,
             logging_level="ERROR", log_to_driver=False,
             _system_config={"worker_niceness": EngineConfig().worker_niceness})
    try:
        for name, fn in (("client", part_client), ("shapes", part_shapes)):
            if name in parts:
                t0 = time.perf_counter()
                fn(args, device)
                print(f"[{name}] part took {time.perf_counter() - t0:.0f} s")
    finally:
        ray.shutdown()
    if "table" in parts:  # its runs start Ray of their own
        t0 = time.perf_counter()
        part_table(args)
        print(f"[table] part took {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
