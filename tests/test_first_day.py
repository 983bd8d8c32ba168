"""The cluster user's first day: the documented cluster commands, as written, against a Ray cluster
started the way ``cluster.yaml`` starts it; what they read and ask for against what the nodes have; the node
image (``Dockerfile``) against the project's pins and ``cluster.yaml``.

The cluster: a head started by ``cluster.yaml``'s own ``ray start --head`` line (no token: ``RAY_AUTH_MODE``
unset, nothing in ``~/.ray``) and one ``gpu_worker`` node started by its worker line with the node type's
resources (the GPU is declared), in a clean ``HOME``, on a free port, started and stopped by process id (never
``ray stop``).  The drivers find the cluster as they do on the AWS head, through the address file of the last
``ray start`` (``$RAY_TMPDIR/ray/ray_current_cluster``), with no ``RAY_ADDRESS``.  The issue's reproduction runs
in the default suite (the module: 57 s at a load average of 3 on 2 cores); the documented sweep (five trials, one
after another on the one GPU node: 150 s there) only with ``RAYFED_DG_FIRST_DAY_SWEEP=1``.
"""
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import REPO
from PIL import Image

from rayfed_dg.config import load_config
from rayfed_dg.data.sources import get_source
from rayfed_dg.tuning import load_space

CLUSTER_YAML = yaml.safe_load((REPO / "cluster.yaml").read_text())
DOCUMENTED_IN = [REPO / "README.md", REPO / "docs" / "clusters.md", REPO / "cluster.yaml"]
NOT_ON_THIS_MACHINE = ["engine.gpus_declared_only=true"]  # the gpu_worker's GPU is declared, not real


def documented_exec(doc: Path) -> list[str]:
    """The commands a page runs on the head: ``ray exec cluster.yaml 'cd ~/rayfed_dg && COMMAND'``."""
    return re.findall(r"ray exec cluster\.yaml 'cd ~/rayfed_dg && ([^']+)'", doc.read_text())


def documented_runs() -> list[tuple[str, Path, list[str]]]:
    """(command, config, overrides) of every command the README, docs/clusters.md and cluster.yaml run on the head."""
    out = []
    for command in sorted({c for doc in DOCUMENTED_IN for c in documented_exec(doc)}):
        args = shlex.split(command)
        sets = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
        if args[:2] == ["python", "tune.py"]:
            space = load_space(args[args.index("--space") + 1])
            out.append((command, REPO / space["config"], [*space.get("set", []), *sets]))
        else:
            assert args[:2] == ["rayfed-dg", "run"], command
            out.append((command, REPO / args[2], sets))
    return out


def test_the_documented_commands_read_what_the_head_fetches():
    """A sweep of `digits` on the cluster found no data: the head fetches only what head_setup_commands name."""
    runs = documented_runs()
    assert {c.split()[0] for c, _, _ in runs} == {"python", "rayfed-dg"}  # the sweep and the single run
    setup = " ; ".join(CLUSTER_YAML["head_setup_commands"])
    for command, config, sets in runs:
        cfg = load_config(config, sets)
        assert f"rayfed-dg data fetch {cfg.data.name} " in setup + " ", (command, cfg.data.name)
        assert cfg.data.root == get_source(cfg.data.name).folder, command  # where the fetch puts it
        if cfg.model.pretrained:  # the ImageNet weights the head puts in TORCH_HOME
            assert f"'{cfg.model.arch}'" in setup and cfg.model.pretrained in setup, command


def test_the_documented_commands_ask_for_the_gpu_share_a_gpu_node_offers():
    """Trials that asked for no GPU trained on the head's CPUs while the g5 GPUs sat idle: each documented run's
    workers ask for GPU and CPU in the proportion of a gpu_worker node, which the head (no GPU) cannot give."""
    node = CLUSTER_YAML["available_node_types"]["gpu_worker"]["resources"]
    head = CLUSTER_YAML["available_node_types"][CLUSTER_YAML["head_node_type"]]
    assert "GPU" not in head["resources"] and head["node_config"]["InstanceType"].startswith("m5.")
    for command, config, sets in documented_runs():
        e = load_config(config, sets).engine
        assert e.num_gpus_per_worker > 0, command
        # as many workers fit a node by its CPUs as by its GPU: neither is left idle (4 x 1 CPU + 0.25 GPU on a g5)
        assert node["CPU"] / e.num_cpus_per_worker == node["GPU"] / e.num_gpus_per_worker == 4, command


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray_start_line(commands: list[str]) -> list[str]:
    (line,) = [c for c in commands if "ray start" in c]
    return shlex.split(line.split(";")[-1])  # after `ulimit -n 65536;`


class TokenlessCluster:
    """A head and a gpu_worker node of ``cluster.yaml`` on this machine, each ``ray start`` the leader of a new
    session: every process of the cluster keeps one of the two sessions (Ray never calls setsid), and only those
    sessions' processes are ended."""

    def __init__(self, root: Path):
        self.root, self.port = root, _free_port()
        self.home, self.share = root / "home", root / "shared"
        self.home.mkdir()
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}  # no token, no address
        env.update(HOME=str(self.home), RAY_TMPDIR=str(root), RAYFED_DG_DATA=str(self.share / "data"),
                   TORCH_HOME=str(self.share / "torch"),
                   PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
        self.env = env
        self.sessions: list[tuple[int, float]] = []

    def _start(self, cmd: list[str]) -> None:
        started = time.time()
        p = subprocess.Popen(cmd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
        self.sessions.append((p.pid, started))
        out, _ = p.communicate(timeout=180)
        assert p.returncode == 0, f"{shlex.join(cmd)} failed:\n{out[-3000:]}"

    def start(self) -> None:
        head = [a for a in _ray_start_line(CLUSTER_YAML["head_start_ray_commands"])
                if not a.startswith(("--port=", "--autoscaling-config="))]  # no cloud provider here
        # the m5.2xlarge head has no GPU; the dashboard and a large object store would only load this machine
        self._start([*head, f"--port={self.port}", "--num-gpus=0", "--include-dashboard=false",
                     "--disable-usage-stats", "--object-store-memory=300000000"])
        worker = [a.replace("$RAY_HEAD_IP:6379", f"127.0.0.1:{self.port}")
                  for a in _ray_start_line(CLUSTER_YAML["worker_start_ray_commands"])]
        res = CLUSTER_YAML["available_node_types"]["gpu_worker"]["resources"]
        self._start([*worker, f"--num-cpus={res['CPU']}", f"--num-gpus={res['GPU']}",
                     "--object-store-memory=300000000"])

    def processes(self) -> list:
        import psutil

        out = []
        for p in psutil.process_iter():
            try:
                sid = os.getsid(p.pid)
                if any(sid == s and p.create_time() >= t - 1.0 for s, t in self.sessions) and p.pid != os.getpid():
                    out.append(p)
            except (ProcessLookupError, PermissionError, psutil.NoSuchProcess):
                pass
        return out

    def stop(self) -> None:
        import psutil

        for _ in range(2):  # a worker a dying raylet was starting may appear meanwhile
            procs = self.processes()
            for p in procs:
                try:
                    p.terminate()
                except psutil.NoSuchProcess:
                    pass
            _, alive = psutil.wait_procs(procs, timeout=5)
            for p in alive:
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass
            psutil.wait_procs(alive, timeout=10)

    def sessions_on_disk(self) -> set[str]:
        return {p.name for p in (self.root / "ray").glob("session_2*")}

    def run(self, command: str, timeout: float = 600) -> subprocess.CompletedProcess:
        """``command`` as the head's shell would run it, in a folder with the checkout's configs and tune.py."""
        work = self.root / "rayfed_dg"
        if not work.exists():
            work.mkdir()
            for name in ("configs", "tune.py"):
                (work / name).symlink_to(REPO / name)
        return subprocess.run(command, shell=True, cwd=work, env=self.env, capture_output=True, text=True,
                              timeout=timeout)


def pacs_like(root: Path) -> None:
    rng = np.random.default_rng(0)
    for d in ("photo", "art_painting", "cartoon", "sketch"):
        for c in ("dog", "horse"):
            (root / d / c).mkdir(parents=True)
            for i in range(10):
                Image.fromarray(rng.integers(0, 255, (12, 12, 3), dtype=np.uint8)).save(root / d / c / f"{i}.png")


@pytest.fixture(scope="module")
def tokenless():
    if shutil.which("ray") is None:
        pytest.skip("the ray command is not on PATH")
    root = Path(tempfile.mkdtemp(prefix="fd", dir="/tmp"))  # short: Ray's socket paths live under it
    c = TokenlessCluster(root)
    pacs_like(c.share / "data" / "PACS")
    try:
        c.start()
        yield c
    finally:
        c.stop()
        shutil.rmtree(root, ignore_errors=True)


def _clean(r: subprocess.CompletedProcess, command: str) -> None:
    assert r.returncode == 0, f"{command}\nexit {r.returncode}\n{r.stderr[-4000:]}"
    for bad in ("Traceback", "AuthenticationError", "Token authentication"):
        assert bad not in r.stderr, f"{command}: {bad!r} in its output\n{r.stderr[-4000:]}"


@pytest.mark.cluster
@pytest.mark.slow
def test_the_issues_reproduction_joins_a_tokenless_head(tokenless):
    """The issue's reproduction: `ray.init()` found the head's cluster and raised AuthenticationError, because the
    driver had turned token authentication on by itself."""
    before = tokenless.sessions_on_disk()
    command = "rayfed-dg run configs/quickstart.yaml --target mono --set compare=null --set training.rounds=1"
    r = tokenless.run(command)
    _clean(r, command)
    summary = json.loads(next((tokenless.root / "rayfed_dg" / "runs").glob("quickstart*/summary.json")).read_text())
    assert summary["targets"]["mono"]["selected_round"] == 1
    # it joined the running cluster (a local Ray of its own would have started a session of its own) and neither
    # turned authentication on nor made itself a token
    assert tokenless.sessions_on_disk() == before and len(before) == 1
    assert not (tokenless.home / ".ray").exists()


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("RAYFED_DG_FIRST_DAY_SWEEP") != "1",
                    reason="five trials in a row, minutes: set RAYFED_DG_FIRST_DAY_SWEEP=1 (docs/testing.md)")
def test_the_documented_cluster_sweep_runs_on_the_gpu_nodes(tokenless):
    """docs/clusters.md's sweep, as cluster.yaml's header writes it too, shrunk to one target and one round: it
    reads the dataset the head fetches, and its trials ask for GPU shares, which only the gpu_worker node has."""
    sweeps = [c for c in documented_exec(REPO / "docs" / "clusters.md") if c.startswith("python tune.py")]
    assert len(sweeps) == 1 and sweeps[0] in (REPO / "cluster.yaml").read_text()
    shrink = ["--target", "photo", "--set", "training.rounds=1",
              *[a for s in NOT_ON_THIS_MACHINE for a in ("--set", s)]]
    # the bucket is rehearsed against moto in tests/test_s3.py; here the sweep's storage is a folder
    command = shlex.join([*shlex.split(sweeps[0].replace("s3://BUCKET", str(tokenless.share))), *shrink])
    r = tokenless.run(command)
    _clean(r, command)
    import pyarrow.parquet as pq

    space = shlex.split(sweeps[0])[shlex.split(sweeps[0]).index("--space") + 1]
    trials = pq.read_table(tokenless.share / "tune" / space / "trials.parquet").to_pylist()
    assert sorted(t["method.lam"] for t in trials) == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert all(t["finished"] and t["target"] == "photo" and t["selected_round"] == 1 for t in trials)


JOIN_OR_START = """
import json, os, sys
from rayfed_dg.config import load_config
from rayfed_dg.engine.workers.resources import cluster_to_join, init_ray, use_token_auth_if_available
from rayfed_dg.errors import ConfigError

out = {"joins": cluster_to_join(None)}
use_token_auth_if_available(local=out["joins"] is None)
out["auth"] = os.environ.get("RAY_AUTH_MODE")
try:
    init_ray(load_config(None, ["engine.ray_address=no-port-here"]))
except ConfigError as e:
    out["bad address"] = str(e)
print(json.dumps(out))
"""


@pytest.mark.parametrize("case", ["ray start here, no token", "RAY_ADDRESS, a token file", "nothing running"])
def test_a_driver_turns_token_auth_on_only_for_its_own_ray_or_with_a_token(tmp_path, case):
    """Decided before ray.init, as ray.init decides it: joining the cluster of a `ray start` on this machine
    (its address file) or RAY_ADDRESS, with no token here: no auth; with a token (RAY_AUTH_TOKEN_PATH): auth;
    starting a Ray of its own: auth, said explicitly.  A malformed address is one line, before Ray starts."""
    (tmp_path / "home").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(HOME=str(tmp_path / "home"), RAY_TMPDIR=str(tmp_path), PYTHONPATH=str(REPO))
    if case == "ray start here, no token":
        (tmp_path / "ray").mkdir()
        (tmp_path / "ray" / "ray_current_cluster").write_text("127.0.0.1:6390")  # what `ray start --head` writes
    elif case == "RAY_ADDRESS, a token file":
        (tmp_path / "token").write_text("0" * 32)
        env.update(RAY_ADDRESS="127.0.0.1:6391", RAY_AUTH_TOKEN_PATH=str(tmp_path / "token"))
    r = subprocess.run([sys.executable, "-c", JOIN_OR_START], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    joins, auth = out["joins"], out["auth"]
    if case == "nothing running":
        assert joins is None and auth == "token"
    else:
        assert joins.endswith(":6390" if case.startswith("ray start") else ":6391")
        assert auth == (None if case.startswith("ray start") else "token")
    assert out["bad address"] == ("cannot join a Ray cluster (engine.ray_address=no-port-here): "
                                  "Invalid address format: no-port-here")
    assert not list(tmp_path.glob("ray/session_*"))  # nothing started a Ray


DOCKERFILE = (REPO / "Dockerfile").read_text()


def _dockerfile_pip_installs() -> list[list[str]]:
    lines = DOCKERFILE.replace("\\\n", " ").splitlines()
    return [shlex.split(line.split("pip install", 1)[1]) for line in lines
            if line.startswith("RUN ") and "pip install" in line]


def test_the_node_image_is_rays_with_the_projects_pins():
    """The Dockerfile builds on the image cluster.yaml runs, installs pyproject.toml's dependencies with Ray held
    at the image's version, then the project, editable, where file_mounts puts the working tree."""
    import tomllib

    from packaging.requirements import Requirement

    (base,) = re.findall(r"^FROM (\S+)$", DOCKERFILE, re.M)
    assert base == CLUSTER_YAML["docker"]["image"]
    ray_version = re.fullmatch(r"rayproject/ray:([\d.]+)-py(\d)(\d+)-gpu", base).group(1)
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    py = re.fullmatch(r"rayproject/ray:[\d.]+-py(\d)(\d+)-gpu", base).groups()
    assert Requirement(f"python{project['requires-python']}").specifier.contains(".".join(py))
    deps, editable = _dockerfile_pip_installs()
    want = {str(Requirement(d)) for d in project["dependencies"] if Requirement(d).name != "ray"}
    assert {str(Requirement(d)) for d in deps if not d.startswith("-")} == want | {f"ray[tune]=={ray_version}"}
    assert {"torch==2.14.1", "torchvision==0.29.1"} <= want
    assert editable[-2:] == ["-e", "."] and "--no-deps" in editable
    (workdir,) = re.findall(r"^WORKDIR (\S+)$", DOCKERFILE, re.M)
    assert workdir == "/home/ray/" + next(k for k in CLUSTER_YAML["file_mounts"]).removeprefix("~/")
    # setup installs the same, and only where the image did not: a no-op on the prebuilt image
    (setup,) = CLUSTER_YAML["setup_commands"]
    skip, install = setup.split(" || ")
    assert skip.startswith("pip show -q rayfed_dg") and f'pip install -q -e . "ray[tune]=={ray_version}"' in install
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".git", "runs", "**/__pycache__"} <= set(ignored) and "rayfed_dg" not in ignored
    # the commented image line and the documented build command name one tag, the project's version
    tag = f"<registry>/rayfed-dg:{project['version']}"
    assert f"# image: {tag}" in (REPO / "cluster.yaml").read_text()
    assert f"docker build -t {tag} ." in DOCKERFILE and f"docker build -t {tag} ." in (REPO / "docs" / "clusters.md").read_text()
