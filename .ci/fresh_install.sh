#!/usr/bin/env bash
# CI's fresh-install job: a new virtual environment built only by the README's install block, then
# the README's test command there, so that README and CI cannot drift.
#
#   1. the commands are read from README.md (--print-commands prints them and stops);
#   2. a snapshot of this checkout (HEAD plus uncommitted changes and untracked, not ignored files),
#      as a git repository, stands in for the README's "<this repository>";
#   3. a new venv (python3 -m venv, nothing from this environment) is activated and the README's
#      "## Install" bash block runs there as written, line by line (the placeholder is the only
#      substitution): clone, the CPU torch wheel, pip install -e ".[test]", tpo-kernels demo;
#   4. in the clone, the README's quick test command ("## Tests" block, the line with -m quick), the
#      collection of the whole suite (every test file imports without the optional libraries), then
#      FRESH_TESTS below: the build checks (they need pybind11 and setuptools from [test]), the
#      package without Triton, the README's code blocks, and every test file that needs an optional
#      library ([trl], [bench], verl: not installed here, so they must skip, with the reason, not fail).
# The full suite runs in CI's main environment (.ci/run). The CUDA extension is not built here
# (TPO_SKIP_CUDA=1, the README's own switch): CI's main environment builds it with TPO_REQUIRE_CUDA.
# Usage: .ci/fresh_install.sh [--print-commands]. FRESH_INSTALL_KEEP=1 keeps the work folder (printed).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
START=$(date +%s)
say() { echo "fresh_install [+$(( $(date +%s) - START ))s]: $*"; }

# The README's quick line runs first; these follow it in one pytest process.
FRESH_TESTS=(
  tests/test_native_build.py
  tests/test_without_triton.py
  tests/test_readme.py
  tests/test_integration_trl.py
  tests/test_integration_verl.py
  tests/test_verl_split_ranks.py
  tests/test_trl_split_ranks.py
  tests/test_trl_moe.py
  tests/test_trl_rlvr.py
  tests/test_bench_trainer_step.py
  "tests/test_bench.py::test_plots_and_throughput"
  "tests/test_reverse_copy.py::test_cli_writes_outputs"
)

WORK="$(mktemp -d "${TMPDIR:-/tmp}/tpo_fresh_install.XXXXXX")"
if [ "${FRESH_INSTALL_KEEP:-0}" = 1 ]; then
  say "work folder kept: $WORK"
else
  trap 'rm -rf "$WORK"' EXIT
fi

SOURCE="$WORK/repository"  # the snapshot (2.), the clone's source
# ---------------------------------------------------------------------------- 1. the README's commands
# The script that runs in the venv: the install block's lines (each announced with the time), then
# the quick test line and FRESH_TESTS.
python3 - "$REPO/README.md" "$SOURCE" "$WORK/commands.sh" "${FRESH_TESTS[@]}" <<'EOF'
import re
import shlex
import sys

readme, source, out, *fresh_tests = sys.argv[1:]
text = open(readme, encoding="utf-8").read()


def bash_block(section: str) -> list:
    """The commands of the first bash block under the README heading ``section``: continuation
    lines joined, comment-only and empty lines dropped (bash would skip them too)."""
    match = re.search(rf"^## {re.escape(section)}\n(.*?)(?=^## )", text, re.S | re.M)
    block = match and re.search(r"^```bash\n(.*?)^```", match.group(1), re.S | re.M)
    if not block:
        sys.exit(f"fresh_install: README.md has no bash block under '## {section}'")
    lines = block.group(1).replace("\\\n", " ").splitlines()
    return [line for line in lines if line.strip() and not line.lstrip().startswith("#")]


install = bash_block("Install")
placeholder = "<this repository>"
if sum(line.count(placeholder) for line in install) != 1:
    sys.exit(f"fresh_install: the README's install block must name '{placeholder}' once (the clone)")
install = [line.replace(placeholder, shlex.quote(source)) for line in install]
quick = [line for line in bash_block("Tests") if " -m quick" in line]
if len(quick) != 1:
    sys.exit("fresh_install: the README's '## Tests' block must have one line with '-m quick'")
script = ['set -euo pipefail', 'step() { echo "fresh_install [+$(( $(date +%s) - START ))s]: \\$ $1"; }']
for line in install + quick:
    script += [f"step {shlex.quote(line)}", line]
# Every test file imports (collection) without the optional libraries; then FRESH_TESTS run.
collect = "python -m pytest -q --collect-only tests > /dev/null"
tests = "python -m pytest -q -rs " + " ".join(shlex.quote(t) for t in fresh_tests)
for line in (collect, tests):
    script += [f"step {shlex.quote(line)}", line]
open(out, "w", encoding="utf-8").write("\n".join(script) + "\n")
EOF

if [ "${1:-}" = "--print-commands" ]; then  # what would run in the venv, nothing run (tests read it)
  cat "$WORK/commands.sh"
  exit 0
fi

# ---------------------------------------------------------------------------- 2. the snapshot
git clone -q "$REPO" "$SOURCE"
git -C "$SOURCE" checkout -q -B fresh-install "$(git -C "$REPO" rev-parse HEAD)"
if ! git -C "$REPO" diff --quiet HEAD; then
  git -C "$REPO" diff --binary HEAD | git -C "$SOURCE" apply --whitespace=nowarn
fi
git -C "$REPO" ls-files -z --others --exclude-standard | tar -C "$REPO" --null -T - -cf - | tar -C "$SOURCE" -xf -
git -C "$SOURCE" add -A
if ! git -C "$SOURCE" diff --cached --quiet; then
  git -C "$SOURCE" -c user.name=ci -c user.email=ci@localhost commit -q -m "uncommitted changes of $REPO"
  say "testing HEAD $(git -C "$REPO" rev-parse --short HEAD) plus the uncommitted changes"
else
  say "testing HEAD $(git -C "$REPO" rev-parse --short HEAD)"
fi

# ---------------------------------------------------------------------------- 3. the venv
say "new venv $WORK/venv ($(python3 --version))"
python3 -m venv "$WORK/venv"
# shellcheck disable=SC1091
source "$WORK/venv/bin/activate"
unset PYTHONPATH TRITON_INTERPRET
export TPO_SKIP_CUDA=1
unset TPO_REQUIRE_CUDA
# An index the block names that does not resolve here (a machine with its own package mirror in
# pip's configuration): pip falls back to the configured ones; without retries it does so at once
# instead of after five back-offs per package.
for host in $(grep -oE -- '--index-url https?://[^/ ]+' "$WORK/commands.sh" | sed -E 's#.*://##' | sort -u); do
  if ! python3 -c "import socket, sys; socket.getaddrinfo(sys.argv[1], 443)" "$host" 2>/dev/null; then
    say "$host does not resolve here: pip uses the indexes of its configuration (PIP_RETRIES=0)"
    export PIP_RETRIES=0
  fi
done

cd "$WORK"
# pip's notes on this machine's empty local index folders are dropped from the log.
if START="$START" bash "$WORK/commands.sh" 2>&1 | grep -v "is ignored: it is neither a file nor a directory"; then
  say "OK in $(( $(date +%s) - START ))s"
else
  rc=$?
  say "FAILED (exit $rc) after $(( $(date +%s) - START ))s"
  exit "$rc"
fi
