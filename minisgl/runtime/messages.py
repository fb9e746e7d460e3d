"""TEMPORARY shim (api branch): replaced by the runtime branch at merge."""

from minisgl.message import *  # noqa: F403
