"""Device traces read into the device model (``devices.trace_format``;
docs/cross_device.md has the formats and the commands that convert them).

- ``csv``, the engine's own: ``client,speed``; ``client,down_mbps,up_mbps``;
  ``client,start_s,end_s[,period_s]`` (online intervals; each client's
  repeat after its ``period_s``, else after the file's largest end).
- ``fedscale``: FedScale's pickles (Lai et al., ICML 2022; SymbioticLab/FedScale,
  benchmark/dataset/data/device_info/).  ``client_device_capacity``: client
  id -> {'computation': ms per sample, 'communication': kbit/s}, looked up as
  FedScale's aggregator does (``aggregator.py`` load_client_profile, client
  ids from 1, the row keyed ``id % rows``); a speed is the file's median
  ms per sample over the client's, so speed 1 is the median device, and a
  bandwidth is the kbit/s both ways (FedScale's one bandwidth for the model's
  upload and download; its kbit is 1024 bits).  FedScale's synchronous
  aggregator also drops a client that is offline at the round's start plus
  its own duration; the engine asks at the round's start only (mid-training
  losses are ``devices.dropout``).  ``client_behave_trace``: id -> {'active': [s],
  'inactive': [s], 'finish_time': s}, the id-th record in file order
  (``client_manager.py``), online within [active_i, inactive_i], repeating
  after finish_time.
- ``flash``: FLASH's ``state_traces.json`` (Yang et al., WWW 2021;
  PKU-Chengxu/FLASH models/timer.py): uid -> {'messages': lines
  ``%Y-%m-%d %H:%M:%S<TAB>state``}; a device is online while its screen is
  locked, it is charging and on wifi (the state starts all off), each user's
  trace repeating over its own first to last message.  A user whose trace
  FLASH rejects (a bad line, no online time, one instant) is skipped; client
  c is the c-th remaining user in uid order.  FLASH truncates times to whole
  seconds, closes both ends of a window, asks at the round's start plus its
  selection window and pauses a training while its device is offline; the
  engine's windows are half-open, asked at the round's start, and a device
  going offline mid-training is ``devices.dropout``.

Where this differs from the reference code it says so at the line.  The
pickles are read by an unpickler that accepts plain data only.
"""
from __future__ import annotations

import csv
import io
import json
import pickle
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from rayfed_dg.errors import ConfigError
from rayfed_dg.utils import write_text

FORMATS = ("csv", "fedscale", "flash")


# ------------------------------------------------------------------ the engine's CSV

def read_csv(path: str, columns: tuple[str, ...], key: str, optional: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError as e:
        raise ConfigError(f"devices.{key}: cannot read {path} ({e.strerror}); give a CSV file") from None
    if not rows or not set(columns) <= set(rows[0]):
        raise ConfigError(f"devices.{key}: {path} needs a header line with the columns {','.join(columns)}")
    have = columns + tuple(c for c in optional if c in rows[0])
    try:
        return {c: np.array([float(r[c]) for r in rows]) for c in have}
    except (TypeError, ValueError):
        raise ConfigError(f"devices.{key}: {path} has a value that is not a number in columns "
                          f"{','.join(have)}") from None


def check_clients(ids: np.ndarray, num_clients: int, path: str, key: str) -> np.ndarray:
    """The trace's client ids, checked to cover 0 .. num_clients - 1."""
    if not np.all(ids == np.round(ids)) or ids.min() < 0:
        raise ConfigError(f"devices.{key}: {path} has a client that is not a whole number >= 0")
    ids = ids.astype(np.int64)
    missing = np.setdiff1d(np.arange(num_clients), ids)
    if len(missing):
        raise ConfigError(f"devices.{key}: {path} covers {num_clients - len(missing)} of the {num_clients} clients "
                          f"(client {missing[0]} has no row); give a row to every client 0..{num_clients - 1}")
    return ids


def _per_client(ids: np.ndarray, values: np.ndarray, num_clients: int) -> np.ndarray:
    out = np.empty(num_clients)
    keep = ids < num_clients  # extra clients are ignored
    out[ids[keep]] = values[keep]
    return out


def _merge(windows: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Windows [a, b) in time order, overlapping or touching ones joined."""
    merged: list[tuple[float, float]] = []
    for a, b in sorted(windows):
        if merged and merged[-1][1] >= a:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


@dataclass(frozen=True)
class AvailabilityTrace:
    """Online intervals [start, end) of every client, sorted and disjoint, in CSR form
    (client c's are ``starts[offsets[c]:offsets[c + 1]]``, ``owner`` the
    client of each); client c's repeat after ``period[c]``."""
    offsets: np.ndarray
    starts: np.ndarray
    ends: np.ndarray
    owner: np.ndarray
    period: np.ndarray

    @staticmethod
    def build(ids: np.ndarray, starts: np.ndarray, ends: np.ndarray, period: np.ndarray) -> AvailabilityTrace:
        """From intervals of clients 0 .. len(period) - 1 (in any order, overlapping or empty)."""
        order = np.lexsort((starts, ids))
        ids, starts, ends = ids[order], starts[order], ends[order]
        cut = np.searchsorted(ids, np.arange(len(period) + 1))
        # a client's overlapping or touching intervals joined (an empty one too): ``available`` reads the last
        # interval starting at or before t, which must then be the one that holds t, as ``online`` finds
        per = [_merge(zip(starts[lo:hi].tolist(), ends[lo:hi].tolist())) for lo, hi in zip(cut[:-1], cut[1:])]
        owner = np.repeat(np.arange(len(period), dtype=np.int64), [len(w) for w in per])
        flat = [w for ws in per for w in ws]
        return AvailabilityTrace(np.searchsorted(owner, np.arange(len(period) + 1)),
                                 np.array([a for a, _ in flat], float), np.array([b for _, b in flat], float), owner,
                                 period)

    def online(self, t: float) -> np.ndarray:
        local = (t % self.period)[self.owner]
        out = np.zeros(len(self.period), bool)
        out[self.owner[(self.starts <= local) & (local < self.ends)]] = True
        return out

    def available(self, client: int, t: float) -> bool:
        t = t % float(self.period[client])
        lo, hi = self.offsets[client], self.offsets[client + 1]
        i = lo + np.searchsorted(self.starts[lo:hi], t, side="right") - 1
        return bool(i >= lo and t < self.ends[i])


def _csv_availability(path: str, num_clients: int) -> AvailabilityTrace:
    key = "availability_trace"
    cols = read_csv(path, ("client", "start_s", "end_s"), key, optional=("period_s",))
    ids = check_clients(cols["client"], num_clients, path, key)
    starts, ends = cols["start_s"], cols["end_s"]
    if np.any(starts < 0) or np.any(ends < starts):
        raise ConfigError(f"devices.{key}: {path} has an interval with start_s < 0 or end_s < start_s")
    if "period_s" in cols:
        period = cols["period_s"]
        if np.any(period <= 0) or np.any(ends > period):
            raise ConfigError(f"devices.{key}: {path} has a period_s <= 0 or an interval ending after its period_s; "
                              "give each client a period_s > 0 and end_s <= period_s")
        per = _per_client(ids, period, num_clients)
        if np.any(period[ids < num_clients] != per[ids[ids < num_clients]]):
            raise ConfigError(f"devices.{key}: {path} gives one client two period_s values; give one per client")
    else:
        if ends.max() <= 0:
            raise ConfigError(f"devices.{key}: {path}: no client is ever online (every end_s is 0)")
        per = np.full(num_clients, float(ends.max()))
    keep = ids < num_clients
    return AvailabilityTrace.build(ids[keep], starts[keep], ends[keep], per)


# ------------------------------------------------------------------ FedScale

class _PlainData(pickle.Unpickler):
    # dicts, lists and numbers need no class; NumPy's scalars need these two; anything else is refused unrun
    ALLOWED = {("numpy._core.multiarray", "scalar"), ("numpy.core.multiarray", "scalar"), ("numpy", "dtype"),
               ("_codecs", "encode")}  # pickle protocol <= 2 keeps a scalar's bytes as text through _codecs.encode

    def find_class(self, module, name):
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not plain data")


def _pickle(path: str, key: str) -> dict:
    want = "client_behave_trace" if key == "availability_trace" else "client_device_capacity"
    try:
        with open(path, "rb") as f:
            data = _PlainData(io.BytesIO(f.read())).load()
    except OSError as e:
        raise ConfigError(f"devices.{key}: cannot read {path} ({e.strerror}); give FedScale's {want}") from None
    except Exception as e:  # a truncated or foreign file raises any of pickle's many errors
        raise ConfigError(f"devices.{key}: {path} is not a FedScale pickle of plain data ({e}); give FedScale's "
                          f"{want}") from None
    if not isinstance(data, dict) or not data:
        raise ConfigError(f"devices.{key}: {path} is not a FedScale dict of clients; give FedScale's {want}")
    return data


def fedscale_capacity(path: str, num_clients: int, key: str) -> tuple[np.ndarray, np.ndarray, float]:
    """(ms per sample, kbit/s) of clients 0 .. num_clients - 1 (FedScale's
    ids 1 ..), and the file's median ms per sample."""
    rows = _pickle(path, key)
    # FedScale falls back to {1.0, 1.0} for an id it lacks (with keys 1 .. N, every N-th client): refused here
    lack = next((c for c in range(num_clients) if (c + 1) % len(rows) not in rows), None)
    if lack is not None:
        raise ConfigError(f"devices.{key}: {path} has no client {(lack + 1) % len(rows)}, which FedScale maps "
                          f"client {lack + 1} to (id % {len(rows)} rows); use fewer than {len(rows)} clients or add "
                          f"a key {(lack + 1) % len(rows)}")
    try:
        ms_all = np.array([float(v["computation"]) for v in rows.values()])
        pairs = [(float(rows[(c + 1) % len(rows)]["computation"]), float(rows[(c + 1) % len(rows)]["communication"]))
                 for c in range(num_clients)]
    except (KeyError, TypeError, ValueError, AttributeError):
        raise ConfigError(f"devices.{key}: {path}: a client is not {{'computation': ms, 'communication': kbps}}; "
                          "give FedScale's client_device_capacity") from None
    ms, kbps = np.array(pairs).reshape(num_clients, 2).T
    if np.any(ms_all <= 0) or np.any(kbps <= 0) or not np.all(np.isfinite(ms_all)) or not np.all(np.isfinite(kbps)):
        raise ConfigError(f"devices.{key}: {path} has a computation or communication <= 0 or not finite; every "
                          "device needs a positive, finite ms per sample and kbit/s")
    return ms, kbps, float(np.median(ms_all))


def _fedscale_availability(path: str, num_clients: int) -> AvailabilityTrace:
    key = "availability_trace"
    rows = list(_pickle(path, key).values())
    ids, starts, ends, period = [], [], [], np.empty(num_clients)
    for c in range(num_clients):
        rec = rows[(c + 1) % len(rows)]  # FedScale's client_manager: the (id % records)-th record in file order
        try:
            on, off, fin = list(map(float, rec["active"])), list(map(float, rec["inactive"])), float(rec["finish_time"])
        except (KeyError, TypeError, ValueError):
            raise ConfigError(f"devices.{key}: {path}: a record lacks numeric 'active', 'inactive' or 'finish_time'; "
                              "give FedScale's client_behave_trace") from None
        if len(on) != len(off) or fin <= 0 or any(a < 0 or b < a for a, b in zip(on, off)):
            raise ConfigError(f"devices.{key}: {path}: a record's 'active' and 'inactive' are not paired intervals "
                              "0 <= active <= inactive, or its finish_time is <= 0; fix that record")
        # FedScale's is_active moves a cursor one interval per call and can answer False inside an interval after a
        # jump; this asks whether t falls in any interval, and half-open (FedScale closes both ends)
        # an interval past finish_time is never asked about there (t % finish_time < finish_time): clipped
        kept = [(a, min(b, fin)) for a, b in zip(on, off) if a < fin]
        ids += [c] * len(kept)
        starts += [a for a, _ in kept]
        ends += [b for _, b in kept]
        period[c] = fin
    return AvailabilityTrace.build(np.array(ids, np.int64), np.array(starts), np.array(ends), period)


# ------------------------------------------------------------------ FLASH

FLASH_REFERENCE = datetime(2020, 1, 2, tzinfo=UTC)  # timer.py's refer_time: its times are seconds from it
_WIFI_OFF = ("unknown", "4g", "3g", "2g", "5g")


def _flash_state(state: str, flags: dict[str, bool]) -> bool:
    """Apply one FLASH message to ``flags`` (charged, wifi, locked); False:
    a battery level that is not a number (FLASH rejects the trace)."""
    if state in ("battery_charged_on", "battery_charged_off"):
        flags["charged"] = state == "battery_charged_on"
    elif state == "wifi" or state in _WIFI_OFF:
        flags["wifi"] = state == "wifi"
    elif state in ("screen_lock", "screen_unlock"):
        flags["locked"] = state == "screen_lock"
    elif state.endswith("%"):  # the battery level, which the rule ignores
        try:
            float(state[:-1])
        except ValueError:
            return False
    elif state not in ("screen_on", "screen_off"):
        raise ConfigError(f"devices.availability_trace: unknown FLASH state {state!r} (FLASH stops on it); remove "
                          "that message or map it to one FLASH knows")
    return True


def flash_user(messages: str) -> tuple[list[tuple[float, float]], float, float] | None:
    """A FLASH user's merged online windows and its first and last message
    (seconds from ``FLASH_REFERENCE``); None where FLASH's Timer rejects it."""
    flags = {"charged": False, "wifi": False, "locked": False}
    start = None
    windows, times = [], []
    for line in messages.split("\n"):
        if not line.strip():
            continue
        try:
            stamp, state = (x.strip() for x in line.strip().split("\t"))
            # timer.py uses time.mktime (the machine's zone); UTC gives the same differences without a DST change
            t = (datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC) - FLASH_REFERENCE).total_seconds()
        except ValueError:
            return None
        if not _flash_state(state.lower(), flags):
            return None
        times.append(t)
        ready = flags["locked"] and flags["wifi"] and flags["charged"]
        if ready and start is None:
            start = t
        elif not ready and start is not None:
            windows.append((start, t))
            start = None
    # a window still open at the last message is dropped, as in timer.py; messages out of time order would give
    # FLASH a negative period: rejected here too
    if not windows or times[-1] <= times[0]:
        return None
    return _merge(windows), times[0], times[-1]


def _flash_availability(path: str, num_clients: int) -> AvailabilityTrace:
    key = "availability_trace"
    try:
        with open(path) as f:
            users = json.load(f)
        items = sorted(users.items(), key=lambda kv: (len(kv[0]), kv[0]))  # uid order: "2" before "10"
        messages = [str(u["messages"]) for _, u in items]
    except OSError as e:
        raise ConfigError(f"devices.{key}: cannot read {path} ({e.strerror}); give FLASH's state_traces.json") \
            from None
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ConfigError(f"devices.{key}: {path} is not FLASH's JSON of users with 'messages'; give FLASH's "
                          "state_traces.json") from None
    parsed = [flash_user(m) for m in messages]
    valid = [p for p in parsed if p is not None]
    if not valid:
        raise ConfigError(f"devices.{key}: {path}: no user has a trace FLASH accepts (online windows over time); "
                          "give FLASH's state_traces.json")
    ids, starts, ends, period = [], [], [], np.empty(num_clients)
    for c in range(num_clients):
        # FLASH draws a valid user at random per client; client c takes the c-th, so a trace maps the same every run
        windows, first, last = valid[c % len(valid)]
        # timer.py asks whether first + (t - first) % P falls in a window, P = last - first: that is, whether
        # t % P falls in the window moved to a % P (split where it passes P)
        p = period[c] = last - first
        for a, b in windows:
            s = a % p
            for lo, hi in ((s, min(s + b - a, p)), (0.0, s + b - a - p)):
                if hi > lo:
                    ids.append(c)
                    starts.append(lo)
                    ends.append(hi)
    return AvailabilityTrace.build(np.array(ids, np.int64), np.array(starts), np.array(ends), period)


# ------------------------------------------------------------------ what the device model reads

def _format_refused(fmt: str, what: str) -> ConfigError:
    return ConfigError(f"devices.trace_format: {fmt} has no {what} trace; use trace_format csv for it "
                       "(rayfed-dg devices convert writes the engine's CSV)")


def read_speeds(path: str, fmt: str, num_clients: int) -> np.ndarray:
    """Each client's speed: a multiple of a device doing a step in step_seconds."""
    if fmt == "fedscale":
        ms, _, median = fedscale_capacity(path, num_clients, "speed_trace")
        return median / ms
    if fmt != "csv":
        raise _format_refused(fmt, "speed")
    cols = read_csv(path, ("client", "speed"), "speed_trace")
    ids = check_clients(cols["client"], num_clients, path, "speed_trace")
    if np.any(cols["speed"] <= 0) or not np.all(np.isfinite(cols["speed"])):
        raise ConfigError(f"devices.speed_trace: {path} has a speed <= 0 or not finite; speeds are finite multiples "
                          "of a device doing one step in step_seconds")
    return _per_client(ids, cols["speed"], num_clients)


def read_bandwidths(path: str, fmt: str, num_clients: int) -> tuple[np.ndarray, np.ndarray]:
    """Each client's (down, up) Mbit/s."""
    key = "network.trace"
    if fmt == "fedscale":
        _, kbps, _ = fedscale_capacity(path, num_clients, key)
        # FedScale's kbit is 1024 bits (aggregator.py: the model's bytes / 1024 x 8 over kbps)
        return kbps * 1.024e-3, kbps * 1.024e-3
    if fmt != "csv":
        raise _format_refused(fmt, "bandwidth")
    cols = read_csv(path, ("client", "down_mbps", "up_mbps"), key)
    ids = check_clients(cols["client"], num_clients, path, key)
    both = np.stack([cols["down_mbps"], cols["up_mbps"]])
    if np.any(both <= 0) or not np.all(np.isfinite(both)):
        raise ConfigError(f"devices.{key}: {path} has a bandwidth <= 0 or not finite; give Mbit/s > 0")
    return _per_client(ids, both[0], num_clients), _per_client(ids, both[1], num_clients)


def read_availability(path: str, fmt: str, num_clients: int) -> AvailabilityTrace:
    return {"csv": _csv_availability, "fedscale": _fedscale_availability,
            "flash": _flash_availability}[fmt](path, num_clients)


# ------------------------------------------------------------------ converters

def _csv_lines(header: str, rows) -> str:
    # repr: the shortest text that reads back as the same float
    return header + "\n" + "".join(",".join(v if isinstance(v, str) else repr(v) for v in row) + "\n" for row in rows)


def convert(fmt: str, num_clients: int, out: Path, capacity: str | None = None,
            availability: str | None = None) -> list[Path]:
    """The engine's CSV files of a FedScale or FLASH trace, for clients
    0 .. num_clients - 1: what the device model reads from the original
    (``speeds.csv``, ``bandwidth.csv``, ``availability.csv``).  Everything is
    read before anything is written."""
    if capacity is None and availability is None:
        raise ConfigError("devices convert: give --capacity, --availability or both")
    texts: dict[str, str] = {}
    if capacity is not None:
        speeds = read_speeds(capacity, fmt, num_clients)
        down, up = read_bandwidths(capacity, fmt, num_clients)
        texts["speeds.csv"] = _csv_lines("client,speed", ((c, float(speeds[c])) for c in range(num_clients)))
        texts["bandwidth.csv"] = _csv_lines("client,down_mbps,up_mbps",
                                            ((c, float(down[c]), float(up[c])) for c in range(num_clients)))
    if availability is not None:
        tr = read_availability(availability, fmt, num_clients)
        rows = []
        for c in range(num_clients):
            lo, hi, p = tr.offsets[c], tr.offsets[c + 1], float(tr.period[c])
            rows += [(c, float(a), float(b), p) for a, b in zip(tr.starts[lo:hi], tr.ends[lo:hi])] or [(c, 0.0, 0.0, p)]
        texts["availability.csv"] = _csv_lines("client,start_s,end_s,period_s", rows)
    out.mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():
        write_text(text, out / name)
    return [out / name for name in texts]
