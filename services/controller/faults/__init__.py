"""Fault recovery: the fault manager that gives each instance its fault level and the one strategy
it runs (``manager``), the strategies themselves (``strategies``: engine relaunch, terminate), and
the recovery service behind TerminateInstance and precision alarms (``recovery``)."""
