"""One thin adapter per wire format. Each declares only its own wire fields, maps them to the
internal request (minisgl.api.request) through one alias table, renders the pipeline's events
in its wire format and owns its error shape; none talks to ZeroMQ."""
