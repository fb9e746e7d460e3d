"""TEMPORARY shim (api branch): replaced by the runtime branch at merge."""
