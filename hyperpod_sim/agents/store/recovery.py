"""How a shard store finds its shards again at startup (see :mod:`agents.store`, "At startup")."""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from pathlib import Path
from stat import S_ISREG

from hyperpod_sim.agents.store.base import Entry, SpareInfo, StoreState
from hyperpod_sim.agents.store.files import (
    DATA_SUFFIX,
    DIR_MODE,
    FILE_MODE,
    META_SUFFIX,
    decimal,
    holds_record,
    is_temp_name,
    matching_record,
    prune_empty_dirs,
    spare_id,
    subdirs,
)
from hyperpod_sim.agents.store.keys import ShardInfo, ShardKey, decode_namespace
from hyperpod_sim.contracts.shm import check_owned

log = logging.getLogger("agents.store")


class StoreRecovery(StoreState):
    """Rebuilds the index (and the spares) from the files under the root."""

    def _recover(self) -> None:
        """Rebuild the index from the files under root; remove what uncommitted writes left behind.
        UnsafeDirectory (the agent refuses to start) for a namespace's or rank's directory of
        another user's, or one that others may write."""
        for ns_dir in subdirs(self._root):
            namespace = decode_namespace(ns_dir.name)
            if namespace is None:
                continue
            self._check_dir(ns_dir)
            for rank_dir in subdirs(ns_dir):
                rank = decimal(rank_dir.name)
                if rank is not None:
                    self._check_dir(rank_dir)
                    self._recover_rank_dir(namespace, rank, rank_dir)
                    prune_empty_dirs(rank_dir, stop=self._root)

    @staticmethod
    def _check_dir(directory: Path) -> None:
        check_owned(directory, directory.lstat())
        with contextlib.suppress(OSError):
            os.chmod(directory, DIR_MODE)  # an older agent's 0755

    def _recover_rank_dir(self, namespace: str, rank: int, directory: Path) -> None:
        steps: set[int] = set()
        for name in sorted(os.listdir(directory)):
            if is_temp_name(name):
                (directory / name).unlink(missing_ok=True)
                continue
            buffer_id = spare_id(name)
            if buffer_id is not None:
                self._recover_spare(namespace, rank, directory / name, buffer_id)
                continue
            stem, dot, suffix = name.partition(".")
            step = decimal(stem)
            if step is not None and f"{dot}{suffix}" in (DATA_SUFFIX, META_SUFFIX):
                steps.add(step)
        for step in sorted(steps):
            self._recover_shard(ShardKey(namespace, rank, step))

    def _recover_spare(self, namespace: str, rank: int, path: Path, buffer_id: str) -> None:
        """Keep a spare found at startup (an agent that restarts keeps its rank's rotation); one
        that is not a plain file of this store's is removed."""
        try:
            stat = path.lstat()
        except FileNotFoundError:
            return
        if not S_ISREG(stat.st_mode) or stat.st_nlink != 1 or stat.st_uid != os.geteuid():
            path.unlink(missing_ok=True)
            return
        with contextlib.suppress(OSError):
            os.chmod(path, FILE_MODE)
        self._spares.setdefault((namespace, rank), []).append(
            SpareInfo(namespace, rank, path, stat.st_size, buffer_id)
        )
        self._spare_bytes += stat.st_size
        # Spares are made at the size the rank reserves: the next ones are made alike.
        self._rank_sizes[(namespace, rank)] = max(self._rank_sizes.get((namespace, rank), 0), stat.st_size)

    def _recover_shard(self, key: ShardKey) -> None:
        data_path = self._data_path(key)
        meta_path = data_path.with_suffix(META_SUFFIX)
        record = matching_record(data_path, meta_path, self._seal)
        problem: str | None
        if record is None:
            problem = "no sidecar that this store sealed describes it"
        else:
            problem = holds_record(data_path, record)
        if record is None or problem is not None:
            if data_path.exists():  # (a sidecar alone is what a crashed first write leaves)
                log.warning("not adopting %s: %s; removed", data_path, problem)
            data_path.unlink(missing_ok=True)
            meta_path.unlink(missing_ok=True)
            return
        for path in (data_path, meta_path):
            with contextlib.suppress(OSError):
                os.chmod(path, FILE_MODE)  # an older agent's 0644
        info = ShardInfo(
            key, record.size, record.checksum, record.replica_of, data_path, record.committed_at, record.save
        )
        # A buffer id of its own: it names this file to the trainers that map it (by buffer id),
        # also once the file is retired and reused for a later save of its rank.
        self._index[key] = Entry(info, record.inode, uuid.uuid4().hex)
        self._committed_bytes += record.size
