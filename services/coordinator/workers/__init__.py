"""Inference workers (``coordinator.workers`` > 1): the ZeroMQ layer between the management
process and its worker processes, and the supervision of those processes.

- :mod:`.codec`: the bytes on the wire (table snapshots, loads, precision samples).
- :mod:`.hub`: the management side (:class:`~.hub.WorkerHub`).
- :mod:`.link`: the worker side (:class:`~.link.WorkerLink`).
- :mod:`.procs`: starting, watching and restarting the worker processes
  (:class:`~.procs.WorkerSupervisor`).

Nothing is imported here on purpose: :mod:`.procs` runs before any gRPC object exists and must
not pull in grpc by way of this package (the hub and the codec reach the routing table, which
does).
"""
