"""Deployment: a spec run on real clients instead of the simulated ones.

- :mod:`~pfl_core.deploy.flower`: a Flower app (a ServerApp running pfl's server side, a ClientApp
  running its client side on the node's own data), for ``flwr run`` and Flower's deployment
  runtime; needs the ``flower`` extra (``pip install -e '.[flower]'``), imported only when used;
- :mod:`~pfl_core.deploy.node`: the ClientApp's side, with the node's own store (client states,
  the run and its data on disk);
- :mod:`~pfl_core.deploy.records`: pfl's messages as Flower records (tensors in an ``ArrayRecord``);
- :mod:`~pfl_core.deploy.local`: a local SuperLink and N SuperNodes (insecure, one machine) and
  ``flwr run`` on them, for trying an app and for the tests.
"""
