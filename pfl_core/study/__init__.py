"""The study: what ``pfl-run SPEC`` runs. Sweep points x seeds, reference runs, the summaries
over seeds, the comparison tables and collaboration gains, the ``--out`` results folder, and
``--resume``. Each run is handed to the engine.

- :mod:`~pfl_core.study.points`: the points of a spec, their names and reference runs (planning);
- :mod:`~pfl_core.study.seeds`: one point over its seeds, summaries and gains (running);
- :mod:`~pfl_core.study.report`: what is printed (tables, dry-run report, locations);
- :mod:`~pfl_core.study.results`: the ``--out`` folder;
- :mod:`~pfl_core.study.stats`: summaries over seeds and paired differences;
- :mod:`~pfl_core.study.run`: ``run_spec_file``, the whole of ``pfl-run SPEC``;
- :mod:`~pfl_core.study.resume`: ``resume_run``, the whole of ``pfl-run --resume RUN``;
- :mod:`~pfl_core.study.reuse`: the finished runs ``pfl-run SPEC --resume`` keeps.
"""

from pfl_core.study.resume import resume_run
from pfl_core.study.run import run_spec_file

__all__ = ["resume_run", "run_spec_file"]
