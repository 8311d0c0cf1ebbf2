"""What a GPU-host stage receives and returns: the plain types between the Pipes worker and the stage libraries.

`pipes_worker` (the entry point on the host) builds a `StageCall`, calls the
stage function, and reports its `StageResult` (materialization metadata,
check outcomes, data version) back to Dagster. The stage libraries
(`hidden_states.stage`, `drafter.stages`) import only this module, not the
worker, so the worker can import them without a cycle. Stdlib only; reads and
writes nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["CheckOutcome", "StageCall", "StageResult", "StageFn"]


@dataclass(frozen=True)
class CheckOutcome:
    """One asset check evaluated: the one type for every check of the project.

    A GPU stage returns them to the orchestrator (the asset must declare a check
    spec of this ``name``); the tokenization checks return them to their asset;
    the demo reads them back from a run's events. ``description`` is the one line
    the UI shows; ``blocking`` says whether a failure stops the downstream.
    """

    name: str
    passed: bool
    severity: Literal["ERROR", "WARN"] = "ERROR"
    metadata: Mapping[str, Any] = field(default_factory=dict)
    description: str = ""
    blocking: bool = False


@dataclass
class StageResult:
    """What a stage returns: metadata of the materialization, check outcomes, optional data version."""

    metadata: dict[str, Any] = field(default_factory=dict)
    checks: list[CheckOutcome] = field(default_factory=list)
    data_version: str | None = None


@dataclass
class StageCall:
    """Everything a stage gets on the host.

    ``store`` is opened from the store URI the orchestrator sent; ``config`` is
    the JSON payload of the asset (its ``dg.Config`` as a dict); ``log`` sends
    each line to the Dagster event log.
    """

    stage: str
    store: Any  # dflash_assets.store.backends.LocalStore | S3Store
    partition_key: str | None
    partition_keys: list[str]
    config: dict[str, Any]
    log: logging.Logger
    run_id: str
    asset_key: str | None


StageFn = Callable[[StageCall], StageResult]
