"""Start or join the Ray cluster a job runs on (``jobs/ray_executor.py``).

Without an address (``--address``, else ``$RAY_ADDRESS``) a new local instance is started,
sized for the run; ``ray.init()``'s own default would instead join the last cluster ``ray
start`` made on this machine. With one, a TCP check comes first, so a wrong host or port
fails in seconds, and Ray's failures to join become ``ConfigError`` messages that say what
to do.
"""

from __future__ import annotations

import math
import os
import signal
import socket
import threading
from typing import Any

from vlmbatch.common.children import RAY_SETUP_HOOK, search_path
from vlmbatch.engine.config import ConfigError
from vlmbatch.jobs.config import RayOptions


def init_ray(ray: Any, opts: RayOptions) -> None:
    """Join ``opts.address`` (else ``$RAY_ADDRESS``), or start a new local Ray instance sized
    for this run; never join a cluster by accident (``ray.init()``'s own default joins the
    last one ``ray start`` made on this machine). A cluster that cannot be reached or joined
    is a ``ConfigError`` naming the address, not a traceback."""
    cpus = opts.preprocess_workers + opts.model_workers * opts.model_cpus
    # the workers import this vlmbatch, not one in the driver's working directory (which Ray
    # puts first on their sys.path): common/children.py
    runtime_env = {"env_vars": {"PYTHONPATH": search_path()},
                   "worker_process_setup_hook": RAY_SETUP_HOOK}
    address = opts.address or os.environ.get("RAY_ADDRESS") or None
    named = f"--address {opts.address}" if opts.address else f"RAY_ADDRESS={address}"
    if address:
        check_reachable(address, named)
    ours = signal.getsignal(signal.SIGTERM)
    try:
        ray.init(address=address or "local", num_cpus=None if address else math.ceil(cpus),
                 include_dashboard=False, log_to_driver=False, runtime_env=runtime_env)
    except (ConnectionError, RuntimeError, ValueError, ray.exceptions.RayError) as e:
        if not address:
            raise
        raise ConfigError(f"{named}: could not join the Ray cluster: {_join_hint(e)}") from None
    except SystemExit as e:  # a SIGTERM while Ray starts, through Ray's handler: ours decides
        if e.code == signal.SIGTERM and callable(ours):
            ours(signal.SIGTERM, None)
        raise
    finally:
        # ray.init replaces the SIGTERM handler with sys.exit(15); the CLI's own one ends the
        # run as Ctrl-C does (exit 143, job marked interrupted), so it is put back
        if callable(ours) and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, ours)


def _join_hint(e: BaseException) -> str:
    """What to tell the user about a failed ``ray.init(address=...)``: Ray's own words (the
    first line of the exception), or the fix for the two causes we can recognise."""
    chain: list[str] = []
    cause: BaseException | None = e
    while cause is not None and len(chain) < 5:
        chain.append(str(cause))
        cause = cause.__cause__ or cause.__context__
    text = " ".join(chain)
    if "ray[client]" in text:
        return "ray:// addresses need Ray Client: pip install 'ray[client]'"
    if "Initialization failure from server" in text:
        return _client_server_hint(str(e))
    token = ("RAY_AUTH_MODE=token here and the cluster's token (~/.ray/auth_token, "
             "RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH)")
    if "token" in text.lower() and "uthentica" in text:
        return f"token authentication failed: the driver needs {token}"
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if "timeout" in text.lower() and os.environ.get("RAY_AUTH_MODE") != "token":
        return f"{first} (if the cluster uses token authentication: {token})"
    return first


# Ray's Ray Client server (ray/util/client/server/proxier.py) starts one server process per
# driver and waits this long (head-side environment variable, seconds) for its gRPC port
CLIENT_WAIT_ENV, CLIENT_WAIT_DEFAULT_S = "RAY_CLIENT_SERVER_CHECK_CHANNEL_TIMEOUT_S", 30


def _client_server_hint(message: str) -> str:
    """A ray:// join that the head's Ray Client server refused: the server's own reason (the
    last line of the traceback it sent back), and for the two causes we know (the server
    process for this driver did not start in time, or died as it started) what to change on
    the head."""
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    reason = lines[-1] if len(lines) > 1 else "no reason given"
    hint = f"the head's Ray Client server refused this driver: {reason}"
    if "Proxy failed to Connect to backend" in message:
        hint += (f" (its server process for this driver did not listen within "
                 f"{CLIENT_WAIT_ENV}, {CLIENT_WAIT_DEFAULT_S} s unless set on the head: on a "
                 f"loaded head start Ray with a longer wait, e.g. {CLIENT_WAIT_ENV}=120 ray "
                 "start --head ..., or join by the GCS address HOST:PORT from a node of the "
                 "cluster)")
    elif "Starting Ray client server failed" in message or "ZombieProcess" in message:
        hint += (" (its server process for this driver died as it started, a fork of the "
                 "head's gRPC server crashing: start the head with GRPC_ENABLE_FORK_SUPPORT=0 "
                 "ray start --head ..., or join by the GCS address HOST:PORT from a node of "
                 "the cluster)")
    return hint


def check_reachable(address: str, named: str, timeout_s: float = 5.0) -> None:
    """A TCP connection to ``host:port`` or ``ray://host:port`` within ``timeout_s``, so a
    wrong address fails in seconds instead of after Ray's own retries (minutes). ``auto`` and
    other forms without a port are left to Ray."""
    hostport = address.removeprefix("ray://")
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit() or not host:
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ConfigError(f"{named}: cannot reach {host}:{port} "
                          f"({e.strerror or e}); is the Ray head running there (`ray start "
                          "--head`) and the port open?") from None
