"""TEMPORARY shim (api branch): replaced by the runtime branch at merge."""

from minisgl.server.process import BACKEND_FAILED_SIGNAL, ChildStartupError  # noqa: F401
