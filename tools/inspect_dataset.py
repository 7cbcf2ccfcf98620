#!/usr/bin/env python
"""``lime_megatron.cli.inspect_dataset``, the ``lime-inspect-dataset`` command, run by its path."""

import sys

from lime_megatron.cli.inspect_dataset import main

if __name__ == "__main__":
    sys.exit(main())
