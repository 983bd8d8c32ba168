"""A one-node Slurm on this machine, for running ``tuning/slurm_sweep.sbatch`` for real.

``LocalSlurm(folder)`` writes a private munge key, ``slurm.conf`` and
``gres.conf`` into ``folder`` and starts ``munged``, ``slurmctld`` and
``slurmd`` in the foreground, keeping their process ids; ``stop`` ends those
three by id (never ``scontrol shutdown`` of anyone else's Slurm, never
``pkill``).  Everything listens on loopback, on free ports, and uses its own
munge socket, so the machine's own munge/Slurm (if any) is untouched.

The node is this machine (``slurmd -C``: its name, CPUs, sockets, memory)
with ``gpus`` declared GPUs: GRES ``gpu`` whose ``File`` entries
``folder/dev/nvidia0..`` are links to ``/dev/null`` (slurmd wants character
devices; it sets ``CUDA_VISIBLE_DEVICES`` from their numbers, as on a GPU node).

Every process the daemons start (job scripts, steps, what those start) carries
``MARK`` in its environment with this instance's token, so ``processes()``
finds whatever is left of them by reading ``/proc/*/environ``.

    python tests/slurm_local.py up FOLDER [--gpus 2]    # prints the SLURM_CONF to export
    python tests/slurm_local.py down FOLDER
"""
from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

MARK = "RAYFED_DG_LOCAL_SLURM"
DAEMONS = ("munged", "slurmctld", "slurmd")


def missing() -> list[str]:
    """The Slurm and munge programs this machine lacks (empty: it can run a local Slurm)."""
    return [p for p in (*DAEMONS, "sbatch", "scontrol", "srun")
            if shutil.which(p) is None and not Path("/usr/sbin", p).is_file()]


def _exe(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _hardware() -> dict[str, str]:
    """This machine as slurmd sees it (``slurmd -C``): NodeName, CPUs, Boards, ... RealMemory."""
    out = subprocess.run([_exe("slurmd"), "-C"], capture_output=True, text=True, check=True).stdout
    return dict(re.findall(r"(\w+)=(\S+)", out.splitlines()[0]))


class LocalSlurm:
    def __init__(self, folder: str | Path, gpus: int = 2, cpus: int | None = None):
        self.dir = Path(folder).resolve()
        self.gpus = gpus
        self.cpus = cpus
        self.token = secrets.token_hex(8)
        self.pids: dict[str, int] = {}
        self._procs: dict[str, subprocess.Popen] = {}
        self.node = ""
        state = self.dir / "local-slurm.json"
        if state.is_file():  # an instance started by `up` in another process
            s = json.loads(state.read_text())
            self.token, self.pids, self.node = s["token"], s["pids"], s["node"]

    # ------------------------------------------------------------------ files
    @property
    def conf(self) -> Path:
        return self.dir / "slurm.conf"

    @property
    def socket(self) -> Path:
        return self.dir / "munge" / "munge.socket"

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """Environment for Slurm's commands (sbatch, scontrol) of this Slurm, marked."""
        env = dict(os.environ if base is None else base)
        env.update({"SLURM_CONF": str(self.conf), MARK: self.token})
        return env

    def write(self) -> None:
        d = self.dir
        for sub in ("munge", "ctld", "spool", "log", "dev"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(d / "munge", 0o711)  # the socket is reachable, the key (0600) is not
        key = d / "munge" / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        os.chmod(key, 0o600)
        for i in range(self.gpus):  # "device files": slurmd wants character devices, and /dev/null is one
            dev = d / "dev" / f"nvidia{i}"
            if not dev.is_symlink():
                dev.symlink_to("/dev/null")
        hw = _hardware()
        self.node = hw["NodeName"]
        cpus = self.cpus or int(hw["CPUs"])
        node = (f"NodeName={self.node} NodeAddr=127.0.0.1 NodeHostname={self.node} CPUs={cpus} "
                f"Boards={hw.get('Boards', 1)} SocketsPerBoard={hw.get('SocketsPerBoard', 1)} "
                f"CoresPerSocket={hw.get('CoresPerSocket', cpus)} ThreadsPerCore={hw.get('ThreadsPerCore', 1)} "
                f"RealMemory={hw.get('RealMemory', 1000)}" + (f" Gres=gpu:{self.gpus}" if self.gpus else "")
                + " State=UNKNOWN")
        self.conf.write_text("\n".join([
            "ClusterName=rayfeddg",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.socket}",
            f"StateSaveLocation={d / 'ctld'}",
            f"SlurmdSpoolDir={d / 'spool'}",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}",
            f"SlurmdPidFile={d / 'slurmd.pid'}",
            f"SlurmctldLogFile={d / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={d / 'log' / 'slurmd.log'}",
            "SlurmdParameters=config_overrides",  # the node as configured here, whatever the hardware says
            "ProctrackType=proctrack/linuxproc",  # no cgroup plugin: steps are tracked as process trees
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "GresTypes=gpu",
            "SchedulerType=sched/backfill",
            "MpiDefault=none",
            "MailProg=/bin/true",
            "ReturnToService=2",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "MinJobAge=600",  # a finished job stays in `scontrol show job` for the test to read
            "KillWait=10",
            "InactiveLimit=0",
            node,
            "PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO",
            ""]))
        (d / "gres.conf").write_text(
            "AutoDetect=off\n"
            + (f"NodeName={self.node} Name=gpu File={d / 'dev'}/nvidia[0-{self.gpus - 1}]\n" if self.gpus else ""))

    # ---------------------------------------------------------------- control
    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(self.dir / "log" / f"{name}.out", "ab")
        # its own session: a Ctrl-C of the test does not reach the daemons before stop() does
        self._procs[name] = subprocess.Popen(cmd, env=self.env(), stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, start_new_session=True)
        self.pids[name] = self._procs[name].pid

    def start(self, timeout: float = 60.0) -> None:
        self.write()
        m = self.dir / "munge"
        self._spawn("munged", [_exe("munged"), "-F", "--force", f"--socket={self.socket}",
                               f"--key-file={m / 'munge.key'}", f"--pid-file={m / 'munged.pid'}",
                               f"--log-file={m / 'munged.log'}", f"--seed-file={m / 'munged.seed'}"])
        self._wait(lambda: self.socket.exists(), timeout, "munged did not open its socket")
        self._spawn("slurmctld", [_exe("slurmctld"), "-D", "-c", "-i", "-f", str(self.conf)])
        self._wait(lambda: self._scontrol("ping").returncode == 0, timeout, "slurmctld does not answer a ping")
        self._spawn("slurmd", [_exe("slurmd"), "-D", "-f", str(self.conf), "-N", self.node])
        self._wait(self._node_idle, timeout, "the node did not become idle")
        (self.dir / "local-slurm.json").write_text(json.dumps({"token": self.token, "pids": self.pids,
                                                                "node": self.node}))

    def _wait(self, ok, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ok():
            dead = [n for n, p in self._procs.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                self.stop()
                logs = {p.name: p.read_text()[-1500:] for p in sorted((self.dir / "log").glob("*")) if p.is_file()}
                raise RuntimeError(f"local Slurm: {what} (exited: {dead}); logs: {logs}")
            time.sleep(0.3)

    def _scontrol(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["scontrol", *args], env=self.env(), capture_output=True, text=True, timeout=30)

    def _node_idle(self) -> bool:
        r = self._scontrol("show", "node", self.node)
        return r.returncode == 0 and bool(re.search(r"State=IDLE\b", r.stdout))

    def stop(self, timeout: float = 15.0) -> None:
        """End this instance's daemons by process id: slurmd, slurmctld, munged, in that order."""
        for name in reversed(DAEMONS):
            pid = self.pids.get(name)
            if pid is None:
                continue
            p = self._procs.get(name)
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if p is not None:
                    if p.poll() is not None:
                        break
                elif not Path(f"/proc/{pid}").exists():
                    break
                time.sleep(0.1)
            else:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                if p is not None:
                    p.wait()
        self.pids.clear()

    def processes(self) -> list[tuple[int, str]]:
        """(pid, command line) of every live process carrying this instance's mark (daemons, jobs, Ray)."""
        want = f"{MARK}={self.token}".encode()
        out = []
        for p in Path("/proc").iterdir():
            if not p.name.isdigit() or int(p.name) == os.getpid():
                continue
            try:
                if want in (p / "environ").read_bytes().split(b"\0"):
                    out.append((int(p.name), (p / "cmdline").read_bytes().replace(b"\0", b" ").decode()))
            except OSError:  # gone, or a kernel thread
                pass
        return out

    def job_processes(self) -> list[tuple[int, str]]:
        """``processes()`` less the daemons themselves (and slurmctld's script helper, slurmscriptd)."""
        daemons = set(self.pids.values())
        return [(pid, cmd) for pid, cmd in self.processes()
                if pid not in daemons and not cmd.startswith("slurmctld: slurmscriptd")]

    # ------------------------------------------------------------------- jobs
    def sbatch(self, args: list[str], env: dict[str, str] | None = None, cwd: str | Path | None = None,
               timeout: float = 600.0) -> tuple[int, int]:
        """``sbatch --parsable --wait ARGS``: (job id, the job's exit code); a job over ``timeout`` is cancelled."""
        p = subprocess.Popen(["sbatch", "--parsable", "--wait", *args], env=self.env(env), cwd=cwd,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            job = out.strip().split(";")[0]
            if job:
                subprocess.run(["scancel", job], env=self.env(), timeout=30)
            raise RuntimeError(f"job {job or '?'} ran over {timeout:g} s and was cancelled") from None
        job = out.strip().split(";")[0]
        if not job.isdigit():
            raise RuntimeError(f"sbatch failed ({p.returncode}): {err.strip()}")
        return int(job), p.returncode

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job -d`` as a dict (a finished job is kept MinJobAge seconds)."""
        r = self._scontrol("show", "job", "-d", str(job_id))
        return dict(re.findall(r"(\w[\w/:]*)=(\S*)", r.stdout))

    def __enter__(self) -> LocalSlurm:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=["up", "down"])
    ap.add_argument("folder")
    ap.add_argument("--gpus", type=int, default=2)
    args = ap.parse_args(argv)
    s = LocalSlurm(args.folder, gpus=args.gpus)
    if args.action == "up":
        if missing():
            print(f"missing: {' '.join(missing())} (apt-get install slurm-wlm munge)", file=sys.stderr)
            return 2
        s.start()
        print(f"export SLURM_CONF={s.conf}")
    else:
        s.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
