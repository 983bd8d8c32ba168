"""The tiered client-state store (engine/store/clientstore.py): its memory budget,
spilling, incremental checkpoints and their pieces, and resume end to end."""
import hashlib
import json
import warnings

import numpy as np
import pytest
import torch
from conftest import tiny_cfg

from rayfed_dg.engine.running.run import ROWS
from rayfed_dg.engine.store.checkpoint import CheckpointWarning, checkpoint_files, load_latest, save_checkpoint
from rayfed_dg.engine.store.clientstore import ClientStore, decode, encode, piece_name, read_index
from rayfed_dg.engine.store.formats import upgrade_checkpoint_state

INIT = {"w": np.zeros(4, np.float32)}  # 16 bytes: every state below is one such tensor


def state(v: float) -> dict[str, np.ndarray]:
    return {"w": np.full(4, v, np.float32)}


def filled(n: int, budget: int, directory=None) -> ClientStore:
    store = ClientStore(INIT, n, budget, directory)
    for c in range(n):
        store.put(c, state(c), {})
    return store


def test_record_round_trips_every_bit():
    rng = np.random.default_rng(0)
    f32 = rng.standard_normal((3, 5)).astype(np.float32)
    f32[0, 0] = np.frombuffer(np.uint32(0x7FC00001).tobytes(), np.float32)[0]  # a NaN with a payload
    s = {"conv.weight": f32, "t": f32.T, "n": np.array(7, np.int64), "h": rng.standard_normal(6).astype(np.float16),
         "empty": np.zeros((0, 3), np.float32), "mask": np.array([True, False])}
    back = decode(encode(s))
    assert list(back) == list(s)
    for k in s:
        assert back[k].dtype == s[k].dtype and back[k].shape == s[k].shape
        assert back[k].tobytes() == np.ascontiguousarray(s[k]).tobytes(), k
        assert back[k].flags.writeable
    assert encode(s) == encode(back)  # the same state is the same bytes (pieces' digests do not depend on the run)


def test_least_recently_used_is_evicted_under_the_byte_budget(tmp_path):
    """Budget 40 bytes, states of 16: two fit.  Hand-traced: put 0, 1, 2 ->
    [1, 2] (0 spilled); get 1 -> [2, 1]; put 3 -> [1, 3] (2 spilled); get 0
    (read back) -> [3, 0] (1 spilled); put 1 (new value) -> [0, 1] (3 spilled)."""
    store = ClientStore(INIT, 5, 40, tmp_path)
    for c in (0, 1, 2):
        store.put(c, state(c), {})
    assert store.in_memory() == [1, 2] and store.memory_bytes == 32
    store.get(1)
    assert store.in_memory() == [2, 1]
    store.put(3, state(3), {})
    assert store.in_memory() == [1, 3]
    assert store.get(0)["w"].tolist() == [0.0] * 4 and store.in_memory() == [3, 0]
    store.put(1, state(11), {})
    assert store.in_memory() == [0, 1] and store.memory_bytes == 32
    rec = len(encode(state(0)))
    assert store.spill_bytes == 3 * rec  # 0, 2, 1 (its old value) spilled; 3 took the slot 1's new value freed
    assert (tmp_path / "spill.bin").stat().st_size == 3 * rec
    assert [store.get(c)["w"][0] for c in range(4)] == [0, 11, 2, 3]
    assert store.get(4) is INIT  # never seen: the initial state


def test_budget_zero_keeps_nothing_in_memory_and_reads_back_the_same_bits(tmp_path):
    rng = np.random.default_rng(1)
    init = {"a": np.zeros((2, 3), np.float32), "b": np.zeros(5, np.float64)}
    store = ClientStore(init, 50, 0, tmp_path)
    states = {c: {"a": rng.standard_normal((2, 3)).astype(np.float32), "b": rng.standard_normal(5)}
              for c in range(50)}
    for c, s in states.items():
        store.put(c, s, {"ci": s["b"][:2] * 2})  # a private tensor travels with the local ones
    assert store.in_memory() == [] and store.memory_bytes == 0
    for c, s in states.items():
        got = store.get(c)
        assert got["a"].tobytes() == s["a"].tobytes() and got["b"].tobytes() == s["b"].tobytes()
        assert got["ci"].tobytes() == (s["b"][:2] * 2).tobytes()
    size = store.spill_bytes
    for c in range(50):  # a client spilled again takes its own slot back: the file does not grow
        store.put(c, states[c], {"ci": states[c]["b"][:2]})
    assert store.spill_bytes == size


def index_bytes(n: int) -> int:
    """A piece's index of ``n`` records, by hand: the record's length prefix, its JSON header, two int64
    arrays of ``n``, and the 8 bytes of its own length."""
    return 8 + len(json.dumps([["clients", "<i8", [n]], ["length", "<i8", [n]]])) + 16 * n + 8


def test_checkpoint_writes_exactly_the_clients_changed_since_the_previous_one(tmp_path):
    store = filled(10, 40, tmp_path / "spill")
    rec = len(encode(state(0)))
    m1 = store.checkpoint(tmp_path, 1)
    loc = store.locations()
    assert loc["clients"].tolist() == list(range(10)) and set(loc["piece"].tolist()) == {1}
    assert loc["offset"].tolist() == [c * rec for c in range(10)] and set(loc["length"].tolist()) == {rec}
    assert (tmp_path / piece_name(1)).stat().st_size == 10 * rec + index_bytes(10) == m1["pieces"][piece_name(1)][
        "bytes"]
    for c in (7, 2, 5):
        store.put(c, state(100 + c), {})
    assert store.spill_bytes == 8 * rec  # 7, spilled again, takes a slot the piece freed
    m2 = store.checkpoint(tmp_path, 2)
    loc = store.locations()
    assert loc["clients"][loc["piece"] == 2].tolist() == [2, 5, 7]
    assert (tmp_path / piece_name(2)).stat().st_size == 3 * rec + index_bytes(3)
    assert read_index(tmp_path / piece_name(2))[0].tolist() == [2, 5, 7]  # the delta: the changed clients only
    assert sorted(m2["pieces"]) == [piece_name(1), piece_name(2)]  # the 7 unchanged ones stay in piece 1
    m3 = store.checkpoint(tmp_path, 3)  # nothing changed: no piece, the same manifest
    assert not (tmp_path / piece_name(3)).exists() and m3 == m2
    # the states a fresh store reads back from the pieces alone
    fresh = ClientStore(INIT, 10, 40)
    fresh.load(m3, tmp_path)
    assert all(np.array_equal(a, b) for a, b in zip(fresh.locations().values(), store.locations().values()))
    assert [fresh.get(c)["w"][0] for c in range(10)] == [100 + c if c in (2, 5, 7) else c for c in range(10)]
    assert fresh.in_memory() == [8, 9]


def test_each_piece_indexes_its_changed_and_relocated_clients_and_the_manifest_names_the_live_pieces(tmp_path):
    """100 clients, checkpoints 1-5 each change 10 new ones (10k..10k+9):
    piece k's index is exactly those 10 (the same 16 bytes each however many
    clients were touched before) and the manifest names pieces 1-5.
    Checkpoint 6 changes 10-15: piece 1 keeps 4 of 10 current (under half),
    so 16-19 move with them into piece 6, whose index is 10-19 (the 6
    changed, then the 4 relocated, in id order), and piece 1 leaves the
    manifest.  A store loaded from the pieces alone has the same map and
    states."""
    store = ClientStore(INIT, 100, 0, tmp_path / "spill")
    rec = len(encode(state(0)))
    for k in range(1, 6):
        for c in range(10 * k, 10 * k + 10):
            store.put(c, state(c), {})
        m = store.checkpoint(tmp_path, k)
        clients, offset, length = read_index(tmp_path / piece_name(k))
        assert clients.tolist() == list(range(10 * k, 10 * k + 10))
        assert offset.tolist() == [i * rec for i in range(10)] and length.tolist() == [rec] * 10
        assert m["pieces"][piece_name(k)]["bytes"] == 10 * rec + index_bytes(10)
        assert sorted(m["pieces"]) == [piece_name(r) for r in range(1, k + 1)]
    for c in range(10, 16):
        store.put(c, state(1000 + c), {})
    m = store.checkpoint(tmp_path, 6)
    assert read_index(tmp_path / piece_name(6))[0].tolist() == list(range(10, 20))
    assert sorted(m["pieces"]) == [piece_name(r) for r in range(2, 7)]
    fresh = ClientStore(INIT, 100, 0)
    fresh.load(m, tmp_path)
    assert all(np.array_equal(a, b) for a, b in zip(fresh.locations().values(), store.locations().values()))
    assert fresh.clients() == list(range(10, 60))
    assert [fresh.get(c)["w"][0] for c in range(10, 60)] == [1000 + c if c < 16 else c for c in range(10, 60)]


def test_the_map_is_the_live_pieces_indexes_in_round_order(tmp_path):
    """A client in two named pieces is where the later one says: 0-3 in
    piece 1; 0 and 1 change (piece 2: half of piece 1 is current, it stays);
    then 0 again (piece 3 holds only 0; piece 2 has 1 current of 2, half,
    and stays).  Loading the manifest reads the three indexes in order:
    0 from piece 3 (not 1 or 2), 1 from piece 2, 2 and 3 from piece 1."""
    store = filled(4, 1000)
    store.checkpoint(tmp_path, 1)
    for c in (0, 1):
        store.put(c, state(10 + c), {})
    store.checkpoint(tmp_path, 2)
    store.put(0, state(20), {})
    m = store.checkpoint(tmp_path, 3)
    assert sorted(m["pieces"]) == [piece_name(1), piece_name(2), piece_name(3)]
    assert [read_index(tmp_path / piece_name(r))[0].tolist() for r in (1, 2, 3)] == [[0, 1, 2, 3], [0, 1], [0]]
    fresh = ClientStore(INIT, 4, 1000)
    fresh.load(m, tmp_path)
    assert fresh.locations()["piece"].tolist() == [3, 2, 1, 1]
    assert [fresh.get(c)["w"][0] for c in range(4)] == [20, 11, 2, 3]


def test_a_piece_less_than_half_current_is_rewritten_into_the_next(tmp_path):
    """Piece 1 holds clients 0-3; after 0, 1, 2 change only client 3 (a
    quarter) is current there, so piece 2 takes it too and piece 1 is named
    no more; at 2 of 4 (a half) a piece stays."""
    store = filled(4, 1000)
    store.checkpoint(tmp_path, 1)
    for c in (0, 1):
        store.put(c, state(10 + c), {})
    store.checkpoint(tmp_path, 2)
    assert store.locations()["piece"].tolist() == [2, 2, 1, 1]
    store.put(2, state(12), {})
    m3 = store.checkpoint(tmp_path, 3)
    assert store.locations()["piece"].tolist() == [2, 2, 3, 3]
    assert sorted(m3["pieces"]) == [piece_name(2), piece_name(3)]
    assert read_index(tmp_path / piece_name(3))[0].tolist() == [2, 3]  # 3 relocated with the changed 2
    fresh = ClientStore(INIT, 4, 0)
    fresh.load(m3, tmp_path)
    assert [fresh.get(c)["w"][0] for c in range(4)] == [10, 11, 12, 3]


def test_without_checkpoints_a_replaced_state_frees_its_spill_slot(tmp_path):
    """No checkpoint ever: budget 40 bytes (two states of 16).  Put 0-3 ->
    0 and 1 spilled (2 slots).  Put 0 anew: its slot is free, and 2, evicted,
    takes it; put 1 anew: 3 takes 1's.  The file stays at the 2 states held
    only on disk; 100 more rounds of new values for 4 of 10 clients keep it
    at most at the 8 that can be on disk at once."""
    store = ClientStore(INIT, 10, 40, tmp_path)
    rec = len(encode(state(0)))
    for c in range(4):
        store.put(c, state(c), {})
    assert store.spill_bytes == 2 * rec
    store.put(0, state(10), {})
    store.put(1, state(11), {})
    assert store.in_memory() == [0, 1] and store.spill_bytes == 2 * rec
    assert [store.get(c)["w"][0] for c in range(4)] == [10, 11, 2, 3]
    values = {c: float(c) for c in range(10)} | {0: 10.0, 1: 11.0}
    rng = np.random.default_rng(0)
    for r in range(100):
        for c in rng.choice(10, 4, replace=False).tolist():
            values[c] = 100.0 * r + c
            store.put(c, state(values[c]), {})
    assert store.spill_bytes <= 8 * rec
    assert [store.get(c)["w"][0] for c in range(10)] == [values[c] for c in range(10)]


def test_a_piece_without_a_whole_index_is_refused_in_one_line_and_one_without_records_reads(tmp_path):
    """A file too short for the index's length, a length longer than the
    file, or one that frames no record (0, 8): ``OSError`` naming the file,
    never a struct, JSON or seek error.  An index with no records before it
    is a whole piece."""
    cases = {"short": (b"abc", "is missing"), "long": (b"x" * 20 + np.int64(24).tobytes(), "is missing"),  # 24 > 28 - 8
             "zero": (bytes(8), "cannot be read"), "eight": (b"y" * 8 + np.int64(8).tobytes(), "cannot be read")}
    for name, (data, why) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(OSError, match=f"{name}: its index {why}"):
            read_index(tmp_path / name)
    index = encode({"clients": np.zeros(0, np.int64), "length": np.zeros(0, np.int64)})
    (tmp_path / "empty").write_bytes(index + np.int64(len(index)).tobytes())
    assert [a.tolist() for a in read_index(tmp_path / "empty")] == [[], [], []]


def test_a_spilled_record_cut_short_is_refused(tmp_path):
    store = ClientStore(INIT, 3, 16, tmp_path)  # one state in memory: 0 spills when 1 arrives
    store.put(0, state(1), {})
    store.put(1, state(2), {})
    spill = tmp_path / "spill.bin"
    spill.write_bytes(spill.read_bytes()[:-1])
    with pytest.raises(OSError, match="a client state's record ends early"):
        store.get(0)


def test_a_state_read_back_from_the_spill_file_is_not_written_there_again(tmp_path):
    """Budget 40 (two states).  Put 0, 1, 2: 0 spilled at offset 0.  Get 0:
    1 spilled.  Put 3: 2 spilled.  Put 4: 0 leaves memory again, and its
    copy at offset 0 is still current: three slots, not four."""
    store = ClientStore(INIT, 5, 40, tmp_path)
    rec = len(encode(state(0)))
    for c in (0, 1, 2):
        store.put(c, state(c), {})
    store.get(0)
    store.put(3, state(3), {})
    store.put(4, state(4), {})
    assert store.in_memory() == [3, 4] and store.spill_bytes == 3 * rec
    assert [store.get(c)["w"][0] for c in range(5)] == [0, 1, 2, 3, 4]


def test_a_checkpoint_frees_the_spill_slots_of_the_states_it_holds(tmp_path):
    """Budget 16 (one state).  Put 0, 1: 0 spilled.  A checkpoint holds
    both, so 0's slot is free: 2, evicted by 3, takes it."""
    store = ClientStore(INIT, 4, 16, tmp_path / "spill")
    rec = len(encode(state(0)))
    store.put(0, state(0), {})
    store.put(1, state(1), {})
    store.checkpoint(tmp_path, 1)
    store.put(2, state(2), {})  # 1 leaves memory: unchanged since the checkpoint, nothing written
    store.put(3, state(3), {})
    assert store.spill_bytes == rec and (tmp_path / "spill" / "spill.bin").stat().st_size == rec
    assert [store.get(c)["w"][0] for c in range(4)] == [0, 1, 2, 3]


@pytest.mark.parametrize("first,second", [("b", "a"), ("a", "b")])
def test_a_checkpoint_into_another_folder_takes_every_state(tmp_path, first, second):
    """Its pieces must stand alone: the unchanged clients move with the changed one."""
    store = filled(3, 1000)
    store.checkpoint(tmp_path / first, 1)
    store.put(1, state(11), {})
    manifest = store.checkpoint(tmp_path / second, 2)
    assert list(manifest["pieces"]) == [piece_name(2)]
    assert read_index(tmp_path / second / piece_name(2))[0].tolist() == [0, 1, 2]
    fresh = ClientStore(INIT, 3, 1000)
    fresh.load(manifest, tmp_path / second)
    assert [fresh.get(c)["w"][0] for c in range(3)] == [0, 11, 2]


def test_starting_over_empties_memory_and_the_spill_file_and_counts_from_zero(tmp_path):
    """Budget 40: eight states leave six in the spill file.  Starting over
    from three states: 32 bytes in memory, one record spilled, and the file
    is that one record; a store that never spilled writes nothing."""
    store = filled(8, 40, tmp_path)
    rec = len(encode(state(0)))
    assert store.spill_bytes == 6 * rec
    store.load_states({5: state(5), 6: state(6), 7: state(7)})
    assert store.memory_bytes == 32 and store.in_memory() == [6, 7]
    assert store.spill_bytes == rec and (tmp_path / "spill.bin").stat().st_size == rec
    assert store.clients() == [5, 6, 7] and [store.get(c)["w"][0] for c in (5, 6, 7)] == [5, 6, 7]
    quiet = ClientStore(INIT, 8, 1000, tmp_path / "never")
    quiet.load_states({0: state(0)})
    assert not (tmp_path / "never").exists()


def test_the_spill_folder_is_chosen_before_the_first_spill_and_never_after(tmp_path):
    store = ClientStore(INIT, 3, 16)
    store.use_directory(tmp_path / "run")
    store.put(0, state(0), {})
    store.put(1, state(1), {})  # 0 spilled, into the folder chosen
    assert (tmp_path / "run" / "spill.bin").stat().st_size == len(encode(state(0)))
    with pytest.raises(RuntimeError, match="spills to .*run already"):
        store.use_directory(tmp_path / "other")


def test_locations_name_only_the_clients_a_checkpoint_holds(tmp_path):
    store = ClientStore(INIT, 5, 1000)
    for c in range(3):
        store.put(c, state(c), {})
    store.checkpoint(tmp_path, 1)
    store.put(4, state(4), {})  # no checkpoint holds it yet
    assert store.locations()["clients"].tolist() == [0, 1, 2]


def test_a_store_whose_spill_folder_is_gone_ends_quietly(tmp_path, monkeypatch):
    """The run directory (or the temporary folder) removed before the
    store is collected: its clean-up ignores what is already gone."""
    import gc
    import shutil

    errors = []
    monkeypatch.setattr("sys.unraisablehook", errors.append)
    for directory in (tmp_path / "run", None):
        store = ClientStore(INIT, 2, 16, directory)
        store.put(0, state(0), {})
        store.put(1, state(1), {})  # 0 spilled: the spill file exists
        shutil.rmtree(store._dir)
        del store
        gc.collect()
    assert errors == []


def _save(directory, store, r):
    manifest = store.checkpoint(directory, r)
    save_checkpoint(directory, r, {"round": r, "client_pieces": manifest}, manifest["pieces"])


def test_kept_checkpoints_keep_their_pieces_and_a_corrupt_piece_falls_back(tmp_path):
    store = filled(6, 1000)
    _save(tmp_path, store, 1)
    store.put(0, state(20), {})
    _save(tmp_path, store, 2)
    store.put(0, state(30), {})
    store.put(1, state(31), {})
    _save(tmp_path, store, 3)  # round 1's checkpoint goes; its piece stays (round 2's names clients 1-5 there)
    assert sorted(p.name for p in tmp_path.glob("round_*")) == [
        "round_00001.clients", "round_00002.clients", "round_00002.json", "round_00002.pt",
        "round_00003.clients", "round_00003.json", "round_00003.pt"]
    assert [p.name for p in checkpoint_files(tmp_path, 3)] == [
        "round_00003.pt", "round_00003.json", "round_00001.clients", "round_00003.clients"]
    piece = tmp_path / piece_name(3)
    data = bytearray(piece.read_bytes())
    data[-1] ^= 1
    piece.write_bytes(bytes(data))
    with pytest.warns(CheckpointWarning, match="round_00003.clients"):
        state2 = load_latest(tmp_path)
    assert state2["round"] == 2
    fresh = ClientStore(INIT, 6, 1000)
    fresh.load(state2["client_pieces"], tmp_path)
    assert [fresh.get(c)["w"][0] for c in range(6)] == [20, 1, 2, 3, 4, 5]
    piece.unlink()  # missing: the same
    with pytest.warns(CheckpointWarning, match="round_00003.clients"):
        assert load_latest(tmp_path)["round"] == 2
    # a piece both kept checkpoints name fails both
    (tmp_path / piece_name(1)).write_bytes(b"")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert load_latest(tmp_path) is None
    # the next checkpoint drops the pieces no kept one names: round 2's and 3's digests stay, piece 3 is gone
    store.put(2, state(32), {})
    _save(tmp_path, store, 4)
    named = {n for r in (3, 4) for n in json.loads((tmp_path / f"round_0000{r}.json").read_text())["pieces"]}
    assert {p.name for p in tmp_path.glob("*.clients")} <= named


def test_a_checkpoint_with_every_state_inside_still_loads(tmp_path):
    """A checkpoint written before pieces (``client_store``: every client's
    state in the .pt) resumes, and the next checkpoint writes every state."""
    from rayfed_dg.data import leave_one_domain_out, load_dataset
    from rayfed_dg.engine.rounds.federation import Federation

    ds = load_dataset("embedded_digits", None, 16)
    cfg = tiny_cfg("method.name=fedbn")
    split = leave_one_domain_out(ds, "colour", 0.2, 0)
    fed = Federation(cfg, split, ds.num_classes, 1)
    local = dict(fed.store.initial)
    old = {c: {k: v + c + 1 for k, v in local.items()} for c in (0, 2)}
    save_checkpoint(tmp_path, 1, {"round": 1, "global_state": fed.global_state, "client_store": old,
                                  "server_state": {}})
    fed.set_state(upgrade_checkpoint_state(load_latest(tmp_path)))  # as a resume reads it: no clock then
    assert fed.round == 1 and fed.store.clients() == [0, 2]
    for c in (0, 2):
        assert all(np.array_equal(fed.store.get(c)[k], old[c][k]) for k in local)
    state = fed.get_state(tmp_path / "new")
    assert read_index(tmp_path / "new" / piece_name(1))[0].tolist() == [0, 2] and "client_store" not in state
    again = Federation(cfg, split, ds.num_classes, 2)
    again.set_state(dict(state, client_pieces=dict(state["client_pieces"], directory=str(tmp_path / "new"))))
    assert all(np.array_equal(again.store.get(c)[k], old[c][k]) for c in (0, 2) for k in local)


def test_a_checkpoint_whose_pieces_have_no_index_still_loads_and_the_next_rewrites_every_state(tmp_path):
    """A checkpoint written before pieces had an index (the map's arrays in
    the .pt, a piece of bare records): a store loads it, and its next
    checkpoint writes every state, changed or not, into one piece with an
    index, which the new manifest alone names."""
    rec = len(encode(state(0)))
    (tmp_path / piece_name(1)).write_bytes(b"".join(encode(state(c)) for c in (1, 3, 4)))
    piece = tmp_path / piece_name(1)
    pieces = {piece.name: {"sha256": hashlib.sha256(piece.read_bytes()).hexdigest(), "bytes": 3 * rec}}
    old = {"clients": np.array([1, 3, 4]), "piece": np.array([1, 1, 1]), "offset": np.array([0, rec, 2 * rec]),
           "length": np.array([rec] * 3), "pieces": pieces}
    save_checkpoint(tmp_path, 1, {"round": 1, "client_pieces": old}, pieces)
    store = ClientStore(INIT, 5, 1000)
    store.load(load_latest(tmp_path)["client_pieces"], tmp_path)
    assert store.clients() == [1, 3, 4] and [store.get(c)["w"][0] for c in (1, 3, 4)] == [1, 3, 4]
    store.put(3, state(33), {})
    m = store.checkpoint(tmp_path, 2)
    assert read_index(tmp_path / piece_name(2))[0].tolist() == [1, 3, 4] and list(m["pieces"]) == [piece_name(2)]
    fresh = ClientStore(INIT, 5, 1000)
    fresh.load(m, tmp_path)
    assert [fresh.get(c)["w"][0] for c in (1, 3, 4)] == [1, 33, 4]


# ------------------------------------------------------------------ end to end


def _fed(ds, host, run_dir, *sets, stop_after=None):
    import ray

    from rayfed_dg.engine import run_federation
    from rayfed_dg.engine.running.plan import split_for

    cfg = tiny_cfg("partition.strategy=single_domain", "partition.num_clients=6", "training.clients_per_round=3",
                   "training.rounds=4", "training.local_steps=2", "training.batch_size=16",
                   "output.checkpoint_every=1", *sets)
    split = split_for(cfg, ds, "texture")
    return run_federation(cfg, split, ray.put(ds.images), ray.put(ds.labels), ds.num_classes, run_dir, progress=False,
                          stop_after=stop_after, host=host)


def _rows(run_dir, name):
    from rayfed_dg.engine.store.rundir import RunDir

    return [{k: v for k, v in r.items() if k != "seconds"} for r in RunDir(run_dir).read_rows(name)]


@pytest.mark.parametrize("name", ["fedbn", "scaffold"])
def test_stopped_and_resumed_through_disk_equals_the_uninterrupted_run(ray_session, tiny_ds, engine_host, tmp_path,
                                                                      name):
    """6 clients, 3 a round, 4 rounds: the run stopped after round 2 and
    resumed keeps every state on disk (budget 0: spill file and pieces only)
    and ends with the metrics, clients and ledger tables of one that kept
    them all in memory; each checkpoint's piece holds the clients its round
    trained, the tables say which."""
    host = engine_host(tiny_ds, 2)
    clean, cut = tmp_path / "clean", tmp_path / "cut"
    whole = _fed(tiny_ds, host, clean, f"method.name={name}")
    disk = (f"method.name={name}", "engine.client_state_memory_mb=0")
    first = _fed(tiny_ds, host, cut, *disk, stop_after=2)
    assert first.rounds_done == 2
    ckpt = cut / "checkpoints" / "texture"
    saved = torch.load(ckpt / "round_00002.pt", weights_only=True)
    manifest = saved["server"]["client_pieces"]
    # the metrics', clients', ledger's and rounds' rows stay in the tables: the checkpoint does not grow with the
    # rounds and clients trained
    assert saved["rows"] == ROWS
    assert saved["result"]["metrics"] == saved["result"]["clients"] == saved["result"]["ledger"] == []
    assert saved["result"]["seconds_per_round"] == saved["result"]["seconds_clients_per_round"] == []
    trained = {r: sorted(row["client"] for row in _rows(cut, "clients") if row["round"] == r) for r in (1, 2)}
    rest = set(trained[1]) - set(trained[2])  # piece 1's clients not trained again: rewritten if under half
    moved = 2 * len(rest) < len(trained[1])
    assert read_index(ckpt / piece_name(2))[0].tolist() == sorted(set(trained[2]) | (rest if moved else set()))
    assert sorted(manifest["pieces"]) == [piece_name(r) for r in ((2,) if moved else (1, 2))]
    assert {c for name in manifest["pieces"] for c in read_index(ckpt / name)[0].tolist()} == \
        set(trained[1]) | set(trained[2])
    assert not (cut / "client_state" / "texture").exists()  # the spill file went with the federation
    resumed = _fed(tiny_ds, host, cut, *disk)
    assert resumed.rounds_done == 4
    for table in ("metrics", "clients", "ledger"):
        assert _rows(cut, table) == _rows(clean, table), table

    def timeless(rows):
        return [{k: v for k, v in r.items() if k != "seconds"} for r in rows]

    # what the resumed run returns holds the rounds before its checkpoint too, read back from the tables
    assert timeless(resumed.clients) == timeless(whole.clients) and resumed.ledger == whole.ledger
    assert resumed.metrics == whole.metrics and resumed.metrics
    # and the seconds of the rounds before it, from the rounds table
    assert len(resumed.seconds_per_round) == len(resumed.seconds_clients_per_round) == 4
    assert resumed.seconds_per_round[:2] == first.seconds_per_round
    assert resumed.seconds_clients_per_round[:2] == first.seconds_clients_per_round
    a, b = (torch.load(d / "final_texture.pt", weights_only=True) for d in (cut, clean))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_run_resumed_from_a_checkpoint_with_every_state_inside_equals_the_uninterrupted_run(
        ray_session, tiny_ds, engine_host, tmp_path):
    """The newest checkpoint of a stopped FedBN run rewritten as checkpoints
    were before pieces (every state in the .pt, no pieces): the resumed run
    still ends as the uninterrupted one."""
    from rayfed_dg.engine.store.checkpoint import checkpoint_path

    host = engine_host(tiny_ds, 2)
    clean, cut = tmp_path / "clean", tmp_path / "cut"
    _fed(tiny_ds, host, clean, "method.name=fedbn")
    _fed(tiny_ds, host, cut, "method.name=fedbn", stop_after=2)
    ckpt = cut / "checkpoints" / "texture"
    state = load_latest(ckpt)
    store = ClientStore({}, 6, 0)
    store.load(state["server"].pop("client_pieces"), ckpt)
    state["server"]["client_store"] = store.snapshot()
    for f in ckpt.iterdir():
        f.unlink()
    save_checkpoint(ckpt, 2, state)
    assert sorted(f.name for f in ckpt.iterdir()) == ["round_00002.json", checkpoint_path(ckpt, 2).name]
    assert _fed(tiny_ds, host, cut, "method.name=fedbn").rounds_done == 4
    for table in ("metrics", "clients", "ledger"):
        assert _rows(cut, table) == _rows(clean, table), table


def test_the_federations_store_keeps_client_state_memory_mb_in_memory_and_spills_the_rest():
    """``engine.client_state_memory_mb`` is MiB: a budget of exactly one state keeps the most recent client's in
    memory and spills the other's."""
    from rayfed_dg.data import leave_one_domain_out, load_dataset
    from rayfed_dg.engine.rounds.federation import Federation
    from rayfed_dg.engine.store.clientstore import _nbytes

    ds = load_dataset("embedded_digits", None, 16)
    split = leave_one_domain_out(ds, "colour", 0.2, 0)
    one = _nbytes(Federation(tiny_cfg("method.name=fedbn"), split, ds.num_classes, 1).store.initial)
    fed = Federation(tiny_cfg("method.name=fedbn", f"engine.client_state_memory_mb={(one + 0.5) / 2**20!r}"), split,
                     ds.num_classes, 2)
    assert fed.store.budget == one
    for c in (0, 1):
        fed.store.put(c, {k: v + c for k, v in fed.store.initial.items()}, {})
    assert fed.store.in_memory() == [1] and fed.store.memory_bytes == one and fed.store.spill_bytes > 0


def test_an_evaluation_takes_a_seeded_sample_of_the_clients_own_models_drawn_per_round(ray_session, tiny_ds,
                                                                                        engine_host):
    """FedBN, 12 clients all trained in round 1: rounds 1 and 2 evaluate the own models of 5 of the 12, the
    sample of (seed, PERSONAL_EVAL, round); ``personal_clients: null`` evaluates every one."""
    import ray

    from rayfed_dg.data import leave_one_domain_out
    from rayfed_dg.engine import run_federation
    from rayfed_dg.seeding import Stream, numpy_rng

    split = leave_one_domain_out(tiny_ds, "texture", 0.2, 0, "single_domain", 12)
    sets = ("method.name=fedbn", "training.local_steps=1", "training.rounds=2")

    def tiny_federation(ds, target, *more, host):
        return run_federation(tiny_cfg(*more), split, ray.put(ds.images), ray.put(ds.labels), ds.num_classes,
                              progress=False, host=host)

    res = tiny_federation(tiny_ds, "texture", *sets, "evaluation.personal_clients=5", host=engine_host(tiny_ds, 2))
    seen = {r: sorted(m["client"] for m in res.metrics if m["split"] == "personal_val" and m["round"] == r)
            for r in (1, 2)}
    want = {r: sorted(numpy_rng(0, Stream.PERSONAL_EVAL, r).choice(12, 5, replace=False).tolist()) for r in (1, 2)}
    assert seen == want and seen[1] != seen[2]
    every = tiny_federation(tiny_ds, "texture", *sets, "evaluation.personal_clients=null",
                            host=engine_host(tiny_ds, 2))
    assert sorted(m["client"] for m in every.metrics if m["split"] == "personal_val" and m["round"] == 2) == \
        list(range(12))


def test_the_personal_sample_is_drawn_among_clients_with_a_validation_split_of_their_own():
    """Explicit clients, two of them holding mono+colour (no validation split of that name, so never evaluated
    personally): with 3 of the 4 others to draw, the sample is 3 of clients 0, 2, 3, 4, that of (seed, round)."""
    from rayfed_dg.data import leave_one_domain_out, load_dataset
    from rayfed_dg.engine.rounds.federation import Federation
    from rayfed_dg.seeding import Stream, numpy_rng

    ds = load_dataset("embedded_digits", None, 16)
    spec = [["mono"], ["mono", "colour"], ["colour"], ["mono"], ["colour"], ["mono", "colour"]]
    split = leave_one_domain_out(ds, "texture", 0.2, 0, "explicit", None, None, 1, spec)
    fed = Federation(tiny_cfg("method.name=fedbn", "evaluation.personal_clients=3"), split, ds.num_classes, 1)
    for c in range(6):
        fed.store.put(c, dict(fed.store.initial), {})
    for r in (1, 2):
        want = sorted(numpy_rng(0, Stream.PERSONAL_EVAL, r).choice([0, 2, 3, 4], size=3, replace=False).tolist())
        assert sorted(fed.own_states(r)) == want


def test_clients_own_models_are_evaluated_when_they_keep_local_state_and_evaluation_personal_asks():
    """``Federation.personalizes``: FedBN's clients keep BatchNorm of their own (evaluated unless
    ``evaluation.personal`` is off); FedAvg's keep nothing, whatever the setting."""
    from rayfed_dg.data import leave_one_domain_out, load_dataset
    from rayfed_dg.engine.rounds.federation import Federation

    ds = load_dataset("embedded_digits", None, 16)
    split = leave_one_domain_out(ds, "colour", 0.2, 0)

    def fed(*sets):
        return Federation(tiny_cfg(*sets), split, ds.num_classes, 1)

    assert fed("method.name=fedbn").personalizes()
    assert not fed("method.name=fedbn", "evaluation.personal=false").personalizes()
    assert fed("method.name=fedbn", "evaluation.personal=false").own_states(1) == {}
    assert not fed("method.name=fedavg", "evaluation.personal=true").personalizes()
