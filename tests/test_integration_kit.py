"""The integration kit (``tpo_kernels.kit``) and the integrations built on it.

The trainers are adapters over the public API: no file of ``tpo_kernels/integrations/`` imports
anything but the package's top-level names and the kit, and no file of the package outside
``tpo_kernels/distributed/`` issues a collective, torch.distributed's or accelerate's (the
byte-counting logs then see every one). The
kit's score standardization is the losses' own, at any score range, and both trainers give
exactly it; its constant group members, row gather and token mean do what the trainers need, the
last two over 2 and 3 gloo ranks through the counted collectives.
"""

from __future__ import annotations

import ast
import math
import pathlib

import pytest
import torch

import tpo_kernels
from tpo_kernels import kit, reference, tpo_loss_from_logprobs

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "tpo_kernels"
INTEGRATIONS = PACKAGE / "integrations"


# ----------------------------------------------------------------------------- what the adapters may use


def _package_imports(path: pathlib.Path):
    """``(line, module, names)`` of each import of the package by ``path`` (relative ones resolved)."""
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = parts[: len(parts) - node.level] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            if module.split(".")[0] == "tpo_kernels":
                yield node.lineno, module, [alias.name for alias in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "tpo_kernels":
                    yield node.lineno, alias.name, []


def _private_imports(path: pathlib.Path):
    public = {"tpo_kernels": set(tpo_kernels.__all__), "tpo_kernels.kit": set(kit.__all__)}
    found = []
    for line, module, names in _package_imports(path):
        if module.startswith("tpo_kernels.integrations"):
            continue  # the adapter's own files
        if module not in public or any(name not in public[module] for name in names):
            found.append(f"line {line}: {module} {names}")
    return found


@pytest.mark.parametrize("path", sorted(INTEGRATIONS.rglob("*.py")), ids=lambda p: str(p.relative_to(INTEGRATIONS)))
def test_integrations_import_only_the_package_api_and_the_kit(path):
    private = _private_imports(path)
    assert not private, f"{path.name} imports what is not the public API or the kit: {private}"


def test_the_import_walk_finds_a_private_import(tmp_path):
    """The walk above sees what it must refuse (a check module, a group_math internal)."""
    fake = INTEGRATIONS / "verl" / "_kit_probe.py"
    fake.write_text("from ...checks.arguments import check_flag\nfrom ... import kit\nfrom ...group_math import x\n")
    try:
        assert [line.split(":")[0] for line in _private_imports(fake)] == ["line 1", "line 3"]
    finally:
        fake.unlink()


# Collectives of torch.distributed; those named like tensor methods (gather, scatter, reduce) count
# when called on torch.distributed itself.
COLLECTIVES = {"all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "all_gather_single",
               "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "broadcast",
               "broadcast_object_list", "gather_object", "scatter_object_list", "barrier", "monitored_barrier",
               "send", "recv", "isend", "irecv", "batch_isend_irecv"}
DIST_ONLY = {"reduce", "gather", "scatter"}
# accelerate's collectives (an Accelerator's methods), called or passed on.
ACCELERATOR = {"gather", "gather_for_metrics", "reduce", "pad_across_processes", "wait_for_everyone"}


def _collective_calls(source: str):
    tree = ast.parse(source)
    aliases = {"torch.distributed"}
    direct = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {alias.asname or alias.name for alias in node.names if alias.name == "torch.distributed"}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            aliases |= {alias.asname or alias.name for alias in node.names if alias.name == "distributed"}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            direct |= {alias.asname or alias.name for alias in node.names
                       if alias.name in COLLECTIVES | DIST_ONLY}
    calls = [f"line {node.lineno}: {ast.unparse(node)}" for node in ast.walk(tree)
             if isinstance(node, ast.Attribute) and node.attr in ACCELERATOR
             and ast.unparse(node.value).split(".")[-1] == "accelerator"]
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and (func.attr in COLLECTIVES or (
                func.attr in DIST_ONLY and ast.unparse(func.value) in aliases)):
            calls.append(f"line {node.lineno}: {ast.unparse(func)}")
        elif isinstance(func, ast.Name) and func.id in direct:
            calls.append(f"line {node.lineno}: {func.id}")
    return calls


OUTSIDE_DISTRIBUTED = [path for path in sorted(PACKAGE.rglob("*.py")) if "distributed" not in path.relative_to(PACKAGE).parts]


@pytest.mark.parametrize("path", OUTSIDE_DISTRIBUTED, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_collective_outside_distributed(path):
    calls = _collective_calls(path.read_text())
    assert not calls, f"{path.relative_to(PACKAGE)} issues collectives outside tpo_kernels/distributed/: {calls}"


def test_the_collective_walk_finds_every_spelling():
    source = ("import torch.distributed as dist\nfrom torch import distributed as d2\n"
              "from torch.distributed import all_gather_object as ago\nimport torch\n"
              "dist.all_reduce(x)\nd2.gather(x)\nago(a, b)\ntorch.distributed.broadcast(x, 0)\nx.gather(1, i)\n"
              "log(self.accelerator.gather, x)\nself.accelerator.reduce(x, reduction='sum')\n")
    found = sorted(int(call.split(":")[0].split()[1]) for call in _collective_calls(source))
    assert found == [5, 6, 7, 8, 10, 11]


# ----------------------------------------------------------------------------- one standardization rule

F32_MAX = float(torch.finfo(torch.float32).max)
# (scores of one group, score_eps): ranges where a direct (s - mean) / std loses the result.
EXTREME = {
    "1e30": ([1e30, 2e30, 3e30, 5e30], 1e-6),
    "1e30_one_ulp_apart": ([1e30, math.nextafter(1e30, math.inf), math.nextafter(math.nextafter(1e30, math.inf),
                                                                                  math.inf), 1e30], 0.0),
    "ties": ([7.0, 7.0, 7.0, 7.0], 1e-6),
    "f32max": ([F32_MAX, -F32_MAX, F32_MAX, 0.0], 1e-6),
    "1e300": ([1e300, -1e300, 5e299, 0.0], 1e-6),
    "subnormal_spread": ([0.0, 1e-310, 2e-310, 3e-310], 0.0),
    "near_tie": ([0.0, 1e-7, 2e-7, 3e-7], 1e-6),
}


def _core_u(scores: torch.Tensor, score_eps: float) -> torch.Tensor:
    """The standardized scores the loss itself uses (its aux ``u``)."""
    logprobs = -torch.rand(len(scores), 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    _, aux = tpo_loss_from_logprobs(logprobs, scores, group_size=len(scores), score_eps=score_eps, return_aux=True)
    return aux["u"]


@pytest.mark.parametrize("name", EXTREME)
def test_kit_standardization_is_the_losses(name):
    values, score_eps = EXTREME[name]
    scores = torch.tensor(values, dtype=torch.float64)
    u = kit.standardize_scores(scores, torch.zeros(len(values), dtype=torch.int64), score_eps=score_eps)
    assert torch.equal(u, _core_u(scores, score_eps))
    if name == "ties":
        assert not u.any()
    if score_eps == 0.0 and name != "ties":  # standardized: population std 1
        assert float(u.square().mean()) == pytest.approx(1.0, rel=1e-12)


@pytest.mark.parametrize("name", EXTREME)
def test_trl_per_reward_standardization_is_the_losses(name):
    """``multi_objective_aggregation="normalize_then_sum"`` standardizes each reward by the losses'
    rule: at 1e300 (squares overflow), 1-ulp spreads at 1e30 and subnormal spreads a direct
    formula gives 0, 0.9 off or the unscaled spread; the kit's rule gives the loss's u exactly."""
    from tpo_kernels.integrations.trl.generation_batch import tpo_scores_from_rewards

    values, score_eps = EXTREME[name]
    rewards = torch.tensor(values, dtype=torch.float64).view(-1, 1)
    scores = tpo_scores_from_rewards(rewards, torch.ones(1), len(values), "normalize_then_sum", score_eps)
    assert torch.equal(scores, _core_u(rewards.view(-1), score_eps))


@pytest.mark.parametrize("name", EXTREME)
def test_verl_estimator_standardization_is_the_losses(name):
    """The ``tpo`` estimator's u (to its 2**-24 encoding) is the loss's u of the raw rewards."""
    from tpo_kernels.integrations.verl import compute_tpo_outcome_advantage
    from tpo_kernels.integrations.verl.advantage import SCORE_BITS, decode_advantages

    values, score_eps = EXTREME[name]
    rewards = torch.zeros(len(values), 3, dtype=torch.float64)
    rewards[:, -1] = torch.tensor(values, dtype=torch.float64)
    mask = torch.ones(len(values), 3)
    advantages, _ = compute_tpo_outcome_advantage(rewards, mask, ["prompt"] * len(values), score_eps=score_eps)
    u, _ = decode_advantages(advantages, mask.bool())
    expected = torch.round(_core_u(rewards[:, -1], score_eps) * 2.0**SCORE_BITS) * 2.0**-SCORE_BITS
    assert torch.equal(u, expected)


def test_standardize_scores_groups_by_id_in_any_order_and_leaves_out_invalid_rows():
    scores = torch.tensor([3.0, 10.0, 1.0, float("nan"), 2.0, 10.0], dtype=torch.float64)
    group_ids = torch.tensor([4, 9, 4, 4, 4, 9])
    valid = ~torch.isnan(scores)
    u = kit.standardize_scores(scores, group_ids, valid=valid)
    expected = reference.standardize(torch.tensor([3.0, 1.0, 2.0], dtype=torch.float64), 1e-6)
    assert torch.equal(u[[0, 2, 4]], expected)
    assert u[[1, 3, 5]].tolist() == [0.0, 0.0, 0.0]  # a tied group; an invalid row


@pytest.mark.parametrize("call, match", [
    (lambda: kit.standardize_scores(torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.int64)), "scores"),
    (lambda: kit.standardize_scores(torch.ones(3), torch.zeros(2, dtype=torch.int64)), "group_ids"),
    (lambda: kit.standardize_scores(torch.ones(2), torch.zeros(2)), "group_ids"),
    (lambda: kit.standardize_scores(torch.ones(2), torch.zeros(2, dtype=torch.int64), valid=torch.ones(2)), "valid"),
    (lambda: kit.standardize_scores(torch.tensor([1.0, float("inf")]), torch.zeros(2, dtype=torch.int64)), "scores"),
    (lambda: kit.standardize_scores(torch.ones(2), torch.zeros(2, dtype=torch.int64), score_eps=-1.0), "score_eps"),
])
def test_standardize_scores_refuses_bad_input_naming_it(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ----------------------------------------------------------------------------- constant members


def _rows(logprobs, scores, group_ids, **fields):
    return kit.LossRows(logprobs=logprobs, scores=torch.tensor(scores, dtype=torch.float64),
                        group_ids=torch.tensor(group_ids), **fields)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_constant_members_give_the_whole_groups_loss_and_this_rows_gradient(packed):
    """Two groups split between a call's own rows and constant members (narrower rows, padded
    or packed): the loss is the unsplit batch's, the gradient the unsplit gradient of the own
    rows; the members get none."""
    gen = torch.Generator().manual_seed(2)
    full = -torch.rand(6, 5, dtype=torch.float64, generator=gen)
    mask = torch.rand(6, 5, generator=gen) > 0.3
    mask[:, 0] = True
    mask[3:, 3:] = False  # the members' tokens fit in 3 columns
    old = full.detach() - 0.1
    scores, ids = [1.0, 0.0, 2.0, 3.0, 1.0, 0.5], [0, 1, 0, 1, 0, 1]
    settings = dict(eta=0.7, beta=0.0, score_eps=0.0)
    whole = full.clone().requires_grad_()
    expected = reference.tpo_loss_from_logprobs(whole, torch.tensor(scores, dtype=torch.float64), mask=mask,
                                                group_ids=torch.tensor(ids), old_logprobs=old, **settings)
    expected.backward()
    own = full[:3].clone().requires_grad_()
    if packed:
        lengths = mask.sum(1)
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        rows = _rows(own[mask[:3]], scores[:3], ids[:3], cu_seqlens=cu[:4], old_logprobs=old[:3][mask[:3]])
        members = _rows(full[3:][mask[3:]], scores[3:], ids[3:], cu_seqlens=cu[3:], old_logprobs=old[3:][mask[3:]])
    else:
        rows = _rows(own, scores[:3], ids[:3], mask=mask[:3], old_logprobs=old[:3])
        members = _rows(full[3:, :3], scores[3:], ids[3:], mask=mask[3:, :3], old_logprobs=old[3:, :3])
    joined = kit.add_constant_members(rows, members)
    loss = tpo_loss_from_logprobs(**joined.loss_inputs(), **settings)
    loss.backward()
    torch.testing.assert_close(loss, expected.to(loss.dtype))
    torch.testing.assert_close(own.grad, whole.grad[:3])


def test_constant_members_must_carry_the_rows_fields():
    rows = _rows(torch.zeros(1, 2), [1.0], [0], ref_logprobs=torch.zeros(1, 2))
    with pytest.raises(ValueError, match="ref_logprobs"):
        kit.add_constant_members(rows, _rows(torch.zeros(1, 2), [0.0], [0]))
    with pytest.raises(ValueError, match="packed"):
        kit.add_constant_members(_rows(torch.zeros(2), [1.0], [0], cu_seqlens=torch.tensor([0, 2])),
                                 _rows(torch.zeros(1, 2), [0.0], [0]))
    with pytest.raises(ValueError, match="mask"):
        kit.add_constant_members(_rows(torch.zeros(1, 2), [1.0], [0]), _rows(torch.zeros(1, 3), [0.0], [0]))
    with pytest.raises(ValueError, match="group_ids"):
        kit.add_constant_members(kit.LossRows(logprobs=torch.zeros(1, 2), scores=torch.ones(1), group_ids=None),
                                 _rows(torch.zeros(1, 2), [0.0], [0]))


def test_token_mean_of_one_process_counts_constant_rows_in_value_only():
    values = torch.tensor([[1.0, 2.0], [3.0, 5.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[True, False], [True, True]])
    joined = torch.cat([values[:1], values[1:].detach()])
    mean = kit.token_mean(joined, mask)
    mean.backward()
    assert mean.item() == pytest.approx(3.0)
    assert values.grad.tolist() == [[1 / 3, 0.0], [0.0, 0.0]]
    assert kit.token_mean(torch.zeros(1, 2), torch.zeros(1, 2, dtype=torch.bool)).item() == 0.0


# ----------------------------------------------------------------------------- over ranks


@pytest.mark.parametrize("world", [2, 3])
def test_row_gather_and_token_mean_over_ranks(world):
    """Ranks with different row counts: every rank gets every rank's rows in rank order; the
    token mean is the mean over all ranks' counted tokens on every rank, with P times this rank's
    own gradient (constant rows none); verl's mini-batch record is the same gather. Each is a
    counted collective of the expected bytes: row counts (int64), rows padded to the largest
    count, three float64 sums."""
    from _distributed import run_ranks
    from _kit_ranks import ROWS, TOKENS, WIDTH, _mine, entropies, kit_on_share, table

    results = run_ranks(world, kit_on_share, deadline_s=120)
    values, mask = entropies(world)
    counted = mask[: sum(ROWS[:world])].to(values.dtype)
    expected_mean = (values * counted).sum() / counted.sum()
    widest = max(ROWS[:world])
    for rank, result in enumerate(results):
        mine = _mine(rank)
        assert torch.equal(result["rows"], table(world)) and result["sizes"] == ROWS[:world]
        assert result["mine"] == mine and result["record_offset"] == mine.start and result["dp_size"] == world
        torch.testing.assert_close(result["mean"], expected_mean, rtol=1e-14, atol=0)
        expected_grad = world * counted[mine] / counted.sum()
        expected_grad[-1] = 0.0  # the constant row
        torch.testing.assert_close(result["grad"], expected_grad, rtol=1e-14, atol=0)
        assert result["record_ids"].tolist() == [r for r in range(world) for _ in range(ROWS[r])]
        torch.testing.assert_close(result["record_ell"], -(values * counted).sum(1))
        counts = ("all_gather", "rows_counts", 8, world * 8)
        assert result["logs"]["gather"] == [counts, ("all_gather", "rows", widest * WIDTH * 8,
                                                     world * widest * WIDTH * 8)]
        assert result["logs"]["mean"] == [("all_reduce", "token_mean", 2 * 8, 2 * 8)]
        assert [entry[1] for entry in result["logs"]["record"]] == ["mini_batch_record_counts", "mini_batch_record"]
        assert result["logs"]["record"][1][2] == widest * 7 * 8
    assert TOKENS == values.shape[1]
