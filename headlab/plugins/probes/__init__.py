"""Built-in per-head probes: the ``probe`` detector (ITI's logistic probes, SAVs' nearest class means) and the
``sav`` action that classifies examples by a vote of a probe step's heads (docs/probes.md)."""
