"""The flight-recorder file, written down once: the writer (``recorder``, inside each patched scheduler), the heartbeat
(``monitor``) and the reader (``rollcall``) all take the layout from here.

One file per scheduler process in ``SGLANG_DP_MTP_FIX_RECORDER_DIR``:
``sglang-dp-mtp-fix-<host>-dp<R>-<pid>-<token>.rec``, the token random per file, so a restarted container that reuses
a PID creates a new file instead of failing on the old one (``rollcall`` reads the newest file of each rank).

Little endian. The file's blocks are allocated when it is created (``posix_fallocate``): a full disk or a quota is
then the "recorder off" warning at open. The writer keeps the ring in its own memory, in this layout, and its heartbeat
thread writes it out whole about once a second (``recorder.Recorder.flush``): a reader sees a file at most about a
second behind its writer.

====== ======================================================================================================
offset header (``HEADER_SIZE`` bytes)
====== ======================================================================================================
0      ``HEADER``: magic (written last), format version, header size, record size, capacity, dp rank, dp size,
       tp rank, tp size, global rank, pid, start (unix s), start (monotonic ns), plugin version, SGLang version, host
192    ``PROC_START``: the process's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22); 0 unknown
200    ``BOOT_ID``: the kernel's boot id (16 bytes; zero unknown). With the host and the start time it tells a live
       process from a later one that reuses its PID
216    ``HEARTBEAT``: ticks, wall time (unix s), monotonic ns, ticks again. Written about once a second by the
       monitor thread, never by the main thread: a rank blocked in a collective keeps ticking, a frozen or dead
       process stops. The two copies of ticks tell a whole write from a torn one
248    the MLP-sync round this rank entered last (u64, kept current by the main thread)
====== ======================================================================================================

Then ``capacity`` records of ``RECORD``, written in turn. The writer stores a round's ``SYNC`` as four 64-bit words
in order through one view of the ring (words 0-3, below ``RECORD``), the round number first and last, so a record cut
by the write-out's snapshot has two different copies and is detected, never taken for an older one. The draft path
is known later in the round (the draft runner's ``can_run_graph``): ``PATH``'s words 4 and 5, the round again last.
The reader reads the file twice and keeps only records identical in both reads (a record being written meanwhile is
skipped).

Each last copy of the round (words 3 and 5) carries a check above the round (``CHECK_SHIFT``): the number of bits set
in what it vouches for, words 1 XOR 2 (the time and the votes) and word 4 (the draft path). A bit flipped in a
decision (a disk, memory, a stray write) fails it: the reader names the record as damaged instead of reading the flip
as a decision, which another rank's would then "diverge" from.
"""

from __future__ import annotations

import re
import socket
import struct

MAGIC = b"SDMFREC1"
FORMAT_VERSION = 3  # 2: process start, boot id and heartbeat in the header, blocks allocated at open; 3: checks
CAPACITY = 256
MAX_CAPACITY = 1 << 16
HEADER_SIZE = 256
HEADER = struct.Struct("<8sIIIIiiiiiidq32s32s64s")
PROC_START = struct.Struct("<Q")
PROC_START_OFFSET = HEADER.size
BOOT_ID_OFFSET = PROC_START_OFFSET + PROC_START.size
BOOT_ID_SIZE = 16
HEARTBEAT = struct.Struct("<QdqQ")
HEARTBEAT_OFFSET = BOOT_ID_OFFSET + BOOT_ID_SIZE
ENTERED_OFFSET = HEADER_SIZE - 8
assert HEARTBEAT_OFFSET + HEARTBEAT.size == ENTERED_OFFSET

# round (begin), monotonic ns, local tokens, forward mode, flags, 2 pad, round (end) | bucket, path, 3 pad, path stamp
RECORD = struct.Struct("<QqiBB2xQiB3xQ")
SYNC = struct.Struct("<QqiBB2xQ")  # at the record's offset 0
PATH = struct.Struct("<iB3xQ")  # at offset SYNC.size
# The same layout as the writer stores it: 64-bit little-endian words, in this order. SYNC: round (word 0),
# monotonic ns (1), tokens | mode << MODE_SHIFT | flags << FLAGS_SHIFT (2: SYNC's i, B, B and pad), round (3). PATH:
# bucket (as u32) | path << PATH_SHIFT (4), round (5). Every record starts on a word:
assert HEADER_SIZE % 8 == 0 and RECORD.size % 8 == 0 and ENTERED_OFFSET % 8 == 0
MODE_SHIFT, FLAGS_SHIFT, PATH_SHIFT = 32, 40, 32
U32 = 0xFFFFFFFF
WORDS = struct.Struct("<6Q")  # a record as the writer's words
# Words 3 and 5: round | check << CHECK_SHIFT (rounds stay below 2^53: ``reader.MAX_ROUND``)
CHECK_SHIFT = 56
ROUND_MASK = (1 << CHECK_SHIFT) - 1


def sync_check(t_ns: int, word: int) -> int:
    """Word 3's check, shifted into place (the writer inlines it)."""
    return (t_ns ^ word).bit_count() << CHECK_SHIFT


def path_check(word: int) -> int:
    """Word 5's check, shifted into place (the writer inlines it)."""
    return word.bit_count() << CHECK_SHIFT


FILE_GLOB = re.compile(r"^sglang-dp-mtp-fix-.*\.rec$")

# flags
SENT_GENERIC, GROUP_GENERIC, SENT_DRAFT, GROUP_DRAFT = 1, 2, 4, 8
# path byte: 0 none recorded, 1 graph, 2 eager; + RUNNER_GATHERS when the draft runner gathers (its bucket is common)
PATH_GRAPH, PATH_EAGER, RUNNER_GATHERS = 1, 2, 4
PATH_NAMES = {None: "unknown", 0: "none", PATH_GRAPH: "graph", PATH_EAGER: "eager"}

HEARTBEAT_PERIOD_S = 1.0
# A heartbeat this much older than the group's freshest one has stopped (a few missed ticks on a loaded host are not)
HEARTBEAT_STALE_S = 5.0


def file_name(dp_rank: int, pid: int, token: str) -> str:
    return f"sglang-dp-mtp-fix-{host_name()}-dp{dp_rank}-{pid}-{token}.rec"


def host_name() -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())[:64] or "host"


def boot_id() -> bytes:
    """This kernel's boot id (16 bytes), zeros where it cannot be read."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return bytes.fromhex(f.read().strip().replace("-", ""))[:BOOT_ID_SIZE].ljust(BOOT_ID_SIZE, b"\0")
    except (OSError, ValueError):
        return bytes(BOOT_ID_SIZE)


def proc_start_ticks(pid: int | str = "self") -> int:
    """A process's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22); 0 where unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
        return int(raw[raw.rindex(b")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


def proc_state(pid: int) -> str | None:
    """A process's state letter (``R``, ``S``, ``T`` stopped, ``Z`` zombie, ...); None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
        return raw[raw.rindex(b")") + 2 :].split()[0].decode()
    except (OSError, ValueError, IndexError):
        return None
