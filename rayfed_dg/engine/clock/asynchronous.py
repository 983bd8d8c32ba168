"""The asynchronous server modes' virtual clock (FedBuff, FedAsync): the event
simulation that decides who trains from which model version and when each
upload arrives, pure (no Ray, no wall time).  Their server updates are
aggregation parts (``engine/aggregation/buffered.py``, which has the
papers' equations); ``docs/asynchronous.md`` is the user's page.

Staleness tau_i of an upload: the server updates applied between the
download of the model the client trained from and the update that takes
its upload (0: it trained on the newest model).

The simulation (``AsyncClock``): ``concurrency`` clients start at t = 0
with version 0; arrivals pop in (finish time, client) order; each frees its
slot, and a replacement starts at that time with the current version (after
the update, if the arrival completes the buffer): a client drawn uniformly
by a seeded sampler among those online at that time (``Devices.available``)
that are neither in flight nor waiting in the buffer (so a client uploads
at most once per update: its local state and its training's seed are one
update's).  A slot that finds nobody tries again ``retry_s`` simulated
seconds later, or at the next update, whichever comes first (the buffered
clients may start again then).  A training that drops out
(``Devices.drops``) frees its slot at its finish and is reported, not
aggregated; its device may start again at once (it uploaded nothing).
With a shared server link (``devices.network.server_mbps``) a training's
finish is not known when it starts: its upload joins the link when its
local steps end (an event of its own) and arrives once its last bit has
left and its delay passed; a dropout's finish is on its own link.
The clock's state is plain data for the checkpoint.
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from rayfed_dg.errors import ConfigError, EngineError
from rayfed_dg.seeding import Stream, numpy_rng

from .devices import DeviceModel, Devices
from .network import SharedLink

MODES = ("fedbuff", "fedasync")
FEDBUFF_K = 10  # Nguyen et al.'s buffer size (their experiments: K = 10 of 100-1000 concurrent clients)
IDLE_RETRIES = 100_000  # consecutive fruitless tries of an idle population before the simulation gives up


# ------------------------------------------------------------------ the clock

@dataclass
class Training:
    """One training on the virtual clock: ``version`` the global model it
    started from, ``draw`` its number among all starts (the device model's
    draw), ``drops`` whether it drops out before uploading."""
    client: int
    version: int
    start: float
    finish: float
    draw: int
    drops: bool
    staleness: int = 0  # set when an update takes its upload
    ready: float | None = None  # on a shared link: when its upload starts (its finish is set when it ends)


@dataclass
class Update:
    """One server update's arrivals (K, in (finish, client) order), the
    trainings that dropped out since the previous update, and the time."""
    version: int  # the version this update produces
    time: float
    arrivals: list[Training]
    dropped: list[Training] = field(default_factory=list)


class AsyncClock:
    """The event simulation of the module docstring.  ``steps(client)``:
    one training's local steps of that client in full batches' worth
    (``planned_work``)."""

    def __init__(self, num_clients: int, concurrency: int, buffer_size: int, seed: int, devices: Devices,
                 steps: Callable[[int], float], retry_s: float = 60.0):
        if not 1 <= buffer_size <= concurrency <= num_clients:
            raise ValueError(f"need 1 <= buffer_size ({buffer_size}) <= concurrency ({concurrency}) "
                             f"<= clients ({num_clients})")
        self.n, self.concurrency, self.k, self.seed = num_clients, concurrency, buffer_size, seed
        self.devices, self.steps, self.retry_s = devices, steps, retry_s
        self.time, self.version, self.starts, self.picks = 0.0, 0, 0, 0
        self.flight: dict[int, Training] = {}  # client -> its training in flight
        # heap: (time, 0 arrival / 1 idle slot / 2 upload start, client / slot seq / client)
        self.events: list[tuple[float, int, int]] = []
        self.link = None
        if isinstance(devices, DeviceModel) and devices.network.capacity_bps is not None:
            self.link = SharedLink(devices.network.capacity_bps)
        self.seen: list[int] = []  # clients whose upload waits in the buffer (one upload per client and update)
        self.buffer: list[Training] = []
        self.dropped: list[Training] = []
        self.idle = 0  # idle-slot events made so far (their tie-break)
        for _ in range(concurrency):
            self._fill(0.0)

    def in_flight_versions(self) -> set[int]:
        return {t.version for t in self.flight.values()}

    def _pick(self, t: float) -> int | None:
        """A client online at ``t``, neither in flight nor seen since the last
        update, drawn uniformly with the seeded sampler; None: nobody."""
        rng = numpy_rng(self.seed, Stream.ASYNC_SAMPLE, self.picks)
        self.picks += 1
        seen = set(self.seen)

        def ok(c: int) -> bool:
            return c not in self.flight and c not in seen and self.devices.available(c, t)

        for c in rng.integers(0, self.n, size=4 * min(self.n, 64)).tolist():  # cheap when most are eligible
            if ok(c):
                return c
        return next((c for c in rng.permutation(self.n).tolist() if ok(c)), None)

    def _fill(self, t: float) -> None:
        """Start a training in a free slot at ``t``, or try again ``retry_s`` later."""
        c = self._pick(t)
        if c is None:
            self.idle += 1
            heapq.heappush(self.events, (t + self.retry_s, 1, self.idle))
            return
        steps = self.steps(c)
        d = self.starts
        self.starts += 1
        tr = Training(c, self.version, t, t + float(self.devices.duration(c, steps, d)), d,
                      bool(self.devices.drops(c, d)))
        self.flight[c] = tr
        if self.link is not None and not tr.drops:
            assert isinstance(self.devices, DeviceModel)
            tr.ready, tr.finish = t + self.devices.ready(c, steps, d), math.inf
            heapq.heappush(self.events, (tr.ready, 2, c))
        else:
            heapq.heappush(self.events, (tr.finish, 0, c))

    def _pop(self) -> tuple[float, int, int]:
        """The next event; on a shared link an upload whose last bit leaves
        first schedules its arrival (after its delay) before that."""
        while self.link is not None:
            end = self.link.next_end()
            if end is None or (self.events and self.events[0][0] < end[0]):
                break
            t, c = end
            self.link.remove(c, t)
            tr = self.flight[c]
            assert isinstance(self.devices, DeviceModel)
            tr.finish = t + self.devices.network.up_delay_s(c, tr.draw)
            heapq.heappush(self.events, (tr.finish, 0, c))
        return heapq.heappop(self.events)

    def next_update(self) -> Update:
        """Run the clock to the arrival that fills the buffer: that update's
        arrivals, with their staleness, and the dropouts on the way."""
        fruitless = 0
        while True:
            t, kind, who = self._pop()
            self.time = t
            if kind == 2:
                assert self.link is not None and isinstance(self.devices, DeviceModel)
                self.link.add(who, t, self.devices.network.bits, float(self.devices.network.up_bps[who]))
                continue
            if kind == 1:
                before = self.starts
                self._fill(t)
                fruitless = 0 if self.starts > before else fruitless + 1
                if fruitless > IDLE_RETRIES:
                    raise EngineError(f"no client could start a training for {fruitless} tries (every {self.retry_s} "
                                      "simulated seconds): the device model keeps them offline; check its availability")
                continue
            fruitless = 0  # an arrival is progress, however many idle slots found nobody meanwhile
            tr = self.flight.pop(who)
            if tr.drops:  # never trained, no upload: free to start again (else a high dropout could stall every slot)
                self.dropped.append(tr)
                self._fill(t)
                continue
            self.seen.append(who)
            tr.staleness = self.version - tr.version
            self.buffer.append(tr)
            if len(self.buffer) < self.k:
                self._fill(t)
                continue
            self.version += 1
            out = Update(self.version, t, self.buffer, self.dropped)
            self.buffer, self.dropped, self.seen = [], [], []
            self._fill(t)  # the replacement downloads the new version
            # the clients seen since the last update may start again: idle slots try now, not at their retry time
            idle = sum(e[1] == 1 for e in self.events)
            if idle:
                self.events = [e for e in self.events if e[1] != 1]
                heapq.heapify(self.events)
                for _ in range(idle):
                    self._fill(t)
            return out

    # ------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        """Plain data (between updates the buffer is empty)."""
        return {"time": self.time, "version": self.version, "starts": self.starts, "picks": self.picks,
                "idle": self.idle, "events": [list(e) for e in self.events],
                "flight": [vars(t).copy() for t in self.flight.values()],
                **({"link": self.link.state_dict()} if self.link is not None else {})}

    def load_state_dict(self, state: dict) -> None:
        self.time, self.version = float(state["time"]), int(state["version"])
        self.starts, self.picks, self.idle = int(state["starts"]), int(state["picks"]), int(state["idle"])
        self.events = [(float(t), int(k), int(w)) for t, k, w in state["events"]]
        heapq.heapify(self.events)
        self.flight = {int(d["client"]): Training(**d) for d in state["flight"]}
        if self.link is not None:
            self.link.load_state_dict(state["link"])
        self.buffer, self.dropped, self.seen = [], [], []


# ------------------------------------------------------------------ what a run may do

def check_async(cfg, num_clients: int) -> None:
    """Refuse, in one line, an asynchronous run the clock cannot simulate: a
    round-shaping device key, or a population smaller than
    ``server.concurrency`` (which methods it takes is the aggregation
    pipeline's check)."""
    s = cfg.server
    if s.mode not in MODES:
        return
    d = cfg.devices
    if d.deadline_s is not None or d.over_selection != 1.0:
        key = "deadline_s" if d.deadline_s is not None else "over_selection"
        raise ConfigError(f"devices.{key} shapes a synchronous round; server.mode={s.mode} has no rounds to close "
                          "(each upload arrives on its own): drop it or use server.mode sync")
    c = concurrency(cfg, num_clients)
    if c > num_clients:
        raise ConfigError(f"server.concurrency={c} exceeds the {num_clients} clients of partition "
                          f"{cfg.partition.strategy}; lower it or add clients")
    k = buffer_size(cfg, num_clients)
    if k > c:
        raise ConfigError(f"server.buffer_size={k} exceeds the {c} clients training at once (server.concurrency, "
                          "else training.clients_per_round); lower it or raise server.concurrency")


def concurrency(cfg, num_clients: int) -> int:
    """``server.concurrency``; None: ``training.clients_per_round`` (all clients when unset)."""
    c = cfg.server.concurrency
    return c if c is not None else (cfg.training.clients_per_round or num_clients)


def buffer_size(cfg, num_clients: int) -> int:
    """``server.buffer_size``; None: 1 for FedAsync, min(10, concurrency) for FedBuff."""
    k = cfg.server.buffer_size
    if k is not None:
        return k
    return 1 if cfg.server.mode == "fedasync" else min(FEDBUFF_K, concurrency(cfg, num_clients))
