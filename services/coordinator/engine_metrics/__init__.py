"""The engines' own Prometheus metrics, scraped by the Coordinator and aggregated by meaning
(docs/engine-metrics.md): :mod:`.collector` scrapes every endpoint of the table off the request
path, :mod:`.rules` says how each series combines, :mod:`.aggregate` groups them into a view,
:mod:`.exposition` writes the Prometheus text, OTLP JSON and protobuf forms, and
:mod:`.source` serves them (cached per collection round) to the HTTP handler and the gRPC
service, in this process or, with inference workers, from the file the collector writes."""
