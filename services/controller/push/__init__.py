"""Keeping every Coordinator's instance table in step: the pusher (``pusher``), the stream that
tells when a Coordinator needs a full set (``watch``), and the configured Coordinator addresses
resolved from DNS (``coordinator_set``)."""
