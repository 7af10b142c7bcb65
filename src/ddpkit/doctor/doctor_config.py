"""``ddpkit doctor``'s settings, one field per flag (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass

from ddpkit.runtime.options import ConfigError, option

__all__ = ["BACKENDS", "DoctorConfig"]

BACKENDS = ("gloo", "nccl", "mpi")


@dataclass
class DoctorConfig:
    """What ``ddpkit doctor`` checks."""

    nproc_per_node: int | None = option(
        None, "ranks of the self-test (default: one per GPU, else 2)", metavar="N"
    )
    backends: tuple[str, ...] | None = option(
        None, f"backends to self-test, among {', '.join(BACKENDS)} (default: every one available here); one asked "
        "for and not available fails", metavar="NAME",
    )
    selftest: bool = option(True, "start ranks and test every backend and device", negate="--no-selftest",
                            negate_only=True)
    json: bool = option(False, "print the report as one JSON document instead of text")
    timeout: float = option(30.0, "seconds a self-test's ranks may take to meet and for each collective",
                            metavar="SECONDS")

    def __post_init__(self) -> None:
        if self.nproc_per_node is not None and self.nproc_per_node < 1:
            raise ConfigError(f"--nproc-per-node {self.nproc_per_node} must be at least 1")
        if self.backends is not None:
            self.backends = tuple(self.backends)
            unknown = [b for b in self.backends if b not in BACKENDS]
            if unknown or not self.backends:
                raise ConfigError(f"--backends {' '.join(self.backends)}: choose among {', '.join(BACKENDS)}")
        if not self.timeout > 0:
            raise ConfigError(f"--timeout {self.timeout} must be a positive number of seconds")
        for flag, value, given in (("--backends", " ".join(self.backends or ()), self.backends is not None),
                                   ("--nproc-per-node", self.nproc_per_node, self.nproc_per_node is not None),
                                   ("--timeout", f"{self.timeout:g}", self.timeout != 30.0)):
            if given and not self.selftest:
                raise ConfigError(f"{flag} {value} sets the self-test, and --no-selftest turns it off: drop one of "
                                  "them")
