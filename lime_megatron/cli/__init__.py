"""The project's commands, one module per command, each with ``main(argv=None) -> int``.

Installed as console scripts (``lime-pretrain``, ``lime-preprocess-data``, ...: pyproject.toml's
``[project.scripts]``, the table in docs/training.md) and run as ``python -m lime_megatron.cli.<name>``;
``pretrain_lime.py`` and ``tools/<name>.py`` in a checkout run the same ``main`` under Megatron-LM's
paths.  Nothing in the library imports this package.
"""

from lime_megatron import harmless_warnings

harmless_warnings.ignore()
