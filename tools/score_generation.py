#!/usr/bin/env python
"""``lime_megatron.cli.score_generation``, the ``lime-score-generation`` command, run by its path."""

import sys

from lime_megatron.cli.score_generation import main

if __name__ == "__main__":
    sys.exit(main())
