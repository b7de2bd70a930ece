"""Where a build is written before it is published, and the clean-up of what builds killed hard left behind.

A build is written into `.<name>.<random>.partial` beside its output and renamed into place when complete, so a
build is either absent or whole. Ctrl-C and SIGTERM remove the partial folder; SIGKILL (the OOM killer, a lost
node, `kubectl delete --force`) cannot, so the next build of that output removes such folders, but never one that
a build is still writing. Each partial folder holds a lock file that its build keeps locked (flock) until the
folder is published or removed; the kernel drops the lock when that process ends, however it ends.

A lock rather than the owner's pid in the folder's name: the builds that share a model volume run in pods on
different nodes, whose process ids mean nothing to each other. On NFS (the usual ReadWriteMany volume) flock is
carried by NFS locks, which the server releases when the client's process ends or its lease expires. On a
filesystem without locks nothing is locked and no partial folder is taken for stale: they are left for the user.
"""
from __future__ import annotations

import fcntl
import glob
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOCK_FILE = ".building"  # inside the partial folder; removed when the folder is published


def partial_folders(output: Path) -> list[Path]:
    """`output`'s partial folders: .<name>.<random>.partial, with no dot in the random part (which tempfile makes),
    so that output `v1` leaves output `v1.2`'s folders (.v1.2.<random>.partial) alone."""
    prefix, suffix = f".{output.name}.", ".partial"
    return sorted(folder for folder in output.parent.glob(f"{glob.escape(prefix)}*{suffix}")
                  if "." not in folder.name[len(prefix):-len(suffix)])


def _abandoned(folder: Path) -> bool:
    """Whether no live build holds `folder`: its lock file can be locked, or it has none (a build that died while
    removing it, or one from before builds locked their folders)."""
    try:
        fd = os.open(folder / LOCK_FILE, os.O_RDWR)  # NFS locks an exclusive flock only on a writable file
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held by a live build, or no locks on this filesystem: either way not known to be stale
        return False
    finally:
        os.close(fd)  # releases the lock just taken
    return True


def remove_abandoned(output: Path) -> list[Path]:
    """Remove the partial folders of `output` that builds killed hard left; returns them."""
    removed = [folder for folder in partial_folders(output) if _abandoned(folder)]
    for folder in removed:
        shutil.rmtree(folder, ignore_errors=True)
    return removed


@contextmanager
def partial_folder(output: Path) -> Iterator[Path]:
    """A new partial folder beside `output`, locked while the block runs and removed at its end unless
    published into `output` by then (`publish`)."""
    # Made and locked under a name remove_abandoned does not look at, then renamed: it never sees it unlocked.
    made = Path(tempfile.mkdtemp(prefix=f".{output.name}.", suffix=".new", dir=output.parent))
    lock = os.open(made / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            pass  # a filesystem without locks: the build runs unlocked (see the module's docstring)
        stage = made.with_suffix(".partial")
        made.rename(stage)
        try:
            yield stage
        finally:
            shutil.rmtree(stage, ignore_errors=True)  # nothing there once published
    finally:
        os.close(lock)


def publish(stage: Path, output: Path) -> None:
    """Replace `output` by the complete build in `stage` (a partial_folder that is still locked)."""
    if output.exists():
        old = output.with_name(f".{output.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        output.rename(old)
        stage.rename(output)
        shutil.rmtree(old, ignore_errors=True)
    else:
        stage.rename(output)
    (output / LOCK_FILE).unlink()  # no longer a partial folder: remove_abandoned never looks at it again
