#!/usr/bin/env bash
# Refresh constraints.txt: the exact versions the README's commands install (CI's pins).
#   bash tools/refresh_constraints.sh
# Resolves today's newest releases in a fresh virtual environment (Python 3.11, the CPU
# torch the README pins), then writes what pip installed. Run tools/test_latest.sh first:
# commit the new pins only with a green suite.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(mktemp -d)
trap 'rm -rf "$venv"' EXIT
python3 -m venv "$venv"
"$venv/bin/pip" install -q torch==2.13.0 -e ".[test]"
{
  echo "# CI's pins: every distribution the README's commands install, at the version last tested"
  echo "# (Python 3.11, CPU torch). Refresh: bash tools/refresh_constraints.sh; newest releases"
  echo "# without these pins: bash tools/test_latest.sh. torch is pinned by the commands themselves."
  "$venv/bin/pip" freeze --exclude-editable | grep -v -i -E '^(torch|pip|setuptools|wheel)=='
} > constraints.txt
echo "constraints.txt: $(grep -c '==' constraints.txt) pins"
