"""The study: what ``pfl-run SPEC`` runs. Sweep points x seeds, reference runs, the summaries
over seeds, the comparison tables and collaboration gains, the ``--out`` results folder, and
``--resume``. Each run is handed to the engine.
"""
