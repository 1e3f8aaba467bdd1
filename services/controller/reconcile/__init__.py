"""Level-triggered reconciles, after Kubernetes' controller-runtime: the rate-limited work queue
(``workqueue``), the runner that drains it into a reconcile function (``runner``), and the two
loops built on them: instances (``instances``) and assembly (``assembler``)."""
