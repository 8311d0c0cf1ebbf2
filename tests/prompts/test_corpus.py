"""The prompt corpus's index (dflash_assets.prompts.corpus): shard names, the index's JSON, a generation committed
once (a second commit of it is a ConcurrentIngestError, and two ingests at once leave an intact corpus), an
``index.json`` that lags its commit rolled forward, and old generations collected.

Real stores: a LocalStore in tmp, and an S3Store against moto's server on 127.0.0.1.
"""

from __future__ import annotations

import io
import json
import re
import time
from pathlib import Path

import pytest

from dflash_assets.prompts.config import IngestConfig
from dflash_assets.prompts.corpus import (ConcurrentIngestError, CorpusIndex, ShardEntry, commit_corpus_index,
                                          corpus_prompt_count, list_shard_keys, load_corpus_index, shard_name,
                                          shard_number)
from dflash_assets.prompts.ingest import ingest_prompt_source
from dflash_assets.prompts.shards import materialize_prompt_shard
from dflash_assets.store import layout
from tests.prompts.test_ingest import _ingest, _jsonl, _materialize_all, _prompts, conv, store  # noqa: F401


def test_shard_names_and_numbers():
    assert shard_name(0) == "shard-00000" and shard_name(123456) == "shard-123456"
    assert shard_number("shard-00042") == 42 and shard_number(shard_name(123456)) == 123456
    for bad in ("shard-42", "raw_prompts/shard-00001", "shard-00001.parquet"):
        with pytest.raises(ValueError, match="not a shard key"):
            shard_number(bad)


def test_a_generation_is_committed_once_and_read_back(store):
    assert load_corpus_index(store) == CorpusIndex()
    assert list_shard_keys(store) == [] and corpus_prompt_count(store) == 0
    entry = ShardEntry("prompt_corpus/staged/gen-000001-abc/shard-00000.parquet", 3, "0" * 64, 1)
    first = CorpusIndex(1, "prompt_corpus/manifest/gen-000001-abc.parquet", {"shard-00000": entry}, {}, "abc")
    commit_corpus_index(store, first, based_on=CorpusIndex(), source="a")
    assert load_corpus_index(store) == first == CorpusIndex.from_json(json.loads(json.dumps(first.to_json())))
    assert list_shard_keys(store) == ["shard-00000"] and corpus_prompt_count(store) == 3
    rival = CorpusIndex(1, "prompt_corpus/manifest/gen-000001-def.parquet", {}, {}, "def")
    with pytest.raises(ConcurrentIngestError, match="run abc.* committed generation 1.*run def, source b"):
        commit_corpus_index(store, rival, based_on=CorpusIndex(), source="b")
    assert load_corpus_index(store) == first  # the first commit stands
    with pytest.raises(ValueError, match="unknown prompt-corpus index format"):
        CorpusIndex.from_json({**first.to_json(), "format": 2})


def test_old_generations_are_collected(tmp_path, store):
    """Objects that neither the current nor the previous index references are deleted."""
    for n in (2, 4, 6, 8):  # cap 3: shard-00000 is rewritten in gen 2, shard-00001 in gen 3
        _ingest(tmp_path, store, range(n), cap=3)

    def without_run(keys):  # staged keys carry the ingest run's id: gen-000002-<run>
        return [re.sub(r"(gen-\d{6})-[0-9a-f]{12}", r"\1", k) for k in keys]

    assert without_run(store.list("prompt_corpus/staged")) == [
        "prompt_corpus/staged/gen-000002/shard-00000.parquet",
        "prompt_corpus/staged/gen-000003/shard-00001.parquet",
        "prompt_corpus/staged/gen-000004/shard-00002.parquet",
    ]
    assert without_run(store.list("prompt_corpus/manifest")) == [
        "prompt_corpus/manifest/gen-000003.parquet", "prompt_corpus/manifest/gen-000004.parquet"]
    assert store.list("prompt_corpus/commits") == [f"prompt_corpus/commits/gen-00000{g}.json" for g in (1, 2, 3, 4)]
    assert _materialize_all(store) == {"shard-00000": ["p0", "p1", "p2"], "shard-00001": ["p3", "p4", "p5"],
                                       "shard-00002": ["p6", "p7"]}


class _GatedSource(io.RawIOBase):
    """A source stream that hands out ``gate`` bytes, then says so (a file appears) and waits for a release file."""

    def __init__(self, data: bytes, gate: int, reached: str, release: str):
        self.data, self.pos, self.gate = data, 0, gate
        self.reached, self.release = Path(reached), Path(release)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:  # the reader then reads this stream itself, not through a 1 MiB buffer
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.pos = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: len(self.data)}[whence] + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, b) -> int:
        if self.pos >= self.gate and not self.release.exists():
            self.reached.touch()
            deadline = time.monotonic() + 120
            while not self.release.exists():
                assert time.monotonic() < deadline, "never released"
                time.sleep(0.02)
        end = min(len(self.data), self.pos + len(b), self.gate if self.pos < self.gate else len(self.data))
        n = end - self.pos
        b[:n] = self.data[self.pos:end]
        self.pos = end
        return n


def _gated_ingest(store_uri: str, endpoint: str, src: str, name: str, gate: str, reached: str, release: str,
                  out: str) -> None:
    """One ingest of ``src`` into ``store_uri``; the outcome goes to ``out`` as JSON. Run in a thread or a process."""
    from dflash_assets.store.backends import open_store

    store = open_store(store_uri, endpoint_url=endpoint or None)
    data = Path(src).read_bytes()
    stream = _GatedSource(data, int(gate), reached, release) if int(gate) else io.BytesIO(data)
    try:
        r = ingest_prompt_source(stream, store, IngestConfig(max_prompts_per_shard=4, source_name=name))
        result = {"ok": r.generation}
    except Exception as e:  # the test asserts on the type and message
        result = {"error": type(e).__name__, "message": str(e)}
    Path(out).write_text(json.dumps(result))


def _check_corpus(store, expected_ids: set[str]) -> None:
    """Every committed shard passes its sha256 and the corpus holds exactly ``expected_ids``."""
    seen = []
    for shard in list_shard_keys(store):
        table, _ = materialize_prompt_shard(store, shard)  # raises on a sha256 or row-count mismatch
        seen += table.column("source_id").to_pylist()
    assert sorted(seen) == sorted(expected_ids)
    index = store.read_json(layout.corpus_commit(store.read_json(layout.corpus_index())["generation"]))
    live = {e["key"] for e in index["shards"].values()} | {index["manifest_key"]}
    leftovers = [k for k in store.list("prompt_corpus/staged") + store.list("prompt_corpus/manifest")
                 if k not in live and layout.corpus_key_generation(k) >= index["generation"]]
    assert leftovers == []  # the losing run removed its own objects


@pytest.mark.parametrize("backend", ["local", "s3"])
@pytest.mark.parametrize("how", ["thread", "process"])
def test_two_ingests_at_once_leave_an_intact_corpus(tmp_path, request, how, backend):
    """B stages shards, A ingests and commits meanwhile, B goes on: B fails clearly, A's corpus is whole.

    Staged keys carry each run's id, so neither run overwrites the other's; with
    shared keys, a last-writer-wins index and a garbage collection that deleted
    the other run's staged objects, the committed shards would fail their sha256.
    """
    import subprocess
    import sys
    import threading

    if backend == "local":
        uri, endpoint = str(tmp_path / "store"), ""
    else:
        uri, endpoint = request.getfixturevalue("s3_store").uri + f"/{how}", request.getfixturevalue("moto_endpoint")
    from dflash_assets.store.backends import open_store

    store = open_store(uri, endpoint_url=endpoint or None)
    ingest_prompt_source(_jsonl(_prompts(range(3))), store, IngestConfig(max_prompts_per_shard=4, source_name="base"))
    files = {}
    for name in ("a", "b"):
        records = [conv(("human", f"{name} prompt {k} " + "x" * 2000), id=f"{name}{k}") for k in range(6)]
        (tmp_path / f"{name}.jsonl").write_bytes(_jsonl(records))
        files[name] = _jsonl(records)
    # B has read 3 records (and staged shard-00000) by then, and more than the 4 KiB the format sniffing reads
    gate = len(b"".join(files["b"].splitlines(keepends=True)[:3]))
    reached, release = tmp_path / "b.reached", tmp_path / "b.release"

    def start(name, gated):
        args = [uri, endpoint, str(tmp_path / f"{name}.jsonl"), name, str(gate if gated else 0),
                str(reached), str(release), str(tmp_path / f"{name}.out")]
        if how == "thread":
            t = threading.Thread(target=_gated_ingest, args=args)
            t.start()
            return t
        code = ("import sys; sys.path.insert(0, sys.argv[1]); from tests.prompts.test_corpus import _gated_ingest; "
                "_gated_ingest(*sys.argv[2:])")
        return subprocess.Popen([sys.executable, "-c", code, str(Path(__file__).parents[2]), *args])

    def wait(job):
        (job.join if how == "thread" else job.wait)(timeout=120)

    b = start("b", gated=True)
    try:
        deadline = time.monotonic() + 60
        while not reached.exists():
            assert time.monotonic() < deadline, "B never reached its gate"
            time.sleep(0.02)
        b_staged = [k for k in store.list("prompt_corpus/staged") if layout.corpus_key_generation(k) == 2]
        assert b_staged  # B has staged objects of generation 2
        a = start("a", gated=False)
        wait(a)
        assert json.loads((tmp_path / "a.out").read_text()) == {"ok": 2}
        assert all(store.exists(k) for k in b_staged)  # A's garbage collection left B's objects alone
    finally:
        release.touch()
        wait(b)
    outcome = json.loads((tmp_path / "b.out").read_text())
    assert outcome["error"] == "ConcurrentIngestError", outcome
    assert "committed generation 2" in outcome["message"] and "Run the ingest again" in outcome["message"]
    base, a_ids, b_ids = {f"p{k}" for k in range(3)}, {f"a{k}" for k in range(6)}, {f"b{k}" for k in range(6)}
    _check_corpus(store, base | a_ids)
    # the retry B was told to make works and keeps every prompt of both
    report = ingest_prompt_source(files["b"], store, IngestConfig(max_prompts_per_shard=4, source_name="b"))
    assert report.generation == 3 and report.new_prompts == 6
    _check_corpus(store, base | a_ids | b_ids)


def test_index_json_that_lags_its_commit_is_rolled_forward(tmp_path, store):
    """A crash between the commit object and index.json (or a slow writer setting it back) loses nothing."""
    _ingest(tmp_path, store, range(2), cap=3)
    stale = store.read_json(layout.corpus_index())
    _ingest(tmp_path, store, range(5), cap=3)
    store.write_json(layout.corpus_index(), stale)  # index.json now says generation 1
    assert list_shard_keys(store) == ["shard-00000", "shard-00001"]
    assert _materialize_all(store) == {"shard-00000": ["p0", "p1", "p2"], "shard-00001": ["p3", "p4"]}
    report = _ingest(tmp_path, store, range(7), cap=3)
    assert report.generation == 3 and report.new_prompts == 2 and report.changed_shards == ["shard-00001"]
    assert _materialize_all(store)["shard-00002"] == ["p6"]


