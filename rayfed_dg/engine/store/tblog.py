"""TensorBoard scalars per round (tensorboardX), and a reader for tests.

One TensorBoard run per federation: ``<run dir>/tensorboard/<target>/`` (a
Tune trial: ``<trial dir>/tensorboard/<target>/``), so that ``tensorboard
--logdir runs`` lists every run, method (compare sub-directory), seed and
target, and overlays them on the same charts.  Tags, with the round as step:

``accuracy/source_val``    mean over source domains, global model, in percent
                           (as ``report``, the tables and the plots)
``accuracy/target``        mean over target domains, global model
``accuracy/personal_val``  mean over clients of each client's own model
                           (methods with client-local state)
``accuracy/source_test``   mean over source domains' in-domain test splits
                           (``data.source_test_fraction`` > 0)
``accuracy/heldout_val``   the held-out validation domain
                           (``data.heldout_val_domain``)
``loss/train``             mean local training loss of the returned clients
``time/round_seconds``     wall-clock seconds of the round (with evaluation)
``comm/bytes_up``          bytes the round's clients sent (the ledger's sum)
``comm/bytes_down``        bytes the round's clients received

Accuracies appear on evaluated rounds only (``evaluation.every``).  A resumed
run starts its event file with a purge at the first round it repeats
(``SessionLog.START``, what ``SummaryWriter(purge_step=...)`` writes), so
TensorBoard hides what the killed run had logged from that round on.

Events are written synchronously with tensorboardX's ``EventsWriter`` and
flushed after each round: ``SummaryWriter.flush`` does not wait for its
background thread, and a run killed right after a round lost that round's
scalars (seen in the SIGKILL test of ``tests/test_resume.py``).
"""
from __future__ import annotations

import os
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .records import RoundResult, Split

TAGS = ("accuracy/source_val", "accuracy/target", "accuracy/personal_val", "accuracy/source_test",
        "accuracy/heldout_val", "loss/train", "time/round_seconds",
        "comm/bytes_up", "comm/bytes_down")


def round_scalars(out: RoundResult, res: Any) -> dict[str, float]:
    """The round's scalars, by tag (see the module docstring); its accuracies
    from ``res``, the federation's ``run.TargetResult``."""
    s: dict[str, float] = {}
    for split, tag in ((Split.SOURCE_VAL, "accuracy/source_val"), (Split.TARGET_TEST, "accuracy/target"),
                       (Split.PERSONAL_VAL, "accuracy/personal_val"), (Split.SOURCE_TEST, "accuracy/source_test"),
                       (Split.HELDOUT_VAL, "accuracy/heldout_val")):
        acc = res.mean(split, out.round)
        if acc is not None:
            s[tag] = 100 * acc
    s["loss/train"] = float(out.train_loss)
    s["time/round_seconds"] = float(out.seconds_total)
    for direction in ("up", "down"):
        s[f"comm/bytes_{direction}"] = float(sum(r.bytes for r in out.ledger if r.direction == direction))
    return s


class TensorBoardLogger:
    """A round callback (``run.RoundCallback``) writing ``round_scalars``."""

    def __init__(self, logdir: Path, purge_step: int | None = None):
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event, SessionLog

        Path(logdir).mkdir(parents=True, exist_ok=True)
        # the pid keeps a resumed run's file apart from the killed one's, even within the same second
        self.writer = EventsWriter(str(Path(logdir) / "events"), f".{os.getpid()}")
        if purge_step is not None:
            self.writer.write_event(Event(wall_time=time.time(), step=purge_step,
                                          session_log=SessionLog(status=SessionLog.START)))
        self.writer.flush()

    def on_round(self, out: RoundResult, res: Any, new_best: bool, server_state: Callable[[], dict]) -> None:
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=tag, simple_value=v) for tag, v in round_scalars(out, res).items()]
        self.writer.write_event(Event(wall_time=time.time(), step=out.round, summary=Summary(value=values)))
        self.writer.flush()  # on disk before the round's checkpoint: kept if the run is killed

    def close(self) -> None:
        self.writer.close()


def _records(path: Path):
    """The records of one TFRecord file (a truncated last record is ignored)."""
    data = path.read_bytes()
    pos = 0
    while pos + 12 <= len(data):
        (n,) = struct.unpack("<Q", data[pos:pos + 8])
        start, end = pos + 12, pos + 12 + n
        if end + 4 > len(data):
            return
        yield data[start:end]
        pos = end + 4


def read_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} as TensorBoard shows them, from the event
    files of one TensorBoard run in file order, applying purges (a
    ``SessionLog.START`` at step s hides the values logged before it at
    steps >= s).  A step listed twice is a point TensorBoard draws twice."""
    from tensorboardX.proto import event_pb2

    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(Path(logdir).glob("events.out.tfevents.*")):
        for rec in _records(path):
            ev = event_pb2.Event.FromString(rec)
            if ev.HasField("session_log") and ev.session_log.status == event_pb2.SessionLog.START:
                out = {tag: [(s, v) for s, v in pts if s < ev.step] for tag, pts in out.items()}
            if ev.HasField("summary"):
                for v in ev.summary.value:
                    if v.HasField("simple_value"):
                        out.setdefault(v.tag, []).append((int(ev.step), float(v.simple_value)))
    return out
