"""A run's state on disk: the client store (client states in memory or spilled), checkpoints
and their provenance, the safetensors state files both are made of, and where files sit
beside an MLflow store.

- :mod:`~pfl_core.state.stateio`: nested states as safetensors files, written atomically;
- :mod:`~pfl_core.state.store`: ``ClientStore``, every client's persistent state;
- :mod:`~pfl_core.state.checkpoint`: writing, finding, validating and restoring checkpoints;
- :mod:`~pfl_core.state.locations`: a SQLite store's file, its artifacts and checkpoint folders.
"""
