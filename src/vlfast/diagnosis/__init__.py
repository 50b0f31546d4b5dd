"""Is this machine on a slow path, where does the time go: facts, rules, measurement, reports.

- ``facts``: what the machine is (torch, CUDA, runtime cuDNN, device), each probe failing soft.
- ``rules``: the public reports of slow paths, as pure functions of those facts, each with its source.
- ``probe``: times each conv against its GEMM on the device, the measurement the verdict rests on.
- ``timing``: synchronised, budgeted timing that says how much to trust it.
- ``doctor``: facts + rules + probe -> one report with its verdict and the exact fix.
- ``profiler``: where a vision tower's time goes, per component, stock against patched.
- ``verification``: ``verify``, the numerical proof that the patch changes nothing on a given model.

The public entry points are ``vlfast.doctor``, ``vlfast.profile`` and ``vlfast.verify``; this package exports nothing of its
own, so that no submodule (``doctor``) is ever mistaken for the function of the same name.
"""
