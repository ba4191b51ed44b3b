"""contracts/shm.py: which directories of the shared-memory tree (and above it) may be used."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from hyperpod_sim.contracts.shm import UnsafeDirectory, private_directory

NOBODY = 65534


def test_missing_directories_are_made_owner_only(tmp_path: Path) -> None:
    assert private_directory(tmp_path / "a" / "b") == tmp_path / "a" / "b"
    for path in (tmp_path / "a", tmp_path / "a" / "b"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700


def test_one_of_ours_with_a_looser_mode_is_tightened(tmp_path: Path) -> None:
    (tmp_path / "root").mkdir(mode=0o755)
    private_directory(tmp_path / "root")
    assert stat.S_IMODE((tmp_path / "root").stat().st_mode) == 0o700


def test_a_link_of_ours_on_the_way_is_followed(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert private_directory(tmp_path / "link" / "root") == tmp_path / "real" / "root"
    assert private_directory(tmp_path / "link") == tmp_path / "real"


def test_a_file_in_the_way_is_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(UnsafeDirectory, match="is not a directory"):
        private_directory(tmp_path / "file")


@pytest.mark.skipif(os.geteuid() != 0, reason="a link of another uid needs root")
def test_a_link_of_another_user_is_refused(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    os.lchown(tmp_path / "link", NOBODY, NOBODY)
    with pytest.raises(UnsafeDirectory) as caught:
        private_directory(tmp_path / "link" / "root")
    assert str(caught.value) == (
        f"{tmp_path / 'link'} is a symbolic link of uid {NOBODY}, who could point it elsewhere"
    )
    assert not (tmp_path / "real" / "root").exists()  # refused before anything was made there


@pytest.mark.skipif(os.geteuid() != 0, reason="a directory of another uid needs root")
def test_a_parent_of_another_user_is_refused(tmp_path: Path) -> None:
    (tmp_path / "theirs").mkdir(mode=0o755)
    os.chown(tmp_path / "theirs", NOBODY, NOBODY)
    with pytest.raises(UnsafeDirectory) as caught:
        private_directory(tmp_path / "theirs" / "root")
    assert str(caught.value) == (
        f"{tmp_path / 'theirs'} belongs to uid {NOBODY}, neither root nor this process's user (uid 0): "
        "that user could rename what is in it"
    )
    assert list((tmp_path / "theirs").iterdir()) == []
