"""The privacy accountant: epsilon at ``privacy.delta`` per group and in
total, after each round, from Google's ``dp-accounting``.

What is composed (docs/privacy.md):

* ``updates`` (DP-FedAvg, ``engine/privacy/updates.py``): one Gaussian mechanism a round
  on the sum of the sampled clients' clipped updates, noise multiplier z
  (with adaptive clipping the update and count noises together make z,
  Andrew et al.'s z_Delta).  The engine samples m of the N clients without
  replacement, a fixed number each round (``seeding.sample_clients``): for
  m < N that is ``SampledWithoutReplacementDpEvent`` (Wang, Balle and
  Kasiviswanathan, AISTATS 2019, Thm. 27), which dp-accounting composes
  only in its RDP accountant and only under the REPLACE_ONE relation (its
  ``_maybe_compose`` refuses any other; N is public).  Replacing one
  client moves the sum of clipped updates by up to 2 x clip, so the event's
  noise multiplier (std over the L2 sensitivity) is z / 2.  With m = N
  there is no sampling and no amplification: a plain ``GaussianDpEvent(z)``
  under ADD_OR_REMOVE_ONE (adding or removing a client moves the sum by up
  to clip).  Poisson sampling, which PLD supports, is not what the engine
  does, so the PLD accountant refuses m < N rather than claim its
  amplification (``check``).
* each payload group of ``privacy.payloads`` (a statistic a method or
  stage shares): a Gaussian mechanism of multiplier z_group for each
  release, counted from the round's ledger rows going up (``payload:`` and
  ``prepare:`` groups); a round counts the releases of the client that
  released the group most often in it (the worst case).  The noise is
  added by the client itself, so no sampling amplifies it.  Its unit is one
  record (one row of the payload, clipped on its own); under REPLACE_ONE
  (when the updates need it) the multiplier is halved likewise.
* the total: all of them composed, at the finest unit among the groups
  released.  When every group's record is a client (the updates, payloads
  of ``client`` records), the total protects a client.  When an ``image``
  group (one row per image: CCST ``single``, amplitude spectra) is
  released too, the total protects one image: adding or removing an image
  moves its client's clipped update, or a ``client`` record, by up to
  2 x clip (from one clipped vector to another), so under ADD_OR_REMOVE_ONE
  those mechanisms enter the total at z / 2, and the image rows at z.  Each
  group's own epsilon stays at its own unit.  Under REPLACE_ONE every
  mechanism is already at z / 2, right at either unit.

What leaves the clients without noise counts too, as a non-private
mechanism (epsilon infinite): the model updates without ``privacy.updates``,
and a payload group the ledger shows released that ``privacy.payloads``
does not name.  So the total is finite only when everything released was
noised.

RDP (the default) is the accountant that supports the engine's sampling
without replacement; PLD is tighter for the Gaussian mechanisms without
sampling (every client each round), e.g. 23.3 against RDP's 24.8 for 15
rounds at z = 1, delta = 1e-5.  Both are offered as ``privacy.accountant``.

Epsilon depends only on how many times each mechanism ran, so the
accountant is a pure function of (rounds run, releases per group): a
resumed run recomputes it from the ledger rows it kept, and the check
before a round (``target_epsilon``) forecasts the next round as the last
one (its releases as the previous round's).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

from rayfed_dg.config import PrivacyConfig
from rayfed_dg.engine.store.records import PrivacyRow
from rayfed_dg.errors import ConfigError

UPDATES = "updates"  # the group of the model updates (DP-FedAvg)
TOTAL = "total"  # every group composed


def payload_group(ledger_group: str) -> str | None:
    """The ``privacy.payloads`` key of a ledger group (``payload:<name>``,
    ``prepare:<name>``), None for model tensors and anything else."""
    prefix, sep, name = ledger_group.partition(":")
    return name if sep and prefix in ("payload", "prepare") else None


def releases(rows: Iterable[Mapping]) -> Counter[str]:
    """Releases of each payload group in ledger ``rows`` (any rounds): per
    round, the most releases of the group by one client (rows going up),
    summed over the rounds."""
    per: Counter[tuple[int, str, int]] = Counter()
    for row in rows:
        g = payload_group(row["group"])
        if g is not None and row["direction"] == "up":
            per[int(row["round"]), g, int(row["client"])] += 1
    most: dict[tuple[int, str], int] = {}
    for (rnd, g, _), n in per.items():
        most[rnd, g] = max(most.get((rnd, g), 0), n)
    out: Counter[str] = Counter()
    for (_, g), n in most.items():
        out[g] += n
    return out


class Accountant:
    """Epsilon of a federation of ``num_clients`` clients, ``per_round`` of
    them sampled each round, under ``privacy``."""

    def __init__(self, privacy: PrivacyConfig, num_clients: int, per_round: int,
                 records: Mapping[str, str] | None = None):
        import dp_accounting as dp

        self.p, self.n, self.m = privacy, num_clients, per_round
        self.records = dict(records or {})  # payload group -> what one record is (methods/payloads.py RECORDS)
        self.sampled = privacy.updates is not None and per_round < num_clients
        # REPLACE_ONE is the only relation dp-accounting composes sampling without replacement under
        self.relation = dp.NeighboringRelation.REPLACE_ONE if self.sampled else \
            dp.NeighboringRelation.ADD_OR_REMOVE_ONE
        self.sensitivity = 2.0 if self.sampled else 1.0  # in clips: replacing a record moves a clipped sum by 2 clips

    def check(self) -> None:
        """Refuse what the chosen accountant cannot account for the engine's sampling."""
        if self.p.accountant == "pld" and self.sampled:
            raise ConfigError(f"privacy.accountant: pld accounts Poisson sampling only, and the engine samples "
                              f"{self.m} of {self.n} clients without replacement: use rdp (Wang et al.'s bound), "
                              "or every client each round (training.clients_per_round: null)")

    def noise_multiplier(self, group: str) -> float:
        """The group's z; 0 for what leaves the clients without noise (updates without ``privacy.updates``, a
        payload group ``privacy.payloads`` does not name): never private, epsilon infinite."""
        if group == UPDATES:
            return self.p.updates.noise_multiplier if self.p.updates is not None else 0.0
        return self.p.payloads[group].noise_multiplier if group in self.p.payloads else 0.0

    def _event(self, group: str, count: int, per_image: bool = False):
        import dp_accounting as dp

        z = self.noise_multiplier(group)
        if count == 0:
            return dp.NoOpDpEvent()
        if z == 0:
            return dp.NonPrivateDpEvent()
        sensitivity = self.sensitivity
        if per_image and self.records.get(group) != "image":  # one image moves a client-level vector by 2 clips
            sensitivity = 2.0
        one = dp.GaussianDpEvent(z / sensitivity)
        if group == UPDATES and self.sampled:
            one = dp.SampledWithoutReplacementDpEvent(self.n, self.m, one)
        return dp.SelfComposedDpEvent(one, count)

    def _fresh(self, kind: str | None = None):
        from dp_accounting import pld, rdp

        return pld.PLDAccountant(self.relation) if (kind or self.p.accountant) == "pld" else \
            rdp.RdpAccountant(neighboring_relation=self.relation)

    def epsilon(self, counts: Mapping[str, int], groups: Iterable[str] | None = None) -> float:
        """Epsilon at ``privacy.delta`` of ``groups`` (default: all of ``counts``) composed, each run
        ``counts[group]`` times."""
        import dp_accounting as dp

        names = list(counts if groups is None else groups)
        # the total of a run that released image rows protects an image (the module docstring)
        per_image = len(names) > 1 and any(self.records.get(g) == "image" and counts.get(g, 0) for g in names)
        events = [self._event(g, int(counts.get(g, 0)), per_image) for g in names]
        acc = self._fresh()
        acc.compose(dp.ComposedDpEvent(events))
        return float(acc.get_epsilon(self.p.delta))

    def counts(self, rounds: int, released: Mapping[str, int]) -> dict[str, int]:
        """Mechanisms run after ``rounds`` update rounds and ``released`` payload releases, by group: the
        updates, then every payload group configured or released."""
        return {UPDATES: rounds, **{g: int(released.get(g, 0)) for g in sorted(set(self.p.payloads) | set(released))}}

    def rows(self, round: int, counts: Mapping[str, int], clip: float | None) -> list[PrivacyRow]:
        """Each group's epsilon after ``round``, then the total's; ``clip``: the round's update clip."""
        d = self.p.delta
        out = [PrivacyRow(round, g, int(n), self.noise_multiplier(g), clip if g == UPDATES else
                          self.p.payloads[g].clip if g in self.p.payloads else None, self.epsilon(counts, [g]), d)
               for g, n in counts.items()]
        return out + [PrivacyRow(round, TOTAL, sum(counts.values()), None, None, self.epsilon(counts), d)]

    def calibrate(self, rounds: int, epsilon: float) -> float:
        """The update noise multiplier z at which ``rounds`` rounds of DP-FedAvg spend ``epsilon`` at delta."""
        import dp_accounting as dp

        def event(z: float):
            one = dp.GaussianDpEvent(z / self.sensitivity)
            return dp.SelfComposedDpEvent(dp.SampledWithoutReplacementDpEvent(self.n, self.m, one)
                                          if self.sampled else one, rounds)

        z = dp.calibrate_dp_mechanism(lambda: self._fresh("rdp"), event, epsilon, self.p.delta,
                                      dp.LowerEndpointAndGuess(1e-3, 1.0), tol=1e-4)
        if self.p.accountant == "pld":  # tighter: below RDP's z (PLD's grid of a tiny z would not fit in memory)
            z = dp.calibrate_dp_mechanism(self._fresh, event, epsilon, self.p.delta,
                                          dp.ExplicitBracketInterval(z / 2, z), tol=1e-4)
        return float(z)
