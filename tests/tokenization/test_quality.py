"""The failure this project exists to catch, built through the real pipeline.

87% of completions are stubs (`<think>\\n\\n</think>\\n\\nOK.<|im_end|>`: a 6-token
loss mask). The engine is a loopback server answering in SGLang's native
shapes (SGLang itself cannot be installed here), decoding with the real
Qwen3.6 tokenizer. The blocking `empty_response_ratio` check fails,
`hidden_state_cache` does not run in that run, and a later run of
`hidden_state_cache` alone is refused by the quality gate on the GPU host.

The gate names the samples it checked. The scenario: a good run writes a
passing gate, completions are regenerated with 87% stubs, the tokenization
step is killed right after the samples are written, and a later GPU run must
not cache the stubs under the old passing gate. The gate names the sha256 of
the samples' bytes, is pending while they are written, and the GPU stages
read samples only through a check of that hash.

The ratio checks decide on evidence: through the real
`tokenized_samples` asset, 1 stub in 23 samples passes the blocking check
(its 95% Wilson lower bound is under 2%) and 4 stubs in 5 fail it.
"""

import hashlib

import dagster as dg
import pyarrow as pa
import re

import pytest

from dagster_project.definitions import defs
from dagster_project.resources import EngineFleetResource, StoreResource, TargetModelResource
from tests.support.sglang_loopback import LoopbackServer
from dflash_assets.store import layout
from dflash_assets.store.backends import LocalStore
from dflash_assets.tokenization.encoder import qwen3_6_encoder
from dflash_assets.tokenization.quality import (
    QualityGateFailed,
    publish_samples,
    read_verified_samples,
    require_quality_gate,
    verified_samples_path,
    write_quality_gate,
)
from dflash_assets.tokenization.samples import COMPLETIONS_MESSAGES_TYPE, tokenize_completions


@pytest.fixture
def stub_engine(tiny_dense_target):
    with LoopbackServer(model_path=str(tiny_dense_target), tokenizer_json=str(tiny_dense_target / "tokenizer.json"),
                        stub_ratio=0.87, reasoning_tokens=(24, 40), content_tokens=(20, 40)) as server:
        yield server


def test_stub_completions_fail_the_blocking_check_and_never_reach_the_gpu(stub_engine, tmp_path, tiny_dense_target):
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(f'{{"conversations": [{{"from": "human", "value": "Question number {i}?"}}]}}\n'
                              for i in range(100)))
    resources = {
        **defs.resources,
        "store": StoreResource(uri=str(tmp_path / "store")),
        "target": TargetModelResource(),
        "engines": EngineFleetResource(endpoints=[f"sglang:{stub_engine.url}"], max_concurrency=16),
    }
    with dg.instance_for_test() as instance:
        dg.materialize(defs.assets, selection=["prompt_corpus"], instance=instance, resources=resources,
                       run_config={"ops": {"prompt_corpus": {"config": {"source_uri": str(source)}}}})
        (shard,) = instance.get_dynamic_partitions("prompt_shards")
        run_config = {"ops": {"completions": {"config": {"max_new_tokens": 128, "max_turns": 1}}}}
        result = dg.materialize(defs.assets, partition_key=shard, instance=instance, resources=resources,
                                selection=["raw_prompts", "completions", "tokenized_samples", "hidden_state_cache"],
                                run_config=run_config, raise_on_error=False)
        assert not result.success
        assert stub_engine.stats.generate_requests >= 100  # the SGLang native path was used

        checks = {c.check_name: c for c in result.get_asset_check_evaluations()}
        empty = checks["empty_response_ratio"]
        assert not empty.passed and empty.severity == dg.AssetCheckSeverity.ERROR
        meta = {k: v.value for k, v in empty.metadata.items()}  # numbers as text: the UI does not plot them
        assert 0.75 < float(meta["ratio"]) < 0.97  # 87% expected from the stub rate
        assert meta["most_common_loss_tokens"] == "6"  # `</think>\n\nOK.<|im_end|>\n`
        assert len(meta["examples"]) == 10
        assert checks["schema"].passed

        def materialized(key):
            return instance.get_latest_materialization_event(dg.AssetKey(key))

        assert materialized("tokenized_samples") is not None  # the data is there, for inspection
        assert materialized("hidden_state_cache") is None
        store = LocalStore(tmp_path / "store")
        assert store.list("hidden_state_cache") == []

        # A later run of the GPU stage alone is refused on the host, from the gate in the store.
        again = dg.materialize(defs.assets, partition_key=shard, instance=instance, resources=resources,
                               selection=["hidden_state_cache"], raise_on_error=False)
        assert not again.success
        failure = next(e for e in again.all_events if e.event_type_value == "STEP_FAILURE")
        assert "blocking checks failed (empty_response_ratio)" in str(failure.event_specific_data.error)
        assert materialized("hidden_state_cache") is None


# -- the gate names the samples it checked ---------------------------------------------------------------

SHARD = "shard-00000"
REASONING = "Let me think about this step by step, carefully, and check the numbers twice before answering."
ANSWER = "Here is a complete answer with enough words in it to count as a real response to the question."


def conversation(i: int, stub: bool) -> list[dict]:
    reply = ({"role": "assistant", "content": "OK.", "reasoning_content": ""} if stub
             else {"role": "assistant", "content": f"{ANSWER} ({i})", "reasoning_content": REASONING})
    return [{"role": "user", "content": f"Question number {i}?", "reasoning_content": None}, reply]


@pytest.fixture(scope="module")
def enc():
    from dflash_assets.target_model.tokenizer import build_qwen3_6_tokenizer

    return qwen3_6_encoder(build_qwen3_6_tokenizer(), strict=True)


def samples(enc, n: int = 100, stubs: int = 0) -> pa.Table:
    convs = [conversation(i, stub=i < stubs) for i in range(n)]
    table = pa.table({"prompt_id": pa.array([f"p{i}" for i in range(n)]),
                      "messages": pa.array(convs, COMPLETIONS_MESSAGES_TYPE)})
    return tokenize_completions(table, enc)[0]


class Killed(Exception):
    """Stands for SIGKILL of the tokenization step at one point of its writes."""


class KilledAfter:
    """A store that dies right after writing the samples Parquet (before the gate that would follow)."""

    def __init__(self, store):
        self._store = store

    def __getattr__(self, name):
        return getattr(self._store, name)

    def write_parquet(self, key, table, **kwargs):
        self._store.write_parquet(key, table, **kwargs)
        raise Killed(key)


@pytest.mark.parametrize("store_fixture", ["local_store", "s3_store"])
def test_gate_names_the_sha256_of_the_samples_it_checked(enc, request, store_fixture):
    store = request.getfixturevalue(store_fixture)
    table = samples(enc)
    published = publish_samples(store, SHARD, table)
    gate = require_quality_gate(store, SHARD)
    data = store.read_bytes(layout.tokenized_samples(SHARD))
    assert gate["status"] == "checked" and gate["samples_sha256"] == hashlib.sha256(data).hexdigest() == published.sha256
    assert gate["data_version"] == published.data_version == published.sha256[:16]
    assert gate["checks"]["empty_response_ratio"]["passed"] and gate["checks"]["schema"]["passed"]
    assert read_verified_samples(store, SHARD).equals(table)
    assert read_verified_samples(store, SHARD, columns=["prompt_id"]).column_names == ["prompt_id"]
    assert hashlib.sha256(verified_samples_path(store, SHARD).read_bytes()).hexdigest() == published.sha256


def test_samples_replaced_after_a_passing_gate_are_refused_by_the_gpu_stage(enc, local_store, tiny_dense_target):
    """Passing gate, then 87% stubs written over the samples with no new gate."""
    from dflash_assets.hidden_states.stage import cache_partition_for_shard
    from dflash_assets.target_model.spec import TargetModelSpec

    publish_samples(local_store, SHARD, samples(enc))
    require_quality_gate(local_store, SHARD)  # passes
    stubs = samples(enc, stubs=87)
    local_store.write_parquet(layout.tokenized_samples(SHARD), stubs)  # what a kill after this write leaves

    with pytest.raises(QualityGateFailed, match="not the ones the quality gate checked"):
        cache_partition_for_shard(local_store, SHARD, TargetModelSpec(model_path=str(tiny_dense_target)))
    assert local_store.list(layout.HIDDEN_STATE_CACHE) == []  # nothing cached
    with pytest.raises(QualityGateFailed, match="not the ones"):  # the online drafter's read
        verified_samples_path(local_store, SHARD)
    with pytest.raises(QualityGateFailed, match="not the ones"):
        require_quality_gate(local_store, SHARD, samples_sha256=hashlib.sha256(
            local_store.read_bytes(layout.tokenized_samples(SHARD))).hexdigest())


def test_a_kill_between_samples_and_gate_leaves_a_gate_that_blocks(enc, local_store):
    publish_samples(local_store, SHARD, samples(enc))
    with pytest.raises(Killed):  # regenerated with 87% stubs; the step dies right after writing the samples
        publish_samples(KilledAfter(local_store), SHARD, samples(enc, stubs=87))
    assert local_store.read_json(layout.quality_gate(SHARD))["status"] == "pending"
    with pytest.raises(QualityGateFailed, match="pending"):
        require_quality_gate(local_store, SHARD)
    with pytest.raises(QualityGateFailed, match="pending"):
        read_verified_samples(local_store, SHARD)
    # the next complete run checks the stubs and fails them: still blocked, by the check that names them
    publish_samples(local_store, SHARD, samples(enc, stubs=87))
    with pytest.raises(QualityGateFailed, match="empty_response_ratio"):
        read_verified_samples(local_store, SHARD)


def test_gates_that_name_no_samples_block(enc, local_store):
    published = publish_samples(local_store, SHARD, samples(enc))
    gate = local_store.read_json(layout.quality_gate(SHARD))
    old = {k: gate[k] for k in ("data_version", "checks", "blocking")}  # the format before gates named their data
    local_store.write_json(layout.quality_gate(SHARD), old)
    with pytest.raises(QualityGateFailed, match="names no samples hash"):
        read_verified_samples(local_store, SHARD)
    with pytest.raises(ValueError, match="64-hex"):  # the 16-hex data version is not enough to name the bytes
        write_quality_gate(local_store, SHARD, published.outcomes, published.data_version)
    local_store.delete(layout.quality_gate(SHARD))
    with pytest.raises(QualityGateFailed, match="no quality record"):
        verified_samples_path(local_store, SHARD)



@pytest.mark.parametrize("field,value,said", [
    ("blocking", "schema", "blocking: input should be a valid list, got 'schema'"),
    ("samples_sha256", "XYZ" * 21 + "0", "samples_sha256: string should match pattern"),
    ("checks", {"schema": {"passed": "yes"}}, "checks.schema.passed: input should be a valid boolean, got 'yes'"),
])
def test_a_malformed_gate_blocks_naming_the_field(enc, local_store, field, value, said):
    publish_samples(local_store, SHARD, samples(enc))
    gate = local_store.read_json(layout.quality_gate(SHARD))
    local_store.write_json(layout.quality_gate(SHARD), {**gate, field: value})
    with pytest.raises(QualityGateFailed, match="malformed: " + re.escape(said)):
        read_verified_samples(local_store, SHARD)

# -- ratio checks decide on evidence, through the real asset ---------------------------------------------------


@pytest.fixture(scope="module")
def qwen_tokenizer_target(tmp_path_factory):
    """A target directory with only the Qwen3.6 tokenizer and chat template: all that tokenized_samples reads."""
    from dflash_assets.target_model.tokenizer import build_qwen3_6_tokenizer

    path = tmp_path_factory.mktemp("qwen3_6-tokenizer")
    build_qwen3_6_tokenizer().save_pretrained(path)
    return path


@pytest.mark.parametrize("n,stubs,passes", [(23, 1, True), (5, 4, False)])
def test_tokenized_samples_decides_its_ratio_checks_on_evidence(qwen_tokenizer_target, tmp_path, n, stubs, passes):
    """A demo-sized shard with 1 stub in 23 (4.35% against 2%) passes the blocking check and its gate lets
    the samples through; 87% stubs in a handful of samples (4 of 5) still fail it and are refused."""
    shard = "shard-00001"
    store = LocalStore(tmp_path / "store")
    convs = [conversation(i, stub=i < stubs) for i in range(n)]
    store.write_parquet(layout.completions(shard), pa.table({
        "prompt_id": pa.array([f"p{i}" for i in range(n)]), "messages": pa.array(convs, COMPLETIONS_MESSAGES_TYPE)}))
    resources = {**defs.resources, "store": StoreResource(uri=str(tmp_path / "store")),
                 "target": TargetModelResource(model_path=str(qwen_tokenizer_target))}
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("prompt_shards", [shard])
        result = dg.materialize(defs.assets, selection=["tokenized_samples"], partition_key=shard,
                                instance=instance, resources=resources, raise_on_error=False)
    assert result.success is passes
    checks = {c.check_name: c for c in result.get_asset_check_evaluations()}
    empty = checks["empty_response_ratio"]
    meta = {k: v.value for k, v in empty.metadata.items()}  # numbers as text
    assert empty.passed is passes and empty.severity == dg.AssetCheckSeverity.ERROR
    assert (meta["n"], meta["count"], meta["threshold"]) == (str(n), str(stubs), "0.02")
    assert float(meta["ratio"]) > 0.02  # the observed share is over the threshold either way
    assert (float(meta["wilson_lower_95"]) <= 0.02) is passes  # the bound decides
    assert "lower bound of the 95% Wilson score interval" in meta["rule"]
    assert empty.description.startswith(f"{stubs}/{n} samples")
    if passes:
        assert require_quality_gate(store, shard)["checks"]["empty_response_ratio"]["passed"]
        assert read_verified_samples(store, shard).num_rows == n
    else:
        with pytest.raises(QualityGateFailed, match="over the 2.00% threshold with 95% confidence"):
            require_quality_gate(store, shard)


@pytest.mark.parametrize("settings", [{}, {"max_empty_ratio": 0.2, "thinking_floor": 0.5, "truncation_ceiling": 0.3}])
def test_check_descriptions_are_built_from_the_thresholds_they_describe(settings):
    """Each description's example is the ratio rule's verdict at these thresholds: the counts it names as passing
    pass, and one more (one fewer, for the floor) fails."""
    from dflash_assets.quality_gates import ratio_gate
    from dflash_assets.tokenization.quality import QualityThresholds, check_descriptions

    thresholds = QualityThresholds(**settings)
    text = check_descriptions(thresholds)
    pct = lambda x: f"{x * 100:g}%"  # noqa: E731
    ok, bad = map(int, re.search(r"at [\d.]+%: (\d+) empty in 23 pass(?:es)?, (\d+) in 23 fail",
                                 text["empty_response_ratio"]).groups())
    assert f"at {pct(thresholds.max_empty_ratio)}:" in text["empty_response_ratio"]
    assert ratio_gate(ok, 23, thresholds.max_empty_ratio).passed
    assert not ratio_gate(bad, 23, thresholds.max_empty_ratio).passed
    ok = int(re.search(r": (\d+) of 23 with reasoning passes", text["thinking_ratio"]).group(1))
    assert ratio_gate(ok, 23, thresholds.thinking_floor, "floor").passed
    assert not ratio_gate(ok - 1, 23, thresholds.thinking_floor, "floor").passed
    ok, bad = map(int, re.search(r": (\d+) cut in 23 pass, (\d+) in 23 fail", text["truncation_ratio"]).groups())
    assert bad == ok + 1 and not ratio_gate(bad, 23, thresholds.truncation_ceiling).passed
