#!/usr/bin/env python
"""``lime_megatron.cli.depth_sweep``, the ``lime-depth-sweep`` command, run by its path."""

import sys

from lime_megatron.cli.depth_sweep import main

if __name__ == "__main__":
    sys.exit(main())
