"""LoRA adapters over HTTP, as vLLM: each loaded adapter is a model name (in /v1/models, and
selected by a request's `model`), loaded with --lora-modules at start or POST
/v1/load_lora_adapter, removed with POST /v1/unload_lora_adapter."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from tandem.server.errors import bad_request, not_found


@dataclass(frozen=True)
class Adapter:
    name: str
    lora_id: int
    path: str


class LoRARegistry:
    def __init__(self, engine, enabled: bool) -> None:
        self.engine, self.enabled = engine, enabled
        self.adapters: dict[str, Adapter] = {}
        self._loading: set[str] = set()  # names whose load is under way
        self._ids = itertools.count(1)

    def lora_id(self, name: str) -> int | None:
        adapter = self.adapters.get(name)
        return adapter.lora_id if adapter else None

    async def load(self, name: str, path: str, reserved: list[str]) -> Adapter:
        """Load an adapter under a new name (not a served model name, not an adapter's)."""
        if not self.enabled:
            raise bad_request("LoRA is not enabled on this server (start it with --enable-lora)")
        if name in self.adapters or name in reserved or name in self._loading:
            raise bad_request(f"The lora adapter '{name}' has already been loaded.", "lora_name")
        adapter = Adapter(name, next(self._ids), path)
        self._loading.add(name)
        try:
            await self.engine.load_lora(adapter.lora_id, path)
        except ValueError as e:
            raise bad_request(str(e), "lora_path") from None
        finally:
            self._loading.discard(name)
        self.adapters[name] = adapter
        return adapter

    async def unload(self, name: str) -> None:
        adapter = self.adapters.get(name)
        if adapter is None:
            raise not_found(f"The lora adapter '{name}' cannot be found.", "lora_name")
        try:
            await self.engine.unload_lora(adapter.lora_id)
        except ValueError as e:
            raise bad_request(str(e), "lora_name") from None
        del self.adapters[name]


def parse_lora_modules(items: list[str] | None) -> list[tuple[str, str]]:
    """--lora-modules entries: name=path, or vLLM's JSON {"name": ..., "path": ...}."""
    import json

    modules = []
    for item in items or []:
        if item.lstrip().startswith("{"):
            try:
                spec = json.loads(item)
                modules.append((spec["name"], spec["path"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(
                    f'--lora-modules: {item!r} is not {{"name", "path"}} JSON'
                ) from None
        elif "=" in item:
            name, path = item.split("=", 1)
            modules.append((name, path))
        else:
            raise ValueError(f"--lora-modules: {item!r} is not name=path")
    return modules
