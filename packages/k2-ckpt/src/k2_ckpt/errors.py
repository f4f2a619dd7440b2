"""Errors raised by the parameter server and the receiver, each naming what went wrong where."""

from __future__ import annotations

from dataclasses import dataclass


class CkptError(Exception):
    """Base class; `status` is the HTTP status the API maps it to."""

    status = 500


class CheckpointNotFound(CkptError, KeyError):
    status = 404

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "checkpoint not found"


class CheckpointExists(CkptError):
    status = 409


class FileMissing(CkptError, FileNotFoundError):
    status = 404


class BadCheckpoint(CkptError, ValueError):
    """A file that is not valid safetensors, duplicate names, unsupported dtypes."""

    status = 422


class TensorMismatch(CkptError, ValueError):
    """The receiver has no such tensor, or its dtype/shape differ from what was sent."""

    status = 409


class UpdateAborted(CkptError):
    """Raised on the receiver when the server aborted the update (old weights kept in staged mode)."""

    status = 409


@dataclass
class RankFailure:
    """One rank's failure during an update, as gathered from every rank."""

    rank: int
    # "worker_error" | "mismatch" | "worker_died" | "timeout" | "req_func" | "server_error", and the
    # same prefixed "commit_" when it happened while the receiver applied its staged tensors
    kind: str
    message: str
    bucket: int | None = None
    tensor: str | None = None
    traceback: str | None = None


class UpdateError(CkptError):
    """`ParameterServer.update` failed; `failures` says which rank, tensor and why.

    Raised identically on every rank. `applied[rank]` lists what that rank's receiver loaded
    in direct mode, and is None when it could not say (it died or hung, or its commit failed
    part-way). Ranks whose receivers applied nothing are absent. In staged mode (the default)
    nothing is applied before the commit; a failure during the commit (kind `commit_*`) leaves
    the receivers that had committed with the new set, complete (they are not listed here).
    """

    def __init__(
        self, checkpoint: str, failures: list[RankFailure], applied: dict[int, list[str] | None] | None = None
    ):
        self.checkpoint = checkpoint
        self.failures = failures
        # rank -> tensors its receiver had loaded before the abort, None = unknown
        self.applied = applied or {}
        head = failures[0]
        where = f"rank {head.rank}" + (f", bucket {head.bucket}" if head.bucket is not None else "")
        where += f", tensor {head.tensor!r}" if head.tensor else ""
        more = f" (+{len(failures) - 1} more)" if len(failures) > 1 else ""
        msg = f"update of checkpoint {checkpoint!r} failed on {where}: [{head.kind}] {head.message}{more}"
        if head.traceback:
            msg += "\n--- remote traceback ---\n" + head.traceback.rstrip()
        super().__init__(msg)

    @property
    def status(self) -> int:  # type: ignore[override]
        kinds = {f.kind.removeprefix("commit_") for f in self.failures}  # a commit failure keeps its cause
        if "mismatch" in kinds:
            return 409
        if kinds & {"timeout", "worker_died"}:
            return 504
        return 502
