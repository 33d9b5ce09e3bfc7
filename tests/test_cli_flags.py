"""Every command line matches flags whole: an abbreviation is an error, never another flag.

argparse's default prefix matching turned `zerokl serve trainer --dp=2` into `--dpo-beta 2` (before
--dp was a flag of its own; `--dpo=2` is the abbreviation tested now).
"""
from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from zerokl import cli
from zerokl.services.inference import server as inference_server
from zerokl.services.routing import server as scheduler_server
from zerokl import up
from zerokl.services.tinker_api import server as tinker_server
from zerokl.services.trainer import server as trainer_server
from zerokl.services.weightstore import server as weightstore_server


def _every_parser(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """``parser`` and every sub-command parser under it, nested ones too."""
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                found += _every_parser(sub)
    return found


PARSERS = {
    "zerokl": cli.build_parser([]),
    # the commands whose flags load only when chosen (their modules import torch)
    "zerokl experiment": cli.build_parser(["experiment"]),
    "zerokl diff": cli.build_parser(["diff"]),
    "serve prefill": inference_server.build_parser("prefill"),
    "serve decode": inference_server.build_parser("decode"),
    "serve trainer": trainer_server.build_parser(),
    "serve scheduler": scheduler_server.build_parser(),
    "serve weight-store": weightstore_server.build_parser(),
    "serve tinker": tinker_server.build_parser(),
    "up": up.build_parser(),
}


def test_every_parser_and_sub_parser_refuses_abbreviations() -> None:
    parsers = [(name, p.prog) for name, top in PARSERS.items() for p in _every_parser(top) if p.allow_abbrev]
    assert parsers == []
    assert len(_every_parser(PARSERS["zerokl"])) == 16     # zerokl, its 11 commands, and the 4 of `jobs`


@pytest.mark.parametrize("name,argv,meant,unknown", [
    ("serve trainer", ["--dpo=2"], "--dpo-beta", "--dpo=2"),
    ("serve decode", ["--preset", "tiny", "--num-block", "4"], "--num-blocks", "--num-block 4"),
    ("serve scheduler", ["--decode", "127.0.0.1:1", "--route-w", "1"], "--route-wait", "--route-w 1"),
    ("serve weight-store", ["--keep", "3"], "--keep-last", "--keep 3"),
    ("up", ["--work", "/tmp/x"], "--workdir", "--work /tmp/x"),
    ("up", ["--tinker-sample", "2"], "--tinker-samplers", "--tinker-sample 2"),
    ("serve tinker", ["--weight-store", "a:1", "--http", "80"], "--http-port", "--http 80"),
    ("zerokl", ["generate", "--max-tok", "3", "--prompt-ids", "3,4"], "--max-tokens", "--max-tok"),
    ("zerokl", ["jobs", "submit", "rl", "--steps", "3", "--eval", "2"], "--eval-every", "--eval 2"),
    ("zerokl", ["status", "--js"], "--json", "--js"),
    ("zerokl experiment", ["experiment", "countdown", "--pres", "tiny"], "--preset", "--pres tiny"),
])
def test_an_abbreviated_flag_is_an_error(name, argv, meant, unknown, capsys) -> None:
    parser = PARSERS[name]
    assert any(meant in a.option_strings for p in _every_parser(parser) for a in p._actions), \
        f"{meant} is not a flag of {name}: the case tests nothing"
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"unrecognized arguments: {unknown}" in err, err


@pytest.mark.parametrize("argv,usage,hint", [
    (["generate", "--max-token", "3", "--prompt-ids", "3,4"], "zerokl generate", "did you mean --max-tokens?"),
    (["generate", "--max-token=3", "--prompt-ids", "3,4"], "zerokl generate", "did you mean --max-tokens?"),
    (["jobs", "submit", "rl", "--steps", "3", "--eval", "2"], "zerokl jobs submit", "did you mean --eval-every?"),
    (["status", "--jsn"], "zerokl status", "did you mean --json?"),
    (["verify", "--backends", "torch"], "zerokl verify", "did you mean --backend?"),
    (["jobs", "list", "--server", "127.0.0.1:1"], "zerokl jobs list",
     "--server is a flag of zerokl jobs: give it before list"),
])
def test_a_mistyped_flag_gets_its_commands_usage_and_what_it_likely_meant(argv, usage, hint, capsys) -> None:
    """Before: `zerokl generate --max-token 3` printed `zerokl`'s own usage (the list of commands) and
    "zerokl: error: unrecognized arguments", no hint. The hint never makes the flag work: still exit 2."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: {usage} ") and f"{usage}: error: unrecognized arguments: " in err, err
    assert err.strip().endswith(f"({hint})"), err


def test_a_flag_nothing_resembles_gets_no_hint(capsys) -> None:
    with pytest.raises(SystemExit):
        cli.main(["generate", "--zzz", "--prompt-ids", "3,4"])
    assert capsys.readouterr().err.strip().endswith("zerokl generate: error: unrecognized arguments: --zzz")


def test_zerokl_generate_with_a_mistyped_flag_as_a_command() -> None:
    r = subprocess.run([sys.executable, "-m", "zerokl", "generate", "--max-token", "3", "--prompt-ids", "3,4"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == "", r
    assert r.stderr.startswith("usage: zerokl generate ") and "usage: zerokl [-h]" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1] == ("zerokl generate: error: unrecognized arguments: --max-token "
                                                 "(did you mean --max-tokens?)"), r.stderr


def test_zerokl_serve_trainer_refuses_an_abbreviation_as_a_command() -> None:
    r = subprocess.run([sys.executable, "-m", "zerokl", "serve", "trainer", "--dpo=2"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "unrecognized arguments: --dpo=2" in r.stderr, r.stderr


@pytest.mark.parametrize("argv,message", [
    (["--steps", "-5"], "argument --steps: must be in 1..4294967295, got -5"),
    (["--steps", "3", "--lr", "inf"], "argument --lr: must be finite and >= 0"),
    (["--steps", "3", "--group", "1"], "argument --group: must be in 2..4294967295, got 1"),
    (["--steps", "3", "--seed", "-1"], "argument --seed: must be in 0..18446744073709551615, got -1"),
    (["--steps", "3", "--train-problems", "100001"], "argument --train-problems: must be in 1..100000, got 100001"),
])
def test_jobs_submit_refuses_bad_numbers_in_one_line(argv, message, capsys) -> None:
    """Before: `--steps -5` passed argparse and died in the protobuf conversion with a traceback."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(["jobs", "--server", "127.0.0.1:1", "submit", "rl", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and message in err.strip().splitlines()[-1], err


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_every_flag_and_argument_says_what_it_does(name: str) -> None:
    silent = [f"{sub.prog} {' '.join(a.option_strings) or a.dest}" for sub in _every_parser(PARSERS[name])
              for a in sub._actions if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))
              and not a.help]
    assert not silent, f"no help text: {silent}"
