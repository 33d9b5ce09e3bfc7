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



def _generated(cls: type, skip: tuple[str, ...], defaults: typing.Any) -> dict[str, argparse.Action]:
    """dest -> the action add_dataclass_arguments makes for each field not skipped."""
    from zerokl.services.runtime.dataclass_flags import add_dataclass_arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_dataclass_arguments(parser, cls, skip=skip, defaults=defaults)
    return {a.dest: a for a in parser._actions if a.dest != "help"}


def _partial_surfaces() -> dict[str, tuple]:
    """name -> (its parser, the flags it needs, [(config class, the fields it takes, the defaults it shows)],
    flags it must not have: fields it does not honour)."""
    from zerokl import experiment

    ap = argparse.ArgumentParser(allow_abbrev=False)
    experiment.add_arguments(ap)
    return {
        "zerokl experiment": (ap, ["countdown"], [
            (RLConfig, ("steps", "prompts_per_step", "group_size", "temperature", "eval_every", "eval_prompts"),
             RLConfig(steps=30, prompts_per_step=16, group_size=8, eval_every=10, eval_prompts=64)),
            (EngineConfig, ("num_blocks", "max_num_seqs", "max_num_batched_tokens"),
             EngineConfig(num_blocks=2048, max_num_seqs=64, max_num_batched_tokens=512))],
            ["--top-p", "--max-staleness", "--ignore-eos", "--block-size", "--warm-up"]),
        "bench_rl_step": (_bench_rl_step().build_parser(), [], [
            (RLConfig, ("steps", "prompts_per_step", "group_size", "max_tokens", "seed", "ignore_eos"),
             RLConfig(steps=5, prompts_per_step=64, group_size=8, max_tokens=24, seed=0, ignore_eos=False)),
            (EngineConfig, ("num_blocks", "max_num_seqs", "max_num_batched_tokens"),
             EngineConfig(num_blocks=8192, max_num_seqs=512, max_num_batched_tokens=2048))],
            ["--top-p", "--max-staleness", "--temperature", "--eval-every", "--block-size", "--warm-up"]),
    }


def _bench_rl_step():  # noqa: ANN202
    """tools/bench/bench_rl_step.py as a module (the benchmarks are scripts, not a package)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[3] / "tools" / "bench" / "bench_rl_step.py"
    spec = importlib.util.spec_from_file_location("bench_rl_step", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["zerokl experiment", "bench_rl_step"])
def test_a_surface_taking_part_of_a_config_has_the_generated_flags(name: str) -> None:
    """`zerokl experiment` and tools/bench/bench_rl_step.py take some RLConfig and EngineConfig fields: their
    flags for them are the generated ones (names, help, types, bounds) with their own defaults, and parse back
    into the config."""
    parser, base, configs, absent = _partial_surfaces()[name]
    actions = {a.dest: a for a in parser._actions}
    for cls, fields, defaults in configs:
        skip = tuple(f.name for f in dataclasses.fields(cls) if f.name not in fields)
        for dest, want in _generated(cls, skip, defaults).items():
            got = actions[dest]
            assert (got.option_strings, got.help, got.default, got.type.__qualname__ if got.type else None,
                    got.nargs, got.choices, got.metavar) == \
                   (want.option_strings, want.help, want.default, want.type.__qualname__ if want.type else None,
                    want.nargs, want.choices, want.metavar), dest
        assert dataclass_from_args(cls, parser.parse_args(base), skip=skip) == defaults
        changed = _every_field_changed(cls, defaults)
        want = dataclasses.replace(defaults, **{f: getattr(changed, f) for f in fields})
        argv = [t for f in fields for t in _flags_for(want)[slice(*_flag_span(want, f))]]
        assert dataclass_from_args(cls, parser.parse_args([*base, *argv]), skip=skip) == want
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--prompts", "0"])          # the field's bounds
    option_strings = {s for a in parser._actions for s in a.option_strings}
    assert option_strings.isdisjoint(absent)


def _flag_span(config: typing.Any, name: str) -> tuple[int, int]:
    """Where field ``name``'s tokens lie in ``_flags_for(config)`` (a bool field's flag is one, the others two)."""
    hints, i = typing.get_type_hints(type(config)), 0
    for f in dataclasses.fields(config):
        n = 1 if hints[f.name] is bool else 2
        if f.name == name:
            return i, i + n
        i += n
    raise KeyError(name)
