#!/usr/bin/env python
"""``lime_megatron.cli.analyze_checkpoint``, the ``lime-analyze-checkpoint`` command, run by its path."""

import sys

from lime_megatron.cli.analyze_checkpoint import main

if __name__ == "__main__":
    sys.exit(main())
