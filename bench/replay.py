"""Sampling-mask replay on the fused head: forward + backward (dH, dW) of the per-token log-probs,
three heads side by side in interleaved rounds (medians):

* ``full``: the fused head over the whole vocabulary (``fused_linear_logprobs``);
* ``kept``: the kept-set head (``ops.kept.linear_kept_row_summary``), kept sets drawn from the
  distribution prime-rl measured on H200 (median 2, mean ~8, p99 ~82, 45-48% singletons): size 1
  with probability 0.46, else ``min(512, 2 + floor(exp(1.7 + 1.3 Z)))``;
* ``public``: the same kept sets through the public call, ``fused_linear_logprobs(...,
  sampling_mask=SamplingMask(token_ids, offsets))`` with its checks (``validate=True``: offsets, ids,
  labels in their sets, read back once) and the ``[V, H]`` weight gradient it allocates;
* ``token``: the token-level candidate head (``ops.candidates.linear_candidate_logits`` and a
  log-softmax over the K candidates) at K = the kept sets' mean size, rounded.

Usage: ``python bench/replay.py [--rows 4096 --hidden 512 --vocab 32768 --threads 2 --rounds 5]``.
Prints each head's median time and the two ratios the replay targets are stated in, for the op and
through the public call.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from tpo_kernels import SamplingMask, fused_linear_logprobs
from tpo_kernels.backends import resolve_backend_key
from tpo_kernels.backends.kept_sets import KeptSets
from tpo_kernels.ops.candidates import linear_candidate_logits
from tpo_kernels.ops.kept import linear_kept_row_summary
from tpo_kernels.backends.rows import RowRequest


def draw_set_sizes(rows: int, gen: torch.Generator) -> torch.Tensor:
    """Set sizes: 1 with probability 0.46, else min(512, 2 + floor(exp(1.7 + 1.3 Z)))."""
    z = torch.randn(rows, generator=gen, dtype=torch.float64)
    wide = torch.clamp(2 + torch.floor(torch.exp(1.7 + 1.3 * z)), max=512).to(torch.int64)
    single = torch.rand(rows, generator=gen, dtype=torch.float64) < 0.46
    return torch.where(single, 1, wide)


def kept_sets(sizes: torch.Tensor, labels: torch.Tensor, vocab: int, gen: torch.Generator) -> KeptSets:
    """Each row's label plus ``size - 1`` other distinct ids (a CSR)."""
    ids = []
    for label, size in zip(labels.tolist(), sizes.tolist()):
        others = torch.randint(0, vocab, (2 * size + 8,), generator=gen).unique()
        others = others[others != label][: size - 1]
        ids.append(torch.cat([torch.tensor([label]), others]))
    counts = torch.tensor([len(i) for i in ids])
    offsets = torch.zeros(len(ids) + 1, dtype=torch.int64)
    offsets[1:] = counts.cumsum(0)
    return KeptSets.from_csr(torch.cat(ids), offsets, labels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--backend", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.rows, args.hidden, generator=gen)
    weight = torch.randn(args.vocab, args.hidden, generator=gen) / math.sqrt(args.hidden)
    labels = torch.randint(0, args.vocab, (args.rows,), generator=gen)
    sizes = draw_set_sizes(args.rows, gen)
    kept = kept_sets(sizes, labels, args.vocab, gen)
    k = max(1, round(float(sizes.double().mean())))
    candidates = torch.cat([labels[:, None], torch.randint(0, args.vocab, (args.rows, k - 1), generator=gen)], 1)
    key = resolve_backend_key(args.backend, hidden.device)
    sorted_sizes = sizes.sort().values
    print(f"rows={args.rows} hidden={args.hidden} vocab={args.vocab} threads={args.threads} backend={key}")
    print(f"kept sets: median {int(sorted_sizes[args.rows // 2])}, mean {float(sizes.double().mean()):.2f}, "
          f"p99 {int(sorted_sizes[int(0.99 * args.rows)])}, singletons {float((sizes == 1).double().mean()):.3f}, "
          f"pairs {kept.num_pairs}; token-level K={k}")

    hidden.requires_grad_(True)
    weight.requires_grad_(True)

    def leaves():  # the same leaves every call, their gradients dropped (no copy of W timed)
        hidden.grad = weight.grad = None
        return hidden, weight

    def full():
        h, w = leaves()
        fused_linear_logprobs(h, w, labels, backend=args.backend).sum().backward()

    def replay():
        h, w = leaves()
        linear_kept_row_summary(h, w, None, kept, RowRequest(), key).label_logprob.sum().backward()

    mask = SamplingMask(token_ids=kept.ids, offsets=kept.offsets)

    def public():
        h, w = leaves()
        fused_linear_logprobs(h, w, labels, sampling_mask=mask, backend=args.backend).sum().backward()

    def token():
        h, w = leaves()
        logits = linear_candidate_logits(h, w, None, candidates, inv_temperature=1.0, backend=key)
        torch.log_softmax(logits, -1)[:, 0].sum().backward()

    heads = {"full": full, "kept": replay, "public": public, "token": token}
    times = {name: [] for name in heads}
    for fn in heads.values():  # warm-up
        fn()
    for _ in range(args.rounds):
        for name, fn in heads.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, t in medians.items():
        print(f"{name:6s} median {t * 1e3:9.2f} ms  (rounds: {', '.join(f'{x * 1e3:.1f}' for x in times[name])})")
    print(f"full / kept = {medians['full'] / medians['kept']:.1f}x (target >= 10x)")
    print(f"kept / token = {medians['kept'] / medians['token']:.2f}x (target <= 1.2x)")
    print(f"through the public call: full / public = {medians['full'] / medians['public']:.1f}x, "
          f"public / token = {medians['public'] / medians['token']:.2f}x")


if __name__ == "__main__":
    main()
