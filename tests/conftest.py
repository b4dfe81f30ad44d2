from pathlib import Path

import pytest

SHARED_DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"


@pytest.fixture
def shared_data() -> Path:
    """The offline real-data folder (../shared/data from the repo root), or skip."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real datasets folder {SHARED_DATA} is absent (only on the project's machines)")
    return SHARED_DATA
