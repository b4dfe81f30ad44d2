"""What one run holds and what a client does in it: the run context and the read-only client
view, the model bank, local training, evaluation, aggregation arithmetic, and the client side
of a round (receive, train, upload), which every executor runs.

- :mod:`~pfl_core.runtime.context`: ``RunContext``, ``ClientView``, ``Client``, ``ModelBank``;
- :mod:`~pfl_core.runtime.training`: optimisers and the epoch loop;
- :mod:`~pfl_core.runtime.evaluation`: scoring clients' models;
- :mod:`~pfl_core.runtime.aggregate`: weighted averages of states;
- :mod:`~pfl_core.runtime.client`: ``run_client``, one participant's round.
"""
