"""TargetPOTrainer under 2 processes (gloo, CPU) with groups spanning processes: a per-device
batch of 2 with 4 generations per prompt, the layout stock GRPOTrainer runs.

Each process trains with plain SGD at a constant learning rate and records every micro-batch; the
test then replays each optimizer step in one process on the concatenation of the processes'
micro-batches (process order) with the parameters the step started from, in float64:

* the loss every process returned equals ``reference.tpo_loss`` on the whole step's batch;
* the parameters after the step equal the replayed SGD step (so the gradient is the
  single-process gradient of the whole batch: a factor P off, or a group normalized over part of
  its completions, fails);
* both processes hold identical parameters, and they moved.

Layouts: one group split over the two processes; two optimizer micro-batches per generation
(groups then move between processes); 3 groups over 12 rows, one straddling the processes;
evaluation with a split group; and whole groups per process (the path without a gather).
"""

import pathlib

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("tokenizers")

from _distributed import run_ranks  # noqa: E402
from _trl_ranks import train_layouts  # noqa: E402
from _trl_tiny import build_tiny_olmo2  # noqa: E402
from transformers import Olmo2ForCausalLM  # noqa: E402

from tpo_kernels import reference  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

WORLD, K, LR, TEMPERATURE = 2, 4, 0.5, 0.9
LAYOUTS = {
    "split_group": dict(per_device_train_batch_size=2, eval_prompts=2, eval_strategy="steps", eval_steps=2,
                        per_device_eval_batch_size=2),
    "split_moved_ga2": dict(per_device_train_batch_size=2, gradient_accumulation_steps=2),
    "straddling": dict(per_device_train_batch_size=6),
    "whole_groups": dict(per_device_train_batch_size=4),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    model_dir = str(tmp_path_factory.mktemp("tiny_olmo2"))
    build_tiny_olmo2(model_dir)
    output_dir = str(tmp_path_factory.mktemp("out"))
    results = run_ranks(WORLD, train_layouts, model_dir, output_dir, LAYOUTS, deadline_s=300)
    return model_dir, results


def _concat(records):
    """The processes' micro-batches as one batch, process order (prompts left-padded, completions
    right-padded to a common width)."""
    def pad(name, left):
        tensors = [r[name] for r in records]
        width = max(t.shape[1] for t in tensors)
        padded = [torch.nn.functional.pad(t, (width - t.shape[1], 0) if left else (0, width - t.shape[1]))
                  for t in tensors]
        return torch.cat(padded)

    batch = {name: pad(name, name.startswith("prompt")) for name in ("prompt_ids", "prompt_mask", "completion_ids",
                                                                      "completion_mask")}
    for name in ("advantages", "tpo_group_ids"):
        batch[name] = torch.cat([r[name] for r in records])
    return batch


def _replay_loss(model, batch):
    """reference.tpo_loss (float64) of one micro-batch over all processes, with groups from the
    global ids; completions without a counted token left out."""
    length = batch["completion_ids"].shape[1]
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -length - 1 : -1]
    mask = batch["completion_mask"].bool()
    kept = mask.any(dim=1)
    labels = batch["completion_ids"].masked_fill(~mask, -100)
    return reference.tpo_loss(logits[kept], labels[kept], batch["advantages"][kept].double(),
                              group_ids=batch["tpo_group_ids"][kept], temperature=TEMPERATURE)


def _model(model_dir, params):
    model = Olmo2ForCausalLM.from_pretrained(model_dir).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(params[name].double())
    return model


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_training_step_equals_single_process_replay(runs, layout):
    model_dir, results = runs
    per_rank = [r[layout] for r in results]
    accumulation = LAYOUTS[layout].get("gradient_accumulation_steps", 1)
    trains = [[m for m in r["micro_batches"] if m["mode"] == "train"] for r in per_rank]
    befores = [r["params_before"] for r in per_rank]
    assert len(befores[0]) == len(befores[1]) == 2
    after = [r["params_after"] for r in per_rank]
    for name in after[0]:  # DDP keeps the processes' parameters identical, bit for bit
        assert torch.equal(after[0][name], after[1][name]), name
        assert all(torch.equal(b0[name], b1[name]) for b0, b1 in zip(*befores)), name
    split = LAYOUTS[layout]["per_device_train_batch_size"] % K != 0
    for step in range(2):
        model = _model(model_dir, befores[0][step])
        total = 0.0
        for micro in range(step * accumulation, (step + 1) * accumulation):
            records = [trains[0][micro], trains[1][micro]]
            batch = _concat(records)
            ids = batch["tpo_group_ids"]
            assert all((ids == g).sum() == K for g in ids.unique()), "a step's batch must hold whole groups"
            loss = _replay_loss(model, batch)
            losses = [r["loss"] for r in records]
            if split:  # every process returns the whole batch's loss
                assert losses == pytest.approx([loss.item()] * WORLD, rel=1e-5, abs=1e-6)
            else:  # each its own groups' mean, equal group counts: their mean is the whole batch's
                assert sum(losses) / WORLD == pytest.approx(loss.item(), rel=1e-5, abs=1e-6)
            total = total + loss / accumulation
        total.backward()
        expected = {name: p.detach() - LR * p.grad for name, p in model.named_parameters()}
        actual = befores[0][step + 1] if step == 0 else after[0]
        for name, value in expected.items():
            torch.testing.assert_close(actual[name].double(), value, rtol=1e-5, atol=2e-6, msg=name)
        moved = [name for name in expected if not torch.equal(actual[name], befores[0][step][name])]
        assert "lm_head.weight" in moved and any("layers.0" in name for name in moved)
    logs = per_rank[0]["logs"]
    assert len(logs) == 2 and all(torch.isfinite(torch.tensor(entry["tpo/loss"])) for entry in logs)


def test_evaluation_with_a_split_group_equals_single_process_replay(runs):
    model_dir, results = runs
    evals = [[m for m in r["split_group"]["micro_batches"] if m["mode"] == "eval"] for r in results]
    assert len(evals[0]) == len(evals[1]) == 2  # 2 prompts x 4 generations, 2 rows per process per batch
    model = _model(model_dir, results[0]["split_group"]["params_after"])
    with torch.no_grad():
        for records in zip(*evals):
            batch = _concat(records)
            assert batch["tpo_group_ids"].unique().numel() == 1  # one group, half on each process
            loss = _replay_loss(model, batch).item()
            assert [r["loss"] for r in records] == pytest.approx([loss] * WORLD, rel=1e-5, abs=1e-6)
