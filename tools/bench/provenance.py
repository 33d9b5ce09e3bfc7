"""Where a benchmark's figures come from: the commit they were measured at (every report names it)."""
from __future__ import annotations

import os
import subprocess


def commit() -> str:
    """$ZEROKL_COMMIT (a copy of the tree without its git history, as on a device machine), else git's
    short HEAD, else "?"."""
    return os.environ.get("ZEROKL_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or "?"
