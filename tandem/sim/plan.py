"""`tandem sim plan`: the cheapest cluster that meets given SLOs at a given request rate.

For each accelerator and tensor- and pipeline-parallel degree, colocated clusters grow until one meets the
attainment target (more instances never hurt attainment much, so a doubling search then
bisection finds the least count in a few simulations; a doubling that no longer raises
attainment stops it); disaggregated ones, for each prefill count, find the least decode count, and stop adding prefill instances once those alone cost
more than the cheapest cluster found. Every cluster simulated is kept: the frontier printed is
each one's price and attainment, with the Pareto-optimal ones (no cheaper cluster attains as
much) marked. Every figure is simulated.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass

from tandem.sim.report import attained

STALLED = 0.005  # doubling a part that raises attainment by less than this is not the fix


@dataclass(frozen=True)
class Layout:
    """One cluster shape: colocated `count` instances, or `prefill` + `decode` instances
    (decode on `decode_hardware` when it differs)."""

    hardware: str
    tp: int = 1
    count: int = 0
    prefill: int = 0
    decode: int = 0
    decode_hardware: str = ""
    pp: int = 1
    ep: bool = False  # a mixture of experts' experts spread over the tp devices

    @property
    def instances(self) -> int:
        return self.count or self.prefill + self.decode

    def cluster(self, base: dict) -> dict:
        """The cluster file this layout is, over `base` (model, router, engine, link)."""
        settings = {k: v for k, v in base.items() if k != "link"}
        group = {"hardware": self.hardware, "tp": self.tp, "pp": self.pp}
        if self.ep:
            group["ep"] = True
        if self.count:
            return settings | {"groups": [group | {"name": self.hardware, "count": self.count}]}
        decode = group | {"hardware": self.decode_hardware or self.hardware}
        return settings | {
            "groups": [
                group | {"name": "prefill", "role": "prefill", "count": self.prefill},
                decode | {"name": "decode", "role": "decode", "count": self.decode},
            ],
            "links": [{"from": "prefill", "to": "decode", **base.get("link", {})}],
        }

    def describe(self) -> str:
        tp = (f" tp{self.tp}" if self.tp > 1 else "") + (f" pp{self.pp}" if self.pp > 1 else "")
        tp += " ep" if self.ep else ""
        if self.count:
            return f"{self.count} x {self.hardware}{tp}"
        return f"{self.prefill}P {self.hardware}{tp} + {self.decode}D " + (
            f"{self.decode_hardware or self.hardware}{tp}"
        )


@dataclass(frozen=True)
class Probe:
    layout: Layout
    price_per_hour: float
    attainment: float
    result: dict

    def meets(self, target: float) -> bool:
        return self.attainment >= target


class Planner:
    """Searches layouts with `evaluate` (a cluster dict -> a `simulate` result), keeping
    every probe."""

    def __init__(self, base: dict, evaluate: Callable[[dict], dict], target: float,
                 max_instances: int, price: Callable[[dict], float]) -> None:  # fmt: skip
        if not 0 < target <= 1:
            raise ValueError(f"slo_target: {target} is not in (0, 1]")
        if max_instances < 1:
            raise ValueError(f"max_instances: {max_instances} must be >= 1")
        self.base, self.evaluate, self.target = base, evaluate, target
        self.max_instances, self.price = max_instances, price
        self.probes: dict[Layout, Probe] = {}
        self.skipped: dict[str, str] = {}  # hardware/tp that cannot hold the model: why

    def probe(self, layout: Layout) -> Probe:
        if layout not in self.probes:
            cluster = layout.cluster(self.base)
            result = self.evaluate(cluster)
            self.probes[layout] = Probe(layout, self.price(cluster), attained(result), result)
        return self.probes[layout]

    def least(self, make: Callable[[int], Layout], limit: int) -> Probe | None:
        """The layout with the fewest n in [1, limit] that meets the target."""
        if limit < 1:
            return None
        good, bad, n, last = None, 0, 1, -1.0
        while good is None:  # double until one meets
            probe = self.probe(make(n))
            if probe.meets(self.target):
                good = n
            elif n >= limit or probe.attainment <= last + STALLED:
                return None  # the limit, or more of this part no longer helps (another binds)
            else:
                bad, n, last = n, min(2 * n, limit), probe.attainment
        while good - bad > 1:
            mid = (good + bad) // 2
            good, bad = (mid, bad) if self.probe(make(mid)).meets(self.target) else (good, mid)
        return self.probe(make(good))

    def search(self, hardware: list[str], tps: list[int], colocated: bool = True,
               disaggregated: bool = False, pps: tuple[int, ...] = (1,),
               eps: tuple[bool, ...] = (False,)) -> Probe | None:  # fmt: skip
        """The cheapest probe that meets the target (None: nothing within max_instances).
        eps: experts split by columns (False) and/or spread whole (True; tp > 1 only)."""
        for hw, tp, pp, ep in itertools.product(hardware, tps, pps, eps):
            if ep and tp == 1:
                continue
            split = f"tp{tp}" + (f" pp{pp}" if pp > 1 else "") + (" ep" if ep else "")
            if colocated:
                self._skipping(f"{hw} {split}", self.least,
                               functools.partial(_colocated, hw, tp, pp, ep), self.max_instances)  # fmt: skip
            if disaggregated:
                for decode_hw in hardware:
                    self._skipping(f"{hw}->{decode_hw} {split}", self._disaggregated, hw,
                                   decode_hw, tp, pp, ep)  # fmt: skip
        return self.cheapest()

    def _skipping(self, what: str, search, *args) -> None:
        try:
            search(*args)
        except ValueError as e:  # the model does not fit this hardware at this tp
            self.skipped[what] = str(e)

    def _disaggregated(self, prefill_hw: str, decode_hw: str, tp: int, pp: int = 1,
                       ep: bool = False) -> None:  # fmt: skip
        for p in range(1, self.max_instances):
            best = self.cheapest()
            floor = Layout(prefill_hw, tp, prefill=p, decode=1, decode_hardware=decode_hw, pp=pp, ep=ep)  # fmt: skip
            if best is not None and self.price(floor.cluster(self.base)) >= best.price_per_hour:
                return  # more prefill instances only cost more than what already meets
            pair = functools.partial(_disaggregated, prefill_hw, decode_hw, tp, pp, ep, p)
            self.least(pair, self.max_instances - p)

    def cheapest(self) -> Probe | None:
        ok = [p for p in self.probes.values() if p.meets(self.target)]
        return min(ok, key=lambda p: (p.price_per_hour, p.layout.instances), default=None)

    def frontier(self) -> list[Probe]:
        """Probes no cheaper (or equally priced) probe beats on attainment, cheapest first."""
        out, best = [], -1.0
        for p in sorted(self.probes.values(), key=lambda p: (p.price_per_hour, -p.attainment)):
            if p.attainment > best:
                out.append(p)
                best = p.attainment
        return out


def format_plan(planner: Planner) -> str:
    frontier = {id(p) for p in planner.frontier()}
    head = (f"{'cluster':<28} {'$/hour':>8} {'attain':>7} {'TTFT p99':>9} {'TPOT p99':>9} "
            f"{'$/M out':>8}  ")  # fmt: skip
    lines = [head, "-" * len(head)]
    for p in sorted(planner.probes.values(), key=lambda p: (p.price_per_hour, p.layout.describe())):
        r = p.result
        per_m = r.get("cost_per_million_output_tokens")
        mark = ("meets" if p.meets(planner.target) else "") + (
            " *frontier" if id(p) in frontier else ""
        )
        lines.append(
            f"{p.layout.describe():<28} {p.price_per_hour:>8.2f} {p.attainment:>7.1%} "
            f"{r['p99_ttft_ms']:>9.1f} {r['p99_tpot_ms']:>9.1f} "
            f"{'-' if per_m is None else f'{per_m:.3f}':>8}  {mark.strip()}"
        )
    for what, why in planner.skipped.items():
        lines.append(f"{what}: skipped ({why})")
    return "\n".join(lines)


def plot_plan(planner: Planner, path) -> object:
    """Price per hour against attainment of every cluster simulated; the frontier joined and
    labelled."""
    from tandem.bench.plots import _pyplot, _save

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.8))
    probes = list(planner.probes.values())
    for label, colocated in (("colocated", True), ("prefill/decode", False)):
        mine = [p for p in probes if bool(p.layout.count) == colocated]
        ax.scatter([p.price_per_hour for p in mine], [p.attainment for p in mine], label=label,
                   alpha=0.6, s=18)  # fmt: skip
    front = planner.frontier()
    ax.plot([p.price_per_hour for p in front], [p.attainment for p in front], "k--", lw=1,
            label="frontier")  # fmt: skip
    for p in front:
        ax.annotate(p.layout.describe(), (p.price_per_hour, p.attainment), fontsize=7,
                    xytext=(4, -10), textcoords="offset points")  # fmt: skip
    ax.axhline(planner.target, color="grey", lw=0.8, label=f"target {planner.target:.0%}")
    ax.set_xlabel("$ per hour (assumed prices)")
    ax.set_ylabel("SLO attainment")
    ax.set_title("tandem sim plan (simulated)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="center right")
    fig.tight_layout()
    return _save(fig, path)


def _colocated(hw: str, tp: int, pp: int, ep: bool, n: int) -> Layout:
    return Layout(hw, tp, count=n, pp=pp, ep=ep)


def _disaggregated(prefill_hw: str, decode_hw: str, tp: int, pp: int, ep: bool, p: int, d: int) -> Layout:  # fmt: skip
    return Layout(prefill_hw, tp, prefill=p, decode=d, decode_hardware=decode_hw, pp=pp, ep=ep)
