"""A fork server for bench/mutation.py: one per job, each with its own copy of the tree.

    python bench/mutation_server.py TREE     # then one JSON request a line on stdin, one JSON reply a line on stdout

It imports the heavy third-party packages once (torch, numpy, Ray, pytest) and nothing of the project, then for each
request writes the mutant's source into ``TREE``, forks, and runs pytest in the child, which imports the project
afresh from ``TREE`` (mutated); the original source is put back before the reply.  A mutant's test run then costs
its tests, not an interpreter's start-up and torch's import each time.

Requests: ``{"module": path under TREE, "source": text or null for the unmutated tree, "args": pytest arguments,
"timeout": seconds, "max_memory": bytes or null, "order": {test id: seconds} or null, "record": a path for the tests'
durations or null}``; replies: ``{"rc": exit status, 124 on timeout, 137 past max_memory, "output": its tail}``.  The
child leads its own session (the processes Ray's tests start included), which a timeout kills whole, and so does a
mutant whose session holds more than ``max_memory`` of anonymous resident memory (a mutated flush bound of the exact
sum grew past 13 GiB; left alone, the machine's other work, a training run's Ray workers, is what an out-of-memory
killer ends).
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time

sys.dont_write_bytecode = True  # a mutant written within the same second as its original must not reuse a .pyc


class FastFirst:
    """A pytest plugin: each file's tests in the order of their unmutated durations (``order``, the fastest first),
    so that ``-x`` ends a killed mutant's run at the cheapest test that kills it; without ``order`` it only records
    those durations.  Files keep their order, so a module-scoped fixture is still set up once."""

    def __init__(self, order: dict[str, float] | None):
        self.order, self.seconds = order or {}, {}

    def pytest_collection_modifyitems(self, items):
        files = {}
        for item in items:
            files.setdefault(item.nodeid.split("::")[0], len(files))
        given = {id(item): k for k, item in enumerate(items)}
        items.sort(key=lambda i: (files[i.nodeid.split("::")[0]], self.order.get(i.nodeid, float("inf")),
                                  given[id(i)]))

    def pytest_runtest_logreport(self, report):
        self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + report.duration


def _child(tree: str, req: dict, log: str) -> None:
    os.setsid()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.chdir(tree)
    sys.path.insert(0, tree)
    os.environ["PYTHONPATH"] = tree  # Ray's workers, started by the tests, import the mutant too
    os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
    import pytest

    plugin = FastFirst(req.get("order"))
    rc = 1  # a mutant that breaks pytest itself is killed, as a failing run is
    try:
        rc = int(pytest.main(req["args"], plugins=[plugin]))
        if req.get("record"):
            with open(req["record"], "w") as f:
                json.dump(plugin.seconds, f)
    finally:  # whatever happens, the child never returns into the server's loop
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)


def _session(sid: int) -> dict[int, int]:
    """The processes of session ``sid`` (the child's: it called ``setsid``; Ray's workers lead process groups of their
    own but stay in it), each with its anonymous resident memory: rss less the pages it shares (the object store's,
    mapped by every Ray process, are not counted again for each).  As ``rayfed_dg/cluster.py`` finds a session's
    processes; not imported from there, since the server imports nothing of the project (each child does, mutated)."""
    import psutil

    out = {}
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid:
                m = p.memory_info()
                out[p.pid] = m.rss - getattr(m, "shared", 0)
        except (psutil.Error, ProcessLookupError, PermissionError):  # a process that ended meanwhile
            continue
    return out


def _end(pid: int) -> None:
    """Kill the child's session: its group, and the groups Ray's workers lead in it."""
    for p in [pid, *_session(pid)]:
        for kill in (os.killpg, os.kill):
            try:
                kill(p, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    os.waitpid(pid, 0)


def _wait(pid: int, timeout: float, max_memory: int | None = None) -> int:
    """The child's exit status; 124 past ``timeout``, 137 once its session holds more than ``max_memory`` bytes
    (checked every half second), its whole session killed."""
    deadline, polls = time.monotonic() + timeout, 0
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        polls += 1
        if max_memory and polls % 25 == 0 and sum(_session(pid).values()) > max_memory:
            _end(pid)
            return 137
        time.sleep(0.02)
    _end(pid)
    return 124


def serve(tree: str) -> None:
    import numpy  # noqa: F401 - imported once here, inherited by every child
    import pytest  # noqa: F401
    import ray  # noqa: F401
    import torch  # noqa: F401

    log = os.path.join(tree, ".mutant.log")
    for line in sys.stdin:
        req = json.loads(line)
        path = os.path.join(tree, req["module"])
        with open(path) as f:
            original = f.read()
        if req["source"] is not None:
            with open(path, "w") as f:
                f.write(req["source"])
        try:
            pid = os.fork()
            if pid == 0:
                _child(tree, req, log)
            try:
                rc = _wait(pid, req["timeout"], req.get("max_memory"))
            except BaseException:  # Ctrl-C, SIGINT: the child's session (its Ray processes too) ends with the server
                _end(pid)
                raise
        finally:
            with open(path, "w") as f:
                f.write(original)
        with open(log) as f:
            tail = f.read()[-4000:]
        if rc == 137:
            tail += f"\nkilled: its tests' anonymous resident memory passed {req['max_memory'] / 2**30:.1f} GiB\n"
        print(json.dumps({"rc": rc, "output": tail}), flush=True)


if __name__ == "__main__":
    serve(sys.argv[1])
