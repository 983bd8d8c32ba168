"""Small shared utilities: atomic files, registries, tables, CLI errors, the
environment a run records (commit and library versions).

Bottom of the import graph: nothing here imports another ``rayfed_dg``
module but ``errors``.
"""
from __future__ import annotations

import contextlib
import difflib
import io
import os
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO, Generic, TypeVar

from .errors import USER_ERRORS, EngineError, ResourceError

T = TypeVar("T")


# --------------------------------------------------------------------- files

def atomic_write_with(path: Path, write: Callable[[BinaryIO], Any], mode: int = 0o644) -> None:
    """Write ``path`` so that a reader sees the old file or the whole new one:
    ``write(f)`` fills a temporary file in the same folder (streamed, so a
    large array is never held twice in memory), which is synced to disk and
    renamed over ``path``.  The temporary name is hidden (``.NAME.XXXXXXXX.tmp``),
    so readers that list a folder of part files never pick up a half-written
    one, and unique, so two writers of one path never write into one file."""
    import tempfile

    path = Path(path)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    tmp = Path(name)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def _fsync_dir(folder: Path) -> None:
    """Make a rename durable (a crash of the machine, not only of the process)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes, mode: int = 0o644) -> None:
    atomic_write_with(path, lambda f: f.write(data), mode)


def write_text(text: str, path: Path) -> None:
    atomic_write(path, text.encode())


def write_table(rows: list[dict] | dict[str, Any], path: Path) -> None:
    """Parquet from a list of row dicts or a dict of columns, written atomically."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(rows) if isinstance(rows, dict) else pa.Table.from_pylist(rows)
    atomic_write_with(path, lambda buf: pq.write_table(table, buf))


# ---------------------------------------------------------------- registries

def did_you_mean(name: str, known: Sequence[str]) -> str:
    hint = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean {hint[0]}?)" if hint else ""


class Registry(Generic[T]):
    """Name -> object, for methods, stages and datasets.  Registering a name
    twice is an error (a silent overwrite would run the wrong code); an unknown
    name raises ``error`` with a did-you-mean and the known names."""

    def __init__(self, kind: str, error: type[Exception] = KeyError):
        self.kind, self.error = kind, error
        self._items: dict[str, T] = {}

    def add(self, name: str, obj: T) -> T:
        if name in self._items and self._items[name] is not obj:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        self._items[name] = obj
        return obj

    def get(self, name: str) -> T:
        if name not in self._items:
            raise self.error(f"unknown {self.kind} {name!r}{did_you_mean(name, self.names())}; "
                             f"known: {', '.join(self.names())}")
        return self._items[name]

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items


# -------------------------------------------------------------------- tables

def render_table(header: Sequence[str], rows: Sequence[Sequence[Any]], style: str = "text") -> str:
    """One table renderer: ``text`` (aligned, for terminals), ``md``
    (Markdown), ``csv`` or ``latex`` (a tabular body)."""
    cells = [[str(c) for c in header]] + [["" if c is None else str(c) for c in r] for r in rows]
    if style == "md":
        return "\n".join(["| " + " | ".join(cells[0]) + " |", "|" + "---|" * len(header)]
                         + ["| " + " | ".join(r) + " |" for r in cells[1:]])
    if style == "csv":
        import csv

        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows(cells)
        return buf.getvalue().rstrip("\n")
    if style == "latex":
        esc = [[c.replace("_", r"\_").replace("%", r"\%").replace("±", r"$\pm$") for c in r] for r in cells]
        body = [" & ".join(r) + r" \\" for r in esc]

        def numeric(c: str) -> bool:
            if c.strip() in ("", "-"):  # a missing value does not make a figures column text
                return True
            try:
                [float(part) for part in c.replace("%", "").split("±") if part.strip()]
                return True
            except ValueError:
                return False

        # text columns left, figures right
        align = "".join("r" if all(numeric(r[i]) for r in cells[1:]) else "l" for i in range(len(header)))
        return "\n".join([r"\begin{tabular}{" + align + "}", r"\toprule", body[0], r"\midrule",
                          *body[1:], r"\bottomrule", r"\end{tabular}"])
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    line = lambda r: " | ".join(c.rjust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(cells[0]), "-+-".join("-" * w for w in widths)] + [line(r) for r in cells[1:]])


# ----------------------------------------------------------------- Ray workers

def exit_quietly_on_sigterm() -> None:
    """For a Ray actor's process: Ray ends a worker with SIGTERM, whose
    handler raises SystemExit wherever the process is.  Inside a finaliser or
    a weakref callback Python can only print that ("Exception ignored in",
    a traceback a user reads at the end of a run) and go on running until
    Ray kills it; exit there instead, quietly, with the exception's code, as
    the SystemExit would have ended the process anywhere else."""
    if getattr(sys.unraisablehook, "exits_on_sigterm", False):
        return
    default = sys.unraisablehook

    def hook(args: Any) -> None:
        if args.exc_type is not None and issubclass(args.exc_type, SystemExit):
            code = getattr(args.exc_value, "code", 1)
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(code if isinstance(code, int) else 1)
        default(args)

    hook.exits_on_sigterm = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM (``kill PID``, ``timeout``, ``docker stop``) stops the block as
    Ctrl-C does, with a KeyboardInterrupt.  A Ray driver would otherwise take
    it in Ray's C++ failure-signal handler: a stack dump and an abort (exit
    134) before the run could say how to resume.  The handler from before
    is put back after the block.  Python delivers signals to the main thread
    only; elsewhere, or where SIGTERM is ignored (an ignored signal is
    inherited from the parent), the block runs as it is."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is signal.SIG_IGN:
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    before = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        # None: a handler not set from Python (Ray's C++ one), which cannot be put back; the default ends the process
        signal.signal(signal.SIGTERM, signal.SIG_DFL if before is None else before)


# ----------------------------------------------------------------------- CLI

def _one_line_warning(message, category, filename, lineno, file=None, line=None):
    print(f"rayfed-dg: warning: {message}", file=sys.stderr)


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield


@contextlib.contextmanager
def env_set(name: str, value: str) -> Iterator[None]:
    """``os.environ[name] = value`` for the block, then as it was (unset if it was)."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def run_cli(prog: str, fn: Callable[[], int], debug: bool = False) -> int:
    """Run a command's body: bad input ends with one line on stderr and exit
    code 2, an engine failure with exit code 1, no traceback unless
    ``debug``; nothing that is written is group/world-writable."""
    os.umask(os.umask(0) | 0o022)
    if not debug:
        import warnings

        warnings.showwarning = _one_line_warning
    try:
        code = fn()
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return code
    except (*USER_ERRORS, ResourceError) as e:
        if debug:
            traceback.print_exc()
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except EngineError as e:
        if debug:
            traceback.print_exc()
        # raised inside an actor, it arrives wrapped with a remote traceback
        print(f"{prog}: error: {getattr(e, 'cause', None) or e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `rayfed-dg data list | head`: the reader left; Python's own flush at exit would raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


# --------------------------------------------------------------- environment

# Besides its config and seed, a run's numbers depend on the code and on these libraries (Pillow decodes and
# resizes the images, torch computes): run.json records them so a figure that moved can be traced.
LIBRARIES = ("torch", "torchvision", "numpy", "pillow", "timm", "ray")


def environment() -> dict[str, str | None]:
    """Python's version, this package's git commit (``+dirty`` when its
    tracked files differ from it; None outside a git checkout) and each of
    ``LIBRARIES``' installed version (None: not installed)."""
    import platform
    import subprocess
    from importlib import metadata

    here = Path(__file__).resolve().parent
    commit = None
    try:
        head = subprocess.run(["git", "-C", str(here), "rev-parse", "--show-toplevel", "--short=12", "HEAD"],
                              capture_output=True, text=True, timeout=10)
        top, _, sha = head.stdout.strip().partition("\n")
        # an installed copy inside some other repository (a virtualenv in a project) has no commit of its own
        if head.returncode == 0 and Path(top).resolve() == here.parent:
            dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no", "--",
                                    str(here)], capture_output=True, text=True, timeout=10).stdout.strip()
            commit = sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    out: dict[str, str | None] = {"python": platform.python_version(), "rayfed_dg_commit": commit}
    for name in LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def environment_changes(was: dict | None, now: dict) -> list[str]:
    """``"pillow 12.1.0 -> 13.0.0"`` for each entry of a recorded ``was`` that
    ``now`` has otherwise (nothing for a record made before run.json kept one)."""
    return [f"{k} {v} -> {now.get(k)}" for k, v in (was or {}).items() if v != now.get(k)]
