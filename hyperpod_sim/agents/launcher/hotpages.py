"""Keep the pages an agent writes to answer a policy push out of the kernel's same-page merging.

Agents forked by the launcher have every anonymous page mergeable (launcher/server.py), and where
ksmd runs it keeps one copy of the pages the agents hold alike. A page that code then writes
(CPython writes an object's reference count at every use; the allocator's free lists live in the
blocks they link) is copied back at the write: the first rollout after ksmd merged a 1,024-node
cluster took about 245 such copy-on-write faults in every agent, twice the CPU of the same push on
pages of its own (docs/nodes.md, "Same-page merging").

The kernel does not say which pages a piece of code writes where it is built without soft-dirty
bits or idle-page tracking, but ``/proc/self/pagemap`` says of each present page whether this
process alone maps it ("exclusively mapped", bit 56, Linux 4.2). Right after ``fork()`` every
private page is mapped twice, and a page the parent writes is copied and its own again. So, once,
after its first policy: the agent opens a connection to itself and greets itself on it (as the
control plane holds a connection from its greeting), forks a twin that stops at once, reads which
of its pages are its own, sends itself the policy in force as a push on that connection (a real
request, answered as a push of the applied generation is: unchanged), reads again, kills the twin,
and marks the pages that became its own unmergeable (``madvise(MADV_UNMERGEABLE)``). Pages alike in
no two agents cost nothing so; the others are what it costs (bench/README.md).

The twin is never seen as an agent (it writes another command line over its own before it stops)
and never outlives its agent (the kernel kills it when its parent dies).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import mmap
import os
import signal
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass

from hyperpod_sim.agents.launcher.title import Title, TitleError
from hyperpod_sim.agents.state import AgentState
from hyperpod_sim.contracts.agent_api import HEALTH_PATH, POLICY_PATH

log = logging.getLogger("agents.hotpages")

PAGE = mmap.PAGESIZE
PRESENT = 1 << 63
EXCLUSIVE = 1 << 56  # "page exclusively mapped"
MADV_UNMERGEABLE = 13
PR_SET_PDEATHSIG = 1
PR_GET_MEMORY_MERGE = 68  # linux/prctl.h (Linux 6.4)
#: The ``User-Agent`` of the agent's push to itself: not counted as one of the control plane's.
SELF_PUSH_AGENT = "hyperpod-sim-agent-self-push"
TWIN_TITLE = "hyperpod-sim-agent-twin"  # the twin's command line: no agent's
ANSWER_TIMEOUT_S = 5.0

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.prctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong)


@dataclass(frozen=True)
class Unmerged:
    """What ``unmerge_written`` did: pages marked unmergeable, in how many runs of adjacent pages
    (a call each, and up to two more mappings), of how many the kernel refused."""

    pages: int
    runs: int
    refused: int


def mergeable() -> bool:
    """Whether this process's pages are all mergeable (``PR_SET_MEMORY_MERGE``, as the launcher's
    agents are): where they are not, nothing is merged and nothing needs keeping apart."""
    return bool(_libc.prctl(PR_GET_MEMORY_MERGE, 0, 0, 0, 0) == 1)


def private_writable_ranges(maps: str) -> list[tuple[int, int]]:
    """``[start, end)`` of each private writable mapping in a ``/proc/<pid>/maps`` text: those whose
    pages can be merged and are copied at a write."""
    ranges = []
    for line in maps.splitlines():
        fields = line.split()
        if len(fields) < 2 or len(fields[1]) != 4:
            continue
        perms = fields[1]
        name = fields[5] if len(fields) > 5 else ""
        if perms[1] != "w" or perms[3] != "p" or name in ("[vsyscall]", "[vvar]", "[vvar_vclock]", "[vdso]"):
            continue
        start, _, end = fields[0].partition("-")
        ranges.append((int(start, 16), int(end, 16)))
    return ranges


class PageWatch:
    """Two readings of which pages of this process's private writable mappings (as they were when
    it was made) are present and its own. A reading goes into buffers made beforehand, mappings of
    their own outside the watched ones, so that reading writes no page it watches."""

    def __init__(self) -> None:
        with open("/proc/self/maps") as handle:
            self.ranges = private_writable_ranges(handle.read())
        self.pages = sum((end - start) // PAGE for start, end in self.ranges)
        self._buffers = [mmap.mmap(-1, max(PAGE, self.pages * 8)) for _ in range(2)]
        self._slices: list[list[tuple[int, memoryview]]] = []
        for buffer in self._buffers:
            view, offset, slices = memoryview(buffer), 0, []
            for start, end in self.ranges:
                size = (end - start) // PAGE * 8
                slices.append((start // PAGE * 8, view[offset : offset + size]))
                offset += size
            self._slices.append(slices)
            view.release()
        self._pagemap = open("/proc/self/pagemap", "rb", buffering=0)  # noqa: SIM115 (closed in close)

    def read(self, which: int) -> None:
        """Reading ``which`` (0 or 1) of every watched page's entry."""
        pagemap = self._pagemap
        for position, target in self._slices[which]:
            pagemap.seek(position)
            done = 0
            while done < len(target):  # a short read only at a mapping's unmapping meanwhile
                got = pagemap.readinto(target[done:])
                if not got:
                    break
                done += got

    def written(self) -> set[int]:
        """Addresses of the pages that were not this process's own at reading 0 and are at
        reading 1: written (or first touched) between the two, while the pages were shared."""
        wanted = PRESENT | EXCLUSIVE
        found: set[int] = set()
        with memoryview(self._buffers[0]) as first_view, memoryview(self._buffers[1]) as second_view:
            first, second = first_view.cast("Q"), second_view.cast("Q")
            index = 0
            for start, end in self.ranges:
                for page in range(start, end, PAGE):
                    if second[index] & wanted == wanted and first[index] & wanted != wanted:
                        found.add(page)
                    index += 1
            first.release()
            second.release()
        return found

    def close(self) -> None:
        self._pagemap.close()
        for slices in self._slices:
            for _, view in slices:
                view.release()
        for buffer in self._buffers:
            buffer.close()


def page_runs(pages: set[int]) -> Iterator[tuple[int, int]]:
    """Adjacent pages of ``pages`` as ``(start, length in bytes)``, in address order."""
    start = end = None
    for page in sorted(pages):
        if end == page:
            end = page + PAGE
            continue
        if start is not None and end is not None:
            yield start, end - start
        start, end = page, page + PAGE
    if start is not None and end is not None:
        yield start, end - start


def mark_unmergeable(pages: set[int]) -> Unmerged:
    runs = refused = 0
    for start, length in page_runs(pages):
        runs += 1
        if _libc.madvise(start, length, MADV_UNMERGEABLE) != 0:
            refused += 1
    return Unmerged(pages=len(pages), runs=runs, refused=refused)


def _be_twin(parent: int) -> None:
    """The twin's whole life: die with its parent, show no agent's command line, stop."""
    try:
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the line above
            return
        with contextlib.suppress(TitleError):
            Title().write([TWIN_TITLE])
        os.kill(os.getpid(), signal.SIGSTOP)
    finally:
        os._exit(0)


@contextlib.contextmanager
def stopped_twin() -> Iterator[int]:
    """A child forked from this process that stops at once, killed and collected at the end: while
    it lives, each private page this process writes becomes its own again."""
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        _be_twin(parent)
    try:
        _, status = os.waitpid(pid, os.WUNTRACED)
        if not os.WIFSTOPPED(status):
            raise ChildProcessError(f"the twin {pid} ended instead of stopping (status {status})")
        yield pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


async def unmerge_written(work: Callable[[], Awaitable[object]]) -> Unmerged:
    """Run ``work`` while a stopped twin shares this process's pages; mark the pages it wrote
    unmergeable."""
    watch = PageWatch()
    try:
        with stopped_twin():
            watch.read(0)
            await work()
            watch.read(1)
        written = watch.written()
    finally:
        watch.close()
    return mark_unmergeable(written)


def _loopback_for(address: str) -> str:
    """Where this agent's own listening address is reached from itself."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(address, address)


async def _exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes) -> int:
    """Send one HTTP/1.1 request on a kept connection and read its whole answer: the status."""
    writer.write(request)
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    length = next(
        (int(line.split(":", 1)[1]) for line in lines[1:] if line.lower().startswith("content-length:")), 0
    )
    await reader.readexactly(length)
    return status


def _request(method: str, path: str, host: str, headers: dict[str, str], body: bytes = b"") -> bytes:
    head = [f"{method} {path} HTTP/1.1", f"Host: {host}", f"User-Agent: {SELF_PUSH_AGENT}"]
    head += [f"{name}: {value}" for name, value in headers.items()]
    head.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


async def keep_push_pages_unmerged(state: AgentState, address: tuple[str, int]) -> Unmerged | None:
    """Push the policy in force to this agent at ``address`` (its listening socket's), on a
    connection it greeted itself on first, with a stopped twin alive around the push; mark the
    pages the push wrote unmergeable. None when there is no policy or token yet."""
    policy, token = state.policy, state.control_plane_token
    if policy is None or token is None:
        return None
    host, port = _loopback_for(address[0]), address[1]
    authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    push = _request(
        "PUT",
        POLICY_PATH,
        authority,
        {"Authorization": f"Bearer {token.get_secret_value()}", "Content-Type": "application/json"},
        json.dumps(policy.document()).encode(),
    )
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), ANSWER_TIMEOUT_S)
    try:
        # The accept and a first request happen before the twin: the control plane's pushes come
        # on a connection it holds from its greeting.
        greeting = _request("GET", HEALTH_PATH, authority, {})
        await asyncio.wait_for(_exchange(reader, writer, greeting), ANSWER_TIMEOUT_S)
        statuses: list[int] = []

        async def pushed() -> None:
            statuses.append(await asyncio.wait_for(_exchange(reader, writer, push), ANSWER_TIMEOUT_S))

        unmerged = await unmerge_written(pushed)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    log.info(
        "kept %d pages (%d runs) that a policy push writes out of same-page merging (the push to "
        "itself answered %s)",
        unmerged.pages,
        unmerged.runs,
        statuses[0] if statuses else "nothing",
    )
    if unmerged.refused:
        log.warning("the kernel refused %d of %d runs of pages to unmerge", unmerged.refused, unmerged.runs)
    return unmerged
