"""Admission of inference requests: tenants and their keys, rate limits, priority classes and
fair queueing (docs/admission.md)."""
