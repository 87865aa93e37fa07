"""Each stage's settings travel as one record: built once by the check pass, flattened at the
torch.library boundary by one method and read back whole, and agreed on across ranks field by
field, so that a new field needs no edit on the way."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tpo_kernels.distributed import plans
from tpo_kernels.checks.arguments import CallFlags, check_options
from tpo_kernels.plan import check_call
from tpo_kernels.group_math import GroupRule
from tpo_kernels.ops import RowRequest
from tpo_kernels.ops.group import LossWeights
from tpo_kernels.requests import Batch, Logits, Options, Placement, SequenceRequest


@pytest.mark.parametrize("rule", [GroupRule(), GroupRule(eta=0.3, anchor=False, score_eps=0.0, length_normalize=True),
                                  GroupRule(eta=1e-30, score_eps=3.5e38)])
def test_a_group_rule_reads_back_whole_from_its_op_form(rule):
    assert GroupRule.from_op(rule.to_op()) == rule


def test_the_group_kernels_take_every_field_the_op_applies():
    rule = GroupRule(eta=0.5, anchor=False, score_eps=1e-3, length_normalize=True)
    assert rule.kernel_args() == {"eta": 0.5, "anchor": False, "score_eps": 1e-3}  # length_normalize: before the op


@pytest.mark.parametrize("request_", [RowRequest(), RowRequest(inv_temperature=1 / 0.7, logit_scale=1.3,
                                                               logit_softcap=30.0, token_fields=("entropy",))])
def test_a_row_request_reads_back_whole_from_its_op_form(request_):
    assert RowRequest.from_op(request_.to_op()) == request_


def test_the_check_pass_builds_each_stage_record_once():
    options = Options(eta=0.5, temperature=0.5, logit_scale=2.0, reduction="sum", score_eps=0.0,
                      length_normalize=True, entropy_coef=0.01, return_aux=True)
    batch = Batch(labels=None, scores=torch.zeros(4), group_size=2, beta=0.1)
    row, rule, weights, flags, checked = check_options(options, batch)
    assert row == RowRequest(inv_temperature=2.0, logit_scale=2.0, token_fields=("entropy",))  # the bonus reads it
    assert rule == GroupRule(eta=0.5, anchor=True, score_eps=0.0, length_normalize=True)
    assert weights == LossWeights(reduction="sum", beta=0.1, entropy_coef=0.01)
    assert flags == CallFlags(validate=True, return_aux=True, return_entropy=False)
    assert checked == batch


def test_the_ranks_agree_on_every_field_of_the_stage_records():
    logits, labels, scores = torch.randn(4, 3, 11), torch.randint(0, 11, (4, 3)), torch.randn(4)
    request = SequenceRequest(function="tpo_loss", source=Logits(logits=logits),
                              batch=Batch(labels=labels, scores=scores, group_size=2), options=Options(eta=0.25),
                              placement=Placement())
    plan = check_call(request).plan
    settings = plans.agreed_settings("tpo_loss", plan, {})
    for record_type in (RowRequest, GroupRule, LossWeights, CallFlags):
        for field in dataclasses.fields(record_type):
            assert field.name in settings, field.name
    assert settings["eta"] == 0.25
    assert settings.keys() == plans.agreed_settings("tpo_loss", None, {}).keys()  # a failed rank's too
