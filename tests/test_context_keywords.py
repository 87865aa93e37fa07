"""``context_parallel_group`` in one process: the keyword on every sequence-level loss and its
modules, checked like ``process_group``; a group of one rank is no group, bit for bit; a rank's
part of completions split over positions is checked locally for what it can decide alone; and
the checks that keep a mesh's groups apart. The runs over several ranks are in
tests/test_context_parallel.py."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import tpo_kernels
from tpo_kernels.distributed import plans
from tpo_kernels.checks.batches import BatchSplit, LabelSpace, prepare_batch
from tpo_kernels.checks.placement import check_context_batch, check_distinct_groups
from tpo_kernels.plan import CheckedCall, RankGroups, check_call
from tpo_kernels.plan.call import plan_sequence
from tpo_kernels.requests import Batch, Logits, Options, Placement, SequenceRequest

from _backends import backend_params

N, T, V, H, K = 4, 5, 11, 8, 2
FUNCTIONS = ["tpo_loss", "fused_linear_tpo_loss", "tpo_loss_from_logprobs"]


@pytest.fixture(scope="module")
def one_rank():
    """A 1-rank gloo group (the world), torn down after this module."""
    from _distributed import free_port, loopback_env

    os.environ.update(loopback_env())
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _inputs(dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, T, H, generator=g, dtype=dtype)
    weight = torch.randn(V, H, generator=g, dtype=dtype)
    labels = torch.randint(0, V, (N, T), generator=g)
    labels[1, 3:] = -100
    scores = torch.randn(N, generator=g, dtype=dtype)
    reference_logits = torch.randn(N, T, V, generator=g, dtype=dtype)
    ref = torch.log_softmax(reference_logits, -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    old = ref + 0.05 * torch.rand(N, T, generator=g, dtype=dtype).neg()
    return dict(hidden=hidden, weight=weight, labels=labels, scores=scores, ref=ref, old=old)


def _call(function: str, x: dict, backend: str, **keywords):
    """``function`` on leaves of ``x``'s tensors with KL, per-token old log-probs and length
    normalization (and the entropy bonus where taken): ``(loss, aux, grads)``."""
    hidden, weight = x["hidden"].clone().requires_grad_(), x["weight"].clone().requires_grad_()
    common = dict(scores=x["scores"], group_size=K, old_logprobs=x["old"], ref_logprobs=x["ref"], beta=0.1,
                  length_normalize=True, backend=backend, return_aux=True, **keywords)
    if function == "tpo_loss":
        leaves = [(hidden @ weight.T).detach().requires_grad_()]
        loss, aux = tpo_kernels.tpo_loss(leaves[0], x["labels"], entropy_coef=0.01, **common)
    elif function == "fused_linear_tpo_loss":
        leaves = [hidden, weight]
        loss, aux = tpo_kernels.fused_linear_tpo_loss(hidden, weight, x["labels"], entropy_coef=0.01, **common)
    else:
        leaves = [torch.log_softmax(hidden @ weight.T, -1).gather(-1, x["labels"].clamp(min=0)[..., None])[..., 0]
                  .detach().requires_grad_()]
        loss, aux = tpo_kernels.tpo_loss_from_logprobs(leaves[0], mask=x["labels"] >= 0, **common)
    grads = torch.autograd.grad(loss, leaves)
    return loss, aux, grads


# ----------------------------------------------------------------------------- the keyword


@pytest.mark.parametrize("function", FUNCTIONS)
@pytest.mark.parametrize("value", [object(), 2, "cp"])
def test_a_value_that_is_no_process_group_is_a_type_error_naming_the_keyword(function, value):
    with pytest.raises(TypeError, match="^context_parallel_group must be a torch.distributed ProcessGroup or None"):
        _call(function, _inputs(), "torch", context_parallel_group=value)


@pytest.mark.parametrize("function", FUNCTIONS)
def test_a_value_that_is_no_process_group_is_refused_beside_an_initialized_group(function, one_rank):
    with pytest.raises(TypeError, match="^context_parallel_group must be a torch.distributed ProcessGroup or None, "
                                        "got object$"):
        _call(function, _inputs(), "torch", context_parallel_group=object(), process_group=one_rank)


@pytest.mark.parametrize("backend", backend_params("torch", "cpu"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("function", FUNCTIONS)
def test_a_group_of_one_rank_is_bitwise_no_group(function, dtype, backend, one_rank):
    x = _inputs(dtype)
    want_loss, want_aux, want_grads = _call(function, x, backend)
    loss, aux, grads = _call(function, x, backend, context_parallel_group=one_rank)
    assert torch.equal(loss, want_loss)
    assert aux.keys() == want_aux.keys()
    for name, value in want_aux.items():
        assert torch.equal(aux[name], value), name
    for grad, want in zip(grads, want_grads):
        assert torch.equal(grad, want)


@pytest.mark.parametrize("module", ["TPOLoss", "FusedLinearTPOLoss"])
def test_the_modules_take_the_keyword(module, one_rank):
    x = _inputs()
    loss_fn = getattr(tpo_kernels, module)(context_parallel_group=one_rank, backend="torch")
    assert loss_fn.context_parallel_group is one_rank
    if module == "TPOLoss":
        logits = x["hidden"] @ x["weight"].T
        got, want = loss_fn(logits, x["labels"], x["scores"], group_size=K), \
            tpo_kernels.tpo_loss(logits, x["labels"], x["scores"], group_size=K, backend="torch")
    else:
        got = loss_fn(x["hidden"], x["weight"], x["labels"], x["scores"], group_size=K)
        want = tpo_kernels.fused_linear_tpo_loss(x["hidden"], x["weight"], x["labels"], x["scores"], group_size=K,
                                                 backend="torch")
    assert torch.equal(got, want)


def test_the_check_pass_reports_no_context_group_for_one_rank(one_rank):
    x = _inputs()
    request = SequenceRequest(function="tpo_loss", source=Logits(logits=x["hidden"] @ x["weight"].T),
                              batch=Batch(labels=x["labels"], scores=x["scores"], group_size=K), options=Options(),
                              placement=Placement(context_parallel_group=one_rank))
    checked = check_call(request)
    assert checked.failure is None and checked.context_group is None and checked.plan.batch.kept is None


# ----------------------------------------------------------------------------- a rank's positions


def _prepare(split: BatchSplit, labels, scores, validate=True, length_normalize=False, **batch):
    space = LabelSpace(token_shape=tuple(labels.shape), vocab_size=V, device=torch.device("cpu"), dtype=torch.float64)
    return prepare_batch(Batch(labels=labels, scores=scores, **{"group_size": K, **batch}), labels, space,
                         validate=validate, split=split, length_normalize=length_normalize)


def test_a_rank_holding_no_counted_token_passes_with_positions_split():
    labels, scores = torch.full((N, 3), -100), torch.randn(N)
    prepared = _prepare(BatchSplit(positions=True), labels, scores)
    assert not prepared.any_kept and prepared.kept is None
    assert prepared.layout.num_groups == N // K  # the completions' own groups: none is split off
    with pytest.raises(ValueError, match="no completion has a counted token"):
        _prepare(BatchSplit(), labels, scores)


def test_with_positions_split_a_completion_without_counted_tokens_here_is_not_left_out_here():
    labels = torch.randint(0, V, (N, 3))
    labels[2] = -100
    prepared = _prepare(BatchSplit(positions=True), labels, torch.randn(N))
    assert prepared.any_kept and prepared.kept is None
    assert prepared.layout.group_members.numel() == N  # every completion stays a member
    whole = _prepare(BatchSplit(), labels, torch.randn(N))
    assert whole.layout.group_members.numel() == N - 1


@pytest.mark.parametrize("length_normalize", [False, True])
def test_per_token_old_logprobs_give_this_ranks_unweighted_sums(length_normalize):
    labels = torch.randint(0, V, (N, 3))
    labels[0, 1:] = -100
    old = -torch.rand(N, 3, dtype=torch.float64)
    prepared = _prepare(BatchSplit(positions=True), labels, torch.randn(N), old_logprobs=old,
                        length_normalize=length_normalize)
    assert prepared.old_seq_logprobs is None
    assert torch.equal(prepared.old_token_sums, torch.where(labels >= 0, old, 0.0).sum(1))


def test_per_completion_old_logprobs_are_used_as_given_with_positions_split():
    labels, old = torch.randint(0, V, (N, 3)), -torch.rand(N, dtype=torch.float64) * 10
    prepared = _prepare(BatchSplit(positions=True), labels, torch.randn(N), old_logprobs=old)
    assert prepared.old_token_sums is None and torch.equal(prepared.old_seq_logprobs, old)


def test_with_positions_split_the_grouping_is_checked_on_the_local_completions():
    labels = torch.randint(0, V, (3, 2))
    with pytest.raises(ValueError, match="group_size must divide the number of completions N=3"):
        _prepare(BatchSplit(positions=True), labels, torch.randn(3))
    assert _prepare(BatchSplit(positions=True, completions=True), labels, torch.randn(3)).split_group_size == K


def test_without_value_checks_nothing_is_read_with_positions_split():
    labels = torch.full((N, 3), -100)
    prepared = _prepare(BatchSplit(positions=True), labels, torch.randn(N), validate=False)
    assert prepared.any_kept and prepared.kept is None


# ----------------------------------------------------------------------------- placement checks


@pytest.mark.parametrize("pair, words", [
    (("vocab_parallel_group", "process_group"), "the vocabulary is sharded over the ranks of process_group"),
    (("context_parallel_group", "process_group"), "context_parallel_group and process_group hold the same ranks"),
    (("context_parallel_group", "vocab_parallel_group"),
     "context_parallel_group and vocab_parallel_group hold the same ranks"),
])
def test_two_groups_holding_the_same_ranks_are_refused(pair, words, one_rank):
    same_ranks = dist.new_group([0])
    with pytest.raises(ValueError, match=f"^{words}"):
        check_distinct_groups({pair[0]: one_rank, pair[1]: same_ranks})


def test_groups_of_one_keyword_or_absent_are_not_compared(one_rank):
    check_distinct_groups({"process_group": None, "context_parallel_group": one_rank, "vocab_parallel_group": None})


def test_no_counted_token_on_any_context_rank_is_refused_with_value_checks():
    with pytest.raises(ValueError, match="no completion has a counted token on any rank of context_parallel_group"):
        check_context_batch(any_counted=False, validate=True)
    check_context_batch(any_counted=False, validate=False)
    check_context_batch(any_counted=True, validate=True)


def test_the_context_agreement_decides_on_no_counted_token_anywhere(one_rank):
    """Through the agreement of a 1-rank context group (the pipeline skips it for one rank)."""
    x = _inputs()
    request = SequenceRequest(function="tpo_loss", source=Logits(logits=x["hidden"] @ x["weight"].T),
                              batch=Batch(labels=torch.full((N, T), -100), scores=x["scores"], group_size=K),
                              options=Options(), placement=Placement())
    plan = plan_sequence(request, RankGroups(context=one_rank))  # no counted token here is not refused here
    with pytest.raises(ValueError, match="no completion has a counted token"):
        check_call(request)
    context, failure = plans.agree_on_context(request, CheckedCall(plan=plan, failure=None,
                                                                       context_group=one_rank), None)
    assert context is None and isinstance(failure, ValueError)
    assert str(failure) == ("no completion has a counted token on any rank of context_parallel_group "
                            "(all masked or ignore_index)")
