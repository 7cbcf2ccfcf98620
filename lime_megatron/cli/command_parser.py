"""The commands' argument parser: argparse's, with the closest known flag named for an unknown one.

``lime-preprocess-data --ouput x`` ends with ``unrecognized arguments: --ouput x; did you mean
--output?`` (exit status 2, as argparse's errors), like the trainer's parser
(``lime_megatron.training.arguments``).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from lime_megatron.training.arguments import unrecognized_arguments


class CommandParser(argparse.ArgumentParser):
    """``ArgumentParser`` whose unknown arguments are reported with a did-you-mean hint."""

    def parse_args(self, args: Sequence[str] | None = None, namespace=None):  # type: ignore[override]
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            self.error(unrecognized_arguments(self, unknown))
        return parsed
