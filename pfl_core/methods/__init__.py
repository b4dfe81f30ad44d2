"""Machinery several methods share, for plugins to build on (through :mod:`pfl_core.api`):

- :mod:`~pfl_core.methods.averaging`: ``WeightAveraging`` (FedAvg's hooks), one-architecture checks;
- :mod:`~pfl_core.methods.proximal`: the proximal term and ``AnchoredAveraging`` (FedProx, Ditto, pFedMe);
- :mod:`~pfl_core.methods.partial`: ``PartialModel``, shared and personal keys, layer splits;
- :mod:`~pfl_core.methods.codistill`: ``PublicPredictionMethod``, distillation on the public set;
- :mod:`~pfl_core.methods.embeddings`: the classifier's input and class prototypes;
- :mod:`~pfl_core.methods.personal`: a client's own model kept in its state;
- :mod:`~pfl_core.methods.expertise`: FedMosaic's expertise scores on the wire;
- :mod:`~pfl_core.methods.per_run`: values computed once per run on each side of a round.
"""
