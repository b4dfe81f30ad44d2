"""``pfl-run --resume``: find the checkpoint (a folder, or an MLflow run's tag), check that the
spec and the code are the ones it was written with, and continue the run in the same MLflow run."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import attrs

from pfl_core.engine import Engine
from pfl_core.errors import PflError
from pfl_core.spec import load_toml, tomllib
from pfl_core.state import checkpoint, provenance
from pfl_core.state.checkpoint import CHECKPOINT_TAG, checkpoints
from pfl_core.state.locations import beside_store, plain_uri, sqlite_file
from pfl_core.study.points import PointResult, resolve_points
from pfl_core.study.report import print_point
from pfl_core.study.reuse import SUPERSEDED_TAG
from pfl_core.study.stats import summarize
from pfl_core.tracking.study import RESUME_TAG
from pfl_core.tracking.tracker import PARENT_TAG, STUDY_TAG, make_tracker


def resume_run(target: str, spec_path: str | None, overrides: list[str], *, tracking_uri: str | None = None,
               quiet: bool = False, out=None, clients: bool = False) -> list[PointResult]:
    """``pfl-run --resume TARGET [SPEC]``: continue one run from its latest good checkpoint (a
    checkpoint folder, a run's folder of them, or an MLflow run id whose ``pfl.checkpoint`` tag
    names it) in the same MLflow run. Refused (PflError) when the spec (SPEC and ``--set``, or
    the checkpoint's own spec with ``--set``) or the code differs from the checkpoint's."""


    out = out or sys.stdout
    if not Path(target).expanduser().exists():
        target = checkpoint_of_run(target, tracking_uri, spec_path)
    loaded = checkpoint.find(target)
    if loaded.skipped:
        print(f"note: {'; '.join(loaded.skipped)}; resuming from the previous good one, {loaded.path}",
              file=sys.stderr)
    saved = load_toml_text(loaded.state["spec"])
    raw = load_toml(spec_path) if spec_path else saved
    candidates = []
    for point in resolve_points(raw, overrides):
        candidates += [point.for_seed(s) for s in point.seeds] if point.seeds else [point.resolved]
    differences = [provenance.differing_keys(saved, c) for c in candidates]
    best = min(range(len(candidates)), key=lambda i: len(differences[i]))
    if differences[best]:
        keys = differences[best]
        raise PflError(f"--resume: the spec differs from the checkpoint's at {', '.join(keys[:8])}"
                       f"{f' and {len(keys) - 8} more keys' if len(keys) > 8 else ''}; resume with the spec "
                       f"the run started with (or leave SPEC out to use the checkpoint's)")
    resolved = candidates[best]
    was, now = loaded.state["code"], provenance.code_version(provenance.plugin_names(resolved.spec))
    if (was["pfl"], was["source_sha256"]) != (now["pfl"], now["source_sha256"]):
        commit = f" at git commit {was['git_commit'][:12]}" if was.get("git_commit") else ""
        what = (f"pfl {was['pfl']} against {now['pfl']}" if was["pfl"] != now["pfl"] else
                "the source of pfl_core or of the spec's plugins changed")
        raise PflError(f"--resume: the checkpoint was written by other code ({what}; it was written{commit}); "
                       f"resume with that code, or start the run again")
    spec = resolved.spec
    uri = tracking_uri or loaded.state.get("tracking_uri")
    tracker = make_tracker(spec.tracking, uri) if loaded.state.get("run_id") else make_tracker(
        attrs.evolve(spec.tracking, enabled=False))
    name = loaded.state.get("run_name") or spec.algorithm.name
    run = Engine(resolved, tracker=tracker, progress=not quiet, run_name=name).run(resume=loaded)
    result = PointResult(name, [spec.experiment.seed], [run], {k: summarize([v]) for k, v in run.final.items()},
                         run.run_id, spec.algorithm.name)
    print_point(result, out, clients)
    if run.run_id and uri:
        rest = rest_of_study(run.run_id, plain_uri(uri), name)
        if rest:
            print(f"note: {rest}", file=sys.stderr)
    return [result]


def rest_of_study(run_id: str, uri: str, name: str) -> str | None:
    """For a run of a study of several runs: the command that completes the rest of the study
    (``pfl-run SPEC --resume``, which keeps this run now that it finished, and those that did),
    as the study recorded it (:data:`~pfl_core.tracking.study.RESUME_TAG`); for a study logged
    before pfl recorded it, how to write it. None for a run on its own, or one of a study that
    another study already continued."""
    import mlflow

    try:
        tags = mlflow.MlflowClient(tracking_uri=uri).get_run(run_id).data.tags
    except Exception:  # noqa: BLE001 - the store went away after the run: nothing more to say
        return None
    if SUPERSEDED_TAG in tags or STUDY_TAG not in tags:
        return None
    where = f"run {name!r} is one run of study {tags[STUDY_TAG]}; complete the rest of the study with"
    command = tags.get(RESUME_TAG)
    if command:
        return f"{where}: {command} --tracking-uri {shlex.quote(uri)}"
    if PARENT_TAG in tags:
        return (f"{where} its spec: pfl-run SPEC --resume --tracking-uri {shlex.quote(uri)}, adding the --set and "
                f"--sweep options the study was started with")
    return None


def load_toml_text(text: str) -> dict:
    return tomllib.loads(text)


def checkpoint_of_run(run_id: str, tracking_uri: str | None, spec_path: str | None) -> str:
    """The checkpoint folder an MLflow run's ``pfl.checkpoint`` tag names."""
    import mlflow

    uri = tracking_uri
    if uri is None and spec_path:
        table = load_toml(spec_path).get("tracking")
        uri = (table.get("uri") if isinstance(table, dict) else None) or None
    uri = plain_uri(uri or mlflow.get_tracking_uri())
    db = sqlite_file(uri)
    if db is not None and not db.is_file():
        raise PflError(f"--resume: {run_id} is neither a checkpoint folder nor a run of an MLflow store here "
                       f"({uri} does not exist; give --tracking-uri, or the checkpoint folder)")
    try:
        run = mlflow.MlflowClient(tracking_uri=uri).get_run(run_id)
    except Exception:
        raise PflError(f"--resume: {run_id} is neither a checkpoint folder nor a run in the MLflow store {uri} "
                       f"(give --tracking-uri, or the checkpoint folder)") from None
    folder = run.data.tags.get(CHECKPOINT_TAG)
    if not folder:  # runs of pfl 0.1 tagged the folder after its first checkpoint: look where it goes
        default = beside_store(uri) / "checkpoints" / run_id
        if not checkpoints(default):
            raise PflError(f"--resume: MLflow run {run_id} has no checkpoint (no {CHECKPOINT_TAG} tag: it was run "
                           f"with checkpoint.enabled = false, or stopped before its first checkpoint)")
        folder = str(default)
    if not checkpoints(Path(folder)):
        raise PflError(f"--resume: MLflow run {run_id} stopped before its first checkpoint was complete "
                       f"({folder} holds none); start the run again")
    return folder
