"""argparse types that refuse an impossible value when the command line is read, before any work starts."""
from __future__ import annotations

import argparse


def at_least(minimum: float, kind: type = int):
    """An argparse type: a number of `kind` no smaller than minimum (a count of 0, a negative rate)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a{'n integer' if kind is int else ' number'}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum:g}, got {text}")
        return value
    return parse
