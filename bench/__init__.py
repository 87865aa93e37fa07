"""The workshop: experiments and tools that run from a clone of the repository, not from the
installed package (which keeps ``tpo-kernels bench`` and ``tpo-kernels check``).

Run from the repository root, as ``python -m bench.<name>``:

* ``reverse_copy``: the paper's terminal-reward reverse-copy task, TPO vs GRPO (``reverse_copy_model``:
  task, policy, objectives, optimizers; ``reverse_copy_plot``: its table and plot)
* ``trl_rlvr``: the same task through TRL, ``TargetPOTrainer`` vs ``GRPOTrainer`` (``trl_rlvr_report``)
* ``trainer_step``: one TRL training step, four loss paths side by side (``trainer_step_setup``)
* ``kernel_report``: registers, spills, shared memory and load widths of every kernel, compiled for
  sm_80/sm_90 without a GPU
* ``examples.distributed_training``: DDP / FSDP2 / vocabulary-parallel training under torchrun
* ``experiment``: what the learning experiments share (settings, results files, the error plot)
* ``compare``: this checkout against another commit (``python -m bench.compare BASE``), every public
  function timed in alternating fresh processes, each side importing its own tree

Scripts: ``gpu_check.sh`` (the offline GPU machine's check), ``precision_edges.py``. Recorded
results: ``results/``; every measurement and its command: ``README.md``.
"""
