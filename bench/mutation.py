"""The tests' own strength: a mutation-testing run with cosmic-ray over the numerical core.

    pip install cosmic-ray==8.7.0        # not a dependency of the project: this script is run by hand, not in CI
    python bench/mutation.py                                   # every module below (hours on 2 cores)
    python bench/mutation.py --modules engine/store/selection.py methods/fedgma.py --out runs/mutation
    python bench/mutation.py --recheck runs/mutation/engine_dispatch.md   # its survivors against today's tests
    python bench/mutation.py --sample 40 --modules models/norms.py        # an estimate from 40 random mutants
    python bench/mutation.py --resume --modules engine/aggregation/exact.py --out runs/mutation_full  # in parts

``SCOPES`` narrows a large module to the functions the tests are meant to pin (the sweep's selection, the pool's
failure accounting); the rest of it is not scored. Each module is mutated one plausible single bug at a time (an
arithmetic or comparison operator swapped, a number changed, a condition negated, a boolean flipped, a loop run zero
times, break/continue swapped) in a copy of the working tree (the checkout itself is never touched), and the tests
that guard it (``MODULES``: fast, hand-computed tests, no end-to-end run) are run against each mutant. A mutant the
tests fail on is killed; one they pass is a survivor. The score per module is killed / (killed + survived); timeouts
count as killed (cosmic-ray's rule), and so do mutants whose tests hold more than ``--max-memory-gb`` of private
memory; mutants that do not even import ("incompetent") as neither. Survivors are written to ``OUT/<module>.md``
with their diffs: each needs a test, or a written reason why the change is not a bug a user would see (an equivalent
mutant: ``x * 1.0`` for ``x``, a bound that cannot be reached, ...).

cosmic-ray enumerates the mutants and keeps their results; they are run here, ``--jobs`` at a time (each job a fork
server with its own copy of the tree, ``bench/mutation_server.py``: torch and Ray are imported once, the project
afresh for each mutant), the tests of each file in the order of their unmutated durations, so that ``-x`` ends a
killed mutant's run at the cheapest test that kills it.  Same verdicts as ``cosmic-ray exec``, in less time (the
docs' testing page has the measurement).

The operators are cosmic-ray's core set less the replacements that make implausible bugs (bitwise and shift
operators, ``%``, ``**``, ``//`` for arithmetic, ``is``/``in`` for comparisons) and the random variable
replacers, so the count stays within reach: typically 50-300 mutants per module, each one test run.

``--sample N`` scores N mutants drawn at random (seeded by ``--seed`` and the module's name, so the same draw every
time) from each module's mutants, and prints the score with its binomial standard error sqrt(p (1 - p) / N): random
mutant sampling (Acree 1980; Wong and Mathur 1995) estimates the full score without running every mutant, at a
tenth of the time for the largest modules. The report says which mutants were drawn.

``--resume`` keeps each module's results in ``OUT/<module>.sqlite``: a run stopped (Ctrl-C, the machine's session
ending) and started again goes on with the mutants not yet run, as long as the module, its tests' files and
``conftest.py`` are byte for byte the same; otherwise it starts afresh, as results against other code do not hold.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable


def _method(*files: str, k: str) -> list[str]:
    """A method's own tests, plus those of its defaults and ranges (``tests/test_method_defaults.py``) and of each
    parameter reaching its code (``tests/test_method_params.py``): their test ids name the method, so ``-k``
    selects them."""
    return [*files, "tests/test_method_defaults.py", "tests/test_method_params.py", "-k", k, "-m", "not slow"]


# module (under rayfed_dg/) -> the pytest arguments of the tests that guard it (fast ones)
MODULES: dict[str, list[str]] = {
    "engine/aggregation/exact.py": ["tests/test_aggregate.py", "tests/test_exact_edges.py", "-m", "not slow"],
    "engine/aggregation/server_opt.py": ["tests/test_server_opt.py", "-m", "not slow"],
    "engine/aggregation/robust.py": ["tests/test_robust.py", "-m", "not slow"],
    "engine/aggregation/pipeline.py": ["tests/test_robust.py", "tests/test_async.py", "tests/test_privacy_updates.py",
                                       "tests/test_server_opt.py", "tests/test_fedomg.py", "-m", "not slow"],
    "engine/store/selection.py": ["tests/test_selection.py", "-m", "not slow"],
    "engine/workers/pool.py": ["tests/test_pool.py", "-m", "not slow"],
    "engine/workers/dispatch.py": ["tests/test_dispatch.py"],  # the pool's failure accounting and dispatch, without Ray
    # the device model and the synchronous round's plan on its clock; FedBuff/FedAsync run on it
    "engine/clock/devices.py": ["tests/test_devices.py", "tests/test_async.py", "tests/test_network.py", "-m",
                                "not slow"],
    "engine/clock/network.py": ["tests/test_network.py", "-m", "not slow"],
    "engine/clock/traces.py": ["tests/test_traces.py", "tests/test_devices.py", "tests/test_network.py", "-m",
                               "not slow"],
    "engine/privacy/accountant.py": ["tests/test_privacy_updates.py", "-m", "not slow"],
    # the clip and noise of a client's update, and of the payloads a method sends beside it
    # (test_robust.py: DP's estimator refused beside an unbounded one, by its declarations)
    "engine/privacy/updates.py": ["tests/test_privacy_updates.py", "tests/test_privacy_payloads.py",
                                  "tests/test_robust.py", "-m", "not slow"],
    "engine/privacy/payloads.py": ["tests/test_privacy_payloads.py", "tests/test_privacy_updates.py", "-m", "not slow"],
    # FedBuff / FedAsync on the clock: the schedule of starts, arrivals and server updates
    "engine/clock/asynchronous.py": ["tests/test_async.py", "tests/test_devices.py", "tests/test_network.py", "-m",
                                     "not slow"],
    # FedBuff's buffer and FedAsync's mixing, and their server updates through the engine
    "engine/aggregation/buffered.py": ["tests/test_async.py", "-m", "not slow"],
    # the federation's wiring: its state, the aggregation pipeline's inputs, the round's order, the checkpoint
    "engine/rounds/federation.py": ["tests/test_engine.py", "tests/test_async.py", "tests/test_robust.py",
                                    "tests/test_server_opt.py", "tests/test_devices.py", "tests/test_resume.py",
                                    "tests/test_clientstore.py", "tests/test_feddg_ga.py", "-m", "not slow"],
    "engine/rounds/server.py": ["tests/test_engine.py", "tests/test_async.py", "tests/test_resume.py",
                                "tests/test_concurrent.py", "tests/test_pool.py", "-m", "not slow"],
    # one round on the pool: its cohort, phases, the workers' exact partial sums merged, its rows
    "engine/rounds/round.py": ["tests/test_engine.py", "tests/test_aggregate.py", "tests/test_async.py",
                               "tests/test_devices.py", "tests/test_feddg_ga.py", "tests/test_client_batching.py",
                               "-m", "not slow"],
    "engine/store/clientstore.py": ["tests/test_clientstore.py", "-m", "not slow"],
    # the concurrent federations' schedule on one machine
    "engine/running/schedule.py": ["tests/test_schedule.py", "tests/test_concurrent.py", "-m", "not slow"],
    "tuning.py": ["tests/test_tuning.py", "-m", "not slow", "-k", "select or collect or unfinished or tie or table"],
    "data/protocol.py": ["tests/test_partitions.py", "tests/test_splits.py", "tests/test_protocols.py", "-m",
                         "not slow"],
    # XAN (gPerXAN), IBN (COPA, gPerXAN's ablation) and DSON, whose by-hand tests sit with the paper baselines'
    "models/norms.py": ["tests/test_models.py", "tests/test_gperxan.py", "tests/test_paper_baselines.py", "-m",
                        "not slow"],
    # StableFDG's style sharing, shifting, exploration and attention, and the MixStyle / DSU layers
    "models/style.py": ["tests/test_stablefdg.py", "tests/test_baselines.py", "-m", "not slow"],
    "methods/fedsam.py": _method("tests/test_benchmark_baselines.py", k="sam or lgf"),  # FedLGF's options too
    "methods/fedgma.py": _method("tests/test_benchmark_baselines.py", k="gma"),
    "methods/fediir.py": _method("tests/test_benchmark_baselines.py", k="iir"),
    "methods/fedadg.py": _method("tests/test_benchmark_baselines.py", k="adg"),
    # the server step and the refusal of old configs' server_lr are tested beside FedAvgM's
    "methods/scaffold.py": _method("tests/test_drift_methods.py", "tests/test_server_opt.py", k="scaffold"),
    "methods/feddyn.py": _method("tests/test_drift_methods.py", k="feddyn"),
    "methods/moon.py": _method("tests/test_drift_methods.py", k="moon"),
    "methods/fedprox.py": _method("tests/test_baselines.py", k="fedprox"),
    # -k matches the module's name too: all of test_feddg_ga.py, and the others' tests naming the method
    "methods/feddg_ga.py": _method("tests/test_feddg_ga.py", k="feddg_ga"),
    "methods/gperxan.py": _method("tests/test_gperxan.py", k="gperxan"),
    "methods/stablefdg.py": _method("tests/test_stablefdg.py", k="stablefdg"),
    "methods/fedfd.py": _method("tests/test_fedfd.py", k="fedfd"),
}

# module -> the functions (or classes, by name) whose mutants are run; the rest of the module is not scored: the
# decisions (the sweep's selection and collection, the pool's failure accounting, the splits), not the plumbing
# around them that only end-to-end tests reach
SCOPES: dict[str, list[str]] = {
    "tuning.py": ["select_value", "select_per_seed", "collect_row", "collect", "markdown_table"],
    "engine/workers/dispatch.py": ["FailureLedger", "DispatchPlan"],
}

# cosmic-ray operator names (regular expressions) left out: implausible bugs and random replacers
EXCLUDED = [
    r"core/ReplaceBinaryOperator_.*_(BitOr|BitAnd|BitXor|LShift|RShift|Mod|Pow|FloorDiv)$",
    r"core/ReplaceBinaryOperator_(BitOr|BitAnd|BitXor|LShift|RShift|Mod|Pow|FloorDiv)_.*",
    r"core/ReplaceComparisonOperator_.*_(Is|IsNot|In|NotIn)$",
    r"core/ReplaceComparisonOperator_(Is|IsNot|In|NotIn)_.*",
    r"core/VariableReplacer", r"core/VariableInserter", r"core/RemoveDecorator", r"core/ExceptionReplacer",
]


def _copy_tree(dst: Path) -> None:
    """The working tree as it is (uncommitted edits included), without what a run never reads."""
    ignore = shutil.ignore_patterns(".git", "runs", "mutants", "site", "__pycache__", "*.egg-info", ".dev",
                                    ".mypy_cache", ".ruff_cache", ".pytest_cache")
    shutil.copytree(REPO, dst, ignore=ignore)


def _pytest_args(module: str) -> list[str]:
    """pytest's arguments that judge ``module``'s mutants (on the fork servers, and in ``--recheck``)."""
    return ["-x", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", *MODULES[module]]


def _pytest(module: str) -> list[str]:
    return [PY, "-m", "pytest", *_pytest_args(module)]


def _mutant_key(item) -> tuple:
    """What a mutant is (unique, unlike its uuid job id): the order of the sample's draw and of the runs."""
    m = item.mutations[0]
    return m.start_pos, m.operator_name, m.occurrence


def _config(module: str, timeout: float) -> str:
    command = " ".join(f'"{t}"' if " " in t else t for t in _pytest(module))
    excluded = ", ".join(json.dumps(e) for e in EXCLUDED)
    return (f'[cosmic-ray]\nmodule-path = "rayfed_dg/{module}"\ntimeout = {timeout}\nexcluded-modules = []\n'
            f"test-command = {json.dumps(command)}\n\n[cosmic-ray.distributor]\nname = \"local\"\n\n"
            f"[cosmic-ray.filters.operators-filter]\nexclude-operators = [{excluded}]\n")


def _run(args: list[str], cwd: Path, timeout: float | None = None) -> subprocess.CompletedProcess:
    # the copy's package, not the installed one, in the test runs and the Ray workers they start
    try:
        return subprocess.run(args, cwd=cwd, env={**os.environ, "PYTHONPATH": str(cwd)}, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:  # a mutant that never ends (a loop that cannot exit): killed, cosmic-ray's rule
        return subprocess.CompletedProcess(args, 124, "", f"timed out after {timeout} s")


def _scope_lines(path: Path, names: list[str]) -> list[tuple[int, int]]:
    """The line ranges of the top-level functions and classes ``names`` in ``path``."""
    import ast

    tree = ast.parse(path.read_text())
    found = {n.name: (n.lineno, n.end_lineno or n.lineno) for n in tree.body
             if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    missing = [n for n in names if n not in found]
    if missing:
        raise SystemExit(f"mutation: {path.name} has no top-level {', '.join(missing)} (SCOPES is stale)")
    return [found[n] for n in names]


def _skip_outside(session: Path, lines: list[tuple[int, int]]) -> None:
    """Mark the mutants outside ``lines`` skipped, as cosmic-ray's own filters do."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    with use_db(str(session), WorkDB.Mode.open) as db:
        for item in list(db.pending_work_items):
            row = item.mutations[0].start_pos[0]
            if not any(a <= row <= b for a, b in lines):
                db.set_result(item.job_id, WorkResult(output="outside the scored functions",
                                                      worker_outcome=WorkerOutcome.SKIPPED))


def _sample(session: Path, n: int, seed: str) -> int:
    """Keep ``n`` of the pending mutants, drawn at random (seeded by ``seed``), and mark the others skipped; the
    number of mutants drawn from."""
    import random

    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    with use_db(str(session), WorkDB.Mode.open) as db:
        pending = sorted(db.pending_work_items, key=_mutant_key)
        keep = set(random.Random(seed).sample(range(len(pending)), min(n, len(pending))))
        for k, item in enumerate(pending):
            if k not in keep:
                db.set_result(item.job_id, WorkResult(output="not in the sample",
                                                      worker_outcome=WorkerOutcome.SKIPPED))
    return len(pending)


def _serve(tree: Path) -> subprocess.Popen:
    return subprocess.Popen([PY, str(tree / "bench" / "mutation_server.py"), str(tree)], cwd=tree, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)


def _ask(server: subprocess.Popen, request: dict) -> dict:
    server.stdin.write(json.dumps(request) + "\n")
    server.stdin.flush()
    for line in server.stdout:  # anything the packages print on import is not a reply
        if line.startswith("{"):
            return json.loads(line)
    raise SystemExit(f"mutation: the fork server of {request['module']} ended")


def _outcome(item, server: subprocess.Popen, original: str, request: dict):
    """Apply one mutant in ``server``'s tree, run the tests there, and judge it (cosmic-ray's rule: any failure or
    a timeout kills it; a mutation the operator cannot make is no test)."""
    import cosmic_ray.plugins
    from cosmic_ray.mutating import _make_diff, mutate_code
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome, WorkResult

    spec = item.mutations[0]
    try:
        operator = cosmic_ray.plugins.get_operator(spec.operator_name)(**(getattr(spec, "operator_args", None) or {}))
        mutated = mutate_code(original, operator, spec.occurrence)
    except Exception as err:  # noqa: BLE001 - cosmic-ray's rule: a mutation that cannot be made is incompetent
        return WorkResult(output=repr(err), test_outcome=TestOutcome.INCOMPETENT,
                          worker_outcome=WorkerOutcome.EXCEPTION)
    if mutated is None:
        return WorkResult(worker_outcome=WorkerOutcome.NO_TEST)
    reply = _ask(server, {**request, "source": mutated})
    diff = "\n".join(_make_diff(original, mutated, request["module"]))
    return WorkResult(output=reply["output"], diff=diff, worker_outcome=WorkerOutcome.NORMAL,
                      test_outcome=TestOutcome.SURVIVED if reply["rc"] == 0 else TestOutcome.KILLED)


def _baseline(servers: list[subprocess.Popen], module: str, record: Path, timeout: float,
              max_memory: int | None = None) -> dict:
    """The mutants' request, its tests' order from an unmutated run's durations; then the unmutated tree in that
    order on every job: a mutant "killed" by tests that fail anyway (an order they depend on, a tree left
    mutated) would inflate the score."""
    request = {"module": f"rayfed_dg/{module}", "args": _pytest_args(module), "timeout": timeout,
               "max_memory": max_memory}
    base = _ask(servers[0], {**request, "source": None, "record": str(record)})
    request["order"] = json.loads(record.read_text()) if record.exists() else {}
    for server in servers:
        if not base["rc"]:
            base = _ask(server, {**request, "source": None})
    if base["rc"]:
        raise SystemExit(f"mutation: the tests of {module} fail unmutated: {base['output'].strip()[-500:]}")
    return request


def _execute(session: Path, module: str, work: Path, jobs: int, timeout: float, max_memory: int | None = None) -> None:
    """Every pending mutant of ``session``, on ``jobs`` fork servers, each with its own copy of the tree; the
    tests in the order of their unmutated durations, fastest first in each file."""
    import queue
    from concurrent.futures import ThreadPoolExecutor, as_completed

    from cosmic_ray.work_db import WorkDB, use_db

    trees = [work] + [work.with_name(f"{work.name}{k}") for k in range(1, jobs)]
    for tree in trees[1:]:
        if not tree.exists():
            shutil.copytree(work, tree)
    servers = [_serve(tree) for tree in trees]
    original = (work / "rayfed_dg" / module).read_text()
    try:
        request = _baseline(servers, module, work / ".durations.json", timeout, max_memory)
        free: queue.Queue = queue.Queue()
        for server in servers:
            free.put(server)

        def one(item):
            server = free.get()
            try:
                return item, _outcome(item, server, original, request)
            finally:
                free.put(server)

        with use_db(str(session), WorkDB.Mode.open) as db:
            items = sorted(db.pending_work_items, key=_mutant_key)
            t0, done, killed = time.monotonic(), 0, 0
            with ThreadPoolExecutor(jobs) as pool:
                futures = [pool.submit(one, item) for item in items]
                try:
                    for fut in as_completed(futures):
                        item, result = fut.result()
                        db.set_result(item.job_id, result)
                        done += 1
                        killed += result.test_outcome is not None and result.test_outcome.value == "killed"
                        if done % 10 == 0 or done == len(items):
                            eta = (time.monotonic() - t0) / done * (len(items) - done)
                            print(f"  {module}: {done}/{len(items)} mutants, {killed} killed, about {eta:.0f} s "
                                  "left", file=sys.stderr, flush=True)
                except BaseException:  # a server that ended, Ctrl-C, SIGTERM: nothing more is run or recorded
                    pool.shutdown(wait=False, cancel_futures=True)
                    for server in servers:  # each kills its running mutant's tests (a SIGTERM reached only us)
                        server.send_signal(signal.SIGINT)
                    raise
    finally:
        for server in servers:
            server.stdin.close()
            server.wait()


def _digest(module: str, work: Path, sample: int | None, seed: int) -> str:
    """What a kept session's results depend on: the module, its tests' files and arguments, the draw."""
    h = hashlib.sha256(json.dumps([module, MODULES[module], sample, seed]).encode())
    for rel in [f"rayfed_dg/{module}"] + [a for a in MODULES[module] if a.endswith(".py")] + ["tests/conftest.py"]:
        h.update((work / rel).read_bytes())
    return h.hexdigest()


def mutate(module: str, work: Path, timeout: float, sample: int | None = None, seed: int = 0,
           jobs: int = 2, keep: Path | None = None, max_memory: int | None = None) -> dict:
    """Score ``module``.  With ``keep`` (a folder) its session database is kept there, and a later call with the
    module and its tests unchanged goes on with the mutants not yet run instead of starting afresh."""
    name = module.replace("/", "_").removesuffix(".py")
    cfg = work / f"{name}.toml"
    session = (keep or work) / f"{name}.sqlite"
    stamp, digest = session.with_suffix(".sha256"), _digest(module, work, sample, seed)
    cfg.write_text(_config(module, timeout))
    t0 = time.monotonic()
    kept = json.loads(stamp.read_text()) if keep is not None and session.exists() and stamp.exists() else {}
    population = kept.get("population")
    if kept.get("digest") != digest:
        session.unlink(missing_ok=True)  # a kept session of other code or tests: its results no longer hold
        stamp.unlink(missing_ok=True)  # an interrupted init must not leave an old stamp beside a new session
        for step in (["cosmic-ray", "init", str(cfg), str(session)], ["cr-filter-operators", str(session), str(cfg)]):
            r = _run(step, work)
            if r.returncode:
                raise SystemExit(f"mutation: {' '.join(step[:2])} failed for {module}: {r.stderr.strip()[-500:]}")
        if module in SCOPES:
            _skip_outside(session, _scope_lines(work / "rayfed_dg" / module, SCOPES[module]))
        population = _sample(session, sample, f"{seed}:{module}") if sample else None
        if keep is not None:
            stamp.with_suffix(".tmp").write_text(json.dumps({"digest": digest, "population": population}))
            stamp.with_suffix(".tmp").replace(stamp)
    _execute(session, module, work, jobs, timeout, max_memory)
    dump = _run(["cosmic-ray", "dump", str(session)], work).stdout.splitlines()
    rows = [json.loads(line) for line in dump if line.strip()]
    killed, survived, incompetent, skipped, survivors = 0, 0, 0, 0, []
    for item, result in rows:
        if result is None or result.get("worker_outcome") == "skipped":
            skipped += 1
            continue
        outcome = result.get("test_outcome")
        if outcome == "survived":
            survived += 1
            m = item["mutations"][0]
            survivors.append({"line": m["start_pos"][0], "operator": m["operator_name"],
                              "occurrence": m["occurrence"], "diff": result.get("diff") or ""})
        elif outcome == "incompetent":
            incompetent += 1
        else:
            killed += 1
    tested = killed + survived
    return {"module": module, "mutants": tested + incompetent, "killed": killed, "survived": survived,
            "incompetent": incompetent, "excluded": skipped, "score": killed / tested if tested else float("nan"),
            "seconds": time.monotonic() - t0, "survivors": survivors, "population": population}


def _survivor_diffs(report: Path) -> list[tuple[str, str]]:
    """(heading, unified diff) of each survivor in a report this script wrote."""
    out, heading, lines, inside = [], "", [], False
    for line in report.read_text().splitlines():
        if line.startswith("## line "):
            heading = line[3:]
        elif line.startswith("```diff"):
            inside, lines = True, []
        elif line == "```" and inside:
            inside = False
            out.append((heading, "\n".join(x for x in lines if x != "--- mutation diff ---") + "\n"))
        elif inside:
            lines.append(line)
    return out


def recheck(report: Path, timeout: float) -> int:
    """Apply each survivor of ``report`` again, one at a time, to a copy of today's tree and run the module's tests:
    the "after" column once tests were added for them, without a whole new cosmic-ray run."""
    name = report.stem
    module = next((m for m in MODULES if m.replace("/", "_").removesuffix(".py") == name), None)
    if module is None:
        print(f"mutation: {report} is not a report of a module in MODULES", file=sys.stderr)
        return 2
    diffs = _survivor_diffs(report)
    killed = 0
    with tempfile.TemporaryDirectory(prefix="rfmut-") as tmp:
        work = Path(tmp) / "tree"
        _copy_tree(work)
        target = work / "rayfed_dg" / module
        original = target.read_text()
        for heading, diff in diffs:
            applied = subprocess.run(["patch", "-p1", "--silent", "--no-backup-if-mismatch"], cwd=work, input=diff,
                                     text=True, capture_output=True)
            if applied.returncode:
                print(f"  {heading}: does not apply to today's code (the line changed)")
                target.write_text(original)
                continue
            r = _run(_pytest(module), work, timeout)
            target.write_text(original)
            killed += r.returncode != 0
            verdict = "killed (timeout)" if r.returncode == 124 else "killed" if r.returncode else "survives"
            print(f"  {heading}: {verdict}", flush=True)
    print(f"{module}: {killed} of the {len(diffs)} survivors in {report} are killed by today's tests")
    return 0


def _refusal(a: argparse.Namespace) -> str | None:
    """What is wrong with the arguments, in one line (None: nothing)."""
    if a.jobs < 1:
        return f"--jobs {a.jobs}: give at least 1"
    if a.max_memory_gb <= 0:
        return f"--max-memory-gb {a.max_memory_gb}: give a positive number of GiB"
    if a.sample is not None and a.sample < 1:
        return f"--sample {a.sample}: give a number of mutants, at least 1"
    unknown = [m for m in a.modules if m not in MODULES]
    if unknown and not a.recheck:
        return f"no tests are mapped for {', '.join(unknown)}; choose from: {', '.join(MODULES)}"
    if not a.recheck and shutil.which("cosmic-ray") is None:
        return "cosmic-ray is not installed (pip install cosmic-ray==8.7.0)"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modules", nargs="+", default=list(MODULES), help="paths under rayfed_dg/ (default: all)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a mutant's test run may take")
    ap.add_argument("--out", default="runs/mutation", help="folder for the survivors' reports")
    ap.add_argument("--recheck", metavar="REPORT", type=Path,
                    help="a survivors' report of an earlier run: apply each again against today's tests")
    ap.add_argument("--sample", type=int, metavar="N", help="score N mutants drawn at random from each module")
    ap.add_argument("--seed", type=int, default=0, help="the draw of --sample")
    ap.add_argument("--jobs", type=int, default=2, help="mutants tested at once, each in its own copy of the tree")
    ap.add_argument("--max-memory-gb", type=float, default=6.0,
                    help="memory a mutant's tests may hold (GiB, anonymous resident); past it the mutant is killed, "
                         "as on timeout (not in --recheck)")
    ap.add_argument("--resume", action="store_true", help="keep results in --out; go on from the mutants not yet run")
    a = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stopped as by Ctrl-C: results so far kept
    wrong = _refusal(a)
    if wrong:
        print(f"mutation: {wrong}", file=sys.stderr)
        return 2
    if a.recheck:
        return recheck(a.recheck, a.timeout)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    print("| module | mutants | killed | survived | incompetent | score | seconds |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="rfmut-") as tmp:
        work = Path(tmp) / "tree"
        _copy_tree(work)
        failed = 0
        for module in a.modules:
            try:
                res = mutate(module, work, a.timeout, a.sample, a.seed, a.jobs, out.resolve() if a.resume else None,
                             int(a.max_memory_gb * 2**30))
            except SystemExit as err:  # one module's failure (its tests fail unmutated, ...) does not end the run
                print(f"| {module} | - | - | - | - | not scored: {str(err).splitlines()[0][:150]} | - |", flush=True)
                failed += 1
                continue
            score, tested = res["score"], res["killed"] + res["survived"]
            if res["population"] is not None and tested:  # an estimate: its binomial standard error
                score = f"{score:.3f} ± {(score * (1 - score) / tested) ** 0.5:.3f}"
            else:
                score = f"{score:.3f}"
            drawn = f" (drawn from {res['population']})" if res["population"] is not None else ""
            print(f"| {module} | {res['mutants']}{drawn} | {res['killed']} | {res['survived']} | {res['incompetent']} "
                  f"| {score} | {res['seconds']:.0f} |", flush=True)
            report = out / (module.replace("/", "_").removesuffix(".py") + ".md")
            lines = [f"# Surviving mutants of rayfed_dg/{module}: {res['survived']} of {res['mutants']}"
                     + (f" (a random sample of {res['population']}, --seed {a.seed})" if res["population"] else ""),
                     ""]
            for s in res["survivors"]:
                lines += [f"## line {s['line']}: {s['operator']} (occurrence {s['occurrence']})", "", "```diff",
                          s["diff"].rstrip(), "```", ""]
            report.write_text("\n".join(lines))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
