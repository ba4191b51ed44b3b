"""Engine and session factory, and the schema migration entry point."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

log = logging.getLogger(__name__)

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"


def _configure_sqlite(engine: Engine) -> None:
    """WAL for concurrent readers; writers take the lock up front (BEGIN IMMEDIATE).

    pysqlite's own transaction handling is switched off so that a write transaction can start
    with BEGIN IMMEDIATE: two concurrent UpdateCluster calls then serialize on the lock instead
    of both reading the old state, and the loser sees the winner's status (ConflictException).
    """

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA busy_timeout=30000")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        if conn.get_execution_options().get("hpsim_write"):
            conn.exec_driver_sql("BEGIN IMMEDIATE")
        else:
            conn.exec_driver_sql("BEGIN")


def _owner_only(path: str | None) -> None:
    """Create the SQLite file readable and writable by its owner only (0600), or make an existing
    one so: it holds the clusters' tokens. SQLite gives its -wal and -shm files the same mode."""
    if not path or path == ":memory:" or path.startswith("file:"):
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.fchmod(fd, 0o600)
        for suffix in ("-wal", "-shm", "-journal"):
            if os.path.exists(path + suffix):
                os.chmod(path + suffix, 0o600)
    except PermissionError:  # a file we may write but do not own: its owner decides
        log.warning("cannot make the database %s owner-only (0600): it is not ours", path)
    finally:
        os.close(fd)


class DatabaseUnreachable(Exception):
    """The driver-level cause of an injected outage (what a dropped connection raises)."""


@dataclass
class Outage:
    """An injected outage of the database (the ``DatabaseOutage`` fault, hyperpod_sim/domain/faults.py): every
    statement and every commit of this process fails with ``OperationalError`` until it ends, as
    if the server had gone away. A transaction it interrupts is rolled back whole."""

    fault_id: str
    duration_s: float
    started_at: float  # epoch seconds
    ends_monotonic: float
    refused: int = 0
    ended_at: float | None = None  # epoch seconds, once over


class Database:
    """One engine per database URL; sessions for reads and for mutating transactions."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.is_sqlite = url.startswith("sqlite")
        kwargs: dict[str, Any] = {}
        if self.is_sqlite:
            kwargs["connect_args"] = {"check_same_thread": False, "timeout": 30}
            kwargs["pool_size"] = 16
        else:
            kwargs["pool_size"] = 16
            kwargs["pool_pre_ping"] = True
        self.engine = create_engine(url, **kwargs)
        if self.is_sqlite:
            _owner_only(self.engine.url.database)
            _configure_sqlite(self.engine)
        self._outage: Outage | None = None
        self._outage_lock = threading.Lock()
        #: When a statement last failed for an outage (epoch seconds; 0: never), injected or real.
        self.last_unavailable_at = 0.0
        event.listen(self.engine, "before_cursor_execute", self._refuse_statement)
        event.listen(self.engine, "commit", self._refuse_commit)
        event.listen(self.engine, "handle_error", self._note_error)
        self._read = sessionmaker(self.engine, expire_on_commit=False)
        self._write = sessionmaker(self.engine.execution_options(hpsim_write=True), expire_on_commit=False)

    @contextmanager
    def read(self) -> Iterator[Session]:
        with self._read() as session:
            yield session

    @contextmanager
    def write(self) -> Iterator[Session]:
        """One transaction: committed when the block ends, rolled back on any error."""
        with self._write() as session, session.begin():
            yield session

    # ------------------------------------------------------------------ injected outages

    def begin_outage(self, *, fault_id: str, duration_s: float) -> Outage:
        """Make the database unreachable for this process for ``duration_s`` seconds."""
        with self._outage_lock:
            self._outage = Outage(
                fault_id=fault_id,
                duration_s=duration_s,
                started_at=time.time(),
                ends_monotonic=time.monotonic() + duration_s,
            )
            return self._outage

    def outage(self) -> Outage | None:
        """The outage this process is in or has just come out of (until :meth:`end_outage`)."""
        with self._outage_lock:
            outage = self._outage
            if outage is not None and outage.ended_at is None and time.monotonic() >= outage.ends_monotonic:
                outage.ended_at = time.time()
            return outage

    def end_outage(self, *, fault_id: str | None = None) -> Outage | None:
        """Forget the outage (ending it now if it still runs); the one forgotten. With ``fault_id``
        only that one."""
        with self._outage_lock:
            outage = self._outage
            if outage is None or (fault_id is not None and outage.fault_id != fault_id):
                return None
            if outage.ended_at is None:
                outage.ended_at = time.time()
            self._outage = None
            return outage

    def _unreachable(self) -> Outage | None:
        outage = self._outage
        if outage is None or outage.ended_at is not None or time.monotonic() >= outage.ends_monotonic:
            return None
        with self._outage_lock:
            outage.refused += 1
        self.last_unavailable_at = time.time()
        return outage

    def _note_error(self, context: Any) -> None:
        """A real outage (a lost connection, a server that does not answer) counts too."""
        if context.is_disconnect or isinstance(context.sqlalchemy_exception, OperationalError):
            self.last_unavailable_at = time.time()

    def _refuse_statement(
        self, conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool
    ) -> None:
        outage = self._unreachable()
        if outage is not None:
            raise OperationalError(statement, parameters, _cause(outage))

    def _refuse_commit(self, conn: Any) -> None:
        outage = self._unreachable()
        if outage is not None:
            raise OperationalError("COMMIT", None, _cause(outage))

    def migrate(self) -> None:
        """Bring the schema to the newest revision (the only way the schema is made)."""
        from alembic import command

        command.upgrade(alembic_config(self.url), "head")

    def dispose(self) -> None:
        self.engine.dispose()


def _cause(outage: Outage) -> DatabaseUnreachable:
    return DatabaseUnreachable(
        f"the database is unreachable (fault {outage.fault_id}, an injected DatabaseOutage)"
    )


def alembic_config(url: str) -> Any:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg
