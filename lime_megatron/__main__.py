"""``python -m lime_megatron``: the main job, ``lime_megatron.cli.main_job``."""

import sys

from lime_megatron.cli.main_job import main

if __name__ == "__main__":
    sys.exit(main())
