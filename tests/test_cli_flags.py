"""train's flags come from the configs' fields (config.flag): the parser says what they say.

In-process and quick: the parser is built and parsed here; tests/test_errors.py and
tests/test_train.py run the real command line.
"""

import argparse
from dataclasses import fields

import pytest

from fsdp_lesson.__main__ import CONFIGS, UsageError, build_parser, configs_from
from fsdp_lesson.config import ModelConfig, RunConfig, TrainConfig
from fsdp_lesson.data import DEFAULT_PATH

FLAGGED = [(c, f) for c in CONFIGS for f in fields(c) if "flag" in f.metadata]


def train_parser() -> argparse.ArgumentParser:
    """The `train` subcommand's parser (argparse keeps subparsers in a private list)."""
    commands = next(a for a in build_parser()._actions if a.choices and "train" in a.choices)
    return commands.choices["train"]


def parse(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["train", *flags])


@pytest.mark.parametrize("config_class, field", FLAGGED, ids=[f.name for _, f in FLAGGED])
def test_every_flagged_field_is_a_flag_with_its_help_default_and_parsing(config_class, field):
    by_flag = {s: a for a in train_parser()._actions for s in a.option_strings}
    action = by_flag[field.metadata["flag"]]
    assert action.dest == field.name
    assert action.help == field.metadata["help"]
    assert action.default == field.metadata.get("default", field.default)
    assert action.type == field.metadata.get("type")
    assert action.choices == field.metadata.get("choices")


def test_the_only_flags_that_are_no_field_are_help_and_out():
    flags = {s for a in train_parser()._actions for s in a.option_strings}
    from_fields = {f.metadata["flag"] for _, f in FLAGGED} | {"--no-prefetch"}
    assert flags - from_fields == {"-h", "--help", "--out"}


def test_no_flags_give_the_configs_defaults():
    model, train, run = configs_from(parse())
    assert model == ModelConfig() and train == TrainConfig()
    assert run == RunConfig(data=DEFAULT_PATH)  # what RunConfig's None stands for, spelled out


def test_flags_round_trip_into_the_configs(tmp_path):
    (tmp_path / "checkpoint").mkdir()  # --resume takes the --out that holds the checkpoint
    args = parse(
        *("--strategy", "zero3", "--optimizer", "adam", "--steps", "7", "--hidden", "8"),
        *("--no-prefetch", "--no-reshard-after-forward", "--accum-reduce", "last"),
        *("--clip-grad-norm", "1.5", "--c-compat", "--collectives", "ring"),
        *("--out", str(tmp_path), "--save-every", "2", "--resume", str(tmp_path)),
    )
    model, train, run = configs_from(args)
    assert (model.hidden, model.emb, model.layers) == (8, 16, 1)
    assert (train.strategy, train.optimizer, train.lr, train.steps) == ("zero3", "adam", 1e-3, 7)
    assert (train.prefetch, train.reshard_after_forward, train.accum_reduce) == (
        False,
        False,
        "last",
    )
    assert (train.clip_grad_norm, train.c_compat, train.batch) == (1.5, True, 32)
    assert (run.collectives, run.save_every) == ("ring", 2)
    assert run.checkpoint_dir == run.resume == tmp_path / "checkpoint"


def test_a_bad_value_is_the_one_line_the_types_say():
    with pytest.raises(UsageError, match="argument --steps: must be 0 or more, got -1"):
        parse("--steps", "-1")
    with pytest.raises(UsageError, match="argument --lr: 'fast' is not a number"):
        parse("--lr", "fast")


def test_help_shows_the_defaults_of_values_but_not_of_plain_switches(monkeypatch):
    # wide lines: argparse breaks a long default at a hyphen ("/work/wt- testtime/...")
    monkeypatch.setenv("COLUMNS", "1000")
    text = " ".join(train_parser().format_help().split())
    assert "gradients while computing (default: True)" in text  # --prefetch | --no-prefetch
    assert "(2x instead of 3x traffic) --replicate" in text  # --no-reshard-after-forward
    assert "(docs/seed_semantics.md) --eval-batches" in text  # --c-compat
    assert "(default: 25000)" in text and f"(default: {DEFAULT_PATH})" in text
