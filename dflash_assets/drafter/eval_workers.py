"""Speculative decoding of held-out prompts over several processes of one host, each holding its own target.

Greedy decoding at batch 1 is bound by the host that launches the kernels rather than by the device: on an H200
a verification of SmolLM2-135M in float32 takes ~49 ms (BENCHMARKS.md), far more than the arithmetic
of 16 tokens through a 135M model, and tau on 64 prompts is 225 s of a 415 s evaluation. Workers decode one
prompt each at a time, so the device serves several of them (how many pays is `bench/eval_workers.py`'s
question). Every prompt is still decoded on its own (`SpeculativeDecoder.generate`), so the rows,
tau and the lossless check are those of `decoding.evaluate_drafter`; only the wall time changes.

Reads: the target model directory (each worker loads it once) and drafter checkpoint directories
(`model.safetensors` + `config.json`; a worker reloads one when its weights file changes). Writes nothing.
Prompts go to the workers and rows come back as JSON text.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any, Callable, Sequence

from dflash_assets.drafter.decoding import EvalPrompt, EvalResult, result_from_rows

__all__ = ["EvalWorkers"]

_WORKER: dict[str, Any] = {}  # in a worker process: its target, and the drafter it loaded last


def _host_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _load_target_in_worker(target_dir: str, device: str | None, dtype: str | None, threads: int) -> None:
    import torch

    from dflash_assets.drafter.decoding import load_target

    torch.set_num_threads(threads)  # the host's CPUs shared out, not each worker taking all of them
    _WORKER["target"] = load_target(target_dir, device, dtype)


def _drafter_in_worker(drafter_dir: str) -> Any:
    from dflash_assets.drafter.model import load_drafter

    weights = Path(drafter_dir, "model.safetensors").stat()
    key = (drafter_dir, weights.st_mtime_ns, weights.st_size)
    if _WORKER.get("drafter_key") != key:
        target = _WORKER["target"]
        param = next(target.parameters())
        _WORKER["drafter"] = load_drafter(drafter_dir, device=param.device, dtype=param.dtype)
        _WORKER["drafter_key"] = key
    return _WORKER["drafter"]


def _wait_for_all_workers(arrivals: str, workers: int, timeout_s: float) -> int:
    """Mark this worker arrived, then wait until `workers` have: no worker takes two of `start`'s tasks."""
    Path(arrivals, str(os.getpid())).touch()
    deadline = time.monotonic() + timeout_s
    while len(os.listdir(arrivals)) < workers:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(os.listdir(arrivals))} of {workers} evaluation workers started in {timeout_s} s")
        time.sleep(0.05)
    return os.getpid()


def _decode_in_worker(drafter_dir: str, prompt_json: str, max_new_tokens: int, stop_token_ids: list[int],
                      check_lossless: bool) -> str:
    from dflash_assets.drafter.decoding import evaluate_drafter

    p = json.loads(prompt_json)
    prompt = EvalPrompt(tuple(p["input_ids"]), p["category"], p["prompt_id"], tuple(p["slices"]))
    result = evaluate_drafter(_drafter_in_worker(drafter_dir), _WORKER["target"], [prompt],
                              max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids,
                              check_lossless=check_lossless)
    return json.dumps({"row": result.per_prompt[0], "counts": result.acceptance_length_counts})


class EvalWorkers:
    """`workers` processes, each with the target of `target_dir` loaded in `decoding.evaluation_dtype(device,
    dtype)`, that decode prompts speculatively for `evaluate`. Use as a context manager; the processes end at
    its exit."""

    def __init__(self, target_dir: str | Path, workers: int, *, device: str | None = None,
                 dtype: str | None = None):
        from dflash_assets.drafter.decoding import evaluation_dtype

        if workers < 1:
            raise ValueError(f"workers must be at least 1, not {workers}")
        # resolved (and a bad name refused) here, once: every worker gets the same dtype, by name
        dtype = str(evaluation_dtype(device, dtype)).removeprefix("torch.")
        self.dtype = dtype
        self.workers = workers
        threads = max(1, _host_cpus() // workers)
        # spawn: a forked child of a process that has used CUDA cannot use it
        self._pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                         initializer=_load_target_in_worker,
                                         initargs=(str(target_dir), device, dtype, threads))

    def start(self, timeout_s: float = 600.0) -> None:
        """Start every worker and load its target now (else they start with the first prompts)."""
        import tempfile

        with tempfile.TemporaryDirectory(prefix="dflash-eval-workers-") as arrivals:
            futures = [self._pool.submit(_wait_for_all_workers, arrivals, self.workers, timeout_s)
                       for _ in range(self.workers)]
            try:
                pids = {f.result() for f in futures}
            except BrokenProcessPool as e:
                raise RuntimeError(f"an evaluation worker died while loading the target (of {self.workers})") from e
        assert len(pids) == self.workers, pids

    def __enter__(self) -> "EvalWorkers":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def evaluate(self, drafter_dir: str | Path, prompts: Sequence[EvalPrompt], *, max_new_tokens: int = 256,
                 stop_token_ids: Sequence[int] = (), check_lossless: bool = True,
                 on_prompt: Callable[[int, dict[str, Any]], None] | None = None) -> EvalResult:
        """`decoding.evaluate_drafter` of the checkpoint in `drafter_dir` over the workers: the same rows, in
        prompt order. `on_prompt(i, row)` is called as each prompt finishes (in the order they finish)."""
        t0 = time.perf_counter()
        stop = [int(t) for t in stop_token_ids]
        futures = {
            self._pool.submit(_decode_in_worker, str(drafter_dir),
                              json.dumps({"input_ids": list(p.input_ids), "category": p.category,
                                          "prompt_id": p.prompt_id, "slices": list(p.slices)}),
                              max_new_tokens, stop, check_lossless): i
            for i, p in enumerate(prompts)}
        rows: list[dict[str, Any] | None] = [None] * len(prompts)
        lengths: Counter = Counter()
        try:
            for future in as_completed(futures):
                i = futures[future]
                out = json.loads(future.result())
                rows[i] = out["row"]
                lengths.update({n: c for n, c in enumerate(out["counts"]) if c})
                if on_prompt is not None:
                    on_prompt(i, out["row"])
        except BrokenProcessPool as e:
            raise RuntimeError(f"an evaluation worker died (of {self.workers}; out of memory?): evaluate with "
                               "fewer workers") from e
        finally:
            for future in futures:
                future.cancel()
        return result_from_rows([r for r in rows if r is not None], lengths, time.perf_counter() - t0)
