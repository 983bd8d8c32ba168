"""``python -m rayfed_dg.cluster down`` stops exactly what ``up`` started.

``down`` used to end every process whose command line held ``ray`` and
``:6379`` (or the cluster's folder): a separate ``ray start --head
--port=6379`` lost 4 of its 5 processes to it.  Now ``up`` records the session
it starts Ray in and the processes in it; ``down`` ends those, what they
started (the autoscaler's worker nodes, every Ray worker) and nothing else.
Here two foreign processes carry exactly the marks the old ``down`` matched
(``ray`` and ``:6379``; a raylet-like command line naming the cluster's folder
and GCS address) and must outlive ``down``; a worker node the autoscaler adds
after ``up`` must not.
"""
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from conftest import REPO

from rayfed_dg.cluster import ADDRESS, PORT, LocalCluster, client_env, cluster_processes, read_record, stop_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

SLEEP = "import time; time.sleep(600)"


def _port_open() -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", PORT)) == 0


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_down_stops_what_up_started_and_nothing_else():
    if shutil.which("ray") is None:
        pytest.skip("the ray command is not on PATH")
    if _port_open():
        pytest.skip(f"port {PORT} is taken by another Ray head; the local cluster can only use {PORT}")
    folder = Path(tempfile.mkdtemp(prefix="rc", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    env = client_env()
    env["RAYFED_DG_CLUSTER_DIR"] = str(folder)
    cli = [sys.executable, "-m", "rayfed_dg.cluster"]
    foreign = [
        # what `ray start --head --port=6379` of someone else looks like to a pattern: ray and :6379
        subprocess.Popen([sys.executable, "-c", SLEEP, "ray", "start", "--head", "--address=127.0.0.1:6379"]),
        # a raylet-like command line naming this cluster's folder and GCS address, a title of a Ray worker
        subprocess.Popen([sys.executable, "-c", SLEEP, "raylet", f"--gcs-address={ADDRESS}",
                          f"--temp-dir={folder}", "ray::IDLE"]),
    ]
    try:
        up = subprocess.run([*cli, "up", "--config", str(REPO / "cluster-local.yaml")], env=env, cwd=REPO,
                            capture_output=True, text=True, timeout=300)
        assert up.returncode == 0, up.stderr[-2000:]
        rec = read_record(folder)
        assert rec and rec["processes"], "up recorded nothing"
        recorded = {pid for pid, _ in rec["processes"]}

        # a worker node the autoscaler starts later, for a one-GPU request (the head has no GPU)
        ask = ("import ray, time; from ray.autoscaler.sdk import request_resources; "
               f"ray.init(address='{ADDRESS}', logging_level='ERROR'); request_resources(bundles=[{{'GPU': 1}}]); "
               "t = time.monotonic()\n"
               "while ray.cluster_resources().get('GPU', 0) < 1 and time.monotonic() - t < 240: time.sleep(1)\n"
               "print('GPUS', ray.cluster_resources().get('GPU', 0))")
        r = subprocess.run([sys.executable, "-c", ask], env=env, capture_output=True, text=True, timeout=300)
        gpus = [float(line.split()[1]) for line in r.stdout.splitlines() if line.startswith("GPUS ")]
        assert r.returncode == 0 and gpus and gpus[0] >= 1, r.stdout[-1000:] + r.stderr[-2000:]
        cluster = LocalCluster(REPO / "cluster-local.yaml", temp_dir=folder)
        later = cluster.worker_raylets()
        assert later and not {p.pid for p in later} & recorded  # started after up, by the autoscaler

        ours = cluster_processes(folder)
        pids = {p.pid for p in ours}
        assert recorded <= pids | {pid for pid in recorded if not psutil.pid_exists(pid)}
        assert {p.pid for p in later} <= pids
        assert not pids & {f.pid for f in foreign}
        for f in foreign:  # what the old down matched, to show that the test would have caught it
            cmd = " ".join(psutil.Process(f.pid).cmdline())
            assert "ray" in cmd and ":6379" in cmd

        t0 = time.monotonic()
        down = subprocess.run([*cli, "down"], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
        took = time.monotonic() - t0
        assert down.returncode == 0, down.stderr[-2000:]
        assert down.stdout.startswith("stopped ") and int(down.stdout.split()[1]) >= len(ours)
        assert [p.pid for p in ours if _alive(p)] == []
        assert not _port_open()
        assert all(f.poll() is None for f in foreign), "down ended a process it did not start"
        assert read_record(folder) is None  # nothing left to stop: a second down is a no-op
        again = subprocess.run([*cli, "down"], env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
        assert again.returncode == 0 and "nothing stopped" in again.stdout
        print(f"\nup recorded {len(recorded)} processes; down stopped {down.stdout.split()[1]} (with the "
              f"autoscaler's worker node) in {took:.1f} s; the {len(foreign)} foreign processes live on")
    finally:
        stop_cluster(folder)  # a no-op once down has run
        for f in foreign:
            f.kill()
            f.wait(timeout=10)
        shutil.rmtree(folder, ignore_errors=True)
