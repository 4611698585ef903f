"""Shared-memory segments of a client that died (SIGKILL, the OOM killer: no cleanup ran) are
found by the owner's pid in their name and removed when the next shm cluster starts; a
segment whose owner lives is kept."""

from __future__ import annotations

import subprocess
import sys

from workbench.distributed.cluster import _alive
from workbench.distributed.comm import SHM_DIR, remove_orphaned_segments, shm_segment_name


def test_segments_of_dead_owners_are_removed_and_live_ones_kept():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead_pid = int(dead.stdout)  # exited and reaped: no such process now
    orphan = SHM_DIR / shm_segment_name(dead_pid)
    mine = SHM_DIR / shm_segment_name()
    for path in (orphan, mine):
        path.write_bytes(b"\0" * 4096)
    try:
        removed = remove_orphaned_segments(_alive)
        assert orphan in removed and not orphan.exists()
        assert mine.exists() and mine not in removed
    finally:
        for path in (orphan, mine):
            path.unlink(missing_ok=True)
