"""Named device profiles from published figures (``devices.profiles``;
docs/cross_device.md).  A profile is a compute tier and a network tier; a
population is a list of them with shares, each client drawn one by a seeded
shuffle with the shares' exact counts.

Compute tiers are slowdowns of one local step against the fastest phone
tier (speed = 1 / slowdown; ``devices.step_seconds`` is that phone's step).
No published figure here ties a phone's step to this machine's: ``rayfed-dg
devices calibrate`` measures this machine, and setting step_seconds to it
models phones as fast as this machine.  Network tiers are median down- and
upload bandwidths and a one-way latency (half the round-trip time the
source reports); the device model takes each as the median of its devices
(with ``devices.network.sigma`` spreading them), which the 5G figures are
and the 2020 averages are not quite.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rayfed_dg.config import ProfileShare
from rayfed_dg.errors import ConfigError
from rayfed_dg.seeding import Stream, numpy_rng

_FLASH = ("FLASH (Yang et al., WWW 2021), PKU-Chengxu/FLASH models/utils/device_util/device_util.py: measured training "
          "time per batch of its FEMNIST CNN on its three device classes, femnist_mean = [1642, 588, 179] ms")
_OOKLA_2020 = ("Ookla Speedtest Global Index, September 2020, as reported by my-financial-wealth.com (2020-10-25): "
               "averages of mobile 35.96 down / 11.22 up Mbit/s, latency 40 ms; fixed broadband 85.73 / 45.74, "
               "latency 21 ms")
_OOKLA_5G = ("Ookla, 'Growing and Slowing: The State of 5G Worldwide in 2021' (2021-12-20): median 5G download "
             "166.13 Mbit/s, upload 21.08 Mbit/s (Q3 2021)")


@dataclass(frozen=True)
class Compute:
    slowdown: float  # one local step's time over the fastest tier's
    source: str


@dataclass(frozen=True)
class Link:
    down_mbps: float
    up_mbps: float
    latency_s: float  # one-way
    source: str


COMPUTE = {
    "phone_high": Compute(1.0, _FLASH + " (179 ms: the fastest class)"),
    "phone_mid": Compute(588 / 179, _FLASH + " (588 / 179)"),
    "phone_low": Compute(1642 / 179, _FLASH + " (1642 / 179)"),
}
NETWORK = {
    "mobile": Link(35.96, 11.22, 0.020, _OOKLA_2020 + " (latency 40 / 2 ms one-way)"),
    "broadband": Link(85.73, 45.74, 0.0105, _OOKLA_2020 + " (latency 21 / 2 ms one-way)"),
    # the 5G report gives no latency: the mobile figure's
    "mobile_5g": Link(166.13, 21.08, 0.020, _OOKLA_5G + "; latency: the mobile figure, 40 / 2 ms"),
}


def assign(shares: list[float], num_clients: int, seed: int) -> np.ndarray:
    """Each client's profile: counts by the largest remainder of
    shares x clients (ties to the earlier profile), placed by a seeded
    shuffle."""
    w = np.array(shares, float) / sum(shares)
    exact = w * num_clients
    counts = np.floor(exact).astype(int)
    rest = num_clients - counts.sum()
    counts[np.argsort(-(exact - counts), kind="stable")[:rest]] += 1
    order = np.repeat(np.arange(len(shares)), counts)
    return order[numpy_rng(seed, Stream.DEVICE_PROFILE).permutation(num_clients)]


def tiers(profiles: list[ProfileShare]) -> tuple[list[Compute], list[Link | None]]:
    """Each profile's compute and network tier, checked by name."""
    for i, p in enumerate(profiles):
        if p.compute not in COMPUTE:
            raise ConfigError(f"devices.profiles.{i}.compute: unknown tier {p.compute!r}; use one of "
                              f"{', '.join(COMPUTE)}")
        if p.network is not None and p.network not in NETWORK:
            raise ConfigError(f"devices.profiles.{i}.network: unknown tier {p.network!r}; use one of "
                              f"{', '.join(NETWORK)}")
    return [COMPUTE[p.compute] for p in profiles], [None if p.network is None else NETWORK[p.network]
                                                    for p in profiles]
