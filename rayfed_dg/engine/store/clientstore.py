"""``ClientStore``: each client's persistent local state between rounds, in
two tiers, and its incremental checkpoint.

A client's state (the method's ``local_keys`` and private tensors: FedBN's
BN layers, SCAFFOLD's control variate) lives in one of three places:

* memory: the most recently used states, up to a byte budget
  (``engine.client_state_memory_mb``), evicted least recently used first
  (a ``get`` or a ``put`` makes a client the most recent);
* the spill file (``spill.bin`` in ``client_state/<target>/`` of the run
  directory, or a temporary folder when the run has none): a state changed
  since the last checkpoint that memory had no room for;
* a checkpoint piece (``checkpoints/<target>/round_*.clients``): a state
  unchanged since the checkpoint that wrote it.

Besides the states in memory, the server keeps only an index, a few numbers
per client in arrays of the population's size (42 bytes a client, 4.2
MB for 10^5), so its memory does not grow with the clients it has seen.

**Format.**  A state is one *record*: a length-prefixed JSON header (names,
dtypes, shapes) then the tensors' raw bytes, so a record decodes without
pickle, round-trips every bit, and is the same bytes whenever the state is
the same.  Records go into few, large files rather than one file per client
(one .npz per client and version would be 10^5 inodes, a directory scan per
listing and one fsync per client per checkpoint):

* the spill file is one slab of slots, rewritten in place: a state changed
  and evicted takes a free slot of its size (a method's records are all one
  size) or a new one at the end; a slot is freed when its state is replaced
  (``put``) or once a checkpoint holds it, so the file stays as large as the
  most states held there at once (between two checkpoints, or over the
  whole run when none is taken).  It is scratch: never synced, never read
  after the run (a resume reads pieces), and truncated when a store starts
  using it;
* a checkpoint writes one *piece*, ``round_*.clients``: the records of the
  clients changed since the previous checkpoint, then the piece's *index*,
  one record (``clients`` and each record's ``length``, int64, in the
  piece's order; offsets are their running sum) followed by its length (8
  bytes), appended once, synced and renamed into place
  (``utils.atomic_write_with``), never modified after.  An unchanged
  client's record stays where an earlier piece wrote it, and a piece less
  than half of whose record bytes are still current is rewritten into the
  next piece (its current clients join the changed ones), which bounds the
  pieces on disk to twice the live states for one extra write per state at
  most.

**Manifest.**  Every client whose location a checkpoint changes (changed,
or moved out of a rewritten piece) is in that checkpoint's piece, so a
piece's index is the checkpoint's delta manifest, and the whole map (client
-> piece, offset, length) is the indexes of the pieces still current,
applied in round order (a later piece's entry supersedes an earlier one's).
The checkpoint names only those pieces, with each one's SHA-256 and size
(``pieces``; ``checkpoint.py`` verifies them before a resume uses the
checkpoint, and keeps the pieces a kept checkpoint names); ``load`` rebuilds
the map from their indexes.  A checkpoint thus writes 16 bytes of index per
record it writes (and a name and digest per piece still current), never a
full manifest: the rewrite rule that bounds the pieces bounds their indexes
to twice a full one, which is all a resume reads.  The manifest carries
its ``format`` (``formats.PIECES``); older manifests are read through
``formats.piece_indexes``.

Workers receive a client's state inside its task (``ClientTask.local_state``),
as before: the bytes a worker would read from a shared file are the bytes
the task carries, and the server's nodes and the workers' need no shared
file system.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import struct
import tempfile
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np

from rayfed_dg.utils import atomic_write_with

from .formats import piece_indexes, stamp

SPILL = "spill.bin"
_LEN = struct.Struct("<Q")


def piece_name(round: int) -> str:
    """The file a checkpoint of ``round`` writes its changed clients' states to."""
    return f"round_{round:05d}.clients"


def piece_round(name: str) -> int:
    """The round of the checkpoint that wrote the piece ``name``."""
    return int(name.split("_")[1].split(".")[0])


def encode(state: Mapping[str, np.ndarray]) -> bytes:
    """One state as a record (the module docstring's format)."""
    arrays = {k: np.asarray(v, order="C") for k, v in state.items()}  # keeps 0-d (ascontiguousarray: 1-d)
    head = json.dumps([[k, a.dtype.str, list(a.shape)] for k, a in arrays.items()]).encode()
    return b"".join([_LEN.pack(len(head)), head, *(a.tobytes() for a in arrays.values())])


def decode(record: bytes | bytearray | memoryview) -> dict[str, np.ndarray]:
    """A record back into its state: writable arrays with the same bits, dtypes and shapes."""
    buf = memoryview(record)
    if buf.readonly:
        buf = memoryview(bytearray(record))
    (n,) = _LEN.unpack_from(buf)
    pos, out = _LEN.size + n, {}
    for key, dtype, shape in json.loads(bytes(buf[_LEN.size:pos])):
        dt = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        out[key] = np.frombuffer(buf, dt, count, pos).reshape(tuple(shape))
        pos += count * dt.itemsize
    return out


def read_index(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A piece's index (its delta manifest): its clients, and their records'
    offsets and lengths, in the piece's order."""
    with open(path, "rb") as f:
        end = f.seek(0, 2)
        f.seek(max(end - _LEN.size, 0))
        tail = f.read(_LEN.size)
        n = _LEN.unpack(tail)[0] if len(tail) == _LEN.size else end
        if n > end - _LEN.size:
            raise OSError(f"{path}: its index is missing (the file was cut short or written without one)")
        f.seek(end - _LEN.size - n)
        try:
            index = decode(f.read(n))
        except (ValueError, struct.error) as e:  # a length that does not frame a record (JSON's errors are ValueErrors)
            raise OSError(f"{path}: its index cannot be read ({e})") from None
    length = index["length"]
    return index["clients"], np.cumsum(length) - length, length


def _read(path: Path, offset: int, length: int) -> bytearray:
    data = bytearray(length)
    with open(path, "rb") as f:
        f.seek(offset)
        if f.readinto(data) != length:
            raise OSError(f"{path}: a client state's record ends early (the file was cut short)")
    return data


def _nbytes(state: Mapping[str, np.ndarray]) -> int:
    return sum(int(v.nbytes) for v in state.values())


class ClientStore:
    """Per-client persistent state (``local_keys`` and private tensors) of
    ``num_clients`` clients; a client seen for the first time starts from
    ``initial`` (the initial model's local tensors).  ``budget``: bytes of
    states kept in memory; ``directory``: the spill file's folder (None: a
    temporary folder, made when first needed)."""

    def __init__(self, initial: dict[str, np.ndarray], num_clients: int, budget: int,
                 directory: Path | None = None):
        self.initial, self.budget = initial, budget
        self._mem: OrderedDict[int, dict[str, np.ndarray]] = OrderedDict()  # least recently used first
        self._mem_bytes = 0
        self._dirty = np.zeros(num_clients, bool)  # changed since the last checkpoint
        self._has = np.zeros(num_clients, bool)  # has a state of its own
        # the last checkpoint's map: piece (its round, -1: none), offset, length
        self._piece = np.full(num_clients, -1, np.int64)
        self._offset = np.zeros(num_clients, np.int64)
        self._length = np.zeros(num_clients, np.int64)
        # round -> {"sha256", "bytes", "records": the bytes before its index} of the pieces the map names
        self._pieces: dict[int, dict] = {}
        self._piece_dir: Path | None = None
        self._rewrite_all = False  # the map came from pieces without an index: the next piece takes every state
        # spill slots: offset and length of the client's current state there (-1: none)
        self._slot = np.full(num_clients, -1, np.int64)
        self._slen = np.full(num_clients, -1, np.int64)
        self._free: dict[int, list[int]] = {}  # length -> offsets of free slots
        self._end = 0  # the spill file's length
        self._dir = directory
        self._spill_made = False

    # ------------------------------------------------------------ reads and writes

    def get(self, client: int) -> dict[str, np.ndarray]:
        if client in self._mem:
            self._mem.move_to_end(client)
            return self._mem[client]
        if not self._has[client]:
            return self.initial
        state = decode(self._record(client))
        self._keep(client, state)
        return state

    def put(self, client: int, update: dict[str, np.ndarray], private: dict[str, np.ndarray]) -> None:
        local = {k: update[k] for k in self.initial if k in update}
        local.update(private)
        # copies: ``update`` may be read-only views of the object store
        self._set(client, {k: np.array(v) for k, v in local.items()})

    def _set(self, client: int, state: dict[str, np.ndarray]) -> None:
        self._drop(client)
        if not state:  # a method without local state (FedAvg): ``initial`` is just as empty
            return
        self._has[client] = True
        self._dirty[client] = True
        self._free_slot(client)  # its spilled copy, if any, is stale
        self._keep(client, state)

    def clients(self) -> list[int]:
        """The clients with a state of their own, ascending."""
        return np.flatnonzero(self._has).tolist()

    def view(self) -> Mapping[int, dict[str, np.ndarray]]:
        """Every client's own state by id, read from the store when asked for (not all at once)."""
        return _View(self)

    def snapshot(self) -> dict[int, dict[str, np.ndarray]]:
        """Every client's own state in one dict (tests and tools: it holds them all in memory)."""
        return {c: self.get(c) for c in self.clients()}

    def in_memory(self) -> list[int]:
        """The clients whose state is in memory, least recently used first."""
        return list(self._mem)

    @property
    def memory_bytes(self) -> int:
        return self._mem_bytes

    @property
    def spill_bytes(self) -> int:
        """The spill file's length (its free slots included)."""
        return self._end

    def _keep(self, client: int, state: dict[str, np.ndarray]) -> None:
        """``state`` into memory as the most recent; evict the least recent until the budget holds."""
        size = _nbytes(state)
        if size > self.budget:  # never fits: straight to disk when it has no copy there
            self._evict(client, state)
            return
        self._mem[client] = state
        self._mem_bytes += size
        while self._mem_bytes > self.budget:
            old, s = self._mem.popitem(last=False)
            self._mem_bytes -= _nbytes(s)
            self._evict(old, s)

    def _drop(self, client: int) -> None:
        s = self._mem.pop(client, None)
        if s is not None:
            self._mem_bytes -= _nbytes(s)

    def _evict(self, client: int, state: dict[str, np.ndarray]) -> None:
        """A state leaves memory: written to the spill file unless disk has it
        already (a spilled copy, or the last checkpoint's piece when unchanged)."""
        if self._dirty[client] and self._slot[client] < 0:
            self._spill(client, encode(state))

    def _record(self, client: int) -> bytearray:
        """The client's current state as a record, from disk (it is not in memory)."""
        if self._dirty[client]:
            return _read(self._spill_path(), int(self._slot[client]), int(self._slen[client]))
        assert self._piece_dir is not None
        return _read(self._piece_dir / piece_name(int(self._piece[client])), int(self._offset[client]),
                     int(self._length[client]))

    # ------------------------------------------------------------ the spill file

    def use_directory(self, directory: Path) -> None:
        """Spill to ``directory`` (the run directory's folder for this
        federation); called before the first round, when nothing has spilled."""
        if self._spill_made:
            raise RuntimeError(f"the client store spills to {self._dir} already")
        self._dir = Path(directory)

    def _spill_path(self) -> Path:
        assert self._dir is not None
        return self._dir / SPILL

    def _make_spill(self) -> None:
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="rayfed-dg-clients-"))
            weakref.finalize(self, shutil.rmtree, self._dir, True)
        else:
            self._dir.mkdir(parents=True, exist_ok=True)
            weakref.finalize(self, self._spill_path().unlink, True)
        self._spill_path().write_bytes(b"")  # a resumed run's old scratch is garbage
        self._spill_made = True

    def _spill(self, client: int, record: bytes) -> None:
        """``record`` into a free slot of its length, or a new one at the end (the client has none)."""
        if not self._spill_made:
            self._make_spill()
        n = len(record)
        free = self._free.get(n)
        self._slot[client] = free.pop() if free else self._end
        self._end = max(self._end, int(self._slot[client]) + n)
        with open(self._spill_path(), "r+b") as f:
            f.seek(int(self._slot[client]))
            f.write(record)
        self._slen[client] = n

    def _free_slot(self, client: int) -> None:
        if self._slot[client] >= 0:
            self._free.setdefault(int(self._slen[client]), []).append(int(self._slot[client]))
        self._slot[client], self._slen[client] = -1, -1

    # ------------------------------------------------------------ checkpoints

    def checkpoint(self, directory: Path, round: int) -> dict:
        """Write the states changed since the last checkpoint (and those of
        pieces less than half current: the module docstring) as the piece of
        ``round`` in ``directory``, its index last; returns the manifest:
        ``pieces``, the pieces the map is made of (file name -> {"sha256",
        "bytes"}; ``load`` reads the map back from them)."""
        directory = Path(directory)
        self._piece[self._dirty] = -1  # superseded: no longer counts as live in its piece
        rewrite = self._dirty.copy()
        if self._rewrite_all or (self._piece_dir is not None and directory != self._piece_dir):
            rewrite |= self._piece >= 0  # a new folder, or pieces without an index: every state
        else:
            at = self._piece >= 0
            live = np.bincount(self._piece[at], self._length[at], max(self._pieces, default=-1) + 1)
            stale = [p for p, info in self._pieces.items() if 2 * live[p] < info["records"]]
            if stale:
                rewrite |= np.isin(self._piece, stale)
        order = np.flatnonzero(rewrite)
        lengths = np.zeros(len(order), np.int64)
        sha, size = hashlib.sha256(), [0]

        def write(f) -> None:
            for i, c in enumerate(order.tolist()):
                rec = encode(self._mem[c]) if c in self._mem else self._record(c)
                f.write(rec)
                sha.update(rec)
                lengths[i] = len(rec)
            index = encode({"clients": order, "length": lengths})
            tail = index + _LEN.pack(len(index))
            f.write(tail)
            sha.update(tail)
            size[0] = int(lengths.sum()) + len(tail)

        directory.mkdir(parents=True, exist_ok=True)
        if len(order):
            atomic_write_with(directory / piece_name(round), write)
            self._piece[order] = round
            self._offset[order] = np.cumsum(lengths) - lengths
            self._length[order] = lengths
            self._pieces[round] = {"sha256": sha.hexdigest(), "bytes": size[0], "records": int(lengths.sum())}
        for c in np.flatnonzero(self._dirty).tolist():
            self._free_slot(c)
        self._dirty[:] = False
        self._rewrite_all = False
        self._piece_dir = directory
        named = set(np.unique(self._piece[self._piece >= 0]).tolist())
        self._pieces = {p: info for p, info in self._pieces.items() if p in named}
        return self.manifest()

    def manifest(self) -> dict:
        """The last checkpoint's manifest (``checkpoint``'s return value)."""
        pieces = {piece_name(p): {"sha256": i["sha256"], "bytes": i["bytes"]} for p, i in sorted(self._pieces.items())}
        return stamp("client-state manifest", {"pieces": pieces})

    def locations(self) -> dict[str, np.ndarray]:
        """The last checkpoint's map, by client (tests and tools): ``clients``
        (ascending) and their records' ``piece`` (its round), ``offset``, ``length``."""
        ids = np.flatnonzero(self._piece >= 0)
        return {"clients": ids, "piece": self._piece[ids], "offset": self._offset[ids], "length": self._length[ids]}

    def load(self, manifest: dict, directory: Path) -> None:
        """Start over from a checkpoint's ``manifest`` whose pieces are in
        ``directory``: the map is their indexes, applied in round order."""
        self._reset()
        directory = Path(directory)
        indexes, self._rewrite_all = piece_indexes(manifest, directory)
        for p, (ids, offset, length) in sorted(indexes.items()):
            self._piece[ids], self._offset[ids], self._length[ids] = p, offset, length
            self._pieces[p] = dict(manifest["pieces"][piece_name(p)], records=int(length.sum()))
        self._has[self._piece >= 0] = True
        self._piece_dir = directory

    def load_states(self, states: dict[int, dict[str, np.ndarray]]) -> None:
        """Start over from every client's state (``client_store``, a state
        without pieces): each counts as changed, so the next checkpoint writes them all."""
        self._reset()
        for c in sorted(states):
            self._set(int(c), {k: np.array(v) for k, v in states[c].items()})

    def _reset(self) -> None:
        self._mem.clear()
        self._mem_bytes = 0
        self._dirty[:], self._has[:] = False, False
        self._piece[:] = -1
        self._slot[:], self._slen[:] = -1, -1
        self._free.clear()
        self._pieces, self._piece_dir, self._end, self._rewrite_all = {}, None, 0, False
        if self._spill_made:
            self._spill_path().write_bytes(b"")


class _View(Mapping):
    def __init__(self, store: ClientStore):
        self.store, self.ids = store, store.clients()

    def __getitem__(self, client: int) -> dict[str, np.ndarray]:
        if not self.store._has[client]:
            raise KeyError(client)
        return self.store.get(client)

    def __iter__(self) -> Iterator[int]:
        return iter(self.ids)

    def __len__(self) -> int:
        return len(self.ids)
