"""The shard store of an agent's in-memory checkpoint tier: one plain file per shard, on tmpfs.

A shard is "rank r's bytes of step n of namespace ns" (a ``ShardKey``). The store keeps each one as a
file under ``root`` (on a node, ``/dev/shm/hpsim/<node_id>``): memory that the agent owns and that
outlives a crash of the agent. A restarted agent finds its shards again by scanning ``root``.

Layout on disk::

    root/<ns>/<rank>/<step>.shard    the shard's raw bytes and nothing else (trainers may mmap it)
    root/<ns>/<rank>/<step>.meta     JSON sidecar: {"version": 1, "current": R, "previous": R | null}
    root/<ns>/<rank>/.<id>.spare     a spare: a retired or prepared file, prefaulted, for the next save
    root/<ns>/<rank>/.<...>.tmp      a write in progress (data or sidecar); removed at startup

``<ns>`` is ``quote(namespace, safe="")`` with ``.`` also escaped (``%2E``), so a namespace holding
``/``, spaces or dots is one directory name and never ``.`` or ``..``; its encoded form must fit in
255 bytes. ``<rank>`` and ``<step>`` are decimal. A record ``R`` is ``{"size", "checksum",
"replica_of", "committed_at", "inode"}``: ``inode`` is the inode number of the data file it describes.
The sidecar's ``"seal"`` is an HMAC-SHA256 of its other members and of the shard's place
(``<ns>/<rank>/<step>``), keyed by ``store.key`` (32 random bytes, 0600) in the store's key
directory (the agent's data dir; ``root`` itself when it has none): only the store that holds the
key can write a sidecar that it adopts.

Commit protocol (``Reservation.commit``), all under the store's lock:

1. The bytes are already in ``.<step>.<uuid>.shard.tmp`` (created at ``reserve``, preallocated,
   written through a shared mapping).
2. Write the sidecar to a temp file and rename it to ``<step>.meta``: ``current`` describes the new
   data file (its inode), ``previous`` the shard it replaces, if any.
3. Rename the data temp file to ``<step>.shard``.

At startup a shard counts only if its sidecar's seal is valid and its data file is a regular file
of this user's, with one name, whose inode and size match the sidecar's ``current`` record, or its
``previous`` one (a crash between steps 2 and 3 of a replacement: the old shard is kept and the
sidecar rewritten), and whose bytes hash to that record's checksum. Anything else (a sidecar
without data, data without a sidecar, a torn, unreadable or unsealed sidecar, a file of another
user's) is removed, as are all ``.tmp`` files. So a crash at
any point leaves the old shard or the new one, never a half shard. Files are not fsync'ed: the
store guards against the agent crashing, not the machine (tmpfs does not survive a reboot anyway).
One store per root: two live stores on the same root would remove each other's writes at startup.

Files are the agent's user's only: directories 0700, data files and sidecars 0600 (a trainer that
uses the same-host fast path runs as that user; any other reads over HTTP). ``root`` and every
directory below it must be this user's and writable by no one else, and the directories above it
root's or this user's, writable by no one else unless sticky (contracts/shm.py); otherwise the store
refuses to start (UnsafeDirectory, naming the directory). A root renamed away and replaced while the
store runs is not written into.

A file handed to a trainer (the same-host fast path) is checked before the agent reads it at
commit: a regular file (not a link, FIFO or device), the very inode reserved, with one name, in
its directory under ``root``, of the reserved size; and it is read with ``preadv``, not mapped, so
a trainer that truncates it even during the check gets its commit refused (``UnusableShardFile``),
never the agent a SIGBUS.

Shards are never written in place: a replacement renames a new file over the old name and an
eviction unlinks it, so a reader that has mapped a shard file keeps seeing one whole shard.

Budget: ``in_use_bytes`` counts committed shards plus reservations in flight (a replacement counts
both copies until it commits). ``reserve`` makes room by evicting whole steps (every local shard of
one ``(namespace, step)``), oldest first by the step's newest ``committed_at``, skipping protected
steps, the new shard's own step and any step with a reservation in flight; it plans the evictions
first and evicts nothing unless the plan makes the shard fit.

Spares (the rotation of a rank's buffers): a primary shard that ages out of retention leaves its
file as a spare of its ``(namespace, rank)`` instead of being deleted, unless a reader here holds it;
``prepare_spares`` also makes new ones in advance, of the rank's last reserved size, allocated and
faulted in (``posix_fallocate`` then a populating mapping), so that a rank holds up to its
retention + 1 files from its first save on and no later save allocates or first-touches memory. A
spare is named by its buffer id and found again at startup. Spares count in the budget, are never
made past it, and are dropped (as few as needed) before any step is evicted for a reservation. A
file is a spare only when no committed shard uses it: a retained step's bytes are never handed out.

Threading: an index guarded by one lock; hashing (at commit and at read) runs outside it, so worker
threads can verify big shards while the event loop keeps using the store. ``protect`` callbacks run
outside the lock too, and at most once per call, only when something has to be evicted.
"""

from __future__ import annotations

from hyperpod_sim.agents.store.base import SpareInfo
from hyperpod_sim.agents.store.files import (
    DATA_SUFFIX,
    DIR_MODE,
    FILE_MODE,
    META_SUFFIX,
    META_VERSION,
    TEMP_SUFFIX,
)
from hyperpod_sim.agents.store.keys import (
    BudgetExceeded,
    CorruptShard,
    ProtectFn,
    ReservationCancelled,
    ShardInfo,
    ShardKey,
    StepId,
    StoreCounters,
    UnusableShardFile,
    check_namespace,
)
from hyperpod_sim.agents.store.reservation import Reservation
from hyperpod_sim.agents.store.shardstore import ShardStore
from hyperpod_sim.contracts.limits import MAX_NAME_BYTES
from hyperpod_sim.contracts.shards import DIGEST_BYTES, checksum_of

__all__ = [
    "DATA_SUFFIX",
    "DIGEST_BYTES",
    "DIR_MODE",
    "FILE_MODE",
    "MAX_NAME_BYTES",
    "META_SUFFIX",
    "META_VERSION",
    "TEMP_SUFFIX",
    "BudgetExceeded",
    "CorruptShard",
    "ProtectFn",
    "Reservation",
    "ReservationCancelled",
    "ShardInfo",
    "ShardKey",
    "ShardStore",
    "SpareInfo",
    "StepId",
    "StoreCounters",
    "UnusableShardFile",
    "check_namespace",
    "checksum_of",
]
