"""serve's stop: a SIGTERM that comes before uvicorn listens for signals (while the embedded S3
starts or the app is built) still stops it gracefully, instead of being lost."""

from __future__ import annotations

import os
import signal
import threading

from fastapi import FastAPI

from hyperpod_sim.serve import process as serving


def test_a_stop_asked_before_uvicorn_listens_is_not_lost() -> None:
    with serving.StopSignals() as early, serving.bind("127.0.0.1", 0) as listener:
        os.kill(os.getpid(), signal.SIGTERM)  # recorded: this process goes on
        assert early.stop_asked
        # A watchdog for the old behaviour (uvicorn serving on, deaf to the lost signal): it
        # stops the server itself, and the test then fails on what it had to do.
        rescued = threading.Event()

        def rescue() -> None:
            rescued.set()
            os.kill(os.getpid(), signal.SIGINT)

        watchdog = threading.Timer(60, rescue)
        watchdog.start()
        try:
            serving.run(FastAPI(), listener=listener, log_level="warning", early=early)
        finally:
            watchdog.cancel()
    assert not rescued.is_set(), "the early SIGTERM was lost: serve kept serving"
