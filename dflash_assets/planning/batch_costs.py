"""How long the in-process Transformers engine takes over the corpus: its generate calls replayed partition by
partition, each priced by a cost model of one call fitted to calls timed on this host.

``TransformersEngine`` (dynamic cache) runs one left-padded ``generate`` at a
time over the requests in flight, grouped by ``generation.engines.next_batch``
(the oldest request and those closest to it in length, within ``max_batch_rows``
rows and ``max_batch_tokens`` padded prompt tokens). A partition's wall time is
then the sum of its calls' times, and a call's time depends on its shape:
on a CPU the prompt's tokens (padding included) cost about as much as the
decode steps, so a partition of long prompts takes several times one of short
prompts with the same number of prompts and new tokens. A few prompts timed
alone say little about that; the corpus's own prompt lengths say it all.

``GenerateCost`` is the seconds of one generate call of ``rows`` prompts
padded to ``width`` tokens running ``steps`` steps, one term per kind of work:
the prefill (``GenerateCost.prefill_seconds``)

    call_s                      x 1                    per call (inputs built, generate set up, its tail)
  + prefill_token_s             x rows x width         the decoder's matmuls over every padded prompt token
  + prefill_attention_s         x rows x width^2       the prompt's self-attention, quadratic in the width ...
    (padded_prefill_attention_s when the rows differ in length: left padding needs an attention mask, and
    the masked kernel costs more: 2 rows of 2,821 tokens took 8.0 s instead of 6.1 on a 2-core CPU)

then ``steps - 1`` decode steps (the first new token comes out of the prefill),
each (``GenerateCost.step_seconds``, over a cache of ``cache`` positions)

    step_s                      x 1                    whatever the rows (the loop, the weights read once)
  + row_step_s                  x rows                 per row (its matmuls, lm_head, sampling)
  + cache_read_s                x rows x cache         decode attention over the KV cache
    (padded_cache_read_s when the rows differ in length)

whose caches grow from ``width + 1``, so a call's cache reads sum to
rows x (steps - 1) x (width + steps / 2). ``ameasure_generate_cost`` times
calls of the shapes ``calibration_shapes`` spans (short and the run's longest
prompts, one row and the run's most rows, padded as the run's calls are) with
each step's tokens clocked; ``GenerateCost.fit`` fits the prefill terms to the
calls' prefill seconds and the step terms to the median step of each half of
their decode steps, by non-negative least squares on the relative error.

``simulate_partition`` replays one partition's dispatch: ``workers``
conversations in flight (the fleet's ``max_concurrency``), each sending its
turns in order, the engine forming each call from the requests pending when
the previous one ends (``next_batch``), every call priced by the model, with
``expected_steps`` decode steps. ``partition_turns`` gives each conversation's
prompt lengths per turn, rendered with the target's chat template (later turns:
the history's template with empty answers plus the answers' measured tokens).
Which conversations go on past a turn is chance (a turn cut at
``max_new_tokens`` ends its conversation), and a long one going on costs far
more than a short one: ``expected_partition`` is the mean of seeded replays,
each with its own draw of the turns that run (``continuing``).

Reads nothing itself (``ameasure_generate_cost`` runs generate calls on an
open engine); writes nothing.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

__all__ = ["GenerateCost", "GenerateSample", "PartitionSimulation", "InprocessEstimate", "calibration_shapes",
           "ameasure_generate_cost", "aestimate_inprocess", "estimate_inprocess", "inprocess_endpoint",
           "expected_partition", "expected_steps", "continuing", "padded_rows", "partition_turns",
           "simulate_partition", "turn_lengths"]

PREFILL_TERMS = ("call_s", "prefill_token_s", "prefill_attention_s", "padded_prefill_attention_s")
STEP_TERMS = ("step_s", "row_step_s", "cache_read_s", "padded_cache_read_s")
TERMS = PREFILL_TERMS + STEP_TERMS


@dataclass(frozen=True)
class GenerateSample:
    """One generate call timed on this host: its shape, its wall seconds, and when each new token came out."""

    rows: int
    width: int
    steps: int
    seconds: float
    padded: bool  # rows of different lengths: left padding and an attention mask
    token_times: tuple[float, ...] = ()  # seconds after the prompt reached generate, one per step

    @property
    def prefill_s(self) -> float:
        """The call less its decode steps: the prefill, its first token, and the call's own set-up and tail."""
        t = self.token_times
        return self.seconds - (t[-1] - t[0]) if len(t) > 1 else self.seconds

    def step_points(self) -> list[tuple[float, float]]:
        """(cache length, seconds) of a decode step: the median step of each half of the call's decode steps (a
        burst of other work on the host moves a median little), at the mean cache length of that half."""
        t = self.token_times
        steps = [(self.width + i + 1, t[i + 1] - t[i]) for i in range(len(t) - 1)]
        if not steps:
            return []
        half = max(1, len(steps) // 2)
        out = []
        for part in (steps[:half], steps[half:]):
            if part:
                out.append((sum(c for c, _ in part) / len(part), _median([d for _, d in part])))
        return out


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _prefill_terms(rows: float, width: float, padded: bool) -> tuple[float, ...]:
    """What each of ``PREFILL_TERMS`` multiplies."""
    square = rows * width * width
    return (1.0, rows * width, 0.0 if padded else square, square if padded else 0.0)


def _step_terms(rows: float, cache: float, padded: bool) -> tuple[float, ...]:
    """What each of ``STEP_TERMS`` multiplies, for one decode step over a cache of ``cache`` positions."""
    reads = rows * cache
    return (1.0, rows, 0.0 if padded else reads, reads if padded else 0.0)


def _nnls(x: Any, y: Any) -> list[float]:
    """Non-negative least squares on the relative error: every subset of the columns solved by least squares,
    the best one whose coefficients are all >= 0 kept (exact; four columns here)."""
    import numpy as np

    x = np.asarray(x, dtype=float) / np.asarray(y, dtype=float)[:, None]
    target = np.ones(x.shape[0])
    used = [j for j in range(x.shape[1]) if x[:, j].any()]  # a term no sample exercises stays 0
    best: tuple[float, tuple[int, ...], Any] | None = None
    for k in range(1, len(used) + 1):
        for subset in itertools.combinations(used, k):
            coef, *_ = np.linalg.lstsq(x[:, subset], target, rcond=None)
            if (coef < 0).any():
                continue
            error = float(np.sum((x[:, subset] @ coef - target) ** 2))
            if best is None or error < best[0] - 1e-12:
                best = (error, subset, coef)
    values = [0.0] * x.shape[1]
    if best is not None:
        for j, c in zip(best[1], best[2]):
            values[j] = float(c)
    return values


@dataclass(frozen=True)
class GenerateCost:
    """Seconds of one generate call by shape (see the module for what each coefficient stands for)."""

    call_s: float
    prefill_token_s: float
    prefill_attention_s: float
    padded_prefill_attention_s: float
    step_s: float
    row_step_s: float
    cache_read_s: float
    padded_cache_read_s: float
    samples: tuple[GenerateSample, ...] = ()  # the calls it was fitted to

    def prefill_seconds(self, rows: float, width: float, padded: bool) -> float:
        return sum(getattr(self, n) * x for n, x in zip(PREFILL_TERMS, _prefill_terms(rows, width, padded)))

    def step_seconds(self, rows: float, cache: float, padded: bool) -> float:
        return sum(getattr(self, n) * x for n, x in zip(STEP_TERMS, _step_terms(rows, cache, padded)))

    def seconds(self, rows: float, width: float, steps: float, padded: bool | None = None) -> float:
        """One call: the prefill, then ``steps - 1`` decode steps (the first new token comes out of the prefill)
        whose cache grows from ``width + 1``: their cache reads sum to rows x (steps - 1) x (width + steps / 2).
        ``padded`` (rows of different lengths) defaults to more than one row."""
        padded = rows > 1 if padded is None else padded
        decode = max(steps - 1.0, 0.0)
        return (self.prefill_seconds(rows, width, padded) + decode * self.step_seconds(rows, 0.0, padded)
                + (self.padded_cache_read_s if padded else self.cache_read_s) * rows * decode * (width + steps / 2.0))

    @classmethod
    def fit(cls, samples: Sequence[GenerateSample]) -> "GenerateCost":
        """The prefill terms fitted to the calls' prefill seconds, the step terms to their decode steps
        (``GenerateSample.step_points``), each by non-negative least squares on the relative error."""
        if not samples:
            raise ValueError("no timed generate calls to fit")
        if any(s.seconds <= 0 for s in samples):
            raise ValueError("timed generate calls must take a positive time")
        prefill = _nnls([_prefill_terms(s.rows, s.width, s.padded) for s in samples],
                        [max(s.prefill_s, 1e-9) for s in samples])
        points = [(s, cache, d) for s in samples for cache, d in s.step_points() if d > 0]
        step = _nnls([_step_terms(s.rows, cache, s.padded) for s, cache, _ in points],
                     [d for _, _, d in points]) if points else [0.0] * len(STEP_TERMS)
        return cls(*prefill, *step, samples=tuple(samples))

    def ratios(self) -> list[float]:
        """Modelled over timed seconds of each sample it was fitted to (the whole call)."""
        return [self.seconds(s.rows, s.width, s.steps, s.padded) / s.seconds for s in self.samples]

    def prefill_ratios(self) -> list[float]:
        """Modelled over timed prefill seconds of each sample."""
        return [self.prefill_seconds(s.rows, s.width, s.padded) / max(s.prefill_s, 1e-9) for s in self.samples]

    def to_metadata(self, prefix: str = "engine_cost_") -> dict[str, Any]:
        meta: dict[str, Any] = {f"{prefix}{name}": float(f"{getattr(self, name):.4g}") for name in TERMS}
        meta[f"{prefix}calls"] = "; ".join(
            f"{s.rows}x{s.width}x{s.steps}{' padded' if s.padded else ''}: {s.seconds:.2f} s (model {r:.2f}x)"
            for s, r in zip(self.samples, self.ratios()))
        return meta


def calibration_shapes(longest: int, most_rows: tuple[int, int], widest_padded: int | None, *, steps: int,
                       short: int = 64, max_tokens: int | None = None) -> list[tuple[int, int, int]]:
    """(rows, width, steps) of the calls that calibrate ``GenerateCost``, spanning the run's calls: one short row
    (the per-call and per-step costs), the run's call of the most rows (``most_rows``: its rows and width) and
    that many short rows with one new token (the per-token and per-row costs), one row of the run's longest
    prompt (the attention terms without padding) and, when the run has calls of several rows,
    two rows at the widest of them (``widest_padded``: the attention terms with padding). Calls of several rows
    are timed padded (``ameasure_generate_cost``), as the run's are. Widths stay within ``max_tokens``."""
    rows, width = most_rows
    rows = max(1, rows)
    cap = max_tokens or max(longest, rows * width, short)
    long = max(min(longest, cap), short)
    width = max(short, min(width, cap // rows))
    shapes = [(1, short, steps), (rows, short, 1), (rows, width, steps), (1, long, steps)]
    if widest_padded and rows > 1:
        shapes.append((2, max(short, min(widest_padded, cap // 2)), steps))
    return list(dict.fromkeys(shapes))


def padded_rows(token_ids: Sequence[int], rows: int, width: int) -> list[list[int]]:
    """``rows`` prompts of ``token_ids`` repeated: the first ``width`` long, the others evenly shorter down to half
    of it, so a call of several rows is left-padded under an attention mask as the run's calls are (how much
    padding matters little; that there is a mask changes the attention kernel)."""
    ids = list(token_ids) or [0]
    full = (ids * (width // len(ids) + 1))[:width]
    if rows == 1:
        return [full]
    return [full[:max(1, width - (width // 2) * i // (rows - 1))] for i in range(rows)]


async def ameasure_generate_cost(engine: Any, shapes: Iterable[tuple[int, int, int]], generation: Any, *,
                                 token_ids: Sequence[int], retime_over: float = 0.2,
                                 log: Callable[[str], None] | None = None) -> GenerateCost:
    """Time one generate call per shape on ``engine`` (an open ``TransformersEngine``: ``time_generate``, no stop
    id, each step's tokens clocked) and fit ``GenerateCost``. The prompts are ``token_ids`` repeated
    (``padded_rows``; real tokens, and the cost of a dense model does not depend on which). A call whose prefill
    the first fit misses by more than ``retime_over`` (other work on the host slowed it) is timed once more and
    the faster kept, then the model is fitted again."""

    async def time_one(rows: int, width: int, steps: int) -> GenerateSample:
        prompts = padded_rows(token_ids, rows, width)
        run = generation.model_copy(update={"max_new_tokens": steps})
        seconds, ran, times = await engine.time_generate(prompts, run)
        return GenerateSample(rows, width, ran, seconds, len({len(p) for p in prompts}) > 1, tuple(times))

    samples = [await time_one(*shape) for shape in shapes]
    model = GenerateCost.fit(samples)
    retimed = 0
    for i, ratio in enumerate(model.prefill_ratios()):
        if abs(ratio - 1.0) > retime_over:
            again = await time_one(samples[i].rows, samples[i].width, samples[i].steps)
            samples[i] = min(samples[i], again, key=lambda s: s.prefill_s)
            retimed += 1
    if retimed:
        model = GenerateCost.fit(samples)
    if log is not None:
        log(f"engine cost model from {len(samples)} generate calls ({retimed} timed twice): "
            + ", ".join(f"{n} {getattr(model, n):.3g}" for n in TERMS))
    return model


def expected_steps(rows: int, max_new_tokens: int, at_cap_share: float, stopped_mean: float) -> float:
    """Decode steps of a call of ``rows`` turns: it runs until its longest row stops, i.e. ``max_new_tokens`` unless
    no row hits the cap (chance ``(1 - at_cap_share) ** rows``), then the stopped turns' mean length (the pilot's;
    the longest of them runs a little longer)."""
    none_capped = (1.0 - min(max(at_cap_share, 0.0), 1.0)) ** max(rows, 1)
    return max_new_tokens * (1.0 - none_capped) + min(stopped_mean, max_new_tokens) * none_capped


def turn_lengths(chat: Any, system: str | None, user_turns: Sequence[str], *, enable_thinking: bool,
                 answer_tokens: float) -> list[int]:
    """Prompt tokens of each turn of one conversation as the engine receives it: the chat template rendered with
    the history (answers left empty) and the next user turn, plus ``answer_tokens`` per answer already in it.
    ``chat``: a ``ChatTokenizer`` (``prompt_ids``)."""
    history: list[dict] = [{"role": "system", "content": system}] if system else []
    out = []
    for k, user in enumerate(user_turns):
        request = history + [{"role": "user", "content": user}]
        out.append(len(chat.prompt_ids(request, enable_thinking)) + int(round(k * answer_tokens)))
        history = request + [{"role": "assistant", "content": ""}]
    return out


def continuing(turns: Sequence[Sequence[int]], share: float, rng: random.Random) -> list[list[int]]:
    """One draw of the turns each conversation runs: its first, then each next one with chance ``share`` while it
    has user turns left (a turn cut at ``max_new_tokens`` ends its conversation: ``share`` is the chance a turn is
    not cut)."""
    runs = []
    for t in turns:
        n = 1
        while n < len(t) and rng.random() < share:
            n += 1
        runs.append(list(t[:n]))
    return runs


@dataclass
class PartitionSimulation:
    """One partition's replayed dispatch: the generate calls (rows, width, steps, modelled seconds) in order; of
    ``expected_partition``, the mean seconds of its replays and all their calls."""

    seconds: float = 0.0
    calls: list[tuple[int, int, float, float]] = field(default_factory=list)
    replays: int = 1


def expected_partition(turns: Sequence[Sequence[int]], cost: GenerateCost, *, share: float, draws: int = 32,
                       seed: int = 0, **replay: Any) -> PartitionSimulation:
    """The expected replay of a partition whose later turns happen by chance: the mean seconds of ``draws``
    replays (``simulate_partition`` with ``replay``'s arguments), each with its own draw of the turns that run
    (``continuing`` over ``turns``: every conversation's turns' prompt lengths), seeded by ``seed`` so the same
    inputs give the same plan. One replay when nothing is left to chance (``share`` 0 or 1)."""
    rng = random.Random(seed)
    n = draws if 0.0 < share < 1.0 and any(len(t) > 1 for t in turns) else 1
    sims = [simulate_partition(continuing(turns, share, rng), cost, **replay) for _ in range(n)]
    return PartitionSimulation(sum(s.seconds for s in sims) / n, [c for s in sims for c in s.calls], n)


def simulate_partition(turns: Sequence[Sequence[int]], cost: GenerateCost, *, workers: int, max_rows: int,
                       max_tokens: int, steps: Callable[[int], float],
                       batch_gap_s: float = 0.005) -> PartitionSimulation:
    """Replay one partition on the in-process engine: ``workers`` conversations in flight (the rest wait for a
    free one), each sending its turns (``turns[i]``: the prompt lengths of the turns it runs) one after the
    other; each call takes the requests pending when the previous one ended, by ``next_batch``'s rule, and
    costs ``cost.seconds(rows, padded width, steps(rows))`` plus ``batch_gap_s`` (the engine's wait for
    requests sent together)."""
    from dflash_assets.generation.engines import next_batch

    waiting = list(range(len(turns)))[::-1]
    pending: list[tuple[int, int]] = []  # (conversation, turn), oldest first
    for _ in range(min(workers, len(turns))):
        pending.append((waiting.pop(), 0))
    sim = PartitionSimulation()
    while pending:
        lengths = [turns[c][k] for c, k in pending]
        picked = next_batch(lengths, [""] * len(pending), max_rows=max_rows, max_tokens=max_tokens)
        batch = [pending[i] for i in picked]
        chosen = set(picked)
        pending = [p for i, p in enumerate(pending) if i not in chosen]
        lengths = [turns[c][k] for c, k in batch]
        rows, width = len(batch), max(lengths)
        n_steps = steps(rows)
        seconds = cost.seconds(rows, width, n_steps, padded=min(lengths) < width) + batch_gap_s
        sim.seconds += seconds
        sim.calls.append((rows, width, n_steps, seconds))
        for c, k in batch:
            if k + 1 < len(turns[c]):
                pending.append((c, k + 1))
            elif waiting:
                pending.append((waiting.pop(), 0))
    return sim


def partition_turns(rows: Iterable[dict], chat: Any, *, max_turns: int, enable_thinking: bool,
                    answer_tokens: float) -> list[list[int]]:
    """``turn_lengths`` of every conversation of a partition (``raw_prompts`` rows: ``system``, ``user_turns``
    capped at ``max_turns``); a row without user turns is left out, as the completions stage fails it."""
    out = []
    for row in rows:
        users = [str(u) for u in (row.get("user_turns") or [])][:max_turns]
        if users:
            out.append(turn_lengths(chat, row.get("system") or None, users, enable_thinking=enable_thinking,
                                    answer_tokens=answer_tokens))
    return out


def inprocess_endpoint(fleet: Any) -> Any:
    """The fleet's one endpoint when it is an in-process Transformers engine on the dynamic cache (what
    ``simulate_partition`` replays), else None: HTTP engines batch on their own, the static cache pads to buckets
    and compiles, continuous batching admits rows one by one, and several in-process endpoints share one model."""
    eps = list(fleet.endpoints)
    if len(eps) == 1 and eps[0].kind == "transformers" and eps[0].cache == "dynamic":
        return eps[0]
    return None


@dataclass(frozen=True)
class InprocessEstimate:
    """The corpus's generation wall time on the in-process engine: its calls replayed and priced (see the module)."""

    engine: str  # what runs: the endpoint and its batching limits
    cost: GenerateCost
    partitions: int  # in the corpus
    simulated: int  # of them replayed (the rest are priced at their mean)
    calls_s: float  # the generate calls of every partition (scaled from the replayed ones)
    calls: float  # generate calls of the replayed partitions (a mean over their replays)
    fixed_s: float  # per partition: what a completions run adds to its calls (the pilot's run less its dispatch)
    continue_share: float  # the chance a conversation with another user turn goes on to it (``continuing``)
    at_cap_share: float  # of turns cut at max_new_tokens (a call runs max_new_tokens steps when one of its rows is)
    answer_tokens: float  # per answer in a later turn's history
    pilot_modelled_s: float  # the pilot's own prompts replayed with the model ...
    pilot_dispatch_s: float  # ... against the pilot's measured dispatch

    @property
    def wall_s(self) -> float:
        return self.calls_s + self.partitions * self.fixed_s

    def describe(self) -> str:
        return (f"{self.engine}: {self.simulated} of {self.partitions} partitions replayed call by call, "
                f"a mean over draws of the conversations that go on past a turn "
                f"({self.calls:.1f} generate calls, {self.calls_s:.1f} s) + {self.partitions} x {self.fixed_s:.2f} s "
                f"per partition outside the calls; each call priced by a model fitted to {len(self.cost.samples)} "
                f"generate calls timed on this host (the pilot's prompts replayed: {self.pilot_modelled_s:.1f} s "
                f"modelled, {self.pilot_dispatch_s:.1f} s measured)")

    def to_metadata(self) -> dict[str, Any]:
        return {"generation_engine": self.engine, "generation_model": "generate calls replayed and priced by a "
                "cost model timed on this host", "engine_partitions_replayed": self.simulated,
                "engine_generate_calls": round(self.calls, 1), "engine_calls_s": round(self.calls_s, 1),
                "engine_fixed_s_per_partition": round(self.fixed_s, 2),
                "engine_continue_share": round(self.continue_share, 3),
                "engine_at_cap_share": round(self.at_cap_share, 3),
                "engine_answer_tokens": round(self.answer_tokens, 1),
                "engine_pilot_modelled_s": round(self.pilot_modelled_s, 2),
                "engine_pilot_measured_s": round(self.pilot_dispatch_s, 2), **self.cost.to_metadata()}


async def aestimate_inprocess(fleet: Any, chat: Any, generation: Any, partitions: Sequence[Sequence[dict]], *,
                              total_partitions: int, pilot: Any, pilot_rows: Sequence[dict],
                              log: Callable[[str], None] | None = None) -> InprocessEstimate:
    """Calibrate the fleet's in-process engine (``inprocess_endpoint``) and replay ``partitions`` (``raw_prompts``
    rows of each; all of the corpus's, or an evenly spaced sample of ``total_partitions``) on it.

    ``chat``: the target's ``TargetChat`` (the completions stage renders with it); ``pilot``: a ``PilotMeasure``
    of ``pilot_rows`` on the same fleet, which gives the share of turns cut at ``max_new_tokens``, the stopped
    turns' and the answers' lengths and the per-partition cost outside the calls; its own calls, priced by the
    model, check it (``pilot_modelled_s`` against ``pilot_dispatch_s``)."""
    from dflash_assets.generation.chat_tokenizer import ChatTokenizer
    from dflash_assets.generation.fleet import build_engine

    ep = inprocess_endpoint(fleet)
    if ep is None:
        raise ValueError("the fleet is not one in-process Transformers endpoint on the dynamic cache")
    tok = ChatTokenizer(chat)
    workers, max_tokens = ep.max_concurrency, ep.max_batch_tokens
    max_rows = ep.max_batch_rows or ep.max_concurrency
    turns_done = max(pilot.turns, 1)
    # the chance a turn is cut at max_new_tokens, by Laplace's rule of succession: (cut + 1) / (turns + 2); a pilot
    # of a few turns all cut (or none) does not show that no turn (or every one) stops on its own
    at_cap = (pilot.turns_at_cap + 1) / (pilot.turns + 2)
    stopped = pilot.turns - pilot.turns_at_cap
    stopped_mean = pilot.stopped_tokens / stopped if stopped else float(generation.max_new_tokens)
    share = 1.0 - at_cap if generation.stop_after_truncated_turn else 1.0
    answer = pilot.answer_tokens / turns_done if pilot.answer_tokens else pilot.completion_tokens / turns_done

    def steps(rows: int) -> float:
        return expected_steps(rows, generation.max_new_tokens, at_cap, stopped_mean)

    def every_turn(rows: Sequence[dict]) -> list[list[int]]:
        return partition_turns(rows, tok, max_turns=generation.max_turns, enable_thinking=generation.enable_thinking,
                               answer_tokens=answer)

    def expected(turns: list[list[int]], cost: GenerateCost, seed: int) -> PartitionSimulation:
        return expected_partition(turns, cost, share=share, seed=seed, workers=workers, max_rows=max_rows,
                                  max_tokens=max_tokens, steps=steps)

    replay = [every_turn(rows) for rows in partitions]
    # the calls' shapes come from the lengths alone: a replay of the first turns (the calls every run makes) at one
    # second a call finds the most rows and the longest prompts, which the calibration spans
    unit = GenerateCost(1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    shapes = [c[:2] for turns in replay if turns
              for c in simulate_partition([t[:1] for t in turns], unit, workers=workers, max_rows=max_rows,
                                          max_tokens=max_tokens, steps=steps).calls]
    most_rows = max(shapes, key=lambda s: (s[0], s[1]), default=(1, 64))
    longest = max((w for _, w in shapes), default=64)
    widest_padded = max((w for r, w in shapes if r > 1), default=None)
    first = next((t for t in pilot_rows if t.get("user_turns")), None)
    ids = tok.prompt_ids(([{"role": "system", "content": first["system"]}] if first and first.get("system") else [])
                         + [{"role": "user", "content": str(first["user_turns"][0]) if first else "Hello"}],
                         generation.enable_thinking)
    # 24 decode steps (fewer when the run's turns are shorter) give each half of a call a median of 11 or more
    calibration = calibration_shapes(longest, most_rows, widest_padded,
                                     steps=max(3, min(generation.max_new_tokens, 24)), max_tokens=max_tokens)
    engine = build_engine(ep, fleet, chat)
    await engine.open()
    try:
        cost = await ameasure_generate_cost(engine, calibration, generation, token_ids=ids, log=log)
    finally:
        await engine.close()
    sims = [expected(turns, cost, i) for i, turns in enumerate(replay) if turns]
    replayed = sum(s.seconds for s in sims)
    calls_s = replayed * total_partitions / len(partitions) if partitions else 0.0
    pilot_turns = every_turn(pilot_rows)
    pilot_s = expected(pilot_turns, cost, 0).seconds if pilot_turns else 0.0
    engine_words = (f"transformers in-process {ep.model_path or fleet.target_model} on {ep.device} ({ep.dtype}, "
                    f"dynamic cache; up to {max_rows} rows and {max_tokens:,} padded prompt tokens a generate call, "
                    f"{workers} requests in flight)")
    return InprocessEstimate(engine_words, cost, total_partitions, len(partitions), calls_s,
                             sum(len(s.calls) / s.replays for s in sims), max(pilot.wall_s - pilot.dispatch_s, 0.0),
                             share, at_cap, answer, pilot_s, pilot.dispatch_s)


def estimate_inprocess(*args: Any, **kwargs: Any) -> InprocessEstimate:
    """Blocking form of ``aestimate_inprocess``."""
    from dflash_assets.generation.fleet import run_sync

    return run_sync(aestimate_inprocess(*args, **kwargs))
