"""The Dagster UI in a real browser: Debian's chromium, headless, driven by Playwright, against ``dagster dev``.

One ``dagster dev`` on 127.0.0.1 for the module, over a 30-prompt source
ingested into three ``prompt_shards`` partitions of 10. Runs launched over
GraphQL as the UI's "Materialize" buttons launch them: ``raw_prompts`` for
two partitions, then ``tokenized_samples`` for a partition whose completions
answer (checks pass) and one whose completions are ``OK.`` stubs (the
blocking ``empty_response_ratio`` check fails). Then, in the browser:

- the global asset lineage, all groups expanded, shows every asset of the
  definitions;
- a materialized ``raw_prompts`` partition shows its own metadata
  (``num_prompts`` 10, its store key);
- the ``tokenized_samples`` checks tab shows ``empty_response_ratio`` as a
  blocking check, its failed evaluation with ``ratio`` and ``threshold``, and
  the passed one in the execution history.

Screenshots of every page land in ``test-artifacts/ui/`` (gitignored), also
when a test fails.
"""

import re

import dagster as dg
import pytest
from dagster_dev import REPO_ROOT, dagster_dev, write_completions, write_prompt_source
from playwright.sync_api import Page, expect, sync_playwright

from dagster_project.definitions import defs
from dflash_assets.store import LocalStore

pytestmark = pytest.mark.slow

ARTIFACTS = REPO_ROOT / "test-artifacts" / "ui"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
TIMEOUT_MS = 60_000


@pytest.fixture(scope="module")
def ui(tmp_path_factory):
    """dagster dev with materialized partitions: raw_prompts x2, tokenized_samples good + stub."""
    root = tmp_path_factory.mktemp("ui")
    source = write_prompt_source(root / "prompts.jsonl", 30)
    store = LocalStore(root / "store")
    with dagster_dev(root / "home", env={"DFLASH_PROMPT_SOURCE": str(source), "DFLASH_STORE": store.uri}) as dev:
        run = dev.launch_run(["prompt_corpus"], {"ops": {"prompt_corpus": {"config": {"max_prompts_per_shard": 10}}}})
        assert dev.wait_for_run(run) == "SUCCESS", dev.log_tail()
        shards = dev.instance().get_dynamic_partitions("prompt_shards")
        assert len(shards) == 3
        good, bad = shards[0], shards[1]
        for shard in (good, bad):
            assert dev.wait_for_run(dev.launch_run(["raw_prompts"], tags={"dagster/partition": shard})) == "SUCCESS"
        write_completions(store, good)
        write_completions(store, bad, stub=True)
        outcomes = {shard: dev.wait_for_run(dev.launch_run(["tokenized_samples"], tags={"dagster/partition": shard}))
                    for shard in (good, bad)}  # bad last: its evaluation is the latest
        assert outcomes == {good: "SUCCESS", bad: "FAILURE"}  # the blocking check fails the run
        yield dev, {"good": good, "bad": bad}


@pytest.fixture(scope="module")
def browser():
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield browser
        browser.close()


@pytest.fixture
def page(browser, request):
    context = browser.new_context(viewport={"width": 1600, "height": 1000})
    # Dagster shows a one-time "Join the Dagster community" dialog over the first page; mark it seen.
    context.add_init_script("window.localStorage.setItem('communityNux', '\"1\"')")
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    yield page
    page.screenshot(path=str(ARTIFACTS / f"{request.node.name}-final.png"), full_page=True)
    context.close()


def _goto(page: Page, url: str) -> None:
    page.goto(url, wait_until="domcontentloaded")
    skip = page.get_by_role("button", name="Skip")  # the community dialog, should it still appear
    if skip.count() and skip.first.is_visible():
        skip.first.click()


def _metadata_row(page: Page, label: str):
    """The row of ``label`` in a metadata table (its accessible name is "label value")."""
    return page.get_by_role("row", name=re.compile(rf"^{re.escape(label)}\s")).first


def test_asset_graph_shows_every_asset(ui, page):
    dev, _ = ui
    keys = sorted(k.to_user_string() for k in defs.resolve_asset_graph().get_all_asset_keys())
    groups = sorted({defs.resolve_asset_graph().get(dg.AssetKey(k)).group_name for k in keys})
    _goto(page, dev.url + "/asset-groups")
    expect(page.get_by_text("Global asset lineage")).to_be_visible()
    for group in groups:  # several groups: the graph opens with each collapsed to one node
        expect(page.get_by_text(group, exact=True).last).to_be_visible()
    page.keyboard.press("Alt+e")  # "Expand all groups" (the graph settings menu names the shortcut)
    for key in keys:
        expect(page.get_by_text(key, exact=True).first).to_be_visible()
    page.screenshot(path=str(ARTIFACTS / "asset-graph.png"))


def test_partition_page_shows_its_metadata(ui, page):
    dev, shards = ui
    _goto(page, f"{dev.url}/assets/raw_prompts?view=partitions&partition={shards['bad']}")
    expect(page.get_by_text("Latest materialization")).to_be_visible()
    expect(_metadata_row(page, "num_prompts")).to_contain_text("10")
    expect(_metadata_row(page, "key")).to_contain_text(f"raw_prompts/{shards['bad']}.parquet")
    expect(_metadata_row(page, "shard")).to_contain_text(shards["bad"])
    page.screenshot(path=str(ARTIFACTS / "raw-prompts-partition.png"), full_page=True)


def test_empty_response_ratio_on_the_asset_page(ui, page):
    dev, _ = ui
    _goto(page, f"{dev.url}/assets/tokenized_samples?view=checks&checkDetail=empty_response_ratio")
    expect(page.get_by_text("This is a blocking asset check.")).to_be_visible()
    # The checks list: the latest evaluation (the stub partition) failed.
    entry = page.locator("div", has_text=re.compile(r"^empty_response_ratio\s*empty_response_ratio\s*Failed$")).last
    expect(entry).to_be_visible()
    expect(page.get_by_text(re.compile(r"10/10 samples \(100\.00%\) have < 16 supervised tokens")).first).to_be_visible()
    expect(_metadata_row(page, "ratio")).to_contain_text("1")
    expect(_metadata_row(page, "threshold")).to_contain_text("0.02")
    page.screenshot(path=str(ARTIFACTS / "empty-response-ratio.png"), full_page=True)

    page.get_by_role("tab", name="Execution history").click()
    expect(page.get_by_text("Passed", exact=True).first).to_be_visible()  # the partition with real answers
    expect(page.get_by_text(re.compile(r"0/10 samples \(0\.00%\)")).first).to_be_visible()
    page.screenshot(path=str(ARTIFACTS / "empty-response-ratio-history.png"), full_page=True)
