"""``bench/graph_speedup.py`` on CPU: random tiny models that always agree reach tau = block size on the static-cache
path and on the eager float32 peer of the same run, and both paths give the target's own tokens."""

from __future__ import annotations

import json

from tests.bench.conftest import load_bench_script


def test_always_accepting_models_reach_the_block_size_on_both_paths(tmp_path):
    bench = load_bench_script("graph_speedup")
    out = tmp_path / "speed.json"
    assert bench.main(["--dims", "tiny", "--random-drafter", "--drafter-layers", "2", "--block-size", "4",
                       "--always-accept", "--prompts", "2", "--prompt-len", "12", "--max-new-tokens", "9",
                       "--no-graphs", "--with-eager", "--device", "cpu", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    static, eager = report["static"], report["eager_float32"]
    assert static["graphs"] is False and static["dtype"] == "bfloat16" and eager["dtype"] == "float32"
    for r in (static, eager):
        assert r["num_prompts"] == 2 and r["outputs_equal"] == 2
        assert r["target_tokens"] == r["speculative_tokens"] == 18
        assert r["tau"] == 4.0  # the prefill's token, then two full blocks of 4 per prompt
        assert r["target_step_ms"] > 0 and r["round_ms"] > 0
