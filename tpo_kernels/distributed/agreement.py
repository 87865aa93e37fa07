"""Ranks agree or fail together: one small record per call and group, exchanged before any
collective that could wait on a peer.

Each rank of a group sends the outcome of its local checks (and, when one failed, its error
type and message), a few per-rank counts (completions, shard sizes, ...) and every setting
that changes the result. The record is a fixed-size int64 tensor, so one all-gather moves it
whatever happened locally. Every rank then decodes the same gathered records and reaches the
same verdict: when a rank failed or two ranks disagree, every rank raises the same error (the
type of the first failing rank's, naming the argument and the ranks); otherwise every rank
gets every rank's counts.

Ranks are named by their global rank, with the rank in the group beside it where the two differ
(a 2-D mesh: "rank 3 (rank 1 of vocab_parallel_group)"). An error that is itself the verdict of
an earlier agreement (on a 2-D mesh, the vocabulary group's before the data group's) travels
verbatim, so every rank of both groups raises the same words.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence

import torch
from torch import Tensor

from .collectives import all_gather_stacked

MESSAGE_BYTES = 512  # a longer local error message is cut (its type and first 512 bytes travel)

# A failing rank's status: the code of its error's type, plus _AGREED when that error is the
# verdict of an earlier agreement (its message then travels as it is). Any other type travels as
# a RuntimeError whose message starts with the type's name.
_OK = 0
_ERROR_TYPES = {1: ValueError, 2: TypeError, 3: RuntimeError, 4: NotImplementedError, 5: OverflowError,
                6: IndexError, 7: KeyError, 8: MemoryError}
_OTHER = 15  # raised as RuntimeError("<type name>: <message>")
_TYPE_BITS = 0xF
_AGREED = 0x10
_AGREED_ATTRIBUTE = "_tpo_kernels_agreed"  # set on the errors _verdict makes

# A setting travels as (tag, code): the tag says how to print the code, so that every rank
# words a disagreement identically from the gathered records alone.
_NONE, _BOOL, _INT, _FLOAT, _TEXT, _HASH = range(6)


_NAMES: Dict[int, str] = {}


def register_names(*names: str) -> None:
    """Names longer than a record field that settings may take (function names, ...): they
    travel as a checksum, and every rank can print them back."""
    for name in names:
        _NAMES[zlib.crc32(name.encode())] = name


def _encode(value) -> tuple:
    if value is None:
        return _NONE, 0
    if isinstance(value, bool):
        return _BOOL, int(value)
    if isinstance(value, int):
        return _INT, value
    if isinstance(value, float):
        return _FLOAT, struct.unpack("<q", struct.pack("<d", value))[0]
    text = str(value).encode()
    if len(text) <= 8:  # short names (reductions, dtypes, paths) travel as themselves
        return _TEXT, int.from_bytes(text.ljust(8, b"\0"), "little", signed=True)
    return _HASH, zlib.crc32(text)


def _decode(tag: int, code: int) -> str:
    if tag == _NONE:
        return "None"
    if tag == _BOOL:
        return str(bool(code))
    if tag == _INT:
        return str(code)
    if tag == _FLOAT:
        return repr(struct.unpack("<d", struct.pack("<q", code))[0])
    if tag == _TEXT:
        return repr(code.to_bytes(8, "little", signed=True).rstrip(b"\0").decode(errors="replace"))
    return repr(_NAMES[code]) if code in _NAMES else f"<value #{code:08x}>"


@dataclass(frozen=True)
class Agreement:
    """What every rank of the group learned: each rank's counts (in group rank order), and the
    error every rank raises (None when all checks passed and the settings agree)."""

    counts: List[Dict[str, int]]
    error: Optional[Exception]


def _status(failure: Optional[BaseException]) -> int:
    if failure is None:
        return _OK
    code = next((code for code, kind in _ERROR_TYPES.items() if type(failure) is kind), _OTHER)
    return code | (_AGREED if getattr(failure, _AGREED_ATTRIBUTE, False) else 0)


def _failure_text(failure: BaseException) -> str:
    # str(KeyError("x")) is "'x'": its argument is the message.
    text = failure.args[0] if type(failure) is KeyError and len(failure.args) == 1 else str(failure)
    if _status(failure) & _TYPE_BITS == _OTHER:
        text = f"{type(failure).__name__}: {text}"
    return str(text)


def _error(status: int, message: str) -> Exception:
    error = _ERROR_TYPES.get(status & _TYPE_BITS, RuntimeError)(message)
    setattr(error, _AGREED_ATTRIBUTE, True)
    return error


def _message_codes(failure: Optional[BaseException]) -> List[int]:
    text = b"" if failure is None else _failure_text(failure).encode()[:MESSAGE_BYTES]
    padded = text.ljust(MESSAGE_BYTES, b"\0")
    return [len(text)] + [int.from_bytes(padded[i:i + 8], "little", signed=True) for i in range(0, MESSAGE_BYTES, 8)]


def _message(codes: Sequence[int]) -> str:
    raw = b"".join(c.to_bytes(8, "little", signed=True) for c in codes[1:])
    return raw[: codes[0]].decode(errors="replace")


def _ranks(indices: Sequence[int], global_ranks: Sequence[int], group_name: str) -> str:
    """``indices`` (ranks in the group) by their global ranks, the group's beside them where
    they differ."""
    word = "rank " if len(indices) == 1 else "ranks "
    named = word + ", ".join(str(global_ranks[i]) for i in indices)
    if all(global_ranks[i] == i for i in indices):
        return named
    return f"{named} ({word}{', '.join(map(str, indices))} of {group_name})"


def group_ranks(group) -> List[int]:
    """The global ranks of ``group``'s members, in group rank order."""
    return list(torch.distributed.get_process_group_ranks(group))


def agree(group, group_name: str, device: torch.device, *, failure: Optional[BaseException],
          counts: Mapping[str, int], settings: Mapping[str, object],
          fingerprints: Optional[Mapping[str, Tensor]] = None) -> Agreement:
    """Exchange this rank's record over ``group`` (one all-gather) and decide together.

    ``counts``: per-rank integers every rank learns (they may differ between ranks).
    ``settings``: values that must be equal on every rank (names in the same order everywhere:
    the same code builds them). ``fingerprints``: 0-d int64 device tensors that must be equal on
    every rank (checksums of inputs that are replicated over the group, e.g. labels next to a
    vocabulary shard); they join the record on the device, without a read-back of their own.
    """
    fingerprints = dict(fingerprints or {})
    host = [_status(failure), *map(int, counts.values())]
    for value in settings.values():
        host.extend(_encode(value))
    host.extend(_message_codes(failure))
    record = torch.tensor(host, dtype=torch.int64, device=device)
    if fingerprints:
        record = torch.cat([record, torch.stack([f.reshape(()).to(device=device, dtype=torch.int64)
                                                 for f in fingerprints.values()])])
    rows = all_gather_stacked(record, group, "agreement").tolist()
    return _verdict(rows, group_name, list(counts), list(settings), list(fingerprints), group_ranks(group))


def _verdict(rows: List[List[int]], group_name: str, count_names: List[str], setting_names: List[str],
             fingerprint_names: List[str], global_ranks: Sequence[int]) -> Agreement:
    num_counts, num_settings = len(count_names), 2 * len(setting_names)
    message_at = 1 + num_counts + num_settings
    failed = [rank for rank, row in enumerate(rows) if row[0] != _OK]
    counts = [dict(zip(count_names, row[1:1 + num_counts])) for row in rows]
    ranks = lambda indices: _ranks(indices, global_ranks, group_name)  # noqa: E731
    if failed:
        first = rows[failed[0]]
        message = _message(first[message_at:message_at + 1 + MESSAGE_BYTES // 8])
        if not first[0] & _AGREED:  # a local failure: say whose
            message = (f"{group_name}: {ranks(failed)} failed {'its' if len(failed) == 1 else 'their'} "
                       f"input checks; {ranks(failed[:1])}: {message}")
        return Agreement(counts, _error(first[0], message))
    for index, name in enumerate(setting_names):
        at = 1 + num_counts + 2 * index
        values = [(row[at], row[at + 1]) for row in rows]
        if len(set(values)) > 1:
            per_rank = ", ".join(f"{ranks([rank])}: {_decode(*value)}" for rank, value in enumerate(values))
            return Agreement(counts, _error(1, f"{group_name}: ranks disagree on {name} ({per_rank}); "
                                               f"every rank must pass the same value"))
    tail = message_at + 1 + MESSAGE_BYTES // 8
    for index, name in enumerate(fingerprint_names):
        values = [row[tail + index] for row in rows]
        if len(set(values)) > 1:
            differ = [rank for rank, value in enumerate(values) if value != values[0]]
            return Agreement(counts, _error(1, f"{group_name}: {name} differs on {ranks(differ)} from "
                                               f"{ranks([0])}; every rank of the group must pass the same {name}"))
    return Agreement(counts, None)


def agreed(error: BaseException) -> Exception:
    """``error`` marked as the same on every rank of a group (an error every rank decided from
    the same gathered records): a later agreement forwards its words unchanged."""
    setattr(error, _AGREED_ATTRIBUTE, True)
    return error


