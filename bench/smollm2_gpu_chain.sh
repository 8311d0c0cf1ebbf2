#!/usr/bin/env bash
# One GPU box, one background chain of bench/smollm2_product.py: generate (the kept shards imported, new shards
# generated and exported), train, evaluate. Start it detached and poll for $RUN_DIR/done, so that a dropped
# connection or a caller's time limit does not stop it:
#
#   setsid nohup bash bench/smollm2_gpu_chain.sh > /tmp/run.log 2>&1 < /dev/null &
#   bash bench/smollm2_gpu_poll.sh 540   # one device run each, the next within 30 s, until it prints "done"
#
# Reads the GGUF halves and the raw_prompts store from SM (default /tmp/sm: --prepare's carries t, a and b) and the
# settings below from the environment (RESAMPLE=NAME adds a second generate stage: the kept shards' prompts again
# as new partitions, sampled, trained on beside the kept ones; with RESAMPLE_BESIDE_TRAIN=N it runs beside
# training, for a later session). Writes into RUN_DIR (default /tmp/run): each stage's log and JSON report,
# `status` (one "stage exit-code" line per stage run), `exp/completions/` (each shard generated here, not the
# imported ones, written atomically as the shard is published), `drafter/` (the drafter, bfloat16 in parts of at
# most 15 MiB: each learning-curve checkpoint as training saves it, then the trained one, then with its tau: the
# next session's INIT_DRAFTER) and `done` when the chain ends. bench/smollm2_gpu_poll.sh is the poll: it brings all
# of it back, each time. A stage that fails stops the chain (but resample).
set -u  # GEN_EXTRA and TRAIN_EXTRA are split on spaces on purpose
SM=${SM:-/tmp/sm}
RUN=${RUN_DIR:-/tmp/run}
WORK=${WORK:-/tmp/smollm2-product}  # the stages' --work: GGUF, target, store, training state
RECIPE=${RECIPE:-smollm2-greedy-v6}
GEN_BUDGET_S=${GEN_BUDGET_S:-700}
TRAIN_BUDGET_S=${TRAIN_BUDGET_S:-850}
SAVE_EVERY=${SAVE_EVERY:-700}
EVAL_PROMPTS=${EVAL_PROMPTS:-64}
SPEED_PROMPTS=${SPEED_PROMPTS:-16}
CURVE_PROMPTS=${CURVE_PROMPTS:-4}
EVAL_WORKERS=${EVAL_WORKERS:-4}
GEN_ATTENTION=${GEN_ATTENTION:-sdpa}  # packed_gqa: the engine's decode step without the KV copy per query head
GEN_STATIC_CACHE_LEN=${GEN_STATIC_CACHE_LEN:-largest}  # per_call: each call's static cache sized to itself
GEN_EXTRA=${GEN_EXTRA:-}      # more --stage generate flags, e.g. "--max-new-tokens 1024" (a new config_hash)
TRAIN_EXTRA=${TRAIN_EXTRA:-}  # more --stage train flags, e.g. "--batch-size 64"
RESAMPLE=${RESAMPLE:-}        # NAME: after the kept shards, generate their prompts again as resample-NAME-* (the
# sampled ones kept in bench/data/smollm2-sampled imported: t07 with the default flags reuses them) ...
RESAMPLE_EXTRA=${RESAMPLE_EXTRA:-"--temperature 0.7"}  # ... with these flags (another config), for RESAMPLE_BUDGET_S
RESAMPLE_BUDGET_S=${RESAMPLE_BUDGET_S:-450}
RESAMPLE_BESIDE_TRAIN=${RESAMPLE_BESIDE_TRAIN:-}  # N: the resample stage runs beside training instead of before it;
# training starts once N shards are published (9: the 8 kept greedy ones and the kept sampled one) and trains on
# those; the shards generated meanwhile come back with each poll, for a later session to keep and train on
INIT_DRAFTER=${INIT_DRAFTER:-}  # DIR: an earlier session's exported drafter (drafter.json + parts): train continues it
mkdir -p "$RUN"
export PYTHONUNBUFFERED=1

stage() {  # stage LABEL STAGE ARGS...: run one stage of the bench, record its exit code, stop the chain on failure
    local name=$1 which=$2; shift 2
    python3 bench/smollm2_product.py --stage "$which" --work "$WORK" "$@" --out "$RUN/$name.json" \
        > "$RUN/$name.log" 2>&1
    local rc=$?
    echo "$name $rc" >> "$RUN/status"
    if [ "$rc" -ne 0 ] && [ "$name" != resample ]; then touch "$RUN/done"; exit "$rc"; fi
}  # a failed resample stage stops nothing: the shards it published before failing are trained on with the kept ones

ENGINE="--gen-dtype bfloat16 --gen-cache static --gen-concurrency 4096 --gen-batch-rows 1024 --gen-batch-tokens 524288
    --gen-static-cache-len $GEN_STATIC_CACHE_LEN"
stage generate generate --parts "$SM/gguf.part-a" "$SM/gguf.part-b" --store "$SM/store" $ENGINE \
    --max-turns 2 --gen-attention "$GEN_ATTENTION" --gen-budget-s "$GEN_BUDGET_S" --export-completions "$RUN/exp" \
    $GEN_EXTRA
resample() {
    stage resample generate --parts "$SM/gguf.part-a" "$SM/gguf.part-b" --store "$SM/store" $ENGINE \
        --max-turns 2 --gen-attention "$GEN_ATTENTION" --gen-budget-s "$RESAMPLE_BUDGET_S" --resample "$RESAMPLE" \
        --import-completions bench/data/smollm2-sampled --export-completions "$RUN/exp" $RESAMPLE_EXTRA
}
WAIT_FOR_SHARDS=0
if [ -n "$RESAMPLE" ] && [ -n "$RESAMPLE_BESIDE_TRAIN" ]; then
    resample &  # the generate stage publishes shard by shard; the train stage below waits for the first N
    WAIT_FOR_SHARDS=$RESAMPLE_BESIDE_TRAIN
elif [ -n "$RESAMPLE" ]; then
    resample
fi
stage train train --recipe "$RECIPE" --train-budget-s "$TRAIN_BUDGET_S" --save-every "$SAVE_EVERY" \
    --wait-for-shards "$WAIT_FOR_SHARDS" \
    ${INIT_DRAFTER:+--init-drafter "$INIT_DRAFTER"} --export-drafter "$RUN/drafter" $TRAIN_EXTRA
# beside training, the resample's last shard ends before the evaluation starts: the batch-1 speed is timed on an
# otherwise idle GPU (RESAMPLE_BUDGET_S is a start deadline: set it so that the last shard ends near training's end)
if [ "$WAIT_FOR_SHARDS" -gt 0 ]; then wait; fi
stage eval eval --recipe "$RECIPE" --eval-prompts "$EVAL_PROMPTS" --speed-prompts "$SPEED_PROMPTS" \
    --curve-prompts "$CURVE_PROMPTS" --eval-workers "$EVAL_WORKERS" --export-drafter "$RUN/drafter"
touch "$RUN/done"
