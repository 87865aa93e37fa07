"""The kernel report (``python -m bench.kernel_report``): its parsers of ptxas and
cuobjdump output, the spill rule, a real spill found in a real compile (CUDA with nvcc, Triton
through the report's own launch capture), and the failure when cuobjdump is missing. The full
report (every kernel, sm_80 and sm_90) runs in .ci/run."""

from __future__ import annotations

import json
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from bench import kernel_report as KR

from _triton_compile import compiled_kernel_rows, run_compiled_python

ROOT = Path(__file__).resolve().parents[1]

# ptxas -v output in the shape nvcc -Xptxas -v prints it (names shortened); the fp32 kernel spills.
PTXAS_LOG = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_ZN3tpo4cuda18row_forward_kernelIfLi512ELb1EEEvPKT_' for 'sm_90'
ptxas info    : Function properties for _ZN3tpo4cuda18row_forward_kernelIfLi512ELb1EEEvPKT_
    24 bytes stack frame, 24 bytes spill stores, 20 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 192 bytes smem, 616 bytes cmem[0]
ptxas info    : Compile time = 12.000 ms
ptxas info    : Compiling entry function '_ZN3tpo4cuda19row_backward_kernelIdLi256EEEvPKT_' for 'sm_90'
ptxas info    : Function properties for _ZN3tpo4cuda19row_backward_kernelIdLi256EEEvPKT_
    8 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads
ptxas info    : Used 48 registers, used 0 barriers, 616 bytes cmem[0]
ptxas info    : Compiling entry function '_ZN3tpo4cuda19row_backward_kernelIfLi256EEEvPKT_' for 'sm_90'
ptxas info    : Function properties for _ZN3tpo4cuda19row_backward_kernelIfLi256EEEvPKT_
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 32 registers, used 0 barriers, 616 bytes cmem[0]
"""

# cuobjdump --dump-resource-usage of an object with two ELFs
RESOURCE_USAGE = """\

Fatbin elf code:
================
arch = sm_80
code version = [1,7]

Resource usage:
 Common:
  GLOBAL:0
 Function _ZN3tpo4cuda18row_forward_kernelIfLi512ELb1EEEvPKT_:
  REG:40 STACK:0 SHARED:192 LOCAL:0 CONSTANT[0]:616 TEXTURE:0 SURFACE:0 SAMPLER:0

Fatbin elf code:
================
arch = sm_90
code version = [1,8]

Resource usage:
 Common:
  GLOBAL:0
 Function _ZN3tpo4cuda18row_forward_kernelIfLi512ELb1EEEvPKT_:
  REG:255 STACK:24 SHARED:1216 LOCAL:0 CONSTANT[0]:616 TEXTURE:0 SURFACE:0 SAMPLER:0
 Function _ZN3tpo4cuda19row_backward_kernelIdLi256EEEvPKT_:
  REG:48 STACK:8 SHARED:0 LOCAL:0 CONSTANT[0]:616 TEXTURE:0 SURFACE:0 SAMPLER:0
 Function _ZN3tpo4cuda19row_backward_kernelIfLi256EEEvPKT_:
  REG:32 STACK:0 SHARED:0 LOCAL:0 CONSTANT[0]:616 TEXTURE:0 SURFACE:0 SAMPLER:0
"""

# cuobjdump -sass of the same (instructions abridged)
SASS = """\

Fatbin elf code:
================
arch = sm_90

\tcode for sm_90
\t\tFunction : _ZN3tpo4cuda18row_forward_kernelIfLi512ELb1EEEvPKT_
        /*0000*/                   LDC R1, c[0x0][0x28] ;                                    /* 0x00000a00ff017b82 */
                                                                                             /* 0x000fe20000000800 */
        /*0010*/               @P0 LDG.E.128.CONSTANT R4, desc[UR4][R2.64] ;                 /* 0x0000000402047981 */
        /*0020*/                   LDG.E.128 R8, desc[UR4][R2.64+0x10] ;                     /* 0x0000100402087981 */
        /*0030*/                   LDG.E.U16 R12, desc[UR4][R6.64] ;                         /* 0x000000040606c981 */
        /*0040*/                   STL [R1], R4 ;                                            /* 0x0000000401007387 */
        /*0050*/                   LDL.LU R4, [R1] ;                                         /* 0x0000000001047983 */
        /*0060*/                   STG.E desc[UR4][R6.64], R4 ;                              /* 0x0000000406007986 */
\t\t..........

\t\tFunction : _ZN3tpo4cuda19row_backward_kernelIfLi256EEEvPKT_
        /*0000*/                   LDG.E.64 R2, desc[UR4][R2.64] ;                           /* 0x0000000402027981 */
        /*0010*/                   STG.E.128 desc[UR4][R6.64], R8 ;                          /* 0x0000000806007986 */
"""


def _rows():
    usage = KR.parse_resource_usage(RESOURCE_USAGE)
    sass = KR.parse_sass(SASS)
    return KR._cuda_rows(usage, sass, KR.parse_ptxas_log(PTXAS_LOG), ["90"], "synthetic")


def test_parsers():
    log = KR.parse_ptxas_log(PTXAS_LOG)
    fwd = log[("sm_90", "_ZN3tpo4cuda18row_forward_kernelIfLi512ELb1EEEvPKT_")]
    assert fwd == {"regs": 255, "stack": 24, "spill_stores": 24, "spill_loads": 20, "smem": 192}
    usage = KR.parse_resource_usage(RESOURCE_USAGE)
    assert usage[("sm_80", "_ZN3tpo4cuda18row_forward_kernelIfLi512ELb1EEEvPKT_")]["regs"] == 40
    assert usage[("sm_90", "_ZN3tpo4cuda18row_forward_kernelIfLi512ELb1EEEvPKT_")] == {
        "regs": 255, "stack": 24, "shared": 1216, "local": 0}
    assert len(usage) == 4
    sass = KR.parse_sass(SASS)
    fwd_sass = sass[("sm_90", "_ZN3tpo4cuda18row_forward_kernelIfLi512ELb1EEEvPKT_")]
    assert fwd_sass == {"loads": {128: 2, 16: 1}, "stores": {32: 1}, "local_insts": 2, "pack_loops": []}
    bwd_sass = sass[("sm_90", "_ZN3tpo4cuda19row_backward_kernelIfLi256EEEvPKT_")]
    assert bwd_sass == {"loads": {64: 1}, "stores": {128: 1}, "local_insts": 0, "pack_loops": []}
    # a lone cubin has no arch header: the caller names it
    lone = KR.parse_resource_usage(" Function k:\n  REG:12 STACK:0 SHARED:0 LOCAL:0\n", default_arch="sm_80")
    assert lone == {("sm_80", "k"): {"regs": 12, "stack": 0, "shared": 0, "local": 0}}


# Loops in SASS (addresses in hex, as cuobjdump prints them): a Triton row forward whose loop
# holds two 128-bit loads, 12 instructions, 2 of them in a region a forward branch skips; a CUDA
# row backward with two such loops, one taking a max (the entropy variant).
LOOP_SASS = """\
\t\tFunction : _row_forward_kernel
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0020*/                   LDG.E.128 R8, desc[UR4][R2.64+0x1000] ;
        /*0030*/                   FMNMX R12, R4, R5, !PT ;
        /*0040*/               @P0 BRA 0x70 ;
        /*0050*/                   MUFU.EX2 R13, R12 ;
        /*0060*/                   FMUL R0, R0, R13 ;
        /*0070*/                   FADD R12, R4, -R12 ;
        /*0080*/                   MUFU.EX2 R12, R12 ;
        /*0090*/                   FADD R0, R0, R12 ;
        /*00a0*/                   IADD3 R2, P1, R2, 0x2000, RZ ;
        /*00b0*/                   ISETP.GE.AND P2, PT, R2, R3, PT ;
        /*00c0*/              @!P2 BRA 0x10 ;
        /*00d0*/                   EXIT ;
\t\tFunction : _ZN3tpo4cuda19row_backward_kernelIfLi512EEEvPKT_
        /*0000*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0010*/                   MUFU.EX2 R5, R4 ;
        /*0020*/                   STG.E.128 desc[UR4][R6.64], R4 ;
        /*0030*/              @!P2 BRA 0x0 ;
        /*0040*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0050*/                   FMNMX R5, R4, -3.0e38, !PT ;
        /*0060*/                   MUFU.EX2 R5, R4 ;
        /*0070*/                   FMUL R5, R5, R4 ;
        /*0080*/                   STG.E.128 desc[UR4][R6.64], R4 ;
        /*0090*/              @!P2 BRA 0x40 ;
"""


def test_loop_instructions_per_element_of_the_row_kernels():
    """The ``insts/elem`` column: a row kernel's main loop's common-path instructions (without the
    region a forward branch skips) per element of its 128-bit loads (4 fp32, 8 bf16 per load);
    the CUDA backward shows its two loops, without/with the max of the entropy term."""
    sass = KR.parse_sass(LOOP_SASS, default_arch="sm_90")
    fwd_loops = sass[("sm_90", "_row_forward_kernel")]["pack_loops"]
    assert fwd_loops == [{"insts": 12, "packs": 2, "skipped": [2], "has_max": True}]
    fwd = KR.KernelRow(source="triton", kernel="_row_forward_kernel", arch="sm_90", dtype="bf16", spec="", regs=40,
                       pack_loops=fwd_loops)
    assert fwd.loop_insts_per_element == [(12 - 2) / (2 * 8)]
    bwd_symbol = "_ZN3tpo4cuda19row_backward_kernelIfLi512EEEvPKT_"
    bwd = KR._cuda_rows({("sm_90", bwd_symbol): {"regs": 64, "stack": 0, "shared": 0, "local": 0}}, sass, {}, ["90"],
                        "synthetic")[0]
    assert (bwd.kernel, bwd.dtype) == ("row_backward_kernel", "fp32")
    assert bwd.loop_insts_per_element == [4 / 4, 6 / 4]
    table = KR.format_table([fwd, bwd])
    assert "insts/elem" in table.splitlines()[0] and "0.62" in table and "1.00/1.50" in table
    other = KR.KernelRow(source="triton", kernel="_group_targets_kernel", arch="sm_90", dtype="fp32", spec="",
                         regs=40, pack_loops=fwd_loops)
    assert other.loop_insts_per_element == [] and KR.KernelRow.from_json(json.loads(json.dumps(fwd.to_json()))) == fwd


def test_ops_select_the_kernels_reported(monkeypatch, capsys):
    """``--ops row``: the Triton workers compile the row ops' calls only, and the CUDA part keeps
    the row kernels; an unknown op is refused."""
    from bench.kernel_report import table

    assert {s.op for s in KR.triton_scenarios(vocabs=(50257,), dtypes=("bf16",))} == set(KR.OPS)
    assert [KR.op_of_kernel(k) for k in ("_row_backward_kernel", "row_forward_kernel", "_weight_grad_run_kernel",
                                         "candidate_forward_kernel", "_group_targets_kernel")] == \
        ["row", "row", "candidate", "candidate", "group"]
    seen = {}

    def triton_workers(archs, args, progress=None):
        seen["ops"] = args.ops
        return []

    def cuda_part(archs, *, from_source, jobs, progress=None):
        return [KR.KernelRow(source="cuda", kernel=name, arch="sm_90", dtype="fp32", spec="", regs=32)
                for name in ("row_forward_kernel", "candidate_forward_kernel", "group_targets_kernel")], []

    monkeypatch.setattr(table, "run_triton_workers", triton_workers)
    monkeypatch.setattr(table, "collect_cuda", cuda_part)
    assert KR.main(["--arch", "90", "--ops", "row"]) == 0
    out = capsys.readouterr().out
    assert seen["ops"] == ["row"] and "row_forward_kernel" in out and "candidate_forward_kernel" not in out
    assert KR.main(["--ops", "rows"]) == 2
    assert "unknown op(s) ['rows']" in capsys.readouterr().err


def test_cuda_names():
    demangled = ("void tpo::cuda::(anonymous namespace)::row_forward_kernel<tpo::bf16_t, 512, true>("
                 "tpo::bf16_t const*, long, long)")
    assert KR.cuda_label(demangled, "") == ("row_forward_kernel", "bf16", "<512, true>")
    assert KR.cuda_label("void k<double>(double const*)", "")[:2] == ("k", "fp64")
    assert KR.cuda_label("void k<tpo::half_t>(tpo::half_t*)", "")[:2] == ("k", "fp16")
    # no demangler: the mangled name still gives the kernel and its element type
    assert KR.cuda_label("_ZN3tpo4cuda19row_backward_kernelIdLi256EEEvPKT_", "_ZN3tpo4cuda19row_backward_kernelIdLi256EEEvPKT_")[:2] \
        == ("row_backward_kernel", "fp64")
    assert KR.cuda_label("x", "_ZN3tpo4cuda18row_forward_kernelINS_6bf16_tELi512ELb1EEEvPKT_")[:2] == ("row_forward_kernel", "bf16")


def test_a_spill_in_an_fp32_kernel_fails_and_fp64_is_only_reported():
    rows = _rows()
    by_dtype = {(r.kernel, r.dtype): r for r in rows}
    fwd = by_dtype[("row_forward_kernel", "fp32")]
    assert fwd.spill_stores == 24 and fwd.spilled and fwd.fails and fwd.loads == {128: 2, 16: 1}
    fp64 = by_dtype[("row_backward_kernel", "fp64")]
    assert fp64.spilled and not fp64.fails
    clean = by_dtype[("row_backward_kernel", "fp32")]
    assert not clean.spilled and not clean.fails
    status, text = KR.verdict(rows)
    assert status == 1 and "SPILLS in fp32/bf16/fp16 kernels" in text and "row_forward_kernel sm_90 fp32" in text
    assert KR.verdict([fp64, clean])[0] == 0
    # without ptxas numbers, local memory seen by cuobjdump (or LDL/STL in the SASS) is a spill
    no_log = KR._cuda_rows(KR.parse_resource_usage(RESOURCE_USAGE), {}, {}, ["90"], "so")
    assert {r.kernel + r.dtype for r in no_log if r.fails} == {"row_forward_kernelfp32"}
    table = KR.format_table(rows)
    assert "st 24B ld 20B 2 LDL/STL" in table and "(fp64)" in table and "128x2 16x1" in table
    assert KR.KernelRow.from_json(json.loads(json.dumps(fwd.to_json()))) == fwd


def _gpu_machine_triton():
    pins = (ROOT / "bench" / "gpu_machine_versions.txt").read_text().splitlines()
    return next(line.split("==")[1] for line in pins if line.startswith("triton=="))


def test_known_triton_local_memory_is_allowed_under_its_release_only():
    """Local memory recorded for one Triton release (the GPU machine's 3.6) passes under that
    release up to the recorded bytes and LDL/STL count; under any other release (3.9, which CI
    uses), or with more of it, or in a kernel not recorded, it fails as any spill does."""
    releases = {key[0] for key in KR.KNOWN_TRITON_LOCAL_MEMORY}
    gpu_machine = ".".join(_gpu_machine_triton().split(".")[:2])
    assert releases <= {gpu_machine} and "3.9" not in releases
    (release, kernel, arch, dtype, spec), (nbytes, insts) = next(iter(KR.KNOWN_TRITON_LOCAL_MEMORY.items()))

    def row(triton_version, stack=nbytes, local_insts=insts, name=kernel):
        r = KR.KernelRow(source="triton", kernel=name, arch=arch, dtype=dtype, spec=spec, regs=32, stack=stack,
                         local_insts=local_insts, used_by=["test"])
        r.mark_known(triton_version)
        return r

    known = row(release + ".0")
    assert known.spilled and known.known == f"Triton {release}" and not known.fails
    status, text = KR.verdict([known])
    assert status == 0 and "Known local memory" in text and kernel in text and "beyond the known local memory" in text
    assert f"(known, Triton {release})" in KR.format_table([known])
    for failing in (row("3.9.0"), row(release + ".1", stack=nbytes + 4), row(release + ".0", local_insts=insts + 1),
                    row(release + ".0", name="_other_kernel")):
        assert failing.fails and not failing.known and KR.verdict([failing])[0] == 1
    assert not row(release + ".0", stack=0, local_insts=0).known  # nothing to excuse: an ordinary clean row
    assert KR.KernelRow.from_json(json.loads(json.dumps(known.to_json()))) == known


def test_missing_cuobjdump_is_an_error(monkeypatch, tmp_path, capsys):
    missing = str(tmp_path / "no-cuobjdump")
    monkeypatch.setenv("CUOBJDUMP", missing)
    with pytest.raises(KR.ReportError, match="not an executable file"):
        KR.find_cuobjdump(KR.load_toolkit())
    assert KR.main(["--cuda-only", "--arch", "90"]) == 2
    assert f"CUOBJDUMP={missing} is not an executable file" in capsys.readouterr().err


def _slow_parts(monkeypatch, seconds):
    """Stand-ins for the Triton workers and the CUDA part that take ``seconds`` and report what they do."""
    from bench.kernel_report import table

    def triton_workers(archs, args, progress=None):
        progress("compiling for sm_90 (1 worker process(es) running)")
        time.sleep(seconds)
        return []

    def cuda_part(archs, *, from_source, jobs, progress=None):
        progress("nvcc: 0 of 2 compiles done, 2 running")
        time.sleep(seconds)
        return [], []

    monkeypatch.setattr(table, "run_triton_workers", triton_workers)
    monkeypatch.setattr(table, "collect_cuda", cuda_part)


def test_progress_lines_while_the_kernels_compile(monkeypatch, capsys):
    """While the parts work, a line on stderr every --progress-every seconds says what is running
    (the report was silent for 219 s before printing anything)."""
    _slow_parts(monkeypatch, seconds=1.0)
    assert KR.main(["--arch", "90", "--progress-every", "0.1"]) == 0
    captured = capsys.readouterr()
    beats = [line for line in captured.err.splitlines() if line.startswith("kernel_report: [")]
    assert len(beats) >= 4, captured.err
    assert any("Triton: compiling for sm_90" in line and "CUDA: nvcc: 0 of 2 compiles done" in line for line in beats)
    assert "kernel_report: [" not in captured.out  # the table on stdout stays clean


def test_progress_every_default_is_under_twenty_seconds_and_must_be_positive(capsys):
    assert 0 < KR.PROGRESS_EVERY_S <= 20 and KR.build_parser().parse_args([]).progress_every == KR.PROGRESS_EVERY_S
    assert KR.main(["--progress-every", "0"]) == 2
    assert capsys.readouterr().err.strip() == "kernel_report: --progress-every must be a positive number of seconds, got 0.0"


def _nvcc():
    toolkit = KR.load_toolkit()
    return toolkit.find_nvcc() if toolkit else None


SPILLING_CU = textwrap.dedent("""\
    __global__ void __launch_bounds__(1024, 2) spilly(const float* __restrict__ x, float* y, int n) {
      float acc[64];
    #pragma unroll
      for (int i = 0; i < 64; ++i) acc[i] = x[threadIdx.x + i * n];
    #pragma unroll
      for (int j = 0; j < 8; ++j) {
    #pragma unroll
        for (int i = 0; i < 64; ++i) acc[i] = acc[i] * acc[(i + j) & 63] + 1.0f;
      }
      float s = 0;
    #pragma unroll
      for (int i = 0; i < 64; ++i) s += acc[i];
      y[threadIdx.x] = s;
    }
    """)


@pytest.mark.skipif(_nvcc() is None, reason="nvcc not found")
def test_a_real_cuda_spill_is_found(tmp_path):
    """nvcc -Xptxas -v and cuobjdump on a kernel squeezed into 32 registers: both see the spill."""
    src = tmp_path / "spilly.cu"
    src.write_text(SPILLING_CU)
    obj = tmp_path / "spilly.o"
    proc = subprocess.run([_nvcc(), "-c", str(src), "-o", str(obj), "-gencode=arch=compute_80,code=sm_80", "-Xptxas", "-v"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    usage, sass = KR.inspect_binary(KR.find_cuobjdump(KR.load_toolkit()), str(obj))
    rows = KR._cuda_rows(usage, sass, KR.parse_ptxas_log(proc.stdout + proc.stderr), ["80"], "test")
    assert len(rows) == 1
    row = rows[0]
    assert row.kernel == "spilly" and row.regs <= 32
    assert row.spill_stores > 0 and row.stack > 0 and row.local_insts > 0 and row.fails
    assert KR.verdict(rows)[0] == 1


TRITON_SCRIPT = textwrap.dedent("""\
    import json, os, sys
    os.environ["TRITON_INTERPRET"] = "0"
    sys.path.insert(0, sys.argv[2])
    import torch
    from bench import kernel_report as KR
    import spill_kernel

    def spill(backend):
        x = torch.zeros(8192)
        spill_kernel.spilly[(1,)](x, x.clone(), BLOCK=8192, num_warps=1)

    scenarios = [s for s in KR.triton_scenarios(vocabs=(151936, 50257), dtypes=("bf16",))
                 if s.label.startswith("row fwd+bwd") and "entropy" not in s.label]
    scenarios.append(KR.Scenario("deliberate spill", "fp32", spill))
    rows = KR.collect_triton(90, scenarios)
    with open(sys.argv[1], "w") as f:
        json.dump([r.to_json() for r in rows], f)
    """)

SPILL_KERNEL = textwrap.dedent("""\
    import triton
    import triton.language as tl


    @triton.jit
    def spilly(x_ptr, y_ptr, BLOCK: tl.constexpr):  # 8192 fp32 values x 2 in one warp: 512 per thread
        i = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + i)
        y = tl.load(y_ptr + i)
        s = tl.sum(x * y, axis=0)
        tl.store(y_ptr + i, x * s + y)
        tl.store(x_ptr + i, y * s + x)
    """)


@pytest.mark.skipif(KR.triton_tool("ptxas") is None, reason="Triton's NVIDIA compiler (ptxas) is absent")
def test_triton_launches_compiled_as_specialized_and_a_spill_found(tmp_path):
    """The report's launch capture on the real row launchers (sm_90, bf16) and on a kernel built to
    spill: specializations as the launcher chose them, aligned rows read with 128-bit loads, and
    the spill detected."""
    (tmp_path / "spill_kernel.py").write_text(SPILL_KERNEL)
    (tmp_path / "run.py").write_text(TRITON_SCRIPT)
    out = tmp_path / "rows.json"
    run_compiled_python(tmp_path / "run.py", out, tmp_path)
    rows = [KR.KernelRow.from_json(d) for d in json.loads(out.read_text())]
    by = {(r.kernel, r.used_by[0]): r for r in rows}
    fwd = by[("_row_forward_kernel", "row fwd+bwd V=151936")]
    bwd = by[("_row_backward_kernel", "row fwd+bwd V=151936")]
    for row in (fwd, bwd):
        assert row.arch.startswith("sm_90") and row.dtype == "bf16" and row.regs > 0
        assert "BLOCK_V=" in row.spec and "warps=" in row.spec and "not%16" not in row.spec
        assert max(row.loads) == 128, row.loads  # a 151936-wide bf16 row is 16-byte aligned
    unaligned = by[("_row_forward_kernel", "row fwd+bwd V=50257")]
    assert "not%16:" in unaligned.spec and "vocab" in unaligned.spec  # what the launcher passed
    # A view starting off a 16-byte boundary (logits[:, 1:], odd V) is compiled too, and still
    # reads (and writes) 128 bits at a time without spilling: the kernels get an aligned base.
    for kernel in ("_row_forward_kernel", "_row_backward_kernel"):
        row = by[(kernel, "row fwd+bwd V=50257 unaligned start")]
        assert max(row.loads) == 128 and not row.spilled, (row.loads, row.stack, row.local)
    assert max(by[("_row_backward_kernel", "row fwd+bwd V=50257 unaligned start")].stores) == 128
    spill = by[("spilly", "deliberate spill")]
    assert spill.spilled and spill.fails and spill.local_insts > 0 and spill.spec.startswith("BLOCK=8192 warps=1")
    status, text = KR.verdict(rows)
    assert status == 1 and "spilly" in text


def test_ci_runs_the_kernel_report_before_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    commands = [line.strip() for line in ci if line.strip() and not line.strip().startswith("#")]
    report = [i for i, c in enumerate(commands) if "bench.kernel_report" in c]
    assert report, "CI does not run the kernel report"
    assert commands[-1] == "python3 -m pytest -q tests"
    assert max(report) < len(commands) - 1


ROW_LOOPS_SCRIPT = textwrap.dedent("""\
    import json, os, sys
    os.environ["TRITON_INTERPRET"] = "0"
    from bench import kernel_report as KR

    scenarios = [s for s in KR.triton_scenarios(vocabs=(151936,), dtypes=("fp32", "bf16"))
                 if s.op == "row" and "unaligned" not in s.label]
    rows = KR.collect_triton(90, scenarios)
    with open(sys.argv[1], "w") as f:
        json.dump([r.to_json() for r in rows], f)
    """)


def _built_cuda_with_sm90():
    if KR.triton_tool("ptxas") is None:
        return None
    try:
        cuobjdump = KR.find_cuobjdump(KR.load_toolkit())
    except KR.ReportError:
        return None
    return next((so for so in KR.built_cuda_extensions() if "90" in KR.elf_archs(cuobjdump, so)), None)


@pytest.mark.skipif(_built_cuda_with_sm90() is None, reason="needs Triton's ptxas and a built CUDA extension for sm_90")
def test_triton_row_loops_issue_within_1_3x_of_the_cuda_kernels_per_element(tmp_path):
    """The Triton row kernels' main loops (sm_90, fp32 and bf16, with and without the entropy)
    issue at most 1.3x the CUDA kernels' instructions per element (their common paths): the
    Triton backend, which ``auto`` picks without nvcc, then stays bound by memory where the CUDA
    kernels are (before: about 1.9x in the forward, 183 instructions per 16 bf16 elements)."""
    from bench.kernel_report.loops import binary_loops
    from bench.kernel_report.parse import ROW_KERNELS

    rows = compiled_kernel_rows(ROW_LOOPS_SCRIPT, tmp_path / "rows.json")
    cuda = {(l.kernel, l.dtype, l.variant): l.common_per_element for l in binary_loops(_built_cuda_with_sm90(), "90")}
    compared = set()
    for row in rows:
        variant = "entropy" if "ENTROPY=1" in row.spec or "ENTROPY_GRAD=1" in row.spec else "plain"
        key = (row.kernel.lstrip("_"), row.dtype, variant)
        (per_element,) = row.loop_insts_per_element
        assert per_element <= 1.3 * cuda[key], (key, per_element, cuda[key])
        assert not row.spilled, key
        compared.add(key)
    assert compared == {(k, d, v) for k in ROW_KERNELS for d in ("fp32", "bf16") for v in ("plain", "entropy")}
