"""The planner: it measures each role's load and latency, learns what one instance serves at the
latency targets, decides the prefill:decode split of the pool (``planner``, on signals read from
the Coordinators: ``signals``, with the pure model in ``model``), and carries a decision out by
switching instances' roles in place (``switches``)."""
