"""Is this machine on a slow path, where does the time go: facts, rules, measurement, reports. The entry
points are ``vlfast.doctor``, ``vlfast.profile`` and ``vlfast.verify``; this package exports nothing of its
own, so that no submodule (``doctor``) is ever mistaken for the function of the same name."""
