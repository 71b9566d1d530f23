"""The engine core process's control calls (RL's: weight updates, pause and resume, sleep,
cache resets), by name, as `AsyncLLM.call_core` sends them (messages.UtilityCall).

Each runs between two steps. A slow one (reading a checkpoint, a trainer's rendezvous, its
broadcast) returns (work, finish): the process runs `work` on its loader thread while steps
go on, then `finish(work's result)` on the loop, which writes what the work prepared.
"""

from __future__ import annotations

from collections.abc import Callable


class ControlCalls:
    """core: the EngineCore; emit: sends outputs with the call's answer (aborted requests'
    ends)."""

    def __init__(self, core, emit: Callable[[list], None]) -> None:
        self.core, self.emit = core, emit
        self.weight_group = None  # a trainer's torch.distributed group (runner/weight_sync.py)
        self.joining = False  # ... while it is being joined
        self._calls = {
            "pause": self.pause,
            "resume": self.resume,
            "reset_prefix_cache": self.reset_prefix_cache,
            "destroy_weights_update_group": self.destroy_group,
            "sleep": self.sleep,
            "wake_up": self.wake_up,
        }
        self._slow = {
            "update_weights_from_disk": self.from_disk,
            "init_weights_update_group": self.init_group,
            "update_weights_from_distributed": self.from_distributed,
        }

    def slow(self, method: str) -> Callable | None:
        return self._slow.get(method)

    def call(self, method: str, args: dict):
        handler = self._calls.get(method)
        if handler is None:
            raise ValueError(f"method: no control call {method!r}")
        return handler(**args)

    # ---- weights ---------------------------------------------------------------------
    def update_weights(self, prepared, weight_version=None, flush_cache=True, recompute_kv=False):
        count = self.core.update_weights(prepared, weight_version, flush_cache, recompute_kv)
        return {"weight_version": self.core.weight_version, "num_tensors": count}

    def from_disk(self, model_path: str, **update):
        """Read, check and quantize off the loop; write between steps."""
        runner = self.core.runner
        return (
            lambda: runner.prepare_weights(runner.read_weights(model_path)),
            lambda prepared: self.update_weights(prepared, **update),
        )

    def init_group(self, timeout_s: float = 300.0, group_name: str = "", **where):
        """Join the trainer's rendezvous off the loop."""
        from tandem.runner.weight_sync import WeightSyncGroup

        if self.weight_group is not None or self.joining:
            raise ValueError("a weight update group is open already: destroy it first")
        self.core.runner.weight_updater()  # refused here, before the trainer waits on us
        self.joining = True

        def join():
            try:
                return WeightSyncGroup(**where, timeout_s=timeout_s)
            finally:
                self.joining = False

        def joined(group):
            self.weight_group = group
            return {"rank": group.rank}

        return join, joined

    def from_distributed(self, names, dtypes, shapes, **update):
        """Receive every tensor off the loop, each layer quantized (or repacked) as soon as
        its tensors have come; write between steps."""
        group = self.weight_group
        if group is None:
            raise ValueError("no weight update group: call init_weights_update_group first")
        runner = self.core.runner

        def receive():
            preparation = runner.weight_preparation()
            try:
                group.receive(names, dtypes, shapes, on_tensor=preparation.add)
            except BaseException:
                preparation.close()
                if group.broken:
                    self.weight_group = None  # torn down by the failure
                raise
            return runner.prepared(preparation)

        return receive, lambda prepared: self.update_weights(prepared, **update)

    def destroy_group(self) -> dict:
        if self.weight_group is None:
            raise ValueError("no weight update group is open")
        group, self.weight_group = self.weight_group, None
        group.close()
        return {}

    # ---- generation --------------------------------------------------------------------
    def pause(self, mode: str, recompute_kv: bool = False) -> dict:
        outputs = self.core.pause(mode)
        if recompute_kv:  # SGLang's "retract": held requests compute their KV anew after
            self.core.scheduler.preempt_running()
        self.emit(outputs)  # the aborted requests' ends go out with the answer
        return {"num_aborted": len(outputs), "num_held": self.core.scheduler.num_running}

    def resume(self) -> dict:
        self.core.resume()
        return {}

    def reset_prefix_cache(self) -> dict:
        return {"freed_blocks": self.core.reset_prefix_cache()}

    def sleep(self, level: int) -> dict:
        return self.core.sleep(level)

    def wake_up(self) -> dict:
        return self.core.wake_up()
