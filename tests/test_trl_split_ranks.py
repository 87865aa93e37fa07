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
micro-steps). The moved and the micro-step-spanning layouts again with a truncating sampler
(top_k=5, top_p=0.85 on transformers generation): each process records the kept sets of the rows it
generated, and they travel with the rows between processes (of unequal widths: the gather pads them
with -1); the replay is then over the recorded sets, which must be the sampler's rule on the
sampling policy's logits for the rows they arrive with, and the full-vocabulary replay must miss
both the loss and the step (the sets matter). And the moved layout where only process 0's sampler
truncates (a suppressed token): process 1's rows then carry whole-vocabulary sets, so that both
processes' batches have the same keys when rows move.

On one process: 2 rows per micro-step with 2 accumulation steps (each group spans the step's two
micro-steps), also with a generation reused for a second optimizer step (``num_iterations=2``: the
other micro-step's rows must be recomputed under the new parameters, and the rollout's log-probs
are the anchor).
"""

import math

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("tokenizers")

from _distributed import run_ranks  # noqa: E402
from _trl_ranks import train_layouts, train_recorded  # noqa: E402
from _trl_tiny import build_tiny_olmo2, sampler_kept_sets  # noqa: E402
from transformers import Olmo2ForCausalLM  # noqa: E402

from tpo_kernels import reference  # noqa: E402
from tpo_kernels.integrations.trl.kept_sets import KEPT_COUNTS, KEPT_IDS, sampling_mask_of  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

WORLD, K, LR, TEMPERATURE = 2, 4, 0.5, 0.9
TOP_K, TOP_P = 5, 0.85
SUPPRESSED = 10  # a word id of the tiny tokenizer
EVAL = dict(eval_prompts=2, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=2)
TRUNCATING = dict(top_k=TOP_K, top_p=TOP_P)
LAYOUTS = {
    "split_group": dict(per_device_train_batch_size=2, **EVAL),
    "split_moved_ga2": dict(per_device_train_batch_size=2, gradient_accumulation_steps=2),
    "straddling": dict(per_device_train_batch_size=6),
    "whole_groups": dict(per_device_train_batch_size=4),
    "window_ga2": dict(per_device_train_batch_size=1, gradient_accumulation_steps=2),
    "split_moved_ga2_top_k_top_p": dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, **EVAL,
                                        **TRUNCATING),
    "window_ga2_top_k_top_p": dict(per_device_train_batch_size=1, gradient_accumulation_steps=2, **TRUNCATING),
    # Only process 0's sampler truncates (a suppressed token): process 1's rows must still carry kept
    # sets (the whole vocabulary), since rows move between processes key by key.
    "split_moved_ga2_rank0_truncates": dict(per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                            rank_overrides={0: dict(generation_kwargs={"suppress_tokens": [
                                                SUPPRESSED]})}),
}
TRUNCATING_LAYOUTS = [name for name, overrides in LAYOUTS.items() if "top_k" in overrides]
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
    if KEPT_IDS in records[0]:  # kept ids -1 after a row's sets, counts 0 after its tokens
        kept_ids = [r[KEPT_IDS] for r in records]
        width = max(ids.shape[1] for ids in kept_ids)
        batch[KEPT_IDS] = torch.cat([torch.nn.functional.pad(ids, (0, width - ids.shape[1]), value=-1)
                                     for ids in kept_ids])
        batch[KEPT_COUNTS] = pad(KEPT_COUNTS, False)
    return batch


def _policy_logits(model, batch):
    """[N, C, V] the logits that predict the batch's completion tokens."""
    length = batch["completion_ids"].shape[1]
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    return model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -length - 1 : -1]


def _recorded_kept(batch, vocab):
    """[N, C, V] bool: the batch's recorded kept sets (None when it carries none)."""
    if KEPT_IDS not in batch:
        return None
    return reference.kept_mask(sampling_mask_of(batch[KEPT_IDS], batch[KEPT_COUNTS]),
                               batch["completion_ids"].shape, vocab)


def _replay_loss(model, batch, sampling=True):
    """reference.tpo_loss (float64) of a batch in one call, with groups from the global ids and the
    raw rewards as scores (the trainer's default score_eps); completions without a counted token
    left out; the rollout's log-probs as the anchor when the run stored them; over the recorded kept
    sets when the batch carries them (the full vocabulary with ``sampling=False``)."""
    logits = _policy_logits(model, batch)
    mask = batch["completion_mask"].bool()
    kept = mask.any(dim=1)
    labels = batch["completion_ids"].masked_fill(~mask, -100)
    old = batch.get("old_per_token_logps")
    keep = _recorded_kept(batch, logits.shape[-1]) if sampling else None
    # The kept sets as a padded id tensor [N, C, V] (-1: not kept), cut to the rows replayed.
    sets = None if keep is None else torch.where(keep, torch.arange(keep.shape[-1]), -1)[kept]
    return reference.tpo_loss(logits[kept], labels[kept], batch["tpo_scores"][kept].double(),
                              group_ids=batch["tpo_group_ids"][kept], temperature=TEMPERATURE,
                              old_logprobs=None if old is None else old[kept].double(), sampling_mask=sets)


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


@pytest.mark.parametrize("layout", [name for name, overrides in LAYOUTS.items() if "eval_prompts" in overrides])
def test_evaluation_with_a_split_group_equals_single_process_replay(runs, layout):
    model_dir, results = runs
    evals = [[m for m in r[layout]["micro_batches"] if m["mode"] == "eval"] for r in results]
    assert len(evals[0]) == len(evals[1]) == 2  # 2 prompts x 4 generations, 2 rows per process per batch
    model = _model(model_dir, results[0][layout]["params_after"])
    with torch.no_grad():
        for records in zip(*evals):
            batch = _concat(records)
            assert batch["tpo_group_ids"].unique().numel() == 1  # one group, half on each process
            loss = _replay_loss(model, batch).item()
            assert [r["loss"] for r in records] == pytest.approx([loss] * WORLD, rel=1e-5, abs=1e-6)


def _sampling_params(run, record_index, accumulation):
    """The parameters that sampled the rows of a run's ``record_index``-th micro-batch: a generation
    serves one optimizer step of ``accumulation`` micro-steps (generated at its first), evaluation
    runs after training."""
    if run["micro_batches"][record_index]["mode"] == "eval":
        return run["params_after"]
    train_index = sum(m["mode"] == "train" for m in run["micro_batches"][:record_index])
    return run["params_before"][train_index // accumulation]


@pytest.mark.parametrize("layout", TRUNCATING_LAYOUTS)
def test_truncated_sampler_sets_travel_with_their_rows(runs, layout):
    """Each micro-batch a process computed a loss on (its rows gathered from both processes and
    reordered by group) carries, for each counted token, the sampler's top-k-then-top-p set of the
    logits that sampled it, and empty sets elsewhere: the sets stayed aligned with their rows."""
    model_dir, results = runs
    accumulation = LAYOUTS[layout]["gradient_accumulation_steps"]
    sizes = []
    for result in results:
        run = result[layout]
        for index, record in enumerate(run["micro_batches"]):
            assert KEPT_IDS in record and KEPT_COUNTS in record
            with torch.no_grad():
                logits = _policy_logits(_model(model_dir, _sampling_params(run, index, accumulation)), record)
            recorded, mask = _recorded_kept(record, logits.shape[-1]), record["completion_mask"].bool()
            expected = sampler_kept_sets(logits, TOP_K, TOP_P, TEMPERATURE)
            assert torch.equal(recorded[mask], expected[mask])
            assert not recorded[~mask].any()
            sizes.append(recorded.sum(dim=-1)[mask])
    assert (torch.cat(sizes) < TOP_K).any()  # top_p cut some sets below top_k


def test_truncated_rows_of_unequal_kept_widths_move_between_processes(runs):
    """The moved layout exercises the gather's padding: in some generation the two processes' rows
    hold kept sets of different total sizes (so one process's ``tpo_kept_ids`` were padded with -1
    to the other's width), and a process trains on rows the other generated."""
    results = [r["split_moved_ga2_top_k_top_p"] for r in runs[1]]
    widths_differ = moved = False
    for step in range(2):
        records = [[m for m in run["micro_batches"] if m["mode"] == "train"][2 * step : 2 * step + 2]
                   for run in results]
        # process p generated group p of each generation (4 rows each; group ids restart per generation)
        totals = {}
        for rank, micro_batches in enumerate(records):
            for record in micro_batches:
                moved |= bool((record["tpo_group_ids"] != rank).any())
                for group, total in zip(record["tpo_group_ids"].tolist(), record[KEPT_COUNTS].sum(dim=1).tolist()):
                    totals[group] = max(totals.get(group, 0), total)
        widths_differ |= totals[0] != totals[1]
    assert moved and widths_differ


@pytest.mark.parametrize("layout", TRUNCATING_LAYOUTS)
def test_full_vocabulary_replay_misses_the_truncated_step(runs, layout):
    """The kept sets matter in these runs: the full-vocabulary replay of the first optimizer step
    differs from the logged loss and from the step the processes took, so the replays over the
    recorded sets above cannot agree by accident."""
    model_dir, results = runs
    per_rank = [r[layout] for r in results]
    accumulation = LAYOUTS[layout]["gradient_accumulation_steps"]
    trains = [[m for m in run["micro_batches"] if m["mode"] == "train"] for run in per_rank]
    batch = _concat([trains[rank][micro] for micro in range(accumulation) for rank in range(WORLD)])
    model = _model(model_dir, per_rank[0]["params_before"][0])
    full_vocabulary = _replay_loss(model, batch, sampling=False)
    assert abs(per_rank[0]["logs"][0]["loss"] - full_vocabulary.item()) > 1e-4
    full_vocabulary.backward()
    taken = per_rank[0]["params_before"][1]
    gap = max((taken[name].double() - (p.detach() - LR * p.grad)).abs().max().item()
              for name, p in model.named_parameters())
    assert gap > 1e-4


def test_a_truncation_on_one_process_gives_the_others_rows_full_vocabulary_sets(runs):
    """Process 0 suppresses a token, process 1 truncates nothing: every process's rows carry kept
    sets (process 1's the whole vocabulary, process 0's all but the suppressed token), so the rows
    move between processes with the same keys, and each step equals its replay over those sets."""
    model_dir, results = runs
    layout = "split_moved_ga2_rank0_truncates"
    vocab = results[0][layout]["params_after"]["lm_head.weight"].shape[0]
    sizes = {0: set(), 1: set()}
    for result in results:
        for record in result[layout]["micro_batches"]:
            recorded, mask = _recorded_kept(record, vocab), record["completion_mask"].bool()
            assert not recorded[:, :, SUPPRESSED][(record["tpo_group_ids"] == 0)].any()
            for group, row_sizes, row_mask in zip(record["tpo_group_ids"].tolist(), recorded.sum(dim=-1), mask):
                sizes[group].update(row_sizes[row_mask].tolist())  # process p generated group p
    assert sizes == {0: {vocab - 1}, 1: {vocab}}
