"""Benchmark: generation through the completions stage against the slot decoder alone, and the decode ceiling.

One process, one loaded target (SmolLM2-135M-Instruct from its GGUF unless ``--target`` names a model dir), the
same real ShareGPT prompts (the first ``--prompts`` valid ones of the packaged file), greedy, ``--max-new-tokens``
per turn:

- ``engine``: the first user turn of every prompt rendered with the chat template and handed to
  ``generation.slot_decoding.SlotDecoder`` directly (no fleet, no asyncio): the engine alone, as the engine
  builds and steps its decoders (each step over the positions view that holds its longest row; the main and the
  long slots side by side, each on a CUDA stream of its own);
- ``engine_in_turn`` (``--variants in_turn``): the same with the decoders stepped one after another;
- ``engine_row_lengths`` (``--variants row_lengths``, CUDA, ``packed_gqa``): the same with ``row_lengths=True``:
  each row attending over its own length through a flex block mask instead of the positions view;
- ``stage``: ``completions``' stage function (``generation.completions.regenerate_shard``) over the same prompts,
  one turn each, through ``TransformersEngine(cache="slots")``: the stage at the engine's settings, so
  ``stage / engine`` is what the stage costs; both clocks start with the decoders built and their graphs
  captured (``prepare_s``: that one-time cost of the stage's engine; ``tokens_per_s_with_prepare`` counts it);
- ``stage_turns``: the same with ``--max-turns`` turns (a conversation's next turn joins the running slots);
- ``stage_switch_interval`` (``--switch-interval S``): the stage again with Python's thread switch interval at S
  seconds (``sys.setswitchinterval``; 0.005 by default), as a test of how much the stage's loop thread (rendering,
  tokenizing, journaling) holds the decoders' worker thread off the GIL;
- ``stage_in_flight`` (``--in-flight N``): the stage again with N requests in flight on the engine (its
  ``max_concurrency``) instead of the slots cache's default, a whole shard (``fleet.SLOTS_IN_FLIGHT``): e.g. twice
  the main slots, where the long prompts reach their tiers as the fleet's input order brings them rather than at
  the start;
- ``stage_prompts_one_by_one`` (``--prompts-one-by-one``): the stage again with each prompt encoded alone on the
  event loop (the tokenizer holding the GIL for each, as the worker thread's prefills wait) instead of each pass's
  prompts together off the GIL (``engines.prompt_encoder``);
- ``ceiling``: the main decoder's captured decode step replayed alone, per (rows, positions) view it ran at:
  rows / step time is what the step could make if every row it computes were always live and nothing else ran
  (rows of their own length: every row at the run's mean position);
- ``static`` (``--static-prompts N``): the stage through ``cache="static"`` (one padded ``generate`` per batch) on
  the first N prompts, the path the slots replace.

Prints one JSON object (also to ``--out``): per mode the wall time, new tokens and tokens/s, the slot decoder's
steps, prefills and occupancy, and the machine with its GPU.

    python bench/stage_generation.py --prompts 8192 --max-new-tokens 256 --out stage_generation.json   # CUDA GPU

Reads: the model (or the GGUF), the packaged ShareGPT file. Writes a scratch store under a temporary directory.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import gpu_info, machine_info, print_report  # noqa: E402


def log(message: str) -> None:
    print(f"[stage_generation] {message}", file=sys.stderr, flush=True)


def prompts_table(root: Path, limit: int):
    """The first `limit` valid prompts of the packaged ShareGPT file, as one raw_prompts shard."""
    from dflash_assets.prompts.config import IngestConfig
    from dflash_assets.prompts.ingest import ingest_prompt_source
    from dflash_assets.prompts.shards import materialize_prompt_shard
    from dflash_assets.prompts.sources import embedded_sharegpt_path
    from dflash_assets.store import layout
    from dflash_assets.store.backends import LocalStore

    store = LocalStore(root / "prompts")
    report = ingest_prompt_source(embedded_sharegpt_path(), store,
                                  IngestConfig(limit=limit, max_prompts_per_shard=limit))
    shard = report.shard_keys[0]
    materialize_prompt_shard(store, shard)
    return store.read_parquet(layout.raw_prompts(shard)), shard


def slots_for(args, model) -> int:
    from dflash_assets.generation.slot_decoding import kv_bytes_per_position, slots_for_memory

    if args.slots:
        return args.slots
    if args.device != "cuda":
        return 32
    import torch

    return slots_for_memory(kv_bytes_per_position(model), args.slot_len, torch.cuda.get_device_properties(0).total_memory,
                            share=args.memory_share)


def engine_alone(args, engine, table, overlap: bool | None = None, **options) -> tuple[dict, list]:
    """Every prompt's first turn through the engine's slot decoders (built as the engine builds them, with
    `options`), stepped on this thread as the engine steps them (side by side on streams of their own, or in turn
    with `overlap` False): the engine without the stage."""
    from dflash_assets.generation.slot_decoding import SlotDecoder, SlotRequest
    from dflash_assets.generation.slot_scheduler import give_streams, step_each

    stop = sorted(engine.tok.stop_ids)
    warm = SlotDecoder(engine.model, slots=8, slot_len=args.slot_len, pad_id=min(stop))  # kernels' first-call cost
    for row in table.slice(0, 8).to_pylist():
        warm.submit(SlotRequest(engine.tok.prompt_ids([{"role": "user", "content": row["user_turns"][0][:200]}],
                                                      args.thinking, None), 4, stop))
    warm.run()
    del warm
    decoders = engine.slot_decoders(**options)
    capture_s = sum(d.capture_views() for d in decoders)  # graphs (and flex compiles) before the clock starts
    overlap = engine.slot_overlap if overlap is None else overlap
    if overlap:
        give_streams(decoders)
    done = []
    skipped = 0
    for row in table.to_pylist():
        messages = ([{"role": "system", "content": row["system"]}] if row.get("system") else []) + \
            [{"role": "user", "content": row["user_turns"][0]}]
        ids = engine.tok.prompt_ids(messages, args.thinking, None)
        fits = [d for d in decoders if len(ids) + args.max_new_tokens <= d.slot_len]
        if not fits:
            skipped += 1
            continue
        fits[0].submit(SlotRequest(ids, args.max_new_tokens, stop,
                                   deliver=lambda r, new, finish: done.append(len(new))))
    sync = _synchronize(args.device)
    sync()
    t0 = time.perf_counter()
    while busy := [d for d in decoders if not d.idle()]:
        step_each(busy, overlap=overlap)
    sync()
    wall = time.perf_counter() - t0
    tokens = sum(done)
    return ({"wall_s": round(wall, 2), "answers": len(done), "skipped_too_long": skipped, "new_tokens": tokens,
             "tokens_per_s": round(tokens / wall, 1),
             "row_lengths": decoders[0].row_lengths, "overlap": overlap, "capture_s": round(capture_s, 1),
             "decoders": [{"slot_len": d.slot_len, **d.stats.as_dict(d.slots)} for d in decoders]}, decoders)


def _synchronize(device: str):
    if device == "cuda":
        import torch

        return torch.cuda.synchronize
    return lambda: None


def ceiling(decoders, device: str, repeats: int = 20) -> dict:
    """Each captured (rows, positions) view's decode step replayed alone: ms per step and rows / step time."""
    if device != "cuda":
        return {}
    import torch

    out = {}
    decoder = decoders[0]  # the many short slots: where the tokens are made
    position = round(decoder.stats.as_dict(decoder.slots)["mean_position"])
    for (rows, view), (graph, _) in sorted(decoder.graphs.items()):
        if decoder.row_lengths:
            decoder.cache.positions[:rows] = position
        graph.replay()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(repeats):
            graph.replay()
        torch.cuda.synchronize()
        step = (time.perf_counter() - t0) / repeats
        out[f"{rows}x{view}"] = {"rows": rows, "positions": view, "step_ms": round(step * 1e3, 3),
                                 "tokens_per_s": round(rows / step, 1)}
        if decoder.row_lengths:
            out[f"{rows}x{view}"]["every_row_at"] = position
            decoder.cache.positions.zero_()
    return out


def stage(args, table, shard: str, root: Path, engine, spec, tok, turns: int, name: str = "") -> dict:
    """``regenerate_shard`` over `table` through `engine` (already open), in a scratch store of its own."""
    from dflash_assets.generation.completions import regenerate_shard
    from dflash_assets.generation.config import GenerationConfig
    from dflash_assets.generation.fleet import EndpointConfig, EngineFleetConfig
    from dflash_assets.store.backends import LocalStore

    generation = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=0.0, top_p=1.0, top_k=None,
                                  max_turns=turns, enable_thinking=args.thinking)
    fleet = EngineFleetConfig(target_model=spec.model_path, endpoints=[EndpointConfig(
        url=engine.url, kind="transformers", device=args.device, dtype=engine.dtype, cache=engine.cache,
        max_concurrency=engine.max_concurrency, max_batch_rows=engine.max_batch_rows,
        max_batch_tokens=engine.max_batch_tokens, slot_len=engine.slot_len, attention=engine.attention,
        slot_tiers=engine.slot_tiers)])
    # a store of its own per mode: no mode resumes another's completions
    store = LocalStore(root / f"stage-{engine.cache}-{turns}{name}")
    prepare_s = asyncio.run(engine.prepare_slots())  # decoders built and captured, as engine alone before its clock
    batches_before = dict(engine.prompt_encoder.batches) if engine.prompt_encoder is not None else {}
    sync = _synchronize(args.device)
    sync()
    t0 = time.perf_counter()
    result = regenerate_shard(table, shard=shard, store=store, fleet=fleet, generation=generation, tokenizer=tok,
                              engines=[engine], progress=lambda update: log(f"{engine.cache} x{turns}: {update}"))
    sync()
    wall = time.perf_counter() - t0
    tokens = result.stats.completion_tokens
    report = {"wall_s": round(wall, 2), "turns": turns, "conversations": table.num_rows, "new_tokens": tokens,
              "tokens_per_s": round(tokens / wall, 1), "prepare_s": round(prepare_s, 1),
              "tokens_per_s_with_prepare": round(tokens / (wall + prepare_s), 1)}
    if engine.prompt_encoder is not None:  # how the prompts were encoded: passes together / one by one
        report["prompt_batches"] = {k: v - batches_before.get(k, 0) for k, v in engine.prompt_encoder.batches.items()}
    if engine.cache == "slots":
        report["slots"] = engine.slot_stats()
    else:
        report["generate_calls"] = len(engine.batch_shapes)
    return report


def variants(args, report: dict, engine, table) -> None:
    """``engine_in_turn`` and ``engine_row_lengths`` (as ``--variants`` asks), each against ``engine``."""
    asked = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(asked) - {"in_turn", "row_lengths"})
    if unknown:
        raise SystemExit(f"--variants: unknown {', '.join(unknown)} (in_turn, row_lengths)")
    for variant in asked:
        if variant == "row_lengths" and (args.device != "cuda" or args.attention != "packed_gqa"):
            log("row_lengths needs CUDA and --attention packed_gqa: not run")
            continue
        options = {"overlap": False} if variant == "in_turn" else {"row_lengths": True}
        name = f"engine_{variant}"
        report[name], decoders = engine_alone(args, engine, table, **options)
        del decoders
        report[f"{name}_vs_engine"] = round(report[name]["tokens_per_s"] / report["engine"]["tokens_per_s"], 3)
        log(f"engine alone, {variant}: {report[name]}")
        save(report, args.out)


def stage_again(args, report: dict, key: str, setting, table, shard: str, root: Path, engine, spec, tok) -> None:
    """``report[key]``: the stage (one turn) again inside `setting` (a context manager yielding what it set), and
    its tokens/s against ``report["stage"]``."""
    with setting as chosen:
        report[key] = {**chosen, **stage(args, table, shard, root, engine, spec, tok, turns=1, name=key)}
    report[f"{key}_vs_stage"] = round(report[key]["tokens_per_s"] / report["stage"]["tokens_per_s"], 3)
    log(f"{key}: {report[key]}")
    save(report, args.out)


@contextlib.contextmanager
def switch_interval(seconds: float):
    """Python's thread switch interval at `seconds` inside (``sys.setswitchinterval``)."""
    default_interval = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        yield {"switch_interval_s": seconds}
    finally:
        sys.setswitchinterval(default_interval)


@contextlib.contextmanager
def requests_in_flight(engine, n: int):
    """`n` requests in flight on `engine` inside (its ``max_concurrency``)."""
    default_in_flight = engine.max_concurrency
    engine.max_concurrency = n
    try:
        yield {"in_flight": n}
    finally:
        engine.max_concurrency = default_in_flight


@contextlib.contextmanager
def prompts_one_by_one(engine):
    """`engine`'s prompts encoded one by one inside (on the event loop, the GIL held for each), as an encoder that
    never batches does."""
    from dflash_assets.generation.engines.prompt_encoder import PromptEncoder

    default_encoder = engine.prompt_encoder
    engine.prompt_encoder = PromptEncoder(engine.tok.encode, engine.tok.encode_many, batch_chars=sys.maxsize)
    try:
        yield {"prompts": "one_by_one"}
    finally:
        engine.prompt_encoder = default_encoder


def tiers(text: str) -> list[tuple[int, int]]:
    """'128x2304,32x8192' -> [(128, 2304), (32, 8192)]."""
    return [tuple(int(v) for v in part.split("x")) for part in text.split(",") if part.strip()]


def save(report: dict, out: Path | None) -> None:
    """What the run has measured so far, to `out` (a run cut short keeps its finished modes)."""
    if out is not None:
        from dflash_assets.atomic_write import write_atomic

        write_atomic(out, json.dumps(report, indent=1))


def open_engine(args, target: str, tok, cache: str, rows: int):
    from dflash_assets.generation.engines import TransformersEngine
    from dflash_assets.generation.fleet import SLOTS_IN_FLIGHT

    # the slots cache's in-flight default (a whole shard; EndpointConfig), twice the rows for the static cache
    in_flight = SLOTS_IN_FLIGHT if cache == "slots" else 2 * rows
    engine = TransformersEngine(target, device=args.device, dtype=args.dtype, tokenizer=tok, cache=cache,
                                max_batch_rows=rows, max_concurrency=in_flight, slot_len=args.slot_len,
                                max_batch_tokens=args.prefill_tokens, attention=args.attention,
                                slot_tiers=tiers(args.tiers))
    asyncio.run(engine.open())
    return engine


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", help="a model dir (default: SmolLM2-135M-Instruct converted from its GGUF)")
    p.add_argument("--gguf", type=Path, help="the SmolLM2 GGUF (default: the one make smollm2 extracted)")
    p.add_argument("--prompts", type=int, default=8192)
    p.add_argument("--prompts-parquet", type=Path, help="a raw_prompts shard to read instead of ingesting the file")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-turns", type=int, default=2)
    p.add_argument("--slots", type=int, default=0, help="0: what fits --memory-share of the GPU (32 on a CPU)")
    p.add_argument("--slot-len", type=int, default=1024, help="positions of the main slots")
    p.add_argument("--tiers", default="128x2304,32x8192",
                   help="further slot decoders for longer requests, SLOTSxPOSITIONS comma-separated ('' for none)")
    p.add_argument("--memory-share", type=float, default=0.45)
    p.add_argument("--prefill-tokens", type=int, default=65536)
    p.add_argument("--static-prompts", type=int, default=0, help="also the static cache's stage on this many")
    p.add_argument("--variants", default="in_turn,row_lengths",
                   help="engine-alone variants against the engine's defaults, comma-separated ('' for none): "
                        "in_turn (decoders stepped one after another), row_lengths (flex block mask per row)")
    p.add_argument("--switch-interval", type=float, default=0.0,
                   help="also the stage with sys.setswitchinterval at this many seconds (0: not run)")
    p.add_argument("--in-flight", type=int, default=0,
                   help="also the stage with this many requests in flight on the engine instead of a whole shard "
                        "(0: not run)")
    p.add_argument("--prompts-one-by-one", action="store_true",
                   help="also the stage with the prompts encoded one by one on the event loop instead of a pass's "
                        "prompts together off the GIL")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--thinking", action="store_true")
    p.add_argument("--attention", default="packed_gqa", choices=["sdpa", "packed_gqa"])
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("dflash_assets.generation").setLevel(logging.INFO)

    from dflash_assets.target_model.spec import TargetModelSpec

    if args.target:
        target = args.target
    else:
        from dflash_assets.embedded.smollm2 import smollm2_target_path

        target = str(smollm2_target_path(gguf=args.gguf, log=log))
    spec = TargetModelSpec(model_path=target, dtype="float32")
    tok = spec.load_tokenizer()
    report: dict = {"target": Path(target).name, "prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
                    "slot_len": args.slot_len, "tiers": tiers(args.tiers), "attention": args.attention,
                    "dtype": args.dtype, "device": args.device}
    with tempfile.TemporaryDirectory(prefix="stage-generation-") as scratch:
        root = Path(scratch)
        if args.prompts_parquet:
            import pyarrow.parquet as pq

            table, shard = pq.read_table(args.prompts_parquet).slice(0, args.prompts), args.prompts_parquet.stem
        else:
            table, shard = prompts_table(root, args.prompts)
        log(f"{table.num_rows} prompts")
        engine = open_engine(args, target, tok, "slots", 1)  # loads the model (kept for the next engine)
        slots = slots_for(args, engine.model)
        asyncio.run(engine.close())
        engine = open_engine(args, target, tok, "slots", slots)
        report["slots"] = slots
        report["engine"], decoders = engine_alone(args, engine, table)
        log(f"engine alone: {report['engine']}")
        report["ceiling"] = ceiling(decoders, args.device)
        log(f"ceiling: {report['ceiling']}")
        del decoders
        save(report, args.out)
        variants(args, report, engine, table)
        report["stage"] = stage(args, table, shard, root, engine, spec, tok, turns=1)
        log(f"stage: {report['stage']}")
        report["stage_vs_engine"] = round(report["stage"]["tokens_per_s"] / report["engine"]["tokens_per_s"], 3)
        save(report, args.out)
        if args.switch_interval:
            stage_again(args, report, "stage_switch_interval", switch_interval(args.switch_interval), table, shard,
                        root, engine, spec, tok)
        if args.in_flight:
            stage_again(args, report, "stage_in_flight", requests_in_flight(engine, args.in_flight), table, shard,
                        root, engine, spec, tok)
        if args.prompts_one_by_one:
            stage_again(args, report, "stage_prompts_one_by_one", prompts_one_by_one(engine), table, shard, root,
                        engine, spec, tok)
        if args.max_turns > 1:
            asyncio.run(engine.close())
            engine = open_engine(args, target, tok, "slots", slots)
            report["stage_turns"] = stage(args, table, shard, root, engine, spec, tok, turns=args.max_turns)
            log(f"stage, {args.max_turns} turns: {report['stage_turns']}")
            save(report, args.out)
        asyncio.run(engine.close())
        if args.static_prompts:
            static = open_engine(args, target, tok, "static", min(slots, 512))
            report["static"] = stage(args, table.slice(0, args.static_prompts), shard, root, static, spec, tok,
                                     turns=1)
            log(f"static: {report['static']}")
            asyncio.run(static.close())
    report["machine"] = machine_info("torch", "transformers")
    report["gpu"] = gpu_info()
    print_report(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
