"""TEMPORARY shim (api branch): replaced by the runtime branch at merge."""

from minisgl.server.model_names import accepted_model_names, served_model_name  # noqa: F401
