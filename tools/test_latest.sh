#!/usr/bin/env bash
# The suite against today's newest releases (not CI: CI installs constraints.txt's pins).
#   bash tools/test_latest.sh [pytest args...]
# A fresh virtual environment, the README's test command without the pins. Green: refresh
# the pins (tools/refresh_constraints.sh) and commit them. Red: an upstream release broke
# something before it reached CI.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(mktemp -d)
trap 'rm -rf "$venv"' EXIT
python3 -m venv "$venv"
"$venv/bin/pip" install -q --upgrade torch==2.13.0 -e ".[test]"
"$venv/bin/pip" list --format=freeze | grep -v -i -E '^(pip|setuptools|wheel)==' > "$venv/versions.txt"
echo "newest releases: $(wc -l < "$venv/versions.txt") distributions (diff against constraints.txt:)"
diff <(grep '==' constraints.txt | sort -f) <(grep -v -i '^torch==' "$venv/versions.txt" | sort -f) || true
"$venv/bin/python" -m pytest -q "$@"
