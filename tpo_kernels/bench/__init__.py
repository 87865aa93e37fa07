"""Benchmark harness for tpo_kernels: ``tpo-kernels bench`` (or ``python -m tpo_kernels.bench``).

Modules, by role:

* ``inputs``:    seeded inputs of every case, score variants (dense, 90%-tied)
* ``baselines``: what users would otherwise write (eager PyTorch, fused cross-entropy kernels)
* ``providers``: our backends and the baselines as runnable providers, with their availability
* ``cases``:     the cases, their throughput measure and default shape grids
* ``presets``:   named settings and the targets they check
* ``plan``:      command-line arguments -> measurements
* ``harness``:   timing and peak memory of one measurement; ``worker``: the same in a subprocess
* ``kernel_times``: kernel-only times of the logits path (row forward, group op, row backward)
* ``calibrate``: copy-bandwidth calibration, nvidia-smi clocks and power around a run
* ``report``:    ratios, checks, targets; results.json, results.md and plots
* ``machine``:   the machine, the software and the installed tpo_kernels (version, commit)
* ``run``:       the command line
"""



def main(argv=None) -> int:
    """Run the benchmark command line with ``argv`` (default: ``sys.argv[1:]``); returns the exit code."""
    from .run import main as run_main

    return run_main(argv)


__all__ = ["main"]
