"""``parambox pick``: probes, the prediction model, the ranking and its validation.

- :mod:`~parambox.studies.pick.model`: the maths (samples to target from a probe and a reference run,
  time per step, the scalability model for more workers, reasons);
- :mod:`~parambox.studies.pick.candidates`: the registry's strategies with their presets' options;
- :mod:`~parambox.studies.pick.runs`: probes and runs to the target (``parambox train`` subprocesses);
- :mod:`~parambox.studies.pick.study`: the whole pick, once per seed;
- :mod:`~parambox.studies.pick.validation`: candidates trained to the target against the predictions;
- :mod:`~parambox.studies.pick.scores`: Kendall's tau, the top pick's hit rate, prediction errors.
- :mod:`~parambox.studies.pick.budget`: ``--budget``, the probes' order and the partial results.
"""

from parambox.studies.pick.study import PickSettings, run_pick, run_pick_seeds

__all__ = ["PickSettings", "run_pick", "run_pick_seeds"]
