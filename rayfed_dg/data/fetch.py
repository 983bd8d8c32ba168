"""``rayfed-dg data fetch NAME``: download, verify and install a dataset.

1. Each archive of the source (``sources.py``) is downloaded into
   ``<root>/.downloads/<file>.part`` with a progress bar; an interrupted
   download (lost connection, Ctrl-C, a killed process) is resumed with an
   HTTP ``Range`` request, by the retry loop or by running the command again;
   a server that ignores ``Range`` gets the file from the start.
2. The finished file is checked against its SHA-256 and size where the
   source gives them; a mismatch deletes it and stops with one line (nothing
   is extracted).  Only then is ``.part`` renamed to the archive's name.
3. The archives are extracted into a hidden staging folder
   ``<root>/.<folder>.partial`` (tar with Python's ``data`` filter, zip with
   its own path sanitising), the layout is found in it (or built, for
   TerraIncognita) and checked by the loader's own listing; only a tree that
   passes is renamed to ``<root>/<folder>`` (one rename on the same file
   system), so ``<root>/<folder>`` is either absent or complete.  The staging
   folder is removed whatever happens; the archives are removed after a
   successful install unless ``keep_archives``.

A host that cannot be reached ends with one line naming the URL and the
manual step (put the file in ``<root>/.downloads/`` by other means and run
the command again: the rest, checks included, is the same).
"""
from __future__ import annotations

import hashlib
import http.client
import re
import shutil
import sys
import tarfile
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

from .base import DataError
from .sources import Archive, Source, data_root, get_source

CHUNK = 1 << 20
USER_AGENT = "rayfed-dg (dataset fetch)"


class _Unreachable(Exception):
    """The server could not be reached or did not send the file (try a mirror)."""


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _one_line(err: object) -> str:
    return " ".join(str(err).split())


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _content_range(value: str | None) -> tuple[int | None, int | None]:
    """(first byte, total size) of a ``Content-Range`` header, None where unknown."""
    m = re.match(r"bytes\s+(?:(\d+)-\d+|\*)/(\d+|\*)", value or "")
    if not m:
        return None, None
    return (int(m.group(1)) if m.group(1) else None), (int(m.group(2)) if m.group(2) != "*" else None)


def _bar(total: int | None, initial: int, desc: str, progress: bool):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                leave=False, disable=None if progress else True)  # None: only on a terminal


class _Retry(Exception):
    """This attempt at a download failed in a way the next one may not (its message: why)."""


def _request(url: str, part: Path, have: int, timeout: float):
    """The response to a request for ``url`` from byte ``have`` on, or None
    when the server has nothing left to send because ``part`` is complete."""
    headers = {"User-Agent": USER_AGENT}
    if have:
        headers["Range"] = f"bytes={have}-"
    try:
        return urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout)
    except urllib.error.HTTPError as e:
        if e.code == 416 and have:  # nothing left to send: complete, or not what the server has
            _, total = _content_range(e.headers.get("Content-Range"))
            if total == have:
                return None
            part.unlink()
            raise _Retry("the partial file did not match the server's; restarting") from None
        raise _Unreachable(f"HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError) as e:
        raise _Unreachable(_one_line(getattr(e, "reason", e))) from None


def _receive(resp, url: str, part: Path, have: int, progress: bool) -> int | None:
    """Write the body of ``resp`` into ``part`` (appended at byte ``have`` for
    a range); returns the file's whole size where the server gives it."""
    if resp.status == 206:
        start, total = _content_range(resp.headers.get("Content-Range"))
        if start != have:  # not the range asked for: start over
            part.unlink()
            raise _Retry(f"the server answered a range from byte {start}, not {have}")
        mode = "ab"
    else:  # 200: the whole file (a server without Range support restarts it)
        have, mode = 0, "wb"
        length = resp.headers.get("Content-Length")
        total = int(length) if length and length.isdigit() else None
    if (resp.headers.get("Content-Type") or "").startswith("text/html"):
        raise _Unreachable("the server sent a web page instead of the file (a quota, sign-in or "
                           "confirmation page)")
    desc = part.name.removesuffix(".part")
    shown = f"{total / 2**20:,.1f} MiB" if total is not None else "size unknown"
    _say(f"downloading {desc} ({shown}{f', resuming at byte {have}' if have else ''}) from {url}")
    try:
        with open(part, mode) as f, _bar(total, have, desc, progress) as bar:
            while chunk := resp.read1(CHUNK):  # what has arrived: a stall loses nothing
                f.write(chunk)
                bar.update(len(chunk))
    except (http.client.IncompleteRead, ConnectionError, TimeoutError) as e:
        raise _Retry(f"connection lost ({_one_line(e) or type(e).__name__})") from None  # resume from what arrived
    return total


def _download(url: str, part: Path, expected_size: int | None, progress: bool, timeout: float,
              attempts: int) -> None:
    """Fill ``part`` with the body of ``url``, resuming what it already holds."""
    last = ""
    for _ in range(attempts):
        have = part.stat().st_size if part.exists() else 0
        if expected_size is not None and have == expected_size:
            return
        try:
            resp = _request(url, part, have, timeout)
            if resp is None:
                return
            with resp:
                total = _receive(resp, url, part, have, progress)
        except _Retry as e:
            last = str(e)
            continue
        size = part.stat().st_size
        if total is not None and size < total:
            last = f"connection closed at byte {size} of {total}"
            continue
        return
    raise _Unreachable(f"{last}; {part} holds {part.stat().st_size if part.exists() else 0} bytes, "
                       "run the command again to resume")


def fetch_archive(src: Source, a: Archive, downloads: Path, root: Path, progress: bool = True,
                  timeout: float = 60.0, attempts: int = 5) -> Path:
    """The verified archive file in ``downloads`` (downloaded, resumed, or
    already there)."""
    final = downloads / a.filename
    part = final.with_name(final.name + ".part")
    if not final.exists():
        errors = []
        for url in (a.url, *a.mirrors):
            try:
                _download(url, part, a.size, progress, timeout, attempts)
                break
            except _Unreachable as e:
                errors.append(str(e))
        else:
            mirrors = f" (and {len(a.mirrors)} mirror(s))" if a.mirrors else ""
            raise DataError(f"cannot download {src.name}: {a.url}{mirrors} failed: {errors[0]}; download "
                            f"that file by other means (browser, gdown, another machine) to {final} and run "
                            f"`rayfed-dg data fetch {src.name} --root {root}` again")
        part.replace(final)
    problem = None
    if a.size is not None and final.stat().st_size != a.size:
        problem = f"size {final.stat().st_size} bytes, expected {a.size}"
    elif a.sha256 is not None:
        got = sha256_of(final)
        if got != a.sha256:
            problem = f"SHA-256 {got}, expected {a.sha256}"
    else:
        # no published checksum for this archive: say what arrived, so it can be compared and pinned
        _say(f"{a.filename}: no published SHA-256 to check against; this file's is {sha256_of(final)} "
             f"({final.stat().st_size} bytes)")
    if problem:
        final.unlink()
        raise DataError(f"{a.filename} from {a.url} is not the published file ({problem}); it was deleted and "
                        f"nothing was extracted; run the command again, or fetch it by hand to {final}")
    return final


def extract(archive: Path, into: Path) -> None:
    """Unpack a zip or tar (any compression) into ``into``; member paths that
    would leave it are refused (tar ``data`` filter, zip sanitising)."""
    into.mkdir(parents=True, exist_ok=True)
    try:
        if zipfile.is_zipfile(archive):
            with zipfile.ZipFile(archive) as z:
                z.extractall(into)
        elif tarfile.is_tarfile(archive):
            with tarfile.open(archive) as t:
                t.extractall(into, filter="data")
        else:
            raise DataError(f"{archive} is neither a zip nor a tar archive")
    except (zipfile.BadZipFile, tarfile.TarError, EOFError, OSError) as e:
        raise DataError(f"cannot extract {archive}: {_one_line(e)}") from None


def find_top(tree: Path, marker: tuple[str, ...], depth: int = 3) -> Path | None:
    """The shallowest folder of ``tree`` (down to ``depth`` levels) holding
    every entry of ``marker``."""
    level = [tree]
    for _ in range(depth + 1):
        for d in level:
            if all((d / m).exists() for m in marker):
                return d
        level = sorted(c for d in level for c in d.iterdir() if c.is_dir() and not c.name.startswith("."))
    return None


def _check(src: Source, tree: Path):
    from .folders import list_layout

    return list_layout(src.loader, tree)


def fetch(name: str, root: str | Path | None = None, progress: bool = True, keep_archives: bool = False,
          source: Source | None = None, timeout: float = 60.0, attempts: int = 5) -> Path:
    """Install dataset ``name`` (or ``source``) under ``root`` (default: the
    data root) and return its folder.  A folder that is already complete is
    left alone."""
    src = source or get_source(name)
    base = Path(root).expanduser() if root is not None else data_root()
    dest = base / src.folder
    if dest.exists():
        try:
            lst = _check(src, dest)
        except DataError as e:
            raise DataError(f"{dest} exists but is not a complete {src.name} tree ({_one_line(e)}); "
                            "move it away and run the command again") from None
        _say(f"{src.name}: {dest} is already there ({len(lst.files)} images); nothing to do")
        return dest
    base.mkdir(parents=True, exist_ok=True)
    downloads = base / ".downloads"
    downloads.mkdir(exist_ok=True)
    files = [fetch_archive(src, a, downloads, base, progress, timeout, attempts) for a in src.archives]
    staging = base / f".{src.folder}.partial"
    shutil.rmtree(staging, ignore_errors=True)  # what a killed earlier attempt left
    try:
        unpacked = staging / "unpacked"
        for f in files:
            _say(f"extracting {f.name}")
            extract(f, unpacked)
        top: Path | None
        if src.arrange is not None:
            top = staging / "arranged"
            top.mkdir()
            src.arrange(unpacked, top)
        else:
            top = find_top(unpacked, src.marker)
            if top is None:
                found = ", ".join(sorted(p.name for p in unpacked.iterdir())[:8]) or "nothing"
                raise DataError(f"the {src.name} archive(s) hold no folder with {', '.join(src.marker)} "
                                f"(top level: {found}); nothing was installed")
        try:
            lst = _check(src, top)
        except DataError as e:
            raise DataError(f"the extracted {src.name} tree is not what data.name={src.loader} reads "
                            f"({_one_line(e)}); nothing was installed") from None
        top.rename(dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if not keep_archives:
        for f in files:
            f.unlink(missing_ok=True)
    counts = ", ".join(f"{d} {n}" for d, n in lst.counts().items())
    _say(f"{src.name}: {len(lst.files)} images ({counts}) in {dest}")
    return dest


def describe(width: int = 100) -> tuple[list[list[str]], str]:
    """What ``rayfed-dg data list`` prints: rows of name, folder (under the
    data root), present, checks; and, wrapped to ``width`` columns, each
    dataset's archives and who publishes them."""
    import textwrap

    from .sources import source_names

    rows, lines = [], []
    for n in source_names():
        s = get_source(n)
        checks = "sha256 + layout" if all(a.sha256 for a in s.archives) else \
            "size + layout" if all(a.size for a in s.archives) else "layout"
        present = "yes" if (data_root() / s.folder).is_dir() else "no"
        rows.append([n, s.folder, present, checks])
        loader = "" if s.loader == n else f" (data.name {s.loader})"
        text = f"{n}{loader}: {', '.join(a.filename for a in s.archives)}; {s.origin}"
        lines.append(textwrap.fill(text, width, initial_indent="  ", subsequent_indent="      "))
    return rows, "\n".join(lines)

