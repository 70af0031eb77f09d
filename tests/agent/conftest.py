"""Fixtures of the agent's tests: the C stand-ins for libcuda and HAMi-core, built once per session."""

from __future__ import annotations

import pytest

from tests.agent import cudastubs


@pytest.fixture(scope="session")
def stubs(tmp_path_factory: pytest.TempPathFactory) -> cudastubs.Stubs:
    return cudastubs.build(tmp_path_factory.mktemp("cudastubs"))
