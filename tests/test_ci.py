"""How ``.ci/run`` stops its slow tier, and how a pytest session takes SIGTERM.

The slow tier's two halves run side by side as background jobs of
``.ci/run``.  Ctrl-C and SIGTERM must reach both, once each, and the script
must wait for both to finish tearing down: a half left running keeps its Ray
clusters and Slurm daemons on the machine.  The script's own text runs here,
with a stand-in ``python`` on PATH that records the signals it gets."""
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import REPO, group_killed_after, sigint_as_in_a_terminal, wait_until

FAKE_PYTEST = """\
#!{python}
import os, signal, sys, time
from pathlib import Path
log = Path(os.environ["FAKE_LOG_DIR"]) / ("cluster" if "slow and cluster" in sys.argv else "rest")
got = []
def note(signum, frame):
    got.append(signum)
    with log.open("a") as f:
        f.write(signal.Signals(signum).name + "\\n")
# as pytest: Python keeps an inherited SIG_IGN for SIGINT; tests/conftest.py takes SIGTERM only at its default
if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, note)
if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
    signal.signal(signal.SIGTERM, note)
with log.open("a") as f:
    f.write("started\\n")
print("output of the", log.name, "half", flush=True)
while not got:
    time.sleep(0.02)
time.sleep(0.5)  # the fixtures' teardown; a signal meanwhile is noted too
with log.open("a") as f:
    f.write("done\\n")
sys.exit(2)
"""


def _slow_tier(tmp_path: Path) -> tuple[subprocess.Popen, Path, Path]:
    ci = (REPO / ".ci" / "run").read_text()
    script = "set -euo pipefail\n" + ci[ci.index("\ncluster_log=$(mktemp)\n"):]
    bin_dir, logs, tmp = tmp_path / "bin", tmp_path / "logs", tmp_path / "tmp"
    for d in (bin_dir, logs, tmp):
        d.mkdir()
    (bin_dir / "python").write_text(FAKE_PYTEST.format(python=sys.executable))
    (bin_dir / "python").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "TMPDIR": str(tmp), "FAKE_LOG_DIR": str(logs)}
    proc = subprocess.Popen(["bash", "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, preexec_fn=sigint_as_in_a_terminal)
    return proc, logs, tmp


@pytest.mark.parametrize("how", ["sigterm", "ctrl_c"])
def test_ci_slow_tier_passes_a_stop_to_both_halves_and_waits_for_them(tmp_path, how):
    proc, logs, tmp = _slow_tier(tmp_path)
    with group_killed_after(proc):
        wait_until(lambda: all((logs / h).is_file() and "started" in (logs / h).read_text() for h in ("rest", "cluster")),
                   proc, "the two halves did not both start")
        if how == "sigterm":  # to the script alone, as `kill PID` sends it
            os.kill(proc.pid, signal.SIGTERM)
        else:  # to the whole process group, as Ctrl-C in a terminal
            os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        # read as the script exits: each half got the stop once and had finished its teardown
        got = {h: (logs / h).read_text().split() for h in ("rest", "cluster")}
    name = "SIGTERM" if how == "sigterm" else "SIGINT"
    assert got == {"rest": ["started", name, "done"], "cluster": ["started", name, "done"]}
    assert proc.returncode == 2  # pytest's code for an interrupted session
    assert out.index("output of the rest half") < out.index("the slow tier's multi-node rehearsals") \
        < out.index("output of the cluster half")
    assert not list(tmp.iterdir())  # the cluster half's log removed


def test_a_pytest_session_takes_sigterm_as_ctrl_c_and_tears_down(tmp_path):
    """SIGTERM interrupts the session as Ctrl-C does: its fixtures are torn
    down (what started a cluster stops it) and pytest exits 2.  A second
    SIGTERM (a CI runner's cancel to the group, then .ci/run's pass-on)
    does not cut the teardown short."""
    (tmp_path / "test_held.py").write_text(textwrap.dedent(f"""
        import time
        from pathlib import Path
        import pytest

        @pytest.fixture
        def cluster():
            yield
            Path({str(tmp_path / "tearing_down")!r}).write_text("yes")
            time.sleep(1)
            Path({str(tmp_path / "torn_down")!r}).write_text("yes")

        def test_held(cluster):
            Path({str(tmp_path / "running")!r}).write_text("yes")
            time.sleep(60)
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
                             str(tmp_path / "test_held.py")], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    with group_killed_after(proc):
        wait_until((tmp_path / "running").is_file, proc, "the held test did not start")
        os.kill(proc.pid, signal.SIGTERM)
        wait_until((tmp_path / "tearing_down").is_file, proc, "the fixture's teardown did not start")
        os.kill(proc.pid, signal.SIGTERM)  # the second, during the teardown
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2, out
    assert (tmp_path / "torn_down").read_text() == "yes"
    assert "KeyboardInterrupt" in out
