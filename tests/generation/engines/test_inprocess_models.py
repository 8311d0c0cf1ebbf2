"""The in-process engine's shared model: loaded and run on one worker thread, shared by the engines of one model,
loaded anew when the weights change, freed when idle."""

from __future__ import annotations

import asyncio
import os

from dflash_assets.generation.engines import GenerationConfig, TransformersEngine
from tests.generation.engines.support import run


def test_transformers_engine_loads_and_generates_on_one_worker_thread(tiny_dense_target, tok, monkeypatch):
    """Compiled CUDA graphs keep per-thread state: the load and every batch run on the engine's one thread."""
    import threading

    from dflash_assets.generation.engines import release_idle_models

    release_idle_models()  # loaded by an earlier test: this one sees the load

    threads = []
    for name in ("_load", "_generate"):
        original = getattr(TransformersEngine, name)

        def record(self, *args, _original=original):
            threads.append((threading.get_ident(), threading.current_thread().name.split("_")[0]))
            return _original(self, *args)

        monkeypatch.setattr(TransformersEngine, name, record)
    gen = GenerationConfig(max_new_tokens=3, temperature=0.0, enable_thinking=False)

    async def go():
        async with TransformersEngine(tiny_dense_target, tokenizer=tok, max_concurrency=1) as eng:
            await asyncio.gather(*(eng.chat([{"role": "user", "content": q}], gen) for q in ("a", "b", "c")))
            return eng.batch_sizes

    assert run(go()) == [1, 1, 1]
    assert len(threads) == 4 and set(threads) == {(threads[0][0], "dflash-generate")}  # the engine's own thread
    assert threads[0][0] != threading.get_ident()


def test_engines_of_one_model_share_its_load_and_thread(tiny_dense_target, tok, monkeypatch, tmp_path):
    """A second engine of the same model (the next shard's) reuses the loaded model, its compiled graphs and its
    thread; another model, or the same directory rebuilt, loads anew and frees the idle one."""
    import shutil

    from dflash_assets.generation.engines import inprocess_models

    inprocess_models.release_idle_models()
    loads = []
    original = TransformersEngine._load
    monkeypatch.setattr(TransformersEngine, "_load", lambda self: loads.append(self.model_path) or original(self))
    gen = GenerationConfig(max_new_tokens=3, temperature=0.0, enable_thinking=False)

    async def one(path):
        async with TransformersEngine(path, tokenizer=tok, max_concurrency=2) as eng:
            out = await eng.chat([{"role": "user", "content": "Hi"}], gen)
            return eng.reused_model, id(eng.model), out.content

    first, second = run(one(tiny_dense_target)), run(one(tiny_dense_target))
    assert loads == [str(tiny_dense_target)] and (first[0], second[0]) == (False, True)
    assert first[1] == second[1] and first[2] == second[2]
    copy = tmp_path / "copy"
    shutil.copytree(tiny_dense_target, copy)
    third = run(one(copy))
    assert loads == [str(tiny_dense_target), str(copy)] and not third[0] and third[2] == first[2]
    assert list(inprocess_models._LOADED) == [TransformersEngine(copy)._key]  # the idle first model was freed
    weights = next(copy.glob("*.safetensors"))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))  # rebuilt in place
    assert not run(one(copy))[0] and len(loads) == 3
    assert inprocess_models.release_idle_models() == 1 and not inprocess_models._LOADED
