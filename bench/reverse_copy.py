"""End-to-end learning benchmark: the terminal-reward reverse-copy task, TPO vs GRPO.

The task is the sparse-reward transformer experiment of the TPO paper (arXiv 2604.06159, Sec. 3.6):
a prompt is a uniformly random binary string ``x`` of length ``H``; the policy reads ``x`` and a
separator and must emit ``reversed(x)``. The reward is 1 only when the whole completion matches
exactly, else 0 (sparse, terminal). At initialization a completion is right with probability
``2**-H``, so at ``H = 7`` about 6% of the groups of ``K = 8`` contain any success at all.

Policy: a small causal transformer in plain PyTorch (d_model 64, 2 layers, 4 heads, pre-norm,
learned positions, final LayerNorm, a bias-free output layer over the 2 data tokens; the input
vocabulary is the 2 data tokens plus the separator). Each episode samples ``B`` prompts and ``K``
completions per prompt (all ``B*K`` in one batched autoregressive pass with a key/value cache),
scores them, and takes ``epochs`` full-batch gradient steps on that one batch (the shared prompt is
encoded once per group in training too, see :meth:`Policy.completion_hidden`). The rollout policy is
frozen as a snapshot: its per-token log-probs are computed once, with
:func:`tpo_kernels.fused_linear_logprobs` on the last hidden states of the first epoch's forward
(the parameters have not moved yet), so the first epoch is exactly on-policy and old log-probs matter
from the second epoch on.

Methods (same model, same prompts and samples given the same seed):

* ``tpo``: :func:`tpo_kernels.fused_linear_tpo_loss` on the last hidden states of the completion
  positions and the output-layer weight (sequence level, eta 1, anchored to ``p_old`` from the
  snapshot's log-probs), mean over the ``B`` groups.
* ``grpo``: written here in plain PyTorch, independently of the package: group z-scored advantages
  ``A = (s - mean) / (std + 1e-4)`` (sample std, as TRL computes it), the clipped ratio surrogate on
  sequence log-probs ``min(r A, clip(r, 1-0.2, 1+0.2) A)`` with ``r = exp(ell - ell_old)``, and a k3
  KL penalty to the rollout snapshot, ``beta * mean_t(exp(lp_old - lp) - (lp_old - lp) - 1)`` with
  ``beta = 0.04``; mean over the ``B*K`` completions.

Optimizers: ``adamw`` (torch.optim.AdamW on every parameter) and ``muon`` (torch.optim.Muon on
every 2-D weight -- the attention / MLP matrices, the embeddings and the output layer -- with
AdamW on the rest: LayerNorm gains and biases, linear biases). Weight decay 0 everywhere.

Dense reward (``--reward dense``): each position is scored by its correctness (1 where it holds its
target token); ``tpo`` and ``grpo`` score a completion by its fraction of correct positions, and

* ``tpo_token``: token-level TPO (paper Sec. 3.4) with
  :func:`tpo_kernels.fused_linear_token_tpo_loss`: at each of the ``B*K*H`` prefix states the sampled
  completions visit, ``K`` candidate next tokens are drawn from the rollout snapshot (with
  replacement), scored by the per-position reward (1 for the target token, else 0) and trained
  toward ``q ∝ p_old exp(u / eta)`` over the candidates, anchored to the snapshot; mean over states.

Metric: exact-match error of an episode = the fraction of its ``B*K`` sampled completions with any
wrong token (= 1 - mean reward), the quantity the paper plots. The greedy-decoding error of the same
rollout policy on a fixed set of prompts (all ``2**H`` when that is at most 512) is also recorded
every ``--eval-every`` episodes, and once more after the last update.

Run ``python -m bench.reverse_copy --help`` from the repository root for the flags; the outputs
(``results.json`` with every curve, ``results.md`` with the table, ``reverse-copy.png``) go to ``--out``.
"""

from __future__ import annotations

import argparse
import concurrent.futures as futures
import datetime as _dt
import multiprocessing as mp
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional

import torch
from torch import Tensor

from .experiment import (
    LOG_EVERY,
    MODEL_HEADS,
    MODEL_LAYERS,
    MODEL_WIDTH,
    add_output_options,
    csv,
    final_error,
    machine,
    print_finished,
    rebuild_report,
    runs_of,
    summary_row,
    write_report,
)
from .reverse_copy_model import (  # noqa: F401 - re-exported for the tests
    DATA_TOKENS,
    OPTIMIZERS,
    Policy,
    exact_match,
    grpo_objective,
    make_optimizer,
    position_correct,
    sample_candidates,
    target_of,
    token_tpo_objective,
    tpo_objective,
    tpo_reference_objective,
)

METHODS = ("tpo", "grpo")
# tpo_token: token-level TPO, needs the per-position rewards of --reward dense.
TOKEN_METHODS = ("tpo_token",)
REWARDS = ("terminal", "dense")
# tpo_ref: the same TPO objective in plain PyTorch on materialized logits (no tpo_kernels), to tell
# the kernels apart from the method when a result needs explaining. Not run unless asked for.
EXTRA_METHODS = ("tpo_ref",)
ALL_METHODS = METHODS + TOKEN_METHODS + EXTRA_METHODS
# Documented default learning rates (bench/results/reverse-copy/: the recorded runs and a Muon lr pilot).
DEFAULT_LR = {"adamw": 1e-4, "muon": 1e-3}


# --------------------------------------------------------------------------------------------------
# One training run
# --------------------------------------------------------------------------------------------------


@dataclass
class RunSpec:
    method: str
    optimizer: str
    seed: int
    lr: float
    reward: str = "terminal"
    horizon: int = 7
    episodes: int = 300
    batch: int = 100
    group: int = 8
    epochs: int = 4
    eta: float = 1.0
    beta: float = 0.04
    clip_eps: float = 0.2
    muon_adamw_lr: Optional[float] = None
    head_dtype: str = "float32"
    threads: int = 1
    eval_every: int = 50
    log_every: int = LOG_EVERY
    d_model: int = MODEL_WIDTH
    n_layers: int = MODEL_LAYERS
    n_heads: int = MODEL_HEADS

    @property
    def name(self) -> str:
        return f"{self.method}/{self.optimizer}/seed{self.seed}"


def eval_prompts(horizon: int, generator: torch.Generator, limit: int = 512) -> Tensor:
    """All ``2**H`` prompts when there are at most ``limit``, else ``limit`` random ones."""
    if 2 ** horizon <= limit:
        codes = torch.arange(2 ** horizon)
        return ((codes[:, None] >> torch.arange(horizon - 1, -1, -1)) & 1).long()
    return torch.randint(0, DATA_TOKENS, (limit, horizon), generator=generator)


def train_run(spec: RunSpec, log=print) -> dict:
    """Train one (method, optimizer, seed) and return its curves."""
    import tpo_kernels

    torch.set_num_threads(spec.threads)
    torch.manual_seed(spec.seed)
    policy = Policy(spec.horizon, spec.d_model, spec.n_layers, spec.n_heads)
    opt = make_optimizer(policy, spec.optimizer, spec.lr, spec.muon_adamw_lr)
    params = list(policy.parameters())
    data_gen = torch.Generator().manual_seed(10_000 + spec.seed)  # prompts and samples
    eval_set = eval_prompts(spec.horizon, torch.Generator().manual_seed(99))
    k, b = spec.group, spec.batch

    curves: Dict[str, list] = {key: [] for key in (
        "error", "reward", "informative_groups", "entropy", "loss_first", "loss_last", "kl_last", "grad_norm", "update_norm",
        "seconds")}
    greedy = {"episode": [], "error": []}

    def greedy_error() -> float:
        policy.eval()
        comp = policy.sample(eval_set, 1, data_gen, greedy=True)
        policy.train()
        return 1.0 - float(exact_match(comp, eval_set).mean())

    start, cpu_start = time.perf_counter(), time.process_time()
    for episode in range(1, spec.episodes + 1):
        t0 = time.perf_counter()
        prompts = torch.randint(0, DATA_TOKENS, (b, spec.horizon), generator=data_gen)
        completions = policy.sample(prompts, k, data_gen)
        if spec.eval_every and (episode % spec.eval_every == 0 or episode == spec.episodes):
            greedy["episode"].append(episode)  # the rollout policy of this episode, before its update
            greedy["error"].append(greedy_error())
        prompts_rep = prompts.repeat_interleave(k, 0)
        correct = position_correct(completions, prompts_rep)  # [B*K, H]
        exact = correct.min(-1).values  # exact_match
        rewards = exact if spec.reward == "terminal" else correct.mean(-1)
        head_dtype = getattr(torch, spec.head_dtype)
        before = [p.detach().clone() for p in params]
        losses, extra = [], {}
        for epoch in range(spec.epochs):
            # the output layer (and with it the loss) runs in --head-dtype; gradients flow back in fp32
            hidden = policy.completion_hidden(prompts, completions, k).to(head_dtype)
            weight = policy.head.weight.to(head_dtype)
            if epoch == 0:  # the rollout snapshot's per-token log-probs, from the first forward
                with torch.no_grad():
                    old_lp, entropy = tpo_kernels.fused_linear_logprobs(
                        hidden.detach(), weight.detach(), completions, return_entropy=True)
                    if spec.method == "tpo_token":  # K candidates at each of the B*K*H visited states
                        states = hidden.detach().reshape(-1, hidden.shape[-1])
                        candidates, cand_old_lp = sample_candidates(states, weight.detach(), k, data_gen)
                        cand_scores = (candidates == target_of(prompts_rep).reshape(-1, 1)).to(torch.float32)
            if spec.method == "tpo_token":
                loss, extra = token_tpo_objective(hidden.reshape(-1, hidden.shape[-1]), weight, candidates,
                                                  cand_scores, cand_old_lp, spec.eta)
            elif spec.method == "tpo":
                loss, extra = tpo_objective(hidden, weight, completions, rewards, k, old_lp, spec.eta)
            elif spec.method == "tpo_ref":
                loss, extra = tpo_reference_objective(hidden, weight, completions, rewards, k, old_lp, spec.eta)
            elif spec.method == "grpo":
                loss, extra = grpo_objective(hidden, weight, completions, rewards, k, old_lp, spec.clip_eps,
                                             spec.beta)
            else:
                raise ValueError(f"unknown method {spec.method!r} (choose from {ALL_METHODS})")
            opt.zero_grad()
            loss.backward()
            if epoch == 0:
                grad_norm = float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params if p.grad is not None)))
            opt.step()
            losses.append(float(loss.detach()))
        with torch.no_grad():
            update_norm = float(torch.sqrt(sum(((p.double() - q.double()) ** 2).sum() for p, q in zip(params, before))))
        # groups (states, for tpo_token) whose scores do not all tie
        groups = cand_scores if spec.method == "tpo_token" else rewards.view(b, k)
        informative = float(((groups.max(1).values - groups.min(1).values) > 0).float().mean())
        reward = float(rewards.mean())
        error = 1.0 - float(exact.mean())
        curves["error"].append(error)
        curves["reward"].append(reward)
        curves["informative_groups"].append(informative)
        curves["entropy"].append(float(entropy.mean()))  # rollout policy, nats per token
        curves["loss_first"].append(losses[0])
        curves["loss_last"].append(losses[-1])
        curves["kl_last"].append(extra.get("kl"))
        curves["grad_norm"].append(grad_norm)  # of the first epoch's loss (on the rollout snapshot)
        curves["update_norm"].append(update_norm)  # parameter change over the episode's epochs
        curves["seconds"].append(time.perf_counter() - t0)
        if spec.log_every and (episode % spec.log_every == 0 or episode == spec.episodes):
            elapsed = time.perf_counter() - start
            kl = f" kl {extra['kl']:.3g}" if "kl" in extra else ""
            log(f"[{spec.name}] ep {episode:4d}/{spec.episodes} reward {reward:.3f} error {error:.3f} "
                f"informative {informative:.2f} entropy {curves['entropy'][-1]:.3f} |g| {grad_norm:.2g} "
                f"|dw| {update_norm:.2g} loss {losses[0]:.4g}->{losses[-1]:.4g}{kl} "
                f"{elapsed / episode:.3f} s/ep wall, {(time.process_time() - cpu_start) / episode:.3f} s/ep CPU "
                f"({elapsed:.0f} s)")
    total, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    if spec.eval_every:
        greedy["after_training"] = greedy_error()  # the policy after the last update
    # wall time depends on the machine's load; process CPU time (all threads) much less so
    return {**asdict(spec), "name": spec.name, "curves": curves, "greedy": greedy,
            "seconds_total": total, "seconds_per_episode": total / spec.episodes,
            "cpu_seconds_per_episode": cpu / spec.episodes}


def _worker(spec_dict: dict) -> dict:
    spec = RunSpec(**spec_dict)
    return train_run(spec, log=lambda line: print(line, flush=True))


# --------------------------------------------------------------------------------------------------
# Summary
# --------------------------------------------------------------------------------------------------


def summarize(results: dict) -> List[dict]:
    """One row per (method, optimizer): median final error over seeds, per-seed values, first
    episode at the threshold per seed."""
    cfg = results["config"]
    window, threshold = cfg["final_window"], cfg["threshold"]
    rows = []
    for optimizer in cfg["optimizers"]:
        for method in cfg["methods"]:
            runs = runs_of(results, method=method, optimizer=optimizer)
            if not runs:
                continue
            rows.append({
                "method": method, "optimizer": optimizer, "lr": runs[0]["lr"],
                **summary_row(runs, [final_error(r, window) for r in runs], threshold, "episode"),
                "greedy_final_error": [r["greedy"]["error"][-1] if r["greedy"]["error"] else None for r in runs],
                "seconds_per_episode": [r["seconds_per_episode"] for r in runs],
                "cpu_seconds_per_episode": [r.get("cpu_seconds_per_episode") for r in runs],
            })
    return rows


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.reverse_copy",
        description="Terminal-reward reverse-copy task: TPO (tpo_kernels, fused-linear) vs GRPO, "
                    "AdamW and Muon. Prints progress, writes results.json, results.md and a PNG.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--horizon", "-H", type=int, default=7, help="prompt / completion length H")
    p.add_argument("--episodes", type=int, default=300, help="episodes (rollout batches) per run")
    p.add_argument("--seeds", default="3", help="a count N (seeds 0..N-1) or a comma-separated list ('0,4,7', '5,')")
    p.add_argument("--methods", default=",".join(METHODS),
                   help="comma-separated: tpo, grpo, tpo_token (token-level TPO, with --reward dense) and tpo_ref "
                        "(TPO in plain PyTorch, no kernels, for cross-checks)")
    p.add_argument("--reward", default="terminal", choices=REWARDS,
                   help="terminal: 1 only for the exact reversal; dense: each position scored by its correctness "
                        "(sequence methods get the fraction of correct positions)")
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="comma-separated: adamw, muon")
    p.add_argument("--lr-adamw", type=float, default=DEFAULT_LR["adamw"], help="AdamW learning rate")
    p.add_argument("--lr-muon", type=float, default=DEFAULT_LR["muon"], help="Muon learning rate (2-D weights)")
    p.add_argument("--muon-adamw-lr", type=float, default=None,
                   help="AdamW lr for the non-2-D parameters under --optimizers muon (default: the Muon lr)")
    p.add_argument("--batch", "-B", type=int, default=100, help="prompts per episode")
    p.add_argument("--group", "-K", type=int, default=8, help="completions per prompt")
    p.add_argument("--epochs", type=int, default=4, help="gradient steps per rollout batch")
    p.add_argument("--eta", type=float, default=1.0, help="TPO target temperature")
    p.add_argument("--beta", type=float, default=0.04, help="GRPO k3 KL weight (to the rollout snapshot)")
    p.add_argument("--clip-eps", type=float, default=0.2, help="GRPO ratio clip")
    p.add_argument("--head-dtype", default="float32", choices=("float32", "float64"),
                   help="dtype of the output layer and the loss (float64: a numerical-precision check)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run (torch.set_num_threads)")
    p.add_argument("--jobs", type=int, default=None,
                   help="runs in parallel processes (default: the CPU count; 1 = in this process)")
    p.add_argument("--eval-every", type=int, default=50, help="greedy-decoding eval every N episodes (0: off)")
    add_output_options(p, out="bench/out/reverse-copy", unit="episode")
    return p


def _parse_seeds(text: str) -> List[int]:
    """``"3"`` means seeds 0, 1, 2; a comma-separated list (``"0,4,7"``, ``"5,"``) names them."""
    text = text.strip()
    if "," not in text:
        return list(range(int(text)))
    return [int(s) for s in csv(text)]


def write_outputs(results: dict, out: str, plot: bool = True) -> List[str]:
    """results.json, results.md and (with matplotlib) reverse-copy.png in ``out``."""
    from . import reverse_copy_plot as rp

    results["summary"] = summarize(results)
    return write_report(results, out, rp, "reverse-copy.png", plot)


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.report:
        return rebuild_report(args.report, write_outputs, plot=not args.no_plot)
    methods, optimizers = csv(args.methods), csv(args.optimizers)
    for m in methods:
        if m not in ALL_METHODS:
            raise SystemExit(f"unknown method {m!r} (choose from {', '.join(ALL_METHODS)})")
        if m in TOKEN_METHODS and args.reward != "dense":
            raise SystemExit(f"method {m!r} needs per-position rewards: add --reward dense")
    for o in optimizers:
        if o not in OPTIMIZERS:
            raise SystemExit(f"unknown optimizer {o!r} (choose from {', '.join(OPTIMIZERS)})")
    seeds = _parse_seeds(args.seeds)
    lrs = {"adamw": args.lr_adamw, "muon": args.lr_muon}
    specs = [RunSpec(method=m, optimizer=o, seed=s, lr=lrs[o], reward=args.reward, horizon=args.horizon, episodes=args.episodes,
                     batch=args.batch, group=args.group, epochs=args.epochs, eta=args.eta, beta=args.beta,
                     clip_eps=args.clip_eps, muon_adamw_lr=args.muon_adamw_lr, head_dtype=args.head_dtype,
                     threads=args.threads,
                     eval_every=args.eval_every, log_every=args.log_every)
             for o in optimizers for s in seeds for m in methods]
    jobs = args.jobs or min(len(specs), os.cpu_count() or 1)
    config = {k: v for k, v in vars(args).items() if k not in ("report",)}
    config.update(methods=methods, optimizers=optimizers, seeds=seeds, lrs=lrs, jobs=jobs,
                  argv=list(sys.argv[1:] if argv is None else argv))
    machine_before = machine()
    print(f"reverse-copy: reward={args.reward} H={args.horizon} B={args.batch} K={args.group} epochs={args.epochs} "
          f"episodes={args.episodes} seeds={seeds} methods={methods} optimizers={optimizers} lrs={lrs} "
          f"runs={len(specs)} jobs={jobs} threads/run={args.threads} load={machine_before['loadavg']}", flush=True)
    start = time.perf_counter()
    if jobs <= 1:
        runs = [train_run(spec, log=lambda line: print(line, flush=True)) for spec in specs]
    else:
        ctx = mp.get_context("spawn")
        with futures.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
            # the worker by its importable name (this module may be running as __main__)
            from bench.reverse_copy import _worker as worker

            runs = list(pool.map(worker, [asdict(s) for s in specs]))
    wall = time.perf_counter() - start
    results = {
        "benchmark": "reverse-copy",
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "config": config,
        "machine": {**machine_before, "loadavg_end": machine()["loadavg"]},
        "wall_seconds": wall,
        "runs": runs,
    }
    paths = write_outputs(results, args.out, plot=not args.no_plot)
    from . import reverse_copy_plot as rp

    print_finished(rp.markdown(results), paths, f"wall {wall:.0f} s for {len(specs)} runs ({jobs} in parallel)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
