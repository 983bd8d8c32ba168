"""Shared utilities: registries, atomic files, tables, the seeding table."""
import pytest
from conftest import FINALISER_EXIT, in_python

from rayfed_dg.seeding import Stream, numpy_rng
from rayfed_dg.utils import Registry, atomic_write, atomic_write_with, render_table


def test_registry_rejects_a_duplicate_name_and_suggests_the_closest():
    r = Registry("thing")
    r.add("alpha", 1)
    r.add("alpha", 1)  # the same object again (a module imported twice) is harmless
    with pytest.raises(ValueError, match="registered twice"):
        r.add("alpha", 2)
    with pytest.raises(KeyError, match=r"unknown thing 'alpah' \(did you mean alpha\?\); known: alpha"):
        r.get("alpah")
    from rayfed_dg.methods import Method, register_method

    class Impostor(Method):
        name = "fedavg"

    with pytest.raises(ValueError, match="method 'fedavg' is registered twice"):
        register_method(Impostor)


def test_every_stream_is_its_own():
    # an IntEnum silently turns a repeated value into an alias: two purposes would share a stream
    assert len(Stream.__members__) == len(set(int(s) for s in Stream))
    # CCST's stage stream (formerly 11, CLIENT_VAL's id) no longer reproduces a client's validation draw
    assert numpy_rng(0, Stream.STAGE, 1, 0).random() != numpy_rng(0, Stream.CLIENT_VAL, 1).random()


def test_atomic_write_keeps_the_old_file_when_the_writer_fails(tmp_path):
    p = tmp_path / "f.bin"
    atomic_write(p, b"old")

    def broken(f):
        f.write(b"half of the new")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        atomic_write_with(p, broken)
    assert p.read_bytes() == b"old" and [x.name for x in tmp_path.iterdir()] == ["f.bin"]
    assert oct(p.stat().st_mode & 0o777) == "0o644"


def test_two_writers_of_one_path_each_write_whole_files(tmp_path):
    """Concurrent writers of one path (two federations filling one cache
    file) each write a temporary file of their own: the path ends up one
    writer's whole file, and neither fails."""
    import threading
    import time

    p = tmp_path / "f.bin"
    both_open, errors = threading.Barrier(2), []

    def writer(byte):
        def write(f):
            both_open.wait()  # both temporaries open before either writes
            for _ in range(20):
                f.write(byte * 4096)
                time.sleep(0.005)
        try:
            atomic_write_with(p, write)
        except Exception as e:  # noqa: BLE001 - any failure of either writer fails the test
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(b,)) for b in (b"a", b"b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert p.read_bytes() in (b"a" * 81920, b"b" * 81920)
    assert [x.name for x in tmp_path.iterdir()] == ["f.bin"]


def test_render_table_styles():
    rows = [["fedavg", "50.66"], ["fedbn", "9.84"]]
    assert render_table(["method", "acc"], rows).splitlines() == [
        "method |   acc", "-------+------", "fedavg | 50.66", " fedbn |  9.84"]
    assert render_table(["method", "acc"], rows, "md").splitlines()[:3] == [
        "| method | acc |", "|---|---|", "| fedavg | 50.66 |"]
    assert render_table(["a_b", "x"], [["1 ± 2", "3%"]], "latex").splitlines()[2:5] == [
        r"a\_b & x \\", r"\midrule", r"1 $\pm$ 2 & 3\% \\"]
    # text columns are left-aligned wherever they are, figures right-aligned
    tab = render_table(["method", "selection", "seeds", "avg"], [["fedavg", "last round", 2, "51.51 ± 3.60"]], "latex")
    assert tab.splitlines()[0] == r"\begin{tabular}{llrr}"
    # a missing value ("-") in a figures column keeps it right-aligned
    tab = render_table(["method", "photo", "avg"], [["fedavg", "-", "51.51 ± 3.60"], ["copa", "40.00", "-"]], "latex")
    assert tab.splitlines()[0] == r"\begin{tabular}{lrr}"
    assert render_table(["a", "b"], [["x,y", 1]], "csv") == 'a,b\n"x,y",1'


def test_a_systemexit_a_finaliser_cannot_raise_ends_the_process_quietly_with_its_code():
    """What Ray's SIGTERM handler raises inside a ``__del__``: Python would
    print "Exception ignored" and run on; with the hook the process ends
    there, with the exception's code, and prints nothing."""
    hook = "from rayfed_dg.utils import exit_quietly_on_sigterm\nexit_quietly_on_sigterm(); exit_quietly_on_sigterm()\n"
    hooked = in_python(hook + FINALISER_EXIT)
    assert (hooked.returncode, hooked.stdout, hooked.stderr) == (3, "", "")
    plain = in_python(FINALISER_EXIT)
    assert plain.returncode == 0 and plain.stdout == "ran on\n" and "Exception ignored" in plain.stderr


def test_any_other_exception_a_finaliser_raises_is_still_reported():
    out = in_python("from rayfed_dg.utils import exit_quietly_on_sigterm\nexit_quietly_on_sigterm()\n"
                      "class Fails:\n    def __del__(self): raise ValueError('kept')\n"
                      "Fails()\nprint('ran on')\n")
    assert out.returncode == 0 and out.stdout == "ran on\n"
    assert "Exception ignored" in out.stderr and "ValueError: kept" in out.stderr


SIGTERM_BLOCK = """
import os, signal, sys, threading, time
from rayfed_dg.utils import sigterm_as_interrupt
def mine(signum, frame): print("mine")
signal.signal(signal.SIGTERM, signal.SIG_IGN if sys.argv[1] == "ignored" else mine)
before = signal.getsignal(signal.SIGTERM)
try:
    with sigterm_as_interrupt():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(2)
    print("ran on")
except KeyboardInterrupt:
    print("interrupted")
print("put back", signal.getsignal(signal.SIGTERM) is before)
def elsewhere():
    with sigterm_as_interrupt():
        print("in a thread", signal.getsignal(signal.SIGTERM) is before)
t = threading.Thread(target=elsewhere); t.start(); t.join()
"""


@pytest.mark.parametrize("parent", ["handled", "ignored"])
def test_sigterm_in_the_block_interrupts_and_the_handler_before_is_put_back(parent):
    """SIGTERM inside ``sigterm_as_interrupt`` raises KeyboardInterrupt (in a child Python: the signal is real);
    the caller's handler is back after the block; a SIGTERM the parent ignores stays ignored; off the main
    thread (where Python cannot set a handler) the block runs as it is."""
    r = in_python(SIGTERM_BLOCK, parent)
    first = "interrupted" if parent == "handled" else "ran on"
    assert r.returncode == 0 and r.stdout.split("\n") == [first, "put back True", "in a thread True", ""], r
