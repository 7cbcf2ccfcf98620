"""The commands' parser names the closest known flag for an unknown one, subcommands' flags
included, and exits with argparse's status 2."""

import subprocess
import sys

import pytest

from lime_megatron.training.arguments import CommandParser


def _parser() -> CommandParser:
    parser = CommandParser(prog="tool")
    parser.add_argument("--num-samples", type=int, default=1)
    commands = parser.add_subparsers(dest="command")
    commands.add_parser("export").add_argument("--checkpoint")
    return parser


@pytest.mark.parametrize(
    "argv, hint",
    [(["export", "--nmu-samples=3"], "--num-samples"), (["export", "--chekpoint", "x"], "--checkpoint")],
)
def test_unknown_flag_names_the_closest(argv, hint, capsys):
    with pytest.raises(SystemExit) as exit_:
        _parser().parse_args(argv)
    assert exit_.value.code == 2
    assert f"unrecognized arguments: {' '.join(argv[1:])}; did you mean {hint}?" in capsys.readouterr().err


def test_known_flags_parse(capsys):
    assert _parser().parse_args(["--num-samples", "3"]).num_samples == 3


def test_a_command_suggests_on_the_command_line(tmp_path):
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "lime_megatron.cli.make_arithmetic_data",
            "--output",
            str(tmp_path / "x.jsonl"),
            "--num-samples",
            "3",
            "--sede",
            "1",
        ],
        capture_output=True,
        text=True,
    )
    assert completed.returncode == 2
    assert completed.stderr.strip().endswith("unrecognized arguments: --sede 1; did you mean --seed?")
    assert not (tmp_path / "x.jsonl").exists()
