"""A bounded schemathesis run against a live control plane: every operation of the OpenAPI document,
with its documented examples and a few generated requests (valid ones and broken ones), must get no
5xx, no status the document does not list, and no answer that breaks its schema.

Bounded to stay within a minute or two on two cores: a fixed number of requests per operation,
derandomized (the same requests every run), no shrinking (a failure is reported as found).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import httpx
import hypothesis
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.conftest import EKS, ControlPlane, group

CHECKS = [not_a_server_error, status_code_conformance, response_schema_conformance, content_type_conformance]
# Generated requests per operation and mode (the documented examples come on top).
PER_OPERATION = {GenerationMode.POSITIVE: 15, GenerationMode.NEGATIVE: 10}
# Operations that would take the service away from the rest of the run: a control-plane fault
# makes its database unreachable, and every later answer a documented 503.
SKIPPED = {"InjectControlPlaneFault"}
# The AWS JSON entry's body is JSON under AWS's media type.
schemathesis.serializer.alias("application/x-amz-json-1.1", "application/json")


def _settings(examples: int) -> Callable[[Any], Any]:
    return hypothesis.settings(
        max_examples=examples,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.explicit, Phase.generate],  # no shrinking: report what was found
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )


def fuzz(url: str, per_operation: dict[GenerationMode, int]) -> dict[str, str]:
    """Send each operation's examples and ``per_operation`` generated requests to ``url``; the
    failures found, by operation, with schemathesis's report."""
    document = httpx.get(f"{url}/openapi.json", timeout=30).json()
    schema = schemathesis.openapi.from_dict(document)
    failures: dict[str, str] = {}
    requests = 0
    started = time.monotonic()

    def run(strategy: Any, examples: int) -> None:
        def call(case: Any) -> None:
            send(case)

        # Unsatisfiable: nothing to break in it (no parameter, no body).
        with contextlib.suppress(hypothesis.errors.Unsatisfiable):
            hypothesis.given(strategy)(_settings(examples)(call))()

    def send(case: Any) -> None:
        nonlocal requests
        requests += 1
        try:
            case.call_and_validate(base_url=url, checks=CHECKS, timeout=30)
        except (Exception, FailureGroup) as exc:  # once per operation, with schemathesis's report
            failures.setdefault(f"{case.method} {case.path}", str(exc)[:2000])

    for result in schema.get_all_operations():
        operation = result.ok()
        if operation.definition.raw.get("operationId") in SKIPPED:
            continue
        for example in schema.get_strategies_from_examples(operation):
            run(example, 1)
        for mode, examples in per_operation.items():
            run(operation.as_strategy(generation_mode=mode), examples)

    elapsed = time.monotonic() - started
    print(f"schemathesis: {requests} requests in {elapsed:.0f} s, {len(failures)} operations failing")
    return failures


def _report(failures: dict[str, str]) -> str:
    return "\n\n".join(f"{where}:\n{report}" for where, report in failures.items())


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_no_answer_breaks_the_document(control_plane: ControlPlane) -> None:
    with httpx.Client(base_url=control_plane.url, timeout=30) as http:
        # What the examples name ("demo", a node of it) exists, so they reach real answers.
        body = {"ClusterName": "demo", "InstanceGroups": [group("workers", 2)], "Orchestrator": EKS}
        assert http.post("/clusters", json=body).status_code == 200
    failures = fuzz(control_plane.url, PER_OPERATION)
    assert failures == {}, _report(failures)


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
class TestWithAuthOn:
    """Unsigned requests: the 401s (403s at the AWS JSON entry) are documented with their shape."""

    @pytest.fixture
    def settings_overrides(self) -> dict[str, Any]:
        return {"auth": {"credentials": {"AKIDFUZZ": "fuzz-secret"}}}

    def test_no_answer_breaks_the_document(self, control_plane: ControlPlane) -> None:
        failures = fuzz(control_plane.url, {GenerationMode.POSITIVE: 3, GenerationMode.NEGATIVE: 2})
        assert failures == {}, _report(failures)
