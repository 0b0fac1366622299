"""What MegaScan's detection is evaluated against: faults whose ground truth is known.

* ``inject``: ``SlowdownInjector`` and ``LinkDelayInjector`` (callbacks) stretch a rank's own spans or links;
* ``faults``: outside faults the detector did not build (a competing process on the GPU, host stalls, a slow
  loader);
* ``synthetic``: traces of a simulated dp × pp × tp job, in the rank files' format, for the CPU tests.
"""
