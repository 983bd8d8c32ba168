"""The tiered client-state store (engine/clientstore.py): its memory budget,
spilling, incremental checkpoints and their pieces, and resume end to end."""
import json
import warnings

import numpy as np
import pytest
import torch
from conftest import tiny_cfg

from rayfed_dg.engine.checkpoint import CheckpointWarning, checkpoint_files, load_latest, save_checkpoint
from rayfed_dg.engine.clientstore import ClientStore, decode, encode, piece_name

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
    assert store.spill_bytes == 4 * rec  # clients 0, 2, 1 (its old value) and 3 were each spilled once
    assert [store.get(c)["w"][0] for c in range(4)] == [0, 11, 2, 3]
    assert store.get(4) is INIT  # never seen: the initial state
    assert (tmp_path / "spill.bin").stat().st_size == 4 * rec


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


def test_checkpoint_writes_exactly_the_clients_changed_since_the_previous_one(tmp_path):
    store = filled(10, 40, tmp_path / "spill")
    rec = len(encode(state(0)))
    m1 = store.checkpoint(tmp_path, 1)
    assert m1["clients"].tolist() == list(range(10)) and set(m1["piece"].tolist()) == {1}
    assert (tmp_path / piece_name(1)).stat().st_size == 10 * rec == m1["pieces"][piece_name(1)]["bytes"]
    for c in (7, 2, 5):
        store.put(c, state(100 + c), {})
    assert store.spill_bytes == 8 * rec  # 7, spilled again, takes a slot the piece freed
    m2 = store.checkpoint(tmp_path, 2)
    changed = m2["clients"][m2["piece"] == 2].tolist()
    assert changed == [2, 5, 7] and (tmp_path / piece_name(2)).stat().st_size == 3 * rec
    assert sorted(m2["pieces"]) == [piece_name(1), piece_name(2)]  # the 7 unchanged ones stay in piece 1
    m3 = store.checkpoint(tmp_path, 3)  # nothing changed: no piece, the same manifest
    assert not (tmp_path / piece_name(3)).exists() and m3["piece"].tolist() == m2["piece"].tolist()
    # the states a fresh store reads back from the pieces alone
    fresh = ClientStore(INIT, 10, 40)
    fresh.load(m3, tmp_path)
    assert [fresh.get(c)["w"][0] for c in range(10)] == [100 + c if c in (2, 5, 7) else c for c in range(10)]
    assert fresh.in_memory() == [8, 9]


def test_a_piece_less_than_half_current_is_rewritten_into_the_next(tmp_path):
    """Piece 1 holds clients 0-3; after 0, 1, 2 change only client 3 (a
    quarter) is current there, so piece 2 takes it too and piece 1 is named
    no more; at 2 of 4 (a half) a piece stays."""
    store = filled(4, 1000)
    store.checkpoint(tmp_path, 1)
    for c in (0, 1):
        store.put(c, state(10 + c), {})
    m2 = store.checkpoint(tmp_path, 2)
    assert m2["piece"].tolist() == [2, 2, 1, 1]
    store.put(2, state(12), {})
    m3 = store.checkpoint(tmp_path, 3)
    assert m3["piece"].tolist() == [2, 2, 3, 3] and sorted(m3["pieces"]) == [piece_name(2), piece_name(3)]
    fresh = ClientStore(INIT, 4, 0)
    fresh.load(m3, tmp_path)
    assert [fresh.get(c)["w"][0] for c in range(4)] == [10, 11, 12, 3]


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
    from rayfed_dg.engine.federation import Federation

    ds = load_dataset("embedded_digits", None, 16)
    cfg = tiny_cfg("method.name=fedbn")
    split = leave_one_domain_out(ds, "colour", 0.2, 0)
    fed = Federation(cfg, split, ds.num_classes, 1)
    local = dict(fed.store.initial)
    old = {c: {k: v + c + 1 for k, v in local.items()} for c in (0, 2)}
    save_checkpoint(tmp_path, 1, {"round": 1, "global_state": fed.global_state, "client_store": old,
                                  "server_state": {}})
    fed.set_state(load_latest(tmp_path))
    assert fed.round == 1 and fed.store.clients() == [0, 2]
    for c in (0, 2):
        assert all(np.array_equal(fed.store.get(c)[k], old[c][k]) for k in local)
    state = fed.get_state(tmp_path / "new")
    assert state["client_pieces"]["clients"].tolist() == [0, 2] and "client_store" not in state
    again = Federation(cfg, split, ds.num_classes, 2)
    again.set_state(dict(state, client_pieces=dict(state["client_pieces"], directory=str(tmp_path / "new"))))
    assert all(np.array_equal(again.store.get(c)[k], old[c][k]) for c in (0, 2) for k in local)


# ------------------------------------------------------------------ end to end


def _fed(ds, host, run_dir, *sets, stop_after=None):
    import ray

    from rayfed_dg.engine import run_federation
    from rayfed_dg.engine.plan import split_for

    cfg = tiny_cfg("partition.strategy=single_domain", "partition.num_clients=6", "training.clients_per_round=3",
                   "training.rounds=4", "training.local_steps=2", "training.batch_size=16",
                   "output.checkpoint_every=1", *sets)
    split = split_for(cfg, ds, "texture")
    return run_federation(cfg, split, ray.put(ds.images), ray.put(ds.labels), ds.num_classes, run_dir, progress=False,
                          stop_after=stop_after, host=host)


def _rows(run_dir, name):
    from rayfed_dg.engine.rundir import RunDir

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
    _fed(tiny_ds, host, clean, f"method.name={name}")
    disk = (f"method.name={name}", "engine.client_state_memory_mb=0")
    assert _fed(tiny_ds, host, cut, *disk, stop_after=2).rounds_done == 2
    ckpt = cut / "checkpoints" / "texture"
    manifest = torch.load(ckpt / "round_00002.pt", weights_only=True)["server"]["client_pieces"]
    trained = {r: sorted(row["client"] for row in _rows(cut, "clients") if row["round"] == r) for r in (1, 2)}
    rest = set(trained[1]) - set(trained[2])  # piece 1's clients not trained again: rewritten if under half
    assert manifest["clients"][manifest["piece"] == 2].tolist() == sorted(
        set(trained[2]) | (rest if 2 * len(rest) < len(trained[1]) else set()))
    assert set(manifest["clients"].tolist()) == set(trained[1]) | set(trained[2])
    assert not (cut / "client_state" / "texture").exists()  # the spill file went with the federation
    assert _fed(tiny_ds, host, cut, *disk).rounds_done == 4
    for table in ("metrics", "clients", "ledger"):
        assert _rows(cut, table) == _rows(clean, table), table
    a, b = (torch.load(d / "final_texture.pt", weights_only=True) for d in (cut, clean))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_run_resumed_from_a_checkpoint_with_every_state_inside_equals_the_uninterrupted_run(
        ray_session, tiny_ds, engine_host, tmp_path):
    """The newest checkpoint of a stopped FedBN run rewritten as checkpoints
    were before pieces (every state in the .pt, no pieces): the resumed run
    still ends as the uninterrupted one."""
    from rayfed_dg.engine.checkpoint import checkpoint_path

    host = engine_host(tiny_ds, 2)
    clean, cut = tmp_path / "clean", tmp_path / "cut"
    _fed(tiny_ds, host, clean, "method.name=fedbn")
    _fed(tiny_ds, host, cut, "method.name=fedbn", stop_after=2)
    ckpt = cut / "checkpoints" / "texture"
    state = load_latest(ckpt)
    m = state["server"].pop("client_pieces")
    states = {}
    for c, p, off, n in zip(m["clients"], m["piece"], m["offset"], m["length"]):
        with open(ckpt / piece_name(int(p)), "rb") as f:
            f.seek(int(off))
            states[int(c)] = decode(f.read(int(n)))
    state["server"]["client_store"] = states
    for f in ckpt.iterdir():
        f.unlink()
    save_checkpoint(ckpt, 2, state)
    assert sorted(f.name for f in ckpt.iterdir()) == ["round_00002.json", checkpoint_path(ckpt, 2).name]
    assert _fed(tiny_ds, host, cut, "method.name=fedbn").rounds_done == 4
    for table in ("metrics", "clients", "ledger"):
        assert _rows(cut, table) == _rows(clean, table), table
