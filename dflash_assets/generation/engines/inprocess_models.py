"""The in-process engine's model loading: one loaded model per (model, weights, device, dtype, cache, attention)
in the process, shared by the engines that run it, with the one worker thread that loaded it and runs all its
generate calls (compiled CUDA graphs keep per-thread state).

An engine closing leaves its model loaded while no other model is asked for, so the next shard's engine reuses the
weights and the compiled decode graphs (a new model per shard would compile every shape again);
``release_idle_models`` frees the idle ones.

Reads: a model directory (weights through ``target_model.loading``; its tokenizer through
``TargetModelSpec.chat()`` when no chat object is given). Writes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_assets.generation.chat_tokenizer import ChatTokenizer
from dflash_assets.generation.engines.protocol import _int_or_none


@dataclass
class _LoadedModel:
    """A model loaded in this process, shared by the in-process engines that run it, with the one thread that
    loaded it and runs all its generate calls (compiled CUDA graphs keep per-thread state)."""

    model: Any
    worker: ThreadPoolExecutor
    users: int = 0
    continuous: Any = None  # transformers' ContinuousBatchingManager (cache="continuous"), while an engine is open
    continuous_key: str = ""  # the sampling settings it was started with

    def stop_continuous(self) -> None:
        """Stop the continuous-batching manager (its requests in flight finish first) and free its cache."""
        if self.continuous is not None:
            manager, self.continuous, self.continuous_key = self.continuous, None, ""
            manager.stop(block=True)


# (model path, its weights' stamp, device, dtype, cache) -> the loaded model. An engine closing leaves its model
# loaded while no other model is asked for, so the next shard's engine reuses the weights and the compiled decode
# graphs (a new model per shard would compile every shape again).
_LOADED: dict[tuple[str, str, str, str, str], _LoadedModel] = {}
_LOADED_LOCK = threading.Lock()


def _weights_stamp(model_path: str) -> str:
    """Names, sizes and mtimes of a model directory's weight files: a model rebuilt in place is loaded anew."""
    path = Path(model_path)
    if not path.is_dir():
        return ""
    files = sorted(f for f in path.iterdir() if f.suffix in (".safetensors", ".bin", ".gguf"))
    return ";".join(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)


def release_idle_models(keep: tuple | None = None) -> int:
    """Drop the loaded models no engine uses (but `keep`), freeing their memory; returns how many were dropped."""
    with _LOADED_LOCK:
        idle = [k for k, m in _LOADED.items() if m.users == 0 and k != keep]
        dropped = [_LOADED.pop(k) for k in idle]
    for m in dropped:
        m.stop_continuous()
        m.worker.shutdown(wait=False)
    if dropped:
        import gc

        gc.collect()
        with contextlib.suppress(Exception):
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return len(dropped)


class SharedModel:
    """The in-process engine's part that opens, loads and releases its shared model (``TransformersEngine``)."""

    @property
    def _key(self) -> tuple[str, ...]:
        return (self.model_path, _weights_stamp(self.model_path), self.device, self.dtype, self.cache, self.attention)

    def _in_worker(self, fn, *args) -> asyncio.Future:
        assert self._loaded is not None, "open() the engine first"
        return asyncio.get_running_loop().run_in_executor(self._loaded.worker, fn, *args)

    async def open(self) -> None:
        if self.model is not None:
            return
        key = self._key
        release_idle_models(keep=key)  # one idle model at a time: free another before loading this one
        with _LOADED_LOCK:
            loaded = _LOADED.get(key)
            self.reused_model = loaded is not None
            if loaded is None:
                loaded = _LOADED[key] = _LoadedModel(
                    None, ThreadPoolExecutor(max_workers=1, thread_name_prefix="dflash-generate"))
            loaded.users += 1
        self._loaded, self._loaded_key = loaded, key
        try:
            await self._in_worker(self._load_once, loaded)
        except BaseException:
            self._release()
            raise
        self.model = loaded.model
        # the model's positions bound prompt + new tokens here, as SGLang's context length does there
        self.context_length = self.configured_context_length or _int_or_none(
            getattr(self.model.config, "max_position_embeddings", None))

    def _release(self) -> None:
        if self._loaded is not None:
            with _LOADED_LOCK:
                self._loaded.users -= 1
                if self._loaded.model is None and self._loaded.users == 0:  # the load failed: nothing to keep
                    _LOADED.pop(self._loaded_key, None)
                    self._loaded.worker.shutdown(wait=False)
            self._loaded = None

    def _load_once(self, loaded: _LoadedModel) -> None:
        """The tokenizer, and the model unless an engine opened before loaded it (on the worker thread, so two
        engines opening at once load it once)."""
        if self.tok is None:
            self.tok = ChatTokenizer(self._tokenizer or self._chat_from_model_dir())
        if loaded.model is None:
            loaded.model = self._load()

    def _chat_from_model_dir(self) -> Any:
        """No chat object given: the model directory's own tokenizer, through the target package (downloads as the
        model load may)."""
        from dflash_assets.target_model.spec import TargetModelSpec

        return TargetModelSpec(model_path=self.model_path, allow_download=True).chat()

    def _load(self) -> Any:
        """The model, on this engine's device and dtype (runs on the worker thread that will run its generates)."""
        import torch

        from dflash_assets.target_model.loading import load_causal_lm

        dtype = "auto" if self.dtype == "auto" else getattr(torch, self.dtype)
        model = load_causal_lm(self.model_path, dtype=dtype).to(self.device).eval()
        if self.attention == "packed_gqa":
            from dflash_assets.generation.packed_gqa import register

            model.set_attn_implementation(register())
        if self.cache == "static":
            from dflash_assets.torch_compile import allow_recompiles, apply_inductor_workarounds

            apply_inductor_workarounds()
            allow_recompiles()
        return model
