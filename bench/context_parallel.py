"""Context parallelism: what goes on the wire and what stays in memory, per rank.

    python -m bench.context_parallel                       # both parts, results to bench/results/context-parallel/
    python -m bench.context_parallel --part memory         # the analytic part only (no processes)
    python -m bench.context_parallel --out DIR --splits 2,4

(a) Bytes per call on the context group. ``tpo_loss_from_logprobs(context_parallel_group=...)`` at
N completions of T tokens split S ways, counted by ``tpo_kernels.distributed.count_collectives`` in
a gloo spawn of S processes (CPU, no accelerator): the agreement record plus one all-reduce of
``[N, C]`` float64 per-completion partials in the forward, nothing in the backward. Against it,
the alternative of gathering every rank's fp32 per-token log-probs (``all_gather_stacked`` of the
``[N, T/S]`` shard, counted the same way) and computing the loss on whole sequences; its backward
must send the gradients back (the same bytes again), which is not counted here.

(b) The per-rank peak memory of the fused head (``fused_linear_tpo_loss``'s vocabulary pass) at N
completions of T tokens on one rank against T/S tokens on each of S context ranks, from the tile
plan (``tpo_kernels.ops.tiles``: the forward's ``tile_shape``, the backward's ``backward_plan``)
under the GPU tile policy: analytic, nothing is allocated. Every token counted and active, no
logits cache (the vocabulary is above the policy's ``small_vocab``), no soft cap, row ops inside the
GPU kernels (no fp32 copy of a tile). The hidden states and the weight are the caller's; the head
allocates the forward's logits tile and per-row summaries, and in the backward ``dH`` (fp32 when
the backward has more than one vocabulary block, then converted to the hidden dtype), ``dW`` and
the backward's tile. Beside it, the bytes each pass moves beyond its matmuls under the same plan
(``tpo_kernels.bench.cases.fused_linear_traffic``), and those of the chunked backward plan.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
from typing import Dict, List

import torch

MiB, GB = 1 << 20, 1e9
DEFAULT_OUT = pathlib.Path(__file__).resolve().parent / "results" / "context-parallel"


# ----------------------------------------------------------------------------- (a) bytes on the wire


# (name, keyword arguments, per-token inputs besides the log-probs, partial columns C the protocol
# gives: log-prob sum and token count, + old log-prob sum, + KL sum)
CONFIGS = (("plain", dict(), (), 2),
           ("token old + KL, length_normalize", dict(beta=0.04, length_normalize=True),
            ("old_logprobs", "ref_logprobs"), 4))


def _rank_bytes(rank: int, world: int, port: int, completions: int, length: int, out_dir: str) -> None:
    """One context rank: its positions of every completion (a contiguous slice: the bytes do not
    depend on the split), the loss and its backward under ``count_collectives``, then the gather
    alternative; writes the records to ``out_dir``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if "GLOO_SOCKET_IFNAME" not in os.environ and os.path.exists("/sys/class/net/lo"):
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    import torch.distributed as dist  # noqa: PLC0415

    import tpo_kernels  # noqa: PLC0415
    from tpo_kernels.distributed import collectives  # noqa: PLC0415

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    result = {}
    try:
        gen = torch.Generator().manual_seed(0)  # every rank draws the whole batch, keeps its slice
        mine = torch.arange(length).tensor_split(world)[rank]
        scores = torch.randn(completions, generator=gen)
        whole = {name: -torch.rand(completions, length, generator=gen) for name in ("logprobs", "old_logprobs",
                                                                                      "ref_logprobs")}
        for name, options, per_token, columns in CONFIGS:
            logprobs = whole["logprobs"][:, mine].clone().requires_grad_(True)
            extra = {key: whole[key][:, mine] for key in per_token}
            with collectives.count_collectives() as forward:
                loss = tpo_kernels.tpo_loss_from_logprobs(logprobs, scores, group_size=8, backend="torch",
                                                          context_parallel_group=dist.group.WORLD,
                                                          **options, **extra)
            with collectives.count_collectives() as backward:
                loss.backward()
            partials = forward.payload_bytes("context_partials")
            assert partials == 8 * completions * columns, (name, partials)  # [N, C] float64, as the protocol says
            result[name] = dict(columns=partials // (8 * completions), forward=[_as_dict(r) for r in forward],
                                backward=[_as_dict(r) for r in backward],
                                received=forward.received_bytes() + backward.received_bytes())
        with collectives.count_collectives() as gathered:
            collectives.all_gather_stacked(whole["logprobs"][:, mine].contiguous(), dist.group.WORLD, "logprobs")
        result["gather fp32 log-probs"] = dict(forward=[_as_dict(r) for r in gathered], backward=[],
                                               received=gathered.received_bytes())
    finally:
        dist.destroy_process_group()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def _as_dict(record) -> dict:
    return dict(op=record.op, purpose=record.purpose, world_size=record.world_size,
                payload_bytes=record.payload_bytes, output_bytes=record.output_bytes)


def counted_bytes(splits: List[int], completions: int, length: int) -> Dict[int, dict]:
    """``{S: rank 0's records}`` from a gloo spawn of S processes per split."""
    out = {}
    ctx = multiprocessing.get_context("spawn")
    for world in splits:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with tempfile.TemporaryDirectory(prefix="tpo-cp-bytes-") as tmp:
            procs = [ctx.Process(target=_rank_bytes, args=(r, world, port, completions, length, tmp))
                     for r in range(world)]
            for p in procs:
                p.start()
            for p in procs:
                p.join(600)
            if any(p.exitcode != 0 for p in procs):
                raise SystemExit(f"the {world}-rank spawn failed: exit codes {[p.exitcode for p in procs]}")
            out[world] = torch.load(os.path.join(tmp, "rank0.pt"))
        print(f"  counted on {world} gloo ranks", flush=True)
    return out


# ----------------------------------------------------------------------------- (b) the fused head's memory


def head_memory(completions: int, length: int, hidden: int, vocab: int, dtype: torch.dtype) -> dict:
    """Bytes the fused head holds at its forward's and its backward's peak on one rank of
    ``completions * length`` tokens, from the tile plan of the GPU policy (module docstring)."""
    from tpo_kernels.ops.tiles import TilePolicy, backward_plan, tile_shape  # noqa: PLC0415

    policy = TilePolicy.for_device(torch.device("cuda"))
    size = torch.empty(0, dtype=dtype).element_size()
    accum = torch.float32  # fused_linear_tpo_loss's default grad_accum_dtype
    rows = completions * length
    chunk = policy.chunk_size(rows, vocab)
    fwd_tokens, fwd_block = tile_shape(rows, vocab, hidden, chunk, policy, dtype, dtype)
    plan = backward_plan(rows, vocab, hidden, chunk, policy, dtype, dtype, accum)
    tile_rows = rows if plan.one_gemm else max(plan.token_chunks)
    multi_block = plan.vocab_block != vocab
    summary_row = 3 * 4 + 1  # row max, log-sum, label log-prob (fp32) and has_label (bool)
    inputs = {"hidden [M, H]": rows * hidden * size, "weight [V, H]": vocab * hidden * size}
    forward = {"logits tile": min(fwd_tokens, rows) * fwd_block * size, "row summaries": rows * summary_row}
    backward = {"row summaries (saved)": rows * summary_row,
                "backward tile": tile_rows * plan.vocab_block * size,
                "dH accumulator": rows * hidden * (4 if multi_block else size),
                "dH in the hidden dtype": rows * hidden * size if multi_block else 0,
                "dW [V, H]": vocab * hidden * size}
    if plan.block_accumulator:
        backward["dW block accumulator"] = plan.vocab_block * hidden * 4
    own = max(sum(forward.values()), sum(backward.values()))
    # The bytes the passes move beyond their matmuls under the same plan (the package's account).
    from tpo_kernels.bench.cases import fused_linear_traffic  # noqa: PLC0415

    dtype_name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    traffic = fused_linear_traffic(dict(M=rows, V=vocab, H=hidden), dtype_name, "cuda")
    chunked = fused_linear_traffic(dict(M=rows, V=vocab, H=hidden), dtype_name, "cuda", one_gemm=False)
    return dict(tokens=rows, chunk_size=chunk, forward_tile=[fwd_tokens, fwd_block],
                backward_plan=dict(one_gemm=plan.one_gemm, token_block=plan.token_block, vocab_block=plan.vocab_block,
                                   vocab_blocks=len(plan.vocab_blocks)),
                inputs=inputs, forward=forward, backward=backward, head_peak=own,
                peak_with_inputs=own + sum(inputs.values()),
                traffic=dict(forward=traffic["forward"]["total"], backward=traffic["backward"]["total"],
                             backward_dH=traffic["backward"]["dH: accumulate over blocks"],
                             backward_chunked_plan=chunked["backward"]["total"]),
                eager_logits=rows * vocab * (size + 4))  # what an unfused head would hold: logits + fp32 log-softmax


# ----------------------------------------------------------------------------- report


def _bytes_table(table: Dict[int, dict], completions: int, length: int) -> List[str]:
    lines = [f"### (a) Bytes per call on the context group, N={completions}, T={length} (counted by "
             "count_collectives in a gloo spawn)", "",
             "| S | config | forward collectives (payload B per rank) | backward | received B per rank "
             "| gather fp32 log-probs, received B per rank | ratio |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for world, result in table.items():
        gather = result["gather fp32 log-probs"]["received"]
        for name, rec in result.items():
            if name == "gather fp32 log-probs":
                continue
            fwd = ", ".join(f"{r['purpose']} {r['payload_bytes']}" for r in rec["forward"])
            bwd = ", ".join(f"{r['purpose']} {r['payload_bytes']}" for r in rec["backward"]) or "none"
            lines.append(f"| {world} | {name} (C={rec['columns']}) | {fwd} | {bwd} | {rec['received']:,} | "
                         f"{gather:,} | {gather / max(rec['received'], 1):,.0f}x |")
    return lines + [""]


def _memory_table(one: dict, split: dict, world: int, args) -> List[str]:
    def gb(x):
        return f"{x / GB:.2f}"

    lines = [f"### (b) Fused head, per-rank peak, N={args.memory_completions}, H={args.hidden}, V={args.vocab}, bf16 "
             f"(analytic, GPU tile policy)", "",
             f"| | T={args.memory_length} on 1 rank | T={args.memory_length // world} on each of {world} |",
             "| --- | --- | --- |"]
    rows = [("tokens per rank", one["tokens"], split["tokens"], str),
            ("forward tile (tokens x vocab)", one["forward_tile"], split["forward_tile"], lambda t: f"{t[0]} x {t[1]}"),
            ("backward tile (tokens x vocab), blocks", one, split,
             lambda d: f"{d['tokens'] if d['backward_plan']['one_gemm'] else d['backward_plan']['token_block']} x "
                       f"{d['backward_plan']['vocab_block']}, {d['backward_plan']['vocab_blocks']}")]
    for label, a, b, fmt in rows:
        lines.append(f"| {label} | {fmt(a)} | {fmt(b)} |")
    for key in one["inputs"]:
        lines.append(f"| input: {key}, GB | {gb(one['inputs'][key])} | {gb(split['inputs'][key])} |")
    for key in one["backward"]:
        lines.append(f"| backward: {key}, GB | {gb(one['backward'][key])} | {gb(split['backward'].get(key, 0))} |")
    lines += [f"| head's own peak (backward), GB | {gb(one['head_peak'])} | {gb(split['head_peak'])} |",
              f"| with its inputs, GB | {gb(one['peak_with_inputs'])} | {gb(split['peak_with_inputs'])} |",
              f"| ratio one rank / one of {world} | | {one['peak_with_inputs'] / split['peak_with_inputs']:.2f}x "
              f"(head's own {one['head_peak'] / split['head_peak']:.2f}x) |",
              f"| backward traffic beyond the matmuls, GB (of it dH over blocks) | "
              f"{gb(one['traffic']['backward'])} ({gb(one['traffic']['backward_dH'])}) | "
              f"{gb(split['traffic']['backward'])} ({gb(split['traffic']['backward_dH'])}) |",
              f"| forward traffic beyond the matmuls, GB | {gb(one['traffic']['forward'])} | "
              f"{gb(split['traffic']['forward'])} |",
              f"| backward traffic of the chunked plan (one_gemm=False), GB | "
              f"{gb(one['traffic']['backward_chunked_plan'])} | {gb(split['traffic']['backward_chunked_plan'])} |",
              f"| for comparison: unfused logits + fp32 log-softmax, GB | {gb(one['eager_logits'])} | "
              f"{gb(split['eager_logits'])} |", ""]
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("all", "bytes", "memory"), default="all")
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    parser.add_argument("--completions", type=int, default=64, help="N for the bytes")
    parser.add_argument("--length", type=int, default=32768, help="T for the bytes")
    parser.add_argument("--splits", default="2,4,8", help="context ranks S for the bytes")
    parser.add_argument("--memory-completions", type=int, default=8)
    parser.add_argument("--memory-length", type=int, default=65536)
    parser.add_argument("--memory-ranks", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151936)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    splits = [int(s) for s in args.splits.split(",")]
    results, lines = {}, ["# Context parallelism: bytes on the wire and the fused head's memory", ""]

    if args.part in ("all", "bytes"):
        print(f"(a) bytes, S = {splits}: counting in gloo spawns", flush=True)
        table = counted_bytes(splits, args.completions, args.length)
        results["bytes"] = dict(completions=args.completions, length=args.length,
                                per_split={str(k): v for k, v in table.items()})
        lines += _bytes_table(table, args.completions, args.length)

    if args.part in ("all", "memory"):
        one = head_memory(args.memory_completions, args.memory_length, args.hidden, args.vocab, torch.bfloat16)
        split = head_memory(args.memory_completions, args.memory_length // args.memory_ranks, args.hidden, args.vocab,
                            torch.bfloat16)
        results["memory"] = dict(completions=args.memory_completions, hidden=args.hidden, vocab=args.vocab,
                                 dtype="bfloat16", one_rank=dict(length=args.memory_length, **one),
                                 split=dict(ranks=args.memory_ranks, length=args.memory_length // args.memory_ranks,
                                            **split))
        lines += _memory_table(one, split, args.memory_ranks, args)

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=pathlib.Path(__file__).resolve().parent).stdout.strip() or "unknown"
    command = "python -m bench.context_parallel " + " ".join(sys.argv[1:] if argv is None else argv)
    results["meta"] = dict(torch=torch.__version__, python=sys.version.split()[0], command=command.strip(),
                           commit=commit)
    lines[1:1] = ["", f"`{command.strip()}` at {commit}, torch {torch.__version__}, CPU (gloo); no GPU figures."]
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (args.out / "results.md").write_text("\n".join(lines))
    print("\n".join(lines))
    print(f"written to {args.out}/results.json and results.md")


if __name__ == "__main__":
    main()
