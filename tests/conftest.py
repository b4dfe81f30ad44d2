from pathlib import Path

import pytest
import skip_policy

SHARED_DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"


@pytest.fixture
def shared_data() -> Path:
    """The offline real-data folder (../shared/data from the repo root), or skip."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real datasets folder {SHARED_DATA} is absent (only on the project's machines)")
    return SHARED_DATA


@pytest.fixture(autouse=True)
def own_template_stores(tmp_path_factory, monkeypatch):
    """Each test its own cache of MLflow template stores (tracking/store_check.py: template_store),
    empty at its start: a store's creation is MLflow's the first time, as it is on a fresh machine,
    whatever ran before (a test that breaks the creation must reach it)."""
    monkeypatch.setenv("PFL_CACHE_DIR", str(tmp_path_factory.mktemp("pfl-cache")))



@pytest.fixture(autouse=True)
def mlflows_default_store_after_each_test():
    """A tracked run sets MLflow's process-wide tracking URI (tracking/tracker.py); reset after
    each test, or the next test's default store (``./mlflow.db``) would be an earlier test's."""
    yield
    import sys

    if "mlflow" in sys.modules:  # never imported only for this: it is slow
        sys.modules["mlflow"].set_tracking_uri(None)

def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


#: For a single test: ``@requires_cuda``. Tests marked ``@pytest.mark.gpu`` get the same skip.
requires_cuda = pytest.mark.skipif(
    not cuda_available(),
    reason="needs a CUDA GPU (executor.device = 'cuda'): torch.cuda.is_available() is False here",
)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` skip, with the reason, where torch sees no CUDA device."""
    if cuda_available():
        return
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(requires_cuda)


def pytest_configure(config):
    skip_policy.install(config)  # a skip for a missing core dependency fails the run
