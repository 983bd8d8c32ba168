"""Each device's link to the server on the virtual clock (the ``devices.network``
section; docs/cross_device.md).  A training downloads the model, trains, and
uploads its update; each transfer takes the link's one-way ``latency_s``, a
seeded jitter (exponential, mean ``jitter_s``, drawn per client, training and
direction) and the model's bits over the device's bandwidth in that
direction.  Bandwidths are per device: the medians ``down_mbps``/``up_mbps``
times exp(sigma z), z standard normal seeded per client and direction, or
read from a trace (``engine/clock/traces.py``).

With ``server_mbps`` the uploads in flight at one time share the server's
link: max-min fair (water-filling: every upload gets an equal share of what
is left, none more than its own uplink), recomputed whenever an upload
starts or ends (``SharedLink``).  Without it an upload is on its own link.
Downloads never share: a broadcast is one object the server sends once.

Pure: no wall time; the same config and seed give the same seconds.
"""
from __future__ import annotations

import math

import numpy as np

from rayfed_dg.config import DevicesConfig
from rayfed_dg.seeding import Stream, numpy_rng

from .profiles import Link
from .traces import read_bandwidths


class Network:
    """The links of ``num_clients`` devices for a model of ``model_bytes``
    (one download, and again one upload).  Bandwidths in bit/s, ``inf``
    where the config sets none (that direction takes only its delays)."""

    def __init__(self, cfg: DevicesConfig, seed: int, num_clients: int, model_bytes: int,
                 links: list[Link | None] | None = None, profile: np.ndarray | None = None):
        """``links``: the profiles' network tiers, ``profile``: each client's
        profile (``engine/clock/profiles.py``); a client whose profile names
        no tier has the config's own values."""
        net = cfg.network
        self.seed, self.bits, self.jitter_s = seed, 8.0 * model_bytes, net.jitter_s
        down_mbps = cfg.bandwidth_mbps if cfg.bandwidth_mbps is not None else net.down_mbps
        up_mbps = cfg.bandwidth_mbps if cfg.bandwidth_mbps is not None else net.up_mbps
        down = np.full(num_clients, math.inf if down_mbps is None else down_mbps)
        up = np.full(num_clients, math.inf if up_mbps is None else up_mbps)
        self.latency_s = np.full(num_clients, net.latency_s)
        if links is not None and profile is not None:
            for k, link in enumerate(links):
                if link is not None:
                    mask = profile == k
                    down[mask], up[mask], self.latency_s[mask] = link.down_mbps, link.up_mbps, link.latency_s
        if net.trace is not None:
            down, up = read_bandwidths(net.trace, cfg.trace_format, num_clients)
        else:
            # a row per client: a client's draws do not depend on how many clients there are
            z = numpy_rng(seed, Stream.DEVICE_BANDWIDTH).standard_normal((num_clients, 2)) * net.sigma
            down, up = down * np.exp(z[:, 0]), up * np.exp(z[:, 1])
        self.down_bps, self.up_bps = down * 1e6, up * 1e6
        self.capacity_bps = None if net.server_mbps is None else net.server_mbps * 1e6

    @property
    def shared(self) -> bool:
        """Whether concurrent uploads divide the server's link."""
        return self.capacity_bps is not None

    def _delays(self, client: int, draw: int) -> tuple[float, float]:
        """(download, upload) latency plus jitter of one training."""
        lat = float(self.latency_s[client])
        if self.jitter_s == 0.0:
            return lat, lat
        j = numpy_rng(self.seed, Stream.DEVICE_JITTER, client, draw).exponential(self.jitter_s, 2)
        return lat + float(j[0]), lat + float(j[1])

    def down_s(self, client: int, draw: int) -> float:
        """Seconds from a training's start until its model has arrived."""
        return self._delays(client, draw)[0] + self.bits / float(self.down_bps[client])

    def up_delay_s(self, client: int, draw: int) -> float:
        """The upload's latency and jitter, after its last bit leaves."""
        return self._delays(client, draw)[1]

    def up_s(self, client: int, draw: int) -> float:
        """Seconds of the upload on the device's own link (no sharing)."""
        return self.bits / float(self.up_bps[client]) + self.up_delay_s(client, draw)


def fair_rates(caps: np.ndarray, capacity: float) -> np.ndarray:
    """Max-min fair shares of ``capacity`` among flows capped at ``caps``:
    in order of cap, each flow takes the smaller of its cap and an equal
    share of what the flows before it left."""
    rates = np.empty(len(caps))
    left = capacity
    for i, j in enumerate(np.argsort(caps, kind="stable")):
        rates[j] = min(float(caps[j]), left / (len(caps) - i))
        left -= rates[j]
    return rates


class SharedLink:
    """The uploads on the server's link: ``add`` one at its start, ask
    ``next_end`` for the earliest to finish at the current rates, ``remove``
    it there.  Rates are ``fair_rates`` of the uploads in client order.
    State is plain data for the checkpoint."""

    def __init__(self, capacity_bps: float):
        self.capacity, self.now = capacity_bps, 0.0
        self.active: dict[int, list[float]] = {}  # client -> [bits left, its uplink's cap]
        self._cached: dict[int, float] | None = None  # the rates, until an upload starts or ends

    def _rates(self) -> dict[int, float]:
        if self._cached is None:
            ids = sorted(self.active)
            rates = fair_rates(np.array([self.active[c][1] for c in ids]), self.capacity)
            self._cached = dict(zip(ids, rates.tolist()))
        return self._cached

    def advance(self, t: float) -> None:
        if t < self.now:
            raise ValueError(f"the link is at {self.now} s; cannot go back to {t} s")
        for c, r in self._rates().items():
            self.active[c][0] = max(0.0, self.active[c][0] - r * (t - self.now))
        self.now = t

    def add(self, client: int, t: float, bits: float, cap_bps: float) -> None:
        self.advance(t)
        self.active[client] = [bits, cap_bps]
        self._cached = None

    def next_end(self) -> tuple[float, int] | None:
        """(time, client) of the upload that ends first (ties: lowest client)."""
        if not self.active:
            return None
        return min((self.now + self.active[c][0] / r, c) for c, r in self._rates().items())

    def remove(self, client: int, t: float) -> None:
        self.advance(t)
        del self.active[client]
        self._cached = None

    def state_dict(self) -> dict:
        return {"now": self.now, "active": [[c, *v] for c, v in sorted(self.active.items())]}

    def load_state_dict(self, state: dict) -> None:
        self.now = float(state["now"])
        self.active = {int(c): [float(b), float(cap)] for c, b, cap in state["active"]}
        self._cached = None


def shared_uploads(link: SharedLink, starts: dict[int, float], bits: float, caps: dict[int, float]) -> dict[int, float]:
    """When each upload's last bit leaves: clients start at ``starts`` on an
    empty ``link`` and share it to the end (a synchronous round's uploads)."""
    pending = sorted((t, c) for c, t in starts.items())[::-1]
    ends: dict[int, float] = {}
    while pending or link.active:
        nxt = link.next_end()
        if pending and (nxt is None or pending[-1][0] <= nxt[0]):
            t, c = pending.pop()
            link.add(c, t, bits, caps[c])
        else:
            assert nxt is not None
            link.remove(nxt[1], nxt[0])
            ends[nxt[1]] = nxt[0]
    return ends
