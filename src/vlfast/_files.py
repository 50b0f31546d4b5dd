"""File permissions for what vlfast writes: the mode every other program would give a new file.

safetensors' writer creates its files with mode 0600, so shards and fixed checkpoints written on shared
storage were unreadable by teammates. ``honour_umask`` gives a written file ``0666 & ~umask``, as ``open``
does.
"""

from __future__ import annotations

import os


def _umask() -> int:
    # Linux reports it without changing it (cheap: once per written file); elsewhere set-and-restore.
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def honour_umask(path: str | os.PathLike) -> None:
    """Give ``path`` the permissions a plain ``open(path, "w")`` would have: 0666 minus the umask."""
    os.chmod(path, 0o666 & ~_umask())
