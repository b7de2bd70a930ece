"""Deprecated: `python builder/drafter_data.py` is now `dflash-drafter-data` (dflash_training/drafter_data.py)."""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dflash_training.drafter_data import main

if __name__ == "__main__":
    print("builder/drafter_data.py is deprecated: use dflash-drafter-data "
          "(or python -m dflash_training.drafter_data)", file=sys.stderr)
    sys.exit(main(sys.argv[1:]))
