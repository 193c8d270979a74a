"""The model API's one table from domain errors to HTTP statuses and Ollama's error body."""

from __future__ import annotations

import json

import pytest

from registry.errors import FerryError, NotFound, TooLarge
from registry.transfer.errors import UpstreamError
from server.api_errors import APIError, error_response, status_for
from server.runner_process import RunnerError
from server.scheduler import InsufficientMemory, SchedulerClosed


@pytest.mark.parametrize(("exc", "status"), [
    (NotFound("model 'x' not found"), 404),
    (TooLarge("request body", 10), 413),
    (InsufficientMemory(2048, 1024, 512), 500),
    (SchedulerClosed(), 503),
    (RunnerError("num_ctx must be positive", runner_status=400), 400),
    (RunnerError("model x is still loading", runner_status=503), 500),
    (RunnerError("runner process has terminated (exit status 1)"), 500),
    (UpstreamError(403, "denied"), 400),
    (FerryError("something the user did wrong"), 400),
    (APIError(422, "explicit"), 422),
    (RuntimeError("a bug"), 500),
])
def test_each_error_maps_to_one_status(exc, status):
    assert status_for(exc) == status


def test_domain_errors_keep_their_fields_and_render_as_ollama_errors():
    exc = InsufficientMemory(needed=3 * 1024**3, available=1024**3, overhead=512 * 1024**2)
    assert (exc.needed, exc.available, exc.overhead) == (3 * 1024**3, 1024**3, 512 * 1024**2)
    response = error_response(exc)
    assert response.status_code == 500
    assert json.loads(response.body) == {
        "error": "model requires 3.0 GiB but only 1.0 GiB are available (after 512.0 MiB overhead)"}
