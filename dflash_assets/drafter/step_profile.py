"""Where a training step's time goes: ``torch.profiler`` over a window of steps of a real run.

:class:`StepProfiler` wraps steps ``start + 1 .. stop`` of ``train_drafter``'s loop (the loader, the target's
forward when training online, the drafter's step, the per-step metrics): it reports the wall time per step, the
time the device was busy (the kernels' own time; the rest is the host feeding it: launches, syncs, collation),
and the kernels that take it, largest first. ``summary()`` is what ``TrainResult.profile`` holds.

Reads nothing; writes nothing (the caller stores the summary).
"""

from __future__ import annotations

import time
from typing import Any

import torch

__all__ = ["StepProfiler", "parse_step_window"]


def parse_step_window(text: str) -> tuple[int, int]:
    """``"300:320"`` -> (300, 320): profile the steps after step 300 up to step 320."""
    try:
        start, stop = (int(v) for v in text.split(":"))
    except ValueError as e:
        raise ValueError(f"{text!r} is not a step window START:STOP (e.g. 300:320)") from e
    if not 0 <= start < stop:
        raise ValueError(f"step window {text!r}: START must be >= 0 and below STOP")
    return start, stop


class StepProfiler:
    """Profiles the steps after ``start`` up to ``stop`` (global step numbers, as the log counts them)."""

    def __init__(self, start: int, stop: int, device: torch.device, top: int = 25):
        self.start, self.stop, self.device, self.top = start, stop, device, top
        self._prof: Any = None
        self._t0 = 0.0
        self._summary: dict[str, Any] | None = None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def before_step(self, step: int) -> None:
        """Call with the step about to run (the last finished step + 1)."""
        if self._prof is None and self._summary is None and step == self.start + 1:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self._sync()
            self._prof = profile(activities=activities)
            self._prof.__enter__()
            self._t0 = time.perf_counter()

    def after_step(self, step: int, last: bool = False) -> None:
        """Call with the step just finished; ``last``: the run stops here (a window cut short ends with it)."""
        if self._prof is not None and (step >= self.stop or last):
            self._sync()
            wall = time.perf_counter() - self._t0
            self._prof.__exit__(None, None, None)
            self._summary = self._summarize(self._prof, wall, step - self.start)
            self._prof = None

    def _summarize(self, prof: Any, wall_s: float, steps: int) -> dict[str, Any]:
        cuda = self.device.type == "cuda"
        attr = "self_device_time_total" if cuda else "self_cpu_time_total"
        kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
        events = [e for e in prof.key_averages() if getattr(e, attr, 0) > 0 and (not cuda or e.device_type == kind)]
        busy_ms = sum(getattr(e, attr) for e in events) / 1e3 / steps
        wall_ms = wall_s * 1e3 / steps
        events.sort(key=lambda e: getattr(e, attr), reverse=True)
        return {"steps": [self.start + 1, self.start + steps], "wall_ms_per_step": round(wall_ms, 2),
                "busy_ms_per_step": round(busy_ms, 2), "busy_share": round(busy_ms / wall_ms, 4) if wall_ms else None,
                "kernels": [{"name": e.key[:160], "ms_per_step": round(getattr(e, attr) / 1e3 / steps, 3),
                             "calls_per_step": round(e.count / steps, 1)} for e in events[:self.top]]}

    def summary(self) -> dict[str, Any] | None:
        """The window's figures once it closed (its ``steps`` say which ran), else None (the run never reached it)."""
        return self._summary
