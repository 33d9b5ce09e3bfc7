"""Regenerate the Python gRPC/protobuf modules next to the .proto files.

    python tools/gen_protos.py          # write protos/zerokl/v1/*_pb2*.py
    python tools/gen_protos.py --check  # exit 1 if the committed files are stale

Generated code is committed so that a plain `pip install` needs no protoc; the
test suite runs --check so the committed code never drifts from the .proto.
"""
from __future__ import annotations

import argparse
import filecmp
import pathlib
import shutil
import sys
import tempfile

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROTO_ROOT = ROOT / "protos"
PKG_DIR = PROTO_ROOT / "zerokl" / "v1"


def generate(out_dir: pathlib.Path) -> None:
    include = pathlib.Path(protoc.__file__).parent / "_proto"
    for proto in sorted(PKG_DIR.glob("*.proto")):
        rc = protoc.main([
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(proto.relative_to(PROTO_ROOT)),
        ])
        if rc != 0:
            raise SystemExit(f"protoc failed on {proto}")


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only compare, write nothing")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = pathlib.Path(tmp)
        generate(tmp_path)
        produced = sorted((tmp_path / "zerokl" / "v1").glob("*.py*"))
        stale = [p.name for p in produced if not (PKG_DIR / p.name).exists()
                 or not filecmp.cmp(p, PKG_DIR / p.name, shallow=False)]
        if args.check:
            if stale:
                print("stale generated files:", ", ".join(stale), "- run tools/gen_protos.py")
                return 1
            print(f"{len(produced)} generated files are current")
            return 0
        for p in produced:
            shutil.copyfile(p, PKG_DIR / p.name)
        (PKG_DIR / "__init__.py").write_text('"""Generated protobuf and gRPC modules for zerokl.v1 (see tools/gen_protos.py)."""\n')
        print(f"wrote {len(produced)} files to {PKG_DIR.relative_to(ROOT)}")
        return 0


if __name__ == "__main__":
    sys.exit(main())
