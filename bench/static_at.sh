#!/usr/bin/env bash
# The static report of the kernels at another commit, modelled by this tree's client and tool:
#   bench/static_at.sh COMMIT OUT_DIR [python -m bench.static arguments but --out]
# e.g. the kernels a GPU run measured, with the model of today (bench/README.md, calibration).
# A temporary worktree of COMMIT gets this tree's bench/ (results left out) in place of its own,
# and `python -m bench.static` runs there with triton_static as installed; the report records
# COMMIT, dirty (its bench is this tree's). The worktree is removed afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { echo "usage: bench/static_at.sh COMMIT OUT_DIR [bench.static arguments]" >&2; exit 2; }
COMMIT=$1 OUT=$(realpath -m "$2")
shift 2
TMP=$(mktemp -d)
trap 'git worktree remove --force "$TMP/tree" >/dev/null 2>&1 || true; rm -rf "$TMP"' EXIT
git worktree add --detach "$TMP/tree" "$COMMIT" >/dev/null
rm -rf "$TMP/tree/bench"
mkdir "$TMP/tree/bench"
tar -C bench --exclude=./results --exclude=__pycache__ -cf - . | tar -C "$TMP/tree/bench" -xf -
cd "$TMP/tree"
"${PYTHON:-python3}" -m bench.static --out "$OUT" "$@"
