"""``run_driver`` of ``tuning/slurm_ray.sh`` without Slurm: a job shell that
sources it runs a stand-in driver (it saves for 1 s after a Ctrl-C), signalled
as a time limit or ``scancel`` would signal the batch shell.  A signal ends
the job only once the driver has saved, with exit code 130 and the resume
line, whatever signals follow; a driver's own 130 or 143 is a stop too; once
the driver is done, a signal is the shell's default again."""
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO, sigint_as_in_a_terminal

DRIVER = """
import pathlib, sys, time
here = pathlib.Path(sys.argv[1])
if len(sys.argv) > 2:
    sys.exit(int(sys.argv[2]))
(here / "started").touch()
try:
    time.sleep(60)
except KeyboardInterrupt:
    (here / "saving").touch()
    time.sleep(1)
    (here / "saved").touch()
    sys.exit(130)
"""

JOB = """set -euo pipefail
say() { echo "job: $*"; }
source tuning/slurm_ray.sh
run_driver "RESUME=1 sbatch job" "$@"
say "driver done"
touch "$DIR/tail"
while [[ ! -e "$DIR/go" ]]; do sleep 0.1; done
say "tail done"
"""


@pytest.fixture
def jobs():
    """The jobs a test started; whatever of them a failing test left running (the job shell and its driver,
    a process group of their own) is killed by its group's id."""
    started: list[subprocess.Popen] = []
    yield started
    for job in started:
        try:
            os.killpg(job.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        job.communicate()


def _job(jobs: list, tmp_path, *args: str) -> subprocess.Popen:
    (tmp_path / "driver.py").write_text(DRIVER)
    (tmp_path / "job.sh").write_text(JOB)
    # SIGINT as a batch shell has it: not ignored
    jobs.append(subprocess.Popen(["bash", str(tmp_path / "job.sh"), sys.executable, str(tmp_path / "driver.py"),
                                  str(tmp_path), *args], cwd=REPO, env={"DIR": str(tmp_path), "PATH": "/usr/bin:/bin"},
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                 preexec_fn=sigint_as_in_a_terminal))
    return jobs[-1]


def _until(path, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 30
    while not path.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.05)


def test_a_signalled_job_exits_130_with_the_resume_line_only_after_the_driver_saved(jobs, tmp_path):
    job = _job(jobs, tmp_path)
    _until(tmp_path / "started", job)
    job.send_signal(signal.SIGTERM)  # the time limit: the driver gets Ctrl-C and saves
    _until(tmp_path / "saving", job)
    job.send_signal(signal.SIGTERM)  # a second signal while it saves ends nothing early
    job.wait(timeout=30)
    saved = (tmp_path / "saved").exists()  # looked at as the job ended, before the driver's output closes
    out = job.communicate(timeout=10)[0]
    assert job.returncode == 130 and saved, out
    assert out.splitlines() == ["job: stopped before the end by a signal (a time limit, scancel); continue with: "
                                "RESUME=1 sbatch job"]


@pytest.mark.parametrize("rc, job_rc", [(130, 130), (143, 130), (3, 3), (0, 0)])
def test_a_driver_that_ends_by_itself_gives_the_job_its_code_or_130_for_a_stop(jobs, tmp_path, rc, job_rc):
    job = _job(jobs, tmp_path, str(rc))
    if rc == 0:
        _until(tmp_path / "tail", job)
        (tmp_path / "go").touch()
    out = job.communicate(timeout=10)[0]
    assert job.returncode == job_rc, out
    said = [line for line in out.splitlines() if "continue with: RESUME=1 sbatch job" in line]
    assert len(said) == (job_rc == 130) and ("tail done" in out) == (rc == 0), out


def test_once_the_driver_is_done_a_signal_ends_the_job_as_it_would_any_shell(jobs, tmp_path):
    job = _job(jobs, tmp_path, "0")
    _until(tmp_path / "tail", job)
    job.send_signal(signal.SIGTERM)  # after a finished run: no resume line, and no carrying on either
    out = job.communicate(timeout=10)[0]
    assert job.returncode == -signal.SIGTERM and "tail done" not in out and "continue with" not in out, out
