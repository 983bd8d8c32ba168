"""Shared fixtures and the test tiers.

``python -m pytest -q -m "not slow"`` is the fast tier (every value test and
the in-process engine tests on one shared local Ray), the README's test
command; ``.ci/run`` runs it, then the slow tier (``-m slow``: its ``cluster``
half beside the rest).  Markers: ``slow`` (CLI subprocesses with their
own Ray, sweeps, real-data decoding), ``ray`` (uses the session's local
Ray), ``data`` (reads the real datasets under the data root; skipped when
absent), ``cluster`` (multi-node Ray on this machine).

The data root: ``$RAYFED_DG_DATA`` when set, else this checkout's neighbour
``../shared/data`` when it exists (set here, so that configs naming
``data.root: PACS`` and subprocesses find it).
"""
import contextlib
import os
import sys
from pathlib import Path

import pytest

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
REPO = Path(__file__).resolve().parents[1]
if not os.environ.get("RAYFED_DG_DATA") and SHARED_DATA.is_dir():
    os.environ["RAYFED_DG_DATA"] = str(SHARED_DATA)
DATA_ROOT = Path(os.environ.get("RAYFED_DG_DATA") or Path.home() / "data").expanduser()


def needs_data(folder: str):
    """Skip unless the data root holds ``folder`` (the ``data`` marker goes with it)."""
    return pytest.mark.skipif(not (DATA_ROOT / folder).is_dir(),
                              reason=f"{DATA_ROOT / folder} is not present (set RAYFED_DG_DATA or run "
                                     "`rayfed-dg data fetch`)")


def _sigterm_once_as_ctrl_c(signum, frame):
    import signal

    # a second SIGTERM (one to the group, one from .ci/run) lets the teardown finish; a handler, not SIG_IGN,
    # which the processes a teardown starts would inherit
    signal.signal(signal.SIGTERM, lambda *_: None)
    raise KeyboardInterrupt


def pytest_configure(config):
    # SIGTERM (`kill`, a CI runner's cancel, .ci/run passing its own on) stops the session as Ctrl-C does: fixtures
    # are torn down, so the Ray clusters, Slurm daemons and moto servers tests started are stopped, not left running
    import signal
    import threading

    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _sigterm_once_as_ctrl_c)
    # one decode cache for the whole session (real datasets are decoded once, not per test);
    # tests of the cache itself point RAYFED_DG_CACHE at their own folder
    if "RAYFED_DG_CACHE" not in os.environ:
        os.environ["RAYFED_DG_CACHE"] = str(Path(config.rootpath) / ".pytest_cache" / "rayfed_dg")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "ray_session" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.ray)


@pytest.fixture(scope="session")
def ray_session():
    import ray

    if not ray.is_initialized():
        from rayfed_dg.config import EngineConfig

        # workers at the niceness a run gives them (engine.worker_niceness), not Ray's 15
        ray.init(num_cpus=2, include_dashboard=False, configure_logging=True, logging_level="ERROR",
                 log_to_driver=False, _system_config={"worker_niceness": EngineConfig().worker_niceness})
    yield ray


@pytest.fixture(scope="session")
def tiny_ds():
    from rayfed_dg.data import load_dataset

    return load_dataset("embedded_digits", None, 16)


@pytest.fixture(scope="session")
def engine_host(ray_session):
    """``engine_host(ds, n_workers)``: the session's ``EngineHost`` of
    ``n_workers`` workers bound to ``ds`` (one per dataset object and worker
    count, started on first use, closed when the session ends), as an
    experiment's federations share theirs: ``host.open(cfg, split, classes)``
    or ``run_federation(..., host=host)`` runs a test's federation on it and
    leaves it open for the next.  A run's numbers do not depend on which
    actors ran it (tests/test_host.py compares a shared host with fresh ones).

    Its workers are started with ``tiny_cfg()``'s engine settings (so that
    federations of ``tiny_cfg`` configs open on it; one torch thread each, as
    on actors of their own) but ask Ray for no CPU: idle between tests, they
    never hold back the tests that start actors of their own on the 2-CPU
    ``ray_session`` (a run without ``host=`` sizes its pool to the whole
    cluster).  Not for tests whose point is fresh actors, killing workers or
    a resume in a new process: those keep starting their own."""
    from rayfed_dg.engine.running.host import EngineHost

    made: dict = {}

    def host(ds, n_workers: int = 1):
        key = (id(ds), n_workers)
        if key not in made:  # the dataset is kept with its host: its id cannot be reused by another one
            refs = [ray_session.put(ds.images), ray_session.put(ds.labels)]
            made[key] = ds, EngineHost(tiny_cfg().engine, refs, n_workers, {"num_cpus": 0})
        return made[key][1]

    yield host
    for _, h in made.values():
        h.close()


def tiny_cfg(*overrides):
    from rayfed_dg.config import load_config

    base = ["data.resolution=16", "model.width=8", "training.rounds=2", "training.batch_size=32",
            "training.lr=0.05", "engine.num_cpus_per_worker=1", "evaluation.batch_size=512",
            "output.save_best_checkpoint=false"]
    return load_config(None, base + list(overrides))


def tiny_federation(ds, target, *sets, host=None, **kw):
    """``tiny_cfg(*sets)``'s federation of ``ds`` with ``target`` left out, run
    by ``run_federation`` (its keywords pass through, ``progress`` off) on
    ``host`` (``engine_host``), or on actors of its own as in a new process."""
    import ray

    from rayfed_dg.data import leave_one_domain_out
    from rayfed_dg.engine import run_federation

    cfg = tiny_cfg(*sets)
    split = leave_one_domain_out(ds, target, cfg.data.val_fraction, cfg.data.split_seed)
    return run_federation(cfg, split, ray.put(ds.images), ray.put(ds.labels), ds.num_classes, progress=False,
                          host=host, **kw)


def server_rounds(ray, cfg, ds, target="texture", workers=1, rounds=1, host=None):
    """Run ``rounds`` rounds on a real server actor; returns (split, [state
    after each round], broadcast state at the end).  ``host``: a running
    ``EngineHost`` of ``ds`` (``engine_host``) to open the federation on and
    leave running; without it, the server's own actors are started and ended."""
    from rayfed_dg.data import leave_one_domain_out
    from rayfed_dg.engine import launch_server

    split = leave_one_domain_out(ds, target, cfg.data.val_fraction, cfg.data.split_seed)
    server = host.open(cfg, split, ds.num_classes) if host is not None else launch_server(
        cfg, split, [ray.put(ds.images), ray.put(ds.labels)], ds.num_classes, workers)
    states = []
    for _ in range(rounds):
        ray.get(server.run_round.remote())
        states.append(ray.get(server.get_state.remote()))
    bcast = ray.get(server.current.remote()).broadcast_state()
    if host is None:
        ray.get(server.shutdown.remote())
    return split, states, bcast


# What Ray's SIGTERM handler raises when it lands in a finaliser, then a line: run after ``before`` by ``in_python``
FINALISER_EXIT = "class Ends:\n    def __del__(self): raise SystemExit(3)\nEnds()\nprint('ran on')\n"


def in_python(code: str, *args: str):
    """``python -c code args``, its output captured."""
    import subprocess

    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)


def tiny_space(path, *sets):
    """gPerXAN's lambda over {0, 1} on the quickstart at 16 px, width 8 (``sets``: the
    space's extra ``set`` overrides, e.g. ``training.rounds=4``), written to ``path``."""
    import yaml

    path.write_text(yaml.safe_dump({
        "config": "configs/quickstart.yaml",
        "set": ["compare=null", "method.name=gperxan", "data.resolution=16", "model.width=8", *sets],
        "params": {"method.lam": {"grid": [0.0, 1.0]}}}))
    return path



# ``rayfed-dg`` whose driver stops after a checkpoint, so that a test's Ctrl-C always lands mid-run, never
# racing the run's end however busy the machine is.  Only the driver's wait is added; the run, its Ray workers and
# its checkpoint are the real ones.
_HELD_CLI = """
import sys, time
from pathlib import Path
from rayfed_dg.cli import main
from rayfed_dg.engine.store.rundir import RunDir
saves, after, marker = set(), int(sys.argv[1]), Path(sys.argv[2])
save = RunDir.save_checkpoint
def held(self, target, round, *args, **kwargs):
    save(self, target, round, *args, **kwargs)
    saves.add((str(self.path), target))
    if len(saves) >= after:
        marker.touch()
        while True:
            time.sleep(0.05)
RunDir.save_checkpoint = held
sys.exit(main(sys.argv[3:]))
"""


def held_cli(args: list[str], marker, federations: int = 1) -> list[str]:
    """The command ``rayfed-dg ARGS`` whose driver, once ``federations``
    federations have each saved a checkpoint, touches ``marker`` and waits
    there (for Ctrl-C) instead of going on."""
    return [sys.executable, "-c", _HELD_CLI, str(federations), str(marker), *args]


def sigint_as_in_a_terminal() -> None:
    """``preexec_fn`` of a child that a test signals as Ctrl-C would: SIGINT at its default.  pytest started in
    the background by a non-interactive shell (nohup, ``cmd &``, some CI runners) ignores SIGINT, a child
    inherits that, and Python honours an inherited SIG_IGN: the child would go on as if never interrupted."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def ctrl_c_when(cmd: list[str], ready, what: str, timeout: float = 600, sigterm: bool = False,
                cwd=None) -> tuple[int, str, str]:
    """Run the CLI ``cmd`` in its own process group and, once ``ready()``
    holds, send it SIGINT as Ctrl-C in a terminal does (to the whole group);
    (exit code, stdout, stderr).  ``what``: the state ``ready`` waits for.
    ``sigterm``: SIGTERM to the command's process alone instead, as ``kill
    PID``, ``timeout`` or ``docker stop`` send it.  ``cwd``: where it runs."""
    import os
    import signal
    import subprocess

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=sigint_as_in_a_terminal, cwd=cwd)
    with group_killed_after(proc):
        wait_until(ready, proc, f"the run ended or stalled before {what}", timeout)
        if sigterm:
            os.kill(proc.pid, signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err


def wait_until(ready, proc, failure: str, timeout: float = 60) -> None:
    """Poll ``ready()`` while ``proc`` runs; ``failure`` if it ends first or ``timeout`` s pass."""
    import time

    deadline = time.time() + timeout
    while not ready():
        assert proc.poll() is None and time.time() < deadline, failure
        time.sleep(0.05)


@contextlib.contextmanager
def group_killed_after(proc):
    """Whatever is left of ``proc``'s process group (started with ``start_new_session``) is killed after the block,
    even when it fails."""
    import signal

    try:
        yield proc
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
