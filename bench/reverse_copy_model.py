"""The reverse-copy benchmark's task, policy, objectives (TPO through tpo_kernels, a plain
PyTorch TPO reference, GRPO written independently) and optimizers."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

OPTIMIZERS = ("adamw", "muon")


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


def position_correct(completions: Tensor, prompts: Tensor) -> Tensor:
    """``[N, H]``: 1.0 where a position holds its target token (the dense, per-position reward)."""
    return (completions == target_of(prompts)).to(torch.float32)


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


def sample_candidates(hidden: Tensor, weight: Tensor, k: int, generator: torch.Generator):
    """``k`` candidate next tokens per state, drawn from the policy at ``hidden [R, d]`` (with
    replacement), and their log-probs ``[R, k]`` under it: the rollout snapshot of token-level TPO."""
    logp = torch.log_softmax((hidden @ weight.t()).float(), dim=-1)
    candidates = torch.multinomial(logp.exp(), k, replacement=True, generator=generator)
    return candidates, logp.gather(1, candidates)


def token_tpo_objective(hidden: Tensor, weight: Tensor, candidates: Tensor, scores: Tensor,
                        old_logprobs: Tensor, eta: float = 1.0):
    """Token-level TPO (paper Sec. 3.4) through :func:`tpo_kernels.fused_linear_token_tpo_loss`:
    at each state ``hidden [R, d]`` the ``K`` candidates ``[R, K]`` with their per-position scores,
    anchored to the snapshot's candidate log-probs; mean over the ``R`` states."""
    import tpo_kernels

    loss = tpo_kernels.fused_linear_token_tpo_loss(hidden, weight, candidates, scores,
                                                   old_logprobs=old_logprobs, eta=eta, anchor=True)
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
