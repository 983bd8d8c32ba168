"""bench/client_cycle.py's smoke mode: every phase of the per-client cycle is
timed and printed, and the phases run inside ``ClientRunner.train`` add up to
about one real call of it (a phase left untimed, or timed twice, shows)."""
import importlib
import statistics
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_smoke_times_every_phase_and_adds_up_to_the_train_call(capsys, monkeypatch):
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
        assert times.steps == 2
        # the medians of phases 1b-6 against the median of the real train call that runs the same work
        in_train = sum(times.median(k) for k in cc.IN_TRAIN)
        assert 0.6 < in_train / statistics.median(times.train) < 1.6, (name, in_train, times.train)
