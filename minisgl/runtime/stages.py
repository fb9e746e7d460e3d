"""Start-up stages, logged as each begins and with its duration: a cold start takes a minute on
a small CPU, and a minute of silence looks like a hang."""

import contextlib
import logging
import time
from collections.abc import Iterator

logger = logging.getLogger("minisgl.startup")


@contextlib.contextmanager
def stage(what: str) -> Iterator[None]:
    logger.info("%s ...", what)
    start_s = time.perf_counter()
    yield
    logger.info("%s: done in %.1f s", what, time.perf_counter() - start_s)
