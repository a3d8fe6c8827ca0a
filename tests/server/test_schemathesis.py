"""Fuzz the plan and calibration endpoints with schemathesis, from the app's own OpenAPI schema, with the API token:
no generated request may get a 5xx. At least 500 generated cases are sent (counted, and the count is asserted)."""

from __future__ import annotations

from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from server.app import create_app
from server.settings import Settings

# Examples per operation. GET /plan has one enum parameter: Hypothesis runs out of distinct cases after a few.
EXAMPLES = {("POST", "/plan"): 400, ("POST", "/plan/batch"): 150, ("GET", "/plan"): 20,
            ("POST", "/calibrations"): 100, ("GET", "/calibrations"): 50, ("DELETE", "/calibrations/{digest}"): 30}
MIN_CASES = 500
TOKEN = "fuzz-token"
AUTHORIZED = {"Authorization": f"Bearer {TOKEN}"}


def fuzz(operation, examples: int, statuses: Counter) -> None:
    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy())
    def one_case(case) -> None:
        response = case.call(headers=AUTHORIZED)
        statuses[response.status_code] += 1
        assert response.status_code < 500, f"{case.method} {case.path} -> {response.status_code}: {response.text}"

    one_case()


@pytest.mark.heavy  # 750 generated requests
def test_plan_and_calibration_endpoints_never_answer_5xx_over_500_generated_cases(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGE_SELECT_CACHE_DIR", str(tmp_path))  # the calibration store: this test's own
    app = create_app(Settings(api_token=TOKEN))
    schema = schemathesis.openapi.from_asgi("/openapi.json", app, headers=AUTHORIZED)
    schema = schema.include(path_regex="^/(plan|calibrations)")
    statuses: Counter = Counter()
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {(op.method.upper(), op.path) for op in operations} == set(EXAMPLES)
    for operation in operations:
        fuzz(operation, EXAMPLES[(operation.method.upper(), operation.path)], statuses)
    print(f"schemathesis cases by status: {dict(statuses)}")
    assert sum(statuses.values()) >= MIN_CASES, statuses
    assert statuses[200] > 0, f"no generated request was planned at all: {statuses}"
    assert statuses[401] == 0, f"the token did not reach every request: {statuses}"
