"""A multi-node Ray cluster on this machine, for rehearsing ``cluster.yaml``.

``LocalCluster`` starts a Ray head on port 6379 with the autoscaler's fake
multi-node provider (``cluster-local.yaml``): the autoscaler starts "worker
nodes" (raylets with declared CPUs and GPUs) on demand, exactly as a cloud
cluster adds machines, and removes them when idle.  It is started and
stopped by process id, never with ``ray stop`` (which ends every Ray process
on the machine, other users' included): ``stop`` ends the processes whose
command line names this cluster's temporary folder or its GCS address.

    python -m rayfed_dg.cluster up [--config cluster-local.yaml]
    python -m rayfed_dg.cluster status
    python -m rayfed_dg.cluster down
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

from .errors import ConfigError

PORT = 6379  # the fake provider's nodes join the head at this port
ADDRESS = f"127.0.0.1:{PORT}"
STATE = Path(os.environ.get("RAYFED_DG_CLUSTER_DIR", "/tmp/rayfed-dg-cluster"))


def client_env() -> dict[str, str]:
    """Environment for a driver of this cluster (``ray start`` turns token
    authentication on; a connecting driver must ask for it too)."""
    env = dict(os.environ)
    env.setdefault("RAY_AUTH_MODE", "token")
    return env


class LocalCluster:
    def __init__(self, config: str | Path, temp_dir: str | Path = STATE):
        self.config = Path(config).resolve()
        self.temp_dir = Path(temp_dir)
        if not self.config.is_file():
            raise ConfigError(f"{self.config}: no such cluster config")
        cfg = yaml.safe_load(self.config.read_text())
        if (cfg.get("provider") or {}).get("type") != "fake_multinode":
            raise ConfigError(f"{self.config}: provider.type must be fake_multinode for a local cluster")
        self.head = dict(cfg["available_node_types"][cfg["head_node_type"]].get("resources") or {})

    # ---------------------------------------------------------------- control
    def start(self) -> None:
        if self._port_in_use():
            raise ConfigError(f"port {PORT} is in use: another Ray head runs there; stop it first "
                              "(python -m rayfed_dg.cluster down, if it is this one)")
        self.temp_dir.mkdir(parents=True, exist_ok=True)
        env = client_env()
        env.update({"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"})
        cmd = ["ray", "start", "--head", f"--port={PORT}", f"--autoscaling-config={self.config}",
               f"--temp-dir={self.temp_dir}", "--include-dashboard=false", "--disable-usage-stats",
               f"--num-cpus={self.head.get('CPU', 0)}", f"--num-gpus={self.head.get('GPU', 0)}"]
        subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
        (self.temp_dir / "rayfed-dg-cluster.json").write_text(json.dumps({"config": str(self.config)}))

    def processes(self) -> list:
        """This cluster's processes: the head's (they name its temporary
        folder) and the worker nodes' (they name its GCS address)."""
        import psutil

        marks = (str(self.temp_dir), f":{PORT}")
        out = []
        for p in psutil.process_iter(["pid", "cmdline"]):
            cmd = " ".join(p.info["cmdline"] or [])
            if p.pid == os.getpid():
                continue
            if any(m in cmd for m in marks) and ("ray" in cmd or "raylet" in cmd):
                out.append(p)
            elif cmd.startswith("ray::"):  # a node's agents and workers show only a title: their logs tell
                try:
                    if any(f.path.startswith(str(self.temp_dir)) for f in p.open_files()):
                        out.append(p)
                except (psutil.AccessDenied, psutil.NoSuchProcess):
                    pass
        return out

    def worker_raylets(self) -> list:
        """Raylets of the worker nodes (the head's has the fake provider's head node id)."""
        from ray.autoscaler._private.fake_multi_node.node_provider import FAKE_HEAD_NODE_ID

        return [p for p in self.processes() if (p.info["cmdline"] or [""])[0].endswith("raylet")
                and f"--node_id={FAKE_HEAD_NODE_ID}" not in p.info["cmdline"]]

    def stop(self, timeout: float = 5.0) -> int:
        import psutil

        found = {p.pid: p for p in self.processes()}
        for p in list(found.values()):  # agents and workers carry only a process title: find them as children
            try:
                found.update({c.pid: c for c in p.children(recursive=True)})
            except psutil.NoSuchProcess:
                pass
        procs = list(found.values())
        for p in procs:
            try:
                p.terminate()
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(procs, timeout=timeout)
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        return len(procs)

    def _port_in_use(self) -> bool:
        import socket

        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", PORT)) == 0

    def wait_until_up(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not self._port_in_use():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the local cluster's head did not open port {PORT} within {timeout:g} s")
            time.sleep(0.5)

    def __enter__(self) -> LocalCluster:
        self.start()
        self.wait_until_up()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    from .utils import run_cli

    ap = argparse.ArgumentParser(prog="python -m rayfed_dg.cluster", description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=["up", "down", "status"])
    ap.add_argument("--config", default="cluster-local.yaml")
    args = ap.parse_args(argv)

    def act() -> int:
        if args.action == "down":
            state = STATE / "rayfed-dg-cluster.json"
            config = json.loads(state.read_text())["config"] if state.is_file() else args.config
            n = LocalCluster(config).stop()
            print(f"stopped {n} processes of the local cluster")
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
