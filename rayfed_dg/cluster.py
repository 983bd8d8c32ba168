"""A multi-node Ray cluster on this machine, for rehearsing ``cluster.yaml``;
and the one step of ``cluster.yaml`` that runs on the cloud head.

``LocalCluster`` starts a Ray head on port 6379 with the autoscaler's fake
multi-node provider (``cluster-local.yaml``): the autoscaler starts "worker
nodes" (raylets with declared CPUs and GPUs) on demand, exactly as a cloud
cluster adds machines, and removes them when idle.  ``SlowFakeProvider``
(``provider: {type: external, module: rayfed_dg.cluster.SlowFakeProvider,
launch_delay_s: ...}``) is that provider with a launch as slow as a cold
cloud node's.  A head on another port tells the provider where its nodes
join (``gcs_address``, in a copy of the config in the cluster's folder).

It stops exactly what it started, never with ``ray stop`` (which ends every
Ray process on the machine, other users' included) and never by matching
command lines (another user's ``ray start --head --port=6379`` names the same
port).  ``up`` runs ``ray start`` as the leader of a new session and records
that session and the processes in it (pid and start time) in the cluster's
folder.  ``down`` ends the recorded processes that are still the same
processes, everything they started (the autoscaler's worker nodes and every
Ray worker are their descendants), and any orphan of the recorded session
started after ``up`` (a worker whose raylet died).  Nothing else: a process is
never chosen by what its command line says.

    python -m rayfed_dg.cluster up [--config cluster-local.yaml]
    python -m rayfed_dg.cluster status
    python -m rayfed_dg.cluster down
    python -m rayfed_dg.cluster pin-image ~/ray_bootstrap_config.yaml   (on the AWS head, see cluster.yaml)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml
from ray.autoscaler._private.fake_multi_node.node_provider import FakeMultiNodeProvider

from .errors import ConfigError

PORT = 6379  # the fake provider's nodes join the head at this port
ADDRESS = f"127.0.0.1:{PORT}"
STATE = Path(os.environ.get("RAYFED_DG_CLUSTER_DIR", "/tmp/rayfed-dg-cluster"))
RECORD = "rayfed-dg-cluster.json"  # in the cluster's folder: what `up` started
SSM_IMAGE = "resolve:ssm:"  # an ImageId EC2 resolves through a Systems Manager parameter at launch
SLOW_PROVIDER = "rayfed_dg.cluster.SlowFakeProvider"


class SlowFakeProvider(FakeMultiNodeProvider):
    """Ray's fake multi-node provider whose every launch takes
    ``launch_delay_s`` (provider config) before the node starts, as a cold
    cloud node boots and installs for minutes.  The autoscaler launches
    from a thread of its own, so it reports the node as a pending launch
    meanwhile, as it does on a cloud.

    A started node is marked set up (``up-to-date``), as a cloud node is
    once its setup commands ran: Ray's fake provider keeps the autoscaler's
    ``uninitialized`` tag, so a node that died would count as pending
    forever, and would never be terminated (the autoscaler ends only
    set-up nodes that stopped reporting) nor replaced at ``max_workers``."""

    def _create_node_with_resources_and_labels(self, node_config, tags, count, resources, labels):
        from ray.autoscaler.tags import STATUS_UP_TO_DATE, TAG_RAY_NODE_STATUS

        time.sleep(float(self.provider_config.get("launch_delay_s", 0.0)))
        with self.lock:
            super()._create_node_with_resources_and_labels(node_config, tags, count, resources, labels)
            for node in self._nodes.values():
                node["tags"][TAG_RAY_NODE_STATUS] = STATUS_UP_TO_DATE


def client_env() -> dict[str, str]:
    """Environment for a driver of this cluster (``ray start`` turns token
    authentication on; a connecting driver must ask for it too)."""
    env = dict(os.environ)
    env.setdefault("RAY_AUTH_MODE", "token")
    return env


# ------------------------------------------------------------------ processes
def _session(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except (ProcessLookupError, PermissionError):
        return None


def _same(pid: int, started: float):
    """The process ``pid`` if it is still the one that started at ``started``
    (not a later process that was given a reused pid), else None."""
    import psutil

    try:
        p = psutil.Process(pid)
        return p if abs(p.create_time() - started) < 0.05 else None
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def _in_session(sid: int) -> list:
    import psutil

    out = []
    for pid in psutil.pids():
        if _session(pid) == sid:
            try:
                out.append(psutil.Process(pid))
            except psutil.NoSuchProcess:
                pass
    return out


def read_record(temp_dir: str | Path = STATE) -> dict | None:
    path = Path(temp_dir) / RECORD
    try:
        rec = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return rec if "session" in rec and "processes" in rec else None


def cluster_processes(temp_dir: str | Path = STATE) -> list:
    """The processes of the cluster recorded in ``temp_dir`` (psutil objects):
    the recorded ones still alive as themselves, their descendants, and the
    orphans of the recorded session started after ``up``."""
    import psutil

    rec = read_record(temp_dir)
    if rec is None:
        return []
    found: dict[int, psutil.Process] = {}
    for pid, started in rec["processes"]:
        p = _same(pid, started)
        if p is None:
            continue
        found[p.pid] = p
        try:
            found.update({c.pid: c for c in p.children(recursive=True)})
        except psutil.NoSuchProcess:
            pass
    # Orphans keep the session that `up` created (Ray never calls setsid).  The session's id is the pid of the
    # `ray start` that led it and has exited; if a process now holds that pid, its session id may be the same
    # number without being ours, so the session is trusted only while that pid is free.
    sid = rec["session"]
    if not psutil.pid_exists(sid):
        for p in _in_session(sid):
            try:
                if p.create_time() >= rec["started"] - 1.0:
                    found.setdefault(p.pid, p)
            except psutil.NoSuchProcess:
                pass
    found.pop(os.getpid(), None)
    return list(found.values())


def stop_cluster(temp_dir: str | Path = STATE, timeout: float = 5.0) -> int:
    """End the processes of the cluster recorded in ``temp_dir`` (SIGTERM,
    then SIGKILL after ``timeout``); returns how many there were."""
    import psutil

    def each(procs: list, signal_of) -> None:
        for p in procs:
            try:
                signal_of(p)()
            except psutil.NoSuchProcess:
                pass

    procs = cluster_processes(temp_dir)
    each(procs, lambda p: p.terminate)
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    each(alive, lambda p: p.kill)
    psutil.wait_procs(alive, timeout=timeout)
    # a worker the dying raylets were starting may appear in the session meanwhile
    late = cluster_processes(temp_dir)
    each(late, lambda p: p.kill)
    (Path(temp_dir) / RECORD).unlink(missing_ok=True)
    return len(procs) + len(late)


class LocalCluster:
    def __init__(self, config: str | Path, temp_dir: str | Path = STATE, port: int = PORT,
                 env: dict[str, str] | None = None):
        self.config = Path(config).resolve()
        self.temp_dir = Path(temp_dir)
        self.port = port
        self.env = dict(env or {})  # for the head's processes (the autoscaler's settings: AUTOSCALER_*)
        if not self.config.is_file():
            raise ConfigError(f"{self.config}: no such cluster config")
        self.cfg = yaml.safe_load(self.config.read_text())
        provider = self.cfg.get("provider") or {}
        if provider.get("type") != "fake_multinode" and provider.get("module") != SLOW_PROVIDER:
            raise ConfigError(f"{self.config}: a local cluster needs provider.type fake_multinode (or type external "
                              f"with module {SLOW_PROVIDER})")
        self.head = dict(self.cfg["available_node_types"][self.cfg["head_node_type"]].get("resources") or {})

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _autoscaling_config(self) -> Path:
        """The config the head's autoscaler reads: on another port than the
        fake provider's default, a copy naming where its nodes join."""
        if self.port == PORT:
            return self.config
        from ray._private.services import get_node_ip_address

        cfg = dict(self.cfg, provider={**self.cfg["provider"], "gcs_address": f"{get_node_ip_address()}:{self.port}"})
        path = self.temp_dir / "autoscaling-config.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return path

    # ---------------------------------------------------------------- control
    def start(self) -> None:
        if self._port_in_use():
            raise ConfigError(f"port {self.port} is in use: another Ray head runs there; stop it first "
                              "(python -m rayfed_dg.cluster down, if it is this one)")
        self.temp_dir.mkdir(parents=True, exist_ok=True)
        env = client_env()
        env.update({"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1", **self.env})
        cmd = ["ray", "start", "--head", f"--port={self.port}", f"--autoscaling-config={self._autoscaling_config()}",
               f"--temp-dir={self.temp_dir}", "--include-dashboard=false", "--disable-usage-stats",
               f"--num-cpus={self.head.get('CPU', 0)}", f"--num-gpus={self.head.get('GPU', 0)}"]
        started = time.time()
        # the leader of a new session: every process Ray starts for this cluster keeps that session
        leader = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  start_new_session=True)
        self._write_record(leader.pid, started, [])  # recorded before it can start anything
        out, err = leader.communicate()
        procs = [[p.pid, p.create_time()] for p in _in_session(leader.pid)]
        self._write_record(leader.pid, started, procs)
        if leader.returncode != 0:
            stop_cluster(self.temp_dir)
            raise RuntimeError(f"ray start failed (exit {leader.returncode}): {(err or out)[-2000:]}")

    def _write_record(self, session: int, started: float, procs: list) -> None:
        rec = {"config": str(self.config), "temp_dir": str(self.temp_dir), "session": session,
               "started": started, "processes": procs}
        tmp = self.temp_dir / (RECORD + ".tmp")
        tmp.write_text(json.dumps(rec))
        tmp.replace(self.temp_dir / RECORD)

    def processes(self) -> list:
        """This cluster's processes (see ``cluster_processes``)."""
        return cluster_processes(self.temp_dir)

    def worker_raylets(self) -> list:
        """Raylets of the worker nodes (the head's has the fake provider's head node id)."""
        import psutil
        from ray.autoscaler._private.fake_multi_node.node_provider import FAKE_HEAD_NODE_ID

        out = []
        for p in self.processes():
            try:
                cmd = p.cmdline()
            except psutil.NoSuchProcess:
                continue
            if cmd and cmd[0].endswith("raylet") and f"--node_id={FAKE_HEAD_NODE_ID}" not in cmd:
                out.append(p)
        return out

    def stop(self, timeout: float = 5.0) -> int:
        return stop_cluster(self.temp_dir, timeout)

    def _port_in_use(self) -> bool:
        import socket

        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", self.port)) == 0

    def wait_until_up(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not self._port_in_use():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the local cluster's head did not open port {self.port} within {timeout:g} s")
            time.sleep(0.5)

    def __enter__(self) -> LocalCluster:
        self.start()
        self.wait_until_up()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


# ------------------------------------------------------------ the AWS head
def instance_image(timeout: float = 2.0) -> str:
    """The AMI this EC2 instance booted from (instance metadata, IMDSv2)."""
    import urllib.request

    base = "http://169.254.169.254/latest"
    try:
        req = urllib.request.Request(f"{base}/api/token", method="PUT",
                                     headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"})
        token = urllib.request.urlopen(req, timeout=timeout).read().decode()
        req = urllib.request.Request(f"{base}/meta-data/ami-id", headers={"X-aws-ec2-metadata-token": token})
        return urllib.request.urlopen(req, timeout=timeout).read().decode().strip()
    except OSError as e:
        raise ConfigError(f"pin-image runs on the cluster's AWS head; the instance metadata service did not "
                          f"answer ({e})") from None


def pin_image(config_path: str | Path, image: str | None = None) -> dict[str, str]:
    """Replace every ``resolve:ssm:...`` ImageId of the autoscaler's config
    with ``image`` (default: the AMI this instance booted from).

    EC2 resolves such an ImageId with the caller's permissions
    (``ssm:GetParameters``): ``ray up`` has the user's, but the workers are
    launched by the head's autoscaler with the head's role, which Ray creates
    with EC2 and S3 access only.  Pinned, the workers boot the head's AMI and
    the role suffices.  Returns {node type: what was replaced}."""
    path = Path(config_path).expanduser()
    try:
        cfg = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such autoscaling config") from None
    todo = {name: t["node_config"]["ImageId"] for name, t in (cfg.get("available_node_types") or {}).items()
            if str((t.get("node_config") or {}).get("ImageId", "")).startswith(SSM_IMAGE)}
    if not todo:
        return {}
    image = image or instance_image()
    for name in todo:
        cfg["available_node_types"][name]["node_config"]["ImageId"] = image
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(cfg))
    tmp.replace(path)
    return todo


def main(argv: list[str] | None = None) -> int:
    from .utils import run_cli

    ap = argparse.ArgumentParser(prog="python -m rayfed_dg.cluster", description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=["up", "down", "status", "pin-image"])
    ap.add_argument("path", nargs="?", help="pin-image: the autoscaler's config (~/ray_bootstrap_config.yaml)")
    ap.add_argument("--config", default="cluster-local.yaml")
    args = ap.parse_args(argv)

    def act() -> int:
        if args.action == "pin-image":
            if not args.path:
                raise ConfigError("pin-image needs the autoscaler's config path")
            done = pin_image(args.path)
            image = yaml.safe_load(Path(args.path).expanduser().read_text())
            for name, was in done.items():
                print(f"{name}: ImageId {was} -> {image['available_node_types'][name]['node_config']['ImageId']}")
            if not done:
                print("no node type names its image through SSM; nothing to pin")
            return 0
        if args.action == "down":
            if read_record(STATE) is None:
                print(f"no local cluster is recorded in {STATE}; nothing stopped")
                return 0
            n = stop_cluster(STATE)
            print(f"stopped {n} processes of the local cluster recorded in {STATE}")
            return 0
        c = LocalCluster(args.config)
        if args.action == "up":
            c.start()
            c.wait_until_up()
            print(f"local cluster up at {ADDRESS} (head {c.head}); run with --set engine.ray_address={ADDRESS}")
            return 0
        r = subprocess.run(["ray", "status", f"--address={ADDRESS}"], env=client_env(), capture_output=True,
                           text=True)
        print(r.stdout or r.stderr)
        return r.returncode

    return run_cli("rayfed-dg cluster", act)


if __name__ == "__main__":
    sys.exit(main())
