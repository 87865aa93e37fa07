"""TargetPOTrainer with groups spanning processes (2 gloo processes on CPU) or micro-steps (one
process): the layouts stock GRPOTrainer runs, e.g. a per-device batch of 2 with 4 generations per
prompt on 2 processes, or on one process with 2 accumulation steps (a group spans two micro-steps).

Each process trains with plain SGD at a constant learning rate and records every micro-batch; the
test then replays each optimizer step in one process, in float64, with the parameters the step
started from, on the concatenation of the step's micro-batches of every process (micro-step, then
process order) in one loss call:

* the loss every process returned for a micro-step equals ``reference.tpo_loss`` on its window's
  batch (the micro-steps whose batches hold whole groups; every process's when groups span
  processes, its own otherwise), and TRL's logged loss of the step equals the step's replay;
* the parameters after the step equal the replayed SGD step (so the gradient is the one of the
  whole step's batch: a factor off, a group normalized over part of its completions, or the rows
  of the window's other micro-steps left out of a group, fails);
* both processes hold identical parameters, and they moved.

Layouts on 2 processes: one group split over the two processes; two optimizer micro-batches per
generation (groups then move between processes); 3 groups over 12 rows, one straddling the
processes; evaluation with a split group; whole groups per process (the path without a gather);
and a per-device batch of 1 with 2 accumulation steps (each group spans both processes and both
micro-steps). On one process: 2 rows per micro-step with 2 accumulation steps (each group spans
the step's two micro-steps), also with a generation reused for a second optimizer step
(``num_iterations=2``: the other micro-step's rows must be recomputed under the new parameters,
and the rollout's log-probs are the anchor).
"""

import math

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("tokenizers")

from _distributed import run_ranks  # noqa: E402
from _trl_ranks import train_layouts, train_recorded  # noqa: E402
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
    "window_ga2": dict(per_device_train_batch_size=1, gradient_accumulation_steps=2),
}
ONE_PROCESS_LAYOUTS = {
    "window_ga2": dict(per_device_train_batch_size=2, gradient_accumulation_steps=2),
    "window_ga2_reused": dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, num_iterations=2),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    model_dir = str(tmp_path_factory.mktemp("tiny_olmo2"))
    build_tiny_olmo2(model_dir)
    output_dir = str(tmp_path_factory.mktemp("out"))
    results = run_ranks(WORLD, train_layouts, model_dir, output_dir, LAYOUTS, deadline_s=400)
    return model_dir, results


@pytest.fixture(scope="module")
def one_process_runs(tmp_path_factory):
    model_dir = str(tmp_path_factory.mktemp("tiny_olmo2_one"))
    build_tiny_olmo2(model_dir)
    output_dir = tmp_path_factory.mktemp("out_one")
    return model_dir, {name: train_recorded(model_dir, str(output_dir / name), overrides)
                       for name, overrides in ONE_PROCESS_LAYOUTS.items()}


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
    for name in ("tpo_scores", "tpo_group_ids"):
        batch[name] = torch.cat([r[name] for r in records])
    if "old_per_token_logps" in records[0]:
        batch["old_per_token_logps"] = pad("old_per_token_logps", False)
    return batch


def _replay_loss(model, batch):
    """reference.tpo_loss (float64) of a batch in one call, with groups from the global ids and the
    raw rewards as scores (the trainer's default score_eps); completions without a counted token
    left out; the rollout's log-probs as the anchor when the run stored them."""
    length = batch["completion_ids"].shape[1]
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -length - 1 : -1]
    mask = batch["completion_mask"].bool()
    kept = mask.any(dim=1)
    labels = batch["completion_ids"].masked_fill(~mask, -100)
    old = batch.get("old_per_token_logps")
    return reference.tpo_loss(logits[kept], labels[kept], batch["tpo_scores"][kept].double(),
                              group_ids=batch["tpo_group_ids"][kept], temperature=TEMPERATURE,
                              old_logprobs=None if old is None else old[kept].double())


def _model(model_dir, params):
    model = Olmo2ForCausalLM.from_pretrained(model_dir).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(params[name].double())
    return model


def _check_steps(model_dir, per_rank, overrides):
    """Replay each optimizer step of a run (one record per process) and compare (module docstring)."""
    world = len(per_rank)
    per_device = overrides["per_device_train_batch_size"]
    accumulation = overrides.get("gradient_accumulation_steps", 1)
    window = K // math.gcd(K, per_device * world)  # micro-steps whose batches hold whole groups
    split = (window * per_device) % K != 0  # a process's rows of a window are not whole groups
    trains = [[m for m in r["micro_batches"] if m["mode"] == "train"] for r in per_rank]
    befores = [r["params_before"] for r in per_rank]
    after = [r["params_after"] for r in per_rank]
    assert all(len(b) == 2 for b in befores)
    for name in after[0]:  # DDP keeps the processes' parameters identical, bit for bit
        assert all(torch.equal(a[name], after[0][name]) for a in after), name
        assert all(torch.equal(b[step][name], befores[0][step][name]) for b in befores for step in range(2)), name
    logs = per_rank[0]["logs"]
    assert len(logs) == 2
    for step in range(2):
        model = _model(model_dir, befores[0][step])
        micros = range(step * accumulation, (step + 1) * accumulation)
        for first in micros[::window]:
            steps = range(first, first + window)
            whole = _concat([trains[rank][micro] for micro in steps for rank in range(world)])
            ids = whole["tpo_group_ids"]
            assert all((ids == g).sum() == K for g in ids.unique()), "a window's batch must hold whole groups"
            with torch.no_grad():
                if split:  # every process returns the loss of the window's groups over all processes
                    expected = [_replay_loss(model, whole).item()] * world
                else:  # each process the loss of its own rows of the window
                    expected = [_replay_loss(model, _concat([trains[rank][m] for m in steps])).item()
                                for rank in range(world)]
            for micro in steps:
                losses = [trains[rank][micro]["loss"] for rank in range(world)]
                assert losses == pytest.approx(expected, rel=1e-5, abs=1e-6)
        batch = _concat([trains[rank][micro] for micro in micros for rank in range(world)])
        total = _replay_loss(model, batch)  # the whole step's batch in one loss call
        assert logs[step]["loss"] == pytest.approx(total.item(), rel=1e-5, abs=1e-6)
        total.backward()
        expected = {name: p.detach() - LR * p.grad for name, p in model.named_parameters()}
        actual = befores[0][step + 1] if step == 0 else after[0]
        for name, value in expected.items():
            torch.testing.assert_close(actual[name].double(), value, rtol=1e-5, atol=2e-6, msg=name)
        moved = [name for name in expected if not torch.equal(actual[name], befores[0][step][name])]
        assert "lm_head.weight" in moved and any("layers.0" in name for name in moved)
    assert all(torch.isfinite(torch.tensor(entry["tpo/loss"])) for entry in logs)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_training_step_equals_single_process_replay(runs, layout):
    model_dir, results = runs
    _check_steps(model_dir, [r[layout] for r in results], LAYOUTS[layout])


@pytest.mark.parametrize("layout", list(ONE_PROCESS_LAYOUTS))
def test_group_spanning_micro_steps_equals_replay(one_process_runs, layout):
    model_dir, results = one_process_runs
    _check_steps(model_dir, [results[layout]], ONE_PROCESS_LAYOUTS[layout])
    if ONE_PROCESS_LAYOUTS[layout].get("num_iterations", 1) > 1:  # the second step reused the generation
        micro_batches = results[layout]["micro_batches"]
        assert all("old_per_token_logps" in m for m in micro_batches)
        assert torch.equal(micro_batches[0]["completion_ids"], micro_batches[2]["completion_ids"])


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
