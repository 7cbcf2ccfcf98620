"""The example YAML configs and their dry-run parsing, shared by the example and fusion tests."""

from pathlib import Path

import yaml

from lime_megatron.training import arguments

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
CONFIGS = sorted(EXAMPLES.glob("*.yaml"))
DATA_PARALLEL = 8  # data-parallel replicas assumed by the dry runs


def world_size(path: Path) -> int:
    """GPUs for the dry run of ``path``: its model-parallel size times DATA_PARALLEL."""
    values = yaml.safe_load(path.read_text())
    return values.get("tensor_model_parallel_size", 1) * values.get("pipeline_model_parallel_size", 1) * DATA_PARALLEL


def parsed(path: Path):
    return arguments.parse_args(["--config", str(path), "--dry-run", "--dry-run-world-size", str(world_size(path))])
