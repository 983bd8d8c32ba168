"""``tuning/slurm_sweep.sbatch`` end to end on a real Slurm on this machine.

Debian's slurm-wlm and munge (``.ci/run`` installs them): ``slurm_local.LocalSlurm``
starts munged, slurmctld and slurmd on loopback by process id, with one node
of this machine's CPUs and 2 declared GPUs (GRES ``gpu``).  The sbatch is
submitted as a user would, with the node count and resources overridden on
sbatch's command line; it starts a Ray head on the allocation (on a free
port), runs a 2-trial sweep on the embedded digits and leaves its trials
table on the shared path.  The GPUs Slurm allocated, the GPUs Ray offers, the
GPUs Tune saw and the GPUs each trial's placement group reserved must agree.
"""
import json
import os
import re
import secrets
import shutil
import socket
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import REPO, tiny_space
from slurm_local import LocalSlurm, missing

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

GPUS = 2  # per node, declared (training runs on the CPU: engine.device auto finds no CUDA)
CPUS = 2
# 8 workers per node share its 2 GPUs, 0.25 GPU each; a trial has 3 (one per source domain): both trials run at once
CPUS_PER_WORKER = 0.25


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _lines(log: str, prefix: str) -> list[str]:
    return [line[len(prefix):].strip() for line in log.splitlines() if line.startswith(prefix)]


@pytest.fixture
def slurm():
    if missing():
        pytest.skip(f"no local Slurm: {', '.join(missing())} not installed (apt-get install slurm-wlm munge)")
    if os.geteuid() != 0:
        pytest.skip("slurmd must run as root to launch jobs")
    if shutil.which("ray") is None:
        pytest.skip("the ray command is not on PATH")
    # a short folder: Ray's session sockets live under it and Unix socket paths are limited to 107 bytes
    folder = Path(tempfile.mkdtemp(prefix="rfslurm-", dir="/tmp"))
    s = LocalSlurm(folder, gpus=GPUS)
    s.start()
    try:
        yield s
    finally:
        s.stop()
        left = s.processes()
        shutil.rmtree(folder, ignore_errors=True)
        assert left == [], f"processes of the local Slurm or its job outlived it: {left}"


def test_sbatch_runs_the_sweep_on_the_gpus_it_asked_slurm_for(slurm, tmp_path):
    space = tiny_space(tmp_path / "tiny.yaml", "training.rounds=2", "evaluation.batch_size=512")
    token = slurm.dir / "ray_token"  # this Ray's own token, not ~/.ray's
    token.write_text(secrets.token_hex(32))
    log = tmp_path / "job.log"
    env = dict(os.environ)
    env.update({
        "SPACE": str(space), "STORAGE": str(tmp_path / "store"), "EXTRA": "--target colour --set engine.gpus_declared_only=true",
        "CPUS_PER_WORKER": str(CPUS_PER_WORKER), "RAY_PORT": str(_free_port()), "RAY_AUTH_TOKEN_PATH": str(token),
        # ports other Ray heads on this machine may hold: no dashboard, the agent on a free port
        "RAY_HEAD_ARGS": f"--include-dashboard=false --disable-usage-stats --temp-dir={slurm.dir / 'ray'}",
        "RAY_START_ARGS": f"--dashboard-agent-listen-port={_free_port()}"})
    env.pop("RAY_ADDRESS", None)
    t0 = time.monotonic()
    job, code = slurm.sbatch(["--nodes=1", f"--cpus-per-task={CPUS}", f"--gpus-per-task={GPUS}", "--time=10",
                              f"--output={log}", str(REPO / "tuning" / "slurm_sweep.sbatch")],
                             env=env, cwd=REPO, timeout=400)
    took = time.monotonic() - t0
    text = log.read_text() if log.exists() else ""
    info = slurm.job(job)
    print(f"\njob {job}: exit {code}, {took:.0f} s; {info.get('JobState')} "
          f"TresPerTask={info.get('TresPerTask')} JOB_GRES={info.get('JOB_GRES')}")
    print("\n".join(line for line in text.splitlines() if line.startswith(("slurm_", "Logical resource usage",
                                                                           "|", "chosen"))))
    assert code == 0 and info.get("JobState") == "COMPLETED", text[-4000:]

    # 1. Slurm allocated GPUS per node to the job, as asked on sbatch's command line
    assert info["NumNodes"] == "1" and info["TresPerTask"] == f"gres:gpu:{GPUS}", info
    assert re.fullmatch(rf"gpu:{GPUS}(\(IDX:[\d-]+\))?", info["JOB_GRES"]), info
    slurm_gpus = GPUS
    # 2. the sweep was told to use them: workers per node x GPU share per worker = the node's GPUs
    workers = _lines(text, "slurm_sweep: workers:")
    m = re.match(r"(\d+) per node, engine.num_cpus_per_worker=([\d.]+) engine.num_gpus_per_worker=([\d.]+)",
                 workers[0])
    per_node, cpus_per_worker, share = int(m[1]), float(m[2]), float(m[3])
    assert cpus_per_worker == CPUS_PER_WORKER and per_node == int(CPUS / CPUS_PER_WORKER)
    assert share > 0 and per_node * share == pytest.approx(GPUS)
    # 3. Ray offered exactly Slurm's GPUs (the job checks this before the sweep and stops otherwise)
    ray_line = _lines(text, "slurm_ray: ray cluster:")[-1]
    assert re.match(rf"1 node\(s\), {CPUS:g} CPU, {slurm_gpus:g} GPU\b", ray_line), ray_line
    # 4. Tune saw those GPUs and its trials used them
    usage = [tuple(map(float, u)) for u in
             re.findall(r"Logical resource usage: ([\d.]+)/([\d.]+) CPUs, ([\d.]+)/([\d.]+) GPUs", text)]
    assert usage and all(total_gpu == slurm_gpus and total_cpu == CPUS for _, total_cpu, _, total_gpu in usage)
    assert max(used_gpu for _, _, used_gpu, _ in usage) >= 3 * share - 1e-9  # at least one trial's workers
    # 5. each trial's placement group: one bundle per worker (3 source domains), each with the derived share
    pgs = [json.loads(p) for p in _lines(text, "slurm_ray: placement group")]
    assert len(pgs) == 2 and all(pg["placed"] for pg in pgs), pgs
    for pg in pgs:
        worker_bundles = [b for b in pg["bundles"] if b.get("CPU", 0) > 0 or b.get("GPU", 0) > 0]
        assert worker_bundles == [{"CPU": CPUS_PER_WORKER, "GPU": share}] * 3, pg
        assert pg["gpu"] == pytest.approx(3 * share)
    # the trials table on the shared path
    sweep = tmp_path / "store" / "tiny"
    rows = pq.read_table(sweep / "trials.parquet").to_pylist()
    print(json.dumps(rows, indent=None))
    assert sorted(r["method.lam"] for r in rows) == [0.0, 1.0]
    assert all(r["target"] == "colour" and r["rounds_run"] == 2 for r in rows)
    assert (sweep / "selection.md").is_file() and (sweep / "chosen_config.yaml").is_file()
    # the job ended its Ray: nothing it started outlives it (only the three daemons remain)
    deadline = time.monotonic() + 30
    while True:
        left = slurm.job_processes()
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert left == [], f"the job left processes behind: {left}"
    assert "slurm_sweep: ray stopped on 1 node(s)" in text
