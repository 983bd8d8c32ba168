"""bench/client_cycle.py's smoke mode: every phase of the per-client cycle is
timed once per client (or round) and printed, with the steps the config asks.
How the phases add up to a real ``ClientRunner.train`` call is the bench's
printed figure, not asserted: timings on a shared machine are not a test."""
import importlib
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_smoke_times_every_phase_once_per_client(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    cc = importlib.import_module("client_cycle")
    threads = torch.get_num_threads()
    try:
        out = cc.main(["--smoke"])
    finally:
        torch.set_num_threads(threads)  # the bench's ClientRunner sets one thread, process-wide
    printed = capsys.readouterr().out
    assert set(out) == {"resnet", "cross_device"}
    for name, times in out.items():
        for key, label in cc.PHASES:
            assert f"[{name}]   {label}" in printed
            assert len(times.phases[key]) == (1 if key in cc.PER_ROUND else 3) and min(times.phases[key]) > 0
        assert times.steps == 2 and len(times.train) == 3
