"""The controller tests that start real processes (Motor's services, etcd, Alertmanager): the e2e
tier (tests/conftest.py); `make test-fast` leaves them out."""
