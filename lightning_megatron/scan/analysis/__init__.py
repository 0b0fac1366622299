"""MegaScan's analysis of trace directories: torch-free, so that the TensorBoard plugin and machines that only
read traces start fast (``tests/test_scan_analysis_imports.py`` keeps it so).

* reading: ``format`` (the rank files), ``validate`` (a merged trace's invariants);
* measuring: ``measure`` (spans, steps, compute, transfers), ``waits`` (data, host and CPU waits),
  ``gpu_measure`` (GPU busy time and queue fields); statistics: ``compare``;
* detection: ``rules`` (the ordered rule pipeline and its ``DetectionContext``), the rules themselves
  (``compute_rules``, ``stage_rules``, ``wait_rules``, ``link_rules``, ``cpu_rules``), the attribution of compute
  suspects (``attribution``), their shared helpers (``rules_common``); ``detect`` runs the pipeline and holds the
  CLI; ``report``: the result;
* ``aggregate``: one clock-aligned timeline; ``plot``: a still picture of a step.
"""
