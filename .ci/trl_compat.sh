#!/usr/bin/env bash
# CI's second TRL release: the TRL test files under TRL 1.15.x (the main environment has 1.16).
#
#   A venv on top of the main environment (--system-site-packages: torch, transformers, the
#   package's other dependencies are the main environment's) with TRL 1.15.x installed over it
#   (--no-deps: its requirements are the main environment's), so the main environment keeps its
#   TRL; then every TRL test file (tests/test_integration_trl.py, tests/test_trl_*.py) with this
#   checkout first on the path. The venv is built fresh in a temporary directory (a few seconds).
# Exit status non-zero when the venv cannot be built, the main environment's TRL changed, or a test
# failed. Environment: TRL_COMPAT_SPEC (default "trl==1.15.*").
set -uo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
SPEC="${TRL_COMPAT_SPEC:-trl==1.15.*}"
START=$(date +%s)
say() { echo "trl_compat [+$(( $(date +%s) - START ))s]: $*"; }

main_trl() { python3 -c 'import trl; print(trl.__version__)'; }
MAIN_TRL="$(main_trl)" || { say "FAILED: the main environment has no TRL"; exit 1; }

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
VENV="$WORK/venv"
if ! { python3 -m venv --system-site-packages "$VENV" &&
       "$VENV/bin/python" -m pip install --quiet --no-deps "$SPEC" > "$WORK/install.log" 2>&1; }; then
  grep -v "is ignored" "$WORK/install.log" | tail -20
  say "FAILED: could not install $SPEC in the venv"
  exit 1
fi
VENV_TRL="$("$VENV/bin/python" -c 'import trl; print(trl.__version__)')"
say "venv: trl $VENV_TRL over the main environment's (trl $MAIN_TRL)"
case "$VENV_TRL" in
  1.15.*) ;;
  *) say "FAILED: the venv imports trl $VENV_TRL, not $SPEC"; exit 1 ;;
esac

mapfile -t FILES < <(ls tests/test_integration_trl.py tests/test_trl_*.py 2>/dev/null)
say "running ${#FILES[@]} TRL test files under trl $VENV_TRL"
# No TPO_KERNELS_ALLOW_UNTESTED_TRL: 1.15 is a tested release, the version check must accept it.
env -u TPO_KERNELS_ALLOW_UNTESTED_TRL PYTHONPATH="$REPO" \
  "$VENV/bin/python" -m pytest -q -p no:cacheprovider -rfE "${FILES[@]}"
rc=$?

if [ "$(main_trl)" != "$MAIN_TRL" ]; then
  say "FAILED: the main environment's TRL changed ($MAIN_TRL -> $(main_trl))"
  exit 1
fi
[ "$rc" = 0 ] || { say "FAILED: the TRL tests under trl $VENV_TRL (exit $rc)"; exit "$rc"; }
say "OK in $(( $(date +%s) - START ))s"
