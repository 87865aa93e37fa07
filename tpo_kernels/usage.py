"""Usage errors of the command lines (``tpo-kernels`` and ``tpo-kernels bench``) and the checks of
their output paths, shared by :mod:`tpo_kernels.cli` and :mod:`tpo_kernels.bench`.

A leaf module: it imports the standard library only, nothing of tpo_kernels, so that both command
lines use it without importing each other (``cli`` hands ``bench`` its arguments; ``bench`` never
imports ``cli``), and parsing answers without importing torch.

A usage error (a bad option or value, a device or backend that is not there, an output path that
cannot be written) is found before any work and ends the command with one line on stderr,
``<prog>: error: ...``, and exit status 2: :class:`UsageError`, also raised by the parsers
(:class:`OneLineParser`).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional


class UsageError(SystemExit):
    """A usage error of a command: exit status 2, and ``str()`` the one line that says what is wrong.
    The command's ``main`` prints it (once: ``reported`` is set then) and re-raises."""

    def __init__(self, message: str, prog: str = "tpo-kernels"):
        super().__init__(2)
        self.message, self.prog, self.reported = message, prog, False

    def __str__(self) -> str:
        return self.message

    def report(self) -> None:
        if not self.reported:
            print(f"{self.prog}: error: {self.message}", file=sys.stderr, flush=True)
            self.reported = True


class OneLineParser(argparse.ArgumentParser):
    """argparse, with its errors as one line (no usage block) and exit status 2 (a UsageError)."""

    def error(self, message):
        raise UsageError(f"{message} (see {self.prog} --help)", self.prog)


def writable_file_problem(path: str) -> Optional[str]:
    """Why the file ``path`` cannot be written (None when it can): its folder must exist and take
    new files, and the path must not be a folder. Nothing is created."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"folder {folder} does not exist"
    if os.path.isdir(path):
        return f"{path} is a folder"
    if not os.access(path if os.path.exists(path) else folder, os.W_OK):
        return f"{path} is not writable"
    return None


def output_folder_problem(path: str, parents: bool = False) -> Optional[str]:
    """Make the output folder ``path`` if needed and say why it cannot take the outputs (None when it
    can). Its parent must exist unless ``parents`` (a default location, made with its parents): a
    mistyped parent is an error rather than a new tree of folders."""
    path = os.path.abspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        return f"{path} exists and is not a folder"
    if not os.path.isdir(path):
        parent = os.path.dirname(path)
        if not parents and not os.path.isdir(parent):
            return f"folder {parent} does not exist"
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:
            return f"cannot create {path}: {exc.strerror or exc}"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"folder {path} is not writable"
    return None
