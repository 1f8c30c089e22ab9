"""Multi-host runs: the --distributed, --coordinator_address, --num_processes, --process_id and
--initialization_timeout flags, and init_distributed (jax.distributed.initialize from them, with
a coordinator that never answers reported in one line instead of an abort). Every process runs
the same command; only --process_id differs (or nothing on a Cloud TPU VM)."""

import socket
import time

import jax
from absl import flags

from launch.usage import UsageError

FLAGS = flags.FLAGS

flags.DEFINE_bool(
    "distributed",
    False,
    "Call jax.distributed.initialize() (auto-detects peers on Cloud TPU VMs); implied by the next three flags.",
)
flags.DEFINE_string("coordinator_address", None, "Multi-host: HOST:PORT of process 0's coordinator.")
flags.DEFINE_integer("num_processes", None, "Multi-host: number of processes (one per host).", lower_bound=1)
flags.DEFINE_integer(
    "process_id", None, "Multi-host: this process's index in [0, num_processes).", lower_bound=0
)
flags.DEFINE_integer(
    "initialization_timeout", 300, "Seconds to wait for the coordinator and every process.", lower_bound=1
)


def _parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--coordinator_address must be HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def _wait_for_coordinator(host: str, port: int, timeout: float) -> None:
    """Polls the coordinator's port until it accepts a connection; UsageError after timeout.

    jax.distributed.initialize aborts the process (no exception) when the coordinator never
    answers, so a non-zero process checks reachability itself first, within the same timeout.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(
                (host, port), timeout=max(0.1, min(2.0, deadline - time.monotonic()))
            ):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise UsageError(
                    f"coordinator {host}:{port} unreachable after {timeout} s ({e.strerror or e}); "
                    "is process 0 running, and is --coordinator_address its address?"
                ) from None
            time.sleep(0.2)


def init_distributed() -> None:
    """jax.distributed.initialize from the flags (a no-op without any of them)."""
    explicit = [FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id]
    if not FLAGS.distributed and all(v is None for v in explicit):
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU hosts; other backends ignore it
    if any(v is not None for v in explicit):
        if any(v is None for v in explicit):
            raise UsageError("--coordinator_address, --num_processes and --process_id go together")
        if FLAGS.process_id >= FLAGS.num_processes:
            raise UsageError(
                f"--process_id={FLAGS.process_id} must be below --num_processes={FLAGS.num_processes}"
            )
        host, port = _parse_address(FLAGS.coordinator_address)
        if FLAGS.process_id != 0:
            _wait_for_coordinator(host, port, FLAGS.initialization_timeout)
    jax.distributed.initialize(
        coordinator_address=FLAGS.coordinator_address,
        num_processes=FLAGS.num_processes,
        process_id=FLAGS.process_id,
        initialization_timeout=FLAGS.initialization_timeout,
    )
