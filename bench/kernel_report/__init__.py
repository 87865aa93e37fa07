"""Kernel report: registers, spills, shared memory and global load widths of every Triton and CUDA
kernel of tpo_kernels, compiled for sm_80 and sm_90 on a machine without a GPU.

    python -m bench.kernel_report                             # sm_80 and sm_90, the table, exit status
    python -m bench.kernel_report --arch 90 --json report.json
    python -m bench.kernel_report --triton-only               # or --cuda-only
    python -m bench.kernel_report --ops row --arch 90          # the row kernels alone (about a minute)
    python -m bench.kernel_report.loops                      # CUDA row kernels: instructions per pack

**Triton.** Each operation of the Triton backend is called through the backend interface
(``TritonBackend().row_forward(...)`` and so on) on small CPU tensors of representative shapes:
2 rows of each vocabulary in ``--vocab`` (default 32000, 50257, 151936: block sizes and warp counts
as at training shapes, and a vocabulary that is not a multiple of 16), and for each odd vocabulary
the row ops on ``logits[:, 1:]`` of a ``[2, 3, V]`` buffer (a view whose start is off a 16-byte
boundary and whose rows do not flatten: the specializations of the README's ``logits[:, :-1]``),
K=8 candidates, H=4096,
16 groups of 8 sequences of 128 tokens, in every dtype the launcher takes. A stand-in Triton
driver names the target GPU and turns each launch into a compile only
(``JITFunction.run(..., warmup=True)``), so every kernel is built exactly as its launcher
specializes it: constexprs, block sizes, ``num_warps``, argument dtypes, and which pointers and
integers are divisible by 16. Nothing runs. One process per architecture, with
``TRITON_INTERPRET`` off.

**CUDA.** The kernels of ``csrc/cuda``: read from the built extension ``tpo_kernels/_C_cuda*.so``
when it carries code for every requested architecture, else compiled from ``csrc/cuda/*.cu`` with
nvcc and the flags setup.py uses, one architecture at a time with ``-Xptxas -v`` (which gives the
exact spill bytes). nvcc, the toolkit and cuobjdump come from ``csrc/cuda_toolkit.py``; cuobjdump
may be the copy the Triton wheel bundles. A missing cuobjdump is an error, never a skip.

**Columns.** ``regs``: registers per thread. ``spill``: bytes of register spill stores (ptxas,
when the kernel was compiled here) or else the local-memory frame (cuobjdump's STACK + LOCAL),
then the number of local-memory instructions (LDL/STL) in the SASS; any local memory counts as a
spill. ``smem``: static shared bytes in the cubin (sm_90 cubins include the 1 KiB the driver
reserves per block) + dynamic bytes the launch requests (Triton). ``loads``: the global loads in
the SASS by width in bits (``128x2`` = two 128-bit LDG instructions; LDG.E.128 is a 16-byte vector
load), then the stores. ``insts/elem`` (row kernels): SASS instructions per element of the
row in the kernel's main loop (the loop with the most 128-bit loads; ``parse.main_loops``), on
its common path (without the regions that forward branches inside the loop skip); the CUDA
backward holds two such loops, ``without/with`` the entropy term. It says whether a row kernel is
bound by memory or by instruction issue: an SM issues 128 thread instructions per cycle, so a
16-byte pack (8 bf16, 4 fp32 elements) stays bound by memory on an H100 / H200 below about 100
instructions. ``launched for``: the calls that produced this specialization.

**Progress.** While the kernels compile (minutes), a line ``kernel_report: [N s] ...`` on stderr says
what is still running, every ``--progress-every`` seconds (default 15).

Exit status: 0 when no fp32, bf16 or fp16 kernel spills (fp64 kernels are reported, not
failed; so is the local memory ``KNOWN_TRITON_LOCAL_MEMORY`` records for one Triton release,
under that release only: Triton 3.6's two 8-byte frames, none under 3.9); 1 when one does; 2
when the report could not be made (a missing tool, a compile error).
"""

from .cuda import _cuda_rows, built_cuda_extensions, collect_cuda, elf_archs
from .parse import (
    DEFAULT_ARCHS,
    DEFAULT_DTYPES,
    DEFAULT_VOCABS,
    ELEMENTS_PER_PACK,
    FAIL_DTYPES,
    KNOWN_TRITON_LOCAL_MEMORY,
    OPS,
    KernelRow,
    ReportError,
    cuda_label,
    demangle,
    main_loops,
    op_of_kernel,
    pack_loop_facts,
    parse_ptxas_log,
    parse_resource_usage,
    parse_sass,
)
from .progress import PROGRESS_EVERY_S, Progress
from .table import build_parser, format_table, main, verdict
from .tools import find_cuobjdump, inspect_binary, load_toolkit, package_dir, triton_tool
from .triton import Scenario, collect_triton, run_triton_workers, triton_scenarios

__all__ = ["DEFAULT_ARCHS", "DEFAULT_DTYPES", "DEFAULT_VOCABS", "ELEMENTS_PER_PACK", "FAIL_DTYPES",
           "KNOWN_TRITON_LOCAL_MEMORY", "KernelRow", "OPS", "PROGRESS_EVERY_S", "Progress", "ReportError", "Scenario",
           "_cuda_rows", "build_parser", "built_cuda_extensions", "collect_cuda", "collect_triton", "cuda_label",
           "demangle", "elf_archs", "find_cuobjdump", "format_table", "inspect_binary", "load_toolkit", "main",
           "main_loops", "op_of_kernel", "pack_loop_facts", "package_dir", "parse_ptxas_log", "parse_resource_usage",
           "parse_sass", "run_triton_workers", "triton_scenarios", "triton_tool", "verdict"]
