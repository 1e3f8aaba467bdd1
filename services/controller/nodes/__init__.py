"""The NodeManager side of the Controller: registrations (``registration``) and the pending
assemblies they fill (``pending``), the heartbeat streams (``heartbeats``) and their sessions
(``sessions``), the clock silence is measured on (``liveclock``), and the calls the Controller
makes to NodeManagers (``client``)."""
