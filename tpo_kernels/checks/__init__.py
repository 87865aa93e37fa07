"""Every input check of the public API, one copy each: :mod:`.arguments` (one argument each, and a
call's settings in one pass), :mod:`.batches` (a batch as flat rows and a layout) and
:mod:`.placement` (where the data lives across ranks; entered only by a distributed call). The
check pass of a call, which runs them in call order and gives its frozen plan, is
:mod:`tpo_kernels.plan.call`.

Checks run in Python before any kernel launch and raise ``ValueError`` / ``TypeError`` naming
the argument. Checks of metadata (types, shapes, dtypes, devices, hyper-parameters) are free;
checks of values (label ranges, finite scores, empty completions, cu_seqlens order) read a
result back from the device, so ``validate=False`` skips them (for compiled and CUDA-graph use,
where a host round trip is not allowed). With ``validate=False`` bad values give wrong results,
never out-of-bounds memory access: the native backends re-check ids at their pointer boundary.
"""
