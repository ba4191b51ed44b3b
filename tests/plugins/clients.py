"""Fixtures: clients of a control plane that several test modules share (a module may override
one with its own)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from hyperpod_sim.sdk.client import HyperPodClient
from tests.conftest import ControlPlane


@pytest.fixture
def client(agent_plane: ControlPlane) -> Any:
    with HyperPodClient(agent_plane.url) as running:
        yield running


@pytest.fixture
def http(control_plane: ControlPlane) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=control_plane.url, timeout=30) as client:
        yield client
