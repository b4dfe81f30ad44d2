"""pfl's version, and the installed versions of the packages that decide a run's numbers (a
leaf module: anything may import it)."""

from __future__ import annotations

__version__ = "0.2.0"

# The packages whose version can change a run's numbers: torch and numpy compute them, mlflow
# stores them; optuna proposes a tuned study's hyperparameters (its samplers change between
# releases). Recorded on every run as tags ``pfl.versions.<name>``.
RESULT_PACKAGES = ("torch", "numpy", "mlflow")
TUNING_PACKAGES = ("optuna",)
VERSION_TAG_PREFIX = "pfl.versions."


def installed_version(name: str) -> str | None:
    """The installed distribution's version, read from its metadata (nothing imported); None
    when it is not installed."""
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def version_tags(names=RESULT_PACKAGES) -> dict[str, str]:
    """``{"pfl.versions.torch": "2.14.1", ...}`` for each of ``names`` ("not installed" if absent)."""
    return {f"{VERSION_TAG_PREFIX}{name}": installed_version(name) or "not installed" for name in names}


CPU_CAPABILITY_TAG = "pfl.machine.cpu_capability"


def machine_tags() -> dict[str, str]:
    """The instruction set torch's CPU kernels use (``AVX512``, ``AVX2``, ...): the same code,
    seed and versions give other numbers under another one (float rounding differs, and grows
    over rounds), so a run's numbers reproduce exactly only where this tag matches."""
    import torch

    return {CPU_CAPABILITY_TAG: torch.backends.cpu.get_cpu_capability()}
