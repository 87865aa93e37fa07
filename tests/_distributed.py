"""Helpers of the multi-process tests: spawn local gloo ranks, run a function on each, collect what
each returns; a hang or a crash fails within a bounded time instead of blocking the run.

Ranks are spawned (not forked: forking a process with torch's thread pools can deadlock), join a
gloo group on the loopback interface, run with one intra-op thread (the test machines have few
cores), and send their results back through files.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import socket
import tempfile
import time
import traceback
from typing import Any, Callable, List

import torch

RANK_TIMEOUT_S = 60  # collectives of one rank waiting for the others
DEFAULT_DEADLINE_S = 240  # the whole run, spawn to join


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loopback_env() -> dict:
    """Environment for gloo on the loopback interface."""
    env = {"MASTER_ADDR": "127.0.0.1"}
    if "GLOO_SOCKET_IFNAME" not in os.environ and os.path.exists("/sys/class/net/lo"):
        env["GLOO_SOCKET_IFNAME"] = "lo"
    return env


def _rank_main(rank: int, world: int, port: int, out_dir: str, fn: Callable, args: tuple,
               rank_timeout_s: float = RANK_TIMEOUT_S) -> None:
    os.environ.update(loopback_env())
    os.environ.update(MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    path = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        torch.set_num_threads(1)
        import torch.distributed as dist  # noqa: PLC0415

        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=rank_timeout_s))
        try:
            result = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
        torch.save({"ok": True, "result": result}, path)
    except BaseException:  # noqa: BLE001 - reported by the parent
        torch.save({"ok": False, "error": traceback.format_exc()}, path)
        raise SystemExit(1) from None


def run_ranks(world: int, fn: Callable, *args: Any, deadline_s: float = DEFAULT_DEADLINE_S,
              rank_timeout_s: float = RANK_TIMEOUT_S) -> List[Any]:
    """``[fn(rank, world, *args) for each rank]``, each run in its own spawned process of a
    gloo group of ``world`` ranks. ``fn`` must be importable (a module-level function).
    ``rank_timeout_s``: the process group's timeout, how long a collective waits for a peer."""
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="tpo-dist-") as out_dir:
        port = free_port()
        procs = [ctx.Process(target=_rank_main, args=(r, world, port, out_dir, fn, args, rank_timeout_s), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        end = time.monotonic() + deadline_s
        for p in procs:
            p.join(max(0.0, end - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
        outputs = []
        for r in range(world):
            path = os.path.join(out_dir, f"rank{r}.pt")
            outputs.append(torch.load(path, weights_only=False) if os.path.exists(path) else None)
    errors = [f"rank {r}:\n{o['error']}" for r, o in enumerate(outputs) if o is not None and not o["ok"]]
    if errors:
        raise AssertionError("a rank failed:\n" + "\n".join(errors))
    if hung:
        raise AssertionError(f"ranks {hung} did not finish within {deadline_s} s (hang?)")
    missing = [r for r, o in enumerate(outputs) if o is None]
    if missing:
        codes = [p.exitcode for p in procs]
        raise AssertionError(f"ranks {missing} returned nothing (exit codes {codes})")
    return [o["result"] for o in outputs]
