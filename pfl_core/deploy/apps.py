"""The objects a Flower app's ``[tool.flwr.app.components]`` name (docs/deployment.md):
``serverapp = "pfl_core.deploy.apps:server_app"``, ``clientapp = "pfl_core.deploy.apps:client_app"``.
Flower checks that they are assigned at this module's top level; importing it builds both, so
it needs the ``flower`` extra (without it: one line naming the extra)."""

from pfl_core.deploy.flower import make_client_app, make_server_app

server_app = make_server_app()
client_app = make_client_app()
