"""The TRL releases TargetPOTrainer supports (1.15 and 1.16): the private GRPOTrainer API it
overrides or calls is pinned (a change fails at import, naming the method), and TRL 1.15's fused
head without its Triton kernels is served by tpo_kernels' own."""

import math

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("tokenizers")

from _trl_tiny import dataset, even_words  # noqa: E402
from trl import GRPOTrainer  # noqa: E402

from tpo_kernels import reference  # noqa: E402
from tpo_kernels.integrations import trl as tpo_trl  # noqa: E402
from tpo_kernels.integrations.trl import TargetPOConfig, TargetPOTrainer  # noqa: E402
from tpo_kernels.integrations.trl.private_api import (GRPO_TRAINER_METHODS, HELPERS, check_private_api,  # noqa: E402
                                                      signature_problems)

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


def test_installed_trl_has_the_pinned_private_api():
    assert signature_problems() == []
    # every private GRPOTrainer method the trainer defines is pinned
    overridden = {name for name in vars(TargetPOTrainer) if name.startswith("_") and not name.startswith("__")
                  and callable(getattr(GRPOTrainer, name, None))}
    assert overridden == set(GRPO_TRAINER_METHODS)


@pytest.mark.parametrize("name", sorted(GRPO_TRAINER_METHODS))
def test_a_changed_private_method_fails_at_import_naming_it(name):
    def changed(self, *args, new_required):  # a new required keyword
        raise AssertionError

    def renamed(self, batch):
        raise AssertionError

    for replacement in (changed, renamed):
        fake = type("NextGRPOTrainer", (GRPOTrainer,), {name: replacement})
        with pytest.raises(ImportError, match=rf"GRPOTrainer\.{name}\(.*expected parameters"):
            check_private_api(grpo_trainer_cls=fake)
    # A new optional parameter after ours is accepted; a missing method is not.
    ours = GRPO_TRAINER_METHODS[name]
    ok = type("NextGRPOTrainer", (GRPOTrainer,), {
        name: eval(f"lambda self, {', '.join(ours)}, new_optional=None: None")})
    assert signature_problems(grpo_trainer_cls=ok) == []
    gone = type("NextGRPOTrainer", (GRPOTrainer,), {name: None})
    with pytest.raises(ImportError, match=rf"GRPOTrainer\.{name}: not found"):
        check_private_api(grpo_trainer_cls=gone)


@pytest.mark.parametrize("dotted", sorted(HELPERS))
def test_a_changed_helper_fails_at_import_naming_it(dotted):
    import importlib

    def resolve(name):
        if name == dotted:
            return lambda other: None
        module, _, attr = name.rpartition(".")
        return getattr(importlib.import_module(module), attr)

    with pytest.raises(ImportError, match=dotted.replace(".", r"\.")):
        check_private_api(resolve=resolve)


@pytest.mark.parametrize("version, accepted", [("1.15.0", True), ("1.15.3", True), ("1.16.0", True),
                                               ("1.14.2", False), ("1.17.0", False)])
def test_version_check_names_the_tested_range(monkeypatch, version, accepted):
    import trl

    monkeypatch.setattr(trl, "__version__", version)
    monkeypatch.delenv(tpo_trl._ALLOW_UNTESTED_ENV, raising=False)
    assert tpo_trl.TESTED_TRL_VERSIONS == ">=1.15,<1.17"
    if accepted:
        tpo_trl._check_trl_version()
    else:
        with pytest.raises(ImportError, match=r"tested with trl>=1\.15,<1\.17"):
            tpo_trl._check_trl_version()


def test_the_trainer_reads_trls_attributes(tiny, tmp_path):
    """The GRPOTrainer attributes (several private) the trainer reads, set by TRL's constructor."""
    path, tokenizer = tiny
    args = TargetPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4, use_cpu=True,
                          bf16=False, report_to="none", max_steps=1, tpo_backend="cpu")
    trainer = TargetPOTrainer(model=path, reward_funcs=even_words, args=args, train_dataset=dataset(),
                              processing_class=tokenizer)
    for name in ("_step", "_buffered_inputs", "_metrics", "_tokenizer", "_is_vlm", "num_generations",
                 "num_generations_eval", "num_iterations", "reward_weights", "multi_objective_aggregation",
                 "aux_loss_enabled", "temperature", "beta", "ref_model", "use_vllm",
                 "vllm_importance_sampling_correction", "vllm_importance_sampling_mode", "entropy_coef",
                 "use_adaptive_entropy", "_last_world_entropy", "_entropy_window_stats"):
        assert hasattr(trainer, name), name
    assert trainer._last_world_entropy == math.inf and trainer._entropy_window_stats is None


def test_trl_fused_head_without_its_kernel(tiny, tmp_path, monkeypatch):
    """TRL 1.15 without its Triton kernels has no fused-head kernel (``_ChunkedLogProbFunction`` is
    None): the trainer serves TRL's fused-head calls, for the policy and the reference model, with
    tpo_kernels' log-probs, and trains with old and reference log-probs."""
    import trl.trainer.utils as trl_utils

    assert hasattr(trl_utils, "_ChunkedLogProbFunction")  # the name the check reads exists in both releases
    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", None)
    path, tokenizer = tiny
    args = TargetPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4, use_cpu=True,
                          bf16=False, report_to="none", max_steps=2, steps_per_generation=2, beta=0.05,
                          temperature=0.7, logging_steps=1, save_strategy="no", disable_tqdm=True, tpo_backend="cpu")
    trainer = TargetPOTrainer(model=path, reward_funcs=even_words, args=args, train_dataset=dataset(),
                              processing_class=tokenizer)
    torch.manual_seed(0)
    ids = torch.randint(3, 40, (4, 9))
    attention = torch.ones_like(ids)
    attention[1, -2:] = 0
    for model in (trainer.model, trainer.ref_model):
        with torch.no_grad():
            logps, entropy, _ = trainer._get_per_token_logps_and_entropies(model, ids, attention, 5,
                                                                           compute_entropy=True)
            logits = model(input_ids=ids, attention_mask=attention).logits[:, -6:-1].double()
        expected = reference.token_logprobs(logits, ids[:, -5:], temperature=0.7)
        counted = attention[:, -5:].bool()
        torch.testing.assert_close(logps.double()[counted], expected[counted], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(entropy.double()[counted],
                                   reference.token_entropy(logits, temperature=0.7)[counted], rtol=1e-5, atol=1e-5)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "tpo/loss" in entry]
    assert len(logs) == 2 and all(math.isfinite(entry["tpo/loss"]) and entry["tpo/kl_k3"] >= 0 for entry in logs)
