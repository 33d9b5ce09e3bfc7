#!/usr/bin/env bash
# Wheels the GPU machine's image lacks (it reaches no package registry): the services' gRPC stack,
# protobuf, OpenTelemetry, the MinIO client, zstandard (delta records), the Tinker endpoint's HTTP stack
# (starlette, uvicorn) and the official tinker SDK with what it needs, downloaded here into .whl/ (git-ignored) for its
# Python 3.12, x86-64. Carry `.whl` with a device call; tools/bench/h200_run.sh installs them.
#   bash tools/device_wheels.sh
set -eu
cd "$(dirname "$0")/.."
mkdir -p .whl
plat="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
# Versions as this project's CPU install resolves them (pip list), so both machines run the same stack.
# (pip spells some names with '_', e.g. pydantic_core: normalized to '-' before matching)
pkgs=$(python3 -m pip list --format=freeze 2>/dev/null | tr '_' '-' | grep -iE '^(grpcio|grpcio-health-checking|grpcio-reflection|grpcio-status|protobuf|googleapis-common-protos|opentelemetry-[a-z-]+|minio|argon2-cffi|argon2-cffi-bindings|cffi|pycparser|pycryptodome|zstandard|starlette|uvicorn|tinker|pydantic|pydantic-core|annotated-types|typing-inspection|typing-extensions|distro|orjson|pyqwest|httpx|httpcore|h2|hpack|hyperframe|sniffio|anyio|h11|click|rich|markdown-it-py|mdurl|pygments)==')
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat -d .whl $pkgs
ls .whl
