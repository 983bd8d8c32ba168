"""Run directories kept on remote storage (S3, GCS, or a folder, through
``pyarrow.fs``), so that nothing of value lives only on the machine a run
started on.

A run directory is written locally as always; with ``output.sync_to: URI``
its copy ``URI/<its name>`` is brought up to date (``Mirror.sync``) when the
run starts, after every checkpoint and when a row ends.  ``rayfed-dg run
--resume URI/<name>`` on another machine downloads the copy (``download``)
and resumes it, and the resumed run goes on updating the same copy.
Credentials and endpoints are pyarrow's: on AWS the instance profile's, else
the ``AWS_*`` variables (``AWS_ENDPOINT_URL_S3`` for an S3-compatible server).

A resume never takes a half-uploaded checkpoint for a complete one.  An
object appears whole or not at all (an S3 PUT or multipart upload), and a sync
uploads every changed file before the files that say others are complete (the
run directory names them, ``rundir.marks_complete``: the checkpoints' digests,
which hash the ``.pt`` and the client-state pieces it names, and the rows'
summaries); only then does it delete what the run directory no longer holds
(superseded checkpoints), digests first.  A copy cut off at any moment holds a
checkpoint whose digest matches, at worst the one before, and every table row
up to it.
"""
from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rayfed_dg.errors import ConfigError


def open_uri(uri: str) -> tuple[Any, str]:
    """(pyarrow filesystem, path in it) of ``uri``; a URI pyarrow cannot open is a ConfigError."""
    import pyarrow.fs as pafs

    try:
        return pafs.FileSystem.from_uri(uri.rstrip("/"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{uri}: not a storage URI pyarrow can open ({e}); give s3://bucket/prefix, gs://... "
                          "or a folder") from None


def remote_files(fs: Any, base: str) -> dict[str, tuple[int, int | None]]:
    """{path relative to ``base``: (size, modification time in ns or None)} of every file below ``base`` ({}
    when there is none)."""
    import pyarrow.fs as pafs

    sel = pafs.FileSelector(base, recursive=True, allow_not_found=True)
    return {i.path[len(base) + 1:]: (i.size, i.mtime_ns) for i in fs.get_file_info(sel)
            if i.type == pafs.FileType.File}


def local_files(root: Path, scratch: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """{relative path: (size, mtime)} of the files a copy holds: none in a ``scratch`` folder, no temporary
    (``.NAME.tmp``)."""
    out = {}
    for p in root.rglob("*"):
        rel = p.relative_to(root)
        if any(part in scratch or part.startswith(".") for part in rel.parts):
            continue
        try:
            st = p.stat()
        except FileNotFoundError:  # removed since listed
            continue
        if p.is_file():
            out[rel.as_posix()] = (st.st_size, st.st_mtime_ns)
    return out


class Mirror:
    """The copy of the run directory ``local`` at ``uri``, kept by one
    process: it uploads what changed since its last sync (a file's size or
    modification time), and on its first, what the copy lacks, holds at
    another size, or wrote before the file last changed here (a resumed
    run's download is marked sent by ``cli``: not sent back).  ``last(rel)``:
    whether the file says others are complete (uploaded last, deleted first);
    ``scratch``: folders never copied."""

    def __init__(self, local: Path, uri: str, last: Callable[[str], bool], scratch: tuple[str, ...] = ()):
        import pyarrow.fs as pafs

        self.local, self.uri, self.last, self.scratch = Path(local), uri.rstrip("/"), last, scratch
        self.fs, self.base = open_uri(self.uri)
        self.folders = isinstance(self.fs, pafs.LocalFileSystem)  # object stores have no folders to make
        self.sent: dict[str, tuple[int, int]] | None = None

    def __repr__(self) -> str:
        return f"Mirror({str(self.local)!r} -> {self.uri!r})"

    def check_new(self) -> None:
        """A ConfigError unless a new run can start its copy here: the bucket
        exists, can be read, and holds no run under this name."""
        import pyarrow.fs as pafs

        try:
            bucket = None if self.folders else self.fs.get_file_info(self.base.split("/")[0])
            taken = remote_files(self.fs, self.base)
        except OSError as e:
            raise ConfigError(f"output.sync_to: cannot read {self.uri} ({e}); check the bucket and the credentials "
                              "(on AWS: the node's instance profile)") from None
        if bucket is not None and bucket.type == pafs.FileType.NotFound:
            hint = f" (aws s3 mb s3://{bucket.path})" if self.uri.startswith("s3://") else ""
            raise ConfigError(f"output.sync_to: {self.uri}: no bucket {bucket.path}; create it{hint} or name another")
        if taken:
            raise ConfigError(f"output.sync_to: {self.uri} already holds a run; choose another --run-dir name, or "
                              f"continue that run with --resume {self.uri}")

    def sync(self) -> None:
        local = local_files(self.local, self.scratch)
        if self.sent is None:
            # a file is up to date there when it has the same size and was written there after it was last
            # changed here: a run resumed from its own folder rewrites files at the same size (a repeated round)
            there = remote_files(self.fs, self.base)
            self.sent = {k: v for k, v in local.items()
                         if k in there and there[k][0] == v[0] and (there[k][1] or -1) >= v[1]}
            gone = set(there) - set(local)
        else:
            gone = set(self.sent) - set(local)
        for rel in sorted((k for k, v in local.items() if self.sent.get(k) != v), key=lambda k: (self.last(k), k)):
            if self._put(rel):
                self.sent[rel] = local[rel]
        for rel in sorted(gone, key=lambda k: (not self.last(k), k)):  # a digest goes before what it names
            self.fs.delete_file(f"{self.base}/{rel}")
            self.sent.pop(rel, None)

    def _put(self, rel: str) -> bool:
        try:
            src = open(self.local / rel, "rb")
        except FileNotFoundError:  # removed since listed (a superseded checkpoint): the deletions follow
            return False
        dest = f"{self.base}/{rel}"
        if self.folders:
            self.fs.create_dir(dest.rsplit("/", 1)[0], recursive=True)
        # an object store shows an object whole or not at all; a folder shows a file as it is written, so a
        # file there is written beside its name and moved onto it
        part = f"{dest.rsplit('/', 1)[0]}/.{dest.rsplit('/', 1)[1]}.tmp" if self.folders else dest
        with src, self.fs.open_output_stream(part) as out:
            while chunk := src.read(1 << 23):
                out.write(chunk)
        if part != dest:
            self.fs.move(part, dest)
        return True


def download(uri: str, dest: Path, marker: str) -> Path:
    """The run directory at ``uri`` copied to ``dest`` (replacing what was there); returns ``dest``.
    ``marker``: the file every run directory holds (the run directory names it), refused where absent."""
    fs, base = open_uri(uri)
    try:
        files = remote_files(fs, base)
    except OSError as e:
        raise ConfigError(f"--resume {uri}: cannot list it ({e}); check the URI and the credentials") from None
    if marker not in files:  # a prefix of several runs (output.sync_to without the name) is not one
        raise ConfigError(f"--resume {uri}: no run there (no {marker}); give the run directory's copy, "
                          "<output.sync_to>/<run name>")
    shutil.rmtree(dest, ignore_errors=True)
    for rel in files:
        path = dest / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        with fs.open_input_stream(f"{base}/{rel}") as src, open(path, "wb") as out:
            while chunk := src.read(1 << 23):
                out.write(chunk)
    return dest


def upload_files(files: list[Path], uri: str) -> None:
    """Each of ``files`` to ``uri/<its name>`` (a sweep's tables beside its trials)."""
    import pyarrow.fs as pafs

    fs, base = open_uri(uri)
    if isinstance(fs, pafs.LocalFileSystem):
        fs.create_dir(base, recursive=True)
    for f in files:
        with fs.open_output_stream(f"{base}/{f.name}") as out:
            out.write(f.read_bytes())


def delete_file(uri: str) -> None:
    """The file at ``uri`` deleted, if there is one."""
    import pyarrow.fs as pafs

    fs, path = open_uri(uri)
    if fs.get_file_info(path).type == pafs.FileType.File:
        fs.delete_file(path)
