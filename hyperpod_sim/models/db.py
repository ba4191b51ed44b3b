"""Engine and session factory, and the schema migration entry point.

A database that does not answer is an outage, whether it refuses connections or holds them:
every wait on it is bounded (:class:`Timeouts`: a pooled connection within ``pool_s``, a new one
within ``connect_s``, a statement within ``statement_s`` on the server and a little more on the
client, where a PostgreSQL connection whose answer does not come is closed), and what times out
fails with ``OperationalError`` like a refused connection, which the API answers 503. Each such
failure, and each statement that waited longer than ``pool_s`` for its answer, is noted
(:meth:`Database.unavailable_ago`): heartbeat deadlines count from it, so silence the control
plane could not record fails no node. It is kept as a monotonic instant and answered as an age, so
that the reconciler counts it on its own clock (an injected one in tests) and no change of the
wall clock can move it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.exc import OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.orm import Session, sessionmaker

log = logging.getLogger(__name__)

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"


@dataclass(frozen=True)
class Timeouts:
    """How long the control plane waits on its database (settings: ``HPSIM_DATABASE__*``)."""

    pool_s: float = 2.0  # for a pooled connection; a statement slower than this counts as a stall
    connect_s: float = 5.0  # for a new connection (PostgreSQL's connect_timeout)
    statement_s: float = 5.0  # PostgreSQL's statement_timeout and lock_timeout

    @property
    def answer_s(self) -> float:
        """The client's own deadline for any answer: past the server's statement timeout, so that
        a server that runs answers with its own error first."""
        return self.statement_s + 2.0


# SQLite's wait for its file's write lock. A local lock, not a server that may stall: under load
# (CI's two cores, four test workers) a writer waits seconds behind the reconciler's transactions,
# and failing it at 5 s failed agent restarts and heartbeats that were only queued. As before the
# bounded timeouts of issue 23, which are for a database over a network.
SQLITE_BUSY_S = 30.0


def _configure_sqlite(engine: Engine, timeouts: Timeouts) -> None:
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
        cursor.execute(f"PRAGMA busy_timeout={int(SQLITE_BUSY_S * 1000)}")
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
    """The driver-level cause of an injected outage or hang, or of a wait on the database that
    timed out (what a dropped connection raises)."""


OUTAGE, HANG = "DatabaseOutage", "DatabaseHang"


@dataclass
class Outage:
    """An injected fault of the database (hyperpod_sim/domain/faults.py). ``DatabaseOutage``: every
    statement and every commit of this process fails with ``OperationalError`` until it ends, as
    if the server had gone away. ``DatabaseHang``: every statement and commit waits for an answer
    that does not come, as through a network stall, a failover or a lock storm; one still waiting
    when the client's deadline (:attr:`Timeouts.answer_s`) passes fails as a timed-out one does, one
    whose wait the hang's end cuts short goes on, late. A transaction either interrupts is rolled
    back whole."""

    fault_id: str
    duration_s: float
    started_at: float  # epoch seconds
    ends_monotonic: float
    kind: str = OUTAGE
    refused: int = 0  # statements failed (an outage's at once, a hang's past the deadline)
    held: int = 0  # a hang's statements answered late, once it ended
    ended_at: float | None = None  # epoch seconds, once over
    over: threading.Event = field(default_factory=threading.Event, repr=False)


class Database:
    """One engine per database URL; sessions for reads and for mutating transactions."""

    def __init__(self, url: str, *, timeouts: Timeouts | None = None) -> None:
        self.url = url
        self.is_sqlite = url.startswith("sqlite")
        self.timeouts = timeouts = timeouts or Timeouts()
        kwargs: dict[str, Any] = {"pool_size": 16, "pool_timeout": timeouts.pool_s}
        if self.is_sqlite:
            kwargs["connect_args"] = {"check_same_thread": False, "timeout": timeouts.statement_s}
        else:
            kwargs["pool_pre_ping"] = True
            kwargs["connect_args"] = _postgresql_timeouts(url, timeouts)
        self.engine = create_engine(url, **kwargs)
        if self.is_sqlite:
            _owner_only(self.engine.url.database)
            _configure_sqlite(self.engine, timeouts)
        elif self.engine.dialect.driver == "psycopg":
            connection_class = _bounded_connection_class(timeouts.answer_s)
            event.listen(
                self.engine,
                "do_connect",
                lambda _dialect, _record, cargs, cparams: connection_class.connect(*cargs, **cparams),
            )
        self._outage: Outage | None = None
        self._outage_lock = threading.Lock()
        #: When a statement last failed for an outage (monotonic seconds; None: never), injected or
        #: real, or last waited longer than ``pool_s`` for its answer; when one last got its answer.
        self.last_unavailable_at: float | None = None
        self.last_answered_at: float | None = None
        # Statements waiting for their answer: id of their connection -> since (monotonic).
        self._in_flight: dict[int, float] = {}
        event.listen(self.engine, "before_cursor_execute", self._statement_starts)
        event.listen(self.engine, "before_cursor_execute", self._refuse_statement)
        event.listen(self.engine, "after_cursor_execute", self._statement_answered)
        event.listen(self.engine, "commit", self._refuse_commit)
        event.listen(self.engine, "handle_error", self._note_error)
        self._read = sessionmaker(self.engine, expire_on_commit=False)
        self._write = sessionmaker(self.engine.execution_options(hpsim_write=True), expire_on_commit=False)

    @contextmanager
    def read(self) -> Iterator[Session]:
        with self._unavailable_raises(), self._read() as session:
            yield session

    @contextmanager
    def connect(self) -> Iterator[Connection]:
        """A Core connection, for a prepared read (an outage raises as ``read`` does)."""
        with self._unavailable_raises(), self.engine.connect() as conn:
            yield conn

    @contextmanager
    def write(self) -> Iterator[Session]:
        """One transaction: committed when the block ends, rolled back on any error."""
        with self._unavailable_raises(), self._write() as session, session.begin():
            yield session

    @contextmanager
    def _unavailable_raises(self) -> Iterator[None]:
        """No pooled connection free within ``pool_s`` (every one waits on a database that does
        not answer) is an outage too: ``OperationalError``, noted as one."""
        try:
            yield
        except PoolTimeout as exc:
            self.last_unavailable_at = time.monotonic()
            cause = DatabaseUnreachable(
                f"no database connection came free within {self.timeouts.pool_s:g} s: each waits on "
                "a database that does not answer"
            )
            raise OperationalError("checkout", None, cause) from exc
        except OperationalError:
            self.last_unavailable_at = time.monotonic()
            raise

    # ------------------------------------------------------------------ is it answering?

    def unavailable_ago(self) -> float | None:
        """How many seconds ago the control plane last could not hear through its database: since
        the last failed or stalled statement's end, 0 while one has waited longer than ``pool_s``
        for its answer or an injected fault is in force, None if it always could. Heartbeat
        deadlines count from then (the reconciler places it on its own clock)."""
        if self._stalled_since() is not None or self._fault_in_force() is not None:
            return 0.0
        if self.last_unavailable_at is None:
            return None
        return max(0.0, time.monotonic() - self.last_unavailable_at)

    def answers(self) -> str | None:
        """None when the database answers, else why not (from memory: no statement is sent)."""
        fault = self._fault_in_force()
        if fault is not None:
            return f"it is in an injected {fault.kind} (fault {fault.fault_id})"
        stalled = self._stalled_since()
        if stalled is not None:
            return f"a statement has waited {time.monotonic() - stalled:.0f} s for its answer"
        if self.last_unavailable_at is not None and (
            self.last_answered_at is None or self.last_unavailable_at > self.last_answered_at
        ):
            return "its last statement failed: it did not answer"
        return None

    def _stalled_since(self) -> float | None:
        """Since when the oldest statement still waiting has waited, if longer than ``pool_s``.
        (One older than the client's deadline by far is a leftover of a path that did not report
        its end: ignored, so that it cannot hold every deadline off for good.)"""
        now = time.monotonic()
        oldest = min(tuple(self._in_flight.values()), default=None)  # a copy: other threads write it
        if oldest is None or not self.timeouts.pool_s < now - oldest < self.timeouts.answer_s + 10:
            return None
        return oldest

    def _fault_in_force(self) -> Outage | None:
        outage = self._outage
        if outage is None or outage.ended_at is not None or time.monotonic() >= outage.ends_monotonic:
            return None
        return outage

    def _statement_starts(
        self, conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool
    ) -> None:
        self._in_flight[id(conn)] = time.monotonic()

    def _statement_answered(
        self, conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool
    ) -> None:
        started = self._in_flight.pop(id(conn), None)
        now = time.monotonic()
        if started is not None and now - started > self.timeouts.pool_s:
            self.last_unavailable_at = now  # answered, but only after a stall
        self.last_answered_at = now

    # ------------------------------------------------------------------ injected outages

    def begin_outage(self, *, fault_id: str, duration_s: float, kind: str = OUTAGE) -> Outage:
        """Make the database unreachable (``DatabaseOutage``) or silent (``DatabaseHang``) for this
        process for ``duration_s`` seconds."""
        with self._outage_lock:
            self._outage = Outage(
                fault_id=fault_id,
                duration_s=duration_s,
                started_at=time.time(),
                ends_monotonic=time.monotonic() + duration_s,
                kind=kind,
            )
            return self._outage

    def outage(self) -> Outage | None:
        """The outage this process is in or has just come out of (until :meth:`end_outage`)."""
        with self._outage_lock:
            outage = self._outage
            if outage is not None and outage.ended_at is None and time.monotonic() >= outage.ends_monotonic:
                outage.ended_at = time.time()
                outage.over.set()
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
            outage.over.set()
            self._outage = None
            return outage

    def _unreachable(self, what: str) -> OperationalError | None:
        """What an injected fault makes of a statement or commit now: for an outage, its failure;
        for a hang, a wait for the hang's end, and the failure if the client's deadline passes
        first. None: it goes through."""
        outage = self._fault_in_force()
        if outage is None:
            return None
        if outage.kind == HANG:
            deadline = self.timeouts.answer_s
            left = outage.ends_monotonic - time.monotonic()
            over = outage.over.wait(min(max(left, 0.0), deadline)) or left <= deadline
            self.last_unavailable_at = time.monotonic()
            with self._outage_lock:
                if over:
                    outage.held += 1
                    return None
                outage.refused += 1
            cause = DatabaseUnreachable(
                f"the database did not answer within {deadline:g} s (fault {outage.fault_id}, an "
                "injected DatabaseHang)"
            )
            return OperationalError(what, None, cause)
        with self._outage_lock:
            outage.refused += 1
        self.last_unavailable_at = time.monotonic()
        cause = DatabaseUnreachable(
            f"the database is unreachable (fault {outage.fault_id}, an injected DatabaseOutage)"
        )
        return OperationalError(what, None, cause)

    def _note_error(self, context: Any) -> None:
        """A real outage (a lost connection, a server that does not answer) counts too."""
        connection = context.connection
        if connection is not None:
            self._in_flight.pop(id(connection), None)
        if context.is_disconnect or isinstance(context.sqlalchemy_exception, OperationalError):
            self.last_unavailable_at = time.monotonic()

    def _refuse_statement(
        self, conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool
    ) -> None:
        refused = self._unreachable(statement)
        if refused is not None:
            self._in_flight.pop(id(conn), None)
            raise refused

    def _refuse_commit(self, conn: Any) -> None:
        refused = self._unreachable("COMMIT")
        if refused is not None:
            raise refused

    def migrate(self) -> None:
        """Bring the schema to the newest revision (the only way the schema is made)."""
        from alembic import command

        command.upgrade(alembic_config(self.url), "head")

    def dispose(self) -> None:
        self.engine.dispose()


def _postgresql_timeouts(url: str, timeouts: Timeouts) -> dict[str, Any]:
    """libpq's connect_timeout, and the server's statement and lock timeouts for every session
    (added to any ``options`` the URL already sets)."""
    from sqlalchemy.engine import make_url

    ms = int(timeouts.statement_s * 1000)
    options = f"-c statement_timeout={ms} -c lock_timeout={ms}"
    given = make_url(url).query.get("options")
    if isinstance(given, str) and given:
        options = f"{given} {options}"
    return {"connect_timeout": max(1, round(timeouts.connect_s)), "options": options}


def _bounded_connection_class(answer_s: float) -> Any:
    """A psycopg connection whose every wait for the server (a statement, a commit, a rollback,
    the pool's ping) ends after ``answer_s`` seconds at most: past it the connection is closed (a
    server that does not answer leaves it in no known state) and ``OperationalError`` raised, which
    SQLAlchemy takes for a lost connection. libpq itself waits as long as the socket is open, and a
    stalled network or proxy keeps it open."""
    import psycopg
    from psycopg import errors

    class BoundedConnection(psycopg.Connection[Any]):
        def wait(self, gen: Any, *args: Any, **kwargs: Any) -> Any:
            if len(args) > 1 or kwargs.get("timeout") is not None:
                return super().wait(gen, *args, **kwargs)  # the caller bounds it
            try:
                return super().wait(gen, *args, **{**kwargs, "timeout": answer_s})
            except errors._WaitTimeout:
                self.pgconn.finish()
                raise psycopg.OperationalError(
                    f"the database did not answer within {answer_s:g} s; the connection was closed"
                ) from None

    return BoundedConnection


def alembic_config(url: str) -> Any:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg
