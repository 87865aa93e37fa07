"""``python -m bench.compare BASE``: the current checkout (head) against another commit (any git
ref), timed side by side.

The base is checked out in a temporary git worktree and built there (its own CPU extension; CUDA
too where a GPU is present), then a fixed suite (every public function, forward and backward, on
every backend this machine runs, plus the cached and uncached fused head, a mostly tied batch, the
strided ``logits[:, :-1]`` and the group stage alone) is timed in rounds of fresh processes,
alternating which side goes first (base, head | head, base | ...), each process importing its own
tree's tpo_kernels. Per case it prints both sides' median times, head/base as the median of the
per-round ratios and their spread, and flags a case slower by more than 5%. The worktree is removed
afterwards, also on an error or an interrupt.

``child``: the timing process and the suite; ``worktree``: the base's tree; ``report``: the
comparison; ``cli``: the command line. bench/README.md says how to read the output.
"""
