#!/usr/bin/env bash
# The poll of bench/smollm2_gpu_chain.sh, one device run each:
#
#   bash bench/smollm2_gpu_poll.sh [WAIT_S]
#
# waits until the chain is done or WAIT_S seconds (default 540) have passed, prints where it stands, and brings
# back into $OUT all that a later session needs, every time: a device machine left idle for 30 s is given back
# with everything on it (session 37 lost a 1,100 s training run so, between two polls). Into $OUT: results.tgz
# (the stages' JSON reports, logs and status, and exp/completions/: every shard generated so far, the session's
# costliest product; session 39 lost six shards that were to be packed after training) and drafter/ (the
# newest drafter the chain exported, drafter.json and the parts it names, when it changed since the last poll:
# earlier polls' copies are already back). Reads RUN_DIR (default /tmp/run). Polls repeated within one device run
# (`for i in 1 2 3; do bash bench/smollm2_gpu_poll.sh 60; done`) keep $OUT current, so that a run stopped at its
# time limit, whose $OUT still comes back, brings the newest drafter.
set -u
WAIT_S=${1:-540}
RUN=${RUN_DIR:-/tmp/run}
: "${OUT:?run through the device tool: \$OUT is where files come back}"
if [ ! -d "$RUN" ]; then  # the chain makes RUN_DIR first: without it, this is a fresh machine, not the chain's
    echo "no chain on this machine ($RUN is missing): the one that ran it was given back; nothing to bring back"
    exit 3
fi
start=$SECONDS
while [ ! -e "$RUN/done" ] && [ $((SECONDS - start)) -lt "$WAIT_S" ]; do sleep 5; done

cat "$RUN/status" 2>/dev/null
for log in "$RUN"/*.log; do
    [ -e "$log" ] && { echo "== $(basename "$log")"; tail -n 3 "$log"; }
done
skip=(--exclude=./drafter --exclude=./.polled-drafter.json --exclude='*.part' --exclude='*.tmp')  # tmp: a copy
tar czf "$OUT/results.tgz.tmp" -C "$RUN" "${skip[@]}" . 2>/dev/null  # a run stopped meanwhile keeps the last one
mv "$OUT/results.tgz.tmp" "$OUT/results.tgz"

# drafter.json first: it names the parts; the exporter writes the parts before it and deletes older ones after
# it, so a part missing here means a newer export came meanwhile: the next poll brings that one. The copy goes to
# drafter.tmp/ and replaces drafter/ whole, so polls repeated in one device run leave one drafter in $OUT.
doc="$RUN/drafter/drafter.json"
if [ -e "$doc" ] && ! cmp -s "$doc" "$RUN/.polled-drafter.json"; then
    rm -rf "$OUT/drafter.tmp" && mkdir -p "$OUT/drafter.tmp"
    cp "$doc" "$OUT/drafter.tmp/drafter.json"
    ok=1
    for part in $(python3 -c 'import json, sys; print(" ".join(json.load(open(sys.argv[1]))["parts"]))' \
                  "$OUT/drafter.tmp/drafter.json"); do
        cp "$RUN/drafter/$part" "$OUT/drafter.tmp/" || ok=0
    done
    if [ "$ok" = 1 ]; then
        rm -rf "$OUT/drafter" && mv "$OUT/drafter.tmp" "$OUT/drafter"
        cp "$OUT/drafter/drafter.json" "$RUN/.polled-drafter.json"
        python3 -c 'import json, sys; d = json.load(open(sys.argv[1])); print("drafter back:", d["recipe"],
              "step", d["step"], "final" if d["final"] else "(training)", d["sequence_tokens_total"], "tokens",
              "tau", d["tau"])' "$OUT/drafter/drafter.json"
    else
        rm -rf "$OUT/drafter.tmp"
    fi
fi
if [ -e "$RUN/done" ]; then echo "done"; else echo "running: poll again within 30 s"; fi
