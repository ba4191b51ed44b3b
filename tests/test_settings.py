"""The control plane's settings: one cached ``get_settings`` that takes serve's flags over the
``HPSIM_*`` environment (hyperpod_sim/settings.py), which ``hyperpod-sim serve`` builds from."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from hyperpod_sim.settings import get_settings


@pytest.fixture(autouse=True)
def fresh_cache() -> Iterator[None]:
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


def test_the_flags_given_win_over_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HPSIM_HOST", "127.0.0.2")
    monkeypatch.setenv("HPSIM_PORT", "9001")
    monkeypatch.setenv("HPSIM_DATABASE__URL", "sqlite:///from-the-environment.db")
    monkeypatch.setenv("HPSIM_REGION", "eu-west-1")
    settings = get_settings(port=9002, data_dir=str(tmp_path), database_url="sqlite:///from-the-flag.db")
    assert settings.port == 9002
    assert settings.data_dir == tmp_path
    assert settings.database_url() == "sqlite:///from-the-flag.db"
    # Flags not given (None) leave what the environment says.
    assert settings.host == "127.0.0.2"
    assert settings.region == "eu-west-1"


def test_without_flags_the_environment_and_the_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HPSIM_HOST", "HPSIM_DATA_DIR", "HPSIM_DATABASE__URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HPSIM_PORT", "9003")
    settings = get_settings(host=None, port=None, data_dir=None, database_url=None)
    assert settings.port == 9003
    assert settings.host == "127.0.0.1"
    assert settings.database_url().startswith("sqlite:///")
    assert settings.database_url().endswith("/.hyperpod-sim/hyperpod-sim.db")


def test_settings_are_read_once_per_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HPSIM_PORT", "9004")
    first = get_settings(host="127.0.0.3")
    monkeypatch.setenv("HPSIM_PORT", "9005")
    assert get_settings(host="127.0.0.3") is first  # cached: the environment is not read again
    assert first.port == 9004
    assert get_settings(host="127.0.0.4").port == 9005  # other flags: read now
    get_settings.cache_clear()
    assert get_settings(host="127.0.0.3").port == 9005
