"""Tracking: MLflow runs, their journal when the store is away, studies, plots, terminal output.

- :mod:`~pfl_core.tracking.tracker`: ``MlflowTracker`` / ``NullTracker``, tags, flattened params;
- :mod:`~pfl_core.tracking.study`: one ``pfl-run`` invocation and its parent run;
- :mod:`~pfl_core.tracking.journal`: calls the store missed, kept on disk and replayed (``pfl replay``);
- :mod:`~pfl_core.tracking.store_check`: is the store usable, before any training;
- :mod:`~pfl_core.tracking.terminal`: progress bar, status lines, human units, run locations;
- :mod:`~pfl_core.tracking.plots`: the figures logged as artifacts;
- :mod:`~pfl_core.tracking.tables`: CSV text of result tables.
"""
