"""A trainer's client of its node's agent: the in-memory tier's HTTP protocol and the same-host
fast path (docs/sdk.md).

Fast path: the agent reserves room for a shard as a file in its shared memory and answers the
file's path; the trainer maps it, copies its tensors straight in and asks the agent to commit
(the agent hashes and publishes it). The agent hands each rank's saves files of its rotation
(spares it prepared after the rank's first save, prefaulted, and files of retired steps), named by
buffer ids; the commit's answer names the rank's spares and the client maps them ahead, so the
trainer keeps its mappings per buffer id and from the second save on writes into pages that are
already mapped. Reads map the
agent's copy read-only and verify its checksum. When the agent's files cannot be opened (another
host, another container), everything goes over HTTP.

Nothing an agent answers is trusted: the SDK maps only a regular file under the shared-memory root
it was configured with (``shm_root``, else ``HPSIM_SIMULATION__SHM_ROOT``, else the agents'
default ``/dev/shm/hpsim``), reached from that root without following a symbolic link, with one
link and exactly the size expected (``open_shared``); for anything else it logs why and uses HTTP.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import mmap
import os
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import quote

import httpx

from hyperpod_sim.contracts.agent_api import (
    CHECKSUM_PARAMETER,
    CP_LATEST_ROUTE,
    CP_NAMESPACE_ROUTE,
    CP_SHARD_ROUTE,
    FAST_ABORT_ROUTE,
    FAST_COMMIT_ROUTE,
    FAST_RELEASE_ROUTE,
    FAST_RESERVE_ROUTE,
    FAST_SHARD_ROUTE,
    SAVE_PARAMETER,
    WORLD_SIZES_PARAMETER,
    agent_path,
)
from hyperpod_sim.contracts.agent_bodies import (
    AgentBody,
    FastCommitted,
    FastLocation,
    FastReservation,
    LatestSteps,
    NamespaceAnswer,
    SpareBuffer,
    problem_of,
)
from hyperpod_sim.contracts.shards import (
    SHARD_META,
    TIER_HEADER,
    ShardMetaError,
    checksum_of,
    parse_shard_meta,
    shard_meta,
)
from hyperpod_sim.sdk.device_copy import CudaHostRegistrar, HostRegistrar

log = logging.getLogger(__name__)
Body = TypeVar("Body", bound=AgentBody)

# Mappings kept per client: the rotation of one rank is in-memory retention + 1 files; several
# namespaces or ranks per process need a few more.
MAX_MAPPINGS = 16
CHUNK = 1 << 20  # request bodies go out in pieces of this size
DEFAULT_SHM_ROOT = "/dev/shm/hpsim"  # where agents keep their shards unless configured otherwise


class AgentError(Exception):
    """The agent refused a call, or could not be reached."""

    def __init__(self, message: str, *, status: int | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class ReservationLost(AgentError):
    """A write that the agent no longer holds at its commit (it restarted, the write expired, or,
    for one reserved ahead, the namespace was reset): the bytes are in a file the agent gave up,
    so the shard is written again (a new reservation, or over HTTP)."""


class UntrustedPath(Exception):
    """A file an agent named that this client will not map (outside its root, a link, not a
    regular file, another size)."""


def shm_root_from(environ: dict[str, str] | None = None) -> str:
    """The shared-memory root to trust: ``HPSIM_SIMULATION__SHM_ROOT`` (what the control plane
    lays its nodes' directories under), else ``/dev/shm/hpsim``."""
    env = os.environ if environ is None else environ
    return env.get("HPSIM_SIMULATION__SHM_ROOT") or DEFAULT_SHM_ROOT


def open_shared(root: str | os.PathLike[str], path: object, *, size: int, writable: bool) -> int:
    """A descriptor of ``path``, which an agent named, if it is a regular file below ``root`` with a
    single link and exactly ``size`` bytes, opened from ``root`` one component at a time with
    ``O_NOFOLLOW`` (so no symbolic link below the root is followed, and none can be swapped in
    meanwhile) and ``O_NONBLOCK`` (a FIFO cannot hang the open). The root itself is the caller's
    own configuration and is taken as it is. UntrustedPath when the file is not one to map;
    OSError when it cannot be opened (another host's path)."""
    if not isinstance(path, str) or not os.path.isabs(path) or "\x00" in path:
        raise UntrustedPath(f"{str(path)[:200]!r} is not an absolute path")
    configured = os.path.normpath(os.path.abspath(os.fspath(root)))
    for base in dict.fromkeys((configured, os.path.realpath(configured))):
        if path.startswith(base.rstrip(os.sep) + os.sep):
            break
    else:
        raise UntrustedPath(f"{path[:200]!r} is not under the shared-memory root {configured}")
    parts = path[len(base.rstrip(os.sep)) + 1 :].split(os.sep)
    if any(part in ("", ".", "..") for part in parts):
        raise UntrustedPath(f"{path[:200]!r} is not a plain path below {base}")
    directory = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts[:-1]:
            flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
            below = os.open(part, flags, dir_fd=directory)
            os.close(directory)
            directory = below
        mode = os.O_RDWR if writable else os.O_RDONLY
        fd = os.open(
            parts[-1], mode | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, dir_fd=directory
        )
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UntrustedPath(f"{path[:200]!r} is or passes through a symbolic link") from exc
        raise
    finally:
        os.close(directory)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UntrustedPath(f"{path[:200]!r} is not a regular file")
        if info.st_nlink != 1:
            raise UntrustedPath(f"{path[:200]!r} has {info.st_nlink} hard links")
        if info.st_size != size:
            raise UntrustedPath(f"{path[:200]!r} holds {info.st_size} bytes, not the {size} expected")
    except BaseException:
        os.close(fd)
        raise
    return fd


def discover_agent_url(environ: dict[str, str] | None = None) -> str:
    """This node's agent, from the environment: ``HPSIM_AGENT_URL``, or the node's
    ``AgentStatus.Endpoint`` from the control plane (``HPSIM_CONTROL_PLANE_URL``,
    ``HPSIM_CLUSTER`` and ``HPSIM_NODE_ID``)."""
    env = os.environ if environ is None else environ
    if env.get("HPSIM_AGENT_URL"):
        return env["HPSIM_AGENT_URL"].rstrip("/")
    control_plane, cluster, node = (
        env.get(k) for k in ("HPSIM_CONTROL_PLANE_URL", "HPSIM_CLUSTER", "HPSIM_NODE_ID")
    )
    if not (control_plane and cluster and node):
        raise AgentError(
            "no agent to checkpoint to: set HPSIM_AGENT_URL, or HPSIM_CONTROL_PLANE_URL, HPSIM_CLUSTER "
            "and HPSIM_NODE_ID, or pass agent_url"
        )
    url = f"{control_plane.rstrip('/')}/clusters/{quote(cluster, safe='')}/nodes/{quote(node, safe='')}"
    response = httpx.get(url, timeout=10.0, trust_env=False)
    if response.status_code != 200:
        raise AgentError(f"cannot describe node {node} of {cluster}: {response.text[:300]}")
    endpoint = (response.json()["NodeDetails"].get("AgentStatus") or {}).get("Endpoint")
    if not endpoint:
        raise AgentError(f"node {node} of {cluster} has no agent endpoint yet")
    return str(endpoint).rstrip("/")


@dataclass
class _Mapping:
    mapping: mmap.mmap
    size: int
    inode: tuple[int, int]  # device and inode of the file mapped: reused only for that same file
    pinned: bool = False  # registered with CUDA as page-locked host memory
    pin_refused: bool = False  # the driver refused to register it: not asked again


@dataclass
class FastWrite:
    """An open same-host write: fill ``view`` (the mapped file), then ``AgentClient.commit``."""

    token: str
    size: int
    buffer_id: str
    view: memoryview
    pin_for_cuda: Callable[[], None]
    namespace: str = ""
    rank: int = 0
    step: int = 0  # the step it commits as
    # Reserved ahead (after the rank's previous commit, under a placeholder step): the commit
    # names ``step``, and it is used only before ``usable_until`` (this process's monotonic clock).
    ahead: bool = False
    usable_until: float = 0.0


class AgentClient:
    """``shm_root``: the only directory whose files the fast path maps (default: ``shm_root_from()``).
    ``checkpoint_token``: the cluster's checkpoint token (``GET /clusters/{name}/checkpoint-token``),
    default ``HPSIM_CHECKPOINT_TOKEN``; sent on every call, and needed for saves and deletes when the
    cluster's ``AgentAccess`` is ``Token``."""

    def __init__(
        self,
        base_url: str,
        *,
        fast_path: bool = True,
        timeout_s: float = 600.0,
        shm_root: str | os.PathLike[str] | None = None,
        checkpoint_token: str | None = None,
        host_registrar: HostRegistrar | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        # Registers mapped buffers as pinned memory for device-to-host copies (sdk/device_copy.py).
        self._registrar: HostRegistrar = host_registrar or CudaHostRegistrar()
        self.fast_path = fast_path
        self.shm_root = os.fspath(shm_root) if shm_root is not None else shm_root_from()
        token = checkpoint_token or os.environ.get("HPSIM_CHECKPOINT_TOKEN")
        self._http = httpx.Client(
            base_url=self.base_url,
            timeout=httpx.Timeout(10.0, read=timeout_s),
            trust_env=False,
            headers={"Authorization": f"Bearer {token}"} if token else None,
        )
        self._mappings: OrderedDict[str, _Mapping] = OrderedDict()
        self._read_maps: OrderedDict[str, tuple[mmap.mmap, tuple[int, int]]] = OrderedDict()
        self._namespaces: dict[str, NamespaceAnswer] = {}  # known to exist (a save per step asks once)
        # (namespace, rank) -> its next write, reserved when its last one was committed.
        self._ahead: dict[tuple[str, int], FastWrite] = {}
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            ahead = list(self._ahead.values())
            self._ahead.clear()
        for write in ahead:
            self.abort(write.token)  # the agent keeps its file as the rank's spare
        with self._lock:
            for entry in self._mappings.values():
                self._unmap(entry)
            self._mappings.clear()
            for mapping, _ in self._read_maps.values():
                with contextlib.suppress(BufferError):
                    mapping.close()
            self._read_maps.clear()
        self._http.close()

    def _pin(self, entry: _Mapping) -> None:
        """Register a mapping as pinned memory once in its life (never again per step), so that
        device-to-host copies into it run at DMA speed; one the driver refused is not asked again."""
        if entry.pinned or entry.pin_refused or not entry.size:
            return
        entry.pinned = self._registrar.register(_address(entry.mapping), entry.size)
        entry.pin_refused = not entry.pinned

    def _unmap(self, entry: _Mapping) -> None:
        if entry.pinned:  # unregistered while it is still mapped
            self._registrar.unregister(_address(entry.mapping))
            entry.pinned = False
        with contextlib.suppress(BufferError):  # a view is still out: unmapped when it is released
            entry.mapping.close()

    # ------------------------------------------------------------------ protocol

    def _call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            return self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise AgentError(f"the agent at {self.base_url} did not answer {method} {path}: {exc}") from exc

    @staticmethod
    def _fail(response: httpx.Response, what: str) -> AgentError:
        try:
            doc = response.json()
            code, message = doc.get("error"), doc.get("message")
        except ValueError:
            code, message = None, response.text[:300]
        return AgentError(
            f"{what}: {response.status_code} {code}: {message}", status=response.status_code, code=code
        )

    def ensure_namespace(
        self, namespace: str, *, num_ranks: int, steps_retained: int, needs: int | None = None
    ) -> NamespaceAnswer:
        """The namespace, created with ``num_ranks`` ranks if it does not exist; AgentError if it
        has fewer than ``needs`` (default ``num_ranks``): a job of any world size up to the
        namespace's ranks less the metadata rank saves in it (docs/sdk.md#resharding)."""
        needs = num_ranks if needs is None else needs
        known = self._namespaces.get(namespace)
        if known is not None and known.num_ranks >= needs:
            return known
        path = agent_path(CP_NAMESPACE_ROUTE, namespace=namespace)
        response = self._call("GET", path)
        if response.status_code == 404:
            response = self._call(
                "POST", path, params={"num_ranks": num_ranks, "steps_retained": steps_retained}
            )
            if response.status_code == 409:
                response = self._call("GET", path)
        if response.status_code not in (200, 201):
            raise self._fail(response, f"namespace {namespace!r}")
        doc = _parsed(NamespaceAnswer, response, f"namespace {namespace!r}")
        self._namespaces[namespace] = doc
        if doc.num_ranks < needs:
            raise AgentError(
                f"namespace {namespace!r} has {doc.num_ranks} ranks (its first job's world size + 1 for "
                f"the metadata), fewer than the {needs} this job needs: a job saves in a namespace "
                "made for at least its world size (TieredCheckpointConfig.max_world_size when it is "
                "created), or in another namespace"
            )
        return doc

    def namespace(self, namespace: str) -> NamespaceAnswer | None:
        """The namespace as the agent knows it (its ranks: the metadata is the last), or None if
        it does not exist; AgentError if the agent does not answer."""
        known = self._namespaces.get(namespace)
        if known is not None:
            return known
        response = self._call("GET", agent_path(CP_NAMESPACE_ROUTE, namespace=namespace))
        if response.status_code == 404:
            return None
        if response.status_code != 200:
            raise self._fail(response, f"namespace {namespace!r}")
        doc = _parsed(NamespaceAnswer, response, f"namespace {namespace!r}")
        self._namespaces[namespace] = doc
        return doc

    def latest(self, namespace: str, *, limit: int = 5) -> list[int]:
        """The newest complete steps, newest first, whatever the world size that saved each."""
        return list(self.latest_sizes(namespace, limit=limit))

    def latest_sizes(self, namespace: str, *, limit: int = 5) -> dict[int, int]:
        """The newest complete steps, newest first, each with the world size of the job that saved
        it (``?world_sizes=true``; without it the agent answers the library's view: the steps of
        the namespace's own world size only)."""
        response = self._call(
            "GET",
            agent_path(CP_LATEST_ROUTE, namespace=namespace),
            params={"limit": limit, WORLD_SIZES_PARAMETER: "true"},
        )
        if response.status_code == 404:
            return {}
        if response.status_code != 200:
            raise self._fail(response, "latest")
        doc = _parsed(LatestSteps, response, "latest")
        return {step: doc.world_sizes[step] for step in doc.steps}

    def put(
        self,
        namespace: str,
        rank: int,
        step: int,
        data: bytes | bytearray | memoryview,
        *,
        save: str | None = None,
    ) -> str:
        """Save a shard over HTTP (of save ``save`` of its step, if given); its checksum."""
        checksum = checksum_of(data)
        meta = shard_meta(checksum, save)
        view = memoryview(data).cast("B")
        # In 1 MiB pieces: httpcore sends a bytes body by slicing off what each send took, which
        # copies the rest every time (a 1 GiB body took minutes); the length is known up front.
        pieces = (bytes(view[i : i + CHUNK]) for i in range(0, len(view), CHUNK))
        response = self._call(
            "POST", agent_path(CP_SHARD_ROUTE, namespace=namespace, rank=rank, step=step), content=pieces,
            headers={SHARD_META: meta, "Content-Length": str(len(view))},
        )  # fmt: skip
        if response.status_code != 200:
            raise self._fail(response, f"save of rank {rank} step {step}")
        return checksum

    def get(
        self, namespace: str, rank: int, step: int, *, checksum: str | None = None
    ) -> tuple[bytes, str] | None:
        """The shard's bytes (verified by the agent, checked again here) and the tier that served
        them (memory, replica, peer, s3); None if no good copy exists anywhere. ``checksum``: only
        the copy with that checksum (the one the step's committed metadata names)."""
        response = self._call(
            "GET",
            agent_path(CP_SHARD_ROUTE, namespace=namespace, rank=rank, step=step),
            params={} if checksum is None else {CHECKSUM_PARAMETER: checksum},
        )
        if response.status_code == 404:
            return None
        if response.status_code != 200:
            raise self._fail(response, f"read of rank {rank} step {step}")
        try:
            expected = parse_shard_meta(response.headers.get(SHARD_META))
        except ShardMetaError as exc:
            raise AgentError(f"rank {rank} step {step} arrived without a usable checksum: {exc}") from exc
        if checksum_of(response.content) != expected:
            raise AgentError(f"rank {rank} step {step} arrived corrupted (checksum mismatch)")
        if checksum is not None and expected != checksum:
            raise AgentError(f"rank {rank} step {step} arrived as another save's copy (checksum {expected})")
        return response.content, response.headers.get(TIER_HEADER, "memory")

    # ------------------------------------------------------------------ fast path

    def reserve(self, namespace: str, rank: int, step: int, size: int) -> FastWrite | None:
        """An open same-host write of ``size`` bytes, or None when the fast path is off or the
        agent's memory is not reachable from this process (then use ``put``).

        The rank's write reserved ahead at its last commit is used when it has this size and is
        well within its time (no round trip on the training thread); otherwise it is given back
        (the agent keeps its file as the rank's spare) and a write is reserved now."""
        if not self.fast_path:
            return None
        with self._lock:
            held = self._ahead.pop((namespace, rank), None)
        if held is not None:
            if held.size == size and time.monotonic() < held.usable_until:
                held.step = step
                return held
            self.abort(held.token)
        return self._reserve(namespace, rank, step, size, ahead=False)

    def _reserve(self, namespace: str, rank: int, step: int, size: int, *, ahead: bool) -> FastWrite | None:
        sent = time.monotonic()
        response = self._call(
            "POST",
            agent_path(FAST_RESERVE_ROUTE, namespace=namespace, rank=rank, step=step),
            params={"size": size, "ahead": "true"} if ahead else {"size": size},
        )
        if response.status_code != 200:
            raise self._fail(response, f"reservation for rank {rank} step {step}")
        try:
            doc = FastReservation.parse(response.content)
            token, buffer_id, path = doc.token, doc.buffer_id, doc.path
            if doc.size != size:
                raise UntrustedPath(f"the agent reserved {doc.size} bytes, not the {size} asked for")
            # Half the agent's deadline, counted from before the request: room for the copy and
            # the planning between the check in ``reserve`` and the commit.
            usable_until = sent + doc.expires_in_s / 2
        except ValueError as exc:  # not JSON, or not a FastReservation (a ValidationError)
            log.warning("the agent's reservation answer is malformed (%s); saving over HTTP", exc)
            self.fast_path = False
            return None
        try:
            entry = self._writable(buffer_id, path, size)
        except (OSError, UntrustedPath) as exc:
            if isinstance(exc, UntrustedPath):
                log.warning("the agent's reservation names a file not to map (%s); saving over HTTP", exc)
            else:
                log.info("the agent's shared memory is not reachable from here (%s); saving over HTTP", exc)
            self.fast_path = False
            self.abort(token)
            return None
        view = memoryview(entry.mapping)[:size] if size else memoryview(bytearray())
        return FastWrite(
            token,
            size,
            buffer_id,
            view,
            lambda: self._pin(entry),
            namespace=namespace,
            rank=rank,
            step=step,
            ahead=ahead,
            usable_until=usable_until,
        )

    def _writable(self, buffer_id: str, path: object, size: int) -> _Mapping:
        """The cached mapping of a buffer, or a new one, of the file the agent reserved, once
        ``open_shared`` has found it one to map (exactly ``size`` bytes now). A cached mapping is
        reused only when it maps that very file (same device and inode): writing into another
        file would commit that file's old bytes under a fresh checksum."""
        fd = open_shared(self.shm_root, path, size=size, writable=True)
        try:
            info = os.fstat(fd)
            inode = (info.st_dev, info.st_ino)
            with self._lock:
                entry = self._mappings.get(buffer_id)
                if entry is not None and entry.size == size and entry.inode == inode:
                    self._mappings.move_to_end(buffer_id)
                    return entry
                if entry is not None:
                    self._unmap(self._mappings.pop(buffer_id))
                populate = getattr(mmap, "MAP_POPULATE", 0)
                mapping = (
                    mmap.mmap(fd, max(size, 1), flags=mmap.MAP_SHARED | populate)
                    if size
                    else mmap.mmap(-1, 1)
                )
                entry = _Mapping(mapping, size, inode)
                self._mappings[buffer_id] = entry
                while len(self._mappings) > MAX_MAPPINGS:
                    self._unmap(self._mappings.popitem(last=False)[1])
                return entry
        finally:
            os.close(fd)

    def commit(self, write: FastWrite, *, size: int | None = None, save: str | None = None) -> FastCommitted:
        """Make the first ``size`` bytes written (default: all) the shard, of save ``save`` of its
        step if given; the agent hashes them (the answer's ``checksum``)."""
        with contextlib.suppress(BufferError):  # staged tensors may still view it: harmless
            write.view.release()
        params: dict[str, int | str] = {"size": write.size if size is None else size}
        if write.ahead:
            params["step"] = write.step
        if save is not None:
            params[SAVE_PARAMETER] = save
        response = self._call("POST", agent_path(FAST_COMMIT_ROUTE, token=write.token), params=params)
        if response.status_code != 200:
            failure = self._fail(response, "commit")
            # 404: the agent does not hold the reservation (it restarted at the same endpoint, or
            # it expired); 409 for one reserved ahead: its namespace was reset since.
            if failure.code == "NoSuchReservation" or (write.ahead and response.status_code == 409):
                raise ReservationLost(str(failure), status=failure.status, code=failure.code)
            raise failure
        result = _parsed(FastCommitted, response, "commit")
        self._map_ahead(result.spares)
        self._reserve_next(write)
        return result

    def _reserve_next(self, committed: FastWrite) -> None:
        """Reserve the rank's next write now, where the commit runs (async_save's background
        thread), so that the next save's staging starts copying at once. The agent holds it
        under a placeholder step (the next one) and the commit names the real one. Best effort:
        when it cannot be had (the budget is short), the next save reserves its own."""
        where = (committed.namespace, committed.rank)
        try:
            write = self._reserve(*where, committed.step + 1, committed.size, ahead=True)
        except AgentError as exc:
            log.debug(
                "no write reserved ahead for rank %s of %s: %s", committed.rank, committed.namespace, exc
            )
            return
        if write is None:
            return
        with self._lock:
            replaced = self._ahead.pop(where, None)
            self._ahead[where] = write
        if replaced is not None:
            self.abort(replaced.token)

    def _map_ahead(self, spares: tuple[SpareBuffer, ...]) -> None:
        """Map the rank's spare buffers that the agent named at commit (populated: every page
        table entry made now), so the next reservations, which hand them out under the same
        buffer ids, find them mapped (docs/decisions/0004-fast-path-mapping.md: a fresh mapping
        costs about twice the copy). Runs where the commit runs (async_save's background thread).
        A spare that is gone meanwhile, or not one to map, is skipped."""
        for spare in spares[: MAX_MAPPINGS // 2]:
            buffer_id, path, size = spare.buffer_id, spare.path, spare.size
            with self._lock:
                if buffer_id in self._mappings:
                    continue
            try:
                self._writable(buffer_id, path, size)
            except (OSError, UntrustedPath, ValueError) as exc:
                log.debug("spare buffer %s not mapped ahead: %s", buffer_id, exc)

    def abort(self, token: str) -> None:
        with contextlib.suppress(AgentError):  # else the agent gives it back at its deadline
            self._call("POST", agent_path(FAST_ABORT_ROUTE, token=token))

    def read_local(self, namespace: str, rank: int, step: int) -> LocalCopy | None:
        """This node's copy of a shard, mapped read-only, with its tier and checksum; None if this
        node holds none or it is not reachable from here (then read over HTTP).

        The agent keeps the file from being reused while the copy is held (a lease); call
        ``LocalCopy.release()`` when done. The caller checks the checksum itself. Mappings are
        kept per buffer, so reading the same buffer again (the next restore, a benchmark) does
        not map and fault it in again."""
        if not self.fast_path:
            return None
        response = self._call("GET", agent_path(FAST_SHARD_ROUTE, namespace=namespace, rank=rank, step=step))
        if response.status_code != 200:
            return None
        try:
            doc = FastLocation.parse(response.content)
            release = functools.partial(self._release, doc.lease)
            buffer_id, path, size = doc.buffer_id, doc.path, doc.size
            tier, expected = doc.tier, doc.checksum
        except ValueError as exc:  # not JSON, or not a FastLocation (a ValidationError)
            log.warning("the agent's answer locating a shard is malformed (%s); reading over HTTP", exc)
            return None
        try:
            mapping = self._readable(buffer_id, path, size) if size > 0 else None
        except UntrustedPath as exc:
            log.warning("the agent names a file not to read from (%s); reading over HTTP", exc)
            self.fast_path = False
            mapping = None
        except OSError:
            mapping = None  # another host's path
        if mapping is None:
            release()
            return None
        return LocalCopy(memoryview(mapping)[:size], tier, expected, release)

    def _readable(self, buffer_id: str, path: object, size: int) -> mmap.mmap:
        """A read-only mapping of the agent's copy, once ``open_shared`` has found it one to map;
        a cached one when it maps that very file (same device and inode)."""
        fd = open_shared(self.shm_root, path, size=size, writable=False)
        try:
            info = os.fstat(fd)
            inode = (info.st_dev, info.st_ino)
            with self._lock:
                cached = self._read_maps.get(buffer_id)
                if cached is not None and cached[1] == inode and len(cached[0]) == size:
                    self._read_maps.move_to_end(buffer_id)
                    return cached[0]
                if cached is not None:
                    with contextlib.suppress(BufferError):
                        self._read_maps.pop(buffer_id)[0].close()
                mapping = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
                self._read_maps[buffer_id] = (mapping, inode)
                while len(self._read_maps) > MAX_MAPPINGS:
                    with contextlib.suppress(BufferError):
                        self._read_maps.popitem(last=False)[1][0].close()
                return mapping
        finally:
            os.close(fd)

    def _release(self, lease: str) -> None:
        with contextlib.suppress(AgentError):  # else the lease runs out at the agent
            self._call("POST", agent_path(FAST_RELEASE_ROUTE, lease=lease))


@dataclass
class LocalCopy:
    """A shard in this node's shared memory, mapped: valid until ``release()``."""

    view: memoryview
    tier: str
    checksum: str
    release: Callable[[], None]


def _parsed(model: type[Body], response: httpx.Response, what: str) -> Body:
    """The agent's answer as the body model it must be; AgentError when it is not."""
    try:
        return model.parse(response.content)
    except ValueError as exc:
        raise AgentError(f"{what}: the agent's answer is off the contract: {problem_of(exc)}") from exc


def _address(mapping: mmap.mmap) -> int:
    import ctypes

    holder = ctypes.c_char.from_buffer(mapping)
    try:
        return ctypes.addressof(holder)
    finally:
        del holder
