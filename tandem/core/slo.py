"""SLO classes: a request's priority, its latency targets, and what to do with it when it can
no longer meet them. Classes come from a file (`--slo-classes`), a request picks one by name
(`slo_class`) or states its own targets (`ttft_ms`, `tpot_ms`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

OVERLOAD_ACTIONS = ("keep", "shed", "demote")


@dataclass(frozen=True)
class SLOClass:
    name: str = "default"
    priority: int = 0  # lower is more urgent, as vLLM's priority
    ttft_ms: float | None = None  # time to first token target
    tpot_ms: float | None = None  # time per output token target
    weight: float = 1.0  # a met request of this class counts this much in goodput
    on_overload: str = "keep"  # once its SLO cannot be met: keep it, shed it, or demote it

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"slo_class: name must be a non-empty string, got {self.name!r}")
        for field in ("ttft_ms", "tpot_ms"):
            value = getattr(self, field)
            if value is not None and not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"{field} must be a number > 0, got {value!r}")
        if not self.weight > 0:
            raise ValueError(f"weight must be > 0, got {self.weight!r}")
        if self.on_overload not in OVERLOAD_ACTIONS:
            raise ValueError(
                f"on_overload must be one of {OVERLOAD_ACTIONS}, got {self.on_overload!r}"
            )

    @property
    def has_targets(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None

    def with_targets(self, ttft_ms: float | None, tpot_ms: float | None, priority: int | None):
        """This class, with a request's own targets and priority where it gives them."""
        return replace(
            self,
            ttft_ms=self.ttft_ms if ttft_ms is None else ttft_ms,
            tpot_ms=self.tpot_ms if tpot_ms is None else tpot_ms,
            priority=self.priority if priority is None else priority,
        )


DEFAULT_CLASS = SLOClass()


def load_slo_classes(path: str | Path) -> dict[str, SLOClass]:
    """A JSON or YAML file: a list of classes (name, priority, ttft_ms, tpot_ms, weight,
    on_overload); one named "default" (or else the first) serves requests that name none."""
    text = Path(path).read_text()
    try:
        if str(path).endswith((".yaml", ".yml")):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as e:
        raise ValueError(f"slo_classes: cannot parse {str(path)!r}: {e}") from None
    if isinstance(data, dict) and "classes" in data:
        data = data["classes"]
    if not isinstance(data, list) or not data or not all(isinstance(c, dict) for c in data):
        raise ValueError(f"slo_classes: {str(path)!r} must hold a non-empty list of classes")
    classes = {}
    for entry in data:
        try:
            cls = SLOClass(**entry)
        except TypeError as e:
            raise ValueError(f"slo_classes: {entry!r}: {e}") from None
        classes[cls.name] = cls
    return classes


def default_class(classes: dict[str, SLOClass]) -> SLOClass:
    """The class of a request that names none: "default" if the file has it, else the first."""
    return classes.get("default") or next(iter(classes.values()), DEFAULT_CLASS)
