"""Nothing of value only on the head: run directories copied to S3
(``output.sync_to``, ``engine/store/remote.py``) and resumed from there, Tune's
storage on S3, against moto's S3 server on loopback.

The server is moto's WSGI application served by the test on a free port of
127.0.0.1 (a thread, stopped at the end); the runs and sweeps under test
are subprocesses that reach it as they would reach S3, through pyarrow's
``AWS_ENDPOINT_URL_S3`` and fake credentials.  One reply is mended on the
way: moto 5.2 names CompleteMultipartUpload's root element
``CompleteMultipartUploadResponse`` where S3 says ``...Result``, and Arrow,
which checks it for errors embedded in a 200, would refuse every upload.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import yaml
from conftest import REPO

BUCKET = "rayfed-runs"
ARGS = ["--target", "negative", "--no-progress", "--set", "compare=null", "--set", "training.rounds=4",
        "--set", "output.checkpoint_every=1", "--set", "data.resolution=16", "--set", "model.width=8"]


def _as_s3(app):
    from werkzeug.wrappers import Response

    def wrapped(environ, start_response):
        resp = Response.from_app(app, environ)
        data = resp.get_data()
        if b"<CompleteMultipartUploadResponse" in data[:200]:
            resp.set_data(data.replace(b"CompleteMultipartUploadResponse", b"CompleteMultipartUploadResult"))
        return resp(environ, start_response)

    return wrapped


@pytest.fixture(scope="module")
def s3():
    """moto's S3 on a free loopback port with one bucket; ``env``: what a subprocess needs to use it."""
    pytest.importorskip("moto", reason="moto is not installed (pip install -e '.[dev]'); the S3 rehearsal needs it")
    pytest.importorskip("flask", reason="moto's server needs flask (pip install 'moto[server]')")
    import boto3
    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import WSGIRequestHandler, make_server

    class Quiet(WSGIRequestHandler):
        def log_request(self, *args, **kwargs):
            pass

    server = make_server("127.0.0.1", 0, _as_s3(DomainDispatcherApplication(create_backend_app)), threaded=True,
                         request_handler=Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{server.server_port}"
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL_S3": endpoint, "AWS_EC2_METADATA_DISABLED": "true"}
    with pytest.MonkeyPatch.context() as mp:
        for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
            mp.delenv(k, raising=False)
        for k, v in env.items():
            mp.setenv(k, v)
        client = boto3.client("s3", endpoint_url=endpoint)
        client.create_bucket(Bucket=BUCKET)
        yield type("S3", (), {"env": {**os.environ, **env}, "client": client, "endpoint": endpoint})
    server.shutdown()
    thread.join()


def _keys(client, prefix: str) -> list[str]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return sorted(o["Key"][len(prefix):] for p in pages for o in p.get("Contents", []))


# ---------------------------------------------------------------- the copy, without Ray: any cut leaves a resumable copy

class Cut:
    """The destination's filesystem, lost after ``after`` writes or deletions (a head that dies mid-sync)."""

    def __init__(self, fs, after):
        self.fs, self.left, self.ops = fs, after, []

    def _op(self, what, path):
        if self.left == 0:
            raise OSError("connection lost")
        self.left -= 1
        self.ops.append((what, path))

    def open_output_stream(self, path):
        if not path.endswith(".tmp"):  # a folder copy's file appears when moved onto its name (below)
            self._op("put", path)
        return self.fs.open_output_stream(path)

    def move(self, src, dest):
        self._op("put", dest)
        self.fs.move(src, dest)

    def delete_file(self, path):
        self._op("delete", path)
        self.fs.delete_file(path)

    def __getattr__(self, name):
        return getattr(self.fs, name)


def _round(rd, target, r):
    """Round ``r`` of a federation as the engine leaves it: its table rows, then a checkpoint naming a
    client-state piece of its own (the two newest kept)."""
    import hashlib

    rd.write_rows("metrics", target, r, [{"target": target, "round": r, "split": "target_test", "domain": target,
                                          "accuracy": r / 10, "loss": 1.0 / r, "n": 10, "stage": None}])
    piece = f"round_{r:05d}-{r}.clients"
    data = bytes([r]) * 1000
    rd.checkpoints(target).mkdir(parents=True, exist_ok=True)
    (rd.checkpoints(target) / piece).write_bytes(data)
    rd.save_checkpoint(target, r, {"round": r}, {piece: {"sha256": hashlib.sha256(data).hexdigest(),
                                                         "bytes": len(data)}})


def test_a_sync_cut_at_any_point_leaves_a_checkpoint_and_every_row_up_to_it(tmp_path):
    """The copy is synced after rounds 1-2; round 3 is written (round 1's checkpoint dropped) and its sync is
    cut after k operations, for every k: what the copy holds is always a checkpoint that verifies (round 2 or
    3) with the table rows of every round up to it, and the full sync leaves exactly the local files."""
    import warnings

    from rayfed_dg.engine.store.checkpoint import CheckpointWarning, load_latest
    from rayfed_dg.engine.store.remote import Mirror
    from rayfed_dg.engine.store.rundir import RunDir, marks_complete

    local = RunDir(tmp_path / "run")
    local.path.mkdir()
    local.write_record({"targets": ["t"], "seeds": None})
    for r in (1, 2):
        _round(local, "t", r)
    first = Mirror(local.path, str(tmp_path / "copy"), marks_complete)
    first.sync()
    _round(local, "t", 3)
    cuts = 0
    for k in range(100):
        copy = tmp_path / f"cut{k}"
        shutil.copytree(tmp_path / "copy", copy)
        m = Mirror(local.path, str(copy), marks_complete)
        m.sent, m.fs = dict(first.sent), Cut(m.fs, k)
        try:
            m.sync()
        except OSError:
            cuts += 1
        else:
            break
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CheckpointWarning)  # the newest may be incomplete: the one before is used
            state = load_latest(copy / "checkpoints" / "t")
        assert state is not None and state["round"] in (2, 3), k
        rows = RunDir(copy).read_target_rows("metrics", "t", state["round"])
        assert [row["round"] for row in rows] == list(range(1, state["round"] + 1)), k
    # round 3's piece, .pt and rows, its digest; then round 1's digest, piece and .pt deleted: 7 operations
    assert cuts == 7 and [op for op, _ in m.fs.ops] == ["put"] * 4 + ["delete"] * 3
    assert m.fs.ops[3][1].endswith("checkpoints/t/round_00003.json")
    assert m.fs.ops[4][1].endswith("checkpoints/t/round_00001.json")
    files = lambda d: sorted(p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file())  # noqa: E731
    assert files(copy) == files(local.path)
    again = Mirror(local.path, str(copy), marks_complete)  # a new process (a resumed run) finds the copy complete: sends nothing
    again.fs = Cut(again.fs, 0)
    again.sync()
    assert again.fs.ops == []



def test_a_resumed_copy_is_brought_up_to_date_where_a_file_changed_at_the_same_size(tmp_path):
    """A resume rewrites files under the same names and often at the same size (a checkpoint of the round it
    repeats): the first sync of a new process sends a file changed after the copy's was written, and after a
    download (the run resumed from the copy) a rewrite is sent; a folder copy is written beside the name and
    moved onto it."""
    import pyarrow.fs as pafs

    from rayfed_dg.engine.store.remote import Mirror, local_files

    run, copy = tmp_path / "run", tmp_path / "copy"
    run.mkdir()
    (copy / "run").mkdir(parents=True)
    (copy / "run" / "round_1.pt").write_bytes(b"BBBB")  # uploaded by the killed process
    time.sleep(0.01)
    (run / "round_1.pt").write_bytes(b"AAAA")  # rewritten after that upload, at the same size, then killed
    Mirror(run, str(copy / "run"), lambda rel: False).sync()  # the run resumed from its own folder
    assert (copy / "run" / "round_1.pt").read_bytes() == b"AAAA"
    m = Mirror(run, str(copy / "run"), lambda rel: False)
    m.sent = local_files(run, ())  # what --resume s3://... downloaded: not sent back
    m.sync()
    time.sleep(0.01)
    (run / "round_1.pt").write_bytes(b"CCCC")  # the resumed run saves that round again
    m.sync()
    assert (copy / "run" / "round_1.pt").read_bytes() == b"CCCC"
    assert sorted(p.name for p in (copy / "run").iterdir()) == ["round_1.pt"]  # no part file left
    assert isinstance(m.fs, pafs.LocalFileSystem)


# ---------------------------------------------------------------- bad input: one line, before anything is written

@pytest.mark.cluster
def test_a_new_run_refuses_a_missing_bucket_and_a_copy_that_holds_a_run(s3, tmp_path):
    from conftest import tiny_cfg

    from rayfed_dg.config import ConfigError
    from rayfed_dg.engine.store.rundir import RunDir

    with pytest.raises(ConfigError, match=r"^output.sync_to: s3://no-such-bucket/runs/exp: no bucket no-such-bucket; "
                                          r"create it \(aws s3 mb s3://no-such-bucket\) or name another$"):
        RunDir.create(tiny_cfg("output.sync_to=s3://no-such-bucket/runs"), tmp_path / "exp")
    s3.client.put_object(Bucket=BUCKET, Key=f"{tmp_path.name}/exp/run.json", Body=b"{}")
    uri = f"s3://{BUCKET}/{tmp_path.name}/exp"
    with pytest.raises(ConfigError, match=f"^output.sync_to: {uri} already holds a run; choose another --run-dir "
                                          f"name, or continue that run with --resume {uri}$"):
        RunDir.create(tiny_cfg(f"output.sync_to=s3://{BUCKET}/{tmp_path.name}"), tmp_path / "exp")
    assert not (tmp_path / "exp").exists()  # nothing written
    RunDir.create(tiny_cfg(f"output.sync_to=s3://{BUCKET}/{tmp_path.name}"), tmp_path / "other")


@pytest.mark.cluster
def test_resuming_from_an_empty_uri_is_one_line_exit_2(s3, tmp_path, capsys, monkeypatch):
    from rayfed_dg.cli import main

    monkeypatch.setenv("RAYFED_DG_CACHE", str(tmp_path))
    assert main(["run", "--resume", f"s3://{BUCKET}/{tmp_path.name}/nothing"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"rayfed-dg: error: --resume s3://{BUCKET}/{tmp_path.name}/nothing: no run there (no run.json); "
                       "give the run directory's copy, <output.sync_to>/<run name>"], err


# ---------------------------------------------------------------- the rehearsal: a head lost, a run resumed from S3

def _cli(*extra):
    return [sys.executable, "-m", "rayfed_dg", "run", str(REPO / "configs" / "quickstart.yaml"), *ARGS, *extra]


@pytest.mark.cluster
@pytest.mark.slow
def test_a_run_copied_to_s3_resumes_from_there_on_a_new_head_bit_for_bit(s3, ray_session, tmp_path):
    """``rayfed-dg run --set output.sync_to=s3://...`` killed (SIGKILL) once its round-2 checkpoint is on S3,
    its local run directory deleted (the head replaced); ``rayfed-dg run --resume s3://.../exp`` on a fresh
    cache downloads it and finishes, and the copy on S3 then holds the tables of a run never interrupted
    (``rayfed_dg.run`` here).  The runs join the session's Ray, as drivers join a cluster's."""
    import rayfed_dg
    from rayfed_dg.engine.store.records import TABLES, TIMING
    from rayfed_dg.engine.store.remote import download
    from rayfed_dg.engine.store.rundir import RUN_RECORD, RunDir

    prefix = f"{tmp_path.name}/runs"
    uri = f"s3://{BUCKET}/{prefix}"
    head = tmp_path / "head"
    join = ["--set", f"engine.ray_address={ray_session.get_runtime_context().gcs_address}"]
    proc = subprocess.Popen(_cli("--run-dir", str(head / "exp"), "--set", f"output.sync_to={uri}", *join), env=s3.env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    marker = f"{prefix}/exp/checkpoints/negative/round_00002.json"
    t0 = time.monotonic()
    try:
        while marker not in _keys(s3.client, "") and proc.poll() is None:
            assert time.monotonic() < t0 + 600, "round 2's checkpoint never reached S3"
            time.sleep(0.1)
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        budget = max(300.0, 3 * (time.monotonic() - t0))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        try:  # the Ray processes it left behind
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    killed_s = time.monotonic() - t0
    shutil.rmtree(head)  # the head is gone, and its disk with it
    copy = _keys(s3.client, f"{prefix}/exp/")
    assert "run.json" in copy and "summary.json" not in copy and "final_negative.pt" not in copy
    new_head = {**s3.env, "RAYFED_DG_CACHE": str(tmp_path / "new-head-cache")}
    t1 = time.monotonic()
    r = subprocess.run(_cli("--resume", f"{uri}/exp", *join), env=new_head, capture_output=True, text=True,
                       timeout=budget)
    resumed_s = time.monotonic() - t1
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"downloaded {uri}/exp to {tmp_path / 'new-head-cache' / 'runs' / BUCKET / prefix / 'exp'}" in r.stderr
    sets = {k: yaml.safe_load(v) for k, v in (a.split("=", 1) for a in ARGS[ARGS.index("--set") + 1::2])}
    rayfed_dg.run(REPO / "configs" / "quickstart.yaml", sets, target="negative", run_dir=tmp_path / "clean",
                  progress=False)
    final = RunDir(download(f"{uri}/exp", tmp_path / "final", RUN_RECORD))  # what S3 holds now
    assert {"summary.json", "final_negative.pt", "best_negative.pt"} <= set(_keys(s3.client, f"{prefix}/exp/"))
    clean = RunDir(tmp_path / "clean")
    no_time = lambda rows: [{k: v for k, v in r.items() if k not in TIMING} for r in rows]  # noqa: E731
    for name in TABLES:
        assert no_time(final.read_rows(name)) == no_time(clean.read_rows(name)), name
    assert len(final.read_rows("metrics")) == 4 * 4
    a, b = (json.loads((d.path / "summary.json").read_text())["targets"]["negative"] for d in (final, clean))
    assert (a["selected_round"], a["target_acc"]) == (b["selected_round"], b["target_acc"])
    # only the two newest checkpoints, locally and on S3
    assert sorted(k for k in _keys(s3.client, f"{prefix}/exp/checkpoints/negative/") if k.endswith(".json")) == [
        "round_00003.json", "round_00004.json"]
    print(f"\nkilled {killed_s:.1f} s after start, once round 2's digest was on S3 ({len(copy)} objects there); "
          f"resumed from {uri}/exp on a fresh cache in {resumed_s:.1f} s; "
          + ", ".join(f"{name} {len(final.read_rows(name))} rows" for name in TABLES)
          + " on S3, equal to an uninterrupted run's")


@pytest.mark.cluster
@pytest.mark.slow
def test_a_sweep_with_s3_storage_keeps_its_tables_there_and_resumes_from_there(s3, ray_session, tmp_path,
                                                                                 monkeypatch):
    """``tune.py --storage s3://...`` (its own Ray, whose workers upload the trials' checkpoints): the
    checkpoints (the two newest of three), the trials table, the selection and the chosen config land on S3;
    the sweep resumed from another process and Ray (this one's) restores from S3 alone, re-runs nothing and
    chooses the same value."""
    from conftest import tiny_space

    from rayfed_dg.tuning import run_sweep

    space = tiny_space(tmp_path / "tiny.yaml", "training.rounds=3", "output.checkpoint_every=1")
    prefix = f"{tmp_path.name}/tune"
    cmd = [sys.executable, "tune.py", "--space", str(space), "--target", "colour", "--storage",
           f"s3://{BUCKET}/{prefix}"]
    r = subprocess.run(cmd, cwd=REPO, env=s3.env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    keys = _keys(s3.client, f"{prefix}/tiny/")
    for f in ("trials.parquet", "selection.parquet", "selection.md", "chosen_config.yaml", "sweep.json"):
        assert f in keys, f
    results = sorted(k for k in keys if k.endswith("/result.json"))
    assert len(results) == 2
    for res in results:  # rounds 1-3 each reported a checkpoint; Tune keeps the two newest
        trial = res.rsplit("/", 1)[0]
        assert sorted({k.split("/")[1] for k in keys if k.startswith(trial + "/checkpoint_")}) == [
            "checkpoint_000001", "checkpoint_000002"], trial
    read = lambda key: s3.client.get_object(Bucket=BUCKET, Key=f"{prefix}/tiny/{key}")["Body"].read()  # noqa: E731
    before = {res: read(res) for res in results}
    chosen = yaml.safe_load(read("chosen_config.yaml"))["method"]["lam"]
    s3.client.delete_object(Bucket=BUCKET, Key=f"{prefix}/tiny/chosen_config.yaml")  # written again by the resume
    monkeypatch.chdir(REPO)
    again = run_sweep(str(space), None, "colour", 1, "fifo", True, [], f"s3://{BUCKET}/{prefix}", verbose=0)
    assert {res: read(res) for res in results} == before  # nothing re-ran
    assert again["complete"] and again["chosen"] == {"method.lam": chosen} and again["path"] == f"s3://{BUCKET}/{prefix}/tiny"
    assert yaml.safe_load(read("chosen_config.yaml"))["method"]["lam"] == chosen
    print(f"\nsweep on s3://{BUCKET}/{prefix}/tiny: {len(keys)} objects, " + ", ".join(
        f for f in ("trials.parquet", "selection.md", "chosen_config.yaml") if f in keys)
          + f"; 2 checkpoints kept per trial of 3; resumed from S3: nothing re-ran, chose method.lam={chosen}")
