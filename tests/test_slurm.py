"""``tuning/slurm_sweep.sbatch`` and ``tuning/slurm_run.sbatch`` end to end on a real two-node Slurm on this machine.

Debian's slurm-wlm and munge (``.ci/run`` installs them): ``slurm_local.LocalSlurm``
starts munged, slurmctld and two slurmds by process id, each slurmd in a network
namespace of its own (its own address, hostname and ``/etc/hosts``), each node
with 2 CPUs and 4 declared GPUs (GRES ``gpu``).  The scripts are submitted as a
user would, with the node count and resources overridden on sbatch's command
line; they start a Ray head on the first node (on a free port) and a Ray
worker on each other node.

* The sweep on both nodes, ``--exclusive`` with 2 of each node's 4 GPUs asked:
  the GPUs Slurm's steps got, the GPUs Ray offers, the GPUs Tune saw and the
  GPUs each trial's placement group reserved agree; one trial runs on each node;
  the trials table is on the shared path.
* One ``rayfed-dg run`` stopped by SIGTERM to every process of the job (what a
  time limit sends: ``scancel --signal=TERM --full``) exits 130 printing the
  command that continues it, and that command finishes the run from its checkpoint.
* Opt-in (``RAYFED_DG_SLURM_TIME_LIMIT=1``, about 4 minutes): a sweep past a real
  ``--time=2`` limit, then the printed resume command, to a complete trials table.
"""
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import REPO, tiny_space
from slurm_local import LocalSlurm, NoNetworkNamespaces, missing

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

GPUS = 4  # declared per node (training runs on the CPU: engine.device auto finds no CUDA)
ASKED = 2  # --gpus-per-node of the jobs, with --exclusive: Slurm gives the job all 4, each step 2
CPUS = 2
# 4 workers per node share its 2 GPUs, 0.5 GPU each; a trial has 3 (one per source domain): one trial fits a node
CPUS_PER_WORKER = 0.5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _lines(log: str, prefix: str) -> list[str]:
    return [line[len(prefix):].strip() for line in log.splitlines() if line.startswith(prefix)]


@pytest.fixture(scope="module")
def slurm(request):
    if missing(nodes=2):
        pytest.skip(f"no local Slurm: {', '.join(missing(nodes=2))} not installed "
                    "(apt-get install slurm-wlm munge iproute2)")
    if os.geteuid() != 0:
        pytest.skip("slurmd must run as root to launch jobs")
    if shutil.which("ray") is None:
        pytest.skip("the ray command is not on PATH")
    # a short folder: Ray's session sockets live under it and Unix socket paths are limited to 107 bytes
    folder = Path(tempfile.mkdtemp(prefix="rfslurm-", dir="/tmp"))
    s = LocalSlurm(folder, gpus=GPUS, cpus=CPUS, nodes=2)
    try:
        s.start()
    except NoNetworkNamespaces as e:
        shutil.rmtree(folder, ignore_errors=True)
        pytest.skip(f"no network namespaces for a second node here: {e}")
    try:
        yield s
    finally:
        s.stop()
        left = s.processes()
        _end(s)
        shutil.rmtree(folder, ignore_errors=True)
        # an interrupted session stops its jobs mid-run: what they leave is ended above, not a failure
        if request.session.exitstatus != pytest.ExitCode.INTERRUPTED:
            assert left == [], f"processes of the local Slurm or its jobs outlived it: {left}"


def _end(slurm: LocalSlurm) -> None:
    """End by process id what of ``slurm``'s jobs outlived it (a failed test's Ray): SIGTERM, then SIGKILL
    after 10 s to those still carrying its mark."""
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        for pid, _ in slurm.processes():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while slurm.processes() and time.monotonic() < deadline:
            time.sleep(0.2)


def _job_env(slurm: LocalSlurm, **more: str) -> dict[str, str]:
    token = slurm.dir / "ray_token"  # this Ray's own token, not ~/.ray's
    if not token.exists():
        token.write_text(secrets.token_hex(32))
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env.update({
        "CPUS_PER_WORKER": str(CPUS_PER_WORKER), "RAY_PORT": str(_free_port()), "RAY_AUTH_TOKEN_PATH": str(token),
        # no dashboard; a temporary folder of the test's (the worker nodes take the head's)
        "RAY_HEAD_ARGS": f"--include-dashboard=false --disable-usage-stats --temp-dir={slurm.dir / 'ray'}",
        "RAY_START_ARGS": f"--dashboard-agent-listen-port={_free_port()}", **more})
    return env


def _no_job_processes(slurm: LocalSlurm) -> None:
    """The job ended its Ray: nothing it started outlives it (only the daemons remain)."""
    deadline = time.monotonic() + 30
    while True:
        left = slurm.job_processes()
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert left == [], f"the job left processes behind: {left}"


def _resume_command(log: str, script: str) -> tuple[dict[str, str], list[str]]:
    """(environment, sbatch arguments) of the command the stopped job printed, checked to be one."""
    said = _lines(log, f"{script}: stopped before the end by a signal (a time limit, scancel); continue with:")
    assert len(said) == 1, log[-3000:]
    words = shlex.split(said[0])
    at = words.index("sbatch")
    assert all("=" in w for w in words[:at]), said
    return dict(w.split("=", 1) for w in words[:at]), words[at + 1:]


def test_a_two_node_sweep_runs_a_trial_on_each_node_with_the_gpus_it_asked_for(slurm, tmp_path):
    space = tiny_space(tmp_path / "tiny.yaml", "training.rounds=2", "evaluation.batch_size=512")
    log = tmp_path / "job.log"
    env = _job_env(slurm, SPACE=str(space), STORAGE=str(tmp_path / "store"),
                   EXTRA="--target colour --set engine.gpus_declared_only=true")
    t0 = time.monotonic()
    job, code = slurm.sbatch(["--nodes=2", "--exclusive", f"--cpus-per-task={CPUS}", f"--gpus-per-node={ASKED}",
                              "--time=10", f"--output={log}", str(REPO / "tuning" / "slurm_sweep.sbatch")],
                             env=env, cwd=REPO, timeout=500)
    took = time.monotonic() - t0
    text = log.read_text() if log.exists() else ""
    info = slurm.job(job)
    print(f"\njob {job}: exit {code}, {took:.0f} s; {info.get('JobState')} NodeList={info.get('NodeList')} "
          f"TresPerNode={info.get('TresPerNode')} JOB_GRES={info.get('JOB_GRES')}")
    print("\n".join(line for line in text.splitlines() if line.startswith(("slurm_", "Logical resource usage",
                                                                           "|", "chosen"))))
    assert code == 0 and info.get("JobState") == "COMPLETED", text[-4000:]

    # 1. Slurm gave the job both nodes, and (--exclusive) every GPU of them, though it asked for 2 a node
    assert info["NumNodes"] == "2" and info["NodeList"] == "rfnode[1-2]", info
    assert info["TresPerNode"] == f"gres:gpu:{ASKED}", info
    assert info["JOB_GRES"] == f"gpu:{2 * GPUS}", info
    # 2. the job used what its steps see, the 2 asked, and said why it differs from the batch step's 4
    assert _lines(text, "slurm_sweep: allocation:") == [f"2 node(s) x {CPUS} CPU, {ASKED} GPU (rfnode[1-2])"]
    assert _lines(text, "slurm_sweep: the job holds") == [
        f"{GPUS} GPU(s) per node (--exclusive) and asked for {ASKED}: Ray uses {ASKED}"]
    workers = _lines(text, "slurm_sweep: workers:")
    m = re.match(r"(\d+) per node, engine.num_cpus_per_worker=([\d.]+) engine.num_gpus_per_worker=([\d.]+)",
                 workers[0])
    per_node, cpus_per_worker, share = int(m[1]), float(m[2]), float(m[3])
    assert cpus_per_worker == CPUS_PER_WORKER and per_node == int(CPUS / CPUS_PER_WORKER)
    assert share == ASKED / per_node
    # 3. Ray: a head on node 1 and a worker on node 2, at their own addresses, each with the step's CPUs and GPUs
    head, worker = slurm.addrs["rfnode1"], slurm.addrs["rfnode2"]
    assert f"slurm_sweep: Ray head on rfnode1 ({head}:{env['RAY_PORT']})" in text
    assert "slurm_sweep: Ray worker on rfnode2" in text
    assert _lines(text, "slurm_ray: ray cluster:")[-1] == (
        f"2 node(s), {2 * CPUS:g} CPU, {2 * ASKED:g} GPU (Slurm: 2 node(s) x {CPUS:g} CPU, {ASKED:g} GPU)")
    assert _lines(text, "slurm_ray: ray node")[-2:] == [f"{a}: {CPUS:g} CPU, {ASKED:g} GPU" for a in (head, worker)]
    # 4. Tune saw those GPUs and, at some moment, both trials' workers
    usage = [tuple(map(float, u)) for u in
             re.findall(r"Logical resource usage: ([\d.]+)/([\d.]+) CPUs, ([\d.]+)/([\d.]+) GPUs", text)]
    assert usage and all(total == (2 * CPUS, 2 * ASKED) for total in [(u[1], u[3]) for u in usage]), usage
    assert max(used_gpu for _, _, used_gpu, _ in usage) == pytest.approx(2 * 3 * share)
    # 5. each trial's placement group: one bundle per worker (3 source domains), each with the derived share, all
    # on one node (a node fits one trial), and the two trials on the two nodes
    pgs = [json.loads(p) for p in _lines(text, "slurm_ray: placement group")]
    assert len(pgs) == 2 and all(pg["placed"] for pg in pgs), pgs
    for pg in pgs:
        worker_bundles = [b for b in pg["bundles"] if b.get("CPU", 0) > 0 or b.get("GPU", 0) > 0]
        assert worker_bundles == [{"CPU": CPUS_PER_WORKER, "GPU": share}] * 3, pg
        assert pg["gpu"] == pytest.approx(3 * share)
    assert sorted(sorted(set(pg["nodes"])) for pg in pgs) == [[head], [worker]], pgs
    # the trials table on the shared path
    sweep = tmp_path / "store" / "tiny"
    rows = pq.read_table(sweep / "trials.parquet").to_pylist()
    print(json.dumps(rows, indent=None))
    assert sorted(r["method.lam"] for r in rows) == [0.0, 1.0]
    assert all(r["target"] == "colour" and r["rounds_run"] == 2 for r in rows)
    assert (sweep / "selection.md").is_file() and (sweep / "chosen_config.yaml").is_file()
    _no_job_processes(slurm)
    assert "slurm_sweep: ray stopped on 2 node(s)" in text


def test_a_run_stopped_by_sigterm_exits_130_and_its_printed_command_finishes_it(slurm, tmp_path):
    run = tmp_path / "run"
    rounds = 30  # short rounds (a third of a second here): the signal lands mid-run, the rest is quick
    env = _job_env(slurm)
    log1, log2 = tmp_path / "job1.log", tmp_path / "job2.log"
    # one worker: fewer processes to start on this machine's 2 cores (the numbers do not depend on it)
    sets = [f"training.rounds={rounds}", "data.resolution=16", "model.width=8", "compare=null",
            "output.checkpoint_every=1", "engine.num_workers=1", "engine.gpus_declared_only=true"]
    job = slurm.submit(["--nodes=1", "--exclusive", f"--cpus-per-task={CPUS}", f"--gpus-per-node={ASKED}",
                        "--time=10", f"--output={log1}", str(REPO / "tuning" / "slurm_run.sbatch"),
                        "configs/quickstart.yaml", "--target", "colour", "--run-dir", str(run),
                        *[a for kv in sets for a in ("--set", kv)]], env=env, cwd=REPO)
    ckpts = run / "checkpoints" / "colour"
    deadline = time.monotonic() + 300
    while not any(ckpts.glob("round_*.json")):
        info = slurm.job(job)
        assert info.get("JobState") in ("PENDING", "RUNNING", "CONFIGURING"), (info, log1.read_text()[-3000:])
        assert time.monotonic() < deadline, "no round was saved in 300 s"
        time.sleep(0.2)
    slurm.signal(job, "TERM")
    code = slurm.wait(job, timeout=120)
    text = log1.read_text()
    info = slurm.job(job)
    saved = sorted(int(p.stem.split("_")[1]) for p in ckpts.glob("round_*.json"))
    print(f"\njob {job}: exit {code}, {info.get('JobState')}, checkpoints of rounds {saved}")
    print("\n".join(line for line in text.splitlines() if line.startswith(("slurm_", "slurmstepd"))))
    # stopped mid-run: exit 130, what a Ctrl-C of rayfed-dg gives, and the command that continues it
    assert code == 130 and info["ExitCode"] == "130:0" and info["JobState"] == "FAILED", text[-3000:]
    assert saved and saved[-1] < rounds and not (run / "summary.json").exists(), saved
    resume_env, args = _resume_command(text, "slurm_run")
    assert resume_env == {"CPUS_PER_WORKER": str(CPUS_PER_WORKER)}
    assert args[-3:] == ["tuning/slurm_run.sbatch", "--resume", str(run)], args
    assert {"--nodes=1", f"--cpus-per-task={CPUS}", f"--gpus-per-node={ASKED}"} <= set(args), args
    _no_job_processes(slurm)
    before = {p.name: p.stat().st_mtime_ns for p in (run / "metrics.parquet").iterdir()}
    assert len(before) >= saved[-1]

    # the printed command, with this test's log file and time limit, from the repository as the script asks
    t0 = time.monotonic()
    job2, code2 = slurm.sbatch([f"--output={log2}", "--time=10", *args], env={**env, **resume_env}, cwd=REPO,
                               timeout=400)
    text2 = log2.read_text()
    print(f"job {job2}: exit {code2}, {time.monotonic() - t0:.0f} s")
    print("\n".join(line for line in text2.splitlines() if line.startswith(("slurm_", "=="))))
    assert code2 == 0, text2[-3000:]
    assert json.loads((run / "summary.json").read_text())["targets"].keys() == {"colour"}
    parts = sorted(p.name for p in (run / "metrics.parquet").iterdir())
    assert parts == [f"colour-r{r:05d}.parquet" for r in range(1, rounds + 1)], parts
    # continued, not restarted: the rounds recorded before the signal were not written again
    assert all((run / "metrics.parquet" / n).stat().st_mtime_ns == t for n, t in before.items()
               if int(n[-13:-8]) <= saved[-1])
    assert f"run dir {run}" in text2 and "slurm_run: ray stopped on 1 node(s)" in text2
    _no_job_processes(slurm)


@pytest.mark.skipif(os.environ.get("RAYFED_DG_SLURM_TIME_LIMIT") != "1",
                    reason="a sweep past a real 2-minute Slurm time limit, about 4 minutes: "
                           "RAYFED_DG_SLURM_TIME_LIMIT=1 runs it")
def test_a_sweep_past_its_time_limit_resumes_to_a_complete_trials_table(slurm, tmp_path):
    rounds = 150  # past a 2-minute limit on an idle 2-core machine too (60 finished in 91 s)
    space = tiny_space(tmp_path / "tiny.yaml", f"training.rounds={rounds}", "evaluation.batch_size=512")
    env = _job_env(slurm, SPACE=str(space), STORAGE=str(tmp_path / "store"),
                   EXTRA="--target colour --set engine.gpus_declared_only=true")
    log1, log2 = tmp_path / "job1.log", tmp_path / "job2.log"
    t0 = time.monotonic()
    job, code = slurm.sbatch(["--nodes=2", "--exclusive", f"--cpus-per-task={CPUS}", f"--gpus-per-node={ASKED}",
                              "--time=2", f"--output={log1}", str(REPO / "tuning" / "slurm_sweep.sbatch")],
                             env=env, cwd=REPO, timeout=400)
    text = log1.read_text()
    info = slurm.job(job)
    print(f"\njob {job}: exit {code}, {time.monotonic() - t0:.0f} s, {info.get('JobState')} "
          f"ExitCode={info.get('ExitCode')} TimeLimit={info.get('TimeLimit')}")
    print("\n".join(line for line in text.splitlines() if line.startswith(("slurm_", "slurmstepd", "tune.py"))))
    assert info["JobState"] == "TIMEOUT" and code == 130, text[-3000:]
    resume_env, args = _resume_command(text, "slurm_sweep")
    assert resume_env["RESUME"] == "1" and resume_env["SPACE"] == str(space), resume_env
    _no_job_processes(slurm)
    t0 = time.monotonic()
    job2, code2 = slurm.sbatch([f"--output={log2}", "--time=10", *args], env={**env, **resume_env}, cwd=REPO,
                               timeout=600)
    text2 = log2.read_text()
    print(f"job {job2}: exit {code2}, {time.monotonic() - t0:.0f} s")
    print("\n".join(line for line in text2.splitlines() if line.startswith(("slurm_", "|", "chosen"))))
    assert code2 == 0, text2[-3000:]
    rows = pq.read_table(tmp_path / "store" / "tiny" / "trials.parquet").to_pylist()
    print(json.dumps(rows, indent=None))
    assert sorted(r["method.lam"] for r in rows) == [0.0, 1.0]
    assert all(r["rounds_run"] == rounds for r in rows)
    # at least one trial continued from a checkpoint the time limit left
    assert max(r["resumed_from_round"] for r in rows) > 0, rows
    _no_job_processes(slurm)
