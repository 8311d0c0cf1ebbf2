"""The one way this project reads a target's DFlash layers: forward hooks, and the decoder cut after the last one.

Used by the hidden-state cache (offline features), by online training and by
speculative decoding, so the three see identical features. Reads and writes
nothing; imports only torch.

Layer id ``i`` is the output of decoder layer ``i``, i.e. Hugging Face's
``hidden_states[i + 1]``. For the last layer (``i = L - 1``) that entry is the
final norm's output, not the raw layer output, so the hook for ``L - 1`` sits
on the final norm. With ``cut=True`` the decoder runs only up to the last
captured layer (no later layer, no final norm unless layer ``L - 1`` is
captured, no lm_head); the model is restored on exit.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from dflash_assets.target_model.conventions import text_config  # re-exported: hidden_states and bench use it from here

__all__ = ["LayerCapture", "decoder_stack", "text_config"]


def decoder_stack(model: nn.Module) -> tuple[nn.Module, nn.ModuleList]:
    """The base text model (it has ``embed_tokens``, ``layers`` and ``norm``) and its decoder layers."""
    inner = getattr(model, "model", None)
    candidates = [model, inner, getattr(inner, "language_model", None) if inner is not None else None]
    for m in candidates:
        if m is not None and isinstance(getattr(m, "layers", None), nn.ModuleList) and hasattr(m, "embed_tokens"):
            return m, m.layers
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")


class LayerCapture:
    """Context manager: hooks on the chosen layers, optionally the decoder cut after the last one.

    Two ways to receive the features:
    - set ``.target`` to a [tokens, n_layers*H] tensor before a forward: each
      hook copies its layer's output (rows in flattened batch order) into
      columns ``j*H:(j+1)*H`` (the cache's zero-copy path);
    - leave ``.target`` as None and call ``features()`` after a forward: the
      layers' outputs concatenated on the last dimension, (b, T, n_layers*H).
    """

    def __init__(self, model: nn.Module, layer_ids: Sequence[int], *, cut: bool = True):
        self.model = model
        self.text_model, self.layers = decoder_stack(model)
        self.layer_ids = [int(i) for i in layer_ids]
        n = len(self.layers)
        if not self.layer_ids or not all(0 <= i < n for i in self.layer_ids):
            raise ValueError(f"layer ids {self.layer_ids} out of range for {n} decoder layers")
        self.hidden_size = int(text_config(model.config).hidden_size)
        self.cut = cut
        self.target: torch.Tensor | None = None
        self._outputs: dict[int, torch.Tensor] = {}
        self._handles: list[Any] = []
        self._saved: dict[str, nn.Module] = {}

    def _hook(self, slot: int) -> Callable:
        H = self.hidden_size

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            out = output[0] if isinstance(output, tuple) else output
            if self.target is not None:
                self.target[:, slot * H:(slot + 1) * H].copy_(out.reshape(-1, H))
            else:
                self._outputs[slot] = out

        return hook

    def features(self) -> torch.Tensor:
        """The captured layers of the last forward, concatenated: (..., T, n_layers*H)."""
        out = torch.cat([self._outputs[slot] for slot in range(len(self.layer_ids))], dim=-1)
        self._outputs.clear()
        return out

    def __enter__(self) -> LayerCapture:
        n = len(self.layers)
        last = max(self.layer_ids)
        try:
            for slot, lid in enumerate(self.layer_ids):
                # HF's hidden_states[n] is the final norm's output, not the last layer's.
                module = self.text_model.norm if lid == n - 1 else self.layers[lid]
                self._handles.append(module.register_forward_hook(self._hook(slot)))
            if self.cut and last < n - 1:
                self._saved = {"layers": self.layers, "norm": self.text_model.norm}
                self.text_model.layers = self.layers[: last + 1]  # no later layer runs
                self.text_model.norm = nn.Identity()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for name, module in self._saved.items():
            setattr(self.text_model, name, module)
        self._saved = {}
        self._outputs.clear()
        self.target = None
