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

Metric: exact-match error of an episode = the fraction of its ``B*K`` sampled completions with any
wrong token (= 1 - mean reward), the quantity the paper plots. The greedy-decoding error of the same
rollout policy on a fixed set of prompts (all ``2**H`` when that is at most 512) is also recorded
every ``--eval-every`` episodes, and once more after the last update.

Run ``python -m tpo_kernels.bench.reverse_copy --help`` for the flags; the outputs (``results.json``
with every curve, ``results.md`` with the table, ``reverse-copy.png``) go to ``--out``.
"""

from __future__ import annotations

import argparse
import concurrent.futures as futures
import datetime as _dt
import json
import multiprocessing as mp
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

METHODS = ("tpo", "grpo")
# tpo_ref: the same TPO objective in plain PyTorch on materialized logits (no tpo_kernels), to tell
# the kernels apart from the method when a result needs explaining. Not run unless asked for.
EXTRA_METHODS = ("tpo_ref",)
OPTIMIZERS = ("adamw", "muon")
# Documented default learning rates (bench/results/reverse-copy/: the recorded runs and a Muon lr pilot).
DEFAULT_LR = {"adamw": 1e-4, "muon": 1e-3}


# --------------------------------------------------------------------------------------------------
# Task
# --------------------------------------------------------------------------------------------------

DATA_TOKENS = 2  # the binary alphabet: tokens 0 and 1 (the output vocabulary)
SEP = 2  # separator between prompt and completion (input vocabulary: 3 tokens)


def target_of(prompts: Tensor) -> Tensor:
    """The correct completion: the prompt reversed."""
    return prompts.flip(-1)


def exact_match(completions: Tensor, prompts: Tensor) -> Tensor:
    """1.0 where the completion is the reversed prompt exactly, else 0.0 (terminal reward)."""
    return (completions == target_of(prompts)).all(-1).to(torch.float32)


# --------------------------------------------------------------------------------------------------
# Policy: a small pre-norm causal transformer
# --------------------------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, ffn_mult: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, ffn_mult * d_model)
        self.fc2 = nn.Linear(ffn_mult * d_model, d_model)

    def forward(self, x: Tensor, past: Optional[tuple] = None):
        """``x [N, T, d]``; ``past`` = cached ``(k, v)`` of the previous positions (then the new
        positions attend to all of them and causally among themselves). Returns ``(x, (k, v))``."""
        n, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        shape = (n, t, self.n_heads, d // self.n_heads)
        q, k, v = (z.reshape(shape).transpose(1, 2) for z in (q, k, v))
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        if past is None or t == 1:
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=past is None)
        else:  # several new positions after a cache: explicit mask
            s = k.shape[2]
            mask = torch.ones(t, s, dtype=torch.bool, device=x.device).tril(s - t)
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(attn.transpose(1, 2).reshape(n, t, d))
        x = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return x, (k, v)


class Policy(nn.Module):
    """Causal transformer over the input vocabulary (data tokens + separator); ``hidden`` returns
    the final-LayerNorm states, ``head`` maps them to logits over the data tokens."""

    def __init__(self, horizon: int, d_model: int = 64, n_layers: int = 2, n_heads: int = 4,
                 ffn_mult: int = 4) -> None:
        super().__init__()
        self.horizon = horizon
        self.embed = nn.Embedding(DATA_TOKENS + 1, d_model)
        self.pos = nn.Embedding(2 * horizon, d_model)  # prompt, separator, completion[:-1]
        self.blocks = nn.ModuleList(Block(d_model, n_heads, ffn_mult) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, DATA_TOKENS, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def hidden(self, tokens: Tensor, start: int = 0, cache: Optional[list] = None):
        """Final hidden states of ``tokens [N, T]`` at positions ``start..start+T-1``; with a
        ``cache`` (list of per-layer ``(k, v)``) of positions ``0..start-1``. Returns
        ``(hidden [N, T, d], new cache)``."""
        positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.pos(positions)
        new_cache = []
        for i, block in enumerate(self.blocks):
            x, kv = block(x, None if cache is None else cache[i])
            new_cache.append(kv)
        return self.ln_f(x), new_cache

    def completion_hidden(self, prompts: Tensor, completions: Tensor, k: int = 1) -> Tensor:
        """Hidden states ``[B*k, H, d]`` of the positions that predict the ``H`` completion tokens
        (the separator and the completion's first ``H-1`` tokens), for training.

        ``prompts [B, H]``, ``completions [B*k, H]`` (the ``k`` of prompt ``b`` contiguous). The
        shared prefix (prompt and separator) is encoded once per prompt and its keys / values
        repeated ``k`` times (gradients sum over the copies), so training costs
        ``B*(H+1) + B*k*(H-1)`` token positions instead of ``B*k*2H``; the result equals the plain
        forward of the ``B*k`` full sequences."""
        h = self.horizon
        sep = prompts.new_full((prompts.shape[0], 1), SEP)
        prefix, cache = self.hidden(torch.cat([prompts, sep], dim=1))
        first = prefix[:, -1:].repeat_interleave(k, 0)
        if h == 1:
            return first
        cache = [(kk.repeat_interleave(k, 0), vv.repeat_interleave(k, 0)) for kk, vv in cache]
        rest, _ = self.hidden(completions[:, :-1], start=h + 1, cache=cache)
        return torch.cat([first, rest], dim=1)

    def completion_hidden_unshared(self, prompts: Tensor, completions: Tensor) -> Tensor:
        """:meth:`completion_hidden` the plain way, on ``prompts`` repeated to ``[B*k, H]``."""
        h = self.horizon
        sep = prompts.new_full((prompts.shape[0], 1), SEP)
        hidden, _ = self.hidden(torch.cat([prompts, sep, completions[:, :-1]], dim=1))
        return hidden[:, h:]

    @torch.no_grad()
    def sample(self, prompts: Tensor, k: int, generator: torch.Generator, greedy: bool = False) -> Tensor:
        """``k`` completions per prompt, ``[B*k, H]`` (the ``k`` of prompt ``b`` contiguous), all in
        one batched autoregressive pass: the prompt is encoded once per prompt, its key/value
        cache repeated ``k`` times, then one position per step."""
        b, h = prompts.shape
        sep = prompts.new_full((b, 1), SEP)
        hidden, cache = self.hidden(torch.cat([prompts, sep], dim=1))
        cache = [(kk.repeat_interleave(k, 0), vv.repeat_interleave(k, 0)) for kk, vv in cache]
        last = hidden[:, -1].repeat_interleave(k, 0)
        out = prompts.new_empty(b * k, h)
        for t in range(h):
            logits = self.head(last)
            if greedy:
                tok = logits.argmax(-1)
            else:
                tok = torch.multinomial(torch.softmax(logits.float(), -1), 1, generator=generator).squeeze(1)
            out[:, t] = tok
            if t + 1 < h:
                hidden, cache = self.hidden(tok[:, None], start=h + 1 + t, cache=cache)
                last = hidden[:, -1]
        return out


# --------------------------------------------------------------------------------------------------
# Losses
# --------------------------------------------------------------------------------------------------


def tpo_objective(hidden: Tensor, weight: Tensor, completions: Tensor, rewards: Tensor, k: int,
                  old_logprobs: Tensor, eta: float = 1.0):
    """TPO through tpo_kernels' fused-linear path on the completion positions' last hidden states
    ``[N, H, d]`` and the output-layer weight (sequence level, anchored to the snapshot)."""
    import tpo_kernels

    loss = tpo_kernels.fused_linear_tpo_loss(
        hidden, weight, completions, rewards, group_size=k, old_logprobs=old_logprobs, eta=eta, anchor=True,
    )
    return loss, {}


def tpo_reference_objective(hidden: Tensor, weight: Tensor, completions: Tensor, rewards: Tensor, k: int,
                            old_logprobs: Tensor, eta: float = 1.0):
    """The TPO objective of :func:`tpo_objective` in plain PyTorch (README math, no tpo_kernels):
    ``ell`` summed token log-probs, ``p = softmax(ell)`` per group, ``u`` the z-scored rewards
    (population std, 0 for tied groups), ``q = softmax(ell_old + u / eta)`` held fixed,
    ``L = -sum q log p``, mean over groups."""
    logp = torch.log_softmax(hidden @ weight.t(), dim=-1)
    ell = logp.gather(-1, completions.unsqueeze(-1)).squeeze(-1).sum(1).view(-1, k)
    s = rewards.view(-1, k)
    std = s.std(1, unbiased=False, keepdim=True)
    u = torch.where(std > 0, (s - s.mean(1, keepdim=True)) / std.clamp_min(1e-30), torch.zeros_like(s))
    q = torch.softmax(old_logprobs.sum(1).view(-1, k) + u / eta, dim=1)
    loss = -(q * torch.log_softmax(ell, dim=1)).sum(1).mean()
    return loss, {}


def group_zscore(rewards: Tensor, k: int, eps: float = 1e-4) -> Tensor:
    """GRPO advantages: ``(s - mean) / (std + eps)`` within each group of ``k`` (sample std)."""
    s = rewards.view(-1, k)
    return ((s - s.mean(1, keepdim=True)) / (s.std(1, keepdim=True) + eps)).reshape(-1)


def grpo_objective(hidden: Tensor, weight: Tensor, completions: Tensor, rewards: Tensor, k: int,
                   old_logprobs: Tensor, clip_eps: float = 0.2, beta: float = 0.04):
    """GRPO as commonly implemented, written independently of tpo_kernels: clipped ratio surrogate
    on sequence log-probs with group z-scored advantages, plus ``beta`` times the k3 estimate of
    KL(policy || rollout snapshot), averaged over tokens then completions."""
    logp = torch.log_softmax(hidden @ weight.t(), dim=-1)
    token_lp = logp.gather(-1, completions.unsqueeze(-1)).squeeze(-1)  # [N, H]
    adv = group_zscore(rewards, k)
    ratio = torch.exp(token_lp.sum(1) - old_logprobs.sum(1))
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * adv)
    log_ratio_ref = old_logprobs - token_lp
    kl = (torch.exp(log_ratio_ref) - log_ratio_ref - 1.0).mean(1)
    loss = (-surrogate + beta * kl).mean()
    return loss, {"kl": float(kl.detach().mean())}


# --------------------------------------------------------------------------------------------------
# Optimizers
# --------------------------------------------------------------------------------------------------


class _Chain:
    """Several optimizers stepped together (Muon on the 2-D weights, AdamW on the rest)."""

    def __init__(self, *opts) -> None:
        self.opts = [o for o in opts if o is not None]

    def zero_grad(self) -> None:
        for o in self.opts:
            o.zero_grad(set_to_none=True)

    def step(self) -> None:
        for o in self.opts:
            o.step()


def make_optimizer(policy: nn.Module, name: str, lr: float, adamw_lr: Optional[float] = None):
    """``adamw``: AdamW(lr) on everything. ``muon``: torch.optim.Muon(lr) on the 2-D weights and
    AdamW(``adamw_lr``, default ``lr``) on the rest. No weight decay."""
    params = list(policy.parameters())
    if name == "adamw":
        return _Chain(torch.optim.AdamW(params, lr=lr, weight_decay=0.0))
    if name == "muon":
        if not hasattr(torch.optim, "Muon"):
            raise RuntimeError(f"torch {torch.__version__} has no torch.optim.Muon (needs torch >= 2.9)")
        matrices = [p for p in params if p.dim() == 2]
        rest = [p for p in params if p.dim() != 2]
        return _Chain(
            torch.optim.Muon(matrices, lr=lr, weight_decay=0.0),
            torch.optim.AdamW(rest, lr=lr if adamw_lr is None else adamw_lr, weight_decay=0.0) if rest else None,
        )
    raise ValueError(f"unknown optimizer {name!r} (choose from {OPTIMIZERS})")


# --------------------------------------------------------------------------------------------------
# One training run
# --------------------------------------------------------------------------------------------------


@dataclass
class RunSpec:
    method: str
    optimizer: str
    seed: int
    lr: float
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
    log_every: int = 25
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4

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
        rewards = exact_match(completions, prompts_rep)
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
            if spec.method == "tpo":
                loss, extra = tpo_objective(hidden, weight, completions, rewards, k, old_lp, spec.eta)
            elif spec.method == "tpo_ref":
                loss, extra = tpo_reference_objective(hidden, weight, completions, rewards, k, old_lp, spec.eta)
            elif spec.method == "grpo":
                loss, extra = grpo_objective(hidden, weight, completions, rewards, k, old_lp, spec.clip_eps,
                                             spec.beta)
            else:
                raise ValueError(f"unknown method {spec.method!r} (choose from {METHODS + EXTRA_METHODS})")
            opt.zero_grad()
            loss.backward()
            if epoch == 0:
                grad_norm = float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params if p.grad is not None)))
            opt.step()
            losses.append(float(loss.detach()))
        with torch.no_grad():
            update_norm = float(torch.sqrt(sum(((p.double() - q.double()) ** 2).sum() for p, q in zip(params, before))))
        groups = rewards.view(b, k)
        informative = float(((groups.max(1).values - groups.min(1).values) > 0).float().mean())
        reward = float(rewards.mean())
        curves["error"].append(1.0 - reward)
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
            log(f"[{spec.name}] ep {episode:4d}/{spec.episodes} reward {reward:.3f} error {1 - reward:.3f} "
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


def final_error(run: dict, window: int) -> float:
    errs = run["curves"]["error"]
    tail = errs[-min(window, len(errs)):]
    return sum(tail) / len(tail)


def first_episode_below(run: dict, threshold: float) -> Optional[int]:
    for i, e in enumerate(run["curves"]["error"], start=1):
        if e <= threshold:
            return i
    return None


def median(values: Sequence[float]) -> float:
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


def summarize(results: dict) -> List[dict]:
    """One row per (method, optimizer): median final error over seeds, per-seed values, first
    episode at the threshold per seed."""
    cfg = results["config"]
    window, threshold = cfg["final_window"], cfg["threshold"]
    rows = []
    for optimizer in cfg["optimizers"]:
        for method in cfg["methods"]:
            runs = sorted((r for r in results["runs"] if r["method"] == method and r["optimizer"] == optimizer),
                          key=lambda r: r["seed"])
            if not runs:
                continue
            finals = [final_error(r, window) for r in runs]
            greedy = [r["greedy"]["error"][-1] if r["greedy"]["error"] else None for r in runs]
            rows.append({
                "method": method, "optimizer": optimizer, "lr": runs[0]["lr"],
                "seeds": [r["seed"] for r in runs],
                "median_final_error": median(finals), "final_error": finals,
                "first_episode_at_threshold": [first_episode_below(r, threshold) for r in runs],
                "greedy_final_error": greedy,
                "seconds_per_episode": [r["seconds_per_episode"] for r in runs],
                "cpu_seconds_per_episode": [r.get("cpu_seconds_per_episode") for r in runs],
            })
    return rows


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------


def _csv(text: str) -> List[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tpo_kernels.bench.reverse_copy",
        description="Terminal-reward reverse-copy task: TPO (tpo_kernels, fused-linear) vs GRPO, "
                    "AdamW and Muon. Prints progress, writes results.json, results.md and a PNG.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--horizon", "-H", type=int, default=7, help="prompt / completion length H")
    p.add_argument("--episodes", type=int, default=300, help="episodes (rollout batches) per run")
    p.add_argument("--seeds", default="3", help="a count N (seeds 0..N-1) or a comma-separated list ('0,4,7', '5,')")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated: tpo, grpo (and tpo_ref: TPO in plain PyTorch, no kernels, for cross-checks)")
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
    p.add_argument("--log-every", type=int, default=25, help="progress line every N episodes")
    p.add_argument("--final-window", type=int, default=20,
                   help="final error = mean sampled error over the last N episodes")
    p.add_argument("--threshold", type=float, default=0.10, help="error threshold for 'first episode at'")
    p.add_argument("--out", default="bench/out/reverse-copy", help="output folder")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--report", metavar="DIR", help="only rebuild results.md and the PNG from DIR/results.json")
    return p


def _parse_seeds(text: str) -> List[int]:
    """``"3"`` means seeds 0, 1, 2; a comma-separated list (``"0,4,7"``, ``"5,"``) names them."""
    text = text.strip()
    if "," not in text:
        return list(range(int(text)))
    return [int(s) for s in _csv(text)]


def _machine() -> dict:
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpu_count": os.cpu_count(), "loadavg": load, "muon": hasattr(torch.optim, "Muon")}


def _rounded(obj, digits: int = 6):
    """Floats to ``digits`` significant digits (curves are noisy far above that), recursively."""
    if isinstance(obj, float):
        return float(f"{obj:.{digits}g}")
    if isinstance(obj, dict):
        return {k: _rounded(v, digits) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_rounded(v, digits) for v in obj]
    return obj


def dump_json(results: dict, f) -> None:
    """``results.json``: floats to 6 significant digits, one line per run (compact, still diffable)."""
    results = _rounded(results)
    head = {k: v for k, v in results.items() if k != "runs"}
    text = json.dumps(head, indent=1)[:-2]  # drop the closing brace, append the runs
    runs = ",\n  ".join(json.dumps(r, separators=(",", ":")) for r in results.get("runs", []))
    f.write(text + (',\n "runs": [\n  ' + runs + "\n ]\n}\n"))


def write_outputs(results: dict, out: str, plot: bool = True) -> List[str]:
    """results.json, results.md and (with matplotlib) reverse-copy.png in ``out``."""
    from . import reverse_copy_plot as rp  # namespace-package relative import works too

    os.makedirs(out, exist_ok=True)
    results["summary"] = summarize(results)
    paths = [os.path.join(out, "results.json"), os.path.join(out, "results.md")]
    with open(paths[0], "w") as f:
        dump_json(results, f)
    with open(paths[1], "w") as f:
        f.write(rp.markdown(results))
    if plot:
        png = rp.plot(results, os.path.join(out, "reverse-copy.png"))
        if png:
            paths.append(png)
    return paths


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.report:
        with open(os.path.join(args.report, "results.json")) as f:
            results = json.load(f)
        for path in write_outputs(results, args.report, plot=not args.no_plot):
            print(f"wrote {path}")
        return 0
    methods, optimizers = _csv(args.methods), _csv(args.optimizers)
    for m in methods:
        if m not in METHODS + EXTRA_METHODS:
            raise SystemExit(f"unknown method {m!r} (choose from {', '.join(METHODS + EXTRA_METHODS)})")
    for o in optimizers:
        if o not in OPTIMIZERS:
            raise SystemExit(f"unknown optimizer {o!r} (choose from {', '.join(OPTIMIZERS)})")
    seeds = _parse_seeds(args.seeds)
    lrs = {"adamw": args.lr_adamw, "muon": args.lr_muon}
    specs = [RunSpec(method=m, optimizer=o, seed=s, lr=lrs[o], horizon=args.horizon, episodes=args.episodes,
                     batch=args.batch, group=args.group, epochs=args.epochs, eta=args.eta, beta=args.beta,
                     clip_eps=args.clip_eps, muon_adamw_lr=args.muon_adamw_lr, head_dtype=args.head_dtype,
                     threads=args.threads,
                     eval_every=args.eval_every, log_every=args.log_every)
             for o in optimizers for s in seeds for m in methods]
    jobs = args.jobs or min(len(specs), os.cpu_count() or 1)
    config = {k: v for k, v in vars(args).items() if k not in ("report",)}
    config.update(methods=methods, optimizers=optimizers, seeds=seeds, lrs=lrs, jobs=jobs,
                  argv=list(sys.argv[1:] if argv is None else argv))
    machine_before = _machine()
    print(f"reverse-copy: H={args.horizon} B={args.batch} K={args.group} epochs={args.epochs} "
          f"episodes={args.episodes} seeds={seeds} methods={methods} optimizers={optimizers} lrs={lrs} "
          f"runs={len(specs)} jobs={jobs} threads/run={args.threads} load={machine_before['loadavg']}", flush=True)
    start = time.perf_counter()
    if jobs <= 1:
        runs = [train_run(spec, log=lambda line: print(line, flush=True)) for spec in specs]
    else:
        ctx = mp.get_context("spawn")
        with futures.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
            # the worker by its importable name (this module may be running as __main__)
            from tpo_kernels.bench.reverse_copy import _worker as worker

            runs = list(pool.map(worker, [asdict(s) for s in specs]))
    wall = time.perf_counter() - start
    results = {
        "benchmark": "reverse-copy",
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "config": config,
        "machine": {**machine_before, "loadavg_end": _machine()["loadavg"]},
        "wall_seconds": wall,
        "runs": runs,
    }
    paths = write_outputs(results, args.out, plot=not args.no_plot)
    from . import reverse_copy_plot as rp

    print()
    print(rp.markdown(results))
    print(f"wall {wall:.0f} s for {len(specs)} runs ({jobs} in parallel)")
    for path in paths:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
