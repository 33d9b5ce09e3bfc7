"""The flags of EngineConfig and RLConfig are generated from the dataclasses (as TrainConfig's are):
every field reaches every command line that takes the config, old flag names keep working, and a
bad number is one usage line."""
from __future__ import annotations

import argparse
import dataclasses
import typing

import pytest

from zerokl import cli
from zerokl.services.engine.types import EngineConfig
from zerokl.services.inference.server import build_parser as inference_parser
from zerokl.services.rl.loop import RLConfig
from zerokl.services.runtime.dataclass_flags import TRISTATE, dataclass_from_args, flag_name


def _non_default(cls: type, f: dataclasses.Field, tp: typing.Any, default: typing.Any) -> typing.Any:
    if tp is bool:
        return not default
    if set(typing.get_args(tp)) == {bool, type(None)}:
        return False if default is not False else True
    if tp in (int, int | None):
        return (default or 7) + 3
    if tp is float:
        return default / 2 + 0.25
    raise AssertionError(f"{cls.__name__}.{f.name}: no test value for {tp}: teach this test (and the flags) its type")


def _every_field_changed(cls: type, defaults: typing.Any) -> typing.Any:
    hints = typing.get_type_hints(cls)
    return cls(**{f.name: _non_default(cls, f, hints[f.name], getattr(defaults, f.name))
                  for f in dataclasses.fields(cls)})


def _flags_for(config: typing.Any) -> list[str]:
    hints, out = typing.get_type_hints(type(config)), []
    for f in dataclasses.fields(config):
        flag, v = flag_name(f), getattr(config, f.name)
        if hints[f.name] is bool:
            out.append(flag if v else "--no-" + flag[2:])
        elif v is None or isinstance(v, bool):
            out += [flag, {v: k for k, v in TRISTATE.items()}[v]]
        else:
            out += [flag, repr(v)]
    return out


def _parsers() -> dict[str, tuple[type, argparse.ArgumentParser, list[str], typing.Any]]:
    """name -> (config class, the parser, flags it needs besides the config's, the defaults it shows)."""
    submit = cli.build_parser(["jobs"])
    return {
        "serve decode": (EngineConfig, inference_parser("decode"), ["--preset", "tiny"], EngineConfig()),
        "serve prefill": (EngineConfig, inference_parser("prefill"), ["--preset", "tiny"], EngineConfig()),
        "jobs submit": (RLConfig, submit, ["jobs", "submit", "rl"], None),
        "demo": (RLConfig, cli.build_parser(["demo"]), ["demo"], RLConfig(prompts_per_step=16, eval_prompts=64)),
    }


@pytest.mark.parametrize("name", sorted(_parsers()))
def test_every_config_field_has_a_flag(name: str) -> None:
    cls, parser, base, defaults = _parsers()[name]
    want = _every_field_changed(cls, defaults or cls())
    assert [f.name for f in dataclasses.fields(cls) if getattr(want, f.name) == getattr(defaults or cls(), f.name)] == []
    assert dataclass_from_args(cls, parser.parse_args([*base, *_flags_for(want)])) == want
    if defaults is not None:
        assert dataclass_from_args(cls, parser.parse_args(base)) == defaults
    else:   # `zerokl jobs submit`: --steps is required, the rest defaults to RLConfig's
        with pytest.raises(SystemExit):
            parser.parse_args(base)
        assert dataclass_from_args(cls, parser.parse_args([*base, "--steps", "4"])) == RLConfig(steps=4)


def test_the_engine_flags_keep_their_names() -> None:
    """--no-prefix-caching, --no-cuda-graphs and --warm-up were hand-written flags before; they mean what they did."""
    parser = inference_parser("decode")
    config = dataclass_from_args(EngineConfig, parser.parse_args(
        ["--preset", "tiny", "--no-prefix-caching", "--no-cuda-graphs", "--warm-up", "--max-model-len", "64"]))
    assert config == EngineConfig(enable_prefix_caching=False, cuda_graphs=False, warm_up=True, max_model_len=64)
    helps = {a.dest: a.help for a in parser._actions}
    assert all(helps[f.name] and not helps[f.name].startswith("(default") for f in dataclasses.fields(EngineConfig))


@pytest.mark.parametrize("argv,message", [
    (["--prompts", "0"], "argument --prompts: must be in 1..4294967295, got 0"),
    (["--eval-prompts", "x"], "argument --eval-prompts: expected an integer, got 'x'"),
    (["--max-staleness", "-1"], "argument --max-staleness: must be in 0..4294967295, got -1"),
])
def test_demo_refuses_bad_numbers_in_one_line(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.build_parser(["demo"]).parse_args(["demo", *argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]


def test_a_surface_takes_some_fields_with_its_own_defaults() -> None:
    """What `zerokl experiment` or a benchmark needs to take only part of a config: ``skip`` on both sides,
    ``defaults`` for its own values; a flag it skipped is not there."""
    from zerokl.services.runtime.dataclass_flags import add_dataclass_arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)
    keep = ("num_blocks", "max_num_seqs", "max_num_batched_tokens")
    skip = tuple(f.name for f in dataclasses.fields(EngineConfig) if f.name not in keep)
    add_dataclass_arguments(parser, EngineConfig, skip=skip, defaults=EngineConfig(num_blocks=2048))
    got = dataclass_from_args(EngineConfig, parser.parse_args(["--max-num-seqs", "8"]), skip=skip)
    assert got == EngineConfig(num_blocks=2048, max_num_seqs=8)
    with pytest.raises(SystemExit):
        parser.parse_args(["--block-size", "8"])
