"""Resumable training state: ``state/step-NNNNNNNN/`` (safetensors + JSON, no pickle) and ``state/latest``.

Writes a state directory atomically (temp dir, every file and the directory
fsynced, then renamed; ``latest`` replaced last), prunes older states, and
reads the newest complete one back. Imports torch and safetensors.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash_assets.atomic_write import write_atomic
from dflash_assets.drafter.model import _atomic_dir, _swap_into_place, drafter_state_dict

__all__ = ["save_training_state", "latest_state_dir", "load_training_state"]


# ----------------------------------------------------------------------------------------------
# Training state: safetensors + json, atomic, no pickle


def _rng_state() -> dict[str, Any]:
    py = random.getstate()
    npst = np.random.get_state()
    st = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [npst[0], npst[1].tolist(), int(npst[2]), int(npst[3]), float(npst[4])],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state().tolist()
    return st


def _set_rng_state(st: dict[str, Any]):
    random.setstate((st["python"][0], tuple(st["python"][1]), st["python"][2]))
    n = st["numpy"]
    np.random.set_state((n[0], np.asarray(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    torch.set_rng_state(torch.tensor(st["torch"], dtype=torch.uint8))
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(st["cuda"], dtype=torch.uint8))


def save_training_state(state_root: Path, step: int, drafter, optimizer, scheduler, trainer: dict[str, Any],
                        history: dict[str, torch.Tensor], keep: int = 2) -> Path:
    """Write state/step-NNNNNNNN atomically, point state/latest at it, prune older states."""
    from safetensors.torch import save_file

    dest = state_root / f"step-{step:08d}"
    tmp = _atomic_dir(dest)
    try:
        save_file({k: v.float().cpu().contiguous() for k, v in drafter_state_dict(drafter).items()},
                  str(tmp / "drafter.safetensors"))
        names = {id(p): n for n, p in _unwrap(drafter).named_parameters()}
        opt = optimizer.state_dict()
        params = [p for g in optimizer.param_groups for p in g["params"]]
        tensors = {}
        for idx, st in opt["state"].items():
            name = names[id(params[idx])]
            for k, v in st.items():
                tensors[f"{name}::{k}"] = torch.as_tensor(v).detach().cpu().contiguous()
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        save_file({k: v.contiguous() for k, v in history.items()}, str(tmp / "history.safetensors"))
        groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"}
                  for g in opt["param_groups"]]
        doc = {**trainer, "step": step, "optimizer_param_groups": groups,
               "scheduler": scheduler.state_dict(), "rng": _rng_state()}
        (tmp / "trainer.json").write_text(json.dumps(doc))
        _swap_into_place(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    write_atomic(state_root / "latest", dest.name)
    for old in sorted(state_root.glob("step-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return dest


def latest_state_dir(state_root: Path) -> Path | None:
    p = state_root / "latest"
    if p.exists() and (state_root / p.read_text().strip() / "trainer.json").exists():
        return state_root / p.read_text().strip()
    done = [d for d in sorted(state_root.glob("step-*")) if (d / "trainer.json").exists()]
    return done[-1] if done else None


def load_training_state(state_dir: Path, drafter, optimizer, scheduler, device) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    doc = json.loads((state_dir / "trainer.json").read_text())
    _unwrap(drafter).load_state_dict(load_file(str(state_dir / "drafter.safetensors"), device=str(device)), strict=True)
    flat = load_file(str(state_dir / "optimizer.safetensors"), device="cpu")
    index = {n: i for i, (n, _) in enumerate(_unwrap(drafter).named_parameters())}
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in flat.items():
        name, k = key.split("::")
        state.setdefault(index[name], {})[k] = t
    groups = [{**g, "params": list(range(len(index)))} for g in doc["optimizer_param_groups"]]
    for g in groups:
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    scheduler.load_state_dict(doc["scheduler"])
    _set_rng_state(doc["rng"])
    history = load_file(str(state_dir / "history.safetensors"))
    return doc, history


def _unwrap(m):
    m = getattr(m, "module", m)
    return getattr(m, "_orig_mod", m)

