"""Sparse-reward RLVR through TRL: ``TargetPOTrainer`` against TRL's own ``GRPOTrainer``.

The task is the reverse-copy task of :mod:`bench.reverse_copy` (the TPO paper's
sparse-reward experiment, arXiv 2604.06159 Sec. 3.6) run through TRL: a prompt is a random binary
string of ``H`` words (``"0"`` / ``"1"``) and the separator ``"="``; the reward function (TRL's
reward-function interface, on the decoded completion) is 1 only when the completion is the prompt
reversed, word for word, else 0. The policy is a tiny OLMo-2 causal LM built from a config (hidden
64, 2 layers, 4 heads, untied head) with a word-level tokenizer built locally: no hub access.

Both trainers get TRL 1.16's defaults except these, identical for both:

* ``learning_rate`` (``--lr``, default 3e-3; TRL's 1e-6 is for pretrained LLMs and does not move
  a randomly initialised model in a few hundred steps);
* ``per_device_train_batch_size = prompts * num_generations`` (TRL's default 8 is one group of 8;
  more prompts per step make the sparse reward informative more often);
* ``max_completion_length = H`` and ``generation_kwargs={"suppress_tokens": [<pad>, <eos>, <unk>,
  "="]}``: completions are exactly H data words, so a random completion is right with probability
  ``2**-H`` as in the paper (TRL suppresses tokens the same way for image tokens);
* ``max_steps``, ``logging_steps=1`` (a curve point per step), ``seed``, ``use_cpu`` /
  ``bf16=False`` (CPU), ``report_to=[]``, ``save_strategy="no"``.

Everything else is TRL's default for both: AdamW (torch fused), linear decay to 0, grad-norm clip
1.0, ``num_iterations=1`` (one gradient step per generation: on-policy, so GRPO's ratio is 1 and
TPO's anchor is ``p_old = p``), ``beta=0`` (no reference model), ``temperature=1``,
``scale_rewards="group"``; GRPO's ``loss_type="dapo"``, ``epsilon=0.2``. TPO: ``tpo_eta=1``,
anchored (TargetPOConfig's defaults). ``--num-iterations`` changes TRL's ``num_iterations`` for
both (a diagnostic: several gradient steps per generation, as the reverse-copy benchmark's epochs).

Metric: exact-match error of a generation = 1 - TRL's logged mean reward (the fraction of its
sampled completions that are wrong; one generation per step unless ``--num-iterations`` > 1), and after training the greedy-decoding error on all ``2**H``
prompts. Each run is a subprocess (``--processes 2``: ``torchrun --nproc_per_node 2``, gloo; each
process then holds half the prompts of a step, so the global batch is the same as in one process).

``--jobs`` is the number of training processes at a time (a torchrun run takes its ``n``); each finished
run is also written to ``OUT/runs/`` and ``--resume`` reads back the runs of the same spec from there.
``--supervised`` is the capacity check: the same model trained by cross-entropy on the reversals
(:func:`supervised_run`), to tell a plateau of the RL apart from what the model can represent.

``python -m bench.trl_rlvr --smoke`` (from the repository root) runs a few steps of both methods (< 3 minutes);
``--out DIR`` writes ``DIR/results.json`` (``{"runs": [{"method", "seed", "final_error", ...}]}``),
``DIR/results.md`` and ``DIR/trl-rlvr.png``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional

from .experiment import (
    LOG_EVERY,
    MODEL_HEADS,
    MODEL_LAYERS,
    MODEL_WIDTH,
    add_output_options,
    child_env,
    csv,
    final_error,
    machine,
    offline_hub,
    print_finished,
    rebuild_report,
    runs_of,
    summary_row,
    write_report,
)

offline_hub()

METHODS = ("tpo", "grpo")
DATA_WORDS = ("0", "1")
SEPARATOR = "="
SPECIAL = ("<pad>", "<eos>", "<unk>")


@dataclass
class TRLRunSpec:
    method: str
    seed: int
    horizon: int = 4
    steps: int = 300
    prompts: int = 16
    group: int = 8
    lr: float = 3e-3
    num_iterations: int = 1
    processes: int = 1
    threads: int = 1
    log_every: int = LOG_EVERY
    hidden: int = MODEL_WIDTH
    layers: int = MODEL_LAYERS
    heads: int = MODEL_HEADS

    @property
    def name(self) -> str:
        return f"{self.method}/seed{self.seed}/{self.processes}proc"


# --------------------------------------------------------------------------------------------------
# Task, tokenizer, model
# --------------------------------------------------------------------------------------------------


def build_tokenizer():
    """Word-level tokenizer over ``<pad> <eos> <unk> 0 1 =``, left padding (TRL generates from the left)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate(SPECIAL + DATA_WORDS + (SEPARATOR,))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>", padding_side="left")


def build_model(spec: TRLRunSpec, tokenizer):
    """A tiny OLMo-2 from a config, initialised from ``spec.seed`` (the same for both methods)."""
    import torch
    from transformers import Olmo2Config, Olmo2ForCausalLM

    config = Olmo2Config(
        vocab_size=len(tokenizer), hidden_size=spec.hidden, intermediate_size=4 * spec.hidden,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.heads,
        max_position_embeddings=4 * (spec.horizon + 1), tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )
    torch.manual_seed(spec.seed)
    return Olmo2ForCausalLM(config)


def prompt_text(bits) -> str:
    return " ".join(DATA_WORDS[b] for b in bits) + " " + SEPARATOR


def make_dataset(horizon: int, rows: int, seed: int):
    """``rows`` uniformly random prompts (a fixed stream per seed)."""
    import torch
    from datasets import Dataset

    bits = torch.randint(0, 2, (rows, horizon), generator=torch.Generator().manual_seed(10_000 + seed))
    return Dataset.from_dict({"prompt": [prompt_text(row.tolist()) for row in bits]})


def reverse_exact(prompts: List[str], completions: List[str], **kwargs) -> List[float]:
    """TRL reward function: 1.0 when the completion is the prompt's words reversed, else 0.0."""
    out = []
    for prompt, completion in zip(prompts, completions):
        words = prompt.split()[:-1]  # drop the separator
        out.append(float(completion.split() == words[::-1]))
    return out


def suppressed_ids(tokenizer) -> List[int]:
    """Every token but the data words: generation emits exactly H data words."""
    keep = set(tokenizer.convert_tokens_to_ids(list(DATA_WORDS)))
    return [i for i in range(len(tokenizer)) if i not in keep]


def greedy_error(model, tokenizer, horizon: int) -> float:
    """Exact-match error of greedy decoding on all ``2**H`` prompts."""
    import torch

    prompts = [prompt_text([(code >> (horizon - 1 - t)) & 1 for t in range(horizon)]) for code in range(2 ** horizon)]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = model.generate(**batch, do_sample=False, max_new_tokens=horizon, min_new_tokens=horizon,
                             suppress_tokens=suppressed_ids(tokenizer), pad_token_id=tokenizer.pad_token_id)
    model.train(was_training)
    texts = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    return 1.0 - sum(reverse_exact(prompts, texts)) / len(prompts)


def supervised_run(spec: TRLRunSpec, eval_every: int = 50) -> Dict[str, list]:
    """The capacity check: the same model (``build_model(spec)``) trained by cross-entropy on the
    reversals themselves for ``spec.steps`` steps of ``spec.prompts`` random prompts (AdamW at
    ``spec.lr`` with linear decay and grad-norm clip 1, as the RL runs, but no sampling and no reward).
    Returns the greedy exact-match error on all ``2**H`` prompts every ``eval_every`` steps: when this
    reaches 0 and the RL runs plateau, the plateau is the RL, not what the model can represent."""
    import torch

    torch.set_num_threads(spec.threads)
    tokenizer = build_tokenizer()
    model = build_model(spec, tokenizer)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.0)
    decay = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 - step / spec.steps)
    gen = torch.Generator().manual_seed(10_000 + spec.seed)
    ids = tokenizer.convert_tokens_to_ids(list(DATA_WORDS))
    out: Dict[str, list] = {"step": [], "greedy_error": []}
    model.train()
    for step in range(1, spec.steps + 1):
        bits = torch.randint(0, 2, (spec.prompts, spec.horizon), generator=gen)
        words = torch.tensor(ids)[bits]
        sep = torch.full((spec.prompts, 1), tokenizer.convert_tokens_to_ids(SEPARATOR))
        input_ids = torch.cat([words, sep, words.flip(1)], dim=1)
        labels = input_ids.clone()
        labels[:, : spec.horizon + 1] = -100  # the loss is on the completion only
        loss = model(input_ids=input_ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        decay.step()
        if step % eval_every == 0 or step == spec.steps:
            out["step"].append(step)
            out["greedy_error"].append(greedy_error(model, tokenizer, spec.horizon))
    return out


# --------------------------------------------------------------------------------------------------
# One run (in its own process, or under torchrun)
# --------------------------------------------------------------------------------------------------


def trainer_args(spec: TRLRunSpec, tokenizer, output_dir: str):
    """The config of ``spec.method``: TRL's defaults but for the fields the docstring lists."""
    common = dict(
        output_dir=output_dir, learning_rate=spec.lr, num_generations=spec.group,
        per_device_train_batch_size=spec.prompts * spec.group // spec.processes,
        max_completion_length=spec.horizon, generation_kwargs={"suppress_tokens": suppressed_ids(tokenizer)},
        num_iterations=spec.num_iterations, max_steps=spec.steps, logging_steps=1, seed=spec.seed,
        use_cpu=True, bf16=False, report_to=[], save_strategy="no", disable_tqdm=True,
    )
    if spec.method == "tpo":
        from tpo_kernels.integrations.trl import TargetPOConfig

        return TargetPOConfig(**common)
    if spec.method == "grpo":
        from trl import GRPOConfig

        return GRPOConfig(**common)
    raise ValueError(f"method must be one of {METHODS}, got {spec.method!r}")


def _recorder(spec: TRLRunSpec, curves: Dict[str, list], log):
    """A TrainerCallback filling ``curves`` from TRL's per-step logs, and timing each step."""
    from transformers import TrainerCallback

    class Recorder(TrainerCallback):
        def __init__(self):
            self.start = self.cpu_start = None

        def on_step_begin(self, args, state, control, **kwargs):
            self.t0, self.c0 = time.perf_counter(), time.process_time()
            if self.start is None:
                self.start, self.cpu_start = self.t0, self.c0

        def on_step_end(self, args, state, control, **kwargs):
            curves["seconds"].append(time.perf_counter() - self.t0)
            curves["cpu_seconds"].append(time.process_time() - self.c0)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not logs or "loss" not in logs:  # the end-of-training summary
                return
            curves["loss"].append(logs["loss"])  # every step
            curves["grad_norm"].append(logs.get("grad_norm"))
            if "reward" not in logs:  # a step on a reused generation (num_iterations > 1) logs no reward
                return
            curves["error"].append(1.0 - logs["reward"])  # every generation
            curves["reward"].append(logs["reward"])
            curves["informative_groups"].append(1.0 - logs.get("frac_reward_zero_std", 0.0))
            step = state.global_step
            last, every = step + spec.num_iterations - 1, spec.log_every  # the last step this generation serves
            if state.is_world_process_zero and every and (last // every > (step - 1) // every or step == spec.steps):
                elapsed = time.perf_counter() - self.start
                log(f"[{spec.name}] step {step:4d}/{spec.steps} reward {logs['reward']:.3f} "
                    f"informative {curves['informative_groups'][-1]:.2f} loss {logs.get('loss', float('nan')):.4g} "
                    f"{elapsed / step:.3f} s/step wall, {(time.process_time() - self.cpu_start) / step:.3f} "
                    f"s/step CPU ({elapsed:.0f} s)")

    return Recorder()


def train_run(spec: TRLRunSpec, log=print) -> Optional[dict]:
    """Train one (method, seed) with TRL; returns its curves on the main process (None elsewhere)."""
    import warnings

    import torch
    from transformers import PrinterCallback

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    torch.set_num_threads(spec.threads)
    tokenizer = build_tokenizer()
    model = build_model(spec, tokenizer)
    dataset = make_dataset(spec.horizon, spec.steps * spec.prompts, spec.seed)
    curves: Dict[str, list] = {k: [] for k in ("error", "reward", "loss", "informative_groups", "grad_norm",
                                               "seconds", "cpu_seconds")}
    with tempfile.TemporaryDirectory() as tmp:
        args = trainer_args(spec, tokenizer, tmp)
        if spec.method == "tpo":
            from tpo_kernels.integrations.trl import TargetPOTrainer as Trainer
        else:
            from trl import GRPOTrainer as Trainer
        trainer = Trainer(model=model, reward_funcs=reverse_exact, args=args, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[_recorder(spec, curves, log)])
        trainer.remove_callback(PrinterCallback)  # the recorder prints the progress lines
        start, cpu_start = time.perf_counter(), time.process_time()
        trainer.train()
        total, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        if not trainer.accelerator.is_main_process:
            return None
        greedy = greedy_error(trainer.model, tokenizer, spec.horizon)
    steps = len(curves["seconds"])
    return {**asdict(spec), "name": spec.name, "curves": curves, "greedy_final_error": greedy,
            "seconds_total": total, "seconds_per_step": total / steps, "cpu_seconds_per_step": cpu / steps}


def _worker_main(spec_path: str, out_path: str) -> int:
    with open(spec_path) as f:
        spec = TRLRunSpec(**json.load(f))
    run = train_run(spec, log=lambda line: print(line, flush=True))
    if run is not None:
        with open(out_path, "w") as f:
            json.dump(run, f)
    return 0


def _launch(spec: TRLRunSpec, tmp: str):
    """Start one run as a subprocess (torchrun for several processes); returns (process, result path)."""
    spec_path, out_path = os.path.join(tmp, f"{spec.method}-{spec.seed}-{spec.processes}.spec.json"), \
        os.path.join(tmp, f"{spec.method}-{spec.seed}-{spec.processes}.run.json")
    with open(spec_path, "w") as f:
        json.dump(asdict(spec), f)
    worker = ["-m", "bench.trl_rlvr", "--worker", spec_path, out_path]
    if spec.processes == 1:
        cmd = [sys.executable] + worker
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={spec.processes}"] + worker
    env = child_env(OMP_NUM_THREADS=str(spec.threads))
    return subprocess.Popen(cmd, env=env), out_path


def _run_path(runs_dir: str, spec: TRLRunSpec) -> str:
    return os.path.join(runs_dir, f"{spec.method}-seed{spec.seed}-{spec.processes}proc.json")


def run_all(specs: List[TRLRunSpec], jobs: int, runs_dir: Optional[str] = None, resume: bool = False) -> List[dict]:
    """Every spec in its own subprocess, at most ``jobs`` processes at a time (a torchrun spec of ``n``
    processes takes ``n``, or all of them when ``jobs < n``); results in the order of ``specs``.

    ``runs_dir``: each finished run is also written there at once (a long command that is stopped keeps its
    finished runs); with ``resume``, a spec whose file there holds the same spec is read back, not run again.
    """
    results: Dict[int, dict] = {}
    pending = []
    for i, spec in enumerate(specs):
        path = _run_path(runs_dir, spec) if runs_dir else None
        if resume and path and os.path.exists(path):
            with open(path) as f:
                run = json.load(f)
            if {k: run.get(k) for k in asdict(spec)} == asdict(spec):
                results[i] = run
                print(f"[{spec.name}] read back from {path}", flush=True)
                continue
        pending.append((i, spec))
    if runs_dir:
        os.makedirs(runs_dir, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        running = []
        while pending or running:
            # start the next spec (in order) while its processes fit; one always starts on an idle machine
            while pending and (not running or sum(s.processes for _, s, _, _ in running) + pending[0][1].processes <= jobs):
                i, spec = pending.pop(0)
                running.append((i, spec) + _launch(spec, tmp))
            time.sleep(0.5)
            for item in list(running):
                i, spec, proc, out_path = item
                if proc.poll() is None:
                    continue
                running.remove(item)
                if proc.returncode != 0:
                    raise RuntimeError(f"run {spec.name} failed with exit status {proc.returncode}")
                with open(out_path) as f:
                    results[i] = json.load(f)
                if runs_dir:
                    with open(_run_path(runs_dir, spec), "w") as f:
                        json.dump(results[i], f)
    return [results[i] for i in range(len(specs))]


# --------------------------------------------------------------------------------------------------
# Summary and CLI
# --------------------------------------------------------------------------------------------------


def summarize(results: dict) -> List[dict]:
    """One row per (method, processes): median final error over seeds and the per-seed values."""
    cfg = results["config"]
    rows = []
    for processes in sorted({r["processes"] for r in results["runs"]}):
        for method in cfg["methods"]:
            runs = runs_of(results, method=method, processes=processes)
            if not runs:
                continue
            rows.append({
                "method": method, "processes": processes,
                **summary_row(runs, [r["final_error"] for r in runs], cfg["threshold"], "step"),
                "greedy_final_error": [r["greedy_final_error"] for r in runs],
                "seconds_per_step": [r["seconds_per_step"] for r in runs],
                "cpu_seconds_per_step": [r["cpu_seconds_per_step"] for r in runs],
            })
    return rows


def write_outputs(results: dict, out: str, plot: bool = True) -> List[str]:
    from . import trl_rlvr_report as report

    results["summary"] = summarize(results)
    return write_report(results, out, report, "trl-rlvr.png", plot)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.trl_rlvr",
        description="Reverse copy (terminal reward) through TRL: TargetPOTrainer vs GRPOTrainer with TRL's "
                    "defaults but for lr, batch and generation length. Writes results.json, results.md and a PNG.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="a few steps of each method at H=3, one seed (< 3 min)")
    p.add_argument("--horizon", "-H", type=int, default=4, help="prompt / completion length in words")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps (one generation each) per run")
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 per method")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated: tpo, grpo")
    p.add_argument("--prompts", type=int, default=16, help="prompts per step (global, over all processes)")
    p.add_argument("--group", "-K", type=int, default=8, help="num_generations: completions per prompt")
    p.add_argument("--lr", type=float, default=3e-3, help="learning rate (both methods)")
    p.add_argument("--num-iterations", type=int, default=1, help="TRL's num_iterations (both methods)")
    p.add_argument("--processes", default="1",
                   help="comma-separated process counts; 2 runs seed 0 of each method under torchrun (gloo) too")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--jobs", type=int, default=2,
                   help="training processes at a time (a run is a subprocess; a torchrun run counts its processes)")
    p.add_argument("--resume", action="store_true",
                   help="read back the runs of the same spec already in OUT/runs/ instead of running them again")
    add_output_options(p, out="bench/out/trl-rlvr", unit="step")
    p.add_argument("--supervised", action="store_true",
                   help="only the capacity check: train the same model by cross-entropy on the reversals "
                        "(--steps, --prompts, --lr, seeds) and print its greedy error")
    p.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    return p


SMOKE = dict(horizon=3, steps=12, seeds=1, prompts=8, log_every=4, processes="1")


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.worker:
        return _worker_main(*args.worker)
    if args.report:
        return rebuild_report(args.report, write_outputs, plot=not args.no_plot)
    if args.smoke:
        parser.set_defaults(**SMOKE)
        args = parser.parse_args(argv)
    if args.supervised:
        for seed in range(args.seeds):
            spec = TRLRunSpec(method="supervised", seed=seed, horizon=args.horizon, steps=args.steps,
                              prompts=args.prompts, lr=args.lr, threads=args.threads)
            start, cpu = time.perf_counter(), time.process_time()
            curve = supervised_run(spec)
            print(f"supervised H={args.horizon} seed {seed}: greedy error % by step "
                  + ", ".join(f"{s}: {100 * e:.1f}" for s, e in zip(curve["step"], curve["greedy_error"]))
                  + f" ({time.perf_counter() - start:.0f} s wall, {time.process_time() - cpu:.0f} s CPU)", flush=True)
        return 0
    methods = csv(args.methods)
    for m in methods:
        if m not in METHODS:
            raise SystemExit(f"--methods: unknown method {m!r} (choose from {', '.join(METHODS)})")
    processes = [int(p) for p in args.processes.split(",")]
    for n in processes:
        if n < 1 or (args.prompts * args.group) % (n * args.group):
            raise SystemExit(f"--processes {n}: each process must hold whole groups of the {args.prompts} prompts")
    common = dict(horizon=args.horizon, steps=args.steps, prompts=args.prompts, group=args.group, lr=args.lr,
                  num_iterations=args.num_iterations, threads=args.threads, log_every=args.log_every)
    specs = [TRLRunSpec(method=m, seed=s, processes=1, **common) for s in range(args.seeds) for m in methods
             if 1 in processes]
    specs += [TRLRunSpec(method=m, seed=0, processes=n, **common) for n in processes if n > 1 for m in methods]
    config = {k: v for k, v in vars(args).items() if k not in ("report", "worker", "resume")}
    config.update(methods=methods, processes=processes, argv=list(sys.argv[1:] if argv is None else argv))
    machine_before = machine()
    print(f"trl-rlvr: H={args.horizon} prompts={args.prompts} K={args.group} steps={args.steps} lr={args.lr:g} "
          f"num_iterations={args.num_iterations} runs={len(specs)} jobs={args.jobs} load={machine_before['loadavg']}",
          flush=True)
    start = time.perf_counter()
    runs = run_all(specs, args.jobs, os.path.join(args.out, "runs"), args.resume)
    for run in runs:
        run["final_error"] = final_error(run, args.final_window)
    results = {"benchmark": "trl-rlvr", "date": _dt.datetime.now().isoformat(timespec="seconds"),
               "config": config, "machine": {**machine_before, "loadavg_end": machine()["loadavg"]},
               "wall_seconds": time.perf_counter() - start, "runs": runs}
    paths = write_outputs(results, args.out, plot=not args.no_plot)
    from . import trl_rlvr_report as report

    print_finished(report.markdown(results), paths)
    return 0


if __name__ == "__main__":
    sys.exit(main())
