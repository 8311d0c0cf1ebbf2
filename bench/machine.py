"""What machine a benchmark ran on, in one shape for every `bench/` script (stdlib only; reads /proc/cpuinfo).

`machine_info("torch", "pyarrow")` gives the CPU model, logical and usable
cores, load average at the call, platform, Python, and the installed versions
of the named packages (absent ones are reported as None). Benchmarks put it
under the "machine" key of the JSON they print. `gpu_info()` gives the torch
and CUDA versions and the visible GPUs' name and count (under "gpu"); it
imports torch only when called, so this module imports on a GPU host that has
only torch (and on one without it). `print_report(report, out)` prints a
benchmark's JSON and writes it to `out` atomically (the only write here, through
`dflash_assets.atomic_write`).
"""

from __future__ import annotations

import json
import os
import platform
from importlib import metadata
from pathlib import Path

__all__ = ["machine_info", "cpu_model", "gpu_info", "print_report"]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def machine_info(*packages: str) -> dict:
    return {
        "cpu": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "loadavg_1_5_15": [round(x, 2) for x in os.getloadavg()],
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {p: _version(p) for p in packages},
    }


def gpu_info() -> dict:
    """torch's and its CUDA build's versions, the first visible GPU's name and how many are visible.

    ``{"torch": None, "cuda": None, "gpu": None, "gpus_visible": 0}`` without torch;
    ``gpu`` None and ``gpus_visible`` 0 where no CUDA device is usable.
    """
    try:
        import torch
    except ImportError:
        return {"torch": None, "cuda": None, "gpu": None, "gpus_visible": 0}
    available = torch.cuda.is_available()
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0) if available else None,
        "gpus_visible": torch.cuda.device_count() if available else 0,
    }


def print_report(report: dict, out: str | None = None) -> None:
    """Print `report` as indented JSON and, given `out`, write the same text there atomically (a temporary file
    beside it, then a rename: a killed run leaves the old report or the new one)."""
    text = json.dumps(report, indent=1, default=str)
    print(text, flush=True)
    if out:
        import sys

        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the library's one atomic writer
        from dflash_assets.atomic_write import write_atomic

        write_atomic(out, text + "\n")
