"""``pretrain_lime.py``'s parser: ``--help`` with every default and the required options marked,
sections named for what they hold, no abbreviated flags, a suggestion for an unknown flag or
config key, the data paths checked before the trainer starts."""

from __future__ import annotations

import argparse

import pytest

from lime_megatron import choices
from lime_megatron.training import arguments
from lime_megatron.training.arguments import ArgumentsError, build_parser, parse_args

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16"]
BASE += ["--micro-batch-size", "1", "--train-iters", "2", "--lr", "1e-3", "--mock-data", "--vocab-size", "128"]


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [action for action in parser._actions if action.option_strings and action.dest != "help"]


def expanded_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The help text of ``action`` as ``--help`` prints it (argparse's ``%(name)s`` filled in)."""
    return (action.help or "") % dict(vars(action), prog=parser.prog)


def test_help_shows_every_options_default_and_marks_the_required_ones():
    parser = build_parser()
    defaults = 0
    for action in options(parser):
        text = expanded_help(parser, action)
        if action.dest in arguments.REQUIRED:
            assert "required" in text, action.dest
        elif action.default is not None and action.const is None:  # store_true flags are off
            value = action.default
            shown = " ".join(map(str, value)) if isinstance(value, list | tuple) else str(value)
            assert f"default: {shown}" in text, (action.dest, text)
            defaults += 1
    assert defaults > 50
    assert parser.format_help()  # every help string formats


def test_help_sections_say_what_they_hold():
    parser = build_parser()
    titles = {action.dest: group.title for group in parser._action_groups for action in group._group_actions}
    assert titles["bf16"] == titles["fp16"] and "CPU and GPU" in titles["bf16"]  # bf16 trains on CPU too
    assert "(default: False)" in " ".join(expanded_help(parser, a) for a in options(parser) if a.dest == "bf16")
    assert titles["num_layers"] == "model shape and architecture"
    assert titles["config"] == titles["dry_run"] == "config file and dry run"
    assert [dest for dest, title in titles.items() if title == titles["help"]] == ["help"]  # argparse's own


@pytest.mark.parametrize(
    "flags,suggestion",
    [
        (["--num-layer", "4"], "did you mean --num-layers?"),  # an abbreviation is not taken
        (["--hiden-size", "4"], "did you mean --hidden-size?"),
        (["--lime-routr=full"], "did you mean --lime-router?"),
    ],
)
def test_an_unknown_flag_gets_the_closest_known_one(flags, suggestion):
    with pytest.raises(ArgumentsError) as error:
        parse_args(BASE + flags, world_size=1)
    message = str(error.value)
    assert message.startswith("command line: unrecognized arguments: ") and message.endswith(suggestion)
    assert "\n" not in message


def test_an_unknown_flag_far_from_every_known_one_gets_no_suggestion():
    with pytest.raises(ArgumentsError, match=r"unrecognized arguments: --zzzzzz$"):
        parse_args(BASE + ["--zzzzzz"], world_size=1)


def test_an_unknown_config_key_gets_the_closest_known_one(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("num_layer: 4\n")
    with pytest.raises(ArgumentsError, match="unknown option 'num_layer' .*; did you mean num_layers\\?$"):
        parse_args(["--config", str(config)], world_size=1)


def test_an_empty_value_turns_a_config_file_setting_off(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("save: ckpt\nload: ckpt\nsave_interval: 5\nwandb_project: p\nlime: true\nlime_router: average\n")
    args = parse_args(["--config", str(config), *BASE], world_size=1)
    assert (args.save, args.load, args.save_interval, args.wandb_project) == ("ckpt", "ckpt", 5, "p")
    emptied = ["--save", "", "--load", "", "--save-interval", "", "--wandb-project", ""]
    args = parse_args(["--config", str(config), *BASE, *emptied], world_size=1)
    assert (args.save, args.load, args.save_interval, args.wandb_project) == (None, None, None, None)
    assert args.lime_router == "average"  # the settings not emptied stay
    with pytest.raises(ArgumentsError, match="--save-interval needs --save"):
        parse_args(["--config", str(config), *BASE, "--save", ""], world_size=1)


def test_data_paths_are_checked_before_the_trainer(tmp_path):
    real_data = [a for a in BASE if a != "--mock-data"] + ["--tokenizer-type", "NullTokenizer"]
    run = arguments.parse_run(real_data + ["--data-path", str(tmp_path / "x")], 1)
    with pytest.raises(ArgumentsError, match=r"data path '.*x': .*x\.bin and .*x\.idx not found"):
        arguments.check_data_paths(run.data)
    (tmp_path / "x.bin").touch()
    with pytest.raises(ArgumentsError, match=r"data path '.*x': .*x\.idx not found"):
        arguments.check_data_paths(run.data)
    (tmp_path / "x.idx").touch()
    arguments.check_data_paths(run.data)
    arguments.check_data_paths(arguments.parse_run(BASE, 1).data)  # mock data: no path


def test_choices_are_those_of_the_modules_that_act_on_them():
    from lime_megatron.inference.scoring import TASKS
    from lime_megatron.models.config import LimeTransformerConfig
    from lime_megatron.planning.routing_block import MACHINES

    assert tuple(TASKS) == choices.GENERATION_TASKS
    assert tuple(MACHINES) == choices.MACHINE_NAMES
    assert LimeTransformerConfig.lime_router == choices.DEFAULT_ROUTER in choices.ROUTER_VARIANTS
