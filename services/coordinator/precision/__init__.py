"""Precision detection: shadow samples of each PD group's output, a checker for garbled answers,
a probe question to confirm, and precision alarms reported to the Controller
(docs/architecture.md, "Precision detection")."""
