"""The repository's folders never shadow an installed distribution.

Running from a checkout puts folders of the repository on ``sys.path`` ahead of
site-packages: the root (``python -m pytest``, ``python -m zerokl``, ``python -c`` there),
each test folder pytest's default import mode inserts (a folder without ``__init__.py``
holding a test file or a conftest.py), and each tools folder whose scripts are run by path.
A regular package (a folder with ``__init__.py``) or a module in any of them named like a
top-level module of an installed distribution is imported instead of it: transformers 5.25
imports the hub-kernels distribution ``kernels``, and a top-level ``kernels/__init__.py`` made
it import the numerics library's folder instead. So the code lives one level down, under its
import path (``kernels/zerokl/kernels``, ``services/zerokl/services``, ``protos/zerokl/v1``),
and the top-level folders are plain folders: a namespace portion, which never wins over an
installed package or module of the same name.

Checked two ways: by rule (no regular package or module in those folders is named like an
installed top-level module) and by behaviour (a Python process started in the root, with the
test and tools folders on its path, resolves every installed top-level module outside the
repository).
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
OWN_DISTRIBUTION = "zerokl"


def installed_top_level_names() -> set[str]:
    """Top-level module names of every installed distribution but this project's own."""
    return {name for name, dists in importlib.metadata.packages_distributions().items()
            if any(d.lower() != OWN_DISTRIBUTION for d in dists)}


def in_environment(path: pathlib.Path) -> bool:
    """Whether path lies in a virtual environment (a `.venv` inside the checkout is common): its
    site-packages are installed distributions, not the repository's folders."""
    return any((parent / "pyvenv.cfg").exists() for parent in [path, *path.parents])


def path_folders() -> list[pathlib.Path]:
    """The repository folders that reach sys.path when the project is run from a checkout."""
    folders = {ROOT}
    for top in ("tests", "tools"):
        for f in (ROOT / top).rglob("*.py"):
            # pytest's prepend mode inserts the first folder upwards without __init__.py;
            # `python tools/x/y.py` inserts the script's folder.
            folder = f.parent
            while (folder / "__init__.py").exists():
                folder = folder.parent
            folders.add(folder)
    folders.update(pathlib.Path(p).resolve() for p in sys.path if p and pathlib.Path(p).resolve().is_relative_to(ROOT))
    return sorted(f for f in folders if not in_environment(f))


def importable_names(folder: pathlib.Path) -> dict[str, pathlib.Path]:
    """Name -> entry for each regular package and module directly in folder."""
    out = {}
    for entry in folder.iterdir():
        if entry.name.startswith("."):
            continue
        if entry.is_dir() and (entry / "__init__.py").exists():
            out[entry.name] = entry
        elif entry.is_file() and entry.suffix in (".py", ".so", ".pyd"):
            out[entry.name.split(".")[0]] = entry
    return out


def test_no_folder_on_the_path_holds_a_package_named_like_an_installed_one():
    installed = installed_top_level_names()
    clashes = [f"{entry.relative_to(ROOT)} shadows the installed top-level module {name!r} "
               f"({', '.join(importlib.metadata.packages_distributions()[name])})"
               for folder in path_folders() for name, entry in importable_names(folder).items()
               if name in installed]
    assert not clashes, "\n".join(clashes)


_RESOLVE = """
import importlib.metadata, importlib.util, json, pathlib, sys
root = pathlib.Path(sys.argv[1])
own = {n for n, d in importlib.metadata.packages_distributions().items() if all(x.lower() == "zerokl" for x in d)}
names = set(importlib.metadata.packages_distributions()) - own
found = {}
for name in sorted(names):
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        continue
    if spec is None:
        continue
    places = [spec.origin] if spec.origin else []
    places += list(spec.submodule_search_locations or [])
    inside = [p for p in places if p and pathlib.Path(p).resolve().is_relative_to(root)
              and not any((d / "pyvenv.cfg").exists() for d in pathlib.Path(p).resolve().parents)]
    if inside:
        found[name] = inside
print(json.dumps(found))
"""


def test_every_installed_top_level_module_resolves_outside_the_repository():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(f) for f in path_folders() if f != ROOT)}
    r = subprocess.run([sys.executable, "-c", _RESOLVE, str(ROOT)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {}, f"resolved inside the repository: {r.stdout}"


def test_transformers_hub_kernels_imports_from_the_repository_root():
    pytest.importorskip("transformers")
    r = subprocess.run([sys.executable, "-c", "import transformers.integrations.hub_kernels"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
