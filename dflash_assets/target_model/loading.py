"""Load a causal LM from a local directory, one load at a time per process.

`AutoModelForCausalLM.from_pretrained` is not thread-safe in Transformers 5: while it loads,
it swaps `PreTrainedModel.tie_weights` for a no-op on the class and puts it back afterwards.
Two loads on two threads (multi-device capture, in-process engines opened together) can
leave the no-op installed for good, and from then on every model with tied embeddings
(SmolLM2) loads with its `lm_head` left on the meta device. Every model load in
`dflash_assets` goes through `load_causal_lm`, which holds one process-wide lock and checks
that no weight was left unloaded.

Reads a model directory; writes nothing. Needs only torch and transformers.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

_LOAD_LOCK = threading.Lock()


class ModelLoadError(RuntimeError):
    """A model directory loaded with some weights still unset (on the meta device)."""


def load_causal_lm(path: str | Path, **kwargs: Any):
    """`AutoModelForCausalLM.from_pretrained(path, **kwargs)` under the process-wide load lock.

    Raises `ModelLoadError` naming the weights that no file held and nothing tied."""
    from transformers import AutoModelForCausalLM

    with _LOAD_LOCK:
        model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    unset = [name for name, p in model.named_parameters() if p.device.type == "meta"]
    if unset:
        shown = ", ".join(unset[:5]) + (f" and {len(unset) - 5} more" if len(unset) > 5 else "")
        tied = getattr(model.config, "tie_word_embeddings", False)
        raise ModelLoadError(
            f"{path}: {len(unset)} weight(s) were not in the checkpoint and not tied: {shown}"
            + (" (the config ties word embeddings: was another thread loading a model outside "
               "load_causal_lm at the same time?)" if tied else ""))
    return model
