"""A Slurm of one or more nodes on this machine, for running the ``tuning/*.sbatch`` scripts for real.

``LocalSlurm(folder)`` writes a private munge key, ``slurm.conf`` and
``gres.conf`` into ``folder`` and starts ``munged``, ``slurmctld`` and a
``slurmd`` per node in the foreground, keeping their process ids; ``stop``
ends them by id (never ``scontrol shutdown`` of anyone else's Slurm, never
``pkill``).  It uses its own munge socket and free ports, so the machine's
own munge/Slurm (if any) is untouched.

One node listens on loopback.  With ``nodes=2`` or more, each node is a host
of its own: a network namespace (``ip netns``) joined by a veth pair to a
bridge on this machine, with its own address on a private /24, and its
``slurmd`` runs there in its own UTS and mount namespaces, with its own
hostname and an ``/etc/hosts`` (bound over the machine's, in that mount
namespace only) naming every node, so ``hostname --ip-address`` on a node
gives that node's address, as on a real cluster.  slurmctld listens on the
bridge's address.  Debian's slurmd is not built with --enable-multiple-slurmd,
and two slurmds sharing one address would make Ray's nodes share one too
(ports, sockets): real nodes never do.  ``stop`` deletes the namespaces, the
veths and the bridge it made (names carry this instance's token).

Each node has ``cpus`` CPUs (default: this machine's, ``slurmd -C``) and
``gpus`` declared GPUs: GRES ``gpu`` whose ``File`` entries
``folder/dev/nvidia0..`` are links to ``/dev/null`` (slurmd wants character
devices; it sets ``CUDA_VISIBLE_DEVICES`` from their numbers, as on a GPU node).

Every process the daemons start (job scripts, steps, what those start) carries
``MARK`` in its environment with this instance's token, so ``processes()``
finds whatever is left of them by reading ``/proc/*/environ``.

    python tests/slurm_local.py up FOLDER [--gpus 2] [--nodes 2]    # prints the SLURM_CONF to export
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


def missing(nodes: int = 1) -> list[str]:
    """The programs this machine lacks to run a local Slurm of ``nodes`` nodes (empty: none)."""
    return [p for p in (*DAEMONS, "sbatch", "scontrol", "srun", *(("ip", "nsenter", "unshare") if nodes > 1 else ()))
            if shutil.which(p) is None and not Path("/usr/sbin", p).is_file()]


class NoNetworkNamespaces(RuntimeError):
    """This machine lets no one here make a bridge (no CAP_NET_ADMIN): no nodes of their own."""


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


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"local Slurm: ip {' '.join(args)}: {r.stderr.strip()}")


def _free_subnet() -> str:
    """``10.241.N`` for an N no address or route of this machine uses."""
    used = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout + \
        subprocess.run(["ip", "-4", "route"], capture_output=True, text=True).stdout
    for n in secrets.SystemRandom().sample(range(1, 255), 254):
        if f"10.241.{n}." not in used:
            return f"10.241.{n}"
    raise RuntimeError("local Slurm: no free 10.241.N.0/24 subnet")


class LocalSlurm:
    def __init__(self, folder: str | Path, gpus: int = 2, cpus: int | None = None, nodes: int = 1):
        self.dir = Path(folder).resolve()
        self.gpus = gpus
        self.cpus = cpus
        self.token = secrets.token_hex(8)
        self.pids: dict[str, int] = {}
        self._procs: dict[str, subprocess.Popen] = {}
        self.nodes: list[str] = []
        self.addrs: dict[str, str] = {}  # node -> its address (several nodes: in its own network namespace)
        self.subnet = ""  # several nodes: 10.241.N, the bridge is .1 and node i is .(i+1)
        self.count = nodes
        if self._state.is_file():  # an instance started by `up` in another process
            st = json.loads(self._state.read_text())
            self.token, self.pids, self.nodes, self.addrs, self.subnet = \
                st["token"], st["pids"], st["nodes"], st["addrs"], st["subnet"]
            self.count = len(self.nodes)

    # names of this instance's network devices and namespaces (interface names are at most 15 characters)
    @property
    def _bridge(self) -> str:
        return f"rf{self.token[:6]}br"

    def _netns(self, i: int) -> str:
        return f"rf{self.token[:6]}n{i}"

    def _veth(self, i: int) -> str:
        return f"rf{self.token[:6]}h{i}"

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
        cpus = self.cpus or int(hw["CPUs"])
        if self.count == 1:
            self.nodes, ctld = [hw["NodeName"]], f"{hw['NodeName']}(127.0.0.1)"
            self.addrs = {self.nodes[0]: "127.0.0.1"}
        else:
            self.subnet = _free_subnet()
            self.nodes = [f"rfnode{i}" for i in range(1, self.count + 1)]
            self.addrs = {n: f"{self.subnet}.{i + 2}" for i, n in enumerate(self.nodes)}
            # slurmctld runs here: it checks that the host named in SlurmctldHost is this one
            ctld = f"{hw['NodeName']}({self.subnet}.1)"
            (d / "hosts").write_text("127.0.0.1 localhost\n" + f"{self.subnet}.1 {hw['NodeName']}\n"
                                     + "".join(f"{a} {n}\n" for n, a in self.addrs.items()))
        for n in self.nodes:
            (d / "spool" / n).mkdir(exist_ok=True)
        hw_line = (f"CPUs={cpus} Boards={hw.get('Boards', 1)} SocketsPerBoard={hw.get('SocketsPerBoard', 1)} "
                   f"CoresPerSocket={hw.get('CoresPerSocket', cpus)} ThreadsPerCore={hw.get('ThreadsPerCore', 1)} "
                   f"RealMemory={hw.get('RealMemory', 1000)}" + (f" Gres=gpu:{self.gpus}" if self.gpus else "")
                   + " State=UNKNOWN")
        self.conf.write_text("\n".join([
            "ClusterName=rayfeddg",
            f"SlurmctldHost={ctld}",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.socket}",
            f"StateSaveLocation={d / 'ctld'}",
            f"SlurmdSpoolDir={d / 'spool' / '%n'}",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}",
            f"SlurmdPidFile={d / 'spool' / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={d / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={d / 'log' / 'slurmd-%n.log'}",
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
            *(f"NodeName={n} NodeAddr={a} NodeHostname={n} {hw_line}" for n, a in self.addrs.items()),
            "PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO",
            ""]))
        (d / "gres.conf").write_text(
            "AutoDetect=off\n"
            + "".join(f"NodeName={n} Name=gpu File={d / 'dev'}/nvidia[0-{self.gpus - 1}]\n"
                      for n in self.nodes if self.gpus))

    def _network(self) -> None:
        """The bridge on this machine and each node's namespace, joined to it by a veth pair.  Any step
        refused (no CAP_NET_ADMIN, no veth or bridge support) deletes what was made and raises
        ``NoNetworkNamespaces``."""
        net = self.subnet
        try:
            _ip("link", "add", self._bridge, "type", "bridge")
            _ip("addr", "add", f"{net}.1/24", "dev", self._bridge)
            _ip("link", "set", self._bridge, "up")
            for i, node in enumerate(self.nodes, 1):
                ns, host_end, node_end = self._netns(i), self._veth(i), f"rf{self.token[:6]}v{i}"
                _ip("netns", "add", ns)
                _ip("link", "add", host_end, "type", "veth", "peer", "name", node_end)
                _ip("link", "set", node_end, "netns", ns)
                _ip("link", "set", host_end, "master", self._bridge)
                _ip("link", "set", host_end, "up")
                _ip("-n", ns, "addr", "add", f"{self.addrs[node]}/24", "dev", node_end)
                _ip("-n", ns, "link", "set", node_end, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except RuntimeError as e:
            self._unnetwork()
            raise NoNetworkNamespaces(str(e)) from None

    def _unnetwork(self) -> None:
        """Delete what ``_network`` made (whatever of it exists)."""
        for i in range(1, len(self.nodes) + 1):
            subprocess.run(["ip", "link", "del", self._veth(i)], capture_output=True)  # its peer goes with it
            subprocess.run(["ip", "netns", "del", self._netns(i)], capture_output=True)
        subprocess.run(["ip", "link", "del", self._bridge], capture_output=True)

    # ---------------------------------------------------------------- control
    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(self.dir / "log" / f"{name}.out", "ab")
        # its own session: a Ctrl-C of the test does not reach the daemons before stop() does
        self._procs[name] = subprocess.Popen(cmd, env=self.env(), stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, start_new_session=True)
        self.pids[name] = self._procs[name].pid
        self._save()

    @property
    def _state(self) -> Path:
        return self.dir / "local-slurm.json"

    def _save(self) -> None:
        """What ``down`` needs to end this instance, written as soon as each part exists (the first daemon
        comes before the namespaces, whose names follow from the token), so that a test killed hard
        mid-start leaves nothing ``down`` cannot find."""
        self._state.write_text(json.dumps({"token": self.token, "pids": self.pids, "nodes": self.nodes,
                                           "addrs": self.addrs, "subnet": self.subnet}))

    def start(self, timeout: float = 60.0) -> None:
        self.write()
        m = self.dir / "munge"
        self._spawn("munged", [_exe("munged"), "-F", "--force", f"--socket={self.socket}",
                               f"--key-file={m / 'munge.key'}", f"--pid-file={m / 'munged.pid'}",
                               f"--log-file={m / 'munged.log'}", f"--seed-file={m / 'munged.seed'}"])
        self._wait(lambda: self.socket.exists(), timeout, "munged did not open its socket")
        if self.count > 1:
            try:
                self._network()
            except RuntimeError:
                self.stop()
                raise
        self._spawn("slurmctld", [_exe("slurmctld"), "-D", "-c", "-i", "-f", str(self.conf)])
        self._wait(lambda: self._scontrol("ping").returncode == 0, timeout, "slurmctld does not answer a ping")
        for i, node in enumerate(self.nodes, 1):
            slurmd = [_exe("slurmd"), "-D", "-f", str(self.conf), "-N", node]
            if self.count > 1:  # each exec keeps the process id: the one kept is slurmd's
                # nsenter, not `ip netns exec`: that remounts /sys, hiding the cgroup file system slurmd reads
                slurmd = ["nsenter", f"--net=/run/netns/{self._netns(i)}", "unshare", "--uts", "--mount",
                          "--propagation", "private", "sh", "-c",
                          'mount --bind "$0" /etc/hosts && hostname "$1" && shift && exec "$@"',
                          str(self.dir / "hosts"), node, *slurmd]
            self._spawn(f"slurmd-{node}", slurmd)
        self._wait(self._nodes_idle, timeout, "the nodes did not become idle")

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

    def _nodes_idle(self) -> bool:
        r = self._scontrol("show", "node", ",".join(self.nodes))
        return r.returncode == 0 and len(re.findall(r"State=IDLE\b", r.stdout)) == len(self.nodes)

    def stop(self, timeout: float = 15.0) -> None:
        """End this instance's daemons by process id: the slurmds, slurmctld, munged, in that order; then
        delete its network namespaces, veths and bridge."""
        for name, pid in reversed(list(self.pids.items())):
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
        if self.subnet:
            self._unnetwork()
        self._state.unlink(missing_ok=True)  # its process ids may be anyone's from now on

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
    def submit(self, args: list[str], env: dict[str, str] | None = None, cwd: str | Path | None = None) -> int:
        """``sbatch --parsable ARGS``: the job's id."""
        r = subprocess.run(["sbatch", "--parsable", *args], env=self.env(env), cwd=cwd, capture_output=True,
                           text=True, timeout=60)
        job = r.stdout.strip().split(";")[0]
        if not job.isdigit():
            raise RuntimeError(f"sbatch failed ({r.returncode}): {r.stderr.strip()}")
        return int(job)

    def wait(self, job: int, timeout: float = 600.0) -> int:
        """The job's exit code once it has ended; a job over ``timeout`` is cancelled."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job)
            if info.get("JobState") not in (None, "PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED"):
                return int(info["ExitCode"].split(":")[0])
            if time.monotonic() > deadline:
                subprocess.run(["scancel", str(job)], env=self.env(), timeout=30)
                raise RuntimeError(f"job {job} ran over {timeout:g} s and was cancelled")
            time.sleep(0.5)

    def sbatch(self, args: list[str], env: dict[str, str] | None = None, cwd: str | Path | None = None,
               timeout: float = 600.0) -> tuple[int, int]:
        """``submit`` then ``wait``: (job id, the job's exit code)."""
        job = self.submit(args, env, cwd)
        return job, self.wait(job, timeout)

    def signal(self, job: int, sig: str = "TERM") -> None:
        """Send ``sig`` to every process of the job, its batch shell included, as Slurm's time limit does
        (``scancel --signal=SIG --full``; the limit then follows with SIGKILL after KillWait)."""
        subprocess.run(["scancel", f"--signal={sig}", "--full", str(job)], env=self.env(), check=True, timeout=30)

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
    ap.add_argument("--nodes", type=int, default=1)
    args = ap.parse_args(argv)
    s = LocalSlurm(args.folder, gpus=args.gpus, nodes=args.nodes)
    if args.action == "up":
        if missing(args.nodes):
            print(f"missing: {' '.join(missing(args.nodes))} (apt-get install slurm-wlm munge iproute2)",
                  file=sys.stderr)
            return 2
        s.start()
        print(f"export SLURM_CONF={s.conf}")
    else:
        s.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
