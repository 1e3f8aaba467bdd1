"""High availability on etcd: the leader election (``election``), what a standby answers
(``standby``), and the wiring of a Controller that leads or waits to (``ha``)."""
