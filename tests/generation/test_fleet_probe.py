"""The probe table: a router endpoint judged by its workers, and the table's markdown and Arrow forms.
The probe itself (real servers, the real router) is tested in test_fleet.py and test_router.py."""

from __future__ import annotations

import pytest

from dflash_assets.generation.fleet_probe import EndpointStatus, FleetProbe, RouterWorkerStatus, router_verdict

ROUTER = "http://127.0.0.1:30000"
TARGET = "/models/Qwen3.6-27B"


def row(status: str = "ok", detail: str = "") -> EndpointStatus:
    return EndpointStatus(ROUTER, "sglang", TARGET if status == "ok" else "", status == "ok", 2.0,
                          status == "ok", status, detail)


def worker(port: int, healthy: bool = True, model: str = TARGET) -> RouterWorkerStatus:
    return RouterWorkerStatus(ROUTER, f"http://127.0.0.1:{port}", model, healthy, 0, model == TARGET)


@pytest.mark.parametrize("base,workers,status,detail", [
    (row(), [worker(1), worker(2)], "ok", "router: 2 of 2 workers healthy"),
    (row(), [worker(1), worker(2, healthy=False)], "ok", "router: 1 of 2 workers healthy"),
    (row(), [worker(1, healthy=False)], "unhealthy", "router: 0 of 1 workers healthy"),
    (row(), [], "unhealthy", "router: 0 of 0 workers healthy"),
    (row(), [worker(1), worker(2, model="/models/Llama-3-8B")], "wrong_model",
     "worker http://127.0.0.1:2 serves /models/Llama-3-8B, target is /models/Qwen3.6-27B; the router spreads "
     "requests over all 2 of its workers"),
    # a worker of another model refuses the router even while it is down: it may come back
    (row(), [worker(1), worker(2, healthy=False, model="other")], "wrong_model",
     "worker http://127.0.0.1:2 serves other, target is /models/Qwen3.6-27B; the router spreads requests over all "
     "2 of its workers"),
    (row("unreachable", "HTTP 500: call_upstream_request_error"), [worker(1)], "unreachable",
     "router: 1 of 1 workers healthy; HTTP 500: call_upstream_request_error"),
])
def test_router_verdict(base, workers, status, detail):
    got = router_verdict(base, workers, TARGET)
    assert (got.status, got.detail, got.usable) == (status, detail, status == "ok")
    assert got.healthy == (base.healthy and status != "unhealthy")


def test_markdown_lists_the_workers_under_the_endpoints_and_arrow_keeps_one_row_per_endpoint():
    probe = FleetProbe(TARGET, (router_verdict(row(), [worker(1), worker(2, model="x|y")], TARGET),),
                       (worker(1), worker(2, model="x|y")))
    md = probe.markdown()
    assert md.index("| endpoint | kind |") < md.index("workers behind routers")
    assert f"| {ROUTER} | http://127.0.0.1:2 | x\\|y | yes | 0 | wrong_model |" in md
    assert probe.to_arrow().num_rows == 1 and not probe.usable
    assert [w["status"] for w in probe.worker_records()] == ["ok", "wrong_model"]
    assert "workers behind routers" not in FleetProbe(TARGET, (row(),)).markdown()
