"""Shared test settings: hypothesis profiles and common fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

#: set by CI; a server that cannot start fails the run there, and skips locally
CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

settings.register_profile("dev", max_examples=60, deadline=None)
settings.register_profile("ci", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if CI else "dev"))


@pytest.fixture(autouse=True)
def _private_default_state(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point the per-user default state file into a temporary directory for every test."""
    path = tmp_path_factory.mktemp("default-state") / "state.json"
    monkeypatch.setenv("RATEQUEUE_STATE_FILE", str(path))
    return path
