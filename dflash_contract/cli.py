"""What the project's command-line tools share: argparse's refusals in the tools' own one-line form."""
from __future__ import annotations

import argparse


class ArgumentParser(argparse.ArgumentParser):
    """argparse's errors as one line, `prog: error: message` and exit 2, like the tools' own refusals (argparse
    prints its whole usage first, which buries the message); --help still shows the usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")
