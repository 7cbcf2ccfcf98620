"""A usage error printed once per launch, as one line, by the process that reports it.

Under torchrun every process runs the same command line, so every process finds the same wrong
option or path; one line per process (eight on a node, more on a cluster) buries the message.
:func:`print_usage_error` prints it from one process: rank 0 for an error found before the
processes talk to each other (the command line, the config file: the same on every rank), and
for an error found later (data, tokenizer, checkpoint files, which can differ between nodes) the
first process to fail, as ``lime_megatron.training.trainer`` counts them. Every process still
exits with status 2; torchrun then adds its own summary of the failed processes. torchrun stops
every process once one has failed, so a process that does not print waits ``REPORTER_GRACE_S``
before it returns: on a loaded node the one that prints may reach its line later than the others
reach their exit (a CI run on 2 busy cores lost the line that way).

This module imports neither torch nor megatron: ``lime_megatron.cli.pretrain`` reports the errors
of its command-line check with it before importing them.
"""

from __future__ import annotations

import os
import sys
import time

REPORTER_GRACE_S = 5.0
"""How long a launched process that does not print the error waits before it exits."""


def print_usage_error(error: Exception, first_to_fail: bool | None = None) -> None:
    """Print ``error`` on stderr as ``pretrain_lime.py: error: ...`` if this process reports it:
    when ``first_to_fail`` (counted by the processes together), or, where they have not counted
    (``None``), when this is rank 0 (``RANK``; 0 outside a launcher). Under a launcher of
    several processes (``WORLD_SIZE`` > 1) one that does not print waits ``REPORTER_GRACE_S``."""
    if first_to_fail is None:
        first_to_fail = int(os.environ.get("RANK", "0")) == 0
    if first_to_fail:
        print(f"pretrain_lime.py: error: {error}", file=sys.stderr, flush=True)
    elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
        time.sleep(REPORTER_GRACE_S)
