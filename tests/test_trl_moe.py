"""TargetPOTrainer on a mixture-of-experts model: a tiny Qwen3-MoE built from a config (CPU,
offline). The trainer adds the model's router load-balancing loss as GRPOTrainer does: the
coefficient ``router_aux_loss_coef`` of the model config (here 0.5, large enough to be seen next
to the TPO loss), router logits requested from the model. Every micro-batch's loss is checked
against ``reference.tpo_loss`` on the model's own logits plus the coefficient times the model's
own ``aux_loss``, both recomputed with the model's ordinary forward."""

import math

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("tokenizers")

from _trl_tiny import VOCAB, dataset, even_words, word_tokenizer  # noqa: E402
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

from tpo_kernels import reference  # noqa: E402
from tpo_kernels.integrations.trl import TargetPOConfig, TargetPOTrainer  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

K, COEF, TEMPERATURE = 4, 0.5, 0.9


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=COEF,
                            max_position_embeddings=64, tie_word_embeddings=False, eos_token_id=1, pad_token_id=0,
                            bos_token_id=None)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_qwen3_moe")
    Qwen3MoeForCausalLM(config).save_pretrained(path)
    tokenizer = word_tokenizer()
    tokenizer.save_pretrained(path)
    return str(path), tokenizer


class MoERecorder(TargetPOTrainer):
    """Recomputes every micro-batch's loss from the model's ordinary forward."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.records = []

    def _compute_loss(self, model, inputs):
        loss = super()._compute_loss(model, inputs)
        length = inputs["completion_ids"].shape[1]
        with torch.no_grad():
            input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
            attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
            outputs = model(input_ids=input_ids, attention_mask=attention_mask, output_router_logits=True)
            mask = inputs["completion_mask"].bool()
            kept = mask.any(dim=1)
            tpo = reference.tpo_loss(outputs.logits[:, -length - 1 : -1][kept].double(),
                                     inputs["completion_ids"].masked_fill(~mask, -100)[kept],
                                     inputs["tpo_scores"][kept].double(),
                                     group_ids=(torch.arange(len(kept)) // K)[kept],
                                     temperature=TEMPERATURE)
        self.records.append(dict(loss=loss.item(), tpo=tpo.item(), router=outputs.aux_loss.item()))
        return loss


def test_moe_router_loss_is_added_with_the_model_coefficient(tiny_moe, tmp_path):
    path, tokenizer = tiny_moe
    args = TargetPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=K,
                          max_completion_length=6, max_steps=2, learning_rate=1e-2, temperature=TEMPERATURE,
                          bf16=False, use_cpu=True, report_to="none", logging_steps=1, save_strategy="no",
                          disable_tqdm=True, seed=0, tpo_backend="cpu")
    trainer = MoERecorder(model=path, reward_funcs=even_words, args=args, train_dataset=dataset(),
                          processing_class=tokenizer)
    assert trainer.aux_loss_enabled and trainer.router_aux_loss_coef == COEF  # from the model config
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    assert len(trainer.records) == 2
    for record in trainer.records:
        assert record["router"] > 0.0 and COEF * record["router"] > 1e-3  # visible next to the tolerance
        assert record["loss"] == pytest.approx(record["tpo"] + COEF * record["router"], rel=1e-5, abs=1e-6)
    changed = {name for name, p in trainer.model.named_parameters() if not torch.equal(before[name], p.detach())}
    assert "lm_head.weight" in changed
    assert any(name.endswith("mlp.gate.weight") for name in changed)  # the router trains
    logs = [entry for entry in trainer.state.log_history if "aux_loss" in entry]
    assert len(logs) == 2 and all(math.isfinite(entry["aux_loss"]) and entry["aux_loss"] > 0 for entry in logs)
