#!/usr/bin/env python
"""``lime_megatron.cli.convert_checkpoint``, the ``lime-convert-checkpoint`` command, run by its path."""

import sys

from lime_megatron.cli.convert_checkpoint import main

if __name__ == "__main__":
    sys.exit(main())
