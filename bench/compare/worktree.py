"""The base side's tree: a temporary, detached git worktree of the base commit with its own
extension built in place, removed again however the comparison ends."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, Optional


class CompareError(RuntimeError):
    """A comparison that cannot start (no git checkout, an unknown ref, a failed build)."""


def git(repository: Path, *args: str) -> str:
    proc = subprocess.run(["git", "-C", str(repository), *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise CompareError(f"git {' '.join(args)} failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout.strip()


def resolve_commit(repository: Path, ref: str) -> str:
    """The full commit id ``ref`` names in ``repository``."""
    try:
        git(repository, "rev-parse", "--is-inside-work-tree")
    except (CompareError, OSError) as exc:
        raise CompareError(f"{repository} is not a git checkout: bench.compare builds the base from git") from exc
    try:
        return git(repository, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
    except CompareError:
        raise CompareError(f"BASE {ref!r} names no commit in {repository}") from None


def tree_state(repository: Path) -> dict:
    """The checked-out commit of a tree and whether tracked files have uncommitted changes."""
    return {"commit": git(repository, "rev-parse", "HEAD"),
            "dirty": bool(git(repository, "status", "--porcelain", "--untracked-files=no"))}


def _write_build_info_if_absent(tree: Path, commit: str) -> None:
    """A base whose setup.py predates the generated ``_build_info`` still names its commit (the
    worktree is a clean checkout of it)."""
    path = tree / "tpo_kernels" / "_build_info.py"
    if not path.exists():
        path.write_text('"""Written by bench.compare for a base whose build does not write it."""\n\n'
                        f"COMMIT = {commit!r}\nDIRTY = False\n")


def build(tree: Path, with_cuda: bool, log=print) -> float:
    """Builds the tree's extensions in place (the CPU one; CUDA too when ``with_cuda``) and writes its
    ``tpo_kernels/_build_info.py`` the way the tree's own setup.py does (its build_py step, copying
    into a folder of the tree's build/); returns the seconds it took."""
    env = {k: v for k, v in os.environ.items() if k not in ("TPO_SKIP_CUDA", "TPO_REQUIRE_CUDA")}
    if not with_cuda:
        env["TPO_SKIP_CUDA"] = "1"
    command = [sys.executable, "setup.py", "build_ext", "--inplace",
               "build_py", "--build-lib", str(tree / "build" / "compare-lib")]
    log(f"building the base: {' '.join(command[1:])} ({'with' if with_cuda else 'without'} CUDA) in {tree}")
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
        raise CompareError(f"building the base failed (exit {proc.returncode}):\n{tail}")
    _write_build_info_if_absent(tree, git(tree, "rev-parse", "HEAD"))
    return seconds


@contextlib.contextmanager
def base_worktree(repository: Path, commit: str, log=print) -> Iterator[Path]:
    """A detached worktree of ``commit`` in a new temporary folder; on leaving (also on an error or
    KeyboardInterrupt) the worktree is removed from git's list and the folder deleted."""
    scratch = Path(tempfile.mkdtemp(prefix="tpo-compare-"))
    tree = scratch / "base"
    added: Optional[Path] = None
    try:
        git(repository, "worktree", "add", "--detach", str(tree), commit)
        added = tree
        yield tree
    finally:
        if added is not None:
            with contextlib.suppress(CompareError, OSError):
                git(repository, "worktree", "remove", "--force", str(added))
        shutil.rmtree(scratch, ignore_errors=True)
        if added is not None and listed(repository, added):  # the removal failed: drop the stale entry
            with contextlib.suppress(CompareError, OSError):
                git(repository, "worktree", "prune")


def listed(repository: Path, tree: Path) -> bool:
    """Whether ``git worktree list`` still names ``tree``."""
    lines = git(repository, "worktree", "list", "--porcelain").splitlines()
    return f"worktree {tree}" in lines or f"worktree {tree.resolve()}" in lines
