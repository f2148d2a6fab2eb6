"""Benchmarks: scripts run from the repository root as ``python -m benchmarks.<script>`` (or
``python benchmarks/<script>.py``); what they share is in ``benchmarks.harness``.
``benchmarks/peers/`` holds runners for other virtual environments' pythons: standalone scripts,
not part of this package."""
