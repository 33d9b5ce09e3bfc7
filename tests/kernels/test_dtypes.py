"""zerokl.kernels.dtypes: the one name <-> torch dtype table, and no other in the source tree."""
import ast
import pathlib

import pytest
import torch

from zerokl.kernels import dtypes
from zerokl.kernels.dtypes import (COMPUTE_DTYPES, DTYPES, FP8, FP8_ALIAS, MODEL_DTYPES, canonical_name, dtype_name,
                                   names_fp8, to_dtype)

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCE = ("kernels", "services", "zerokl", "tools")
HOME = ROOT / "kernels" / "zerokl" / "kernels" / "dtypes.py"


def test_canonical_names_are_torchs_own():
    for name, dtype in DTYPES.items():
        assert dtype_name(dtype) == name == str(dtype).split(".")[-1]
        assert to_dtype(name) is dtype and canonical_name(name) == name
    assert set(MODEL_DTYPES) <= set(DTYPES)
    assert dtype_name(torch.bfloat16) == "bfloat16"


def test_fp8_has_one_alias():
    assert to_dtype(FP8_ALIAS) is FP8 is torch.float8_e4m3fn
    assert canonical_name("fp8") == "float8_e4m3fn" == dtype_name(FP8)
    assert names_fp8("fp8") and names_fp8("float8_e4m3fn")
    assert not any(names_fp8(n) for n in (None, "bfloat16", "float32", "e4m3", ""))


def test_compute_dtypes_are_what_the_flags_accept():
    assert [to_dtype(n) for n in COMPUTE_DTYPES] == [torch.float32, torch.bfloat16, FP8]
    from zerokl import vocab        # spelled there for what reads them without torch (zerokl up, TrainConfig, a server)
    assert vocab.COMPUTE_DTYPES == COMPUTE_DTYPES


@pytest.mark.parametrize("name", ["bf16", "torch.float32", "float8", "int8", ""])
def test_an_unknown_name_is_refused(name):
    with pytest.raises(ValueError, match="dtype"):
        to_dtype(name)


def test_among_restricts_the_names_a_caller_takes():
    assert to_dtype("fp8", among=COMPUTE_DTYPES) is FP8
    with pytest.raises(ValueError, match="expected one of float32, bfloat16, fp8"):
        to_dtype("float16", among=COMPUTE_DTYPES)


def _sources():
    for top in SOURCE:
        for path in sorted((ROOT / top).rglob("*.py")):
            if path != HOME and ".venv" not in path.parts:
                yield path


_DTYPE_ATTRS = {name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)}


def _name_to_dtype_dicts(tree: ast.AST):
    """Dict literals keyed by a dtype's name (any spelling: {"bfloat16": torch.bfloat16}, not a
    {"dtype": torch.float32} of keyword arguments), and comprehensions over a literal of torch dtypes."""
    is_dtype = lambda v: (isinstance(v, ast.Attribute) and isinstance(v.value, ast.Name)   # noqa: E731
                          and v.value.id == "torch" and v.attr in _DTYPE_ATTRS)
    names = _DTYPE_ATTRS | {FP8_ALIAS, "bf16", "fp16", "fp32", "e4m3"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict) and node.keys and any(
                isinstance(k, ast.Constant) and k.value in names and is_dtype(v)
                for k, v in zip(node.keys, node.values)):
            yield node.lineno
        if isinstance(node, ast.DictComp) and any(isinstance(g.iter, (ast.Tuple, ast.List)) and g.iter.elts
                                                  and all(map(is_dtype, g.iter.elts)) for g in node.generators):
            yield node.lineno


def test_no_other_module_names_dtypes():
    """One table (zerokl.kernels.dtypes): no other module cuts "torch." off a dtype's str() or keeps
    its own name -> dtype dict (what torchtitan keeps one of)."""
    cuts, tables = [], []
    for path in _sources():
        text = path.read_text()
        rel = path.relative_to(ROOT)
        cuts += [f"{rel}:{i}" for i, line in enumerate(text.splitlines(), 1)
                 if 'removeprefix("torch.")' in line or "removeprefix('torch.')" in line]
        tables += [f"{rel}:{line}" for line in _name_to_dtype_dicts(ast.parse(text, str(path)))]
    assert not cuts, f"use zerokl.kernels.dtypes.dtype_name: {cuts}"
    assert not tables, f"use zerokl.kernels.dtypes (DTYPES, to_dtype): {tables}"


def test_the_checks_see_a_table():
    tree = ast.parse('T = {"fp8": torch.float8_e4m3fn}\nU = {str(d): d for d in (torch.int8,)}\n'
                     'V = {"dtype": torch.float32}')
    assert sorted(_name_to_dtype_dicts(tree)) == [1, 2]
    assert dtypes.__all__ and "DTYPES" in dtypes.__all__
