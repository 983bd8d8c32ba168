"""The cluster path on a real multi-node Ray cluster on this machine.

A head on port 6379 with the autoscaler's fake multi-node provider
(``cluster-local.yaml``: the head has no GPU; ``gpu_worker`` nodes with one
declared GPU each are added on demand, at most 4).  Drivers run in
subprocesses, as a user's would; the cluster is started and stopped by
process id (``rayfed_dg.cluster.LocalCluster``), never with ``ray stop``.
"""
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import pyarrow.parquet as pq
import pytest
import yaml
from conftest import REPO, tiny_space

from rayfed_dg.cluster import ADDRESS, PORT, SLOW_PROVIDER, LocalCluster, client_env

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

TINY = ["--set", "compare=null", "--set", "data.resolution=16", "--set", "model.width=8",
        "--set", "evaluation.batch_size=512"]
ON_CLUSTER = ["--set", f"engine.ray_address={ADDRESS}", "--set", "engine.num_gpus_per_worker=0.25",
              "--set", "engine.num_cpus_per_worker=0.5", "--set", "engine.gpus_declared_only=true"]


# the slow-replacement node loss: 5 min scaled down, 15-17 min with the defaults, here (a shared 2-core machine)
SLOW = pytest.mark.skipif(os.environ.get("RAYFED_DG_SLOW_CLUSTER") != "1",
                          reason="a slow replacement node takes minutes to rehearse: RAYFED_DG_SLOW_CLUSTER=1 runs it")


def _port_free() -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", PORT)) != 0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if shutil.which("ray") is None:
        pytest.skip("the ray command is not on PATH")
    if not _port_free():
        pytest.skip(f"port {PORT} is taken by another Ray head; the fake provider's nodes can only join 6379")
    c = LocalCluster(REPO / "cluster-local.yaml", temp_dir=tmp_path_factory.mktemp("rc"))
    c.start()
    c.wait_until_up()
    yield c
    c.stop()


def _run(args, timeout=600, **kw):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env=client_env(), **kw)


def _wait_for_round_1(proc, run_dir, timeout: float) -> None:
    """Until the run in ``run_dir`` has saved round 1's checkpoint (the node is killed after it)."""
    first = run_dir / "checkpoints" / "colour" / "round_00001.json"
    deadline = time.monotonic() + timeout
    while not first.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before round 1 was saved"
        time.sleep(0.2)


def _kill_tree(raylet) -> None:
    """A worker node lost: its raylet and everything it started, killed at once."""
    import psutil

    for p in raylet.children(recursive=True) + [raylet]:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def _against_a_clean_run(common, tmp_path):
    """(metrics rows of the run in tmp_path/lost, those of the same run on local Ray, the lost run's summary)."""
    clean = _run([*common, "--set", "engine.num_cpus_per_worker=1", "--run-dir", str(tmp_path / "clean")])
    assert clean.returncode == 0, clean.stderr[-2000:]
    lost = pq.read_table(tmp_path / "lost" / "metrics.parquet").to_pylist()
    clean_rows = pq.read_table(tmp_path / "clean" / "metrics.parquet").to_pylist()
    return lost, clean_rows, json.loads((tmp_path / "lost" / "summary.json").read_text())["targets"]["colour"]


def _gpus() -> float:
    r = _run(["-c", f"import ray; ray.init(address='{ADDRESS}', logging_level='ERROR'); "
                    "print(ray.cluster_resources().get('GPU', 0))"], timeout=120)
    return float(r.stdout.strip().splitlines()[-1])


def test_a_pool_the_cluster_can_never_fit_fails_within_the_timeout(cluster, tmp_path):
    t0 = time.monotonic()
    r = _run(["-m", "rayfed_dg", "run", "configs/quickstart.yaml", "--target", "colour", *TINY, *ON_CLUSTER,
              "--set", "engine.num_gpus_per_worker=2", "--set", "engine.scale_up_timeout_s=15",
              "--run-dir", str(tmp_path / "never")])
    took = time.monotonic() - t0
    errors = [line for line in r.stderr.splitlines() if line.startswith("rayfed-dg: error")]
    assert r.returncode == 2, r.stderr[-2000:]
    assert len(errors) == 1 and "did not provide" in errors[0] and "max_workers" in errors[0], r.stderr[-1500:]
    assert "asked the autoscaler" in r.stderr  # it did ask before giving up
    assert took < 15 + 90 and not (tmp_path / "never").exists()


def test_sweep_scales_up_from_zero_on_fractional_gpus_and_matches_local_ray(cluster, tmp_path):
    space = tiny_space(tmp_path / "tiny.yaml", "training.rounds=2", "engine.num_workers=4")
    assert _gpus() == 0  # the head has no GPU and no worker node runs yet
    r = _run(["tune.py", "--space", str(space), "--target", "colour", "--storage", str(tmp_path / "cluster"),
              "--set", f"engine.ray_address={ADDRESS}", "--set", "engine.num_gpus_per_worker=0.25",
              "--set", "engine.num_cpus_per_worker=0.5", "--set", "engine.gpus_declared_only=true"], timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "asked the autoscaler" in r.stderr
    # GPU nodes were launched for the sweep; how many is the autoscaler's call (it has launched a third node
    # for 2 trials x 4 workers x 0.25 GPU when demand arrived while nodes were still starting)
    assert _gpus() >= 1
    local = _run(["tune.py", "--space", str(space), "--target", "colour", "--storage", str(tmp_path / "local"),
                  "--set", "engine.num_cpus_per_worker=0.5"], timeout=900)
    assert local.returncode == 0, local.stderr[-3000:]
    cols = ["method.lam", "target", "selected_round", "selected_src_val", "selected_target_acc", "rounds_run"]
    key = lambda p: sorted(tuple(row[c] for c in cols) for row in pq.read_table(p).to_pylist())  # noqa: E731
    assert key(tmp_path / "cluster" / "tiny" / "trials.parquet") == key(tmp_path / "local" / "tiny" / "trials.parquet")


def test_losing_a_worker_node_mid_run_gives_the_clean_result_with_retries(cluster, tmp_path):

    # the engine's defaults (max_task_retries, worker_restart_timeout_s, checkpoint_every) on the module's cluster,
    # where fake nodes start in seconds and the sweep above may have left a spare node: the lost workers come back
    # well within the plain wait.  A replacement slower than that, with no spare: the RAYFED_DG_SLOW_CLUSTER tests
    common = ["-m", "rayfed_dg", "run", "configs/quickstart.yaml", "--target", "colour", *TINY, "--no-progress",
              "--set", "method.name=fedavg", "--set", "training.rounds=10"]
    proc = subprocess.Popen([sys.executable, *common, *ON_CLUSTER, "--run-dir", str(tmp_path / "lost")],
                            cwd=REPO, env=client_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_round_1(proc, tmp_path / "lost", 300)
    # the worker node that hosts most of the pool's workers: kill its raylet and everything it started.  Round
    # 1 waits for the autoscaler; later rounds take about a second each: find it and kill it at once
    hosts = [(sum(" ".join(ch.cmdline()).startswith("ray::Worker") for ch in p.children(recursive=True)), p)
             for p in cluster.worker_raylets()]
    n_workers, victim = max(hosts, key=lambda h: h[0])
    assert n_workers >= 1
    _kill_tree(victim)
    killed_at = time.monotonic()
    out, err = proc.communicate(timeout=600)
    print(f"\nthe run ended {time.monotonic() - killed_at:.1f} s after the node was killed")
    assert proc.returncode == 0, err[-3000:]
    lost, clean_rows, summary = _against_a_clean_run(common, tmp_path)
    print(f"node killed: its raylet and {n_workers} workers; tasks retried {summary['tasks_retried']}, "
          f"re-run uncharged {summary['tasks_rerun']}; mean seconds per round (node killed): "
          f"{summary['mean_seconds_per_round']:.1f}")
    print("round | split | domain | accuracy (node killed) | accuracy (clean, local)")
    for a, b in zip(lost, clean_rows):
        print(f"{a['round']} | {a['split']} | {a['domain']} | {a['accuracy']:.4f} | {b['accuracy']:.4f}")
    assert lost == clean_rows
    # the node's tasks ran again: charged when one ran alone on its worker, uncharged when it shared it (pool.py)
    assert summary["tasks_retried"] + summary["tasks_rerun"] >= 1 and summary["clients_dropped"] == 0


def _slow_cluster(tmp_path, launch_delay_s: float, env: dict | None = None) -> LocalCluster:
    """A cluster of its own (a free port): ``cluster-local.yaml`` with every
    launch ``launch_delay_s`` long (``SlowFakeProvider``) and at most one
    worker node, so that no spare node can take a lost node's workers."""
    cfg = yaml.safe_load((REPO / "cluster-local.yaml").read_text())
    cfg["provider"] = {**cfg["provider"], "type": "external", "module": SLOW_PROVIDER, "launch_delay_s": launch_delay_s}
    cfg["max_workers"] = cfg["available_node_types"]["gpu_worker"]["max_workers"] = 1
    (tmp_path / "slow.yaml").write_text(yaml.safe_dump(cfg))
    with socket.socket() as s:  # a free port outside Ray's worker ports (10002-19999)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # Ray's socket paths must stay under 107 bytes: a short folder of its own (removed by the caller)
    return LocalCluster(tmp_path / "slow.yaml", temp_dir=tempfile.mkdtemp(prefix="rdg", dir="/tmp"), port=port,
                        env=env)


def _lose_the_node_and_compare(cluster: LocalCluster, tmp_path, sets: list[str]) -> str:
    """Run 10 rounds on ``cluster``, kill its worker node (its raylet and
    every worker on it) once round 1 is saved, and check the run's metrics
    against a clean local run's; returns the run's stderr."""

    common = ["-m", "rayfed_dg", "run", "configs/quickstart.yaml", "--target", "colour", *TINY, "--no-progress",
              "--set", "method.name=fedavg", "--set", "training.rounds=10"]
    on = [a.replace(ADDRESS, cluster.address) for a in ON_CLUSTER]
    proc = subprocess.Popen([sys.executable, *common, *on, *sets, "--run-dir", str(tmp_path / "lost")],
                            cwd=REPO, env=client_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_round_1(proc, tmp_path / "lost", 900)
    # the one worker node holds the whole pool: no spare node, so every worker waits for its replacement.  Later
    # rounds take about a second each: kill it at once
    (victim,) = cluster.worker_raylets()
    n_workers = sum(" ".join(ch.cmdline()).startswith("ray::Worker") for ch in victim.children(recursive=True))
    assert n_workers >= 1
    _kill_tree(victim)
    killed_at = time.monotonic()
    out, err = proc.communicate(timeout=3600)
    waited = time.monotonic() - killed_at
    assert proc.returncode == 0, err[-3000:]
    lost, clean_rows, summary = _against_a_clean_run(common, tmp_path)
    print(f"\nthe run ended {waited:.1f} s after the node (its raylet and {n_workers} workers) was killed; tasks "
          f"retried {summary['tasks_retried']}, re-run uncharged {summary['tasks_rerun']}")
    for line in err.splitlines():
        if "waiting for" in line and "lost worker" in line:
            print(line.strip())
    print("round | split | domain | accuracy (node killed) | accuracy (clean, local)")
    for a, b in zip(lost, clean_rows):
        print(f"{a['round']} | {a['split']} | {a['domain']} | {a['accuracy']:.4f} | {b['accuracy']:.4f}")
    assert lost == clean_rows
    # the node's tasks ran again: charged when one ran alone on its worker, uncharged when it shared it (pool.py)
    assert summary["tasks_retried"] + summary["tasks_rerun"] >= 1 and summary["clients_dropped"] == 0
    return err


@SLOW
def test_losing_the_only_worker_node_waits_for_its_slow_replacement_and_gives_the_clean_result(tmp_path):
    """Scaled down: the time constants of the real case (below) shrunk.  The
    replacement node takes 45 s to launch, once the autoscaler has noticed the
    loss (10 s without a heartbeat here, Ray's failure detection in seconds):
    far past the pool's 40 s wait for a lost worker, so the run survives only
    because the wait follows the autoscaler's launch.  The pool's first
    waiting line, 40 s after the loss, falls inside the launch (about 15-55 s
    after it, and the node's start after that: 10-20 s on a busy machine)."""
    if shutil.which("ray") is None:
        pytest.skip("the ray command is not on PATH")
    fast_death = {"AUTOSCALER_HEARTBEAT_TIMEOUT_S": "10", "RAY_health_check_period_ms": "1000",
                  "RAY_health_check_failure_threshold": "3"}
    c = _slow_cluster(tmp_path, launch_delay_s=45, env=fast_death)
    try:
        with c:
            err = _lose_the_node_and_compare(c, tmp_path, ["--set", "engine.worker_restart_timeout_s=40"])
    finally:
        shutil.rmtree(c.temp_dir, ignore_errors=True)
    assert "the autoscaler is launching 1 x gpu_worker" in err, err[-3000:]


@SLOW
def test_losing_the_only_worker_node_with_the_defaults_survives_a_replacement_slower_than_300_s(tmp_path):
    """The engine's defaults (max_task_retries, worker_restart_timeout_s=300,
    worker_replacement_timeout_s, checkpoint_every) and Ray's (the
    autoscaler's 30 s heartbeat timeout), a replacement node that launches in
    330 s, and no spare node: the pool's workers come back about 6 min
    after the loss, and the numbers are the clean run's."""
    c = _slow_cluster(tmp_path, launch_delay_s=330)
    try:
        with c:
            err = _lose_the_node_and_compare(c, tmp_path, [])
    finally:
        shutil.rmtree(c.temp_dir, ignore_errors=True)
    assert "the autoscaler is launching 1 x gpu_worker" in err, err[-3000:]


def test_local_and_cloud_cluster_configs_differ_only_in_the_provider():
    cloud = yaml.safe_load((REPO / "cluster.yaml").read_text())
    local = yaml.safe_load((REPO / "cluster-local.yaml").read_text())
    for key in ("cluster_name", "max_workers", "upscaling_speed", "idle_timeout_minutes", "head_node_type"):
        assert cloud[key] == local[key], key
    assert set(cloud["available_node_types"]) == set(local["available_node_types"])
    for name, node in cloud["available_node_types"].items():
        other = local["available_node_types"][name]
        assert node.get("min_workers") == other.get("min_workers") and node.get("max_workers") == other.get(
            "max_workers"), name
        if name != cloud["head_node_type"]:  # the head's resources are detected on the cloud
            assert {k: v for k, v in node["resources"].items() if k in ("CPU", "GPU")} == \
                   {k: v for k, v in other["resources"].items() if k in ("CPU", "GPU")}, name
    assert cloud["provider"]["type"] == "aws" and local["provider"]["type"] == "fake_multinode"
