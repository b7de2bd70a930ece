"""Deprecated: `python builder/train_drafter.py` is now `dflash-train-drafter` (dflash_training/train_drafter.py)."""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dflash_training.train_drafter import main

if __name__ == "__main__":
    print("builder/train_drafter.py is deprecated: use dflash-train-drafter "
          "(or python -m dflash_training.train_drafter)", file=sys.stderr)
    sys.exit(main(sys.argv[1:]))
