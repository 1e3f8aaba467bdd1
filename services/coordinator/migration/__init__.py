"""Continuing a request on another instance when the engine answering it fails or is drained
(docs/migration.md)."""
